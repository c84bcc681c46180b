"""The native component decoder computes exactly what the torch path computes; decoding writes into any slice of a KV buffer."""

import pytest
import torch

from cachegen_core.codec import fused
from cachegen_core.codec.classes import bank
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.coders import native_lib
from cachegen_core.codec.config import CodecConfig
from cachegen_core.errors import CacheGenFormatError, CoderError
from cachegen_core.codec.format import unpack
from cachegen_core.kv import KVCache
from cachegen_core.codec.pipeline import magnitude_bound
from cachegen_core.codec.rotary import RotarySpec
from cachegen_core.codec.substreams import stream_layout

pytestmark = pytest.mark.skipif(not native_lib.available(), reason="native coder library not built")


def torch_path(codec: KVCodec, blob: bytes) -> KVCache:
    c = unpack(blob, codec.limits, views=True)
    h = codec.check_header(c.header, len(blob))
    geo = codec._geometry(h.shape[0], h.shape[1], h.shape[2], h.shape[3], h.start)
    mean, step, exact, row = codec._side_info(h, c, geo)
    comps = codec._components_torch(h, geo, step, bank(codec.config.table_classes), stream_layout(geo, row), c, torch.device("cpu"))
    return codec._synthesise(h, comps, mean, step, exact, h.start, None)


def torch_path_at(codec: KVCodec, blob: bytes, start: int) -> KVCache:
    """``torch_path`` with the keys moved to ``start``."""
    c = unpack(blob, codec.limits, views=True)
    h = codec.check_header(c.header, len(blob))
    geo = codec._geometry(h.shape[0], h.shape[1], h.shape[2], h.shape[3], h.start)
    mean, step, exact, row = codec._side_info(h, c, geo)
    comps = codec._components_torch(h, geo, step, bank(codec.config.table_classes), stream_layout(geo, row), c, torch.device("cpu"))
    return codec._synthesise(h, comps, mean, step, exact, start, None)


@pytest.fixture
def kv_path_only(monkeypatch):
    """Decoding must take ``fused.decode_kv`` (the whole reconstruction in C++), not the components path."""

    def refuse(*args, **kwargs):
        raise AssertionError("decode_components used where decode_kv should write the KV")

    monkeypatch.setattr(fused, "decode_components", refuse)


@pytest.mark.parametrize("rotary", [False, True], ids=["keys-as-they-are", "rotary"])
@pytest.mark.parametrize(
    "config",
    [CodecConfig(), CodecConfig(sink_tokens=0), CodecConfig(sink_tokens=4, step_cap=2.0), CodecConfig(stream_symbols=700)],
    ids=["default", "no-sink", "sink4-capped", "many-streams"],
)
def test_bit_exact_with_the_torch_path_at_every_level(tiny_kv, tiny_llama, config, rotary, kv_path_only):
    codec = KVCodec(config, rotary=RotarySpec.from_model(tiny_llama) if rotary else None)
    for kv, start in ((tiny_kv, 0), (tiny_kv.slice(0, 1), 0), (tiny_kv.slice(3, 14), 3), (tiny_kv.slice(3, 14), 0)):
        for level in codec.levels:
            blob = codec.encode(kv, level, start=start)
            ref = torch_path(codec, blob)
            got = codec.decode(blob)
            assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)
            if rotary:  # keys moved to other positions (a document cache landing elsewhere)
                for at in (0, start + 9, 1000):
                    ref, got = torch_path_at(codec, blob, at), codec.decode(blob, start=at)
                    assert torch.equal(got.keys, ref.keys) and torch.equal(got.values, ref.values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kv_decoder_writes_a_slice_in_the_blobs_dtype_bit_exact(tiny_kv, tiny_llama, dtype, kv_path_only):
    codec = KVCodec(CodecConfig(sink_tokens=2), rotary=RotarySpec.from_model(tiny_llama))
    kv = KVCache(tiny_kv.keys.to(dtype), tiny_kv.values.to(dtype)).slice(0, 40)
    for level in codec.levels:
        blob = codec.encode(kv, level, start=0)
        ref = torch_path(codec, blob)
        buf = KVCache(torch.full((3, 2, 100, 16), 7.0, dtype=dtype), torch.full((3, 2, 100, 16), 7.0, dtype=dtype))
        out = buf.slice(30, 70)
        assert codec.decode(blob, out=out) is out
        assert torch.equal(out.keys, ref.keys) and torch.equal(out.values, ref.values)
        assert (buf.keys[:, :, :30] == 7).all() and (buf.values[:, :, 70:] == 7).all()  # nothing outside the slice


def test_the_kv_decoder_refuses_inconsistent_arguments(tiny_kv):
    codec = KVCodec()
    blob = codec.encode(tiny_kv, 1, start=0)
    c = unpack(blob, codec.limits, views=True)
    h = codec.check_header(c.header, len(blob))
    geo = codec._geometry(*h.shape, h.start)
    mean, step, _, row = codec._side_info(h, c, geo)
    layout, freqs = stream_layout(geo, row), bank(codec.config.table_classes)
    lengths = [len(p) for p in c.streams]
    out = KVCache(torch.empty(h.shape), torch.empty(h.shape))
    short = type(layout)(layout.offsets - geo.period * (layout.offsets > 0), layout.table_ids)  # one token too few
    with pytest.raises(CoderError, match="inconsistent arguments"):
        fused.decode_kv(blob, lengths, short, freqs, geo, step, mean, None, out)
    with pytest.raises(ValueError, match="cos/sin"):
        fused.decode_kv(blob, lengths, layout, freqs, geo, step, mean, (torch.ones(3, 16), torch.ones(3, 16)), out)
    fused.decode_kv(blob, lengths, layout, freqs, geo, step, mean, None, out)  # the same call, consistent: decodes
    n_exact = h.shape[2] - geo.coded_tokens  # the sink tokens are the caller's to write
    assert torch.equal(out.values[:, :, n_exact:], torch_path(codec, blob).values[:, :, n_exact:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decodes_into_a_slice_of_a_larger_buffer_in_its_dtype(tiny_kv, dtype):
    codec = KVCodec()
    blob = codec.encode(tiny_kv.slice(0, 40), 1, start=0)
    ref = torch_path(codec, blob)
    buf = KVCache(torch.full((3, 2, 100, 16), 7.0, dtype=dtype), torch.full((3, 2, 100, 16), 7.0, dtype=dtype))
    out = buf.slice(30, 70)
    assert codec.decode(blob, out=out) is out
    assert torch.equal(out.keys, ref.keys.to(dtype)) and torch.equal(out.values, ref.values.to(dtype))  # one rounding
    assert (buf.keys[:, :, :30] == 7).all() and (buf.keys[:, :, 70:] == 7).all()  # nothing outside the slice


def test_a_buffer_of_another_shape_is_a_format_error(tiny_kv):
    codec = KVCodec()
    blob = codec.encode(tiny_kv.slice(0, 40), 1, start=0)
    with pytest.raises(CacheGenFormatError, match="shape"):
        codec.decode(blob, out=KVCache(torch.empty(3, 2, 41, 16), torch.empty(3, 2, 41, 16)))


def test_values_beyond_the_output_dtype_are_refused():
    big = KVCache(torch.randn(2, 1, 20, 8) * 30000, torch.randn(2, 1, 20, 8))
    blob = KVCodec().encode(big, 0, start=0)
    KVCodec().decode(blob)  # float32 holds it
    with pytest.raises(CacheGenFormatError, match="range"):
        KVCodec().decode(blob, out=KVCache(torch.empty(2, 1, 20, 8, dtype=torch.float16), torch.empty(2, 1, 20, 8, dtype=torch.float16)))


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("start", [0, 5])
def test_the_parameters_bound_every_decoded_value(tiny_kv, tiny_llama, start, rotary):
    """The decoder skips the overflow scan when ``magnitude_bound`` is under the dtype's range: it must bound the output."""
    spec = RotarySpec.from_model(tiny_llama) if rotary else None
    codec = KVCodec(CodecConfig(sink_tokens=4), rotary=spec)
    for scale in (1.0, 300.0):
        kv = KVCache(tiny_kv.keys * scale, tiny_kv.values * scale)
        for level in codec.levels:
            blob = codec.encode(kv, level, start=start)
            c = unpack(blob, codec.limits, views=True)
            h = codec.check_header(c.header, len(blob))
            geo = codec._geometry(*h.shape, h.start)
            mean, step, exact, _ = codec._side_info(h, c, geo)
            bound = magnitude_bound(codec._transform(*geo_shape(h)), mean, step, exact, codec.rotary)
            for at in (start, start + 7) if rotary else (start,):  # decoded where it was encoded, and moved
                got = codec.decode(blob, start=at)
                assert max(got.keys.abs().max(), got.values.abs().max()) <= bound


def geo_shape(h):
    return h.shape[0], h.shape[1], h.shape[3]


def test_supports_only_the_native_coder():
    assert fused.supports(native_lib.CODER_NAME) and not fused.supports("torchac")


class _FakeFusingDecoder:
    device = torch.device("cuda", 7)

    @staticmethod
    def fuses(head_dim, rotary):
        return True


def test_a_fused_device_kernel_that_disagrees_once_is_replaced_by_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(fused, "_VERIFIED", set())
    monkeypatch.setattr(fused, "_UNFUSED", set())
    dev = _FakeFusingDecoder.device
    assert fused.fuses_on(_FakeFusingDecoder(), 64, True) and not fused.fuses_on(None, 64, True)
    ref = KVCache(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    good = KVCache(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    fused.verify_once(dev, good, lambda: ref)
    calls = []
    fused.verify_once(dev, good, lambda: calls.append(1) or ref)  # verified: never checked again
    assert not calls and fused.fuses_on(_FakeFusingDecoder(), 64, True)
    other = torch.device("cuda", 6)
    bad = KVCache(torch.ones(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))
    with caplog.at_level("WARNING", logger="cachegen_core.codec.fused"):
        fused.verify_once(other, bad, lambda: ref)
    assert torch.equal(bad.values, ref.values) and "disagrees" in caplog.text  # the reference is what the caller gets
    monkeypatch.setattr(_FakeFusingDecoder, "device", other)
    assert not fused.fuses_on(_FakeFusingDecoder(), 64, True)  # that device decodes without the fused kernel from now on
