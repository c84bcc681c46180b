"""Fitting a model's profile from a few texts: statistics, transform and classes from one pass each.

For each text: a prefill of its first ``tokens`` tokens (in pieces) gives the KV whose covariance
(``kvstats.py``) and symbols (``Profile.fit``: the class of every component) the profile is
fitted from, and one Fisher draw per context length scores the following tokens on a prefix of
that KV. The transform (``transform.fit_transform``) and the classes need no more data than that:
two texts of 4096 tokens fit the reference model in well under a minute of 2 cores
(``docs/results.md``), on the calibration text shipped with the package (``calibration_texts``:
two of the demo transcripts) when no other text is given. ``fit_weights`` measures, in one short
Fisher draw, the step weights a codec without a profile codes with (``weights.py``), and ``weights_by_layer``
scales them by each layer's measured sensitivity (``sensitivity.py``).

``guard`` wraps every model call: an engine fitting in the background passes one that waits for
its requests to finish and holds its model lock.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager

import torch

from ..hfcompat import cache_arg, output_cache
from ..kv import KVCache
from .config import CodecConfig
from .kvstats import KVStats
from .profile import Profile
from .rotary import RotarySpec
from .sensitivity import layer_multipliers, layer_sensitivity
from .transform import Transform, fit_transform, identity_transform, scale_layers
from .weights import step_weights

#: The calibration text shipped with the package (two of the demo transcripts; see its README).
CALIBRATION = Path(__file__).resolve().parent.parent / "profiles" / "calibration.jsonl"


def calibration_texts(path: str | Path = CALIBRATION, field: str = "prompt") -> list[str]:
    """The texts of a JSON-lines file (default: the shipped calibration text)."""
    with open(path) as f:
        return [json.loads(line)[field] for line in f if line.strip()]


@dataclass(frozen=True)
class FitPlan:
    """How much a fit reads: ``texts`` texts of up to ``tokens`` tokens (covariance and classes), and
    one Fisher draw per context length of ``contexts`` that a text is long enough for, scoring the
    next ``continuation`` tokens. A text is prefilled ``piece_tokens`` at a time (one model call
    each: a background fit holds the model for no longer). With ``layer_power`` > 0 the first
    ``sensitivity_texts`` of them also measure each (kind, layer)'s sensitivity (``sensitivity.py``): on
    the first context of ``contexts``, each layer alone coded at ``sensitivity_step``, the next
    ``sensitivity_tokens`` tokens scored (one forward pass per kind and layer); the transform then scales
    each layer's step by it to the power ``-layer_power / 2``. Blobs and decoders do not change: only
    the profile's transform. The defaults are the fast fit (``docs/results.md``)."""

    texts: int = 2
    tokens: int = 4096
    contexts: tuple[int, ...] = (1536,)
    continuation: int = 256
    chunk_tokens: int = 1536
    piece_tokens: int = 1024
    seed: int = 0
    layer_power: float = 0.0
    sensitivity_texts: int = 1
    sensitivity_tokens: int = 128
    sensitivity_step: float = 0.16

    def __post_init__(self) -> None:
        if not 0 <= self.layer_power < float("inf") or not 0 < self.sensitivity_step < float("inf"):
            raise ValueError("layer_power must be >= 0 and sensitivity_step > 0")
        if self.sensitivity_texts < 0 or self.sensitivity_tokens < 2:
            raise ValueError("sensitivity_texts must be >= 0 and sensitivity_tokens >= 2")


def fit_profile(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str] | None = None,
    config: CodecConfig | None = None,
    *,
    plan: FitPlan = FitPlan(),
    fingerprint: str = "",
    rotary: RotarySpec | None = None,
    guard: Callable[[], ContextManager[Any]] | None = None,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    source: str = "the calibration text shipped with cachegen_core",
    identity: dict[str, Any] | None = None,
) -> Profile:
    """A profile of ``model`` fitted on ``texts`` (default: ``calibration_texts()``) under ``config``.

    ``rotary``: the model's rotary embedding (keys are coded before it), None for keys as they are.
    ``guard``: a context manager factory every model call runs inside; ``progress``: wraps the text
    loop (a progress bar); ``source``: what the texts are, kept in the profile; ``identity``: the model's
    (``keys.fingerprint.model_identity``), kept too. With ``config.transform == "none"`` only the classes are fitted."""
    config = config or CodecConfig()
    guard = guard or contextlib.nullcontext
    texts = list(texts) if texts is not None else calibration_texts()
    max_tokens = max(plan.tokens, max(plan.contexts, default=0) + plan.continuation)
    ids = [x for x in (tokenizer(t)["input_ids"][:max_tokens] for t in texts) if len(x) > 1][: plan.texts]
    if not ids:
        raise ValueError("fit_profile needs at least one text of two tokens or more")
    device = getattr(model, "device", torch.device("cpu"))
    gen = torch.Generator(device=device).manual_seed(plan.seed)
    caches: list[KVCache] = []
    stats: KVStats | None = None
    for x in progress(ids) if progress is not None else ids:
        kv = _prefill(model, x[: plan.tokens], plan.piece_tokens, guard)
        caches.append(kv)
        if config.transform == "none":
            continue
        if stats is None:
            group = config.head_group(kv.num_kv_heads, kv.head_dim)
            stats = KVStats.empty(kv.num_layers, kv.num_kv_heads, kv.head_dim, group)
        stats.add_covariance(kv, rotary=rotary, chunk_tokens=plan.chunk_tokens, sink_tokens=config.sink_tokens)
        for c in (c for c in plan.contexts if len(x) >= c + plan.continuation and c <= kv.num_tokens):
            if config.transform != "fisher-klt":
                break
            with guard():
                stats.add_fisher(model, kv.slice(0, c).to(device), x[c : c + plan.continuation], rotary=rotary,
                                 sink_tokens=config.sink_tokens, generator=gen)  # fmt: skip
    transform = None
    if stats is not None:
        fisher = stats.fisher if config.transform == "fisher-klt" and stats.fisher_tokens else None
        transform = fit_transform(stats.covariance, fisher, config.fisher_eps, group=stats.group)
        if plan.layer_power > 0:
            transform = _sensitive_layers(model, ids, caches, transform, config, plan, rotary, guard)
    about = {"source": source, "texts": len(ids), "tokens": sum(min(len(x), plan.tokens) for x in ids),
             "fisher_draws": len(stats.contexts) if stats else 0}  # fmt: skip
    if plan.layer_power > 0 and transform is not None:
        about.update(layer_power=plan.layer_power, sensitivity_texts=plan.sensitivity_texts, sensitivity_tokens=plan.sensitivity_tokens)
    return Profile.fit(config, caches, transform=transform, rotary=rotary, chunk_tokens=plan.chunk_tokens,
                       model_fingerprint=fingerprint, about=about, identity=identity)  # fmt: skip


def fit_weights(
    model: Any,
    tokenizer: Any,
    text: str | None = None,
    config: CodecConfig | None = None,
    *,
    rotary: RotarySpec | None = None,
    context: int = 512,
    continuation: int = 128,
    seed: int = 0,
) -> torch.Tensor:
    """Step weights for coding ``model`` without a profile (``weights.py``), from one Fisher draw: the KV of the
    first ``context`` tokens of ``text`` (default: the first shipped calibration text), the next ``continuation``
    tokens scored on it. A forward and a backward pass over ``context + continuation`` tokens: about 3 s for the
    reference model on 2 CPU cores. 128 scored tokens rather than 64: top-1 agreement 0.1-0.3 point higher on
    held-out transcripts at the same bits (``docs/results.md``, "Without a profile"). ``ValueError`` when the
    text is too short to score anything, or is one token repeated (a tokenizer that does not know its words:
    the KV would vary by rounding noise only)."""
    config = config or CodecConfig()
    ids, n = _weights_text(tokenizer, text, config, context, continuation)
    device = getattr(model, "device", torch.device("cpu"))
    kv = _prefill(model, ids[:n], n, contextlib.nullcontext)
    stats = KVStats.empty(kv.num_layers, kv.num_kv_heads, kv.head_dim)
    stats.add_covariance(kv, rotary=rotary, chunk_tokens=n, sink_tokens=config.sink_tokens)
    stats.add_fisher(model, kv.to(device), ids[n:], rotary=rotary, sink_tokens=config.sink_tokens,
                     generator=torch.Generator(device=device).manual_seed(seed))  # fmt: skip
    return step_weights(stats.fisher.diagonal(dim1=-2, dim2=-1), stats.covariance.diagonal(dim1=-2, dim2=-1), config.fisher_eps)


#: The geometric mean of ``weights_by_layer``'s multipliers. 1: about the bits of the weights alone at a lower KL
#: (tuning transcripts: -24 % at the default level, -0.7 % bits); a larger mean trades that back for bits, but on
#: the tuning transcripts 1.1 and 1.2 fell below 99.0 % top-1 (``docs/history/2026-11-28-bits-per-element.md``, 2026-11-29).
LAYER_GAIN = 1.0


def weights_by_layer(
    model: Any,
    tokenizer: Any,
    weights: torch.Tensor,
    text: str | None = None,
    config: CodecConfig | None = None,
    *,
    rotary: RotarySpec | None = None,
    context: int = 512,
    continuation: int = 128,
    level: int = 3,
    power: float = 1.0,
    gain: float = LAYER_GAIN,
    guard: Callable[[], ContextManager[Any]] | None = None,
) -> torch.Tensor:
    """``weights`` (``fit_weights``': per component, within a layer) times a step multiplier per (kind, layer)
    from the layer's measured sensitivity (``sensitivity.layer_sensitivity``: each layer alone coded as a codec
    without a profile codes it at ``level``, the KL of the next ``continuation`` tokens per unit of its weighted
    squared error), to the power ``-power / 2``, their geometric mean ``gain``. The Fisher behind the weights is
    the model's around one layer at a time; the KL across layers, measured, puts the error where the model minds
    it least (values ~3x keys, the first layers several times the last). One forward pass per kind and layer on
    the same text as ``fit_weights`` (``2 x layers + 1`` passes of ``continuation`` tokens after ``context``):
    36 s for the reference model on 2 CPU cores, which is why an engine measures it in the background
    (``engine/profiles.py``). ``guard`` wraps every model call."""
    config = config or CodecConfig()
    guard = guard or contextlib.nullcontext
    ids, n = _weights_text(tokenizer, text, config, context, continuation)
    kv = _prefill(model, ids[:n], n, guard)
    kl, err = layer_sensitivity(model, kv, ids[n:], identity_transform(kv.num_layers, kv.num_kv_heads, kv.head_dim),
                                config.level_step(level, fitted=False, weighted=True), rotary=rotary,
                                sink_tokens=config.sink_tokens, chunk_tokens=n, guard=guard, weights=weights)  # fmt: skip
    return (weights * (gain * layer_multipliers(kl, err, power))[:, :, None, None]).contiguous()


def _weights_text(tokenizer: Any, text: str | None, config: CodecConfig, context: int, continuation: int) -> tuple[list[int], int]:
    """The token ids ``fit_weights`` and ``weights_by_layer`` measure on, and how many of them are the context."""
    text = calibration_texts()[0] if text is None else text
    ids = tokenizer(text)["input_ids"][: context + continuation]
    n = len(ids) - continuation
    if n < config.sink_tokens + 2:
        raise ValueError(f"fit_weights needs a text of at least {config.sink_tokens + 2 + continuation} tokens")
    if len(set(ids)) < 2:
        raise ValueError(f"the text is token {ids[0]} repeated for this tokenizer: nothing to measure the model's sensitivity on")
    return ids, n


def _sensitive_layers(
    model: Any,
    ids: list[list[int]],
    caches: list[KVCache],
    transform: Transform,
    config: CodecConfig,
    plan: FitPlan,
    rotary: RotarySpec | None,
    guard: Callable[[], ContextManager[Any]],
) -> Transform:
    """``transform`` with each (kind, layer) scaled by its measured sensitivity (``sensitivity.py``), measured on the
    first ``plan.sensitivity_texts`` texts long enough for a context of ``plan.contexts[0]`` tokens and its continuation."""
    kl = err = None
    c, n = plan.contexts[0] if plan.contexts else plan.chunk_tokens, plan.sensitivity_tokens
    used = [(x, kv) for x, kv in zip(ids, caches) if len(x) >= c + n and kv.num_tokens >= c][: plan.sensitivity_texts]
    for x, kv in used:
        k, e = layer_sensitivity(model, kv.slice(0, c), x[c : c + n], transform, plan.sensitivity_step,
                                 rotary=rotary, sink_tokens=config.sink_tokens, chunk_tokens=plan.chunk_tokens, guard=guard)  # fmt: skip
        kl, err = (k, e) if kl is None else (kl + k, err + e)
    return transform if kl is None else scale_layers(transform, layer_multipliers(kl, err, plan.layer_power))


def _prefill(model: Any, ids: list[int], piece: int, guard: Callable[[], ContextManager[Any]]) -> KVCache:
    """The KV of ``ids`` on the CPU, computed ``piece`` tokens per model call (each inside ``guard``)."""
    from transformers import DynamicCache  # noqa: PLC0415

    cache = DynamicCache()  # plain cache layers: every token, sliding-window models too
    device = getattr(model, "device", torch.device("cpu"))
    # no logits but the last token's where the model can skip them (a 7B model's vocabulary projection over a piece of
    # 1024 tokens is 4x its MLP's work, for nothing)
    skip = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    for s in range(0, len(ids), max(piece, 1)):
        with guard(), torch.no_grad():
            out = model(torch.tensor([ids[s : s + piece]], device=device), use_cache=True, **cache_arg(model, cache), **skip)
            cache = output_cache(out)
    return KVCache.from_dynamic_cache(cache).to("cpu")
