"""What a miss stores: the engine's default options, and the 16-bit forms alone where no entropy coder runs.

A build without the native library (an sdist installed where no C++ compiler was, so ``setup.py`` skipped
its optional extension) and without torchac cannot code a compression level. The engine still reuses
contexts there: it stores and streams the raw forms (``raw.py``: the KV in 16 bits, a conversion and a
checksum), which need no coder, and says once per process how to bring compression back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from ...codec.kvcodec import KVCodec
from ...coders import no_coder_reason
from ...streaming import LOSSLESS, RAW, RAW_OPTIONS, Option

log = logging.getLogger("cachegen_core.engine")

#: What brings compression back: the binary wheel carries the native coder (``make wheel`` builds it).
INSTALL_WHEEL = "pip install --force-reinstall --no-deps langchain_cachegen-*manylinux*.whl"
_warned = threading.Event()


def exact16(dtype: torch.dtype) -> Option:
    """The 16-bit raw form of a model of ``dtype``: its KV bit for bit (``lossless``) when the model is 16-bit,
    else rounded to 16 bits (``raw``)."""
    return LOSSLESS if dtype in (torch.float16, torch.bfloat16) else RAW


def default_options(level: Option, codec: KVCodec, dtype: torch.dtype, slo_s: float | None) -> list[Option]:
    """The 16-bit form and ``level``; with a deadline also the coarsest level, the one the controller falls
    back to on a slow link (without one, nothing coarser than ``level`` is used)."""
    if level in RAW_OPTIONS:
        return [level]
    return list(dict.fromkeys([exact16(dtype), level, *([codec.levels[-1]] if slo_s else [])]))


def storable(options: Sequence[Option], codec: KVCodec, dtype: torch.dtype) -> list[Option]:
    """``options`` when ``codec`` has an entropy coder; else their raw forms (the 16-bit form when they name
    none), with one warning per process, when levels were dropped, saying why and how to get compression back."""
    if codec.coder is not None or all(o in RAW_OPTIONS for o in options):
        return list(options)
    kept = [o for o in options if o in RAW_OPTIONS] or [exact16(dtype)]
    if not _warned.is_set():
        _warned.set()
        log.warning(
            "no entropy coder can run here (%s): KV chunks are stored and reused as raw KV %s only, not "
            "compressed. The binary wheel, which carries the native coder, brings compression back: %s (`make wheel` "
            "builds it)", no_coder_reason(), kept, INSTALL_WHEEL,
        )  # fmt: skip
    return kept
