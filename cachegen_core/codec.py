"""KVCodec: ``encode(KVCache, level) -> bytes`` and ``decode(bytes) -> KVCache``.

A blob holds one chunk of a context's KV at one level: quantised anchors and deltas
(``quantize.py``), range-coded in independent substreams (``coders/``) with the
tables of a ``Profile`` (or, without one, tables measured on the chunk and stored in
the blob), inside the checksummed container of ``format.py``. How symbols are cut
into substreams and which table codes each: ``substreams.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from . import fused
from .bitstats import encode_stats
from .coders import BackendUnavailable, Coder, StreamLayout, SymbolDecoder, default_coder, get_decoder
from .config import CodecConfig
from .errors import CacheGenFormatError, CoderError
from .format import Container, Limits, pack, unpack
from .kv import KVCache, KVShapeError, merge_heads, split_heads
from .profile import Profile, TableLayout
from .quantize import ALPHABET, DELTA_OFFSET, DELTA_RADIUS, Quantized, from_bf16_bits, to_bf16_bits
from .substreams import ChunkGeometry, flatten_symbols, inline_tables, n_inline_tables, stream_layout, unflatten_symbols

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MAX_DIM = 1 << 14
#: A blob may decode to at most this many KV elements per byte (0.004 bits per element).
MAX_ELEMENTS_PER_BYTE = 2048
#: The per-(kind, layer, channel) quantisation parameters, each a section of raw bfloat16 bits.
_PARAMS = ("anchor_min", "anchor_step", "delta_step")


@dataclass(frozen=True)
class Prepared:
    """A chunk quantised and laid out for the entropy coder."""

    level: int
    shape: list[int]
    dtype: str
    geometry: ChunkGeometry
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


class KVCodec:
    """Encode and decode KV chunks; one instance per (model, codec configuration, profile).

    ``fingerprint`` (the model fingerprint) is written into every blob and, when set,
    required of every blob decoded. ``coder`` defaults to the fastest available.
    ``limits`` and ``max_tokens`` bound what a blob may make the decoder allocate.
    ``device`` (default the CPU) is where decoding runs and the decoded KV is returned:
    on ``cuda`` the substreams are decoded by the GPU decoder of the blob's coder and
    dequantised there by torch. A device whose decoder cannot run here raises
    ``BackendUnavailable`` (at construction for ``coder``'s format, at decode for a
    blob's); it is never silently replaced by another.
    """

    def __init__(
        self,
        config: CodecConfig | None = None,
        profile: Profile | None = None,
        *,
        coder: Coder | None = None,
        fingerprint: str = "",
        limits: Limits = Limits(),
        max_tokens: int = 1 << 17,
        device: str | torch.device | None = None,
    ) -> None:
        self.config = config or CodecConfig()
        if profile is not None and profile.codec_id != self.config.codec_id:
            raise ValueError(
                f"profile was fitted for codec {profile.codec_id}, not {self.config.codec_id}; refit it with this config"
            )
        self.profile = profile
        self.coder = coder or default_coder()
        self.fingerprint = fingerprint
        self.limits = limits
        self.max_tokens = max_tokens
        self.device = torch.device("cpu" if device is None else device)
        if self.device.type != "cpu":  # fail now, not at the first blob
            try:
                get_decoder(self.coder.name, self.device)
            except KeyError:
                raise BackendUnavailable(f"coder {self.coder.name!r} is not registered: no {self.device.type} decoder") from None

    @property
    def levels(self) -> list[int]:
        """Level numbers, 0 = finest (near-lossless) .. n-1 = most aggressive."""
        return list(range(self.config.n_levels))

    @property
    def codec_id(self) -> str:
        return self.config.codec_id

    @property
    def profile_id(self) -> str | None:
        return self.profile.id if self.profile is not None else None

    @property
    def _tables(self) -> TableLayout | None:
        return self.profile.layout if self.profile is not None else None

    # ---------------------------------------------------------------- encoding
    def encode(self, kv: KVCache, level: int | None = None) -> bytes:
        """Compress ``kv`` (one chunk, any token count >= 1) at ``level`` into a blob."""
        p = self.prepare(kv, level)
        return self._pack(p, self.coder.encode(p.symbols, p.layout, p.freqs))

    def prepare(self, kv: KVCache, level: int | None = None) -> "Prepared":
        """Quantise ``kv`` and lay out its symbols for the coder (everything ``encode`` does but coding)."""
        level = self.config.default_level if level is None else level
        if level not in self.levels:
            raise ValueError(f"level {level} not in {self.levels}")
        self._check_kv(kv)
        layers, heads, tokens, dim = kv.shape
        qs = [self.config.quantize(merge_heads(x), level, kind) for kind, x in enumerate((kv.keys, kv.values))]
        geo = ChunkGeometry.of(layers, tokens, heads * dim, self.config)
        symbols = flatten_symbols(qs, geo)
        layout = stream_layout(geo, level, self._tables)
        sections = {name: _bits(qs, name) for name in _PARAMS}
        if self.profile is None:
            freqs = inline_tables(symbols, layout, geo)
            sections["tables"] = freqs.astype(np.uint16)
        else:
            freqs = self.profile.freqs
        return Prepared(level, list(kv.shape), _dtype_name(kv.dtype), geo, symbols, layout, freqs, sections)

    def encode_with_stats(self, kv: KVCache, level: int | None = None) -> tuple[bytes, dict[str, Any]]:
        """``encode`` plus where the bits went: coded and ideal bits per stream group."""
        p = self.prepare(kv, level)
        payloads = self.coder.encode(p.symbols, p.layout, p.freqs)
        blob = self._pack(p, payloads)
        return blob, encode_stats(len(blob), payloads, p.symbols, p.layout, p.freqs, p.geometry)

    def _pack(self, p: "Prepared", payloads: list[bytes]) -> bytes:
        header = {
            "codec": "cachegen",
            "codec_id": self.codec_id,
            "codec_config": self.config.to_dict(),
            "profile_id": self.profile_id,
            "model_fingerprint": self.fingerprint,
            "coder": self.coder.name,
            "level": p.level,
            "shape": p.shape,
            "dtype": p.dtype,
            "tables": "inline" if self.profile is None else "profile",
        }
        return pack(header, p.sections, payloads)

    def _check_kv(self, kv: KVCache) -> None:
        if kv.num_tokens < 1:
            raise KVShapeError("cannot encode an empty KV cache (0 tokens)")
        if kv.num_tokens > self.max_tokens:
            raise KVShapeError(f"chunk of {kv.num_tokens} tokens exceeds max_tokens={self.max_tokens}")
        if _dtype_name(kv.dtype) not in DTYPES:
            raise KVShapeError(f"unsupported KV dtype {kv.dtype}")
        if not torch.isfinite(kv.keys).all() or not torch.isfinite(kv.values).all():
            raise KVShapeError("KV cache contains NaN or infinite values")
        if self.profile is not None:
            m = self.profile.meta
            if (kv.num_layers, kv.num_kv_heads * kv.head_dim) != (m["num_layers"], m["channels"]):
                raise KVShapeError(
                    f"KV of shape {kv.shape} does not match the profile's model "
                    f"({m['num_layers']} layers, {m['channels']} channels)"
                )

    # ---------------------------------------------------------------- decoding
    def decode(self, blob: bytes | Checked, level: int | None = None, *, device: str | torch.device | None = None,
               out: KVCache | None = None) -> KVCache:  # fmt: skip
        """Rebuild the KV of a blob; any defect or mismatch raises ``CacheGenFormatError``.

        ``level``: when given, the level the blob must be at (a blob stored under another
        level's key is then a format error). ``device``: where to decode, instead of the
        codec's ``device`` (``BackendUnavailable`` when the blob's coder cannot decode there).
        ``out``: the tensors to write into (of the blob's shape; e.g. a slice of a prompt's
        preallocated KV, in the model's dtype), returned; on the CPU with the native coder
        the substreams are then decoded and dequantised straight into it (``fused.py``).
        """
        checked = blob if isinstance(blob, Checked) else self.check(blob, level)
        if level is not None and checked.header.level != level:
            raise CacheGenFormatError(f"blob is at level {checked.header.level}, expected level {level}")
        blob, h, c = checked.blob, checked.header, checked.container
        if out is not None and out.shape != h.shape:
            raise CacheGenFormatError(f"blob holds KV of shape {list(h.shape)}, the model's chunk is {list(out.shape)}")
        return self._reconstruct(h, c, self.device if device is None else torch.device(device), blob, out)

    def check(self, blob: bytes, level: int | None = None) -> Checked:
        """Verify a blob's container (every checksum) and header without decoding it: the cheap half of
        ``decode``, which a fetch thread can do while the previous chunk decodes."""
        c = unpack(blob, self.limits, views=True)
        return Checked(blob, self.check_header(c.header, len(blob), level), c)

    def check_header(self, header: Mapping[str, Any], blob_bytes: int, level: int | None = None) -> BlobHeader:
        """Check a blob's header (of a blob of ``blob_bytes`` bytes) against this codec.

        Returns what decoding needs from it; ``CacheGenFormatError`` saying what is wrong
        otherwise (including a level other than ``level``, when given).
        """
        h = header
        for key in ("codec", "codec_id", "tables", "dtype", "coder", "model_fingerprint"):
            if not isinstance(h.get(key), str):
                raise CacheGenFormatError(f"header field {key!r} must be a string, got {h.get(key)!r}")
        if h.get("codec") != "cachegen" or h.get("codec_id") != self.codec_id:
            raise CacheGenFormatError(f"blob was written by codec {h.get('codec_id')!r}, this codec is {self.codec_id}")
        if self.fingerprint and h.get("model_fingerprint") != self.fingerprint:
            raise CacheGenFormatError("blob belongs to another model (fingerprint mismatch)")
        tables = h["tables"]
        if tables == "profile":
            if self.profile is None or h.get("profile_id") != self.profile.id:
                raise CacheGenFormatError(f"blob needs profile {h.get('profile_id')!r}, this codec has {self.profile_id!r}")
        elif tables != "inline" or h.get("profile_id") is not None:
            raise CacheGenFormatError(f"bad table source {tables!r}")
        blob_level = h.get("level")
        if blob_level not in self.levels or isinstance(blob_level, bool):
            raise CacheGenFormatError(f"bad level {blob_level!r}")
        if level is not None and blob_level != level:
            raise CacheGenFormatError(f"blob is at level {blob_level}, expected level {level}")
        shape = h.get("shape")
        if (
            not isinstance(shape, list)
            or len(shape) != 4
            or any(not isinstance(d, int) or isinstance(d, bool) or not 1 <= d <= _MAX_DIM for d in shape[:2] + shape[3:])
            or not isinstance(shape[2], int)
            or isinstance(shape[2], bool)
            or not 1 <= shape[2] <= self.max_tokens
        ):
            raise CacheGenFormatError(f"bad shape {shape!r} (tokens limited to max_tokens={self.max_tokens})")
        if h["dtype"] not in DTYPES:
            raise CacheGenFormatError(f"bad dtype {h['dtype']!r}")
        layers, heads, tokens, dim = shape
        elements = 2 * layers * tokens * heads * dim
        # rANS can spend almost no bits on a near-certain symbol: bound what a blob may expand to.
        if elements > self.limits.max_section_elements or elements > MAX_ELEMENTS_PER_BYTE * blob_bytes:
            raise CacheGenFormatError(f"shape {shape} claims {elements} elements, too many for a blob of {blob_bytes} bytes")
        if tables == "profile":
            m = self.profile.meta  # type: ignore[union-attr]
            if (layers, heads * dim) != (m["num_layers"], m["channels"]):
                raise CacheGenFormatError("blob shape does not match the profile's model")
        return BlobHeader(
            level=blob_level,
            shape=(layers, heads, tokens, dim),
            dtype=DTYPES[h["dtype"]],
            tables=tables,
            coder=h["coder"],
            profile_id=h.get("profile_id"),
            model_fingerprint=h["model_fingerprint"],
        )

    def _reconstruct(self, h: BlobHeader, c: Container, device: torch.device, blob: bytes, out: KVCache | None) -> KVCache:
        """The KV of a blob whose header passed ``check_header``: check its sections and substreams,
        decode them on ``device`` and dequantise there (into ``out`` when given)."""
        layers, heads, tokens, dim = h.shape
        geo = ChunkGeometry.of(layers, tokens, h.channels, self.config)
        if len(c.streams) != geo.n_streams:
            raise CacheGenFormatError(f"blob has {len(c.streams)} substreams, shape {list(h.shape)} needs {geo.n_streams}")
        params, freqs = self._side_info(h, c)
        layout = stream_layout(geo, h.level, self._tables)
        target = out if out is not None else None
        if device.type == "cpu" and self.config.delta_scale in ("layer", "channel"):
            target = out if out is not None else KVCache(torch.empty(h.shape, dtype=h.dtype), torch.empty(h.shape, dtype=h.dtype))
            if fused.supports(h.coder, target):
                fused.check_bound(params, 256 if self.config.anchor_offset == 0 else DELTA_RADIUS + 1, target.dtype)
                layout.validate(freqs.shape[0])
                fused.decode_into(blob, [len(p) for p in c.streams], layout.offsets, layout.table_ids, freqs, geo, params,
                                  head_dim=dim, group_size=self.config.group_size, anchor_offset=self.config.anchor_offset,
                                  min_anchor_symbol=0 if self.config.anchor_offset == 0 else DELTA_OFFSET - DELTA_RADIUS,
                                  out=target)  # fmt: skip
                return target
        kv = self._reconstruct_torch(h, geo, params, freqs, layout, c, device)
        if out is None:
            return kv
        out.keys.copy_(kv.keys)
        out.values.copy_(kv.values)
        return out

    def _reconstruct_torch(self, h: BlobHeader, geo: ChunkGeometry, params: dict[str, torch.Tensor], freqs: np.ndarray,
                           layout: StreamLayout, c: Container, device: torch.device) -> KVCache:  # fmt: skip
        """Decode the symbols with the blob's coder on ``device`` and dequantise them with torch there."""
        heads, tokens = h.shape[1], h.shape[2]
        decoder = self._decoder(h.coder, device)
        try:
            symbols = decoder.decode_symbols(c.streams, layout, freqs)
        except CoderError:
            raise
        except Exception as e:  # a coder must never leak another exception type
            raise CoderError(f"coder {decoder.name} failed: {e}") from e
        dev = symbols.device
        out = []
        low_anchor = 0 if self.config.anchor_offset == 0 else DELTA_OFFSET - DELTA_RADIUS
        for kind, (anchors, deltas) in enumerate(unflatten_symbols(symbols, geo)):
            if (deltas.numel() and int(deltas.min()) < DELTA_OFFSET - DELTA_RADIUS) or int(anchors.min()) < low_anchor:
                raise CacheGenFormatError("symbol out of range")
            q = Quantized(anchors, deltas, *(params[name][kind].to(dev) for name in _PARAMS), self.config.anchor_offset)
            x = split_heads(self.config.dequantize(q, tokens), heads).to(h.dtype).contiguous()
            if not torch.isfinite(x).all():  # checked in the blob's dtype: float16 overflows past 65504
                raise CacheGenFormatError("decoded KV is not finite")
            out.append(x)
        return KVCache(out[0], out[1])

    @staticmethod
    def _decoder(coder: str, device: torch.device) -> SymbolDecoder:
        """The decoder of ``coder``'s substreams on ``device``; a coder missing here is a format error."""
        try:
            return get_decoder(coder, device)
        except KeyError:
            raise CacheGenFormatError(f"blob was written by coder {coder!r}, not available here") from None

    def _side_info(self, h: BlobHeader, c: Container) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        """The checked quantisation parameters (float32 ``(2, layers, channels)`` each) and the frequency tables."""
        layers, channels = h.shape[0], h.channels
        expected = {name: (2, layers, channels) for name in _PARAMS}
        if h.tables == "inline":
            expected["tables"] = (n_inline_tables(layers), ALPHABET)
        got = {k: v.shape for k, v in c.sections.items()}
        if got != expected or any(c.sections[k].dtype != np.uint16 for k in expected):
            raise CacheGenFormatError(f"sections {got} do not match the expected {expected}")
        params = {k: from_bf16_bits(torch.from_numpy(c.sections[k].astype(np.int32))) for k in _PARAMS}
        if not all(torch.isfinite(v).all() for v in params.values()):
            raise CacheGenFormatError("non-finite quantisation parameters")
        if not ((params["anchor_step"] > 0).all() and (params["delta_step"] > 0).all()):
            raise CacheGenFormatError("quantisation steps must be positive")
        freqs = c.sections["tables"].astype(np.uint32) if h.tables == "inline" else self.profile.freqs  # type: ignore[union-attr]
        return params, freqs


# -------------------------------------------------------------------- helpers
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bits(qs: list[Quantized], name: str) -> np.ndarray:
    return torch.stack([to_bf16_bits(getattr(q, name)) for q in qs]).numpy().astype(np.uint16)
