"""The versioned, self-describing bitstream container (spec: ``docs/format.md``).

::

    offset  size  field
    0       4     magic b"CGKV"
    4       2     format version (u16, little endian)
    6       2     reserved, must be 0
    8       4     header length H (u32)
    12      4     CRC-32 of the header bytes (u32)
    16      H     header: UTF-8 JSON object
    ...           sections, in header order, sizes from their dtype and shape
    ...           stream table: n_streams x (u32 length, u64 XXH3-64)
    ...           substream payloads, concatenated

The header lists every section with its dtype, shape and XXH3-64 hash, the number of
substreams and the CRC-32 of the stream table. Every length and count is checked
against the blob's real size and against ``Limits`` before anything is allocated,
and every failure raises ``CacheGenFormatError`` saying what is wrong. Nothing is
ever deserialised as objects: sections are raw little-endian arrays of an allow-listed dtype.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import xxhash

from ..errors import CacheGenFormatError

MAGIC = b"CGKV"
VERSION = 2
#: Earlier versions and what replaced them, for the error a blob of one of them gets.
_OLD_VERSIONS = {1: "codec v1 (anchor/delta token groups)"}
_PREAMBLE = struct.Struct("<4sHHII")
_STREAM_ENTRY = struct.Struct("<IQ")
SECTION_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "int32": np.int32, "float32": np.float32}


@dataclass(frozen=True)
class Limits:
    """Hard upper bounds applied to every blob before any allocation."""

    max_blob_bytes: int = 1 << 31
    max_header_bytes: int = 1 << 20
    max_streams: int = 1 << 20
    max_section_elements: int = 1 << 28


@dataclass(frozen=True)
class Container:
    """A parsed, checksum-verified blob."""

    header: dict[str, Any]
    sections: dict[str, np.ndarray]
    streams: list[bytes] | list[memoryview]
    #: The substreams' XXH3-64 digests, when ``unpack`` was asked not to check them (``first_bad_stream`` does).
    digests: tuple[int, ...] = ()


def _crc(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _payload_hash(data: bytes | memoryview) -> int:
    """XXH3-64 of a section or substream: they hold a blob's bulk (a raw chunk: tens of megabytes),
    which CRC-32 checks at ~1-3 GB/s and XXH3 at ~10-30 GB/s, on the warm path of every fetch."""
    return xxhash.xxh3_64_intdigest(data)


def pack(header: Mapping[str, Any], sections: Mapping[str, np.ndarray], streams: Sequence[bytes]) -> bytes:
    """Serialise a header dict, named arrays and substream payloads into one blob."""
    return b"".join([frame(header, sections, streams), *streams])


def frame(header: Mapping[str, Any], sections: Mapping[str, np.ndarray], streams: Sequence[Any]) -> bytes:
    """Everything of ``pack``'s blob before its substream payloads (preamble, header, sections, stream table):
    a blob is ``frame(...)`` followed by the payloads, wherever they already are (``raw.RawCodec.stage``)."""
    sec_meta, sec_bytes = [], []
    for name, arr in sections.items():
        dtype = np.dtype(arr.dtype).name
        if dtype not in SECTION_DTYPES:
            raise ValueError(f"section {name!r}: dtype {dtype} not allowed")
        raw = np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()
        sec_meta.append({"name": name, "dtype": dtype, "shape": list(arr.shape), "xxh3": _payload_hash(raw)})
        sec_bytes.append(raw)
    table = b"".join(_STREAM_ENTRY.pack(len(s), d) for s, d in zip(streams, _digests(streams)))
    full = dict(header)
    full.update({"sections": sec_meta, "n_streams": len(streams), "streams_crc32": _crc(table)})
    head = json.dumps(full, sort_keys=True, separators=(",", ":")).encode()
    pre = _PREAMBLE.pack(MAGIC, VERSION, 0, len(head), _crc(head))
    return b"".join([pre, head, *sec_bytes, table])


def frame_bound(header: Mapping[str, Any], n_streams: int) -> int:
    """The most bytes ``frame`` takes for ``header``, no sections and ``n_streams`` substreams (the stream table's
    CRC-32 printed at its widest)."""
    full = {**header, "sections": [], "n_streams": n_streams, "streams_crc32": 0xFFFFFFFF}
    return _PREAMBLE.size + len(json.dumps(full, sort_keys=True, separators=(",", ":")).encode()) + n_streams * _STREAM_ENTRY.size


def read_header(blob: bytes | memoryview, limits: Limits = Limits()) -> dict[str, Any]:
    """Parse and verify only the preamble and header (cheap; for ``cachegen inspect``)."""
    header, _ = _read_header(memoryview(blob), limits)
    return header


def _read_header(mv: memoryview, limits: Limits) -> tuple[dict[str, Any], int]:
    n = len(mv)
    if n > limits.max_blob_bytes:
        raise CacheGenFormatError(f"blob of {n} bytes exceeds max_blob_bytes={limits.max_blob_bytes}")
    if n < _PREAMBLE.size:
        raise CacheGenFormatError(f"blob of {n} bytes is shorter than the {_PREAMBLE.size}-byte preamble (truncated?)")
    magic, version, reserved, hlen, hcrc = _PREAMBLE.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CacheGenFormatError(f"bad magic {bytes(magic)!r}: not a CacheGen blob")
    if version in _OLD_VERSIONS:
        raise CacheGenFormatError(
            f"blob is format version {version}, {_OLD_VERSIONS[version]}; this build reads version {VERSION} only: re-encode the context"
        )
    if version != VERSION:
        raise CacheGenFormatError(f"unsupported format version {version} (this build reads version {VERSION})")
    if reserved != 0:
        raise CacheGenFormatError("reserved preamble field is not zero")
    if hlen > limits.max_header_bytes:
        raise CacheGenFormatError(f"header length {hlen} exceeds max_header_bytes={limits.max_header_bytes}")
    end = _PREAMBLE.size + hlen
    if end > n:
        raise CacheGenFormatError(f"header claims {hlen} bytes but the blob ends after {n - _PREAMBLE.size} (truncated)")
    raw = mv[_PREAMBLE.size : end]
    if _crc(raw) != hcrc:
        raise CacheGenFormatError("header checksum mismatch (corrupted header)")
    try:
        header = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, ints over 4300 digits
        raise CacheGenFormatError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CacheGenFormatError("header is not a JSON object")
    return header, end


def _int_field(header: Mapping[str, Any], key: str, lo: int, hi: int) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CacheGenFormatError(f"header field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def unpack(blob: bytes | memoryview, limits: Limits = Limits(), *, views: bool = False, hashes: bool = True) -> Container:
    """Parse and verify a whole blob: header, every section and every substream checksum.

    ``views``: the substreams are memoryviews into ``blob`` instead of copies (for large
    payloads read once; ``blob`` must then stay unchanged while they are used). ``hashes=False``
    (with ``views``): every length and the stream table's CRC are checked, the substreams' own
    checksums are left to the caller (``first_bad_stream``), e.g. beside their copy to a GPU."""
    mv = memoryview(blob)
    header, pos = _read_header(mv, limits)
    n = len(mv)
    secs = header.get("sections")
    if not isinstance(secs, list) or len(secs) > 64:
        raise CacheGenFormatError("header field 'sections' must be a list of at most 64 entries")
    sections: dict[str, np.ndarray] = {}
    for s in secs:
        if not isinstance(s, dict) or not isinstance(s.get("name"), str) or not isinstance(s.get("dtype"), str) or s["dtype"] not in SECTION_DTYPES:
            raise CacheGenFormatError(f"bad section descriptor {s!r}")
        shape = s.get("shape")
        if not isinstance(shape, list) or len(shape) > 8 or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise CacheGenFormatError(f"section {s['name']!r}: bad shape {shape!r}")
        count = math.prod(shape)  # exact: numpy's int64 product would wrap or overflow on forged dims
        if count > limits.max_section_elements:
            raise CacheGenFormatError(f"section {s['name']!r} claims {count} elements, over the limit")
        dtype = np.dtype(SECTION_DTYPES[s["dtype"]]).newbyteorder("<")
        size = count * dtype.itemsize
        if pos + size > n:
            raise CacheGenFormatError(f"section {s['name']!r} needs {size} bytes past offset {pos}, blob has {n} (truncated)")
        raw = mv[pos : pos + size]
        if _payload_hash(raw) != _int_field(s, "xxh3", 0, (1 << 64) - 1):
            raise CacheGenFormatError(f"section {s['name']!r} checksum mismatch (corrupted)")
        if s["name"] in sections:
            raise CacheGenFormatError(f"duplicate section {s['name']!r}")
        sections[s["name"]] = np.frombuffer(raw, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
        pos += size
    n_streams = _int_field(header, "n_streams", 0, limits.max_streams)
    table_size = n_streams * _STREAM_ENTRY.size
    if pos + table_size > n:
        raise CacheGenFormatError(f"stream table of {n_streams} entries runs past the end of the blob (truncated)")
    table = mv[pos : pos + table_size]
    if _crc(table) != _int_field(header, "streams_crc32", 0, 0xFFFFFFFF):
        raise CacheGenFormatError("stream table checksum mismatch (corrupted)")
    pos += table_size
    entries = [_STREAM_ENTRY.unpack_from(table, i * _STREAM_ENTRY.size) for i in range(n_streams)]
    total = sum(length for length, _ in entries)
    if pos + total != n:
        what = "truncated" if pos + total > n else "trailing bytes"
        raise CacheGenFormatError(f"substreams need {total} bytes after offset {pos}, blob has {n - pos} ({what})")
    chunks = []
    for length, _ in entries:
        chunks.append(mv[pos : pos + length])
        pos += length
    digests = tuple(digest for _, digest in entries)
    if views and not hashes:
        return Container(header, sections, chunks, digests)
    bad = first_bad_stream(Container(header, sections, chunks, digests))
    if bad is not None:
        raise CacheGenFormatError(f"substream {bad} checksum mismatch (corrupted)")
    return Container(header, sections, chunks if views else [bytes(c) for c in chunks])


def first_bad_stream(c: Container) -> int | None:
    """The first substream of ``c`` (unpacked with ``hashes=False``) whose XXH3-64 is not its digest, or None."""
    for i, ok in enumerate(_hashes_match(c.streams, c.digests)):  # type: ignore[arg-type]
        if not ok:
            return i
    return None


#: Substream bytes from which a blob's hashes are split between the caller and a helper thread.
PARALLEL_HASH_BYTES = 8 << 20
_hash_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool)
_hash_pool_lock = threading.Lock()


def _digests(chunks: Sequence[Any]) -> list[int]:
    """The XXH3-64 of each chunk. Past ``PARALLEL_HASH_BYTES`` the second half is hashed by a helper thread beside
    the caller (xxhash releases the GIL): the first raw chunk of a 3K context, 35 MB, is checked on the critical path
    of a warm request, before anything else can run, and a 7B chunk's 200 MB when it is stored from a GPU."""

    def part(lo: int, hi: int) -> list[int]:
        return [_payload_hash(chunks[i]) for i in range(lo, hi)]

    n = len(chunks)
    if n < 2 or sum(len(c) for c in chunks) < PARALLEL_HASH_BYTES or (os.cpu_count() or 1) < 2:
        return part(0, n)
    global _hash_pool
    with _hash_pool_lock:
        if _hash_pool is None or _hash_pool[0] != os.getpid():  # a forked child has the pool but not its thread
            _hash_pool = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="cachegen-hash"))
        pool = _hash_pool[1]
    second = pool.submit(part, n // 2, n)
    return part(0, n // 2) + second.result()


def _hashes_match(chunks: Sequence[memoryview], digests: Sequence[int]) -> list[bool]:
    """Whether each chunk's XXH3-64 is its digest (``_digests``)."""
    return [a == b for a, b in zip(_digests(chunks), digests)]
