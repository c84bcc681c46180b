"""The native rANS coder: exact round trips, agreement with the torchac oracle, and hostile input."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cachegen_core.coders import default_coder
from cachegen_core.coders.base import TOTAL_FREQ, StreamLayout, cross_entropy_bits
from cachegen_core.coders.native import CSRC, NativeCoder, available
from cachegen_core.coders.reference import ReferenceCoder
from cachegen_core.errors import CoderError

pytestmark = pytest.mark.skipif(not available(), reason="native coder library not built")


def tables(rng, n_tables, alphabet, concentration=0.3, near_zero=False):
    p = rng.dirichlet(np.ones(alphabet) * concentration, size=n_tables)
    f = np.floor(p * (TOTAL_FREQ - alphabet)).astype(np.int64) + 1
    if near_zero:
        f[:, : alphabet // 2] = 1  # half the alphabet at probability 2^-16
    f[np.arange(n_tables), f.argmax(1)] += TOTAL_FREQ - f.sum(1)
    return f.astype(np.uint32)


def sample(rng, freqs, layout):
    cum = np.cumsum(freqs / TOTAL_FREQ, axis=1)
    out = np.empty(layout.n_symbols, np.uint8)
    for s in range(layout.n_streams):
        a, b = int(layout.offsets[s]), int(layout.offsets[s + 1])
        t = np.resize(layout.table_ids[s], b - a)
        out[a:b] = np.minimum((cum[t] < rng.random(b - a)[:, None]).sum(1), freqs.shape[1] - 1)
    return out


def layout_of(counts, table_ids):
    return StreamLayout(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), np.asarray(table_ids, np.int32))


@settings(max_examples=60, deadline=None)
@given(
    alphabet=st.integers(2, 256),
    counts=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    period=st.integers(1, 40),
    skew=st.sampled_from([0.05, 0.3, 5.0]),
    near_zero=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_round_trip_matches_reference(alphabet, counts, period, skew, near_zero, seed):
    rng = np.random.default_rng(seed)
    freqs = tables(rng, 5, alphabet, skew, near_zero)
    layout = layout_of(counts, rng.integers(0, 5, (len(counts), period)))
    sym = sample(rng, freqs, layout)
    if near_zero and sym.size:
        sym[:: max(1, sym.size // 7)] = 0  # force some 1/65536 symbols
    native = NativeCoder(threads=2)
    payloads = native.encode(sym, layout, freqs)
    assert np.array_equal(native.decode(payloads, layout, freqs), sym)
    ref = ReferenceCoder()
    assert np.array_equal(ref.decode(ref.encode(sym, layout, freqs), layout, freqs), sym)
    assert all(len(p) == 0 for p, c in zip(payloads, counts) if c == 0)


def test_one_symbol_and_uniform_streams():
    rng = np.random.default_rng(1)
    for alphabet in (2, 3, 17, 255, 256):
        freqs = np.full((1, alphabet), TOTAL_FREQ // alphabet, np.int64)
        freqs[0, 0] += TOTAL_FREQ - freqs.sum()
        freqs = freqs.astype(np.uint32)
        layout = layout_of([1, 0, 1000], np.zeros((3, 1)))
        sym = rng.integers(0, alphabet, 1001).astype(np.uint8)
        c = NativeCoder(threads=1)
        assert np.array_equal(c.decode(c.encode(sym, layout, freqs), layout, freqs), sym)


def test_size_within_half_a_percent_of_entropy():
    rng = np.random.default_rng(2)
    freqs = tables(rng, 192, 256, 0.3)
    layout = layout_of([200_000] * 4, np.tile(np.arange(192), (4, 1)))
    sym = sample(rng, freqs, layout)
    coded = 8 * sum(map(len, NativeCoder().encode(sym, layout, freqs)))
    assert coded <= cross_entropy_bits(sym, layout, freqs) * 1.005


def test_threads_give_identical_bytes():
    rng = np.random.default_rng(3)
    freqs = tables(rng, 8, 64)
    layout = layout_of([50_000, 70_000, 10, 0, 90_000], rng.integers(0, 8, (5, 8)))
    sym = sample(rng, freqs, layout)
    assert NativeCoder(threads=1).encode(sym, layout, freqs) == NativeCoder(threads=4).encode(sym, layout, freqs)


def _valid():
    rng = np.random.default_rng(4)
    freqs = tables(rng, 3, 40)
    layout = layout_of([500, 300], rng.integers(0, 3, (2, 5)))
    sym = sample(rng, freqs, layout)
    return NativeCoder(threads=1), layout, freqs, sym, NativeCoder(threads=1).encode(sym, layout, freqs)


def test_truncated_oversized_and_garbage_payloads_are_errors():
    c, layout, freqs, sym, payloads = _valid()
    p0 = payloads[0]
    for n in range(len(p0)):
        with pytest.raises(CoderError):
            c.decode([p0[:n], payloads[1]], layout, freqs)
    with pytest.raises(CoderError, match="trailing"):
        c.decode([p0 + b"\0\0", payloads[1]], layout, freqs)
    rng = np.random.default_rng(5)
    rejected = 0
    for _ in range(300):
        junk = rng.integers(0, 256, rng.integers(0, 2 * len(p0))).astype(np.uint8).tobytes()
        try:
            out = c.decode([junk, payloads[1]], layout, freqs)
            assert out.max() < freqs.shape[1]
        except CoderError:
            rejected += 1
    assert rejected >= 290  # the end-state check catches almost all garbage


def test_bit_flips_never_crash():
    c, layout, freqs, sym, payloads = _valid()
    for i in range(len(payloads[0])):
        bad = bytearray(payloads[0])
        bad[i] ^= 0x10
        try:
            c.decode([bytes(bad), payloads[1]], layout, freqs)
        except CoderError:
            pass


def test_codec_picks_native_by_default():
    assert default_coder().name == NativeCoder.name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_sources_compile(tmp_path: Path):
    for cu in CSRC.glob("*.cu"):
        subprocess.run(["nvcc", "-c", str(cu), "-o", str(tmp_path / (cu.stem + ".o")), "-I", str(CSRC)], check=True)


def _cuda_ready() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and shutil.which("nvcc") is not None
    except ImportError:
        return False


@pytest.mark.skipif(not _cuda_ready(), reason="needs a GPU and nvcc")
def test_cuda_decode_equals_cpu_decode():
    rng = np.random.default_rng(7)
    c = NativeCoder()
    for alphabet, counts, period in [(256, [0, 1, 17, 100_000, 5], 192), (2, [3000, 3001], 1), (40, [16, 15, 33], 7)]:
        freqs = tables(rng, 9, alphabet)
        layout = layout_of(counts, rng.integers(0, 9, (len(counts), period)))
        sym = sample(rng, freqs, layout)
        payloads = c.encode(sym, layout, freqs)
        cpu = c.decode(payloads, layout, freqs)
        gpu = c.decode_cuda(payloads, layout, freqs).cpu().numpy()
        assert np.array_equal(gpu, cpu) and np.array_equal(cpu, sym)
        big = max(range(len(counts)), key=lambda i: counts[i])
        broken = list(payloads)
        broken[big] = broken[big][:-2]
        with pytest.raises(CoderError):
            c.decode_cuda(broken, layout, freqs)
        broken[big] = payloads[big] + b"\0\0"
        with pytest.raises(CoderError, match="trailing"):
            c.decode_cuda(broken, layout, freqs)
