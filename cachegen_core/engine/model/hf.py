"""The transformers side of the engine: prefill, generation on top of a reused KV, stop strings, timing.

Plain functions over a Hugging Face causal LM and its tokenizer; the engine serialises
calls to the model. Stop strings use transformers' own ``StopStringCriteria`` where it
understands the tokenizer (every subword tokenizer), and a decoded-text check otherwise.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ...errors import CacheGenError
from ...hfcompat import cache_arg, output_cache
from ...kv import KVCache, KVShapeError


#: New tokens generated when the caller names no limit.
DEFAULT_MAX_NEW_TOKENS = 64


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """A model config's (layers, KV heads, head dim)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, heads, head_dim


def model_dtype(model: Any) -> torch.dtype:
    """The dtype the model computes (and caches) in."""
    return next(model.parameters()).dtype


class _InPlaceLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of a buffer with spare capacity.

    transformers' ``DynamicLayer`` appends with ``torch.cat``, copying the whole cache of the
    layer at every forward: for a long reused context that is the cost of the question's
    prefill and of every generated token. Here new tokens are written into the buffer in
    place; past its capacity the layer falls back to concatenating.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = keys  # (1, heads, capacity, head_dim)
        self._vbuf: torch.Tensor | None = values
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys[:, :, :filled], values[:, :, :filled]
        self._mine = self.keys  # the view this layer set: anything else means transformers replaced it

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if self._kbuf is None or self._vbuf is None or n + m > self._kbuf.shape[-2] or self.keys is not self._mine:
            self._kbuf = self._vbuf = None  # out of room (or cropped, reset...): plain concatenation from now on
            return super().update(key_states, value_states, *args, **kwargs)
        self._kbuf[:, :, n : n + m].copy_(key_states)
        self._vbuf[:, :, n : n + m].copy_(value_states)
        self.keys, self.values = self._kbuf[:, :, : n + m], self._vbuf[:, :, : n + m]
        self._mine = self.keys
        return self.keys, self.values


class _InPlaceSlidingLayer(_InPlaceLayer):
    """A sliding-window layer on a buffer: every token kept in place (the engine stores them all), but attention
    given what transformers' ``DynamicSlidingWindowLayer`` gives it, the last ``sliding_window - 1`` cached tokens
    and the new ones (views, no copy), with the same mask sizes: a reused cache is read exactly as a fresh one."""

    is_sliding = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, filled: int, sliding_window: int) -> None:
        super().__init__(keys, values, filled)
        self.sliding_window = sliding_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        first = max(0, keys.shape[-2] - key_states.shape[-2] - self.sliding_window + 1)
        return keys[:, :, first:], values[:, :, first:]

    def get_mask_sizes(self, queries: int | torch.Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset) for ``queries`` new tokens (transformers before 5 passes their cache positions)."""
        q = queries.shape[0] if isinstance(queries, torch.Tensor) else queries
        seen = self.get_seq_length()
        return min(seen, self.sliding_window - 1) + q, max(seen - self.sliding_window + 1, 0)

    def get_max_length(self) -> int:
        return self.sliding_window


class UnsupportedModel(CacheGenError, ValueError):
    """The model's KV cache has layers the engine cannot hold in its buffers exactly (linear attention, shared
    KV...): reusing a context could change its answers, so the engine refuses the model."""


def cache_layers(model: Any) -> list[int | None]:
    """Per layer of ``model``'s KV cache: None for full attention, its window for a sliding (or chunked) one.

    Raises :class:`UnsupportedModel`, naming the layer type, for any other layer transformers would build.
    """
    layers, n = DynamicCache(config=model.config).layers, kv_geometry(model.config)[0]
    if not layers:  # no config layer types: transformers builds full-attention layers as they come
        return [None] * n
    if len(layers) != n:
        raise UnsupportedModel(f"{type(model).__name__}: {n} layers but {len(layers)} KV cache layers (layers sharing their KV)")
    windows: list[int | None] = []
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            windows.append(None)
        elif type(layer) is DynamicSlidingWindowLayer:
            windows.append(int(layer.sliding_window))
        else:
            kinds = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
            kind = f" ({kinds[i]!r})" if i < len(kinds) else ""
            raise UnsupportedModel(
                f"{type(model).__name__}: KV cache layer {i} is a {type(layer).__name__}{kind}; context reuse supports "
                "full-attention and sliding-window attention layers only"
            )
    return windows


def supported_geometry(model: Any) -> tuple[int, int, int]:
    """:func:`kv_geometry` of a model whose every KV cache layer the engine holds exactly (:func:`cache_layers`:
    raises :class:`UnsupportedModel` otherwise)."""
    cache_layers(model)
    return kv_geometry(model.config)


def model_cache(model: Any, kv: KVCache | None, filled: int | None = None) -> Any:
    """A transformers cache holding the first ``filled`` tokens of ``kv`` (default: all), for ``model``.

    When ``kv`` is already in the model's dtype and on its device it is used in place, and
    tokens the model appends are written into its spare capacity (``kv.num_tokens - filled``)
    without copying the cache; otherwise it is converted first (a copy). ``None`` stays None.
    Sliding-window layers keep every token too (:class:`_InPlaceSlidingLayer`).
    """
    if kv is None:
        return None
    filled = kv.num_tokens if filled is None else filled
    if kv.dtype != model_dtype(model) or kv.keys.device != model.device:
        kv = kv.slice(0, filled).to(device=model.device, dtype=model_dtype(model))
    layers, heads, _, _ = kv.shape
    n, want = kv_geometry(model.config)[:2]
    if (layers, heads) != (n, want):
        raise KVShapeError(f"model has {n} layers and {want} KV heads, the KV cache {layers} and {heads}")
    windows = cache_layers(model)
    cache = DynamicCache(config=model.config)
    cache.layers = [
        _InPlaceLayer(kv.keys[i : i + 1], kv.values[i : i + 1], filled) if w is None
        else _InPlaceSlidingLayer(kv.keys[i : i + 1], kv.values[i : i + 1], filled, w)
        for i, w in enumerate(windows)
    ]  # fmt: skip
    return cache


def _plain_cache(model: Any, kv: KVCache | None, filled: int | None, beams: int) -> Any:
    """A transformers cache of its own layers holding ``kv``'s first ``filled`` tokens once per beam (beam search
    reorders the cache's batch, which a buffer's views cannot follow)."""
    if kv is None or not filled:
        return None
    cache, part = DynamicCache(config=model.config), kv.slice(0, filled)
    for i in range(kv.num_layers):
        cache.update(part.keys[i : i + 1].repeat(beams, 1, 1, 1), part.values[i : i + 1].repeat(beams, 1, 1, 1), i)
    return cache


@torch.no_grad()
def prefill(model: Any, ids: Sequence[int], past: KVCache | None = None) -> KVCache:
    """KV of ``ids`` computed by the model on top of ``past`` (only the new tokens, owning their memory).

    Computed into a buffer of the engine's own (:func:`prefill_into`), never taken from the cache transformers
    builds itself, whose sliding-window layers keep only their window.
    """
    start = past.num_tokens if past is not None else 0
    layers, heads, head_dim = kv_geometry(model.config)
    shape, dtype = (layers, heads, start + len(ids), head_dim), model_dtype(model)
    buffer = KVCache(torch.empty(shape, dtype=dtype, device=model.device), torch.empty(shape, dtype=dtype, device=model.device))
    if past is not None:
        buffer.slice(0, start).keys.copy_(past.keys)
        buffer.slice(0, start).values.copy_(past.values)
    prefill_into(model, ids, buffer, start)
    return buffer if past is None else KVCache(buffer.keys[:, :, start:].clone(), buffer.values[:, :, start:].clone())


@torch.no_grad()
def prefill_into(model: Any, ids: Sequence[int], buffer: KVCache, start: int) -> None:
    """Compute the KV of ``ids`` on top of ``buffer``'s first ``start`` tokens, into ``buffer[start:]``.

    In place when ``buffer`` is in the model's dtype and on its device (else computed, then copied).
    """
    end = start + len(ids)
    if end > buffer.num_tokens:
        raise KVShapeError(f"{len(ids)} tokens after {start} do not fit a buffer of {buffer.num_tokens}")
    cache = model_cache(model, buffer, start)
    model(torch.tensor([list(ids)], device=model.device), **cache_arg(model, cache), use_cache=True)
    first = cache.layers[0]
    if not (isinstance(first, _InPlaceLayer) and first._kbuf is not None):
        kv = KVCache.from_dynamic_cache(cache).slice(start, end)
        buffer.slice(start, end).keys.copy_(kv.keys)
        buffer.slice(start, end).values.copy_(kv.values)


class FirstTokenTimer:
    """A transformers streamer that records when the first generated token appears, passing tokens on."""

    def __init__(self, start: float, inner: Any = None) -> None:
        self.start = start
        self.ttft: float | None = None
        self.inner = inner
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True  # generate() first pushes the prompt ids
        elif self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


class _StopOnDecodedText:
    """Stop once the decoded new text contains a stop string: for tokenizers ``StopStringCriteria`` cannot map."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_len: int) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.prompt_len = prompt_len
        self.window = 2 * max(len(s) for s in self.stops) + 4  # tokens: a stop can span at most this many

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        text = self.tokenizer.decode(input_ids[0, self.prompt_len :][-self.window :], skip_special_tokens=True)
        done = any(s in text for s in self.stops)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def stop_criterion(tokenizer: Any, stops: Sequence[str], prompt_len: int) -> Any:
    """A stopping criterion for ``stops``: transformers' ``StopStringCriteria``, or a decoded-text check."""
    from transformers import StopStringCriteria  # noqa: PLC0415

    stops = [s for s in stops if s]
    try:
        return StopStringCriteria(tokenizer=tokenizer, stop_strings=stops)
    except (ValueError, KeyError, IndexError, TypeError):  # its vocabulary cleaning assumes subword tokens
        return _StopOnDecodedText(tokenizer, stops, prompt_len)


class _Cancelled:
    """Stop as soon as ``event`` is set: checked after every generated token."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """The random generators start from ``seed`` inside (and are restored after); nothing when None."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(seed))
        yield


@dataclass(frozen=True)
class Generated:
    """A generation's text, the model's cache after it, new token count, first-token time (None if none),
    and why it ended: ``"stop"`` (an end-of-sequence token, or the stop string ``stop_sequence``),
    ``"length"`` (the token limit) or ``"cancelled"`` (its ``cancel`` event was set)."""

    text: str
    cache: Any
    new_tokens: int
    ttft_s: float | None
    finish_reason: str = "stop"
    stop_sequence: str | None = None


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    ids: Sequence[int],
    past: KVCache | None,
    start: float,
    generation_kwargs: dict[str, Any],
    streamer: Any = None,
    filled: int | None = None,
    cancel: threading.Event | None = None,
) -> Generated:
    """Generate after ``ids``, whose first ``filled`` tokens (default ``past.num_tokens``) ``past`` covers
    (it must leave one); the tokens past ``filled`` are spare capacity the model writes into.

    ``generation_kwargs`` go to ``model.generate`` (greedy, 64 new tokens by default), plus
    ``stop``: strings after which generation stops (the text is returned whole; callers
    cut it), and ``seed``: the random generators' seed for this generation (restored after it).
    ``start`` is when the request began, for the first-token time. Setting ``cancel`` stops
    generation after the token being computed.
    """
    kwargs = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "do_sample": False, **generation_kwargs}
    stops = [s for s in kwargs.pop("stop", None) or [] if s]
    seed = kwargs.pop("seed", None)
    if stops or cancel is not None:
        from transformers import StoppingCriteriaList  # noqa: PLC0415

        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        if stops:
            criteria.append(stop_criterion(tokenizer, stops, len(ids)))
        if cancel is not None:
            criteria.append(_Cancelled(cancel))
        kwargs["stopping_criteria"] = criteria
    if kwargs.get("pad_token_id") is None and tokenizer.pad_token_id is None:
        kwargs["pad_token_id"] = tokenizer.eos_token_id
    beams = int(kwargs.get("num_beams") or 1) > 1  # beam search takes no streamer: no first-token time then
    timer = FirstTokenTimer(start, streamer)
    input_ids = torch.tensor([list(ids)], device=model.device)
    with _seeded(seed, model.device):
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            **cache_arg(model, _plain_cache(model, past, filled, int(kwargs["num_beams"])) if beams else model_cache(model, past, filled)),
            streamer=streamer if beams else timer,
            return_dict_in_generate=True,
            **kwargs,
        )
    new = out.sequences[0, len(ids) :]
    text = tokenizer.decode(new, skip_special_tokens=True)
    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) is not None else None
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    hit = min(((text.find(s), s) for s in stops if s in text), default=(-1, None))[1]
    limit = kwargs.get("max_new_tokens")
    natural = (new.numel() > 0 and int(new[-1]) in eos_ids) or hit is not None
    if not natural and limit is not None and new.numel() >= limit:
        reason = "length"
    else:
        reason = "cancelled" if not natural and cancel is not None and cancel.is_set() else "stop"
    return Generated(text, output_cache(out), int(new.numel()), timer.ttft, reason, hit)


def stream_pieces(tokenizer: Any, run: Callable[[Any], tuple[str, Any]], cancel: threading.Event | None = None) -> Iterator[Any]:
    """Yield the text pieces ``run(streamer)`` generates (in a thread of its own), then the second item of what it
    returns; an exception it raises is raised here, in the caller's thread. Closing the iterator early sets ``cancel``
    (which ``run`` is expected to pass to :func:`generate`) and waits for ``run`` to end."""
    from transformers import TextIteratorStreamer  # noqa: PLC0415

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["text"], result["info"] = run(streamer)
        except BaseException as e:  # noqa: BLE001  surfaced in the caller's thread below
            result["error"] = e
            streamer.end()

    thread = threading.Thread(target=target, name="cachegen-generate", daemon=True)
    thread.start()
    try:
        for piece in streamer:
            if piece:
                yield piece
    finally:  # also when the caller closes the iterator early: then generation stops within a token
        if thread.is_alive() and cancel is not None:
            cancel.set()
        thread.join()
    if "error" in result:
        raise result["error"]
    yield result["info"]
