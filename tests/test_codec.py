import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cachegen_core.codec import KVCodec
from cachegen_core.coders import BackendUnavailable
from cachegen_core.coders.native import NativeCoder
from cachegen_core.coders.reference import ReferenceCoder
from cachegen_core.config import CodecConfig
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.format import Limits, pack, read_header, unpack
from cachegen_core.kv import KVCache, KVShapeError, merge_heads, split_heads
from cachegen_core.profile import Profile


def _expected(kv: KVCache, codec: KVCodec, level: int) -> KVCache:
    """What decoding must give exactly: the quantiser's own reconstruction."""
    out = []
    for kind, x in enumerate((kv.keys, kv.values)):
        q = codec.config.quantize(merge_heads(x), level, kind)
        out.append(split_heads(codec.config.dequantize(q, kv.num_tokens), kv.num_kv_heads).to(kv.dtype))
    return KVCache(*out)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_round_trip_is_the_quantiser_exactly(tiny_kv, level):
    codec = KVCodec()
    blob = codec.encode(tiny_kv, level)
    got = codec.decode(blob)
    want = _expected(tiny_kv, codec, level)
    assert got.shape == tiny_kv.shape and got.dtype == tiny_kv.dtype
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert read_header(blob)["level"] == level


def test_levels_get_smaller_and_coarser(tiny_kv):
    codec = KVCodec()
    sizes, errs = [], []
    for lvl in codec.levels:
        blob = codec.encode(tiny_kv, lvl)
        sizes.append(len(blob))
        errs.append((codec.decode(blob).keys - tiny_kv.keys).square().mean().item())
    assert sizes == sorted(sizes, reverse=True) and errs == sorted(errs)


def test_payload_within_one_percent_of_cross_entropy():
    torch.manual_seed(0)
    kv = KVCache(torch.randn(2, 2, 640, 32).cumsum(2) * 0.1, torch.randn(2, 2, 640, 32))
    _, stats = KVCodec().encode_with_stats(kv, 1)
    assert stats["payload_bits_per_element"] <= stats["ideal_bits_per_element"] * 1.01
    assert stats["payload_bits_per_element"] >= stats["ideal_bits_per_element"] * 0.999


def test_profile_codec_is_smaller_and_exact(tiny_llama, tiny_kv, tmp_path):
    torch.manual_seed(5)
    train = []
    for _ in range(4):
        ids = torch.randint(3, 128, (1, 300))
        with torch.no_grad():
            train.append(KVCache.from_dynamic_cache(tiny_llama(ids, use_cache=True).past_key_values))
    cfg = CodecConfig()
    prof = Profile.fit(cfg, train, chunk_tokens=160, model_fingerprint="tiny")
    path = prof.save(tmp_path / "p.safetensors")
    loaded = Profile.load(path)
    assert loaded.id == prof.id and np.array_equal(loaded.freqs, prof.freqs)
    with_p, without = KVCodec(cfg, loaded), KVCodec(cfg)
    blob = with_p.encode(tiny_kv, 1)
    assert len(blob) < len(without.encode(tiny_kv, 1))
    assert read_header(blob)["profile_id"] == prof.id
    want = _expected(tiny_kv, with_p, 1)
    assert torch.equal(with_p.decode(blob).keys, want.keys)
    with pytest.raises(CacheGenFormatError, match="profile"):
        without.decode(blob)


@pytest.mark.parametrize("seed", [0, 2, 4])
def test_finest_level_generates_the_same_greedy_tokens(tiny_llama, seed):
    torch.manual_seed(seed)
    ids = torch.randint(3, 128, (1, 120))
    codec = KVCodec()
    with torch.no_grad():
        plain = tiny_llama.generate(ids, max_new_tokens=10, do_sample=False)
        kv = KVCache.from_dynamic_cache(tiny_llama(ids[:, :-1], use_cache=True).past_key_values)
        decoded = codec.decode(codec.encode(kv, 0))
        cached = tiny_llama.generate(ids, past_key_values=decoded.to_dynamic_cache(tiny_llama.config), max_new_tokens=10, do_sample=False)
    assert torch.equal(plain, cached)


@settings(max_examples=25, deadline=None)
@given(
    config=st.sampled_from([CodecConfig(), CodecConfig(anchor_mode="level"), CodecConfig(delta_scale="channel")]),
    layers=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2, 3]),  # 1 = MQA
    tokens=st.sampled_from([1, 2, 9, 10, 11, 19, 161, 333]),
    head_dim=st.sampled_from([1, 4, 8]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    level=st.integers(0, 3),
    seed=st.integers(0, 10_000),
)
def test_odd_shapes_round_trip(config, layers, kv_heads, tokens, head_dim, dtype, level, seed):
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(
        torch.randn(layers, kv_heads, tokens, head_dim, generator=g).to(dtype),
        torch.randn(layers, kv_heads, tokens, head_dim, generator=g).to(dtype),
    )
    codec = KVCodec(config)
    got = codec.decode(codec.encode(kv, level))
    want = _expected(kv, codec, level)
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def _repack_header(blob: bytes, **fields) -> bytes:
    """``blob`` with header fields replaced (and checksums redone)."""
    c = unpack(blob)
    header = {k: v for k, v in c.header.items() if k not in ("sections", "n_streams", "streams_crc32")}
    return pack({**header, **fields}, c.sections, c.streams)


def _small_blob():
    torch.manual_seed(11)
    kv = KVCache(torch.randn(1, 1, 12, 2), torch.randn(1, 1, 12, 2))
    return KVCodec(fingerprint="m1").encode(kv, 1)


def test_every_truncation_is_a_format_error():
    blob = _small_blob()
    codec = KVCodec(fingerprint="m1")
    codec.decode(blob)
    for n in range(len(blob)):
        with pytest.raises(CacheGenFormatError):
            codec.decode(blob[:n])
    with pytest.raises(CacheGenFormatError, match="trailing"):
        codec.decode(blob + b"\0")


def test_every_single_byte_corruption_is_a_format_error():
    blob = _small_blob()
    codec = KVCodec(fingerprint="m1")
    for i in range(len(blob)):
        for flip in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[i] ^= flip
            with pytest.raises(CacheGenFormatError):
                codec.decode(bytes(bad))


def test_foreign_blobs_are_rejected(tiny_kv):
    blob = KVCodec(fingerprint="model-a").encode(tiny_kv, 1)
    with pytest.raises(CacheGenFormatError, match="another model"):
        KVCodec(fingerprint="model-b").decode(blob)
    with pytest.raises(CacheGenFormatError, match="codec"):
        KVCodec(CodecConfig(group_size=5)).decode(blob)
    with pytest.raises(CacheGenFormatError, match="max_tokens"):
        KVCodec(max_tokens=100).decode(blob)
    with pytest.raises(CacheGenFormatError, match="max_blob_bytes"):
        KVCodec(limits=Limits(max_blob_bytes=1000)).decode(blob)
    with pytest.raises(CacheGenFormatError, match="magic"):
        KVCodec().decode(b"\x89PNG" + blob[4:])


def test_bad_inputs_to_encode(tiny_kv):
    codec = KVCodec()
    with pytest.raises(KVShapeError, match="empty"):
        codec.encode(tiny_kv.slice(0, 0))
    with pytest.raises(ValueError, match="level"):
        codec.encode(tiny_kv, 9)
    bad = tiny_kv.keys.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(KVShapeError, match="NaN"):
        codec.encode(KVCache(bad, tiny_kv.values))


def test_reference_coder_recorded(tiny_kv):
    blob = KVCodec(coder=ReferenceCoder()).encode(tiny_kv.slice(0, 20), 2)
    assert read_header(blob)["coder"] == "torchac"


def test_forged_header_cannot_make_the_decoder_allocate_without_bound():
    from cachegen_core.testing.fuzz import repack_header as _repack

    blob = _small_blob()

    for tokens in (100_000, 32_000):  # within max_tokens, far beyond what 1 KB holds; 32000 keeps the stream count

        def claim_many(h, tokens=tokens):
            h["shape"][2] = tokens

        with pytest.raises(CacheGenFormatError):
            KVCodec(fingerprint="m1").decode(_repack(blob, claim_many))
    assert len(blob) * 2048 < 2 * 1 * 2 * 10**7  # the element bound would stop a claim of 10M tokens

    def list_dtype(h):
        h["dtype"] = ["float32"]

    with pytest.raises(CacheGenFormatError, match="string"):
        KVCodec(fingerprint="m1").decode(_repack(blob, list_dtype))


def test_decode_checks_the_expected_level(tiny_kv):
    codec = KVCodec()
    blob = codec.encode(tiny_kv.slice(0, 30), 2)
    assert torch.equal(codec.decode(blob, level=2).keys, codec.decode(blob).keys)
    for other in (0, 1, 3):  # a blob planted under another level's key
        with pytest.raises(CacheGenFormatError, match="level 2, expected level"):
            codec.decode(blob, level=other)


def test_check_header_returns_what_decoding_needs(tiny_kv):
    codec = KVCodec(fingerprint="m1")
    kv = tiny_kv.slice(0, 30).to(torch.float16)
    blob = codec.encode(kv, 3)
    h = codec.check_header(read_header(blob), len(blob))
    assert (h.level, h.shape, h.dtype, h.tables, h.coder) == (3, kv.shape, torch.float16, "inline", codec.coder.name)
    assert (h.profile_id, h.model_fingerprint, h.channels) == (None, "m1", kv.num_kv_heads * kv.head_dim)
    with pytest.raises(CacheGenFormatError, match="another model"):
        KVCodec(fingerprint="m2").check_header(read_header(blob), len(blob))
    with pytest.raises(CacheGenFormatError, match="too many"):  # a header cannot claim more than its blob can hold
        codec.check_header(read_header(blob), 1)


class _FakeGpuDecoder:
    """Stands in for a GPU decoder of the native format: the CPU coder's symbols, with a record of the call."""

    calls: list[torch.device] = []

    def __init__(self, device: torch.device) -> None:
        from cachegen_core.coders import get_coder

        self.device = device
        self.name = NativeCoder.name
        self._coder = get_coder(NativeCoder.name)

    def decode_symbols(self, payloads, layout, freqs):
        self.calls.append(self.device)
        return torch.from_numpy(self._coder.decode(payloads, layout, freqs))


def test_decode_uses_the_decoder_of_the_device(tiny_kv, monkeypatch):
    from cachegen_core.coders import registry

    kv = tiny_kv.slice(0, 40)
    blob = KVCodec(coder=NativeCoder()).encode(kv, 1)
    want = KVCodec().decode(blob)
    monkeypatch.setitem(registry.DEVICE_DECODERS, (NativeCoder.name, "cuda"), _FakeGpuDecoder)
    _FakeGpuDecoder.calls.clear()
    for got in (KVCodec(device="cuda:1").decode(blob), KVCodec().decode(blob, device="cuda:1")):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert _FakeGpuDecoder.calls == [torch.device("cuda:1")] * 2
    with pytest.raises(BackendUnavailable, match="no cuda decoder"):  # torchac decodes on the CPU only
        KVCodec().decode(KVCodec(coder=ReferenceCoder()).encode(kv, 1), device="cuda:1")


def test_an_unavailable_device_is_a_typed_error_not_a_format_error(tiny_kv, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    blob = KVCodec(coder=NativeCoder()).encode(tiny_kv.slice(0, 40), 1)
    for call in (lambda: KVCodec(coder=NativeCoder(), device="cuda"), lambda: KVCodec().decode(blob, device="cuda")):
        with pytest.raises(BackendUnavailable, match="CUDA") as e:
            call()
        assert not isinstance(e.value, CacheGenFormatError)
    with pytest.raises(BackendUnavailable, match="no cuda decoder"):
        KVCodec(coder=ReferenceCoder(), device="cuda")
    forged = _repack_header(blob, coder="native-rans99")  # a coder missing here stays a format error on any device
    with pytest.raises(CacheGenFormatError, match="not available here"):
        KVCodec().decode(forged, device="cuda")
