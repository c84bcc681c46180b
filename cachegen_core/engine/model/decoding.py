"""How one request picks its next tokens, outside transformers' ``generate``: its settings, its processors, its stops.

A request's generation keywords (transformers' names, plus ``stop`` and ``seed``: what ``hf.generate`` takes) become
a :class:`Decoding`: the generation config transformers would use (the model's own ``generation_config`` under the
request's keywords, greedy unless they sample), the logits processors ``generate`` would build from it (temperature,
top-k, top-p, repetition penalty, minimum length...: transformers' own classes, applied to this request's scores
alone), its end-of-sequence tokens, its stop strings and a random generator of its own (seeded by ``seed``, else
drawn from torch's global generator when the request is made, so ``torch.manual_seed`` before a request makes it
repeatable). So a request samples the same tokens whichever requests it is batched with. Settings that need
``generate`` itself (beam search, assisted decoding, classifier-free guidance...) are refused with the reason
(:func:`unsupported`): the engine answers those requests one at a time through ``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: New tokens generated when the caller names no limit (``hf.DEFAULT_MAX_NEW_TOKENS``).
DEFAULT_MAX_NEW_TOKENS = 64
#: The keywords a request's decoding reads itself; the others go to transformers' generation config.
_OWN = ("stop", "seed", "stopping_criteria", "logits_processor")


@dataclass(eq=False)
class Decoding:
    """One request's next-token choice: ``processors`` (transformers' ``LogitsProcessorList``, empty for plain greedy
    decoding), ``sample`` (multinomial sampling with ``generator``, else argmax), ``eos`` (ids that end it),
    ``max_new_tokens``, ``stops`` (strings after which it ends) and ``criteria`` (callables ``(ids, scores) -> bool
    tensor``: the caller's ``stopping_criteria`` and the stop strings' check)."""

    max_new_tokens: int
    sample: bool = False
    processors: Any = None
    generator: torch.Generator | None = None
    eos: frozenset[int] = frozenset()
    stops: tuple[str, ...] = ()
    criteria: list[Any] = field(default_factory=list)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: the next token of many such requests is one op."""
        return not self.sample and not self.processors

    def choose(self, ids: torch.Tensor, logits: torch.Tensor) -> int:
        """The next token after ``ids`` (1, n) (prompt and tokens so far) from this request's ``logits`` (vocab,)."""
        scores = logits[None]
        if self.processors:
            scores = self.processors(ids, scores)
        if not self.sample:
            return int(scores.argmax(-1))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def stopped(self, ids: torch.Tensor) -> bool:
        """Whether a criterion (a stop string, the caller's) ends the request after ``ids`` (1, n)."""
        return any(bool(c(ids, None).any()) for c in self.criteria)


def split_kwargs(generation_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformers' generation settings, the engine's own: ``stop``, ``seed``, ``stopping_criteria``, ``logits_processor``)."""
    own = {k: generation_kwargs[k] for k in _OWN if k in generation_kwargs}
    return {k: v for k, v in generation_kwargs.items() if k not in _OWN}, own


def generation_config(model: Any, settings: dict[str, Any]) -> Any:
    """The generation config ``generate`` would run with: the model's own, under ``settings`` (greedy unless they say
    otherwise, ``DEFAULT_MAX_NEW_TOKENS`` new tokens), special tokens prepared."""
    settings = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "do_sample": False, **settings}
    config, unused = model._prepare_generation_config(None, **settings)
    if unused:
        raise TypeError(f"generation keyword(s) {sorted(unused)} are not generation settings")
    model._prepare_special_tokens(config, True, device=model.device)
    return config


def unsupported(model: Any, config: Any, processors: Any = None) -> str | None:
    """Why a request of ``config`` cannot be decoded step by step beside others (None: it can)."""
    from transformers.generation.configuration_utils import GenerationMode  # noqa: PLC0415

    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value} needs transformers' generate"
    if (config.num_return_sequences or 1) > 1:
        return "several sequences per prompt need transformers' generate"
    names = {type(p).__name__ for p in processors or ()}
    if "UnbatchedClassifierFreeGuidanceLogitsProcessor" in names:
        return "classifier-free guidance runs the model itself"
    return None


def decoding(model: Any, tokenizer: Any, prompt_tokens: int, generation_kwargs: dict[str, Any]) -> Decoding | str:
    """The :class:`Decoding` of a request of ``prompt_tokens`` tokens, or why it needs ``generate`` (a string)."""
    from .hf import stop_criterion  # noqa: PLC0415

    settings, own = split_kwargs(generation_kwargs)
    config = generation_config(model, settings)
    from transformers import LogitsProcessorList  # noqa: PLC0415

    user = LogitsProcessorList(own.get("logits_processor") or [])
    processors = model._get_logits_processor(config, input_ids_seq_length=prompt_tokens, logits_processor=user, device=model.device)
    why = unsupported(model, config, processors)
    if why is not None:
        return why
    eos = config.eos_token_id
    eos_ids = frozenset(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [int(eos)])
    stops = tuple(s for s in own.get("stop") or [] if s)
    criteria = list(own.get("stopping_criteria") or [])
    if stops:
        criteria.append(stop_criterion(tokenizer, stops, prompt_tokens))
    generator = None
    if config.do_sample:
        generator = torch.Generator(device=model.device)
        seed = own.get("seed")
        generator.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,))))
    return Decoding(int(config.max_new_tokens), bool(config.do_sample), processors, generator, eos_ids, stops, criteria)


def first_stop(text: str, stops: Sequence[str]) -> str | None:
    """The stop string that appears first in ``text`` (None: none does)."""
    return min(((text.find(s), s) for s in stops if s in text), default=(-1, None))[1]
