"""LangChain's generation parameters, as transformers' ``generate`` reads them, and the checks of every keyword.

``CacheGenLLM`` and ``ChatCacheGen`` take, at construction (fields), per call and through ``bind``, the
parameters other LangChain chat models and LLMs take, with the same meaning: ``max_tokens`` (new tokens at
most), ``temperature`` (``0`` or ``None``: greedy decoding; ``> 0``: sampling at that temperature), ``top_p``
and ``top_k`` (nucleus and top-k sampling; given without a temperature they sample at temperature 1, as a
hosted model whose default temperature is 1 does), ``seed`` (a sampled answer is the same for the same seed
and prompt) and ``stop``. A call's value overrides a field's, a field's overrides ``generation_kwargs``
(transformers' names, checked when given: :func:`check_generation_kwargs`). Per call, transformers' own
``max_new_tokens`` and ``do_sample`` are accepted too. Any other keyword is a ``TypeError`` naming the
accepted ones: transformers would otherwise reject it deep in ``generate``, or ignore it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

from pydantic import BaseModel

#: LangChain's generation fields: both classes take them at construction, with their per-call meaning.
FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
#: The generation keywords a call (or ``bind``) may pass.
ACCEPTED = (*FIELDS, "max_new_tokens", "do_sample")
_SAMPLING = ("temperature", "top_p", "top_k")


class GenerationFields(BaseModel):
    """LangChain's generation parameters as a model's fields (``CacheGenLLM``'s, ``ChatCacheGen``'s): what they
    mean per call; ``None`` leaves the setting below them (a chat's LLM, then ``generation_kwargs``)."""

    max_tokens: int | None = None
    """New tokens per answer (256 by default)."""
    temperature: float | None = None
    """Sampling temperature; ``0``: greedy decoding (the default)."""
    top_p: float | None = None
    """Nucleus sampling's probability mass (samples, at temperature 1 unless one is set)."""
    top_k: int | None = None
    """Top-k sampling's candidates (samples, at temperature 1 unless one is set)."""
    seed: int | None = None
    """Random seed of sampling: the same seed and prompt give the same answer."""
    stop: list[str] | None = None
    """Stop sequences: the answer ends before the first one it writes (a call's ``stop`` replaces them)."""

    def generation_fields(self) -> dict[str, Any]:
        """The fields' values (``None`` where unset)."""
        return {k: getattr(self, k) for k in FIELDS}


#: ``generate`` arguments the engine sets itself, or that would be silently overridden: why each is refused.
_REFUSED = {
    "max_length": "it counts the prompt too and max_new_tokens (always set) overrides it: use max_new_tokens",
    "stop_strings": "use stop (LangChain's stop sequences, cut from the answer)",
    "streamer": "use stream()/astream()",
    "return_dict_in_generate": "the engine sets it",
    "num_return_sequences": "one answer per prompt: use batch() or n calls with different seeds",
}
_ENGINE_ONLY = ("stop", "seed")  # not transformers' names: the engine reads them (``hf.generate``)


@cache
def generate_arguments() -> frozenset[str]:
    """The names ``generation_kwargs`` may hold: ``GenerationConfig``'s settings and ``generate``'s own keyword
    arguments, less those the engine sets (:data:`_REFUSED`), plus ``stop`` and ``seed``."""
    from transformers import GenerationConfig  # noqa: PLC0415
    from transformers.generation.utils import GenerationMixin  # noqa: PLC0415

    names = {k for k in GenerationConfig().to_dict() if not k.startswith("_") and k != "transformers_version"}
    params = inspect.signature(GenerationMixin.generate).parameters.values()
    names |= {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("self", "inputs", "generation_config")}
    return frozenset(names - set(_REFUSED)) | frozenset(_ENGINE_ONLY)


def unknown_keywords(owner: str, unknown: list[str], accepted: Sequence[str], hints: Mapping[str, str] = {},
                     accepted_text: str | None = None) -> TypeError:  # fmt: skip
    """A ``TypeError`` naming the ``unknown`` keywords (with a hint, or the closest accepted name, for each) and
    the ``accepted`` ones (or ``accepted_text``, where they are too many to list)."""
    why = []
    for k in unknown:
        close = difflib.get_close_matches(k, accepted, n=1)
        why.append(f"{k!r}: {hints[k]}" if k in hints else f"{k!r} (did you mean {close[0]!r}?)" if close else repr(k))
    return TypeError(f"{owner} got unexpected keyword argument(s) {'; '.join(why)}. Accepted: {accepted_text or ', '.join(accepted)}")


#: Why a keyword other LangChain integrations take is refused at construction.
CONSTRUCTION_HINTS = {
    "pipeline_kwargs": "HuggingFacePipeline's option: pass transformers' generate arguments as generation_kwargs (e.g. "
    "generation_kwargs={'max_new_tokens': 128}), or LangChain's max_tokens, temperature, top_p, top_k, seed, stop",
    "max_new_tokens": "transformers' name: use max_tokens (or generation_kwargs={'max_new_tokens': ...})",
    "do_sample": "temperature > 0 (or top_p, top_k) samples, temperature=0 is greedy; or generation_kwargs={'do_sample': ...}",
    "task": "HuggingFacePipeline's option: CacheGen generates text, nothing else to choose",
}


def refuse_unknown(owner: str, given: Mapping[str, Any], accepted: list[str], hints: Mapping[str, str] = {}) -> None:
    """Raise ``TypeError`` when ``given`` (construction keywords) holds a name not in ``accepted``."""
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise unknown_keywords(owner, unknown, sorted(accepted), {**CONSTRUCTION_HINTS, **hints})


def check_keywords(kwargs: Mapping[str, Any], owner: str) -> None:
    """Raise ``TypeError`` naming the accepted keywords when ``kwargs`` (a call's) holds another."""
    unknown = sorted(set(kwargs) - set(ACCEPTED))
    if unknown:
        raise TypeError(f"{owner} got unexpected generation keyword(s) {unknown}; accepted: {', '.join(ACCEPTED)}")


def check_generation_kwargs(kwargs: Mapping[str, Any], owner: str) -> None:
    """Raise, when ``generation_kwargs`` are given, what ``generate`` would raise (or silently ignore) at the
    first call: ``TypeError`` for a name it does not take, ``ValueError`` for a value out of range."""
    names = generate_arguments()
    unknown = sorted(set(kwargs) - names)
    if unknown:
        hints = {**_REFUSED, "max_tokens": "generation_kwargs takes transformers' names: max_new_tokens (or the max_tokens field)"}
        text = (
            "the settings of transformers' GenerationConfig and the arguments of generate() (max_new_tokens, do_sample, "
            "temperature, top_p, top_k, repetition_penalty, ...), and stop and seed"
        )
        raise unknown_keywords(f"{owner}'s generation_kwargs", unknown, sorted(names), hints, text)
    _check_values(dict(kwargs))


def _check_values(gen: Mapping[str, Any]) -> None:
    """``ValueError`` for a generation setting out of range (transformers' names)."""
    n = gen.get("max_new_tokens", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {n!r}")
    if gen.get("temperature") is not None and gen["temperature"] < 0:
        raise ValueError(f"temperature must be >= 0, got {gen['temperature']!r}")
    if gen.get("top_p") is not None and not 0 < gen["top_p"] <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {gen['top_p']!r}")
    if gen.get("top_k") is not None and gen["top_k"] < 1:
        raise ValueError(f"top_k must be >= 1, got {gen['top_k']!r}")


def layered(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """LangChain-named settings, each layer overriding those before it (``None`` leaves a setting;
    ``max_new_tokens`` counts as ``max_tokens``)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for k, v in layer.items():
            if v is not None:
                out["max_tokens" if k == "max_new_tokens" else k] = v
    return out


def to_transformers(defaults: Mapping[str, Any], call: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """``defaults`` (transformers' names, e.g. ``CacheGenLLM.generation_kwargs``) overridden by ``call`` (the
    accepted keywords; ``None`` values leave the default), in transformers' names; ``stop`` and ``seed`` are kept
    for the engine. Sampling settings in either sample unless ``do_sample`` says otherwise, as LangChain means them.
    Raises ``TypeError`` on an unknown keyword, ``ValueError`` on a value out of range."""
    check_keywords(call, owner)
    call = layered(call)
    out = dict(defaults)
    if "do_sample" not in out and any(out.get(k) is not None for k in _SAMPLING):
        out["do_sample"] = out.get("temperature") != 0
    if "max_tokens" in call:
        out["max_new_tokens"] = call.pop("max_tokens")
    _check_values({**out, **call})
    if call.get("temperature", out.get("temperature")) == 0 or call.get("do_sample") is False:  # greedy: sampling settings would only draw warnings
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


__all__ = [
    "ACCEPTED",
    "FIELDS",
    "GenerationFields",
    "check_generation_kwargs",
    "check_keywords",
    "layered",
    "refuse_unknown",
    "to_transformers",
    "unknown_keywords",
]
