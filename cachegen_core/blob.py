"""What a blob is once its header is read: the dataclasses ``KVCodec`` passes around, the header's
bounds, and the conversions of its sections (split from ``codec.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .coders import StreamLayout
from .format import Container
from .pipeline import Coded
from .quantize import to_bf16_bits
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



def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bf16_section(x: torch.Tensor) -> np.ndarray:
    """bfloat16-exact float32 -> raw bits as uint16, same shape."""
    return to_bf16_bits(x).numpy().astype(np.uint16)
