"""A progress bar for long cold work (encoding many chunks), on stderr, only on a terminal.

``enabled``: ``False`` never shows one; ``True`` or ``None`` show one when stderr is a
terminal (tqdm's ``disable=None``), unless ``CACHEGEN_PROGRESS=0`` and ``enabled`` is None.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def wanted(enabled: bool | None) -> bool:
    """Whether a bar may be shown: ``enabled``, or the ``CACHEGEN_PROGRESS`` setting when None (default yes)."""
    if enabled is None:
        from .settings import load  # noqa: PLC0415

        enabled = load().progress
    return enabled is not False


def progress_bar(items: Iterable[T], enabled: bool | None = None, **tqdm_kwargs: Any) -> Iterator[T]:
    """``items``, with a tqdm bar on stderr when :func:`wanted` and stderr is a terminal."""
    items = list(items)
    if len(items) < 2 or not wanted(enabled):
        yield from items
        return
    from tqdm import tqdm  # noqa: PLC0415

    with tqdm(items, file=sys.stderr, disable=None, leave=False, **tqdm_kwargs) as bar:
        yield from bar
