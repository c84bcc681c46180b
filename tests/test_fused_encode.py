"""The native encoder (csrc/kv_encode.cpp) quantises exactly as the torch path does: means, steps,
symbols, counts and whole blobs bit-identical, for any slice of a buffer, with and without sink
tokens, rotary embedding and profile; its C entry point checks its arguments."""

import platform

import numpy as np
import pytest
import torch

from cachegen_core.codec import fused_encode
from cachegen_core.codec.kvcodec import KVCodec
from cachegen_core.coders import native_lib
from cachegen_core.codec.config import CodecConfig
from cachegen_core.codec.fused_encode import quantise_chunk
from cachegen_core.kv import KVCache, KVShapeError
from cachegen_core.codec.profile import Profile
from cachegen_core.codec.quantize import ALPHABET
from cachegen_core.codec.rotary import RotarySpec
from cachegen_core.codec.transform import fit_transform, identity_transform

pytestmark = [
    pytest.mark.skipif(not native_lib.available(), reason="native coder library not built"),
    pytest.mark.skipif(platform.machine().lower() not in fused_encode.X86, reason="torch's reduction order is followed on x86-64"),
]


def random_kv(layers: int, heads: int, tokens: int, dim: int, seed: int = 0, buffer: int | None = None) -> KVCache:
    """Keys with per-channel offsets (means far from zero, as real un-rotated keys have) and values;
    with ``buffer``, a token slice [3, 3 + tokens) of a larger buffer."""
    g = torch.Generator().manual_seed(seed)
    total = buffer or tokens
    keys = torch.randn(layers, heads, total, dim, generator=g) * torch.logspace(-1, 1, dim) + 20 * torch.randn(dim, generator=g)
    values = torch.randn(layers, heads, total, dim, generator=g).cumsum(2) * 0.1
    kv = KVCache(keys, values)
    return kv.slice(3, 3 + tokens) if buffer else kv


def both_paths(kv: KVCache, level_step: float, **kw) -> tuple:
    transform = kw.pop("transform", None) or identity_transform(kv.num_layers, kv.num_kv_heads, kv.head_dim)
    ref = quantise_chunk(kv, transform, level_step, native=False, count=True, **kw)
    got = quantise_chunk(kv, transform, level_step, native=True, count=True, **kw)
    return ref, got


def assert_same(ref: tuple, got: tuple, layers: int) -> None:
    (rc, rflat, rcounts), (gc, gflat, gcounts) = ref, got
    assert rcounts is None  # only the native pass counts
    assert torch.equal(gc.mean, rc.mean) and torch.equal(gc.step, rc.step) and torch.equal(gc.exact, rc.exact)
    assert np.array_equal(gflat, rflat) and torch.equal(gc.symbols, rc.symbols)
    rows = rflat.reshape(rc.symbols.shape[3], 2 * layers, -1)  # (token, table, channel)
    want = np.stack([np.bincount(rows[:, t].ravel(), minlength=ALPHABET) for t in range(2 * layers)])
    assert np.array_equal(gcounts, want)


def spec(scaling: float = 1.0, dim: int = 16) -> RotarySpec:
    return RotarySpec(tuple((10000.0 ** (-torch.arange(0, dim, 2).float() / dim)).tolist()), scaling)


@pytest.mark.parametrize("config", [CodecConfig(), CodecConfig(sink_tokens=0), CodecConfig(sink_tokens=4, step_cap=2.0)],
                         ids=["default", "no-sink", "sink4-capped"])  # fmt: skip
@pytest.mark.parametrize("rotary", [None, 1.0, 0.7], ids=["no-rotary", "rotary", "rotary-scaled"])
def test_tiny_model_kv_identical_at_every_level(tiny_kv, config, rotary):
    rot = None if rotary is None else spec(rotary, tiny_kv.head_dim)
    cases = ((tiny_kv, 0), (tiny_kv.slice(3, 40), 3), (tiny_kv.slice(3, 40), 0), (tiny_kv.slice(9, 10), 9), (tiny_kv.slice(0, 6), 0))
    for kv, start in cases:
        for level in range(config.n_levels):
            ref, got = both_paths(kv, config.level_step(level, fitted=False), fitted=False, step_cap=config.step_cap,
                                  start=start, sink_tokens=config.sink_tokens, rotary=rot)  # fmt: skip
            assert_same(ref, got, kv.num_layers)


def random_weights(kv: KVCache, seed: int = 0) -> torch.Tensor:
    """Step weights log-uniform in [1/8, 8], as ``weights.step_weights`` keeps them."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp((torch.rand(2, kv.num_layers, kv.num_kv_heads, kv.head_dim, generator=g) * 2 - 1) * np.log(8.0))


@pytest.mark.parametrize("rotary", [None, 1.0], ids=["no-rotary", "rotary"])
def test_step_weights_identical_on_both_paths(tiny_kv, rotary):
    """Without a profile, steps multiplied by each component's weight: the same floats natively (base * weight)."""
    config, rot, w = CodecConfig(sink_tokens=4, step_cap=2.0), None if rotary is None else spec(rotary, tiny_kv.head_dim), random_weights(tiny_kv)
    for kv, start in ((tiny_kv, 0), (tiny_kv.slice(3, 40), 3), (tiny_kv.slice(9, 10), 9)):
        for level in range(config.n_levels):
            for cap in (0.0, config.step_cap):
                ref, got = both_paths(kv, config.level_step(level, fitted=False, weighted=True), fitted=False, step_cap=cap,
                                      start=start, sink_tokens=config.sink_tokens, rotary=rot, weights=w)  # fmt: skip
                assert_same(ref, got, kv.num_layers)
    plain = quantise_chunk(tiny_kv, identity_transform(*w.shape[1:]), 0.5, fitted=False)[0].step
    weighted = quantise_chunk(tiny_kv, identity_transform(*w.shape[1:]), 0.5, fitted=False, weights=w)[0].step
    assert not torch.equal(plain, weighted)  # the weights are applied


@pytest.mark.parametrize("dim", [8, 16, 48, 64])  # row sums only, both kinds of column, cascades only
@pytest.mark.parametrize("tokens", [2, 37, 700])
def test_sums_in_torch_order_give_identical_means_and_steps(dim, tokens):
    """Means far from zero and 700 tokens: summed in any other order, float32 means differ (and some bfloat16 ones)."""
    kv = random_kv(3, 2, tokens, dim, seed=dim + tokens, buffer=tokens + 9)
    for cap in (0.0, 1.5):
        ref, got = both_paths(kv, 0.3, fitted=False, step_cap=cap, sink_tokens=1, rotary=spec(1.0, dim))
        assert_same(ref, got, 3)


@pytest.mark.parametrize("dim", [1, 3, 5, 12])  # torch folds one column away; fewer than 8 columns are summed otherwise
def test_odd_head_dims_without_rotary(dim):
    kv = random_kv(2, 3, 70, dim, seed=dim, buffer=80)
    for cap in (0.0, 1.5):
        ref, got = both_paths(kv, 0.3, fitted=False, step_cap=cap, sink_tokens=1)
        assert_same(ref, got, 2)


def test_torch_sum_order_is_torchs_bit_for_bit():
    """csrc/torch_sum.h adds in the order of torch's CPU reductions (the claim every identity above rests on)."""
    lib = native_lib.cpu_library()
    g = torch.Generator().manual_seed(3)
    for outer, rows, cols in (
        (2, 1, 1),
        (2, 5, 7),
        (2, 6, 1),
        (3, 9, 1),
        (2, 3, 2),
        (2, 40, 7),
        (3, 300, 16),
        (2, 1000, 64),
        (2, 333, 48),
        (2, 4100, 96),
        (2, 70000, 8),
        (2, 2, 3),
    ):
        x = (torch.randn(outer, rows, cols, generator=g) * 3 + 50).contiguous()
        col, inner = np.empty((outer, cols), np.float32), np.empty(outer, np.float32)
        assert lib.cg_torch_sums(x.data_ptr(), outer, rows, cols, col.ctypes.data, inner.ctypes.data) == 0
        assert torch.equal(torch.from_numpy(col), x.sum(dim=1)), (outer, rows, cols)
        assert torch.equal(torch.from_numpy(inner), x.sum(dim=(1, 2))), (outer, rows, cols)
        naive = x.double().sum(dim=1).float()
        assert rows < 300 or not torch.equal(naive, x.sum(dim=1))  # the order matters for these inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_blobs_byte_identical_to_the_torch_path(tiny_kv, tiny_llama, monkeypatch, dtype):
    rot = RotarySpec.from_model(tiny_llama)
    buf = KVCache(tiny_kv.keys.to(dtype), tiny_kv.values.to(dtype))
    weighted = KVCodec(rotary=rot, weights=random_weights(tiny_kv, 1))
    for codec in (KVCodec(), KVCodec(CodecConfig(sink_tokens=4), rotary=rot), KVCodec(CodecConfig(stream_symbols=700)), weighted):
        for kv, start in ((buf, 0), (buf.slice(5, 100), 5), (buf.slice(0, 1), 0), (buf.slice(7, 8), 7)):
            native = [codec.encode(kv, level, start=start) for level in codec.levels]
            with monkeypatch.context() as m:
                m.setattr(fused_encode, "supports", lambda kv: False)
                assert native == [codec.encode(kv, level, start=start) for level in codec.levels]


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_decoded_components_within_half_a_step(tiny_kv, weighted):
    codec = KVCodec(weights=random_weights(tiny_kv, 2) if weighted else None)
    kv = tiny_kv.slice(1, 120)  # a slice of the buffer, no sink token in it
    for level in codec.levels:
        got = codec.decode(codec.encode(kv, level, start=1))
        step = codec.prepare(kv, level, start=1).coded.step
        for k, (x, y) in enumerate(((kv.keys, got.keys), (kv.values, got.values))):
            err = (x - y).abs() - 8 * x.abs() * 2.0**-23  # and the float32 resolution of the mean's addition
            assert (err <= step[k][:, :, None, :] / 2).all()


def test_profiles_encode_identically(tiny_kv, monkeypatch):
    """With a profile's tables (no counting), and with a fitted transform (components from torch, steps and symbols native)."""
    L, H, _, D = tiny_kv.shape
    g = torch.Generator().manual_seed(0)
    group = CodecConfig().head_group(H, D)  # the heads of a layer in one matrix
    a = torch.randn(2, L, H // group, group * D, group * D, generator=g)
    tf = fit_transform(a @ a.transpose(-1, -2) + torch.eye(group * D), group=group)
    for config in (CodecConfig(), CodecConfig(step_cap=2.0)):
        for profile in (Profile.fit(config, [tiny_kv], chunk_tokens=80), Profile.fit(config, [tiny_kv], transform=tf, chunk_tokens=80)):
            codec = KVCodec(config, profile)
            cases = ((tiny_kv, 0), (tiny_kv.slice(20, 90), 20))
            native = [codec.encode(kv, level, start=start) for kv, start in cases for level in codec.levels]
            with monkeypatch.context() as m:
                m.setattr(fused_encode, "supports", lambda kv: False)
                assert native == [codec.encode(kv, level, start=start) for kv, start in cases for level in codec.levels]


@pytest.mark.parametrize("where", ["coded", "sink", "key-coded"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_kv_is_the_same_shape_error(tiny_kv, tiny_llama, monkeypatch, where, bad):
    keys, values = tiny_kv.keys.clone(), tiny_kv.values.clone()
    target = keys if where == "key-coded" else values
    target[1, 0, 0 if where == "sink" else 50, 3] = bad
    kv = KVCache(keys, values)
    for codec in (KVCodec(), KVCodec(rotary=RotarySpec.from_model(tiny_llama))):
        with pytest.raises(KVShapeError, match="NaN or infinite"):
            codec.encode(kv, 1, start=0)
        with monkeypatch.context() as m:
            m.setattr(fused_encode, "supports", lambda kv: False)
            with pytest.raises(KVShapeError, match="NaN or infinite"):
                codec.encode(kv, 1, start=0)


def test_one_layer_and_all_exact_chunks_take_the_torch_path(tiny_kv):
    """torch sums a one-layer chunk's squares to one number split across its threads (no order to follow)."""
    tf = identity_transform(1, 2, 16)
    one = KVCache(tiny_kv.keys[:1], tiny_kv.values[:1])
    assert quantise_chunk(one, tf, 0.5, fitted=False, count=True)[2] is None  # the torch path counts nothing
    assert quantise_chunk(tiny_kv.slice(0, 1), identity_transform(3, 2, 16), 0.5, fitted=False, count=True)[2] is None
    assert quantise_chunk(tiny_kv.slice(0, 2), identity_transform(3, 2, 16), 0.5, fitted=False, count=True)[2] is not None


def test_native_only_for_cpu_kv_with_the_library(tiny_kv):
    assert fused_encode.supports(tiny_kv)
    meta = KVCache(torch.empty(1, 1, 2, 4, device="meta"), torch.empty(1, 1, 2, 4, device="meta"))
    assert not fused_encode.supports(meta)


def _call(lib, **kw):
    """cg_encode_chunk on a valid tiny chunk, with any argument replaced; (status, outputs)."""
    L, H, T, D = 2, 1, 5, 8
    x = torch.randn(L, H, T, D)
    a = dict(keys=x.data_ptr(), values=x.data_ptr(), strides=np.array([H * T * D, T * D, D] * 2, np.int64),
             extents=np.array([x.numel()] * 2, np.int64), layers=L, heads=H, tokens=T, head_dim=D, first=1, cos=None,
             sin=None, scale2=1.0, level_step=0.5, cap=0.0, fitted=0, weights=None, mean=np.full((2, L, H, D), 7, np.float32),
             step=np.full((2, L, H, D), 7, np.float32), out=np.full(2 * L * H * D * (T - 1), 7, np.uint8),
             out_len=2 * L * H * D * (T - 1), scratch=np.full(2 * L * H * D * (T - 1), 7, np.uint8),
             counts=np.full((2 * L, 256), 7, np.int64), finite=np.zeros(1, np.int32), threads=2)  # fmt: skip
    a.update(kw)
    arr = lambda v: v.ctypes.data if isinstance(v, np.ndarray) else v  # noqa: E731
    err = lib.cg_encode_chunk(*(arr(v) for v in a.values()))
    return err, a, x


def test_library_checks_its_arguments():
    """Bad shapes, strides, extents and parameters are CG_ERR_ARGS before any memory is touched."""
    lib = native_lib.cpu_library()
    err, a, _ = _call(lib)
    assert err == 0 and a["finite"][0] == 1 and (a["counts"].sum(axis=1) == 4 * 8).all()  # the valid call works
    cos = np.ones((4, 8), np.float32)
    bad = [
        dict(out_len=2 * 2 * 8 * 4 - 1), dict(first=5), dict(first=-1), dict(first=6), dict(tokens=0), dict(head_dim=0),
        dict(layers=0), dict(heads=-1), dict(extents=np.array([79, 80], np.int64)), dict(extents=np.array([80, 0], np.int64)),
        dict(strides=np.array([-40, 40, 8, 40, 40, 8], np.int64)), dict(strides=np.array([40, 40, 8, 40, 40, 9], np.int64)),
        dict(strides=np.array([40, 40, 1 << 62, 40, 40, 8], np.int64)), dict(cos=cos.ctypes.data), dict(sin=cos.ctypes.data),
        dict(cos=cos.ctypes.data, sin=cos.ctypes.data, head_dim=7, strides=np.array([35, 35, 7] * 2, np.int64), out_len=112),
        dict(cos=cos.ctypes.data, sin=cos.ctypes.data, scale2=0.0), dict(level_step=0.0), dict(level_step=float("nan")),
        dict(cap=-1.0), dict(cap=float("inf")), dict(fitted=2), dict(fitted=1), dict(mean=None), dict(step=None),
        dict(finite=None), dict(out=None), dict(scratch=None), dict(keys=None), dict(strides=None), dict(heads=1 << 14, head_dim=1 << 7),
        *(dict(weights=np.where(np.arange(32) == 17, bad, 1.0).astype(np.float32)) for bad in (0.0, -1.0, np.nan, np.inf)),
        dict(fitted=1, first=0, weights=np.ones(32, np.float32)),  # weights: (2, layers, heads, dim), without a profile only
    ]  # fmt: skip
    for kw in bad:
        err, a, _ = _call(lib, **kw)
        assert err == -7, kw
        written = [k for k in ("counts", "out", "mean", "step") if isinstance(a[k], np.ndarray) and not (a[k] == 7).all()]
        assert not written, kw
    err, a, _ = _call(lib, counts=None)  # counting is optional
    assert err == 0
    err, a, _ = _call(lib, weights=np.full(32, 0.5, np.float32))  # valid weights
    assert err == 0 and a["finite"][0] == 1
    assert lib.cg_torch_sums(None, 1, 1, 1, None, None) == -7


def test_library_reports_non_finite_values():
    lib = native_lib.cpu_library()
    for t in (0, 3):  # a sink token (first = 1) and a coded one
        x = torch.randn(2, 1, 5, 8)
        x[1, 0, t, 2] = float("inf")
        err, a, _ = _call(lib, keys=x.data_ptr(), values=x.data_ptr())
        assert err == 0 and a["finite"][0] == 0


def test_counts_of_narrow_symbol_distributions():
    """At coarse steps almost every symbol is within 3 or 7 of 128 (then counted 32 at a time): exact counts,
    with the rare far ones, in regions longer than the byte counters' 255 vectors; and at a fine step."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 2, 600, 32, generator=g)
    x[..., ::50, 5] *= 40  # a few values far out: steps grow with the peak, everything else lands near 128
    kv = KVCache(x, x.flip(2).clone())
    regimes = set()
    for level_step in (0.1, 0.3, 0.5, 2.0):
        ref, got = both_paths(kv, level_step, fitted=False, sink_tokens=0)
        assert_same(ref, got, 2)
        distance = np.abs(ref[1].astype(np.int32) - 128)
        regimes.add(next((near for near in (3, 7) if (distance <= near).mean() > 0.97), None))
        assert distance.max() > 7
    assert regimes == {3, 7, None}  # every way of counting


def test_threads_do_not_change_anything():
    kv = random_kv(4, 2, 300, 64, seed=5)
    tf = identity_transform(4, 2, 64)
    runs = [quantise_chunk(kv, tf, 0.4, fitted=False, count=True, threads=t) for t in (1, 2, 7)]
    for coded, flat, counts in runs[1:]:
        assert torch.equal(coded.step, runs[0][0].step) and np.array_equal(flat, runs[0][1]) and np.array_equal(counts, runs[0][2])
