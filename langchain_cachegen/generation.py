"""LangChain's generation parameters, as transformers' ``generate`` reads them.

``CacheGenLLM`` and ``ChatCacheGen`` take, per call and through ``bind``, the parameters other
LangChain chat models and LLMs take, with the same meaning: ``max_tokens`` (new tokens at most),
``temperature`` (``0`` or ``None``: greedy decoding; ``> 0``: sampling at that temperature),
``top_p`` and ``top_k`` (nucleus and top-k sampling; given without a temperature they sample at
temperature 1, as a hosted model whose default temperature is 1 does), ``seed`` (a sampled answer
is the same for the same seed and prompt) and ``stop``. transformers' own ``max_new_tokens`` and
``do_sample`` are accepted too. Any other keyword is a ``TypeError`` naming the accepted ones:
transformers would otherwise reject it deep in ``generate``, or ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The generation keywords a call (or ``bind``) may pass.
ACCEPTED = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "max_new_tokens", "do_sample")
_SAMPLING = ("temperature", "top_p", "top_k")


def check_keywords(kwargs: Mapping[str, Any], owner: str) -> None:
    """Raise ``TypeError`` naming the accepted keywords when ``kwargs`` holds another."""
    unknown = sorted(set(kwargs) - set(ACCEPTED))
    if unknown:
        raise TypeError(f"{owner} got unexpected generation keyword(s) {unknown}; accepted: {', '.join(ACCEPTED)}")


def to_transformers(defaults: Mapping[str, Any], call: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``defaults`` (transformers' names, e.g. ``CacheGenLLM.generation_kwargs``) overridden by ``call`` (the
    accepted keywords; ``None`` values leave the default), in transformers' names; ``stop`` and ``seed`` are kept
    for the engine. Raises ``TypeError`` on an unknown keyword, ``ValueError`` on a value out of range."""
    check_keywords(call, owner)
    call = {k: v for k, v in call.items() if v is not None}
    out = dict(defaults)
    if "max_tokens" in call:
        out["max_new_tokens"] = call.pop("max_tokens")
    if "max_new_tokens" in call:
        out["max_new_tokens"] = call.pop("max_new_tokens")
    if not isinstance(out.get("max_new_tokens", 1), int) or out.get("max_new_tokens", 1) < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {out['max_new_tokens']!r}")
    temperature = call.get("temperature")
    if temperature is not None and temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if "top_p" in call and not 0 < call["top_p"] <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {call['top_p']!r}")
    if "top_k" in call and call["top_k"] < 1:
        raise ValueError(f"top_k must be >= 1, got {call['top_k']!r}")
    if temperature == 0 or call.get("do_sample") is False:  # greedy: sampling settings would only draw warnings
        for k in _SAMPLING:
            out.pop(k, None)
            call.pop(k, None)
        out["do_sample"] = False
    elif any(k in call for k in _SAMPLING) and "do_sample" not in call:
        out["do_sample"] = True
    out.update(call)
    if not out.get("do_sample"):
        for k in _SAMPLING:
            out.pop(k, None)
    return out


__all__ = ["ACCEPTED", "check_keywords", "to_transformers"]
