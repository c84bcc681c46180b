"""Entropy coders behind one interface; blobs record the coder's name so each decodes with its own.

``native-rans16-v1`` (``native.py``, C++ in ``csrc/``; on GPUs Triton kernels,
``triton_decoder.py``) is the default wherever its library loads; ``torchac`` (``reference.py``, an optional extra) is the slow oracle and
the fallback. ``registry.py`` knows which coders, and which decoders per kind of device
(CPU, CUDA), can run here.

May import: ``errors`` and ``paths`` only (numpy, ctypes; torch where a decoder needs it).
"""

from __future__ import annotations

from .base import BackendUnavailable, Coder, StreamLayout, SymbolDecoder, ideal_bits_per_stream
from .reference import ReferenceCoder
from .registry import available_coders, decoder_devices, default_coder, fastest_coder, get_coder, get_decoder, no_coder_reason

__all__ = [
    "BackendUnavailable",
    "Coder",
    "StreamLayout",
    "SymbolDecoder",
    "ReferenceCoder",
    "available_coders",
    "decoder_devices",
    "default_coder",
    "fastest_coder",
    "get_coder",
    "get_decoder",
    "ideal_bits_per_stream",
    "no_coder_reason",
]
