"""ChunkReader: find a prompt's stored chunks and stream them back into the prompt's KV buffer.

The read side of the store, as :class:`~.writer.ChunkWriter` is the write side: manifest lookup (one
``get_many`` per prompt), blob fetch, decode checked against the model's KV geometry (a forged, well-formed
blob of another shape is refused) straight into the prompt's preallocated KV, and the pipelined stream of
several prompts' chunks under the controller (a chunk shared by prompts goes once). It measures what the
controller plans with into the shared :class:`CostModel`. On a store that hands back the very objects it
holds (``shares_values``: the in-process memory store), the blobs of the last stream are kept with their
verification, and a later fetch that returns the same (immutable) object is not hashed again: on a 3K
context that check was 7 of the 17 ms the memory store's raw chunks took (``docs/history/``). Failures
never escape: a bad blob or a store error is reported in the request's ``GenerationInfo`` and the chunks
from there on are left to be recomputed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ...keys.chunks import Chunk, blob_key
from ...codec.kvcodec import Checked, KVCodec
from ...errors import BackendUnavailable, BlobMissing, CacheGenFormatError, StoreError
from ...kv import KVCache, KVShapeError
from ...pinned import HostArena, host_arena
from ...keys.manifest import Manifest, manifest_key
from ...codec.raw import RawChecked, RawCodec
from ...stores.base import KVStore
from ...streaming import RAW_OPTIONS, TEXT, ChunkCost, ChunkRecord, Controller, Estimator, Option, StreamFailure, rank, stream_batch
from ..costs.cost import CostModel
from .hot import HotTier
from ..serving.info import GenerationInfo
from .placement import DecodePlacement
from .reads import StreamReads
from ..costs.probes import offered_samples
from .runs import PrefillInto, copy_chunk, keys_before, prefill_text_runs
from .tails import decode_borrowed, find_tail
from .writer import StoreHealth

log = logging.getLogger("cachegen_core.engine")

#: A prompt's partial chunks that may follow a run of chunks ending at a given token (``chunks.partial_chunks``).
PartialChunks = Callable[[int], list[Chunk]]


def report(info: GenerationInfo, msg: str) -> None:
    """A request-level problem: in the request's errors and in the log."""
    info.errors.append(msg)
    log.warning(msg)


class ChunkReader:
    """Reads chunks of ``codec`` from ``store`` for a model of KV ``geometry`` (layers, KV heads, head dim)."""

    def __init__(
        self, codec: KVCodec, store: KVStore, geometry: tuple[int, int, int], cost_model: CostModel, health: StoreHealth,
        raw: RawCodec | None = None, hot: HotTier | None = None,
    ) -> None:  # fmt: skip
        self.codec = codec
        self.hot = hot  # the writer's chunks not yet stored (``hot.py``), looked up before the store
        self.raw = raw or RawCodec(codec.fingerprint)
        self.store = store
        self.placement = DecodePlacement(codec.coder.name if codec.coder is not None else None)  # where levels are decoded
        self.geometry = geometry
        self.cost_model = cost_model
        self.health = health
        self._verified: dict[str, tuple[Any, Checked | RawChecked]] = {}  # blob key -> (the store's object, checked)
        self._read_buffers: list[Any] = []  # kept between streams (see StreamReads)
        self.arena: HostArena | None = None  # pinned read buffers, raw checksums beside the copy: a model on a GPU
        self._buffers_lock = threading.Lock()
        self.prober: Any = None  # measures the options a stream's cost model says are due (``probes.py``), if set

    def clear(self) -> None:
        """Forget the kept read buffers and verified blobs (memory only: the next stream makes new ones)."""
        with self._buffers_lock:
            self._read_buffers, self._verified = [], {}

    @property
    def decode_device(self) -> torch.device:
        """Where levels are decoded (``placement.py``)."""
        return self.placement.device

    def use_device(self, device: torch.device, arena: HostArena | None = None) -> str | None:
        """Decode levels on ``device`` (the model's) when the coder can there, else on the CPU; returns why not. On a GPU
        blobs are read into pinned buffers of ``arena`` (default the process's), raw checksums run beside the copy."""
        self.arena = (arena or host_arena()) if device.type == "cuda" else arena
        self.clear()
        return self.placement.use(device)

    def note_decode(self, info: GenerationInfo, options: Sequence[Option]) -> None:
        """Where a request's streamed levels (among ``options``) were decoded, in its ``info``."""
        self.placement.note(info, options)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The store's values of ``keys`` (manifests), the hot tier's first."""
        if self.hot is None or not len(self.hot):
            return self.store.get_many(keys)
        return self.hot.get_many(keys, self.store.get_many)

    def trouble(self, info: GenerationInfo, msg: str) -> None:
        """A store failure: in the request's errors always, in the log once until the store recovers."""
        info.errors.append(msg)
        self.health.failed(msg)

    def lookup(self, chunks: Sequence[Chunk], floor: Option, info: GenerationInfo, options: Sequence[Option] | None = None) -> list[Manifest]:
        """Manifests of the longest run of leading chunks stored in some option (of ``options``, default
        any) at least as fine as ``floor`` (one store request)."""
        if not chunks:
            return []
        try:
            raw = self.get_many([manifest_key(c.key) for c in chunks])
        except StoreError as e:
            self.trouble(info, f"store failure, recomputing every chunk: {e}")
            return []
        if raw and raw[0] is not None:  # a store that hands data back works again (a miss proves nothing of writes)
            self.health.recovered()
        run = []
        for c, data in zip(chunks, raw):
            manifest = self.usable_manifest(data, floor, options, info, f"chunk {c.index}, recomputing from there")
            if manifest is None:
                break
            run.append(manifest)
        return run

    @staticmethod
    def usable_manifest(data: bytes | None, floor: Option, options: Sequence[Option] | None, info: GenerationInfo,
                        what: str) -> Manifest | None:  # fmt: skip
        """The manifest in ``data`` when it names an option at least as fine as ``floor`` (and among
        ``options``, when given); None when absent, unusable or bad (a bad one reported as
        ``bad manifest for <what>``)."""
        if not data:  # absent (or empty: see ``fetch``)
            return None
        try:
            manifest = Manifest.from_bytes(data)
        except CacheGenFormatError as e:
            report(info, f"bad manifest for {what}: {e}")
            return None
        if any(rank(o) <= rank(floor) and (options is None or o in options) for o in manifest.options):
            return manifest
        return None

    def lookup_partial(self, candidates: Sequence[Chunk], floor: Option, info: GenerationInfo,
                       options: Sequence[Option] | None = None) -> tuple[Chunk, Manifest] | None:  # fmt: skip
        """The longest of ``candidates`` (partial chunks, shortest first) stored in some option at least as
        fine as ``floor``, itself or as a longer one's first tokens found through a pointer (``tails.py``), and the
        stored chunk's manifest (one store request; one more to follow pointers); None when none is."""
        return find_tail(self, candidates, floor, info, options)

    def fetch(self, key: str, option: Option, reads: StreamReads | None = None, size: int = 0) -> Checked | RawChecked:
        """The blob of chunk ``key`` stored as ``option``, its checksums and header verified (in the stream's
        fetch thread, beside the previous chunk's decode); ``BlobMissing`` when it is not (or no longer) stored.

        With a stream's ``reads``: the very object the last stream verified is not verified again (a store
        that shares its objects), and a local store's raw form of ``size`` bytes (on a GPU any form of any store)
        is read into one of the stream's buffers (a store that can: ``read_into``). A store that holds pinned values (``views``: the memory
        store on a GPU) hands back the object it holds."""
        name = blob_key(key, option)
        read_into, raw, shares = getattr(self.store, "read_into", None), option in RAW_OPTIONS, getattr(self.store, "shares_values", False)
        view = self.store.view if getattr(self.store, "views", False) else None  # type: ignore[attr-defined]
        if self.hot is not None and (blob := self.hot.get(name)) is not None:
            pass  # before the store: an entry leaves the hot tier only once the store holds it
        elif reads is not None and read_into is not None and not shares and size > 0 and (
                reads.arena is not None or (raw and getattr(self.store, "local", False))):  # fmt: skip
            blob = read_into(name, reads.buffer(size))
        else:
            blob = view(name) if view is not None else self.store.get(name)
        if blob is None or not len(blob):  # or empty: the read raced an eviction on a cluster (``RedisStore``); no blob is empty
            raise BlobMissing(f"chunk {key[:12]} as {option} is not in the store")
        known = self._verified.get(name)
        if known is not None and known[0] is blob:
            checked = known[1]
        elif raw:  # to a GPU: its checksums are run beside its copy there (``RawCodec.decode``)
            checked = self.raw.check(blob, option, payloads=self.arena is None)
        else:
            checked = self.codec.check(blob, option)  # type: ignore[arg-type]
        if reads is not None and shares:
            reads.seen[name] = (blob, checked)
        return checked

    def decode(self, blob: bytes | Checked | RawChecked, key: str, option: Option, out: KVCache | None = None, observe: bool = True) -> KVCache:
        """The chunk's KV (written into ``out`` when given), checked against the model's geometry (and
        ``out``'s tokens); its cost goes into the cost model (``observe``; a probe times it itself)."""
        t = time.perf_counter()
        if option in RAW_OPTIONS:
            try:
                kv = self.raw.decode(blob, option, out=out)  # type: ignore[arg-type]
            except KVShapeError as e:
                raise CacheGenFormatError(f"chunk {key[:12]}: {e}") from None
        else:
            fits = out is not None and isinstance(blob, Checked) and out.shape == blob.header.shape
            try:
                kv = self.codec.decode(blob, level=option, device=self.decode_device, out=out if fits else None)  # type: ignore[arg-type]
            except BackendUnavailable as e:  # the device's decoder cannot run after all
                if self.decode_device.type == "cpu":
                    raise
                self.placement.fall_back(e)
                kv = self.codec.decode(blob, level=option, device=self.decode_device, out=out if fits else None)  # type: ignore[arg-type]
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != self.geometry:  # checksums say nothing of a forged shape
            raise CacheGenFormatError(f"chunk {key[:12]} decoded to KV of shape {kv.shape}, the model's is "
                                      f"(layers, kv heads, head dim) = {self.geometry}")  # fmt: skip
        if out is not None and kv is not out:
            if kv.num_tokens != out.num_tokens:
                raise CacheGenFormatError(f"chunk {key[:12]} decoded to {kv.num_tokens} tokens, expected {out.num_tokens}")
            out.keys.copy_(kv.keys)
            out.values.copy_(kv.values)
            kv = out
        if observe:
            self.cost_model.observe_decode(option, len(blob), time.perf_counter() - t, kv.num_tokens)
        return kv

    def get(self, chunk_ids: Sequence[str], level: int, info: GenerationInfo | None = None) -> KVCache:
        """Fetch and decode chunks in order at ``level``; raises ``StoreError`` (``BlobMissing``) or ``CacheGenFormatError``."""
        if not chunk_ids:
            raise ValueError("get_kv needs at least one chunk id")
        parts = []
        for key in chunk_ids:
            t0 = time.perf_counter()
            blob = self.fetch(key, level)
            t1 = time.perf_counter()
            parts.append(self.decode(blob, key, level))
            if info is not None:
                info.fetch_s, info.decode_s = info.fetch_s + t1 - t0, info.decode_s + time.perf_counter() - t1
                info.bytes_fetched += len(blob)
                info.levels.append(level)
        return KVCache.concat(parts)

    def stream(
        self,
        prompts: Sequence[tuple[list[int], list[Chunk], KVCache]],
        infos: Sequence[GenerationInfo],
        *,
        floor: Option,
        controller: Controller,
        estimator: Estimator,
        prefill: PrefillInto,
        partials: Sequence[PartialChunks | None] | None = None,
        defer_text: bool = False,
    ) -> list[tuple[int, int]]:
        """Stream the stored leading chunks of every (ids, chunks, buffer) prompt as one batch into
        its buffer; returns per prompt ``(covered, filled)``: the leading tokens the stream accounted
        for (found in the store: nothing to store again) and those its buffer now holds.

        Chunks are looked up at ``floor`` (see :meth:`lookup`); the controller picks among its
        options (those the chunk's manifest lists) and text, for which ``prefill`` is called.
        ``partials[p]`` gives prompt p's partial chunks after a run ending at a token: the longest
        one stored extends the run (:meth:`lookup_partial`). ``defer_text`` (one prompt, no deadline):
        text chunks are prefilled after the stream, each run of them in one pass, and a run that
        ends the stream not at all: the generation prefills it with the rest of the prompt in one pass
        (chunk by chunk, a small model's prompt recomputed whole took 2 cores 5.2 s against 2.2 s).
        """
        runs, manifests, owner = [], {}, {}
        for p, ((_, chunks, _), info) in enumerate(zip(prompts, infos)):
            found = self.lookup(chunks, floor, info, controller.options)
            runs.append(chunks[: len(found)])
            more = partials[p] if partials is not None else None
            tail = self.lookup_partial(more(runs[-1][-1].end if runs[-1] else 0), floor, info, controller.options) if more else None
            if tail is not None:
                runs[-1].append(tail[0])
                found.append(tail[1])
            for c, m in zip(runs[-1], found):
                manifests.setdefault(c.key, m)  # the owner's: a borrowed chunk's is its stored chunk's
                owner.setdefault(c.key, (c, p))
        if not manifests:
            return [(0, 0)] * len(prompts)
        held: list[set[str]] = [set() for _ in prompts]  # chunks already in each prompt's buffer
        deferred: set[str] = set()  # text chunks not prefilled yet (``defer_text``)

        def slot(key: str) -> KVCache:
            c, p = owner[key]
            return prompts[p][2].slice(c.start, c.end)

        def decode(blob: bytes, key: str, option: Option) -> KVCache:
            c, p = owner[key]
            if c.stored is c:
                kv = self.decode(blob, key, option, out=slot(key))
            else:  # a borrowed chunk (``tails.py``): a longer stored one's first tokens
                kv = decode_borrowed(self, blob, c, option, prompts[p][2])  # type: ignore[arg-type]
            held[p].add(key)
            return kv

        def on_text(key: str) -> KVCache:
            c, p = owner[key]  # prefix-chained keys: the chunks before it in its prompt were streamed first
            if defer_text:
                deferred.add(key)
                return slot(key)
            for k in keys_before(c, runs):
                if k not in held[p]:  # decoded into another prompt's buffer: copy it over first
                    copy_chunk(slot(k), owner[k][0], prompts[p][2])
                    held[p].add(k)
            prefill(prompts[p][0][c.start : c.end], prompts[p][2], c.start)
            held[p].add(key)
            return slot(key)

        batch_info = infos[0] if len(infos) == 1 else GenerationInfo()
        records, failure = self.run_stream([[c.key for c in run] for run in runs], manifests, lambda k: owner[k][0],
                                           decode=decode, on_text=on_text, controller=controller, estimator=estimator)  # fmt: skip
        if failure is not None:
            self._failed(batch_info, failure)
        for r in records:
            batch_info.stream.append(r.as_dict())
            batch_info.bytes_fetched += r.bytes
            batch_info.fetch_s += r.fetch_s
            batch_info.decode_s += r.decode_s
        self.note_decode(batch_info, [r.option for r in records])
        option = {r.chunk: r.option for r in records}
        trailing = prefill_text_runs(runs[0], deferred, held[0], prompts[0], prefill) if deferred else []
        covered = []
        for p, (run, info) in enumerate(zip(runs, infos)):
            mine = []
            for c in run:
                if c.key not in option or not any(c.key in h for h in held):
                    break
                if c.key not in held[p]:  # streamed once for the batch, into another prompt's buffer
                    copy_chunk(slot(c.key), c, prompts[p][2])
                mine.append(c)
            info.levels = [option[c.key] for c in mine] + [TEXT] * len(trailing)
            info.text_chunks = sum(lv == TEXT for lv in info.levels)
            if info is not batch_info:  # fetch figures are the batch's: the chunks were streamed once for every prompt
                info.stream, info.errors = batch_info.stream, info.errors + batch_info.errors
                info.bytes_fetched, info.fetch_s, info.decode_s = batch_info.bytes_fetched, batch_info.fetch_s, batch_info.decode_s
                info.decode_device = batch_info.decode_device
            filled = mine[-1].end if mine else 0
            covered.append((trailing[-1].end if trailing else filled, filled))
        return covered

    def run_stream(
        self,
        requests: Sequence[Sequence[str]],
        manifests: Mapping[str, Manifest],
        chunk_of: Callable[[str], Chunk],
        *,
        decode: Callable[[Checked | RawChecked, str, Option], Any],
        on_text: Callable[[str], Any],
        controller: Controller,
        estimator: Estimator,
    ) -> tuple[tuple[ChunkRecord, ...], StreamFailure | None]:
        """``stream_batch`` over stored chunks (``requests``: chunk keys; ``manifests``: each key's; ``chunk_of``: the
        chunk, its tokens and its place in the prompt: text is priced there), with what every stream of this reader
        shares: the cost model (planned with; after the stream, the options it says are due a measurement, offered
        but not used, go to the ``prober``: ``CostModel.after_stream``, ``probes.py``), the verified
        blobs of a store that shares its objects and the read buffers (see ``fetch``). A form the manifest names but
        the store no longer holds (a raw form its raw tier evicted: ``stores/tiers.py``) is replaced by the next one
        the controller picks, the level or text. Returns the records, and the failure that stopped the stream, if any
        (its records then are those before it)."""

        def cost(key: str) -> ChunkCost:
            sizes = {o: n for o, n in manifests[key].sizes.items() if o in controller.options}
            c = chunk_of(key)
            return self.cost_model.chunk_cost(c.num_tokens, sizes, c.start, decoded=c.stored.num_tokens)

        def fetch(key: str, option: Option) -> Checked | RawChecked:  # a borrowed chunk's blobs are its stored chunk's
            return self.fetch(chunk_of(key).stored.key, option, reads, manifests[key].sizes.get(option, 0))

        with self._buffers_lock:
            reads = StreamReads([self._read_buffers.pop() if self._read_buffers else bytearray() for _ in range(2)], self.arena)
        failure = None
        try:
            records = stream_batch(requests, cost, fetch=fetch,
                                   decode=decode, on_text=on_text, controller=controller, estimator=estimator,
                                   overlap=not getattr(self.store, "shares_values", False), missing=(BlobMissing,)).plan.records  # fmt: skip
        except StreamFailure as f:  # its buffers are not kept: a fetch the driver left running may still write into one
            failure, records = f, f.partial.trace
        else:
            with self._buffers_lock:
                self._read_buffers = sorted(self._read_buffers + [b for b in reads.buffers if len(b)], key=len)[-4:]
        if getattr(self.store, "shares_values", False):
            self._verified = reads.seen  # the last stream's blobs only: held by the store anyway, unless it evicted them since
        samples = offered_samples(manifests, controller.options, lambda k: chunk_of(k).stored)
        due = self.cost_model.after_stream(samples, {r.option for r in records}, text=controller.allow_text)
        if due and self.prober is not None:
            self.prober.after_stream(due, samples)
        return records, failure

    def _failed(self, info: GenerationInfo, f: StreamFailure) -> None:
        if isinstance(f.cause, BlobMissing):  # evicted since its manifest was read: a plain miss
            return
        if isinstance(f.cause, StoreError):
            self.trouble(info, f"store failure for chunk {f.index}, recomputing from there: {f.cause}")
        else:
            kind = "bad blob" if isinstance(f.cause, CacheGenFormatError) else "failure"
            report(info, f"{kind} for chunk {f.index}, recomputing from there: {f.cause}")
