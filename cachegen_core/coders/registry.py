"""Which coders and decoders this process can run, by the coder name that blobs record.

A *coder* is a byte format with its CPU encoder and decoder (``Coder``):
``native-rans16-v1`` (``native.py``), the default wherever its library loads, and
``torchac`` (``reference.py``), the slow oracle, listed only when the optional torchac
package is installed. A coder may also have *decoders* for other kinds of device
(``SymbolDecoder``, table ``DEVICE_DECODERS``): the native format decodes on CUDA with
Triton kernels (``triton_decoder.py``; compiled at first use, nothing built at install).
``get_decoder(name, device)`` picks the decoder a blob needs, or says why none can run there.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import torch

from . import native_lib, reference
from .base import BackendUnavailable, Coder, StreamLayout, SymbolDecoder
from .native import NativeCoder
from .reference import ReferenceCoder
from .triton_decoder import triton_decoder

#: Every coder this build knows, fastest first (whether or not it can run here).
KNOWN_CODERS: tuple[type, ...] = (NativeCoder, ReferenceCoder)
#: Decoders besides each coder's CPU one, by (coder name, device type): a factory taking the
#: ``torch.device`` that raises ``BackendUnavailable`` when it cannot run here.
DEVICE_DECODERS: dict[tuple[str, str], Callable[[torch.device], SymbolDecoder]] = {
    (NativeCoder.name, "cuda"): triton_decoder,
}


@lru_cache(maxsize=1)
def available_coders() -> dict[str, type]:
    """Coder classes that can run in this process, by recorded name (fastest first)."""
    ready = {NativeCoder: native_lib.available, ReferenceCoder: reference.available}
    return {cls.name: cls for cls in KNOWN_CODERS if ready[cls]()}


@lru_cache(maxsize=None)
def get_coder(name: str) -> Coder:
    """The coder that wrote blobs named ``name`` (one shared instance); ``KeyError`` if it cannot run here."""
    return available_coders()[name]()


def no_coder_reason() -> str:
    """Why no entropy coder can run here: the native library's load error, and torchac missing."""
    return f"{native_lib.load_error() or 'the native coder is unavailable'}; and torchac is not installed"


def fastest_coder() -> Coder | None:
    """The fastest coder available here, or None where none can run (a build without the native library and
    no torchac: levels cannot be coded there, raw forms still can)."""
    coders = available_coders()
    return get_coder(next(iter(coders))) if coders else None


def default_coder() -> Coder:
    """The fastest coder available here: native when its library loads, else torchac when installed."""
    coder = fastest_coder()
    if coder is None:
        raise BackendUnavailable(f"no entropy coder can run here: {no_coder_reason()} (pip install langchain-cachegen[torchac])")
    return coder


def decoder_devices(name: str) -> tuple[str, ...]:
    """Kinds of device that coder ``name`` has a decoder for in this build (``KeyError`` if unknown)."""
    if name not in {cls.name for cls in KNOWN_CODERS}:
        raise KeyError(name)
    return ("cpu", *sorted(kind for coder, kind in DEVICE_DECODERS if coder == name))


class _HostDecoder:
    """The CPU ``SymbolDecoder`` of any coder: its ``decode``, as a tensor."""

    device = torch.device("cpu")

    def __init__(self, coder: Coder) -> None:
        self.coder = coder
        self.name = coder.name

    def decode_symbols(self, payloads: Sequence[bytes], layout: StreamLayout, freqs: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.coder.decode(payloads, layout, freqs))


def get_decoder(name: str, device: str | torch.device | None = None) -> SymbolDecoder:
    """A decoder of coder ``name``'s payloads onto ``device`` (default: the CPU).

    ``KeyError`` when the coder itself cannot run here (like ``get_coder``);
    ``BackendUnavailable`` when it can but has no decoder for that kind of device, or
    that decoder cannot run here (no GPU, no Triton...), saying why.
    """
    coder = get_coder(name)
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cpu":
        return _HostDecoder(coder)
    make = DEVICE_DECODERS.get((name, dev.type))
    if make is None:
        raise BackendUnavailable(f"coder {name!r} has no {dev.type} decoder (it decodes on: {', '.join(decoder_devices(name))})")
    return make(dev)
