"""How many positions a model attends over, and the check that a request fits in them.

A request reads ``prompt tokens + max_new_tokens - 1`` positions: the prompt's and every new
token's but the last, which is sampled and never read back (as transformers counts when it warns
past ``max_position_embeddings``), whether or not generation stops sooner. Past the model's range a
rotary model extrapolates (its answers degrade, silently) and a model with learned positions (GPT-2)
fails inside ``torch``; the engine refuses such a request up front with a ``ValueError`` naming
both numbers.

The range (:func:`position_limit`) is the config's ``max_position_embeddings``, unless its rotary
scaling extends it: with a ``factor`` and the pretraining length (``original_max_position_embeddings``,
given, or for ``dynamic``, ``yarn``, ``longrope`` and ``llama3`` scaling taken as
``max_position_embeddings`` itself, as transformers takes it) it is ``factor x`` that length when larger.
So a Qwen2.5 config given ``yarn`` with factor 4 reaches 4 x 32,768 positions, Llama 3.1 keeps its
131,072 (its 8,192 x 8 is smaller), and a ``linear`` config without a pretraining length keeps the
``max_position_embeddings`` it states (such configs state the extended length). A model whose config
names no range is not checked.
"""

from __future__ import annotations

from typing import Any

#: Rotary scalings whose pretraining length defaults to ``max_position_embeddings`` (``transformers``' rule).
_EXTENDING = ("dynamic", "yarn", "longrope", "llama3")


def _rope_parameters(config: Any) -> list[dict[str, Any]]:
    """The config's rotary parameters: one dict, or one per layer type (transformers 5 ``rope_parameters``, 4 ``rope_scaling``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    nested = [p for p in params.values() if isinstance(p, dict)]
    return nested if nested and len(nested) == len(params) else [params]


def position_limit(config: Any) -> int | None:
    """The positions the model attends over (see the module doc); None when its config names none."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
        return None
    best = limit
    for rope in _rope_parameters(config):
        kind, factor = rope.get("rope_type", rope.get("type", "default")), rope.get("factor")
        original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        if kind in _EXTENDING:
            original = original or limit
        if kind != "default" and isinstance(factor, (int, float)) and factor > 1 and isinstance(original, int):
            best = max(best, int(factor * original))
    return best


def positions_needed(prompt_tokens: int, new_tokens: int) -> int:
    """The positions a request reads: the prompt's and every new token's but the last (sampled, never read back)."""
    return prompt_tokens + max(0, new_tokens - 1)


def check_positions(limit: int | None, prompt_tokens: int, new_tokens: int) -> None:
    """``ValueError`` when a request of ``prompt_tokens`` and up to ``new_tokens`` new ones needs more positions
    than ``limit`` (None: no limit)."""
    needed = positions_needed(prompt_tokens, new_tokens)
    if limit is None or needed <= limit:
        return
    asked = f"the prompt's {prompt_tokens} tokens" + (f" and max_new_tokens={new_tokens}" if new_tokens else "")
    raise ValueError(f"{asked} need {needed} positions, the model has {limit}: shorten the prompt"
                     f"{' or ask for fewer new tokens' if new_tokens else ''} (docs/models.md, 'Prompt length')")  # fmt: skip
