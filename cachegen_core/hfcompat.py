"""The name transformers takes a KV cache under: ``cache`` from 5.24 on, ``past_key_values`` before.

5.24 deprecates ``past_key_values`` (a FutureWarning on every call; removed in 5.40) and 5.23 ignores
``cache`` without a word, so the name is read from the model's ``forward`` signature, once per class.
Outputs answer to ``past_key_values`` in both, 5.24 logging a deprecation: :func:`output_cache` reads ``cache``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any


@functools.lru_cache(maxsize=None)
def _name(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def cache_arg(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model(...)`` or ``model.generate(...)``, under the name this transformers reads."""
    return {_name(type(model)): cache}


def output_cache(out: Any) -> Any:
    """The KV cache of a model's (or ``generate``'s) output: ``out.cache`` where it has one (5.24 logs a deprecation
    on ``out.past_key_values``), else ``out.past_key_values``."""
    names = {f.name for f in dataclasses.fields(out)} if dataclasses.is_dataclass(out) else set()
    return out.cache if "cache" in names else out.past_key_values
