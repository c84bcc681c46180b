"""ChunkWriter and the manifest: a reader never sees a partially written chunk."""

import threading
import time

import pytest

from cachegen_core.keys.chunks import blob_key
from cachegen_core.engine import ChunkWriter, KVEngine
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.keys.manifest import Manifest, manifest_key
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words

CHUNK = 64


class SlowWritesStore(MemoryStore):
    """Writes one key at a time with a pause between them, recording the order; records reads of absent blobs."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.order: list[str] = []
        self.missing_reads: list[str] = []

    def put_many(self, items) -> None:
        for k, v in items:
            self.put(k, v)

    def put(self, key, value) -> None:
        time.sleep(self.delay_s)
        self.order.append(key)
        super().put(key, value)

    def get(self, key):
        value = super().get(key)
        if value is None and not key.endswith("-M"):
            self.missing_reads.append(key)
        return value


def test_manifest_is_written_after_every_blob_it_names(tiny_llama, tiny_tokenizer):
    store = SlowWritesStore()
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, background=False)
    prompt = words(21, 3 * CHUNK + 4)
    e.generate(prompt, max_new_tokens=1)
    for c in e.chunks(prompt):
        m = Manifest.from_bytes(store.get(manifest_key(c.key)))
        assert m.options == e.store_options
        blobs = [store.order.index(blob_key(c.key, lv)) for lv in m.options]
        assert max(blobs) < store.order.index(manifest_key(c.key))
        assert all(m.sizes[lv] == len(store.get(blob_key(c.key, lv))) for lv in m.options)


def test_a_reader_racing_the_writer_finds_every_level_the_manifest_names(tiny_llama, tiny_tokenizer, tiny_kv):
    """While a slow writer stores chunks level by level, a reader polls: a chunk is absent, or whole."""
    store = SlowWritesStore(delay_s=0.01)
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, background=True)
    chunks = e.chunks(list(range(3, 3 + 4 * CHUNK)))
    seen_partial, seen_whole, done = [], set(), threading.Event()

    def reader() -> None:
        while not done.is_set():
            for c in chunks:
                raw = store.get(manifest_key(c.key))
                if raw is None:
                    continue
                for lv in Manifest.from_bytes(raw).options:
                    if store.get(blob_key(c.key, lv)) is None:
                        seen_partial.append((c.index, lv))
                seen_whole.add(c.index)

    t = threading.Thread(target=reader)
    t.start()
    for c in chunks:
        e.writer.submit(c, tiny_kv.slice(0, CHUNK))
    assert e.flush(timeout=60)
    done.set()
    t.join()
    assert seen_partial == [] and store.missing_reads == []
    assert seen_whole == {0, 1, 2, 3}  # the reader did see the chunks once they were complete


def test_engine_reading_while_the_writer_writes_never_misses_a_named_blob(tiny_llama, tiny_tokenizer):
    """Requests racing the background writer (and an SLO that may pick any stored level) are answered
    from whole chunks only: no fetch of a blob the manifest named fails."""
    store = SlowWritesStore(delay_s=0.005)
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level=0, background=True, slo_s=0.05)
    prompt = words(22, 4 * CHUNK + 3)
    infos = [e.generate(prompt, max_new_tokens=1)[1] for _ in range(6)]
    assert e.flush(timeout=60)
    infos.append(e.generate(prompt, max_new_tokens=1)[1])
    assert store.missing_reads == []
    assert all(i.errors == [] and i.cached_tokens % CHUNK == 0 for i in infos)
    assert infos[-1].cached_tokens == 4 * CHUNK


def test_writer_rejects_levels_the_codec_lacks(tiny_llama, tiny_tokenizer):
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, background=False)
    with pytest.raises(ValueError, match="neither raw forms"):
        ChunkWriter(e.codec, MemoryStore(), [0, 9], background=False)
    with pytest.raises(ValueError, match="at least one option"):
        ChunkWriter(e.codec, MemoryStore(), [], background=False)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"\xff", "not valid JSON"),
        (b"[]", "not a cachegen-manifest-v1"),
        (b'{"format": "cachegen-manifest-v1", "options": {"x": 3}}', "unknown option"),
        (b'{"format": "cachegen-manifest-v1", "options": {"1": -3}}', "bad size"),
        (b'{"format": "cachegen-manifest-v1", "options": {"1": true}}', "bad size"),
        (b"{" * 5000, "exceeds"),
    ],
)
def test_bad_manifests_are_typed_errors(raw, message):
    with pytest.raises(CacheGenFormatError, match=message):
        Manifest.from_bytes(raw)


def test_a_bad_manifest_is_a_reported_miss(tiny_llama, tiny_tokenizer):
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, background=False)
    prompt = words(23, 2 * CHUNK + 1)
    e.generate(prompt, max_new_tokens=1)
    e.store.put(manifest_key(e.chunks(prompt)[1].key), b"garbage")
    _, info = e.generate(prompt, max_new_tokens=1)
    assert info.cached_tokens == CHUNK and "bad manifest for chunk 1" in info.errors[0]


def test_manifest_round_trip():
    m = Manifest({3: 10, 0: 99})
    assert Manifest.from_bytes(m.to_bytes()) == m and m.options == [0, 3] and 3 in m and 1 not in m
    m = Manifest({1: 4, "raw": 8, "lossless": 16})
    assert Manifest.from_bytes(m.to_bytes()) == m and m.options == ["lossless", "raw", 1]


def test_writers_of_different_forms_keep_each_others_blobs_named(tiny_llama, tiny_tokenizer):
    """Two engine configurations share a store: the manifest names every form either stored."""
    store = MemoryStore()
    a = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level=0, store_options=[0], background=False,
                 allow_text=False)  # fmt: skip
    b = KVEngine(tiny_llama, tiny_tokenizer, codec=a.codec, store=store, chunk_tokens=CHUNK, level=3, store_options=["raw", 3],
                 background=False)  # fmt: skip
    prompt = words(24, 2 * CHUNK + 1)
    a.generate(prompt, max_new_tokens=1)
    b.store_kv(prompt)
    for c in a.chunks(prompt):
        assert Manifest.from_bytes(store.get(manifest_key(c.key))).options == ["raw", 0, 3]
    _, info = a.generate(prompt, max_new_tokens=1)
    assert info.cached_tokens == 2 * CHUNK and info.levels == [0, 0]  # a's own form is still found


def test_levels_wait_while_a_request_computes_and_the_raw_form_does_not(tiny_llama, tiny_tokenizer):
    """The worker writes a chunk's first stage (raw) at once, its levels only when no request holds ``busy()``."""
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, background=False)
    kv = e.calculate_kv(words(31, CHUNK))
    chunk = e.chunks(words(31, CHUNK))[0]
    store = MemoryStore()
    w = ChunkWriter(e.codec, store, ["raw", 1], background=True, first_stage_now=False)
    with w.busy(), w.busy():  # two requests at once
        assert w.submit(chunk, kv)
        deadline = time.monotonic() + 5
        while store.get(blob_key(chunk.key, "raw")) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.get(blob_key(chunk.key, "raw")) is not None  # the next request can hit already
        time.sleep(0.3)
        assert store.get(blob_key(chunk.key, 1)) is None and not w.idle.is_set()
    assert w.idle.is_set() and w.flush(10)
    assert store.get(blob_key(chunk.key, 1)) is not None
    assert Manifest.from_bytes(store.get(manifest_key(chunk.key))).options == ["raw", 1]


def test_close_writes_what_is_queued_stops_the_thread_and_frees_the_kept_buffers(tiny_llama, tiny_tokenizer):
    store = SlowWritesStore(delay_s=0.02)
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 1])
    prompt = words(33, 3 * CHUNK)
    e.generate(prompt, max_new_tokens=1)
    e.generate(prompt, max_new_tokens=1)  # warm: its buffer goes back to the pool
    thread = e.writer._worker._thread
    assert e.buffers.kept_bytes > 0
    with e:
        pass
    assert not thread.is_alive() and e.buffers.kept_bytes == 0 and e.reader._read_buffers == []
    assert all(store.get(blob_key(c.key, 1)) is not None for c in e.chunks(prompt))  # the queued levels were written
    e.generate(words(34, 2 * CHUNK), max_new_tokens=1)  # after close it still answers, storing before it returns
    assert all(store.get(blob_key(c.key, 1)) is not None for c in e.chunks(words(34, 2 * CHUNK)))
    assert e.close()  # closing twice is harmless


def test_a_dropped_engine_is_freed_at_once_and_its_writer_thread_ends(tiny_llama, tiny_tokenizer):
    import gc
    import weakref

    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK)
    e.generate(words(35, 2 * CHUNK), max_new_tokens=1)
    e.flush()
    thread, ref = e.writer._worker._thread, weakref.ref(e)
    gc.disable()  # freed by reference counting: no cycle through the document step or the writer
    try:
        del e
        assert ref() is None
    finally:
        gc.enable()
    thread.join(10)
    assert not thread.is_alive()


class SlowDisk(SlowWritesStore):
    """A local store that hands back copies (as the disk store does); its writes wait for ``opened`` when given."""

    shares_values = False

    def __init__(self, opened: threading.Event | None = None) -> None:
        super().__init__()
        self.opened = opened

    def put(self, key, value) -> None:
        if self.opened is not None:
            assert self.opened.wait(60)
        super().put(key, value)

    def get(self, key):
        value = super().get(key)
        return None if value is None else bytes(bytearray(value))


def test_a_miss_returns_before_a_slow_local_store_holds_its_chunks_and_the_next_request_hits(tiny_llama, tiny_tokenizer):
    """Write-behind (``hot.py``): the 16-bit form is encoded before the request returns and read from memory until stored."""
    store = SlowDisk(opened := threading.Event())
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 1], partial_step=0,
                 allow_text=False)  # tiny model: text and fetching tie, picked by timings  # fmt: skip
    prompt = words(36, 3 * CHUNK + 7)
    try:
        text, _ = e.generate(prompt, max_new_tokens=4)  # returns while the store takes no write at all
        keys = [c.key for c in e.chunks(prompt)]
        assert len(e.writer.hot) == 3 and store.order == [] and e.writer.pending == 3
        again, info = e.generate(prompt, max_new_tokens=4)
        assert info.cached_tokens == 3 * CHUNK and info.levels == ["raw"] * 3 and again == text  # from the hot tier
    finally:
        opened.set()  # else a failure above leaves the worker blocked in put (and the exit flush waiting for it)
    assert e.flush(30) and len(e.writer.hot) == 0 and e.writer.hot.nbytes == 0
    assert all(Manifest.from_bytes(store.get(manifest_key(k))).options == ["raw", 1] for k in keys)
    fresh = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 1], partial_step=0)
    same, info = fresh.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == 3 * CHUNK and same == text  # from the store now, for any engine


def test_a_chunk_the_store_refused_leaves_the_hot_tier(tiny_llama, tiny_tokenizer):
    from cachegen_core.errors import StoreError

    class Refusing(SlowDisk):
        def put(self, key, value):
            raise StoreError("disk full")

    e = KVEngine(tiny_llama, tiny_tokenizer, store=Refusing(), chunk_tokens=CHUNK, store_options=["raw", 1], partial_step=0)
    e.generate(words(37, 2 * CHUNK + 3), max_new_tokens=1)
    assert e.flush(30) and len(e.writer.hot) == 0 and e.store_stats["failed"] == 2
    _, info = e.generate(words(37, 2 * CHUNK + 3), max_new_tokens=1)
    assert info.cached_tokens == 0  # nothing claims a chunk the store does not hold


def test_a_store_that_holds_the_very_objects_gets_the_first_stage_before_the_request_returns(tiny_llama, tiny_tokenizer):
    store = SlowWritesStore()
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 1], partial_step=0)
    prompt = words(38, 2 * CHUNK + 3)
    e.generate(prompt, max_new_tokens=1)
    assert len(e.writer.hot) == 0 and all(store.get(blob_key(c.key, "raw")) is not None for c in e.chunks(prompt))
    e.flush(30)


class GatedStore(MemoryStore):
    """Every write waits for ``gate``, and the keys are recorded in the order they were written."""

    def __init__(self) -> None:
        super().__init__(pinned=False)
        self.gate = threading.Event()
        self.order: list[str] = []

    def put_many(self, items) -> None:
        items = list(items.items() if isinstance(items, dict) else items)
        self.gate.wait(30)
        self.order += [k for k, _ in items]
        super().put_many(items)


def test_staged_raw_forms_leave_the_request_at_once_and_are_written_before_any_level(tiny_llama, tiny_tokenizer):
    """A GPU's miss path on the CPU (``stage_raw=True``): the request writes nothing itself; the worker finishes every
    staged raw form and writes it before any level, the blobs byte for byte those ``encode`` writes, and the next
    request answers as without a cache."""
    store = GatedStore()
    opts = {"chunk_tokens": CHUNK, "level": "lossless", "store_options": ["lossless", 1]}  # answers exactly when warm
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, background=True, **opts)
    e.writer.stage_raw = True
    prompt = words(31, 4 * CHUNK + 3)
    cold, info = e.generate(prompt, max_new_tokens=6)
    assert info.chunks_queued == 4 and store.order == [] and len(store) == 0  # the request returned with nothing written
    store.gate.set()
    assert e.flush(timeout=60)
    raw = e.store_options[0]
    blobs = [store.order.index(blob_key(c.key, raw)) for c in e.chunks(prompt)]
    levels = [store.order.index(blob_key(c.key, 1)) for c in e.chunks(prompt)]
    assert max(blobs) < min(levels)
    plain = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(pinned=False), background=False, **opts)
    plain.generate(prompt, max_new_tokens=6)
    for c in e.chunks(prompt):
        assert store.get(blob_key(c.key, raw)) == plain.store.get(blob_key(c.key, raw))
        assert store.get(blob_key(c.key, 1)) == plain.store.get(blob_key(c.key, 1))  # levels coded from the staged copy
    warm, info = e.generate(prompt, max_new_tokens=6)
    assert info.cached_tokens == 4 * CHUNK and info.levels == ["lossless"] * 4 and warm == cold


def test_staged_raw_forms_of_a_disk_store_are_read_from_the_hot_tier_until_written(tiny_llama, tiny_tokenizer, tmp_path):
    from cachegen_core.stores.disk import DiskCacheStore

    gate = threading.Event()

    class SlowDisk(DiskCacheStore):
        def put_many(self, items):
            gate.wait(30)
            super().put_many(items)

    e = KVEngine(tiny_llama, tiny_tokenizer, store=SlowDisk(tmp_path / "kv"), chunk_tokens=CHUNK, level="lossless",
                 store_options=["lossless", 1], background=True, allow_text=False)  # fmt: skip
    e.writer.stage_raw = True
    prompt = words(32, 3 * CHUNK + 3)
    cold, _ = e.generate(prompt, max_new_tokens=6)
    deadline = time.monotonic() + 30
    while len(e.writer.hot) < 1 and time.monotonic() < deadline:  # the worker finished the first chunk's raw form
        time.sleep(0.01)
    staged = [v for k, v in e.writer.hot._values.items() if k.endswith("-Llossless")]
    assert staged and all(isinstance(v, memoryview) for v in staged)  # blobs framed around the staged copy, not encoded
    warm, info = e.generate(prompt, max_new_tokens=6)
    assert info.cached_tokens >= CHUNK and warm == cold  # found in the hot tier, the store still blocked
    gate.set()
    assert e.flush(timeout=60)
