"""KVCodec: ``encode(KVCache, level, start=) -> bytes`` and ``decode(bytes) -> KVCache``.

A blob holds one chunk of a context's KV at one level: exact sink tokens and quantised transform components
(``pipeline.py``), range-coded in independent substreams (``coders/``) with the codec's fixed tables (``classes.py``),
each component's class taken from a ``Profile`` (or, without one, picked on the chunk and stored in the blob), inside
the checksummed container of ``format.py``. How symbols are cut into substreams and which table codes each:
``substreams.py``. Keys are coded before the rotary embedding when the codec knows it (``rotary.py``), so a blob
decodes at its own positions or, on request, at any others.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from . import fused
from .bitstats import encode_stats
from ..coders import BackendUnavailable, Coder, StreamLayout, SymbolDecoder, fastest_coder, get_decoder, no_coder_reason
from .config import CodecConfig
from ..errors import CacheGenFormatError, CoderError
from .format import Container, Limits, pack, unpack
from ..kv import KVCache, KVShapeError, SpareBuffer, all_finite
from .blob import DTYPES, MAX_ELEMENTS_PER_BYTE, MAX_START, BlobHeader, Checked, Prepared, bf16_section, dtype_name, side_info, valid_shape
from .fused_encode import quantise_chunk
from .pipeline import exact_part, exact_tokens, magnitude_bound, synthesise_parts
from .classes import bank
from .profile import Profile
from .quantize import OFFSET, RADIUS, dequantize
from .rotary import RotarySpec
from .substreams import ChunkGeometry, chunk_classes, stream_layout, unflatten_symbols
from .transform import Transform, identity_transform
from .weights import check_weights


class KVCodec:
    """Encode and decode KV chunks; one instance per (model, codec configuration, profile).

    ``fingerprint`` (the model fingerprint) is written into every blob and, when set,
    required of every blob decoded. ``coder`` defaults to the fastest available; where none can
    run (no native library, no torchac) it is None and coding a level raises ``BackendUnavailable``.
    ``limits`` and ``max_tokens`` bound what a blob may make the decoder allocate.
    ``device`` (default the CPU) is where decoding runs and the decoded KV is returned:
    on ``cuda`` by the GPU decoder of the blob's coder (``coders.get_decoder``: the native
    format's Triton kernels write the KV itself, or with a profile the components that
    torch turns into KV there). A device whose decoder cannot run here raises
    ``BackendUnavailable`` (at construction for ``coder``'s format, at decode for a
    blob's); it is never silently replaced by another.
    ``rotary``: the model's rotary embedding (``RotarySpec.from_model(model)``); keys are
    then coded before it. Defaults to the profile's; a profile fitted with another one
    (or without) is refused. Without either, keys are coded as they are.
    ``weights`` (assignable as ``step_weights``): with no profile, each component's step multiplier
    (``weights.py``, measured by ``fitting.fit_weights``); they change what is encoded, never what decodes.
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
        rotary: RotarySpec | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        self.config = config or CodecConfig()
        self.step_weights = None if weights is None else check_weights(weights)
        if profile is not None and profile.codec_id != self.config.codec_id:
            raise ValueError(
                f"profile was fitted for codec {profile.codec_id}, not {self.config.codec_id}: refit it with this configuration "
                "(`cachegen profile --model MODEL`)"
            )
        if profile is not None:
            if rotary is not None and (profile.rotary is None or profile.rotary.id != rotary.id):
                raise ValueError("profile was fitted with another rotary embedding (or keys as they are); refit it for this model")
            rotary = profile.rotary
        self.profile = profile
        self.rotary = rotary
        self.coder: Coder | None = coder or fastest_coder()
        self.fingerprint = fingerprint
        self.limits = limits
        self.max_tokens = max_tokens
        self.device = torch.device("cpu" if device is None else device)
        self._spare = SpareBuffer()
        if self.device.type != "cpu":  # fail now, not at the first blob
            try:
                get_decoder(self._coder().name, self.device)
            except KeyError:
                raise BackendUnavailable(f"coder {self._coder().name!r} is not registered: no {self.device.type} decoder") from None

    @property
    def levels(self) -> list[int]:
        return list(range(self.config.n_levels))  # 0 = finest (near-lossless) .. n-1 = most aggressive

    @property
    def codec_id(self) -> str:
        return self.config.codec_id

    @property
    def profile_id(self) -> str | None:
        return self.profile.id if self.profile is not None else None

    @property
    def _fitted(self) -> bool:
        return self.profile is not None and self.profile.transform is not None

    def _transform(self, layers: int, heads: int, dim: int) -> Transform:
        return self.profile.transform if self._fitted else identity_transform(layers, heads, dim)  # type: ignore[union-attr,return-value]

    def _geometry(self, layers: int, heads: int, tokens: int, dim: int, start: int) -> ChunkGeometry:
        coded = tokens - exact_tokens(start, tokens, self.config.sink_tokens)
        return ChunkGeometry.of(layers, heads, dim, coded, self.config.tokens_per_stream(2 * layers * heads * dim))

    # ---------------------------------------------------------------- encoding
    def encode(self, kv: KVCache, level: int | None = None, *, start: int) -> bytes:
        """Compress ``kv`` (one chunk, any token count >= 1) at ``level`` into a blob.

        ``start`` (required): context position of the chunk's first token (its keys were rotated for positions
        ``start ..``; coded as if at 0, a later chunk takes about half as many bytes again); tokens below
        ``config.sink_tokens`` are kept exactly.
        """
        p = self.prepare(kv, level, start=start)
        return self._pack(p, self._coder().encode(p.symbols, p.layout, p.freqs))

    def prepare(self, kv: KVCache, level: int | None = None, *, start: int) -> Prepared:
        """Quantise ``kv`` and lay out its symbols for the coder (``encode`` but the coding; on the CPU, a GPU's KV copied)."""
        level = self.config.default_level if level is None else level
        kv = kv if kv.keys.device.type == "cpu" else KVCache(kv.keys.cpu(), kv.values.cpu())
        if level not in self.levels:
            raise ValueError(f"level {level} not in {self.levels}")
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= MAX_START:
            raise ValueError(f"start must be an integer in [0, {MAX_START}]")
        self._check_kv(kv)
        layers, heads, tokens, dim = kv.shape
        w = None if self.profile is not None else self.step_weights  # its shape checked by _check_kv
        coded, symbols, _ = quantise_chunk(
            kv, self._transform(layers, heads, dim), self.config.level_step(level, fitted=self._fitted, weighted=w is not None),
            fitted=self._fitted, step_cap=self.config.step_cap, start=start, sink_tokens=self.config.sink_tokens, rotary=self.rotary,
            weights=w)  # fmt: skip
        geo = self._geometry(layers, heads, tokens, dim, start)
        sections = {"mean": bf16_section(coded.mean), "step": bf16_section(coded.step)}
        if coded.exact.shape[3]:
            sections["exact"] = coded.exact.contiguous().numpy().astype(np.float32)
        if self.profile is None:
            sections["classes"] = chunk_classes(symbols, geo, self.config.table_classes)
            row = sections["classes"].reshape(-1)
        else:
            row = self.profile.row(level)
        layout = stream_layout(geo, row)
        freqs = bank(self.config.table_classes)
        return Prepared(level, start, list(kv.shape), dtype_name(kv.dtype), geo, coded, symbols, layout, freqs, sections)

    def encode_with_stats(self, kv: KVCache, level: int | None = None, *, start: int) -> tuple[bytes, dict[str, Any]]:
        """``encode`` plus where the bits went: coded and ideal bits, by kind and layer third."""
        p = self.prepare(kv, level, start=start)
        blob = self._pack(p, payloads := self._coder().encode(p.symbols, p.layout, p.freqs))
        return blob, encode_stats(len(blob), payloads, p.symbols, p.layout, p.freqs, p.geometry, p.sections)

    def _pack(self, p: Prepared, payloads: list[bytes]) -> bytes:
        header = {
            "codec": "cachegen",
            "codec_id": self.codec_id,
            "codec_config": self.config.to_dict(),
            "profile_id": self.profile_id,
            "model_fingerprint": self.fingerprint,
            "coder": self._coder().name,
            "level": p.level,
            "shape": p.shape,
            "dtype": p.dtype,
            "tables": "inline" if self.profile is None else "profile",
            "start": p.start,
            "rotary": self.rotary.id if self.rotary is not None else None,
        }
        return pack(header, p.sections, payloads)

    def _coder(self) -> Coder:
        """The entropy coder levels need; ``BackendUnavailable`` where none runs (raw forms need none)."""
        if self.coder is None:
            raise BackendUnavailable(f"no entropy coder can run here to code a level: {no_coder_reason()}")
        return self.coder

    def _check_kv(self, kv: KVCache) -> None:
        if kv.num_tokens < 1:
            raise KVShapeError("cannot encode an empty KV cache (0 tokens)")
        if kv.num_tokens > self.max_tokens:
            raise KVShapeError(f"chunk of {kv.num_tokens} tokens exceeds max_tokens={self.max_tokens}")
        if dtype_name(kv.dtype) not in DTYPES:
            raise KVShapeError(f"unsupported KV dtype {kv.dtype}")
        if self.rotary is not None and kv.head_dim != self.rotary.head_dim:
            raise KVShapeError(f"KV head_dim {kv.head_dim} does not match the rotary embedding's {self.rotary.head_dim}")
        if self.profile is not None:
            m = self.profile.meta
            if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (m["num_layers"], m["kv_heads"], m["head_dim"]):
                raise KVShapeError(f"KV of shape {kv.shape} does not match the profile's model "
                                   f"({m['num_layers']} layers, {m['kv_heads']} KV heads of {m['head_dim']})")  # fmt: skip
        elif self.step_weights is not None and self.step_weights.shape[1:] != (kv.num_layers, kv.num_kv_heads, kv.head_dim):
            raise KVShapeError(f"KV of shape {kv.shape} does not match the step weights {tuple(self.step_weights.shape)}")

    # ---------------------------------------------------------------- decoding
    def decode(self, blob: bytes | Checked, level: int | None = None, *, device: str | torch.device | None = None,
               out: KVCache | None = None, start: int | None = None) -> KVCache:  # fmt: skip
        """Rebuild the KV of a blob; any defect or mismatch raises ``CacheGenFormatError``.

        ``level``: when given, the level the blob must be at (a blob stored under another
        level's key is then a format error). ``device``: where to decode, instead of the
        codec's ``device`` (``BackendUnavailable`` when the blob's coder cannot decode there).
        ``out``: the tensors to write into (of the blob's shape; e.g. a slice of a prompt's
        preallocated KV, in the model's dtype), returned; on the CPU with the native coder
        the substreams are then decoded and dequantised by native threads (``fused.py``).
        ``start``: context position to give the first token, default the one it was encoded
        at; another one re-rotates the keys (only with a rotary embedding).
        """
        checked = blob if isinstance(blob, Checked) else self.check(blob, level)
        if level is not None and checked.header.level != level:
            raise CacheGenFormatError(f"blob is at level {checked.header.level}, expected level {level}")
        blob, h, c = checked.blob, checked.header, checked.container
        if out is not None and out.shape != h.shape:
            raise CacheGenFormatError(f"blob holds KV of shape {list(h.shape)}, the model's chunk is {list(out.shape)}")
        if start is not None and start != h.start:
            if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= MAX_START:
                raise ValueError(f"start must be an integer in [0, {MAX_START}]")
            if self.rotary is None:
                raise ValueError("decoding at another position needs the model's rotary embedding (KVCodec(rotary=...))")
        dev = self.device if device is None else torch.device(device)
        return self._reconstruct(h, c, dev, blob, out, h.start if start is None else start)

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
        elif self.profile is not None:  # its components are channels: this codec's transform would misread them
            raise CacheGenFormatError(f"blob was coded without a profile, this codec has {self.profile_id!r}")
        rotary = self.rotary.id if self.rotary is not None else None
        if h.get("rotary") != rotary:
            raise CacheGenFormatError(f"blob's keys were coded with rotary embedding {h.get('rotary')!r}, this codec has {rotary!r}")
        start = h.get("start")
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= MAX_START:
            raise CacheGenFormatError(f"bad start position {start!r}")
        blob_level = h.get("level")
        if blob_level not in self.levels or isinstance(blob_level, bool):
            raise CacheGenFormatError(f"bad level {blob_level!r}")
        if level is not None and blob_level != level:
            raise CacheGenFormatError(f"blob is at level {blob_level}, expected level {level}")
        shape = h.get("shape")
        if not valid_shape(shape, self.max_tokens):
            raise CacheGenFormatError(f"bad shape {shape!r} (tokens limited to max_tokens={self.max_tokens})")
        if h["dtype"] not in DTYPES:
            raise CacheGenFormatError(f"bad dtype {h['dtype']!r}")
        layers, heads, tokens, dim = shape
        elements = 2 * layers * tokens * heads * dim
        # rANS can spend almost no bits on a near-certain symbol: bound what a blob may expand to.
        if elements > self.limits.max_section_elements or elements > MAX_ELEMENTS_PER_BYTE * blob_bytes:
            raise CacheGenFormatError(f"shape {shape} claims {elements} elements, too many for a blob of {blob_bytes} bytes")
        if self.rotary is not None and dim != self.rotary.head_dim:
            raise CacheGenFormatError("blob head_dim does not match the rotary embedding")
        if tables == "profile":
            m = self.profile.meta  # type: ignore[union-attr]
            if (layers, heads, dim) != (m["num_layers"], m["kv_heads"], m["head_dim"]):
                raise CacheGenFormatError("blob shape does not match the profile's model")
        return BlobHeader(
            level=blob_level,
            shape=(layers, heads, tokens, dim),
            dtype=DTYPES[h["dtype"]],
            tables=tables,
            coder=h["coder"],
            profile_id=h.get("profile_id"),
            model_fingerprint=h["model_fingerprint"],
            start=start,
        )

    def _reconstruct(self, h: BlobHeader, c: Container, device: torch.device, blob: bytes | memoryview,
                     out: KVCache | None, start: int) -> KVCache:  # fmt: skip
        """The KV of a blob whose header passed ``check_header``: check its sections and substreams,
        decode them on ``device`` and rebuild the KV there (into ``out`` when given), keys at
        positions from ``start``."""
        layers, heads, tokens, dim = h.shape
        geo = self._geometry(layers, heads, tokens, dim, h.start)
        if len(c.streams) != geo.n_streams:
            raise CacheGenFormatError(f"blob has {len(c.streams)} substreams, shape {list(h.shape)} needs {geo.n_streams}")
        mean, step, exact, row = self._side_info(h, c, geo)
        layout = stream_layout(geo, row)
        freqs = bank(self.config.table_classes)
        gpu = self._decoder(h.coder, device) if device.type != "cpu" else None  # its device holds the output
        where = gpu.device if gpu is not None else device
        native = gpu is None and fused.supports(h.coder)
        if native:
            layout.validate(freqs.shape[0])
        lengths = [len(p) for p in c.streams]
        fusable = not self._fitted and (native or fused.fuses_on(gpu, dim, self.rotary is not None))
        if fusable and out is None:
            out = KVCache(*(torch.empty(h.shape, dtype=h.dtype, device=where) for _ in range(2)))
        if fusable and fused.writes_kv(out, h.dtype, where) and not self._may_overflow(h, mean, step, exact, out):  # type: ignore[arg-type]
            cs = self.rotary.cos_sin(start + tokens - geo.coded_tokens, geo.coded_tokens, where) if self.rotary else None
            if native:
                fused.decode_kv(blob, lengths, layout, freqs, geo, step, mean, cs, out)
            else:
                fused.decode_kv_on(gpu, blob, lengths, layout, freqs, geo, step, mean, cs, out)
            for kind, dst in enumerate((out.keys, out.values)):  # the exact sink tokens
                dst[:, :, : tokens - geo.coded_tokens].copy_(exact_part(exact, kind, start=start, encoded_start=h.start, rotary=self.rotary))
            if gpu is not None:  # the fused kernel checked against the torch path once per device
                fused.verify_once(where, out, lambda: self._synthesise(h, self._components_torch(h, geo, step, freqs, layout, c, device),
                                                                        mean.to(where), step.to(where), exact.to(where), start, None))  # fmt: skip
            return out
        if native:  # into the codec's spare buffer: its pages are faulted in once, not per chunk
            with self._spare.take((2, layers, heads, geo.coded_tokens, dim), torch.float32) as scratch:
                comps = fused.decode_components(blob, lengths, layout.offsets, layout.table_ids, freqs, geo, step, out=scratch)
                return self._synthesise(h, comps, mean, step, exact, start, out)
        if hasattr(gpu, "decode_components"):  # dequantised by the kernel, the transform's matmul left to torch
            comps = fused.decode_components_on(gpu, blob, lengths, layout, freqs, geo, step)
        else:
            comps = self._components_torch(h, geo, step, freqs, layout, c, device)
        return self._synthesise(h, comps, mean.to(comps.device), step.to(comps.device), exact.to(comps.device), start, out)

    def _may_overflow(self, h: BlobHeader, mean: torch.Tensor, step: torch.Tensor, exact: torch.Tensor, out: KVCache) -> bool:
        """Whether decoded values may reach the blob's or ``out``'s dtype range (``pipeline.magnitude_bound``): then scanned."""
        limit = min(torch.finfo(h.dtype).max, torch.finfo(out.dtype).max)
        transform = self._transform(h.shape[0], h.shape[1], h.shape[3])
        return magnitude_bound(transform, mean, step, exact, self.rotary) * 1.001 >= limit

    def _components_torch(self, h: BlobHeader, geo: ChunkGeometry, step: torch.Tensor, freqs: np.ndarray,
                          layout: StreamLayout, c: Container, device: torch.device) -> torch.Tensor:  # fmt: skip
        """Decode the symbols with the blob's coder on ``device`` and dequantise them with torch there:
        float32 components ``(2, layers, heads, coded_tokens, dim)``."""
        decoder = self._decoder(h.coder, device)
        try:
            flat = decoder.decode_symbols(c.streams, layout, freqs)
        except CoderError:
            raise
        except Exception as e:  # a coder must never leak another exception type
            raise CoderError(f"coder {decoder.name} failed: {e}") from e
        if flat.numel() and int(flat.min()) < OFFSET - RADIUS:
            raise CacheGenFormatError("symbol out of range")
        symbols = unflatten_symbols(flat, geo)
        return torch.stack([dequantize(symbols[kind], step[kind].to(flat.device)) for kind in range(2)])

    def _synthesise(self, h: BlobHeader, comps: torch.Tensor, mean: torch.Tensor, step: torch.Tensor,
                    exact: torch.Tensor, start: int, out: KVCache | None) -> KVCache:  # fmt: skip
        """Components to KV in the blob's dtype (``pipeline.synthesise_parts``), written into ``out`` when given (else
        into a new cache); scanned for overflow only when the parameters' bound does not exclude it (``_may_overflow``)."""
        layers, heads, tokens, dim = h.shape
        transform = self._transform(layers, heads, dim)
        if out is None:
            out = KVCache(*(torch.empty(h.shape, dtype=h.dtype, device=comps.device) for _ in range(2)))
        checked = self._may_overflow(h, mean, step, exact, out)
        n = tokens - comps.shape[3]
        direct = not checked and h.dtype == out.dtype == torch.float32 and out.keys.device == comps.device  # computed in ``out``
        parts = synthesise_parts(comps, mean, exact, transform, start=start, encoded_start=h.start, rotary=self.rotary,
                                 bodies=(out.keys[:, :, n:], out.values[:, :, n:]) if direct else None)  # fmt: skip
        for (ex, body), dst in zip(parts, (out.keys, out.values)):
            for part, where in ((ex, dst[:, :, :n]), (body, dst[:, :, n:])):
                if not part.numel() or part.data_ptr() == where.data_ptr():  # a body computed in place
                    continue
                if h.dtype != dst.dtype or checked:
                    part = part.to(h.dtype)  # the blob's dtype first: what decoding without ``out`` returns
                if checked and not all_finite(part):  # float16 overflows past 65504
                    raise CacheGenFormatError("decoded KV is not finite")
                if checked and h.dtype != dst.dtype and not all_finite(part.to(dst.dtype)):
                    raise CacheGenFormatError(f"decoded KV is beyond {dst.dtype}'s range")
                where.copy_(part)
        return out

    @staticmethod
    def _decoder(coder: str, device: torch.device) -> SymbolDecoder:
        """The decoder of ``coder``'s substreams on ``device``; a coder missing here is a format error."""
        try:
            return get_decoder(coder, device)
        except KeyError:
            raise CacheGenFormatError(f"blob was written by coder {coder!r}, not available here") from None

    def _side_info(self, h: BlobHeader, c: Container, geo: ChunkGeometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
        """The checked mean, step, exact tokens and the class of every position of the period (``blob.side_info``)."""
        row = self.profile.row(h.level) if self.profile is not None else None
        info = side_info(h, c, geo, row, self.config.table_classes)
        return info.mean, info.step, info.exact, info.row
