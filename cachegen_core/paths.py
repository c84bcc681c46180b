"""Where the package keeps its files: one user cache directory for everything.

``$CACHEGEN_CACHE_DIR`` when set, else ``<user cache dir>/langchain-cachegen``
(platformdirs). Converted models, codec profiles, native builds and the default disk
store all live below it, so one variable moves (or isolates) all of them.
"""

from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "langchain-cachegen"


def cache_dir(*parts: str) -> Path:
    """The package's cache directory (or a path below it); not created here."""
    root = os.environ.get("CACHEGEN_CACHE_DIR")
    if not root:
        from platformdirs import user_cache_dir  # noqa: PLC0415

        root = user_cache_dir(APP_NAME)
    return Path(root).joinpath(*parts)
