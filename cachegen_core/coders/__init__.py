"""Entropy coders behind one interface; blobs record the coder's name so each decodes with its own.

``native-rans16-v1`` (``native.py``, C++/CUDA in ``csrc/``) is the default wherever its
library loads; ``torchac`` (``reference.py``) is the slow oracle and the fallback.
"""

from __future__ import annotations

from functools import lru_cache

from .base import Coder, StreamLayout
from .reference import ReferenceCoder

__all__ = ["Coder", "StreamLayout", "ReferenceCoder", "get_coder", "default_coder", "available_coders"]


@lru_cache(maxsize=1)
def available_coders() -> dict[str, type]:
    """Coder classes that can run in this process, by recorded name (native first when it loads)."""
    from . import native  # noqa: PLC0415

    coders: dict[str, type] = {}
    if native.available():
        coders[native.NativeCoder.name] = native.NativeCoder
    coders[ReferenceCoder.name] = ReferenceCoder
    return coders


@lru_cache(maxsize=None)
def get_coder(name: str) -> Coder:
    """The coder that wrote blobs named ``name`` (one shared instance); ``KeyError`` if this build lacks it."""
    return available_coders()[name]()


def default_coder() -> Coder:
    """The fastest coder available here: native when its library loads, else torchac."""
    return get_coder(next(iter(available_coders())))
