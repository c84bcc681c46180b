"""What a blob is once its header is read: the dataclasses ``KVCodec`` passes around, the header's
bounds, and the conversions of its sections (split from ``kvcodec.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..coders import StreamLayout
from .format import Container
from .pipeline import Coded
from ..errors import CacheGenFormatError
from .quantize import from_bf16_bits, to_bf16_bits
from .substreams import ChunkGeometry

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_DIM = 1 << 14
#: Largest context position a blob may claim for its first token.
MAX_START = 1 << 40
#: A blob may decode to at most this many KV elements per byte (0.004 bits per element).
MAX_ELEMENTS_PER_BYTE = 2048


@dataclass(frozen=True)
class Prepared:
    """A chunk quantised and laid out for the entropy coder."""

    level: int
    start: int
    shape: list[int]
    dtype: str
    geometry: ChunkGeometry
    coded: Coded
    symbols: np.ndarray
    layout: StreamLayout
    freqs: np.ndarray
    sections: dict[str, np.ndarray]


@dataclass(frozen=True)
class BlobHeader:
    """A blob's header once checked against a codec (``KVCodec.check_header``): what decoding needs."""

    level: int
    shape: tuple[int, int, int, int]  # (layers, kv_heads, tokens, head_dim)
    dtype: torch.dtype  # of the KV that was encoded, and is decoded
    tables: str  # "inline" (in the blob) or "profile"
    coder: str  # the coder (byte format) of the substreams
    profile_id: str | None
    model_fingerprint: str
    start: int = 0  # context position of the first token when encoded

    @property
    def channels(self) -> int:
        return self.shape[1] * self.shape[3]


@dataclass(frozen=True)
class Checked:
    """A blob whose container and header ``KVCodec.check`` verified: ``decode`` takes it as it is."""

    blob: bytes
    header: BlobHeader
    container: Container

    def __len__(self) -> int:
        return len(self.blob)


@dataclass(frozen=True)
class SideInfo:
    """A blob's checked parameters: chunk ``mean`` and ``step`` float32 ``(2, layers, heads, dim)``,
    ``exact`` tokens float32 ``(2, layers, heads, n, dim)`` and ``row``, the table (class) of every
    position of the coder's period."""

    mean: torch.Tensor
    step: torch.Tensor
    exact: torch.Tensor
    row: np.ndarray


def side_info(h: BlobHeader, c: Container, geo: ChunkGeometry, profile_row: np.ndarray | None, n_classes: int) -> SideInfo:
    """The sections of a blob whose header passed ``KVCodec.check_header``, checked: shapes, dtypes,
    finite parameters, positive steps, classes below ``n_classes`` (``CacheGenFormatError`` otherwise).
    ``profile_row``: the profile's classes at the blob's level, for a blob coded with them."""
    layers, heads, tokens, dim = h.shape
    n_exact = tokens - geo.coded_tokens
    expected = {"mean": ((2, layers, heads, dim), np.uint16), "step": ((2, layers, heads, dim), np.uint16)}
    if n_exact:
        expected["exact"] = ((2, layers, heads, n_exact, dim), np.float32)
    if h.tables == "inline":
        expected["classes"] = ((2, layers, heads * dim), np.uint8)
    got = {k: (v.shape, v.dtype) for k, v in c.sections.items()}
    if set(got) != set(expected) or any(got[k][0] != shape or got[k][1] != dt for k, (shape, dt) in expected.items()):
        raise CacheGenFormatError(f"sections {got} do not match the expected {expected}")
    mean, step = (from_bf16_bits(torch.from_numpy(c.sections[k].astype(np.int32))) for k in ("mean", "step"))
    exact = torch.from_numpy(c.sections["exact"]) if n_exact else torch.zeros(2, layers, heads, 0, dim)
    if not (torch.isfinite(mean).all() and torch.isfinite(step).all() and torch.isfinite(exact).all()):
        raise CacheGenFormatError("non-finite quantisation parameters or exact tokens")
    if not (step > 0).all():
        raise CacheGenFormatError("quantisation steps must be positive")
    if h.tables == "inline":
        row = c.sections["classes"].reshape(-1).astype(np.int32)
        if row.size and int(row.max()) >= n_classes:
            raise CacheGenFormatError(f"table classes must be < {n_classes}")
    else:
        assert profile_row is not None  # check_header refuses a profile blob to a codec without its profile
        row = profile_row
    return SideInfo(mean, step, exact, row)


def valid_shape(shape: Any, max_tokens: int) -> bool:
    """Whether a header's ``shape`` is ``[layers, heads, tokens, head_dim]`` of plain ints in bounds."""
    if not isinstance(shape, list) or len(shape) != 4:
        return False
    if any(not isinstance(d, int) or isinstance(d, bool) for d in shape):
        return False
    return all(1 <= d <= MAX_DIM for d in shape[:2] + shape[3:]) and 1 <= shape[2] <= max_tokens


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bf16_section(x: torch.Tensor) -> np.ndarray:
    """bfloat16-exact float32 -> raw bits as uint16, same shape."""
    return to_bf16_bits(x).numpy().astype(np.uint16)
