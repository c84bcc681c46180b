"""The GPU decoder (Triton kernels, ``coders/triton_decoder.py``) against the native CPU decoder: symbols and KV
bit for bit at every level, with and without a profile; hostile payloads and blobs as typed errors, never a read
or write outside the tensors a kernel is given; an engine decoding its warm chunks with it, or saying why not.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``) and that decoder stands in for the CUDA one in the registry; on a GPU they run there.
The interpreter's cost is per operation on a whole block, so cases use short substreams, many decoded side by
side (``CodecConfig(stream_symbols=...)``), and chunks of a few dozen tokens.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

from cachegen_core.codec import fused
from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.rotary import RotarySpec
from cachegen_core.codec.transform import fit_transform
from cachegen_core.coders import BackendUnavailable, StreamLayout, registry
from cachegen_core.coders.native import NativeCoder
from cachegen_core.coders.triton_decoder import TritonDecoder, interpreting, unavailable_reason
from cachegen_core.engine import KVEngine
from cachegen_core.errors import CacheGenFormatError, CoderError
from cachegen_core.kv import KVCache
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_llama, words
from cachegen_core.testing.fuzz.blobs import repack, split
from tests.test_native_coder import layout_of, sample, tables

ONE_TOKEN = CodecConfig(stream_symbols=1)  # a substream per token: the interpreter decodes them side by side


@pytest.fixture(scope="module")
def decoder() -> TritonDecoder:
    """The decoder of this machine's GPU, or without one the interpreted decoder on CPU tensors (CI: required)."""
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    reason = unavailable_reason(device)
    if reason is not None:
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(f"{reason} (the GPU decoder's tests must run when CI is set)", pytrace=False)
        pytest.skip(reason)
    return TritonDecoder(device)


@pytest.fixture
def on_gpu(decoder, monkeypatch) -> TritonDecoder:
    """``KVCodec(device="cuda")`` decodes with ``decoder`` (on a GPU the registry's own), its fused-kernel check fresh."""
    if decoder.device.type == "cpu":
        monkeypatch.setitem(registry.DEVICE_DECODERS, (NativeCoder.name, "cuda"), lambda device: decoder)
    monkeypatch.setattr(fused, "_VERIFIED", set())
    monkeypatch.setattr(fused, "_UNFUSED", set())
    return decoder


@pytest.fixture
def in_bounds(decoder, monkeypatch):
    """In the interpreter: every address a kernel loads or stores lies inside one of the tensors it was given."""
    if decoder.device.type != "cpu":
        yield
        return
    from triton.runtime import interpreter as ti

    spans: list[tuple[int, int]] = []
    checks = [0]
    init, load, store = ti.GridExecutor._init_args_hst, ti.InterpreterBuilder.create_masked_load, ti.InterpreterBuilder.create_masked_store

    def record(self, args_dev, kwargs):
        args, kw = init(self, args_dev, kwargs)
        spans[:] = [_span(a) for a in [*args, *kw.values()] if isinstance(a, torch.Tensor) and a.numel()]
        return args, kw

    def check(ptrs, mask, what):
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        addr = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)].astype(np.uint64)
        inside = np.zeros(addr.shape, dtype=bool)
        for lo, hi in spans:
            inside |= (addr >= lo) & (addr + size <= hi)
        assert inside.all(), f"a {what} outside the kernel's tensors"
        checks[0] += 1

    monkeypatch.setattr(ti.GridExecutor, "_init_args_hst", record)
    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_load", lambda self, p, m, *a: (check(p, m, "load"), load(self, p, m, *a))[1])
    monkeypatch.setattr(ti.InterpreterBuilder, "create_masked_store", lambda self, p, v, m, *a: (check(p, m, "store"), store(self, p, v, m, *a))[1])
    yield
    assert checks[0], "no load was checked: the interpreter's hooks have moved"


def _span(t: torch.Tensor) -> tuple[int, int]:
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _verdict(decode):
    """A decoder's symbols as numpy, or the ``CoderError`` it raised."""
    try:
        return np.asarray(decode())
    except CoderError as e:
        return e


def _same(a, b) -> bool:
    return (isinstance(a, CoderError) and isinstance(b, CoderError)) or (
        isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    )


# ---------------------------------------------------------------------------------------------- symbols

CASES = [  # alphabet, symbols per substream, period, tables
    (256, [0, 1, 17, 400, 5, 253, 300], 192, 9),
    (2, [300, 301], 1, 9),
    (40, [16, 15, 33, 0], 7, 9),
    (256, [96] * 40, 16, 3000),
]


@pytest.mark.parametrize("alphabet,counts,period,n_tables", CASES)
def test_symbols_are_the_cpu_decoders(decoder, in_bounds, alphabet, counts, period, n_tables):
    rng = np.random.default_rng(alphabet + period)
    freqs = tables(rng, n_tables, alphabet, near_zero=alphabet > 2)
    layout = layout_of(counts, rng.integers(0, n_tables, (len(counts), period)))
    sym = sample(rng, freqs, layout)
    payloads = NativeCoder().encode(sym, layout, freqs)
    got = decoder.decode_symbols(payloads, layout, freqs)
    assert got.device.type == decoder.device.type and np.array_equal(got.cpu().numpy(), sym)
    shared = StreamLayout(layout.offsets, np.broadcast_to(layout.table_ids[0], layout.table_ids.shape))  # one row, sent once
    sym = sample(rng, freqs, shared)
    assert np.array_equal(decoder.decode_symbols(NativeCoder().encode(sym, shared, freqs), shared, freqs).cpu().numpy(), sym)


def test_hostile_payloads_get_the_cpu_decoders_verdict(decoder, in_bounds):
    rng = np.random.default_rng(5)
    freqs = tables(rng, 5, 256, near_zero=True)
    layout = layout_of([300, 3, 0, 200], rng.integers(0, 5, (4, 24)))
    sym = sample(rng, freqs, layout)
    cpu = NativeCoder()
    good = cpu.encode(sym, layout, freqs)

    def both(payloads, lay=layout, f=freqs):
        want = _verdict(lambda: cpu.decode(payloads, lay, f))
        got = _verdict(lambda: decoder.decode_symbols(payloads, lay, f).cpu().numpy())
        assert _same(want, got), (want, got)
        return got

    for cut in (2, 1, 64, len(good[0]) - 10):  # truncated: short, odd, into the states
        assert isinstance(both([good[0][:-cut], *good[1:]]), CoderError)
    with pytest.raises(CoderError, match="trailing"):
        decoder.decode_symbols([good[0] + b"\0\0", *good[1:]], layout, freqs)
    with pytest.raises(CoderError, match="trailing"):
        decoder.decode_symbols([*good[:2], b"\0\0", good[3]], layout, freqs)  # bytes for a substream of no symbol
    with pytest.raises(CoderError, match="initial coder state"):
        decoder.decode_symbols([bytes(4) + good[0][4:], *good[1:]], layout, freqs)
    for at in rng.integers(64, len(good[0]) - 1, 8):  # one garbled word: caught (short, trailing or a wrong final state)
        bad = bytearray(good[0])
        bad[at] ^= 1 << int(rng.integers(8))
        assert isinstance(both([bytes(bad), *good[1:]]), CoderError)
    for _ in range(6):  # garbage of any length
        both([rng.integers(0, 256, int(rng.integers(60, 700))).astype(np.uint8).tobytes(), *good[1:]])
    other = layout_of([300, 3, 0, 200], (layout.table_ids + 1) % 5)  # the right bytes, the wrong table ids
    both(good, other)
    with pytest.raises(CoderError, match="outside"):  # a table id out of range: refused before any launch
        decoder.decode_symbols(good, layout_of([300, 3, 0, 200], layout.table_ids + 5), freqs)


# ---------------------------------------------------------------------------------------------- KV


def _decode_both(cpu: KVCodec, gpu: KVCodec, blob: bytes, at: int, dtype: torch.dtype, device: torch.device):
    """The CPU decoder's KV, and the GPU decoder's written into a slice of a larger zeroed buffer (checked untouched)."""
    want = cpu.decode(blob, start=at)
    layers, heads, tokens, dim = want.shape
    buf = KVCache(*(torch.zeros(layers, heads, tokens + 9, dim, dtype=dtype, device=device) for _ in range(2)))
    got = gpu.decode(blob, start=at, out=buf.slice(5, 5 + tokens))
    assert got.keys.data_ptr() == buf.keys[:, :, 5:].data_ptr()
    assert not buf.keys[:, :, :5].any() and not buf.values[:, :, 5 + tokens :].any()
    return want, KVCache(got.keys.cpu(), got.values.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary", [True, False])
def test_kv_is_the_cpu_decoders_at_every_level(on_gpu, in_bounds, tiny_llama, tiny_kv, dtype, rotary):
    spec = RotarySpec.from_model(tiny_llama) if rotary else None
    cpu, gpu = KVCodec(ONE_TOKEN, rotary=spec), KVCodec(ONE_TOKEN, rotary=spec, device="cuda")
    kv = tiny_kv.slice(0, 20).to(dtype)  # from position 0: the exact sink token too
    for level in cpu.levels:
        want, got = _decode_both(cpu, gpu, cpu.encode(kv, level, start=0), 7 if rotary else 0, dtype, on_gpu.device)
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert str(on_gpu.device) in fused._VERIFIED  # the fused kernel wrote them, and agreed with the torch path


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.float32), (8, torch.float16)])
def test_rotary_pairs_in_one_lane_and_in_one_round(on_gpu, in_bounds, head_dim, dtype):
    """head_dim 64 and 128: a key's pair is the same lane's, head_dim / 32 rounds apart; 8: two head vectors a round."""
    torch.manual_seed(head_dim)
    spec = RotarySpec(tuple(10000.0 ** (-i / (head_dim // 2)) for i in range(head_dim // 2)))
    kv = KVCache(torch.randn(2, 1, 6, head_dim).cumsum(2), torch.randn(2, 1, 6, head_dim)).to(dtype)
    cpu, gpu = KVCodec(ONE_TOKEN, rotary=spec), KVCodec(ONE_TOKEN, rotary=spec, device="cuda")
    for level in (0, 3):
        want, got = _decode_both(cpu, gpu, cpu.encode(kv, level, start=40), 1000, dtype, on_gpu.device)
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert str(on_gpu.device) in fused._VERIFIED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_with_a_profile_at_every_level(on_gpu, in_bounds, tiny_llama, tiny_kv, dtype):
    """A profile's per-component tables (the fused kernel), and its transform: components dequantised by the kernel,
    the matmul in torch. On the CPU that is the CPU decoder's torch code: bit for bit. On a GPU the matmul is
    cuBLAS's, summed in another order: within one unit in the last place of a 16-bit dtype, and of float32's
    resolution at the vector's magnitude."""
    spec = RotarySpec.from_model(tiny_llama)
    _, heads, _, dim = tiny_kv.shape
    group = ONE_TOKEN.head_group(heads, dim)  # the heads of a layer in one matrix
    a = torch.randn(2, tiny_kv.num_layers, heads // group, group * dim, group * dim, generator=torch.Generator().manual_seed(0))
    transform = fit_transform(a @ a.transpose(-1, -2) + torch.eye(group * dim), group=group)
    for tf in (None, transform):
        profile = Profile.fit(ONE_TOKEN, [tiny_kv.slice(0, 120)], transform=tf, rotary=spec, chunk_tokens=60)
        cpu, gpu = KVCodec(ONE_TOKEN, profile), KVCodec(ONE_TOKEN, profile, device="cuda")
        for level in cpu.levels:
            want, got = _decode_both(cpu, gpu, cpu.encode(tiny_kv.slice(130, 150).to(dtype), level, start=130), 130, dtype, on_gpu.device)
            for g, w in ((got.keys, want.keys), (got.values, want.values)):
                if tf is None or on_gpu.device.type == "cpu":
                    assert torch.equal(g, w)
                else:
                    ulp = (
                        torch.finfo(dtype).eps * w.float().abs().amax(dim=-1, keepdim=True)
                        if dtype == torch.float32
                        else torch.finfo(dtype).eps * w.float().abs()
                    )
                    assert ((g.float() - w.float()).abs() <= ulp * (8 if dtype == torch.float32 else 1)).all()


def test_one_long_substream_of_the_default_configuration(on_gpu, in_bounds, tiny_kv):
    cpu, gpu = KVCodec(), KVCodec(device="cuda")
    blob = cpu.encode(tiny_kv.slice(0, 8), 1, start=0)
    want, got = _decode_both(cpu, gpu, blob, 0, tiny_kv.dtype, on_gpu.device)
    assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)


def test_hostile_blobs_are_typed_errors_as_on_the_cpu(on_gpu, in_bounds, tiny_kv):
    """Blobs forged with valid checksums (only the decoder can tell): the same verdict as the CPU decoder's, and the
    same KV when both accept."""
    cpu, gpu = KVCodec(ONE_TOKEN), KVCodec(ONE_TOKEN, device="cuda")
    blob = cpu.encode(tiny_kv.slice(0, 12), 2, start=0)
    rng = np.random.default_rng(3)
    forged = []
    for i in (0, 5):
        p = split(blob)
        p.streams[i] = p.streams[i][:-2]  # truncated
        forged.append(repack(p))
        p = split(blob)
        s = bytearray(p.streams[i])
        s[int(rng.integers(64, len(s)))] ^= 0x10  # a garbled word
        p.streams[i] = bytes(s)
        forged.append(repack(p))
    p = split(blob)
    p.streams[3] = p.streams[4]  # another token's substream: decodes, to the wrong token
    forged.append(repack(p))
    p = split(blob)
    p.sections["classes"] = np.roll(p.sections["classes"], 1, axis=0)  # every component now reads another class
    forged.append(repack(p))
    rejected = 0
    for bad in forged:
        verdicts = []
        for codec in (cpu, gpu):
            try:
                kv = codec.decode(bad)
                verdicts.append(KVCache(kv.keys.cpu(), kv.values.cpu()))
            except CacheGenFormatError as e:
                verdicts.append(e)
        if isinstance(verdicts[0], CacheGenFormatError):
            assert isinstance(verdicts[1], CacheGenFormatError), verdicts
            rejected += 1
        else:
            assert isinstance(verdicts[1], KVCache), verdicts
            assert torch.equal(verdicts[0].keys, verdicts[1].keys) and torch.equal(verdicts[0].values, verdicts[1].values)
    assert rejected >= 4  # the truncated and garbled substreams at least


# ---------------------------------------------------------------------------------------------- the engine


def _engine(tiny_llama, tiny_tokenizer) -> KVEngine:
    codec = KVCodec(CodecConfig(stream_symbols=4 * 192))  # substreams of 4 tokens of the tiny model
    return KVEngine(tiny_llama, tiny_tokenizer, codec, MemoryStore(), chunk_tokens=32, level=1, store_options=[1],
                    background=False, allow_text=False, partial_step=0)  # fmt: skip


def test_a_warm_request_decodes_on_the_models_device_and_says_so(on_gpu, tiny_tokenizer):
    """On a GPU the model, its buffers and the decode are all there; without one the decoder's CPU tensors stand in."""
    engine = _engine(make_tiny_llama().to(on_gpu.device), tiny_tokenizer)
    prompt = words(4, 70)
    engine.generate(prompt, max_new_tokens=6)  # cold: two chunks stored
    assert engine.reader.use_device(torch.device("cpu")) is None
    want, info = engine.generate(prompt, max_new_tokens=6)
    assert info.levels == [1, 1] and info.decode_device == "cpu"
    assert engine.reader.use_device(torch.device("cuda")) is None  # what an engine does with a model on a GPU
    text, info = engine.generate(prompt, max_new_tokens=6)
    assert text == want and info.levels == [1, 1] and info.decode_device == "cuda" and not info.errors
    assert str(on_gpu.device) in fused._VERIFIED  # the fused kernel wrote the chunks into the buffer


def test_a_device_decoder_that_fails_falls_back_to_the_cpu_once_and_says_so(on_gpu, monkeypatch, caplog, tiny_tokenizer):
    prompt = words(5, 70)
    engine = _engine(make_tiny_llama().to(on_gpu.device), tiny_tokenizer)
    engine.generate(prompt, max_new_tokens=6)
    want, _ = engine.generate(prompt, max_new_tokens=6)

    def broken(*args, **kwargs):
        raise BackendUnavailable("the kernel does not compile here")

    monkeypatch.setattr(TritonDecoder, "decode_kv", broken)
    assert engine.reader.use_device(torch.device("cuda")) is None
    with caplog.at_level(logging.WARNING, logger="cachegen_core.engine"):
        text, info = engine.generate(prompt, max_new_tokens=6)
        again, info2 = engine.generate(prompt, max_new_tokens=6)
    assert text == again == want and info.decode_device == info2.decode_device == "cpu"
    assert any("does not compile" in e for e in info.errors) and not info2.errors
    assert caplog.text.count("decoding on the CPU from now on") == 1


def test_a_blobs_substreams_go_to_the_device_without_being_joined():
    """Payloads that follow one another in one buffer (a blob's substreams) are sent as one view of it, not joined
    into fresh memory; any others are joined, in order."""
    from cachegen_core.coders.triton_decoder import _joined

    blob = bytes(range(200))
    mv = memoryview(blob)
    parts = [mv[10:30], mv[30:31], mv[31:90]]
    data, offsets = _joined(parts, 3)
    assert np.shares_memory(data, np.frombuffer(blob, np.uint8)) and data.tobytes() == blob[10:90]
    assert offsets.tolist() == [0, 20, 21, 80]
    shuffled = [mv[30:31], mv[10:30]]
    data, _ = _joined(shuffled, 2)
    assert not np.shares_memory(data, np.frombuffer(blob, np.uint8)) and data.tobytes() == blob[30:31] + blob[10:30]
    data, _ = _joined([b"ab", b"cd"], 2)
    assert data.tobytes() == b"abcd"
    with pytest.raises(CoderError):
        _joined(parts, 4)
