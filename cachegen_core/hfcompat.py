"""The name transformers takes a KV cache under: ``cache`` from 5.24 on, ``past_key_values`` before.

5.24 deprecates ``past_key_values`` (a FutureWarning on every call; removed in 5.40) and 5.23 ignores
``cache`` without a word, so the name is read from the model's ``forward`` signature, once per class.
Outputs still answer to ``past_key_values`` in both.
"""

from __future__ import annotations

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
