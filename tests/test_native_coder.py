"""The native rANS coder: exact round trips, agreement with the torchac oracle, a frozen byte
format, hostile input and the coder registry (its GPU decoder: ``test_triton_decoder.py``).

Without the native library these tests are skipped, except under ``CI`` (set and not
``0``/``false``/``no``), where they fail with the load error: a broken build must not
hide behind the torchac fallback.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cachegen_core import coders
from cachegen_core.coders import default_coder, get_coder
from cachegen_core.coders.base import TOTAL_FREQ, StreamLayout, ideal_bits_per_stream
from cachegen_core.coders.native import NativeCoder
from cachegen_core.coders.native_lib import cpu_library, load_error
from cachegen_core.coders.reference import ReferenceCoder
from cachegen_core.errors import CoderError


def _in_ci() -> bool:
    """The rule of ``tests/redis_fixture.py``: ``CI`` set to anything but empty, 0, false or no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(autouse=True, scope="module")
def _native_library() -> None:
    """Skip the module without the native library, or fail it under CI with the reason."""
    error = load_error()
    if error is not None:
        if _in_ci():
            pytest.fail(f"{error} (the native coder is required when CI is set)", pytrace=False)
        pytest.skip(error)


@pytest.mark.skipif(not _in_ci(), reason="only CI requires the native coder")
def test_ci_codes_with_the_native_coder():
    assert default_coder().name == NativeCoder.name


def tables(rng: np.random.Generator, n_tables: int, alphabet: int, concentration: float = 0.3, near_zero: bool = False) -> np.ndarray:
    """Random valid tables (Dirichlet); with ``near_zero`` half the alphabet has frequency 1."""
    p = rng.dirichlet(np.ones(alphabet) * concentration, size=n_tables)
    f = np.floor(p * (TOTAL_FREQ - alphabet)).astype(np.int64) + 1
    if near_zero:
        f[:, : alphabet // 2] = 1
    f[np.arange(n_tables), f.argmax(1)] += TOTAL_FREQ - f.sum(1)
    return f.astype(np.uint32)


def sample(rng: np.random.Generator, freqs: np.ndarray, layout: StreamLayout) -> np.ndarray:
    """Symbols drawn from the very tables the layout assigns them."""
    cum = np.cumsum(freqs / TOTAL_FREQ, axis=1)
    out = np.empty(layout.n_symbols, np.uint8)
    for s in range(layout.n_streams):
        a, b = int(layout.offsets[s]), int(layout.offsets[s + 1])
        t = np.resize(layout.table_ids[s], b - a)
        out[a:b] = np.minimum((cum[t] < rng.random(b - a)[:, None]).sum(1), freqs.shape[1] - 1)
    return out


def layout_of(counts, table_ids) -> StreamLayout:
    return StreamLayout(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), np.asarray(table_ids, np.int32))


def round_trip(coder: NativeCoder, sym: np.ndarray, layout: StreamLayout, freqs: np.ndarray) -> list[bytes]:
    payloads = coder.encode(sym, layout, freqs)
    assert np.array_equal(coder.decode(payloads, layout, freqs), sym)
    return payloads


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
        sym[:: max(1, sym.size // 7)] = 0  # force some symbols of probability 2^-16
    payloads = round_trip(NativeCoder(threads=2), sym, layout, freqs)
    ref = ReferenceCoder()
    assert np.array_equal(ref.decode(ref.encode(sym, layout, freqs), layout, freqs), sym)
    assert all(len(p) == 0 for p, c in zip(payloads, counts, strict=True) if c == 0)


@pytest.mark.parametrize("alphabet", [2, 3, 17, 255, 256])
def test_one_symbol_empty_and_uniform_streams(alphabet):
    rng = np.random.default_rng(alphabet)
    freqs = np.full((1, alphabet), TOTAL_FREQ // alphabet, np.int64)
    freqs[0, 0] += TOTAL_FREQ - freqs.sum()
    layout = layout_of([1, 0, 1000, 15, 16, 17], np.zeros((6, 1)))
    sym = rng.integers(0, alphabet, layout.n_symbols).astype(np.uint8)
    payloads = round_trip(NativeCoder(threads=1), sym, layout, freqs.astype(np.uint32))
    assert payloads[1] == b"" and len(payloads[0]) >= 64


def test_every_symbol_at_minimum_frequency():
    """Tables where almost all symbols have frequency 1, coded with exactly those symbols."""
    freqs = np.ones((2, 256), np.uint32)
    freqs[0, 7] = freqs[1, 200] = TOTAL_FREQ - 255
    layout = layout_of([5000, 4999], [[0, 1, 1], [1, 0, 1]])
    sym = np.arange(layout.n_symbols, dtype=np.int64).astype(np.uint8)  # mostly the 2^-16 symbols
    payloads = round_trip(NativeCoder(), sym, layout, freqs)
    assert 8 * sum(map(len, payloads)) <= ideal_bits_per_stream(sym, layout, freqs).sum() * 1.005 + 2 * 64 * 8


def test_byte_format_is_frozen():
    """Blobs in stores must stay decodable: these bytes are the v1 format (csrc/rans_core.h)."""
    freqs = np.array([[40000, 20000, 5000, 536], [1, 1, 65533, 1]], np.uint32)
    layout = layout_of([0, 1, 36, 1000], [[0, 1, 1], [1, 0, 0], [0, 0, 1], [1, 1, 0]])
    sym = (np.arange(1037) * 7919 % 13 % 4).astype(np.uint8)
    sym[(np.arange(1037) % 3 == 0) & (sym > 2)] = 2
    payloads = round_trip(NativeCoder(), sym, layout, freqs)
    assert [len(p) for p in payloads] == [0, 66, 76, 1170]
    assert payloads[1] == bytes.fromhex("00000100" * 16 + "0000")
    assert hashlib.sha256(b"".join(payloads)).hexdigest() == "afb7467343335db7c76eca6942a3b78ad1a296a59383384c5ebd75b3f5c2d81d"


@pytest.mark.parametrize("n_tables", [3, 20_000])  # two slot-lookup resolutions (12 and 10 bits)
def test_size_within_half_a_percent_of_entropy(n_tables):
    rng = np.random.default_rng(2)
    freqs = tables(rng, n_tables, 256, 0.3)
    layout = layout_of([50_000] * 4, rng.integers(0, n_tables, (4, 192)))
    sym = sample(rng, freqs, layout)
    payloads = round_trip(NativeCoder(), sym, layout, freqs)
    coded = 8 * sum(map(len, payloads))
    assert coded <= ideal_bits_per_stream(sym, layout, freqs).sum() * 1.005


@pytest.mark.parametrize("lut_bits", [1, 4, 8, 12, 16])
def test_every_slot_lookup_resolution_decodes_the_same(lut_bits, monkeypatch):
    """The decoder's slot lookup (a decoder-side choice, not part of the format) at any resolution."""
    from cachegen_core.coders import native_lib

    rng = np.random.default_rng(lut_bits)
    freqs = np.concatenate([tables(rng, 3, 256, 0.05, near_zero=True), tables(rng, 3, 256, 5.0)])
    layout = layout_of([4000, 3000], rng.integers(0, 6, (2, 11)))
    sym = sample(rng, freqs, layout)
    sym[::13] = rng.integers(0, 256, sym[::13].size)  # plenty of rare symbols: long bisections
    payloads = NativeCoder().encode(sym, layout, freqs)
    monkeypatch.setattr(native_lib, "lut_bits_for", lambda n: lut_bits)
    monkeypatch.setattr(native_lib, "_TABLES", native_lib._TableCache())
    assert NativeCoder().tables(freqs).lut_bits == lut_bits
    assert np.array_equal(NativeCoder().decode(payloads, layout, freqs), sym)


def test_threads_give_identical_bytes_and_symbols():
    rng = np.random.default_rng(3)
    freqs = tables(rng, 8, 64)
    layout = layout_of([50_000, 70_000, 10, 0, 90_000], rng.integers(0, 8, (5, 8)))
    sym = sample(rng, freqs, layout)
    one, four = NativeCoder(threads=1), NativeCoder(threads=4)
    payloads = one.encode(sym, layout, freqs)
    assert payloads == four.encode(sym, layout, freqs)
    assert np.array_equal(four.decode(payloads, layout, freqs), one.decode(payloads, layout, freqs))


def test_decode_into_and_table_cache_by_identity():
    rng = np.random.default_rng(8)
    layout = layout_of([3000, 0, 2000], rng.integers(0, 4, (3, 9)))
    c = NativeCoder()
    for _ in range(3):  # same shape, new arrays: never a stale cache hit
        freqs = tables(rng, 4, 100)
        sym = sample(rng, freqs, layout)
        out = np.full(layout.n_symbols, 255, np.uint8)
        c.decode_into(c.encode(sym, layout, freqs), layout, freqs, out)
        assert np.array_equal(out, sym)
    with pytest.raises(CoderError, match="output"):
        c.decode_into(c.encode(sym, layout, freqs), layout, freqs, np.empty(3, np.uint8))


def test_bad_tables_layouts_and_symbols_are_coder_errors():
    rng = np.random.default_rng(9)
    freqs = tables(rng, 2, 8)
    layout = layout_of([100], [[0, 1]])
    sym = sample(rng, freqs, layout)
    c = NativeCoder()
    zero = freqs.copy()
    zero[0, 0], zero[0, 1] = 0, zero[0, 1] + zero[0, 0]
    for bad in (zero, freqs.astype(np.int64), freqs[:, :1], freqs + 1):
        with pytest.raises(CoderError):
            c.encode(sym, layout, bad)
    with pytest.raises(CoderError):
        c.encode(sym, layout_of([100], [[0, 2]]), freqs)  # table id out of range
    with pytest.raises(CoderError):
        c.encode(sym[:-1], layout, freqs)
    with pytest.raises(CoderError, match="alphabet"):
        c.encode(np.full(100, 8, np.uint8), layout, freqs)
    with pytest.raises(CoderError, match="substreams"):
        c.decode([], layout, freqs)


def test_library_checks_raw_arguments():
    """The C ABI rejects inconsistent offsets and table ids itself (not only the Python wrapper)."""
    lib = cpu_library()
    freqs = np.full((1, 4), TOTAL_FREQ // 4, np.uint32)
    t = NativeCoder().tables(freqs)
    p = lambda a: a.ctypes.data  # noqa: E731
    in_off = np.array([0, 10], np.int64)
    buf = np.zeros(10, np.uint8)
    out = np.zeros(8, np.uint8)
    status = np.zeros(1, np.int32)
    for sym_off, tids in ((np.array([0, -4], np.int64), np.zeros(1, np.int32)), (np.array([0, 8], np.int64), np.array([5], np.int32))):
        err = lib.cg_decode(p(buf), p(in_off), 1, p(sym_off), p(tids), 1, p(t.info), p(t.lut), t.lut_bits, 1, 4, p(out), p(status), 1)
        assert err == -7
    bad = np.array([[0, 1, 2, 3]], np.uint32)
    info, lut = np.zeros((1, 4), np.uint32), np.zeros((1, 256), np.uint8)
    assert lib.cg_build_tables(p(bad), 1, 4, 8, p(info), p(lut)) == -8


def _valid() -> tuple[NativeCoder, StreamLayout, np.ndarray, np.ndarray, list[bytes]]:
    rng = np.random.default_rng(4)
    freqs = tables(rng, 3, 40)
    layout = layout_of([500, 300], rng.integers(0, 3, (2, 5)))
    sym = sample(rng, freqs, layout)
    c = NativeCoder(threads=1)
    return c, layout, freqs, sym, c.encode(sym, layout, freqs)


def test_truncated_oversized_and_garbage_payloads_are_errors():
    c, layout, freqs, _, payloads = _valid()
    p0 = payloads[0]
    for n in range(len(p0)):
        with pytest.raises(CoderError):
            c.decode([p0[:n], payloads[1]], layout, freqs)
    for extra in (b"\0", b"\0\0", bytes(1000)):
        with pytest.raises(CoderError, match="trailing"):
            c.decode([p0 + extra, payloads[1]], layout, freqs)
    with pytest.raises(CoderError, match="trailing"):  # an empty substream that is not empty
        c.decode([p0, payloads[1], b"x"], layout_of([500, 300, 0], np.zeros((3, 5))), freqs)
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


def test_bit_flips_are_caught_or_in_range():
    c, layout, freqs, _, payloads = _valid()
    caught = 0
    for i in range(len(payloads[0])):
        for bit in (0x01, 0x10, 0x80):
            bad = bytearray(payloads[0])
            bad[i] ^= bit
            try:
                out = c.decode([bytes(bad), payloads[1]], layout, freqs)
                assert out.max() < freqs.shape[1]
            except CoderError:
                caught += 1
    assert caught >= 0.95 * 3 * len(payloads[0])


def test_registry_prefers_native_and_falls_back_to_reference(monkeypatch):
    assert default_coder().name == NativeCoder.name
    assert get_coder(NativeCoder.name) is get_coder(NativeCoder.name)
    assert isinstance(get_coder("torchac"), ReferenceCoder)
    with pytest.raises(KeyError):
        get_coder("no-such-coder")
    from cachegen_core.coders import native_lib

    monkeypatch.setattr(native_lib, "available", lambda: False)
    coders.available_coders.cache_clear()
    coders.get_coder.cache_clear()
    try:
        assert default_coder().name == ReferenceCoder.name
    finally:
        monkeypatch.undo()
        coders.available_coders.cache_clear()
        coders.get_coder.cache_clear()
    assert default_coder().name == NativeCoder.name


def test_a_torchac_that_does_not_load_is_a_typed_error(monkeypatch):
    """torchac compiles its extension on first import: where that fails (no compiler), coding with it raises
    BackendUnavailable, which the engine handles, never an ImportError from deep inside a request."""
    from cachegen_core.coders import reference
    from cachegen_core.errors import BackendUnavailable

    monkeypatch.setattr(reference, "_torchac", None)
    monkeypatch.setitem(sys.modules, "torchac", None)  # an import that fails
    with pytest.raises(BackendUnavailable, match="torchac is installed but does not load"):
        reference._backend()
