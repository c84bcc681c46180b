"""Mutators of real blobs: *raw* corruption (checksums left stale) and *forgeries* re-packed with valid CRCs.

Raw mutations test that corruption is detected; forged ones (header fields, header
text, sections, substreams, transplants, the stream table) reach the deep decode
paths, as an attacker with write access to the store could.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from cachegen_core.errors import CacheGenFormatError
from cachegen_core.codec.format import _PREAMBLE, _STREAM_ENTRY, MAGIC
from cachegen_core.codec.classes import counts_to_freqs

from .blobs import dump_header, header_of, repack, split, with_header
from .edits import INTERESTING_INTS, json_get, json_paths, json_set, odd_value, raw_edit
from .seeds import Seed


_KEY_FIELDS = ["shape", "level", "n_streams", "sections", "dtype", "tables", "coder", "profile_id",
               "streams_crc32", "codec", "codec_id", "model_fingerprint"]  # fmt: skip


def mutate_header(rng: random.Random, blob: bytes) -> bytes:
    """Forge: change one or a few header fields (any path, any JSON type) and fix the header CRC."""
    h = header_of(blob)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        r = rng.random()
        if r < 0.45:  # the fields decode trusts most
            key = rng.choice(_KEY_FIELDS)
            sub = [p for p in json_paths(h.get(key)) if p] if isinstance(h.get(key), (list, dict)) else []
            path = (key,) + (rng.choice(sub) if sub and rng.random() < 0.7 else ())
        elif r < 0.9 and len(json_paths(h)) > 1:
            path = rng.choice(json_paths(h)[1:])
        else:
            path = ()
        if path == ():
            h = rng.choice([[], None, 1, "x", {}, [h], {"header": h}])
            break
        try:
            parent = json_get(h, path[:-1])
            if isinstance(parent, dict) and (rng.random() < 0.1 or path[-1] not in parent):
                parent.pop(path[-1], None) if path[-1] in parent else parent.__setitem__(path[-1], odd_value(rng))
            elif isinstance(parent, list) and rng.random() < 0.1:
                parent.append(odd_value(rng)) if rng.random() < 0.5 else parent.pop(path[-1])
            else:
                h = json_set(h, path, odd_value(rng, json_get(h, path)))
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or retyped the path
            continue
    if rng.random() < 0.05:
        h = h if not isinstance(h, dict) else {**h, rng.choice(["extra", "__proto__", ""]): odd_value(rng)}
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
        head = bytearray(head[:-1] + b',"level":' + str(rng.choice(INTERESTING_INTS)).encode() + b"}")
    elif r < 0.42:  # numbers Python's JSON refuses or turns odd: 5000 digits, 1e999, -0, NaN
        num = rng.choice([b"9" * 5000, b"1e999", b"-0", b"NaN", b"-Infinity", b"1" + b"0" * 400])
        head = bytearray(head[:-1] + b',"' + rng.choice([b"n_streams", b"level", b"extra"]) + b'":' + num + b"}")
    else:
        raw_edit(rng, head)
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
            arr.reshape(-1)[: max(0, arr.size - rng.randint(1, 3))] if rng.random() < 0.5 else np.concatenate([arr.reshape(-1), arr.reshape(-1)[:3]])
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
        raw_edit(rng, b)
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


def mutate_raw(rng: random.Random, blob: bytes, other: bytes) -> bytes:
    """Corrupt: byte-level edits with the checksums left as they are (1-3 edits)."""
    b = bytearray(blob)
    if rng.random() < 0.15:  # aim at the preamble: magic, version, reserved, header length, header CRC
        field = rng.choice([(0, 4), (4, 2), (6, 2), (8, 4), (12, 4)])
        v = rng.choice(INTERESTING_INTS) & ((1 << (8 * field[1])) - 1)
        b[field[0] : sum(field)] = v.to_bytes(field[1], "little")
        return bytes(b)
    for _ in range(rng.choice([1, 1, 2, 3])):
        raw_edit(rng, b, other)
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
