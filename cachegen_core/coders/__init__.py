"""Entropy coders behind one interface; blobs record the coder's name so each decodes with its own."""

from __future__ import annotations

from .base import Coder, StreamLayout
from .reference import ReferenceCoder

__all__ = ["Coder", "StreamLayout", "ReferenceCoder", "get_coder", "default_coder", "available_coders"]


def available_coders() -> dict[str, type]:
    """Coder classes that can run in this process, by recorded name."""
    return {ReferenceCoder.name: ReferenceCoder}


def get_coder(name: str) -> Coder:
    """The coder that wrote blobs named ``name``; ``KeyError`` if this build lacks it."""
    return available_coders()[name]()


def default_coder() -> Coder:
    """The fastest coder available here."""
    return ReferenceCoder()
