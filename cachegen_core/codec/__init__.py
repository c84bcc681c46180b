"""The codec: everything a blob is made of and decoded from.

A chunk's KV goes through the codec v3 pipeline (``pipeline``: exact sink tokens, the chunk
mean, keys before the rotary embedding (``rotary``), the transform across each group of a
layer's heads (``transform``), uniform steps (``quantize``)), its symbols are laid out in substreams (``substreams``) and
entropy-coded with the model's profiled tables (``profile``, fitted from ``kvstats``; without a
profile, steps weighted by the model's measured sensitivity, ``weights``; ``bitstats`` says where the
bits go) into the versioned container (``format``) as a checked blob (``blob``).
``kvcodec.KVCodec`` ties it together (``encode``/``decode``); ``fused`` and ``fused_encode`` are the
native one-pass decoder and encoder; ``raw`` the exact 16-bit forms in the same container;
``limits`` bounds what a stored blob may make the decoder allocate; ``config`` the frozen
``CodecConfig``.

May import: ``errors``, ``paths``, ``hfcompat``, ``kv`` and ``coders``; nothing above them
(keys, stores, operations, streaming, engine).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {"KVCodec": "kvcodec", "CodecConfig": "config", "Profile": "profile", "RawCodec": "raw", "DecodeLimits": "limits"}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .config import CodecConfig
    from .kvcodec import KVCodec
    from .limits import DecodeLimits
    from .profile import Profile
    from .raw import RawCodec


def __getattr__(name: str) -> Any:  # loaded on first use: ``codec.format`` alone needs no torch
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
