"""Raw KV blobs (the ``raw`` and ``lossless`` options): round trips, typed errors, and the engine's
exactness promise (``level="lossless"`` answers exactly as without a cache)."""

import pytest
import torch

from cachegen_core.keys.chunks import blob_key
from cachegen_core.engine import KVEngine
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.kv import KVCache
from cachegen_core.codec.raw import RawCodec, raw_dtype
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_llama, words

CHUNK = 32


def test_lossless_is_bit_exact_and_raw_is_16_bit(tiny_kv):
    rc = RawCodec("fp")
    exact = rc.decode(rc.encode(tiny_kv, "lossless"), "lossless")
    assert exact.dtype == torch.float32 and torch.equal(exact.keys, tiny_kv.keys) and torch.equal(exact.values, tiny_kv.values)
    half = rc.decode(rc.encode(tiny_kv, "raw"), "raw")
    assert half.dtype == torch.float16 and torch.equal(half.keys, tiny_kv.keys.half())
    out = KVCache(torch.empty(tiny_kv.shape), torch.empty(tiny_kv.shape))
    assert rc.decode(rc.encode(tiny_kv, "raw"), "raw", out=out) is out and torch.equal(out.values, tiny_kv.values.half().float())
    bf = KVCache(tiny_kv.keys.bfloat16(), tiny_kv.values.bfloat16())
    assert raw_dtype(bf) == torch.bfloat16 and torch.equal(rc.decode(rc.encode(bf, "raw"), "raw").keys, bf.keys)
    big = KVCache(tiny_kv.keys * 1e5, tiny_kv.values)
    assert raw_dtype(big) == torch.bfloat16  # beyond float16's range: never an inf


def test_every_byte_flip_and_truncation_is_a_format_error(tiny_kv):
    rc = RawCodec("fp")
    blob = rc.encode(tiny_kv.slice(0, 5), "raw")
    for i in range(0, len(blob), max(1, len(blob) // 300)):
        bad = bytearray(blob)
        bad[i] ^= 0x5A
        with pytest.raises(CacheGenFormatError):
            rc.decode(bytes(bad), "raw")
    for n in (0, 10, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CacheGenFormatError):
            rc.decode(blob[:n], "raw")


def test_payload_checks_left_to_decode_still_reject_every_corruption(tiny_kv):
    """``check(payloads=False)`` (a GPU's fetch: the checksums run beside the copy) checks lengths and header only;
    decoding then checks the payloads, once: a flipped payload byte fails there, a good blob round-trips exactly."""
    rc = RawCodec("fp")
    blob = rc.encode(tiny_kv.slice(0, 5), "lossless")
    checked = rc.check(blob, "lossless", payloads=False)
    assert checked.pending is not None
    assert torch.equal(rc.decode(checked, "lossless").keys, tiny_kv.keys[:, :, :5])
    assert checked.pending.bad is None  # checked, and not again on the next decode of the same blob
    bad = bytearray(blob)
    bad[-3] ^= 0x01  # the last payload's bytes: no header, table or length changes
    late = rc.check(bytes(bad), "lossless", payloads=False)  # passes: its checksums are not read yet
    out = KVCache(torch.zeros(tiny_kv.slice(0, 5).shape), torch.zeros(tiny_kv.slice(0, 5).shape))
    with pytest.raises(CacheGenFormatError, match="checksum"):
        rc.decode(late, "lossless", out=out)
    assert not out.keys.any() and not out.values.any()  # nothing of the bad blob was written
    with pytest.raises(CacheGenFormatError, match="checksum"):
        rc.check(bytes(bad), "lossless")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option", ["raw", "lossless"])
def test_a_staged_blob_is_byte_for_byte_the_encoded_one(tiny_kv, dtype, option):
    """``stage`` (the GPU's store path: payloads copied straight into one host buffer, the frame written before them
    afterwards) gives exactly ``encode``'s bytes, in plain memory and in a block of an arena."""
    from cachegen_core.pinned import HostArena

    kv = KVCache(tiny_kv.keys.to(dtype), tiny_kv.values.to(dtype)).slice(3, 40)  # a strided slice, as of a prompt's buffer
    rc = RawCodec("fp")
    arena = HostArena(1 << 22, slab_bytes=1 << 22, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    for alloc in (None, arena.alloc):
        staged = rc.stage(kv, option, alloc)
        assert torch.equal(staged.ready().keys.float(), kv.keys.to(staged.kv.dtype).float())
        assert bytes(staged.finish()) == rc.encode(kv, option)
        assert staged.finish() is staged.finish()  # made once
    assert arena.pinned_bytes > 0


def test_foreign_or_mislabelled_raw_blobs_are_rejected(tiny_kv):
    blob = RawCodec("fp-a").encode(tiny_kv, "raw")
    with pytest.raises(CacheGenFormatError, match="another model"):
        RawCodec("fp-b").decode(blob, "raw")
    with pytest.raises(CacheGenFormatError, match="expected 'lossless'"):
        RawCodec("fp-a").decode(blob, "lossless")
    out = KVCache(torch.empty(3, 2, 7, 16), torch.empty(3, 2, 7, 16))
    with pytest.raises(Exception, match="does not fit"):
        RawCodec("fp-a").decode(blob, "raw", out=out)
    with pytest.raises(ValueError, match="not a raw option"):
        RawCodec().encode(tiny_kv, "level")


def test_level_lossless_answers_exactly_as_without_a_cache(tiny_llama, tiny_tokenizer):
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level="lossless", background=False)
    assert e.store_options == ["lossless"]
    for seed in range(4):  # prompts where a lossy KV flips the tiny model's greedy answer are caught too
        prompt = words(40 + seed, 3 * CHUNK + 7)
        cold, _ = e.generate(prompt, max_new_tokens=12)
        warm, info = e.generate(prompt, max_new_tokens=12)
        assert info.cached_tokens == 3 * CHUNK and set(info.levels) <= {"lossless", "text"}
        ids = torch.tensor([tiny_tokenizer(prompt)["input_ids"]])
        plain = tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=2)
        assert warm == cold == tiny_tokenizer.decode(plain[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_corrupted_raw_blob_is_recomputed(tiny_llama, tiny_tokenizer):
    # text off: chunk 1 must be fetched to be found bad, and after a fetch timed during a stall it was predicted slower
    # than prefilling its 32 tokens
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=CHUNK, level="raw", background=False, allow_text=False)
    prompt = words(50, 3 * CHUNK + 2)
    e.generate(prompt, max_new_tokens=4)
    key = blob_key(e.chunks(prompt)[1].key, "raw")
    blob = bytearray(e.store.get(key))
    blob[-3] ^= 0xFF
    e.store.put(key, bytes(blob))
    _, info = e.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == CHUNK and "bad blob for chunk 1" in info.errors[0]


def test_the_next_request_finds_the_raw_form_before_the_levels_are_written(tiny_llama, tiny_tokenizer):
    """The background writer stores every queued chunk's raw form before any chunk's levels."""
    import threading

    gate = threading.Event()

    class SlowLevels(MemoryStore):
        def put_many(self, items):
            items = list(items)
            if any(not k.endswith(("-Lraw", "-Llossless")) for k, _ in items):
                gate.wait(30)  # levels wait until the second request has been answered
            super().put_many(items)

    e = KVEngine(tiny_llama, tiny_tokenizer, store=SlowLevels(), chunk_tokens=CHUNK, level=1, background=True)
    prompt = words(51, 4 * CHUNK + 3)
    e.generate(prompt, max_new_tokens=2)
    for _ in range(500):  # the raw stage of all four chunks lands quickly
        _, info = e.generate(prompt, max_new_tokens=2)
        if info.cached_tokens == 4 * CHUNK:
            break
    gate.set()
    assert info.cached_tokens == 4 * CHUNK and set(info.levels) <= {"raw", "text"}
    assert e.flush(timeout=60) and e.store_stats["failed"] == 0
    from cachegen_core.keys.manifest import Manifest, manifest_key

    for c in e.chunks(prompt):  # and afterwards every chunk is complete: raw form and levels
        assert Manifest.from_bytes(e.store.get(manifest_key(c.key))).options == ["raw", 1]


def test_default_forms_stored(tiny_llama, tiny_tokenizer):
    """The exact 16-bit form and the level; the coarsest level too when a deadline may need it."""
    model = make_tiny_llama(dtype=torch.float16)
    assert KVEngine(model, tiny_tokenizer, store=MemoryStore(), background=False).store_options == ["lossless", 2]
    assert KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), background=False).store_options == ["raw", 2]
    timed = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), slo_s=1.0, background=False)
    assert timed.store_options == ["raw", 2, 4] and timed.codec.levels[-1] == 4  # the coarsest level
    assert KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), level="raw", background=False).store_options == ["raw"]


def test_forged_raw_headers_are_typed_errors_or_consistent(tiny_kv):
    """Well-formed, re-checksummed raw blobs with any header field changed (an attacker with write access
    to the store, without a signing key): a typed error, or KV of exactly the header's shape and dtype."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cachegen_core.errors import CacheGenError
    from cachegen_core.testing.fuzz.blobs import repack_header

    rc = RawCodec("fp")
    blob = rc.encode(tiny_kv.slice(0, 6), "raw")
    values = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-2, 1 << 40),
        st.text(max_size=8),
        st.lists(st.integers(-1, 70000), max_size=5),
        st.sampled_from(["float32", "float16", "bfloat16", "raw", "lossless"]),
    )

    @settings(max_examples=300, deadline=None)
    @given(field=st.sampled_from(["codec", "option", "dtype", "shape", "model_fingerprint", "n_streams", "extra"]), value=values)
    def check(field, value):
        forged = repack_header(blob, lambda h: h.__setitem__(field, value))
        try:
            kv = rc.decode(forged, "raw")
        except (CacheGenError, ValueError):
            return
        assert kv.shape == tuple(tiny_kv.slice(0, 6).shape) and kv.dtype in (torch.float16, torch.bfloat16)

    check()


def test_manifests_from_the_store_parse_or_are_typed_errors():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cachegen_core.keys.manifest import Manifest

    json_values = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6)),
        lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=6), v, max_size=3),
        max_leaves=10,
    )

    @settings(max_examples=300, deadline=None)
    @given(options=st.dictionaries(st.text(max_size=9), json_values, max_size=5), raw=st.binary(max_size=64))
    def check(options, raw):
        import json

        for data in (json.dumps({"format": "cachegen-manifest-v1", "options": options}).encode(), raw):
            try:
                m = Manifest.from_bytes(data)
            except CacheGenFormatError:
                continue
            assert all((o in ("raw", "lossless") or (isinstance(o, int) and 0 <= o <= 63)) and n > 0 for o, n in m.sizes.items())

    check()
