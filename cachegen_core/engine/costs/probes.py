"""Probes: what the controller plans with, measured off the request's path (``cost.py``).

- When the engine is built, each raw form it stores: a synthetic chunk of the model's geometry and dtype, encoded in
  that form and decoded into a buffer on the model's device, as a stored raw chunk is: the device's copy rate, before
  any request plans with it (an H200 copied 7 GB/s and more where the prior said 2, and the engine recomputed every
  chunk rather than copy it).
- After a stream, the options its cost model says are due (``CostModel.after_stream``: offered, not used, never
  measured or not lately): one chunk the stream offered in that form, fetched from the store and decoded into a spare
  buffer; text: a chunk's worth of tokens prefilled from the prompt's start, when no prefill of that size was timed.
The probes write into a buffer of their own, one chunk's KV on the model's device, kept (a fresh one's page faults
would be timed) until the engine is closed.

Probes run one at a time in a background thread (``serving/background.py``), started when there is work and ending
when there is none, under ``Yielding``: paused before each torch op while a request computes (the model lock let go),
so a request waits for one op at most. A probe that paused measured the pause too: it is dropped (the cost model asks
again later). The first decode of a form in an engine runs twice and the second is timed (a GPU decoder compiles its
kernels on first use); on a GPU the device is synchronised before the clock stops. An engine built with
``background=False`` runs its probes when a request has answered, before it returns (deterministic, for scripts and
tests).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...errors import CacheGenError, StoreError
from ...kv import KVCache
from ...stores.base import fetches_on_cpu
from ...streaming import RAW_OPTIONS, TEXT, Option
from ...streaming.estimators import read_fixed_s
from ..model import hf
from ..serving.buffers import BufferPool
from ..serving.background import JobQueue
from ..serving.yielding import Yielding

log = logging.getLogger("cachegen_core.engine")
#: The largest synthetic chunk a build probe copies (bytes of its raw form).
MAX_PROBE_BYTES = 64 << 20
#: The longest fetch a probe makes over a link (predicted at the bandwidth estimate), seconds.
MAX_PROBE_FETCH_S = 0.2
#: A stored chunk to probe a form with: its key, tokens and the form's bytes.
Sample = tuple[str, int, int]


def offered_samples(manifests: Mapping[str, Any], options: Sequence[Option], chunk_of: Callable[[str], Any]) -> dict[Option, Sample]:
    """Per stored option of ``options`` that some chunk's manifest names, the first such chunk (a probe's sample):
    ``chunk_of`` gives the chunk a manifest's key names, the stored one (its key and tokens: ``Chunk.stored``)."""
    samples: dict[Option, Sample] = {}
    for key, manifest in manifests.items():
        for option, size in manifest.sizes.items():
            if option in options and option not in samples:
                c = chunk_of(key)
                samples[option] = (c.key, c.num_tokens, size)
    return samples


class Prober:
    """Measures ``engine``'s costs in the background (``background``) or when asked to (:meth:`drain`).

    Holds the engine weakly. ``measured`` counts the probes whose measurement reached the cost model, ``dropped``
    those that paused for a request or failed.
    """

    def __init__(self, engine: Any, *, background: bool = True, quiet_s: float = 0.5) -> None:
        self._engine = weakref.proxy(engine)
        self.background = background
        self.yielding = Yielding(engine.writer.turns, quiet_s=quiet_s, device=engine.model.device)
        self._queue: JobQueue[Callable[[], bool]] = JobQueue(self._count, self.yielding, name="cachegen-probe", background=background)
        self._warm: set[Option] = set()
        self._buffers = BufferPool(*engine.kv_geometry, hf.model_dtype(engine.model), engine.model.device, keep=1)  # faulted once
        self.measured = self.dropped = 0

    # ------------------------------------------------------------ what to probe
    def after_build(self) -> None:
        """Probe the copy of each raw form the engine stores (now, without a background thread)."""
        self._queue.submit([lambda o=o: self._raw_copy(o) for o in self._engine.store_options if o in RAW_OPTIONS])
        self.drain()

    def after_stream(self, due: Sequence[Option], samples: Mapping[Option, Sample]) -> None:
        """Probe the options ``due`` (``CostModel.after_stream``): each stored one on its chunk of ``samples``."""
        jobs: list[Callable[[], bool]] = [lambda: self._text()] if TEXT in due else []
        jobs += [lambda o=o, s=samples[o]: self._stored(o, *s) for o in due if o != TEXT and o in samples]
        self._queue.submit(jobs)

    # ------------------------------------------------------------ running them
    def drain(self) -> None:
        """Run the probes queued, now, on this thread (an engine without a background thread: after each request)."""
        self._queue.drain()

    def _count(self, job: Callable[[], bool]) -> None:
        try:
            ok = job()
        except (CacheGenError, StoreError, RuntimeError, ValueError, OSError) as e:  # a probe never fails a request
            log.debug("a cost probe failed: %s", e)
            ok = False
        if ok:
            self.measured += 1
        else:
            self.dropped += 1

    def join(self, timeout: float | None = None) -> bool:
        """Wait until no probe is queued or running; False if ``timeout`` passed first."""
        return self._queue.join(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Run no other probe, wait for the one running (at most one op, then it stops), free the probes' buffer."""
        self._queue.stop(timeout)
        self._buffers.clear()

    # ------------------------------------------------------------ the probes
    def _timed(self, work: Callable[[], Any]) -> tuple[Any, float | None]:
        """What ``work`` returns and the seconds it took (the device synchronised); None when a request computed
        meanwhile (it paused, or a request was running when it ended: the time says nothing of the work alone)."""
        device, pauses = self._engine.model.device, self.yielding.pauses
        t = time.perf_counter()
        result = work()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        seconds = time.perf_counter() - t
        alone = self.yielding.pauses == pauses and (not self.background or self.yielding.idle.is_set())
        return result, seconds if alone else None

    def _decode(self, option: Option, blob: Any, key: str, tokens: int, stored: bool = True) -> bool:
        """Decode ``blob`` (checked) into a spare buffer, timed (twice the first time: a warm-up), into the cost model."""
        e = self._engine
        out = self._buffers.take(tokens)
        try:
            work = lambda: e.reader.decode(blob, key, option, out=out, observe=False)  # noqa: E731
            if option not in self._warm:
                work()
                self._warm.add(option)
            seconds = self._timed(work)[1]
        finally:
            self._buffers.give(out)
        if seconds is None:
            return False
        e.cost_model.observe_decode(option, len(blob), seconds, tokens, probe=True, stored=stored)
        return True

    def _raw_copy(self, option: Option) -> bool:
        """A synthetic chunk in raw form ``option``, decoded on the model's device."""
        e = self._engine
        layers, heads, dim = e.kv_geometry
        per_token = 2 * layers * heads * dim * (4 if option == "lossless" and hf.model_dtype(e.model).itemsize == 4 else 2)
        tokens = max(1, min(e.chunk_tokens, MAX_PROBE_BYTES // per_token))
        shape = (layers, heads, tokens, dim)
        kv = KVCache(torch.randn(shape).to(hf.model_dtype(e.model)), torch.randn(shape).to(hf.model_dtype(e.model)))
        blob = e.reader.raw.check(e.reader.raw.encode(kv, option), option)  # type: ignore[arg-type]
        return self._decode(option, blob, "synthetic", tokens, stored=False)

    def _stored(self, option: Option, key: str, tokens: int, size: int) -> bool:
        """The stored chunk ``key`` in form ``option``, fetched (checked; a fetch alone feeds the bandwidth estimate)
        and decoded. Not over a link on which the fetch would take over ``MAX_PROBE_FETCH_S``: the next request's
        fetches would share it."""
        e = self._engine
        bandwidth = e.estimator.estimate()
        if not fetches_on_cpu(e.store) and bandwidth and read_fixed_s(e.estimator) + size / bandwidth > MAX_PROBE_FETCH_S:
            return False
        blob, seconds = self._timed(lambda: e.reader.fetch(key, option))
        if seconds:
            e.estimator.update(len(blob), seconds)
        return self._decode(option, blob, key, tokens)

    def _text(self) -> bool:
        """A chunk's worth of tokens prefilled from the prompt's start (holding the model lock)."""
        e = self._engine
        tokens = e.chunk_tokens
        vocab = int(getattr(e.model.config, "vocab_size", 0) or 0)
        ids = [(7 + 31 * i) % vocab if vocab else 0 for i in range(tokens)]  # any tokens: the cost is the same
        out = self._buffers.take(tokens)
        try:
            with self.yielding.holding(e.scheduler.lock) if self.background else e.scheduler.exclusive():
                seconds = self._timed(lambda: hf.prefill_into(e.model, ids, out, 0))[1]
        finally:
            self._buffers.give(out)
        if seconds is None:
            return False
        e.cost_model.observe_prefill(tokens, 0, seconds)
        return True
