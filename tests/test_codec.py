import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.coders import BackendUnavailable
from cachegen_core.coders.native import NativeCoder
from cachegen_core.coders.reference import ReferenceCoder
from cachegen_core.codec.config import CodecConfig
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.codec.format import Limits, pack, read_header, unpack
from cachegen_core.hfcompat import cache_arg
from cachegen_core.kv import KVCache, KVShapeError
from cachegen_core.codec.pipeline import components, dequantise, quantise, synthesise
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.transform import identity_transform

DATA = __import__("pathlib").Path(__file__).parent / "data"


def _expected(kv: KVCache, codec: KVCodec, level: int, start: int = 0) -> KVCache:
    """What decoding must give exactly: the quantiser's own reconstruction."""
    tf = codec.profile.transform if codec.profile is not None and codec.profile.transform is not None else None
    fitted = tf is not None
    tf = tf or identity_transform(kv.num_layers, kv.num_kv_heads, kv.head_dim)
    comp = components(kv, tf, start=start, sink_tokens=codec.config.sink_tokens, rotary=codec.rotary)
    coded = quantise(comp, codec.config.level_step(level, fitted=fitted), fitted=fitted, step_cap=codec.config.step_cap)
    k, v = synthesise(dequantise(coded), coded.mean, coded.exact, tf, start=start, encoded_start=start, rotary=codec.rotary)
    return KVCache(k.to(kv.dtype), v.to(kv.dtype))


@pytest.mark.parametrize("level", range(CodecConfig().n_levels))
def test_round_trip_is_the_quantiser_exactly(tiny_kv, level):
    codec = KVCodec()
    blob = codec.encode(tiny_kv, level, start=0)
    got = codec.decode(blob)
    want = _expected(tiny_kv, codec, level)
    assert got.shape == tiny_kv.shape and got.dtype == tiny_kv.dtype
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert read_header(blob)["level"] == level


def test_levels_get_smaller_and_coarser(tiny_kv):
    codec = KVCodec()
    sizes, errs = [], []
    for lvl in codec.levels:
        blob = codec.encode(tiny_kv, lvl, start=0)
        sizes.append(len(blob))
        errs.append((codec.decode(blob).keys - tiny_kv.keys).square().mean().item())
    assert sizes == sorted(sizes, reverse=True) and errs == sorted(errs)


def test_payload_within_one_percent_of_cross_entropy():
    torch.manual_seed(0)
    kv = KVCache(torch.randn(2, 2, 640, 32).cumsum(2) * 0.1, torch.randn(2, 2, 640, 32))
    _, stats = KVCodec().encode_with_stats(kv, 1, start=0)
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
    blob = with_p.encode(tiny_kv, 1, start=0)
    assert len(blob) < len(without.encode(tiny_kv, 1, start=0))
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
        decoded = codec.decode(codec.encode(kv, 0, start=0))
        cached = tiny_llama.generate(ids, **cache_arg(tiny_llama, decoded.to_dynamic_cache(tiny_llama.config)), max_new_tokens=10, do_sample=False)
    assert torch.equal(plain, cached)


@settings(max_examples=25, deadline=None)
@given(
    config=st.sampled_from([CodecConfig(), CodecConfig(sink_tokens=0), CodecConfig(step_cap=1.0, stream_symbols=48)]),
    layers=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2, 3]),  # 1 = MQA
    tokens=st.sampled_from([1, 2, 9, 10, 11, 19, 161, 333]),
    head_dim=st.sampled_from([1, 4, 8]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    level=st.integers(0, CodecConfig().n_levels - 1),
    start=st.sampled_from([0, 1, 5000]),
    seed=st.integers(0, 10_000),
)
def test_odd_shapes_round_trip(config, layers, kv_heads, tokens, head_dim, dtype, level, start, seed):
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(
        torch.randn(layers, kv_heads, tokens, head_dim, generator=g).to(dtype),
        torch.randn(layers, kv_heads, tokens, head_dim, generator=g).to(dtype),
    )
    codec = KVCodec(config)
    got = codec.decode(codec.encode(kv, level, start=start))
    want = _expected(kv, codec, level, start)
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def _repack_header(blob: bytes, **fields) -> bytes:
    """``blob`` with header fields replaced (and checksums redone)."""
    c = unpack(blob)
    header = {k: v for k, v in c.header.items() if k not in ("sections", "n_streams", "streams_crc32")}
    return pack({**header, **fields}, c.sections, c.streams)


def _small_blob():
    torch.manual_seed(11)
    kv = KVCache(torch.randn(1, 1, 12, 2), torch.randn(1, 1, 12, 2))
    return KVCodec(fingerprint="m1").encode(kv, 1, start=0)


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


@pytest.mark.parametrize("stream", [0, 5, 6, 11])
def test_a_big_blobs_substreams_are_all_checked_when_hashed_in_two_threads(stream):
    """Past PARALLEL_HASH_BYTES the second half of the substreams is hashed by a helper thread: a flipped
    byte in any substream, either half, is reported with its index."""
    from cachegen_core.codec import format as fmt

    rng = np.random.default_rng(stream)
    streams = [rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for _ in range(12)]
    blob = pack({"codec": "test"}, {}, streams)
    assert sum(map(len, streams)) >= fmt.PARALLEL_HASH_BYTES
    assert unpack(blob, views=True).streams == streams
    bad = bytearray(blob)
    bad[len(blob) - (12 - stream) * (1 << 20) + 12345] ^= 0x10
    with pytest.raises(CacheGenFormatError, match=f"substream {stream} checksum mismatch"):
        unpack(bytes(bad))


def test_a_forked_child_hashes_big_blobs_too():
    """The helper thread of the parent does not exist in a forked child (a pre-forking server's workers):
    the child makes its own instead of waiting on the parent's forever."""
    import multiprocessing

    streams = [bytes([i]) * (1 << 20) for i in range(12)]
    blob = pack({"codec": "test"}, {}, streams)
    unpack(blob)  # the parent's helper thread exists now
    child = multiprocessing.get_context("fork").Process(target=unpack, args=(blob,))
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0


def test_foreign_blobs_are_rejected(tiny_kv):
    blob = KVCodec(fingerprint="model-a").encode(tiny_kv, 1, start=0)
    with pytest.raises(CacheGenFormatError, match="another model"):
        KVCodec(fingerprint="model-b").decode(blob)
    with pytest.raises(CacheGenFormatError, match="codec"):
        KVCodec(CodecConfig(sink_tokens=2)).decode(blob)
    with pytest.raises(CacheGenFormatError, match="max_tokens"):
        KVCodec(max_tokens=100).decode(blob)
    with pytest.raises(CacheGenFormatError, match="max_blob_bytes"):
        KVCodec(limits=Limits(max_blob_bytes=1000)).decode(blob)
    with pytest.raises(CacheGenFormatError, match="magic"):
        KVCodec().decode(b"\x89PNG" + blob[4:])


def test_bad_inputs_to_encode(tiny_kv):
    codec = KVCodec()
    with pytest.raises(KVShapeError, match="empty"):
        codec.encode(tiny_kv.slice(0, 0), start=0)
    with pytest.raises(ValueError, match="level"):
        codec.encode(tiny_kv, 9, start=0)
    with pytest.raises(ValueError, match="start"):
        codec.encode(tiny_kv, 1, start=-1)
    with pytest.raises(TypeError, match="start"):  # no default: a later chunk coded as if at 0 costs half again
        codec.encode(tiny_kv, 1)  # type: ignore[call-arg]
    bad = tiny_kv.keys.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(KVShapeError, match="NaN"):
        codec.encode(KVCache(bad, tiny_kv.values), start=0)
    for value in (float("inf"), float("-inf")):  # in the values, at the last element, in float16 too
        bad = tiny_kv.values.clone().half()
        bad[-1, -1, -1, -1] = value
        with pytest.raises(KVShapeError, match="infinite"):
            codec.encode(KVCache(tiny_kv.keys.half(), bad), start=0)


def test_reference_coder_recorded(tiny_kv):
    blob = KVCodec(coder=ReferenceCoder()).encode(tiny_kv.slice(0, 20), 2, start=0)
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
    blob = codec.encode(tiny_kv.slice(0, 30), 2, start=0)
    assert torch.equal(codec.decode(blob, level=2).keys, codec.decode(blob).keys)
    for other in (0, 1, 3):  # a blob planted under another level's key
        with pytest.raises(CacheGenFormatError, match="level 2, expected level"):
            codec.decode(blob, level=other)


def test_check_header_returns_what_decoding_needs(tiny_kv):
    codec = KVCodec(fingerprint="m1")
    kv = tiny_kv.slice(0, 30).to(torch.float16)
    blob = codec.encode(kv, 3, start=0)
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
    blob = KVCodec(coder=NativeCoder()).encode(kv, 1, start=0)
    want = KVCodec().decode(blob)
    monkeypatch.setitem(registry.DEVICE_DECODERS, (NativeCoder.name, "cuda"), _FakeGpuDecoder)
    _FakeGpuDecoder.calls.clear()
    for got in (KVCodec(device="cuda:1").decode(blob), KVCodec().decode(blob, device="cuda:1")):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert _FakeGpuDecoder.calls == [torch.device("cuda:1")] * 2
    with pytest.raises(BackendUnavailable, match="no cuda decoder"):  # torchac decodes on the CPU only
        KVCodec().decode(KVCodec(coder=ReferenceCoder()).encode(kv, 1, start=0), device="cuda:1")


def test_an_unavailable_device_is_a_typed_error_not_a_format_error(tiny_kv, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    blob = KVCodec(coder=NativeCoder()).encode(tiny_kv.slice(0, 40), 1, start=0)
    for call in (lambda: KVCodec(coder=NativeCoder(), device="cuda"), lambda: KVCodec().decode(blob, device="cuda")):
        with pytest.raises(BackendUnavailable, match="CUDA") as e:
            call()
        assert not isinstance(e.value, CacheGenFormatError)
    with pytest.raises(BackendUnavailable, match="no cuda decoder"):
        KVCodec(coder=ReferenceCoder(), device="cuda")
    forged = _repack_header(blob, coder="native-rans99")  # a coder missing here stays a format error on any device
    with pytest.raises(CacheGenFormatError, match="not available here"):
        KVCodec().decode(forged, device="cuda")


# ------------------------------------------------------------------ v2: what is new in the format


def test_a_v1_blob_is_rejected_naming_its_version():
    blob = (DATA / "v1_blob.bin").read_bytes()  # written by the codec before issue 16 (tests/data/README.md)
    assert blob[:6] == b"CGKV\x01\x00"
    with pytest.raises(CacheGenFormatError, match="format version 1.*version 2"):
        KVCodec(fingerprint="m1").decode(blob)


def test_error_bound_per_element(tiny_kv):
    """Each component is within half its step, so each element is within sum_j |B_ij| step_j / 2."""
    codec = KVCodec(CodecConfig(sink_tokens=0))
    blob = codec.encode(tiny_kv, 2, start=0)
    got = codec.decode(blob)
    step = codec.prepare(tiny_kv, 2, start=0).coded.step  # identity transform: B = I
    for kind, (x, y) in enumerate(((tiny_kv.keys, got.keys), (tiny_kv.values, got.values))):
        err = (x - y).abs() - 8 * x.abs() * 2.0**-23
        assert (err <= step[kind][:, :, None, :] / 2).all()


def test_sink_tokens_are_exact_and_only_at_the_context_start(tiny_kv):
    codec = KVCodec(CodecConfig(sink_tokens=2))
    got = codec.decode(codec.encode(tiny_kv, 3, start=0))
    assert torch.equal(got.keys[:, :, :2], tiny_kv.keys[:, :, :2]) and torch.equal(got.values[:, :, :2], tiny_kv.values[:, :, :2])
    assert not torch.equal(got.values[:, :, 2], tiny_kv.values[:, :, 2])
    later = codec.decode(codec.encode(tiny_kv, 3, start=1536))  # a later chunk of the context: no sink in it
    assert not torch.equal(later.values[:, :, 0], tiny_kv.values[:, :, 0])
    assert len(codec.encode(tiny_kv, 3, start=0)) > len(codec.encode(tiny_kv, 3, start=1536))


@pytest.mark.parametrize(
    "shape",
    [(30, 3, 1536, 64), (30, 3, 1024, 64), (4, 8, 1536, 128), (2, 2, 4000, 32)],
    ids=["smollm2-chunk", "smollm2-tail", "7b-like", "narrow-long"],
)
def test_payload_within_half_a_percent_of_entropy_on_chunk_shapes(shape):
    """No short substreams: every substream holds >= stream_symbols symbols, so the rANS flush stays small."""
    torch.manual_seed(sum(shape))
    layers, heads, tokens, dim = shape
    scale = torch.logspace(-1, 1, layers * heads * dim).reshape(layers, heads, 1, dim)
    kv = KVCache(torch.distributions.Laplace(0.0, 1.0).sample((layers, heads, tokens, dim)) * scale,
                 torch.randn(layers, heads, tokens, dim) * scale)  # fmt: skip
    codec = KVCodec(coder=NativeCoder())
    for level in (codec.config.default_level, codec.levels[-1]):
        _, stats = codec.encode_with_stats(kv, level, start=1536)
        assert stats["ideal_bits_per_element"] < 6
        assert stats["payload_bits_per_element"] <= stats["ideal_bits_per_element"] * 1.005
        assert stats["streams"] >= 1


def test_rotary_spec_matches_transformers(tiny_llama):
    from cachegen_core.codec.rotary import RotarySpec

    spec = RotarySpec.from_model(tiny_llama)
    assert spec is not None and spec.head_dim == tiny_llama.config.hidden_size // tiny_llama.config.num_attention_heads
    x = torch.randn(2, 3, 50, spec.head_dim)
    assert torch.allclose(spec.unrotate(spec.rotate(x, 77), 77), x, atol=1e-5)
    pos = torch.arange(300, 350)[None]
    cos, sin = tiny_llama.model.rotary_emb(x, pos)
    mine_cos, mine_sin = spec.cos_sin(300, 50)
    # transformers' module against ours (another code path; RotarySpec.from_model accepts 1e-6): |cos| <= 1, so
    # 1e-6 is 8 float32 ulps of the largest value, while a wrong frequency or position is off by far more
    assert torch.allclose(cos[0], mine_cos, rtol=0, atol=1e-6) and torch.allclose(sin[0], mine_sin, rtol=0, atol=1e-6)
    assert not torch.allclose(spec.cos_sin(301, 50)[0], mine_cos, rtol=0, atol=1e-6)  # one position off: caught


def test_rotate_is_transformers_formula_bit_for_bit_with_and_without_grad(tiny_llama):
    """``rotate`` computes half by half into one buffer (the decoder's hot path): the same float32 operations
    as transformers' ``x * cos + rotate_half(x) * sin``, so the native and GPU decoders stay bit-exact with it."""
    from cachegen_core.codec.rotary import RotarySpec, rotate_half

    spec = RotarySpec.from_model(tiny_llama)
    x = torch.randn(2, 3, 50, spec.head_dim) * 30
    cos, sin = spec.cos_sin(1234, 50)
    assert torch.equal(spec.rotate(x, 1234), x * cos + rotate_half(x) * sin)
    y = x.clone()
    assert spec.rotate(y, 1234, in_place=True) is y and torch.equal(y, x * cos + rotate_half(x) * sin)
    g = x.clone().requires_grad_(True)
    spec.rotate(g, 1234).square().sum().backward()  # the Fisher's backward pass goes through it
    assert torch.isfinite(g.grad).all() and g.grad.abs().sum() > 0


def test_rotary_spec_refuses_what_it_cannot_invert(tiny_llama, monkeypatch):
    from cachegen_core.codec.rotary import RotarySpec

    monkeypatch.setattr(tiny_llama.config, "model_type", "gpt_neox")
    assert RotarySpec.from_model(tiny_llama) is None


def test_decoding_at_another_start_re_rotates_the_keys(tiny_llama):
    """decode(blob, start=s) equals the keys as if they sat at s, up to the quantisation error; layer 0's keys
    depend on the token and its position only, so the model itself says what they are at s."""
    from cachegen_core.codec.rotary import RotarySpec

    spec = RotarySpec.from_model(tiny_llama)
    codec = KVCodec(CodecConfig(sink_tokens=0), rotary=spec)
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (1, 90))
    with torch.no_grad():
        at_p = KVCache.from_dynamic_cache(tiny_llama(ids, position_ids=torch.arange(400, 490)[None], use_cache=True).past_key_values)
        at_s = KVCache.from_dynamic_cache(tiny_llama(ids, position_ids=torch.arange(37, 127)[None], use_cache=True).past_key_values)
    blob = codec.encode(at_p, 0, start=400)
    same = codec.decode(blob)
    assert torch.equal(codec.decode(blob, start=400).keys, same.keys)
    moved = codec.decode(blob, start=37)
    tol = (same.keys - at_p.keys).abs().amax() * 1.01 + 1e-6  # the quantisation error at the encoding position
    assert (moved.keys[0] - at_s.keys[0]).abs().amax() <= tol
    assert torch.equal(moved.values, same.values)
    want = spec.rotate(spec.unrotate(same.keys, 400), 37)
    assert torch.allclose(moved.keys, want, atol=1e-5)
    with pytest.raises(ValueError, match="rotary"):  # without the rotary embedding positions cannot move
        KVCodec(CodecConfig(sink_tokens=0)).decode(KVCodec(CodecConfig(sink_tokens=0)).encode(at_p, 0, start=0), start=5)
    with pytest.raises(CacheGenFormatError, match="rotary"):  # keys coded before RoPE need the same RoPE
        KVCodec(CodecConfig(sink_tokens=0)).decode(blob)


def test_exact_sink_tokens_move_with_the_start(tiny_llama, tiny_kv):
    from cachegen_core.codec.rotary import RotarySpec

    spec = RotarySpec.from_model(tiny_llama)
    codec = KVCodec(rotary=spec)
    blob = codec.encode(tiny_kv, 1, start=0)
    assert torch.equal(codec.decode(blob).keys[:, :, 0], tiny_kv.keys[:, :, 0])
    moved = codec.decode(blob, start=10)
    assert torch.allclose(moved.keys[:, :, :1], spec.rotate(spec.unrotate(tiny_kv.keys[:, :, :1], 0), 10), atol=1e-5)


def test_fitted_transform_round_trip_and_profile_file(tiny_llama, tmp_path):
    """A profile with a Fisher-weighted transform and the rotary embedding: saved, loaded, decoded exactly."""
    from cachegen_core.codec.kvstats import kv_statistics
    from cachegen_core.codec.rotary import RotarySpec
    from cachegen_core.codec.transform import fit_transform

    spec = RotarySpec.from_model(tiny_llama)
    torch.manual_seed(4)
    texts = [torch.randint(3, 128, (200,)).tolist() for _ in range(3)]
    cfg = CodecConfig()
    group = cfg.head_group(2, 16)  # both heads of a layer in one matrix
    stats = kv_statistics(tiny_llama, texts, rotary=spec, contexts=(64, 128), continuation=32, chunk_tokens=64, group=group)
    assert stats.fisher_tokens == 3 * (63 + 127) and stats.covariance_tokens == 3 * 127
    tf = fit_transform(stats.covariance, stats.fisher, 0.1, group=group)
    assert group == 2 and tf.analysis.shape == (2, 3, 1, 32, 32) and tf.shape == (3, 2, 16)
    eye = torch.eye(tf.analysis.shape[-1])
    assert torch.allclose(tf.synthesis @ tf.analysis, eye.expand_as(tf.analysis), atol=1e-4)
    train = []
    for t in texts:
        with torch.no_grad():
            train.append(KVCache.from_dynamic_cache(tiny_llama(torch.tensor([t]), use_cache=True).past_key_values))
    prof = Profile.fit(cfg, train, transform=tf, rotary=spec, chunk_tokens=64, model_fingerprint="tiny")
    loaded = Profile.load(prof.save(tmp_path / "p.safetensors"))
    assert loaded.id == prof.id and loaded.rotary == spec and torch.equal(loaded.transform.synthesis, prof.transform.synthesis)
    # stored with a width per column (3-8 bits, finer for stronger components): within half a step of each column's
    # grid, and inverted exactly
    widths = torch.from_numpy(prof.stored["widths"].astype("int64"))
    assert widths.min() >= 3 and widths.max() <= 8 and widths.float().mean() < 7
    assert torch.equal(widths[0, 0, 0], widths[0, 0, 0].sort(descending=True).values.clamp(3, 8))  # components come strongest first
    half_step = tf.synthesis.abs().amax(dim=-2, keepdim=True) / (2 * ((1 << widths) // 2 - 1))[..., None, :]
    assert ((loaded.transform.synthesis - tf.synthesis).abs() <= half_step * (1 + 1e-5)).all()
    assert not torch.equal(loaded.transform.synthesis, tf.synthesis)
    assert torch.allclose(loaded.transform.analysis.double() @ loaded.transform.synthesis.double(), eye.double().expand_as(tf.analysis), atol=1e-5)
    codec = KVCodec(cfg, loaded)
    assert codec.rotary == spec  # taken from the profile
    kv = train[0].slice(64, 160)
    blob = codec.encode(kv, 1, start=64)
    got = codec.decode(blob)
    want = _expected(kv, codec, 1, start=64)
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert (got.keys - kv.keys).abs().mean() < kv.keys.abs().mean() * 0.2
    L, H, _, D = kv.shape
    buf = KVCache(torch.zeros(L, H, 200, D, dtype=torch.bfloat16), torch.zeros(L, H, 200, D, dtype=torch.bfloat16))
    out = codec.decode(blob, out=buf.slice(64, 160))  # into the prompt's buffer, in the model's dtype: one rounding
    assert torch.equal(out.keys, want.keys.to(torch.bfloat16)) and torch.equal(out.values, want.values.to(torch.bfloat16))
    assert (buf.keys[:, :, :64] == 0).all() and (buf.keys[:, :, 160:] == 0).all()
    buf32 = KVCache(torch.zeros(L, H, 200, D), torch.zeros(L, H, 200, D))
    out32 = codec.decode(blob, out=buf32.slice(64, 160))  # float32: computed in the buffer itself, the same numbers
    assert torch.equal(out32.keys, want.keys) and torch.equal(out32.values, want.values)
    assert (buf32.keys[:, :, :64] == 0).all() and (buf32.keys[:, :, 160:] == 0).all()
    short = train[1].slice(0, 40)  # a shorter chunk with the sink token, decoded in the longer one's components buffer
    got = codec.decode(codec.encode(short, 1, start=0))
    want = _expected(short, codec, 1, start=0)
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    with pytest.raises(ValueError, match="rotary"):
        KVCodec(cfg, loaded, rotary=RotarySpec((1.0,) * (spec.head_dim // 2)))
