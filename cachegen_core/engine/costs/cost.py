"""CostModel: what the streaming controller plans with, measured as the engine runs.

Per stored option (a level, ``raw``, ``lossless``), the decode seconds and blob bytes per token seen so far (running
averages), and the prefill's cost by tokens and position (``streaming.fits.PrefillFit``: a chunk late in a long
prompt costs more to recompute, attention), fitted from the engine's own prefills of at least a partial chunk's tokens:
cold prompts, text chunks, the generation's pass after a cached prefix (``observe_prefill``), the last few of each
shape. Until an option's decode has been
measured it is assumed to cost a prior (a compressed level: ``elements_per_token`` symbols at ``symbols_per_s``; a raw
form: its bytes at ``copy_bytes_per_s``), the prefill ``prefill_prior_s_per_token`` (attention's share from the
model's shape, ``attention_per_position``); the first measurement replaces a prior outright, later ones move the
estimate smoothly.

What a fetch costs is not here: the engine's estimator measures it, per store (``streaming/estimators.py``: the
bandwidth and, on a store on this host, a read's fixed cost apart from it), and the controller adds it to these costs.

Priors are not trusted for long: the engine measures every option off the request's path (``probes.py``): a raw form's
copy on the model's device when it is built, and after each stream (:meth:`after_stream`) the options it offered but
did not use that were never measured on a stored chunk, or not for ``probe_every`` streams, one stored chunk each, decoded in the
background; text, when no prefill of a chunk's size has been timed. An option the controller stops choosing is measured
again that way, so one slow measurement (on the memory store a raw chunk decoded beside another engine's work measured
0.10 s instead of 0.008 s) rules nothing out for good: a probe measuring less than the estimate replaces it (contention
only ever adds time), and the priors, far off on some devices (an H200 copies raw forms at 7 GB/s and more, the prior
says 2), decide one request at most.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from ...streaming import RAW_OPTIONS, TEXT, ChunkCost, Option, rank
from ...streaming.fits import PrefillFit, fit_prefill

#: Prefill seconds per token assumed before the first measurement.
PREFILL_PRIOR_S_PER_TOKEN = 2e-3
#: Entropy-decoded symbols per second assumed for a level before its first measurement.
PRIOR_SYMBOLS_PER_S = 100e6
#: Bytes per second a raw form is assumed to be checked and copied at before its first measurement.
PRIOR_COPY_BYTES_PER_S = 2e9
#: Weight of a new measurement in the running averages.
WEIGHT = 0.3
#: Streams after which an option offered but not used is measured again (a probe).
PROBE_EVERY = 4
#: Prefill measurements kept per shape (tokens and position, each to a power of two).
KEPT_PER_SHAPE = 3
#: Fewest tokens of a prefill the fit takes (the fewest a chunk priced as text has: a partial chunk's step). A
#: question's few tokens cost mostly its pass's fixed work: 15 tokens after 1,536 of a 4-layer 7B-shaped model took
#: 63 ms a token against 31 for the 1,536, which a fit without that work read as attention (text priced 20x too high
#: at 30K tokens).
MIN_PREFILL_TOKENS = 64


class CostModel:
    """Running costs: ``bytes_per_token[option]``, ``decode_s_per_token[option]``, the prefill's
    (:meth:`prefill_seconds`, ``prefill_s_per_token`` for a chunk of ``reference_tokens`` at the start).

    ``elements_per_token``: KV elements per token of the model (2 x layers x KV heads x head dim), for the decode
    priors (0: decoding assumed free until measured). ``attention_per_position``: the prefill prior's attention
    term per cached position, as a fraction of its per-token term (``model_costs``).
    """

    def __init__(self, elements_per_token: int = 0, prefill_prior_s_per_token: float = PREFILL_PRIOR_S_PER_TOKEN,
                 weight: float = WEIGHT, *, attention_per_position: float = 0.0, symbols_per_s: float = PRIOR_SYMBOLS_PER_S,
                 copy_bytes_per_s: float = PRIOR_COPY_BYTES_PER_S, reference_tokens: int = 1536,
                 probe_every: int = PROBE_EVERY) -> None:  # fmt: skip
        if prefill_prior_s_per_token <= 0 or not 0 < weight <= 1 or symbols_per_s <= 0 or copy_bytes_per_s <= 0:
            raise ValueError("the priors must be > 0 and the weight in (0, 1]")
        if attention_per_position < 0 or reference_tokens < 1 or probe_every < 1:
            raise ValueError("attention_per_position must be >= 0, reference_tokens and probe_every >= 1")
        self.elements_per_token = elements_per_token
        self.weight = weight
        self.symbols_per_s, self.copy_bytes_per_s = symbols_per_s, copy_bytes_per_s
        self.reference_tokens, self.probe_every = reference_tokens, probe_every
        self.bytes_per_token: dict[Option, float] = {}
        self.decode_s_per_token: dict[Option, float] = {}
        self.prior_prefill = PrefillFit(prefill_prior_s_per_token, prefill_prior_s_per_token * attention_per_position)
        self.streams = 0  # streams seen (after_stream)
        self.measured_at: dict[Option, int] = {}  # the stream count at an option's last measurement
        self._probed_at: dict[Option, int] = {}  # ... and at its last probe asked for
        self._points: dict[tuple[int, int], deque[tuple[int, int, float]]] = {}
        self._fit: PrefillFit | None = None  # fitted on first use after a measurement (the prior before any)
        self._lock = threading.Lock()

    # ------------------------------------------------------------ decoding
    def observe_decode(self, option: Option, nbytes: int, seconds: float, tokens: int, *, probe: bool = False,
                       stored: bool = True) -> None:  # fmt: skip
        """One blob of ``nbytes`` decoded in ``seconds`` into ``tokens`` tokens; ``probe``: measured off the request's
        path, beside no other work, so it replaces a higher estimate (a measurement taken under contention);
        ``stored=False``: a synthetic blob, not fetched from the store (the option is still due a stored probe)."""
        if tokens <= 0:
            return
        s = seconds / tokens
        if probe and s < self.decode_s_per_token.get(option, math.inf):
            self.decode_s_per_token[option] = s
        else:
            self._observe(self.decode_s_per_token, option, s)
        self._observe(self.bytes_per_token, option, nbytes / tokens)
        if stored:
            self.measured_at[option] = self.streams

    def _observe(self, table: dict[Option, float], key: Option, value: float) -> None:
        table[key] = value if key not in table else (1 - self.weight) * table[key] + self.weight * value

    def prior_s_per_token(self, option: Option) -> float:
        """The decode seconds per token assumed for ``option`` before it is measured."""
        if option in RAW_OPTIONS:
            return self.bytes_per_token.get(option, 0.0) / self.copy_bytes_per_s
        return self.elements_per_token / self.symbols_per_s

    def decode_seconds(self, option: Option, tokens: int, nbytes: int) -> float:
        """Expected seconds to decode a blob of ``nbytes`` holding ``tokens`` tokens stored as ``option``."""
        measured = self.decode_s_per_token.get(option)
        if measured is not None:
            return measured * tokens
        if option in RAW_OPTIONS:
            return nbytes / self.copy_bytes_per_s
        return self.prior_s_per_token(option) * tokens

    # ------------------------------------------------------------ prefilling
    def observe_prefill(self, tokens: int, position: int, seconds: float) -> None:
        """``tokens`` tokens prefilled after ``position`` cached ones in ``seconds`` (the fit follows on its next use;
        fewer than ``MIN_PREFILL_TOKENS`` are left out)."""
        if tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        with self._lock:
            kept = self._points.setdefault((tokens.bit_length(), position.bit_length()), deque(maxlen=KEPT_PER_SHAPE))
            kept.append((tokens, position, seconds))
            self._fit = None

    @property
    def prefill_fit(self) -> PrefillFit:
        """The prefill's cost fitted to the measurements kept (the prior before any)."""
        fit = self._fit
        if fit is None:
            with self._lock:
                points = [p for kept in self._points.values() for p in kept]
            self._fit = fit = fit_prefill(points, self.prior_prefill)
        return fit

    @property
    def prefill_measured(self) -> bool:
        """Whether any prefill has been measured (the prior is in use until then)."""
        return bool(self._points)

    def prefill_seconds(self, tokens: int, position: int = 0) -> float:
        """Expected seconds to recompute ``tokens`` tokens after ``position`` (no per-call overhead: a chunk is
        prefilled with the chunks and prompt around it)."""
        return self.prefill_fit.seconds(tokens, position, overhead=False)

    @property
    def prefill_s_per_token(self) -> float:
        """Prefill seconds per token of a chunk of ``reference_tokens`` at the prompt's start."""
        return self.prefill_seconds(self.reference_tokens) / self.reference_tokens

    def _sized_prefill(self) -> bool:
        """Whether a prefill of at least half a chunk was measured (a question's few tokens say little of a chunk's)."""
        with self._lock:
            return any(t >= self.reference_tokens // 2 for kept in self._points.values() for t, _, _ in kept)

    # ------------------------------------------------------------ planning and probing
    def chunk_cost(self, tokens: int, sizes: Mapping[Option, int], position: int | None = None, decoded: int | None = None) -> ChunkCost:
        """The controller's view of one chunk stored at ``sizes`` (option -> blob bytes), at ``position`` in its prompt
        (None: text priced at ``prefill_s_per_token``); ``decoded``: the tokens its blobs hold, when more than its own
        (a longer stored chunk's first tokens: ``chunks/tails.py``)."""
        text_s = self.prefill_seconds(tokens, position) if position is not None else None
        decode_s = {o: self.decode_seconds(o, decoded or tokens, n) for o, n in sizes.items()}
        return ChunkCost(dict(sizes), decode_s, tokens, text_s)

    def after_stream(self, offered: Iterable[Option], used: Iterable[Option], *, text: bool = False) -> list[Option]:
        """A stream offered the stored ``offered`` (and ``text``, when allowed) and used ``used``: the options due a
        probe now, finest first (each asked for once until measured or ``probe_every`` streams have passed): an unused
        one never measured on a stored chunk, or not for ``probe_every`` streams; ``TEXT`` when no prefill of a chunk's size is
        known."""
        self.streams += 1
        used = set(used)
        due: list[Option] = []
        for o in sorted(set(offered) - used - {TEXT}, key=rank):
            last = max(self.measured_at.get(o, -self.probe_every), self._probed_at.get(o, -self.probe_every))
            if self.streams - last >= (self.probe_every if o in self.measured_at else 1):
                due.append(o)
        if text and TEXT not in used and not self._sized_prefill():
            if self.streams - self._probed_at.get(TEXT, -self.probe_every) >= self.probe_every:
                due.append(TEXT)
        for o in due:
            self._probed_at[o] = self.streams
        return due

    def as_dict(self) -> dict[str, Any]:
        fit = self.prefill_fit
        return {
            "bytes_per_token": dict(self.bytes_per_token),
            "decode_s_per_token": dict(self.decode_s_per_token),
            "prefill_s_per_token": self.prefill_s_per_token,
            "prefill_fit": {"g": fit.g, "a": fit.a, "b": fit.b},
            "prefill_measured": self.prefill_measured,
        }


def model_costs(model: Any, geometry: tuple[int, int, int], reference_tokens: int = 1536) -> CostModel:
    """A cost model for ``model`` of KV ``geometry`` (layers, KV heads, head dim): its decode priors by the KV elements
    of a token, its prefill prior's attention share by the model's shape (about ``4 * layers * query heads * head dim``
    flops per token and cached position against ``2 * parameters`` per token; none when unknown)."""
    layers, kv_heads, head_dim = geometry
    heads = int(getattr(getattr(model, "config", None), "num_attention_heads", 0) or 0)
    try:
        params = sum(p.numel() for p in model.parameters())
    except (AttributeError, TypeError):
        params = 0
    share = 4 * layers * heads * head_dim / (2 * params) if heads and params else 0.0
    return CostModel(2 * layers * kv_heads * head_dim, attention_per_position=share, reference_tokens=reference_tokens)
