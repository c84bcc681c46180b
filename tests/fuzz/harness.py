"""A structured fuzzer for the container parser, ``KVCodec.decode`` and every coder's ``decode``.

Three targets, each fed by its own generator:

- ``container``: ``format.unpack`` on mutated blobs;
- ``codec``: ``KVCodec.decode`` on mutated blobs;
- ``coder-<name>``: every coder in ``available_coders()`` called directly with random
  layouts, random tables and random or mutated payloads (valid ones must round-trip).

Seeds are real blobs: tiny random KV caches coded by every available coder, with
inline tables and with a fitted profile, one and many substreams, at every level.
Mutations come in two families. *Raw* ones (bit flips, byte insertions and
deletions, truncations, splices between blobs, preamble fields) leave the checksums
as they are, so they test that corruption is detected. *Forged* ones rewrite the
header JSON (shape, level, n_streams, sections, coder, dtypes, odd JSON types) or
the sections and substreams and re-pack the blob with correct CRC-32s: that is what
reaches the deep decode paths (semantic checks, the coders, dequantisation), and it
is what an attacker with write access to the store can do.

Every input must end in a decoded ``KVCache`` or ``CacheGenFormatError`` (a
``CoderError`` for the coders): any other exception is a *crash*; taking longer
than ``hang_s`` is a *hang*; a ``tracemalloc`` peak above ``alloc_bound`` (derived
from the input's size and the header's validated shape, capped by ``max_tokens``)
is an *overalloc*. ``wrong_kv_accepted`` counts decodes that returned KV they should
not have: a raw mutation (checksums untouched) that decodes to anything but the
seed's KV, a forged blob whose KV contradicts its own validated header (shape,
dtype, non-finite values), or a coder that returns symbols outside the alphabet or
mis-decodes an unmodified payload. Forged blobs that decode to *different but
self-consistent* KV are counted apart, as ``forged_accepted``: CRC-32 detects
corruption, not forgery (see ``docs/security.md``).
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
import tracemalloc
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cachegen_core.codec import KVCodec
from cachegen_core.coders import StreamLayout, available_coders, get_coder
from cachegen_core.config import CodecConfig
from cachegen_core.errors import CacheGenFormatError, CoderError
from cachegen_core.format import _PREAMBLE, _STREAM_ENTRY, MAGIC, Limits, pack, unpack
from cachegen_core.kv import KVCache
from cachegen_core.profile import Profile, counts_to_freqs

FINGERPRINT = "fuzz-model"
#: Tokens a fuzzed codec accepts per blob: small, so that the worst a forged header may
#: legally ask for stays cheap and the allocation bound below stays meaningful.
MAX_TOKENS = 4096
LIMITS = Limits(max_blob_bytes=1 << 24, max_header_bytes=1 << 16, max_streams=1 << 14, max_section_elements=1 << 22)
OUTCOMES = ("decoded", "rejected", "crash", "hang", "overalloc", "wrong_kv_accepted", "forged_accepted")


# ----------------------------------------------------------------------------- seeds
def warm_up() -> None:
    """Load every coder once, with stdout sent to stderr: torchac's first import builds an
    extension and prints to stdout, which would corrupt the JSON lines of the benchmarks."""
    import os  # noqa: PLC0415
    import sys  # noqa: PLC0415

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        from cachegen_core.coders.reference import _backend  # noqa: PLC0415

        _backend()
        available_coders()
    except Exception:  # a coder that cannot load is simply not fuzzed
        pass
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@dataclass(frozen=True)
class Seed:
    """A real blob, the codec that decodes it, and the KV it decodes to."""

    name: str
    codec: KVCodec
    blob: bytes
    kv: KVCache
    coder: str


def _tiny_kvs(seed: int) -> list[KVCache]:
    """Small KV caches with KV-like structure (smooth keys, noisy values), odd token counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for layers, heads, tokens, dim, dtype in (
        (2, 2, 23, 4, torch.float32),
        (3, 1, 41, 8, torch.float16),
        (1, 2, 1, 4, torch.bfloat16),
    ):
        k = torch.randn(layers, heads, tokens, dim, generator=g).cumsum(2) * 0.3
        v = torch.randn(layers, heads, tokens, dim, generator=g)
        out.append(KVCache(k.to(dtype), v.to(dtype)))
    return out


def make_codecs(seed: int = 0) -> list[tuple[str, KVCodec, list[KVCache]]]:
    """Codecs to fuzz (name, codec, the KV caches it codes): inline tables, many substreams, a fitted profile."""
    kvs = _tiny_kvs(seed)
    many = CodecConfig(stream_symbols=48)  # several token blocks per layer: many substreams
    cfg = CodecConfig()
    g = torch.Generator().manual_seed(seed + 1)
    train = [KVCache(torch.randn(2, 2, 64, 4, generator=g).cumsum(2) * 0.3, torch.randn(2, 2, 64, 4, generator=g))]
    profile = Profile.fit(cfg, train, chunk_tokens=32, model_fingerprint=FINGERPRINT)
    kw: dict[str, Any] = {"fingerprint": FINGERPRINT, "max_tokens": MAX_TOKENS, "limits": LIMITS}
    return [
        ("inline", KVCodec(cfg, **kw), kvs),
        ("inline-many", KVCodec(many, **kw), kvs[:2]),
        ("profile", KVCodec(cfg, profile, **kw), [kvs[0]]),  # a profile fits one model shape
    ]


def make_seeds(seed: int = 0, coders: Sequence[str] | None = None) -> list[Seed]:
    """Every (codec variant, coder, KV, level) combination as a real blob."""
    names = list(coders) if coders is not None else list(available_coders())
    seeds = []
    for variant, codec, kvs in make_codecs(seed):
        for coder_name in names:
            enc = KVCodec(codec.config, codec.profile, coder=get_coder(coder_name), fingerprint=FINGERPRINT)
            for i, kv in enumerate(kvs):
                for level in codec.levels:
                    blob = enc.encode(kv, level)
                    seeds.append(Seed(f"{variant}/{coder_name}/kv{i}/L{level}", codec, blob, codec.decode(blob), coder_name))
    return seeds


# ------------------------------------------------------------------------ blob surgery
@dataclass
class Parts:
    """A blob taken apart without any check (for forging): preamble, header, sections, streams."""

    version: int
    reserved: int
    header: dict[str, Any]
    sections: dict[str, np.ndarray]
    streams: list[bytes]


def split(blob: bytes) -> Parts:
    """Take a *valid* blob apart (``unpack`` it; the parts can then be re-packed after changes)."""
    c = unpack(blob, Limits())
    _, version, reserved, _, _ = _PREAMBLE.unpack_from(blob, 0)
    return Parts(version, reserved, dict(c.header), dict(c.sections), list(c.streams))


def with_header(blob: bytes, header_bytes: bytes, *, fix_crc: bool = True) -> bytes:
    """``blob`` with its header JSON replaced by ``header_bytes`` and the preamble's length and CRC fixed."""
    magic, version, reserved, hlen, hcrc = _PREAMBLE.unpack_from(blob, 0)
    crc = zlib.crc32(header_bytes) & 0xFFFFFFFF if fix_crc else hcrc
    return _PREAMBLE.pack(magic, version, reserved, len(header_bytes), crc) + header_bytes + blob[_PREAMBLE.size + hlen :]


def header_of(blob: bytes) -> dict[str, Any]:
    hlen = _PREAMBLE.unpack_from(blob, 0)[3]
    return json.loads(blob[_PREAMBLE.size : _PREAMBLE.size + hlen])


def dump_header(h: Any) -> bytes:
    return json.dumps(h, sort_keys=True, separators=(",", ":")).encode()


def _repack(blob: bytes, mutate: Callable[[dict[str, Any]], None]) -> bytes:
    """``blob`` with its header dict changed in place by ``mutate``, header length and CRC fixed."""
    h = header_of(blob)
    mutate(h)
    return with_header(blob, dump_header(h))


def repack(p: Parts, *, keep_header_fields: bool = False) -> bytes:
    """Re-pack parts with every checksum recomputed (``format.pack``); extra header fields kept."""
    header = {k: v for k, v in p.header.items() if k not in ("sections", "n_streams", "streams_crc32")}
    blob = pack(header, p.sections, p.streams)
    if keep_header_fields:  # a forged sections/n_streams/streams_crc32 entry: keep it, fix only the header CRC
        h = header_of(blob)
        for k in ("sections", "n_streams", "streams_crc32"):
            if k in p.header:
                h[k] = p.header[k]
        blob = with_header(blob, dump_header(h))
    return blob


# ------------------------------------------------------------------------------ mutators
_INTERESTING_INTS = [0, 1, 2, 3, 7, 8, 9, 10, 11, 15, 16, 17, 127, 128, 255, 256, 1023, 4095, 4096, 4097,
                     16383, 16384, 16385, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1,
                     2**63, 2**64, 2**70, -1, -2, -(2**31), -(2**63)]  # fmt: skip


def _odd_value(rng: random.Random, old: Any = None) -> Any:
    """A value of a random JSON type, biased to boundaries and to near-misses of ``old``."""
    r = rng.random()
    if isinstance(old, int) and not isinstance(old, bool) and r < 0.35:
        return rng.choice([old + 1, old - 1, old * 2, old // 2, -old, old + 16, old * 1000, 0])
    if r < 0.6:
        return rng.choice(_INTERESTING_INTS)
    return rng.choice([None, True, False, 1.0, 0.5, -0.0, 1e308, float("inf"), float("nan"), "", "x", "0",
                       "native-rans16-v1", "torchac", "inline", "profile", "float32", "float16", "bfloat16",
                       "uint8", "uint16", "int32", "float64", "object", "cachegen", [], [1], [1, 2, 3, 4],
                       [2, 2, 2**31, 4], {}, {"a": 1}, [[]], ["float32"]])  # fmt: skip


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (dict keys and list indices)."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list) and len(obj) <= 16:
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return obj


def _get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


_KEY_FIELDS = ["shape", "level", "n_streams", "sections", "dtype", "tables", "coder", "profile_id",
               "streams_crc32", "codec", "codec_id", "model_fingerprint"]  # fmt: skip


def mutate_header(rng: random.Random, blob: bytes) -> bytes:
    """Forge: change one or a few header fields (any path, any JSON type) and fix the header CRC."""
    h = header_of(blob)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        r = rng.random()
        if r < 0.45:  # the fields decode trusts most
            key = rng.choice(_KEY_FIELDS)
            sub = [p for p in _paths(h.get(key)) if p] if isinstance(h.get(key), (list, dict)) else []
            path = (key,) + (rng.choice(sub) if sub and rng.random() < 0.7 else ())
        elif r < 0.9 and len(_paths(h)) > 1:
            path = rng.choice(_paths(h)[1:])
        else:
            path = ()
        if path == ():
            h = rng.choice([[], None, 1, "x", {}, [h], {"header": h}])
            break
        try:
            parent = _get(h, path[:-1])
            if isinstance(parent, dict) and (rng.random() < 0.1 or path[-1] not in parent):
                parent.pop(path[-1], None) if path[-1] in parent else parent.__setitem__(path[-1], _odd_value(rng))
            elif isinstance(parent, list) and rng.random() < 0.1:
                parent.append(_odd_value(rng)) if rng.random() < 0.5 else parent.pop(path[-1])
            else:
                h = _set(h, path, _odd_value(rng, _get(h, path)))
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or retyped the path
            continue
    if rng.random() < 0.05:
        h = h if not isinstance(h, dict) else {**h, rng.choice(["extra", "__proto__", ""]): _odd_value(rng)}
    try:
        head = dump_header(h)
    except ValueError:  # nan/inf are fine in Python's JSON; deep recursion is not
        head = b"{}"
    return with_header(blob, head)


def mutate_header_text(rng: random.Random, blob: bytes) -> bytes:
    """Forge: byte-level damage to the header JSON text (bad UTF-8, bad JSON, deep nesting), CRC fixed."""
    head = bytearray(dump_header(header_of(blob)))
    r = rng.random()
    if r < 0.15:
        depth = rng.choice([100, 10_000, 200_000])
        head = bytearray(b"[" * depth + b"]" * depth)
    elif r < 0.25:
        head = bytearray(head.replace(b'"', b"'", 1) if rng.random() < 0.5 else head + b"\xff\xfe")
    elif r < 0.35:  # duplicate keys: JSON allows them, the last one wins
        head = bytearray(head[:-1] + b',"level":' + str(rng.choice(_INTERESTING_INTS)).encode() + b"}")
    elif r < 0.42:  # numbers Python's JSON refuses or turns odd: 5000 digits, 1e999, -0, NaN
        num = rng.choice([b"9" * 5000, b"1e999", b"-0", b"NaN", b"-Infinity", b"1" + b"0" * 400])
        head = bytearray(head[:-1] + b',"' + rng.choice([b"n_streams", b"level", b"extra"]) + b'":' + num + b"}")
    else:
        _raw_edit(rng, head)
    return with_header(blob, bytes(head))


def mutate_sections(rng: random.Random, blob: bytes) -> bytes:
    """Forge: change section arrays (values, dtype, shape, names) and re-pack with valid CRCs."""
    p = split(blob)
    if not p.sections:
        return blob
    name = rng.choice(sorted(p.sections))
    arr = p.sections[name].copy()
    r = rng.random()
    if r < 0.3 and arr.size:
        flat = arr.reshape(-1)
        idx = rng.randrange(flat.size)
        # bf16 bit patterns: NaN, +inf, -inf, -0, 0, huge, tiny, negative
        v = rng.choice([0x7FC0, 0x7F80, 0xFF80, 0x8000, 0, 0x7F7F, 0x0001, 0xBF80, rng.randrange(65536)])
        flat[idx] = np.array(v, dtype=np.uint64).astype(flat.dtype)  # wraps in a narrower integer dtype
    elif r < 0.45 and arr.size:
        arr = np.random.default_rng(rng.randrange(2**32)).integers(0, 65536, arr.shape).astype(arr.dtype)
    elif r < 0.6 and name == "tables":  # a differently shaped but valid table: every row sums to 2**16
        n = np.random.default_rng(rng.randrange(2**32))
        counts = n.integers(0, 50, arr.shape) * (n.random(arr.shape) < 0.3)
        arr = counts_to_freqs(counts + (counts.sum(axis=1, keepdims=True) == 0), alpha=0.0).astype(np.uint16)
    elif r < 0.7:
        arr = arr.astype(rng.choice([np.uint8, np.int32, np.float32]))
    elif r < 0.8:
        arr = (
            arr.reshape(-1)[: max(0, arr.size - rng.randint(1, 3))]
            if rng.random() < 0.5
            else np.concatenate([arr.reshape(-1), arr.reshape(-1)[:3]])
        )
    elif r < 0.9:
        p.sections[rng.choice(["extra", name + "_", "tables"])] = arr
    else:
        del p.sections[name]
        arr = None  # type: ignore[assignment]
    if arr is not None:
        p.sections[name] = arr
    return repack(p)


def mutate_streams(rng: random.Random, blob: bytes, other: bytes) -> bytes:
    """Forge: damage, drop, add, reorder or swap substreams and re-pack with valid CRCs."""
    p = split(blob)
    s = p.streams
    r = rng.random()
    if r < 0.35 and s:
        i = rng.randrange(len(s))
        b = bytearray(s[i])
        _raw_edit(rng, b)
        s[i] = bytes(b)
    elif r < 0.45 and s:
        s.pop(rng.randrange(len(s)))
    elif r < 0.55:
        s.insert(rng.randrange(len(s) + 1), rng.randbytes(rng.choice([0, 1, 63, 64, 66, 200])))
    elif r < 0.65 and len(s) > 1:
        i, j = rng.sample(range(len(s)), 2)
        s[i], s[j] = s[j], s[i]
    elif r < 0.75 and s:
        s[rng.randrange(len(s))] = b""
    elif r < 0.9:  # the substreams of another blob (other coder, shape or level)
        try:
            p.streams = split(other).streams
        except CacheGenFormatError:
            pass
    else:
        i = rng.randrange(len(s)) if s else 0
        if s:
            s[i] = rng.randbytes(len(s[i]))
    return repack(p)


def mutate_transplant(rng: random.Random, blob: bytes, other: bytes) -> bytes:
    """Forge: the header of one blob over the sections and substreams of another, CRCs valid."""
    a, b = split(blob), split(other)
    b.header = {**b.header, **{k: a.header[k] for k in rng.sample(sorted(a.header), rng.randint(1, 4)) if k in a.header}}
    return repack(b, keep_header_fields=rng.random() < 0.3)


def mutate_table(rng: random.Random, blob: bytes) -> bytes:
    """Forge: make the stream table disagree with the payloads, with its CRC fixed in the header."""
    p = split(blob)
    h = header_of(blob)
    body = blob[_PREAMBLE.size + _PREAMBLE.unpack_from(blob, 0)[3] :]
    sec_bytes = sum(v.nbytes for v in p.sections.values())
    n = len(p.streams)
    table = bytearray(body[sec_bytes : sec_bytes + n * _STREAM_ENTRY.size])
    if n:
        i = rng.randrange(n)
        length, crc = _STREAM_ENTRY.unpack_from(table, i * _STREAM_ENTRY.size)
        length = rng.choice([0, 1, length + 1, max(length - 1, 0), 2**31, 2**32 - 1, length * 2])
        _STREAM_ENTRY.pack_into(table, i * _STREAM_ENTRY.size, length, crc)
    h["streams_crc32"] = zlib.crc32(table) & 0xFFFFFFFF
    if rng.random() < 0.3:
        h["n_streams"] = rng.choice([0, n + 1, n - 1, 2**20, 2**31])
    rest = body[:sec_bytes] + bytes(table) + body[sec_bytes + n * _STREAM_ENTRY.size :]
    head = dump_header(h)
    return _PREAMBLE.pack(MAGIC, p.version, p.reserved, len(head), zlib.crc32(head) & 0xFFFFFFFF) + head + rest


def _raw_edit(rng: random.Random, b: bytearray, other: bytes = b"") -> None:
    """One in-place byte-level edit of ``b`` (bit flips, set bytes, insert, delete, truncate, splice...)."""
    op = rng.randrange(10)
    n = len(b)
    if op == 0 and n:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif op == 1 and n:
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(n)] = rng.choice([0, 0xFF, 0x7F, 0x80, 0x01, rng.randrange(256)])
    elif op == 2:
        i = rng.randrange(n + 1)
        b[i:i] = rng.randbytes(rng.choice([1, 2, 4, 8, 16, 100]))
    elif op == 3 and n:
        i = rng.randrange(n)
        del b[i : i + rng.choice([1, 2, 4, 16, 64, n])]
    elif op == 4:
        del b[rng.randrange(n + 1) :]
    elif op == 5:
        b += rng.randbytes(rng.choice([1, 4, 64])) if rng.random() < 0.5 else bytes(rng.choice([1, 16]))
    elif op == 6 and n:
        i = rng.randrange(n)
        j = rng.randrange(i, min(n, i + 64) + 1)
        b[i:i] = b[i:j]  # duplicate a range
    elif op == 7 and other:
        i, j = rng.randrange(n + 1), rng.randrange(len(other) + 1)
        b[i:] = other[j:]  # splice: our head, the other blob's tail
    elif op == 8 and n >= 4:
        i = rng.randrange(n - 3)
        b[i : i + 4] = (rng.choice(_INTERESTING_INTS) & 0xFFFFFFFF).to_bytes(4, "little")
    elif n:
        i, j = sorted(rng.sample(range(n + 1), 2)) if n > 1 else (0, n)
        b[i:j] = bytes(reversed(b[i:j]))


def mutate_raw(rng: random.Random, blob: bytes, other: bytes) -> bytes:
    """Corrupt: byte-level edits with the checksums left as they are (1-3 edits)."""
    b = bytearray(blob)
    if rng.random() < 0.15:  # aim at the preamble: magic, version, reserved, header length, header CRC
        field = rng.choice([(0, 4), (4, 2), (6, 2), (8, 4), (12, 4)])
        v = rng.choice(_INTERESTING_INTS) & ((1 << (8 * field[1])) - 1)
        b[field[0] : sum(field)] = v.to_bytes(field[1], "little")
        return bytes(b)
    for _ in range(rng.choice([1, 1, 2, 3])):
        _raw_edit(rng, b, other)
    return bytes(b)


#: (name, forged?, weight, function(rng, blob, other) -> bytes)
MUTATORS: list[tuple[str, bool, float, Callable[[random.Random, bytes, bytes], bytes]]] = [
    ("raw", False, 0.30, mutate_raw),
    ("header", True, 0.30, lambda rng, b, o: mutate_header(rng, b)),
    ("header-text", True, 0.06, lambda rng, b, o: mutate_header_text(rng, b)),
    ("sections", True, 0.10, lambda rng, b, o: mutate_sections(rng, b)),
    ("streams", True, 0.12, mutate_streams),
    ("transplant", True, 0.06, mutate_transplant),
    ("table", True, 0.04, lambda rng, b, o: mutate_table(rng, b)),
    ("identity", False, 0.02, lambda rng, b, o: b),
]


def mutate(rng: random.Random, seed: Seed, seeds: Sequence[Seed]) -> tuple[bytes, str, bool]:
    """One mutated input from ``seed`` (and sometimes another seed): (bytes, mutator name, forged?)."""
    other = rng.choice(seeds).blob
    name, forged, _, fn = rng.choices(MUTATORS, weights=[m[2] for m in MUTATORS])[0]
    data = fn(rng, seed.blob, other)
    if rng.random() < 0.1 and name != "identity":  # stack a raw edit on top: corrupted *and* forged
        data = mutate_raw(rng, data, other)
        name += "+raw"
    return data, name, forged


# ------------------------------------------------------------------------- the oracle
class _Timeout(BaseException):
    """Raised by the SIGALRM handler inside a target that runs past the hard time limit."""


@contextmanager
def hard_deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (main thread only; elsewhere only measured)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _Timeout()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def validated_elements(header: Any, max_tokens: int = MAX_TOKENS) -> int:
    """KV elements a header may legitimately make the decoder produce (0 unless its shape passes decode's checks)."""
    shape = header.get("shape") if isinstance(header, dict) else None
    if not (isinstance(shape, list) and len(shape) == 4 and all(type(d) is int and d >= 1 for d in shape)):
        return 0
    layers, heads, tokens, dim = shape
    if max(layers, heads, dim) > 1 << 14 or tokens > max_tokens:
        return 0
    return 2 * layers * heads * tokens * dim


def alloc_bound(data: bytes, max_tokens: int = MAX_TOKENS) -> int:
    """Bytes the decoder may allocate (traced) for ``data``: a few copies of the blob, plus a fixed
    overhead, plus 48 bytes per KV element of a shape that passes decode's own checks (symbols,
    table ids, offsets...). Without a valid shape nothing may scale beyond the blob's size."""
    try:
        elements = validated_elements(header_of(data), max_tokens)
    except Exception:
        elements = 0
    return 8 * len(data) + (8 << 20) + 48 * elements


@dataclass
class Result:
    """The outcome of one input."""

    outcome: str
    detail: str = ""
    seconds: float = 0.0
    peak_bytes: int = 0
    bound_bytes: int = 0


def _same_kv(a: KVCache, b: KVCache) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _consistent(kv: KVCache, header: dict[str, Any], max_tokens: int) -> str:
    """Why a decoded KV contradicts its own header ('' if it does not)."""
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if list(kv.shape) != header.get("shape"):
        return f"decoded shape {kv.shape} != header shape {header.get('shape')}"
    if dtypes.get(header.get("dtype")) != kv.dtype:  # type: ignore[arg-type]
        return f"decoded dtype {kv.dtype} != header dtype {header.get('dtype')}"
    if kv.num_tokens > max_tokens:
        return f"{kv.num_tokens} tokens > max_tokens"
    if not (torch.isfinite(kv.keys).all() and torch.isfinite(kv.values).all()):
        return "non-finite KV accepted"
    return ""


def run_one(
    fn: Callable[[], Any], bound: int, hang_s: float, hard_s: float, trace: bool
) -> tuple[Any, BaseException | None, Result]:
    """Run ``fn`` under the time and allocation watch; return (value, exception, partial result)."""
    started = trace and not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    if trace:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    t = time.perf_counter()
    value, exc = None, None
    try:
        with hard_deadline(hard_s):
            value = fn()
    except _Timeout as e:
        exc = e
    except Exception as e:  # classified by the caller
        exc = e
    dt = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1] - base if trace else 0
    if started:
        tracemalloc.stop()
    res = Result("", seconds=dt, peak_bytes=peak, bound_bytes=bound)
    if isinstance(exc, _Timeout) or dt > hang_s:
        res.outcome, res.detail = "hang", f"{dt:.2f}s"
    elif trace and peak > bound:
        res.outcome, res.detail = "overalloc", f"traced peak {peak} B > bound {bound} B"
    return value, exc, res


def check_container(data: bytes, *, hang_s: float = 2.0, hard_s: float = 20.0, trace: bool = True) -> Result:
    """``format.unpack``: a ``Container`` or ``CacheGenFormatError``, quickly, within the bound."""
    _, exc, res = run_one(lambda: unpack(data, LIMITS), 8 * len(data) + (4 << 20), hang_s, hard_s, trace)
    if res.outcome:
        return res
    if exc is None:
        res.outcome = "decoded"
    elif isinstance(exc, CacheGenFormatError):
        res.outcome = "rejected"
    else:
        res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc}"[:300]
    return res


def check_codec(
    codec: KVCodec,
    data: bytes,
    *,
    expected: KVCache | None,
    forged: bool,
    hang_s: float = 2.0,
    hard_s: float = 20.0,
    trace: bool = True,
) -> Result:
    """``KVCodec.decode``: KV or ``CacheGenFormatError``; a decoded KV is judged against ``expected``.

    ``expected``: the KV the unmodified seed decodes to, or None when ``data`` is a seed
    blob itself (then ``expected`` is compared too) -- see the module doc for the rules.
    """
    kv, exc, res = run_one(lambda: codec.decode(data), alloc_bound(data, codec.max_tokens), hang_s, hard_s, trace)
    if res.outcome:
        return res
    if exc is not None:
        if isinstance(exc, CacheGenFormatError):
            res.outcome = "rejected"
        else:
            res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc}"[:300]
        return res
    if not isinstance(kv, KVCache):
        res.outcome, res.detail = "crash", f"decode returned {type(kv).__name__}"
        return res
    why = _consistent(kv, header_of(data), codec.max_tokens)
    if why:
        res.outcome, res.detail = "wrong_kv_accepted", why
    elif expected is not None and not _same_kv(kv, expected):
        if forged:
            res.outcome = "forged_accepted"
        else:
            res.outcome, res.detail = "wrong_kv_accepted", "a corrupted blob decoded to other KV than its seed"
    else:
        res.outcome = "decoded"
    return res


# --------------------------------------------------------------- direct coder fuzzing
def _random_freqs(g: np.random.Generator, n_tables: int, alphabet: int) -> np.ndarray:
    kind = g.integers(4)
    if kind == 0:  # peaked: one symbol takes almost everything (rANS's cheapest case)
        counts = np.zeros((n_tables, alphabet))
        counts[np.arange(n_tables), g.integers(0, alphabet, n_tables)] = 1e9
    elif kind == 1:
        counts = np.ones((n_tables, alphabet))
    else:
        counts = g.integers(0, 1000, (n_tables, alphabet)) * (g.random((n_tables, alphabet)) < g.random())
    counts = counts + (counts.sum(axis=1, keepdims=True) == 0)  # an empty row would be 0/0
    return counts_to_freqs(counts, alpha=0.0)


def _bad_freqs(g: np.random.Generator, freqs: np.ndarray) -> np.ndarray:
    f = freqs.copy()
    k = g.integers(7)
    if k == 0:
        f[0, 0] += 1  # sums to 2**16 + 1
    elif k == 1:
        f[0, :] = 0
        f[0, 0] = 1 << 16  # a zero-frequency symbol
    elif k == 2:
        return f.astype(np.int64)
    elif k == 3:
        return f[0]  # 1-D
    elif k == 4:
        return np.ascontiguousarray(f[:, :1])  # alphabet of 1
    elif k == 5:
        return np.zeros((0, f.shape[1]), dtype=np.uint32)
    else:
        f[0, 0] = 0xFFFFFFFF
    return f


@dataclass
class CoderCase:
    """One direct call of a coder's ``decode``; ``expect`` is set when the payloads are unmodified."""

    payloads: list[bytes]
    layout: StreamLayout
    freqs: np.ndarray
    expect: np.ndarray | None
    alphabet: int
    what: str


def coder_case(rng: random.Random, coder: Any, others: Sequence[Any]) -> CoderCase:
    """A random layout and table set, symbols coded by ``coder`` (or another coder), then maybe damaged."""
    g = np.random.default_rng(rng.randrange(2**32))
    n_streams = int(g.choice([0, 1, 1, 2, 3, 5, 8, 17]))
    big = rng.random() < 0.05
    counts = g.integers(0, 20_000 if big else 300, n_streams) * (g.random(n_streams) < 0.9)
    if n_streams and rng.random() < 0.2:
        counts[g.integers(n_streams)] = rng.choice([1, 15, 16, 17, 31, 32, 33])  # around the 16 lanes
    offsets = np.zeros(n_streams + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    period = int(g.choice([1, 2, 3, 7, 15, 16, 17, 40]))
    alphabet = int(g.choice([2, 3, 16, 255, 256, 256, 256]))
    n_tables = int(g.integers(1, 6))
    freqs = _random_freqs(g, n_tables, alphabet)
    tids = g.integers(0, n_tables, (n_streams, period)).astype(np.int32)
    layout = StreamLayout(offsets, tids)
    # symbols drawn from their own tables, so that peaked tables give long cheap runs
    cdf = np.cumsum(freqs, axis=1) / float(1 << 16)
    n = int(offsets[-1])
    table_of = (
        np.concatenate([np.resize(tids[s], int(counts[s])) for s in range(n_streams)]) if n else np.zeros(0, dtype=np.int32)
    )
    symbols = (
        (cdf[table_of] < g.random((n, 1))).sum(axis=1).clip(0, alphabet - 1).astype(np.uint8) if n else np.zeros(0, np.uint8)
    )
    enc = rng.choice(list(others)) if others and rng.random() < 0.15 else coder
    payloads = enc.encode(symbols, layout, freqs)
    what = f"n_streams={n_streams} symbols={n} period={period} alphabet={alphabet} by={enc.name}"
    r = rng.random()
    if enc is coder and r < 0.25:
        if rng.random() < 0.3:  # same values in strided, non-contiguous arrays: a coder must not assume C order
            layout = StreamLayout(np.repeat(offsets, 2)[::2], np.repeat(tids, 2, axis=1)[:, ::2])
            what += " strided layout"
        return CoderCase(payloads, layout, freqs, symbols, alphabet, "valid " + what)
    if r < 0.55 and payloads:
        i = rng.randrange(len(payloads))
        b = bytearray(payloads[i])
        _raw_edit(rng, b, rng.choice(payloads))
        payloads[i] = bytes(b)
        what += f" damaged stream {i}"
    elif r < 0.65 and payloads:
        payloads = [rng.randbytes(rng.choice([0, 3, 64, 65, 66, 130, len(p)])) for p in payloads]
        what += " random payloads"
    elif r < 0.72:
        payloads = payloads[:-1] if payloads and rng.random() < 0.5 else payloads + [b""]
        what += " wrong payload count"
    elif r < 0.8:
        freqs = _bad_freqs(g, freqs)
        what += " bad tables"
    elif r < 0.88 and n_streams:
        bad = rng.randrange(4)
        if bad == 0:
            tids = tids.copy()
            tids[0, 0] = rng.choice([-1, n_tables, 2**31 - 1])
        elif bad == 1:
            offsets = offsets.copy()
            offsets[-1] = max(0, offsets[-2] - 1) if n_streams else 0
        elif bad == 2:
            offsets = offsets.astype(np.int32)
        else:
            tids = tids.astype(np.int64)
        layout = StreamLayout(offsets, tids)
        what += " bad layout"
    elif enc is not coder:
        what += " (cross-coder)"
    else:  # swap two payloads
        if len(payloads) > 1:
            i, j = rng.sample(range(len(payloads)), 2)
            payloads[i], payloads[j] = payloads[j], payloads[i]
        what += " swapped streams"
    return CoderCase(payloads, layout, freqs, None, alphabet, what)


def check_coder(coder: Any, case: CoderCase, *, hang_s: float = 2.0, hard_s: float = 20.0, trace: bool = True) -> Result:
    """A coder's ``decode``: uint8 symbols in the alphabet (exactly the input when unmodified), or ``CoderError``."""
    n = int(case.layout.offsets[-1]) if case.layout.offsets.size else 0
    bound = (8 << 20) + 8 * sum(len(p) for p in case.payloads) + 24 * max(n, 0) + 16 * case.layout.table_ids.size
    out, exc, res = run_one(lambda: coder.decode(case.payloads, case.layout, case.freqs), bound, hang_s, hard_s, trace)
    if res.outcome:
        res.detail += f" [{case.what}]"
        return res
    if exc is not None:
        if isinstance(exc, CoderError) and case.expect is None:
            res.outcome = "rejected"
        else:
            res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc} [{case.what}]"[:300]
        return res
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != (n,):
        res.outcome, res.detail = (
            "wrong_kv_accepted",
            f"decode returned {type(out).__name__} {getattr(out, 'shape', '')} [{case.what}]",
        )
    elif out.size and int(out.max()) >= case.alphabet:
        res.outcome, res.detail = "wrong_kv_accepted", f"symbol {int(out.max())} outside the alphabet [{case.what}]"
    elif case.expect is not None and not np.array_equal(out, case.expect):
        res.outcome, res.detail = "wrong_kv_accepted", f"valid payloads mis-decoded [{case.what}]"
    else:
        res.outcome = "decoded"
    return res


# ---------------------------------------------------------------------------- the run
@dataclass
class TargetStats:
    """Outcome counts of one target, with the first few findings."""

    inputs: int = 0
    outcomes: Counter = field(default_factory=Counter)
    by_mutator: Counter = field(default_factory=Counter)
    findings: list[dict[str, Any]] = field(default_factory=list)
    max_seconds: float = 0.0
    max_peak_over_bound: float = 0.0

    def add(self, res: Result, mutator: str, data: bytes | None = None, seed: str = "") -> None:
        self.inputs += 1
        self.outcomes[res.outcome] += 1
        self.by_mutator[f"{mutator}:{res.outcome}"] += 1
        self.max_seconds = max(self.max_seconds, res.seconds)
        if res.bound_bytes:
            self.max_peak_over_bound = max(self.max_peak_over_bound, res.peak_bytes / res.bound_bytes)
        if res.outcome in ("crash", "hang", "overalloc", "wrong_kv_accepted") and len(self.findings) < 20:
            f = {"outcome": res.outcome, "detail": res.detail, "mutator": mutator, "seed": seed}
            if data is not None:
                f["input_hex"] = data.hex() if len(data) <= 4096 else data[:4096].hex() + "..."
            self.findings.append(f)

    @property
    def bad(self) -> int:
        return sum(self.outcomes[k] for k in ("crash", "hang", "overalloc", "wrong_kv_accepted"))

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            **{k: self.outcomes.get(k, 0) for k in OUTCOMES},
            "max_input_s": round(self.max_seconds, 4),
            "max_peak_over_bound": round(self.max_peak_over_bound, 4),
        }


@dataclass
class FuzzReport:
    """Per-target statistics of a run."""

    targets: dict[str, TargetStats]
    seconds: float
    seeds: int
    coders: list[str]
    rss_growth_mb: float

    @property
    def inputs(self) -> int:
        return sum(t.inputs for t in self.targets.values())

    @property
    def findings(self) -> list[dict[str, Any]]:
        return [{"target": name, **f} for name, t in self.targets.items() for f in t.findings]

    def as_dict(self) -> dict[str, Any]:
        return self.summary()

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "seconds": round(self.seconds, 1),
            "inputs_per_s": round(self.inputs / max(self.seconds, 1e-9), 1),
            "seeds": self.seeds,
            "coders": self.coders,
            "rss_growth_mb": round(self.rss_growth_mb, 1),
            "targets": {name: t.summary() for name, t in self.targets.items()},
            "findings": len(self.findings),
        }


def _max_rss_mb() -> float:
    try:
        import resource  # noqa: PLC0415

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:  # pragma: no cover - not on Linux
        return 0.0


def run(
    inputs: int = 10_000,
    seconds: float = 60.0,
    *,
    seed: int = 0,
    coders: Sequence[str] | None = None,
    weights: tuple[float, float, float] = (0.15, 0.6, 0.25),
    hang_s: float = 2.0,
    trace_every: int = 1,
    progress: Callable[[FuzzReport], None] | None = None,
) -> FuzzReport:
    """Fuzz for ``inputs`` inputs or ``seconds`` seconds, whichever ends first.

    ``weights``: shares of the container, codec and direct-coder targets. ``trace_every``:
    watch allocations with ``tracemalloc`` on every n-th input (tracing slows Python down).
    """
    rss0 = _max_rss_mb()
    names = list(coders) if coders is not None else list(available_coders())
    seeds = make_seeds(seed, names)
    coder_objs = {n: get_coder(n) for n in names}
    stats: dict[str, TargetStats] = {"container": TargetStats(), "codec": TargetStats()}
    stats.update({f"coder-{n}": TargetStats() for n in names})
    rng = random.Random(seed)
    blobs = {s.blob: s for s in seeds}
    start = time.perf_counter()
    tracing = trace_every > 0
    if tracing:
        tracemalloc.start()
    done = 0
    try:
        while done < inputs and time.perf_counter() - start < seconds:
            trace = tracing and done % trace_every == 0
            target = rng.choices(["container", "codec", "coder"], weights=weights)[0]
            if target == "coder":
                name = rng.choice(names)
                coder = coder_objs[name]
                case = coder_case(rng, coder, [c for n2, c in coder_objs.items() if n2 != name])
                stats[f"coder-{name}"].add(check_coder(coder, case, hang_s=hang_s, trace=trace), case.what.split(" ")[-1])
            else:
                s = rng.choice(seeds)
                data, mut, forged = mutate(rng, s, seeds)
                if data in blobs:  # a mutation that gave back a real blob must decode to that blob's KV
                    s, forged = blobs[data], False
                if target == "container":
                    stats["container"].add(check_container(data, hang_s=hang_s, trace=trace), mut, data, s.name)
                else:
                    res = check_codec(s.codec, data, expected=s.kv, forged=forged, hang_s=hang_s, trace=trace)
                    stats["codec"].add(res, mut, data, s.name)
            done += 1
            if progress is not None and done % 2000 == 0:
                progress(FuzzReport(stats, time.perf_counter() - start, len(seeds), names, _max_rss_mb() - rss0))
    except KeyboardInterrupt:  # an interrupted run still reports what it found
        pass
    finally:
        if tracing:
            tracemalloc.stop()
    return FuzzReport(stats, time.perf_counter() - start, len(seeds), names, _max_rss_mb() - rss0)


def seed_outcomes(seeds: Sequence[Seed]) -> list[str]:
    """Sanity check of the oracle: every seed decodes to its own KV under every target."""
    bad = []
    for s in seeds:
        r = check_codec(s.codec, s.blob, expected=s.kv, forged=False, trace=False)
        if r.outcome != "decoded":
            bad.append(f"{s.name}: {r.outcome} {r.detail}")
        if check_container(s.blob, trace=False).outcome != "decoded":
            bad.append(f"{s.name}: container rejected")
    return bad


# ----------------------------------------------------------------- profile files
def profile_file_cases(rng: random.Random, directory: Any, n: int) -> Iterator[tuple[str, Any]]:
    """``n`` damaged or forged profile files (safetensors tables + JSON metadata) written to ``directory``.

    Structured ones rewrite the metadata (missing keys, odd JSON types and values, deep
    nesting, huge numbers) or the table array (dtype, shape, values) through safetensors
    itself; raw ones flip, cut or splice the file's bytes."""
    from pathlib import Path  # noqa: PLC0415

    from safetensors.numpy import save_file  # noqa: PLC0415

    _, codec, _ = make_codecs(0)[2]
    prof = codec.profile
    assert prof is not None
    directory = Path(directory)
    good = directory / "good.safetensors"
    prof.save(good)
    raw = good.read_bytes()
    for i in range(n):
        path = directory / f"case-{i}.safetensors"
        meta: Any = json.loads(json.dumps(prof.meta))
        freqs = prof.freqs.astype(np.uint16)
        r = rng.random()
        if r < 0.4:
            path_ = rng.choice(_paths(meta)[1:])
            if rng.random() < 0.2:
                meta.pop(path_[0], None)
            else:
                meta = _set(meta, path_, _odd_value(rng, _get(meta, path_)))
            text = json.dumps(meta)
        elif r < 0.5:
            text = rng.choice(["[" * 100_000 + "]" * 100_000, '{"format": 1' + "0" * 5000 + "}", "null", "[]", '{"a":',
                               json.dumps(meta).replace('"channels": ', '"channels": 1e999, "x": ')])  # fmt: skip
        else:
            text = json.dumps(meta)
        if 0.5 <= r < 0.7:
            g = np.random.default_rng(rng.randrange(2**32))
            k = rng.randrange(5)
            if k == 0:
                freqs = freqs.astype(rng.choice([np.uint8, np.int32, np.float32, np.uint32]))
            elif k == 1:
                freqs = freqs[: max(0, freqs.shape[0] - rng.randint(1, 3))]
            elif k == 2:
                freqs = freqs.reshape(-1)
            elif k == 3:
                freqs = freqs.copy()
                freqs[g.integers(freqs.shape[0]), g.integers(freqs.shape[1])] = rng.choice([0, 1, 65535])
            else:
                freqs = g.integers(0, 65536, freqs.shape).astype(np.uint16)
        try:
            save_file({"freqs": np.ascontiguousarray(freqs)}, str(path), metadata={"cachegen_profile": text})
        except Exception:  # safetensors refuses to write it: write the raw good file instead
            path.write_bytes(raw)
        if r >= 0.7:  # raw damage to the file bytes
            b = bytearray(path.read_bytes())
            _raw_edit(rng, b, raw)
            path.write_bytes(bytes(b))
        yield f"profile-{'meta' if r < 0.5 else 'tables' if r < 0.7 else 'raw'}", path


def check_profile_file(path: Any, seeds: Sequence[Seed]) -> Result:
    """What the library does with a profile file, step by step: ``Profile.load``; the checks of
    ``find_profile`` (its model fingerprint and codec id); ``KVCodec(config, profile)`` (a
    ``ValueError`` for a profile of another codec is its documented answer); decoding the
    profile seed blobs. Each step must end in a value or ``CacheGenFormatError``."""
    cfg = next(s.codec.config for s in seeds if s.name.startswith("profile/"))

    def body() -> str:
        try:
            prof = Profile.load(path)
            _ = (prof.model_fingerprint == FINGERPRINT, prof.codec_id == cfg.codec_id)
        except CacheGenFormatError:
            return "rejected"
        try:
            codec = KVCodec(cfg, prof, fingerprint=FINGERPRINT, max_tokens=MAX_TOKENS, limits=LIMITS)
        except (CacheGenFormatError, ValueError):
            return "rejected"
        for s in seeds:
            if s.name.startswith("profile/"):
                try:
                    codec.decode(s.blob)
                except CacheGenFormatError:
                    pass
        return "decoded"

    value, exc, res = run_one(body, 64 << 20, 2.0, 20.0, True)
    if res.outcome:
        return res
    if exc is not None:
        res.outcome, res.detail = "crash", f"{type(exc).__name__}: {exc}"[:300]
    else:
        res.outcome = value
    return res


def run_profiles(n: int, seed: int = 0, seeds: Sequence[Seed] | None = None) -> TargetStats:
    """``n`` damaged or forged profile files through ``check_profile_file``."""
    import tempfile  # noqa: PLC0415

    seeds = list(seeds) if seeds is not None else make_seeds(seed)
    stats = TargetStats()
    with tempfile.TemporaryDirectory(prefix="cachegen-fuzz-profile-") as d:
        for name, path in profile_file_cases(random.Random(seed), d, n):
            res = check_profile_file(path, seeds)
            if res.outcome == "crash":
                res.detail += f" [{name}]"
            stats.add(res, name)
            path.unlink()
    return stats
