"""Opening a disk store whose database is damaged: move it aside and start afresh (``DiskCacheStore``).

A cache is worth less than the application that uses it: a ``cache.db`` overwritten, truncated,
replaced by a directory or unreadable must not stop a process from starting, any more than a dead
Redis does. :func:`open_cache` opens the diskcache ``Cache``; when SQLite says the database is
damaged (:func:`damage`), it moves what diskcache owns in the directory (the database with its
journal files and the value folders, never another file) into a new ``damaged-<time>-*/`` inside it,
logs once where it went, and opens a new, empty store there. Every process opening the directory
recovers under one file lock, and tries again first: a process that finds the store recreated
by another opens that one (as does one whose first try met an I/O error: the files moved under it).

What is not damage is raised as before: a locked database (another writer), a full or read-only
disk, a directory the process may not write in. Damage found later, by a read or a write of a store
already open, is a ``StoreError`` like any other: the engine recomputes.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

log = logging.getLogger("cachegen_core.stores.disk")

#: The database file diskcache keeps in its directory, and the SQLite files beside it.
DB_NAME = "cache.db"
_DB_FILES = (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", f"{DB_NAME}-journal")
#: diskcache's value folders: two hex digits (``ab/cd/<name>.val``).
_VALUE_DIR = re.compile(r"^[0-9a-f]{2}$")
LOCK_NAME = ".recovery.lock"
#: How long a process waits for another one's recovery (moving files within one directory: instant).
LOCK_TIMEOUT_S = 60.0
# SQLite's primary result codes: an I/O error, a damaged file, one it cannot open, one that is not a database.
_IOERR, _CORRUPT, _CANTOPEN, _NOTADB = 10, 11, 14, 26

T = TypeVar("T")


def damage(exc: BaseException, directory: Path) -> str | None:
    """Why ``exc`` (raised opening the store in ``directory``) says its database is damaged, or None when it does
    not: a file that is not a database or is malformed, or one SQLite cannot open though the directory is writable
    (a directory or a dangling link in its place, an unreadable file)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return None
    code = _primary_code(exc)
    if code in (_CORRUPT, _NOTADB):
        return str(exc)
    db = directory / DB_NAME
    if code == _CANTOPEN and os.path.lexists(db) and os.access(directory, os.W_OK):
        if not db.is_file():
            return f"{exc}: {db} is not a file"
        if not os.access(db, os.R_OK | os.W_OK):
            return f"{exc}: {db} cannot be read and written"
    return None


def _primary_code(exc: sqlite3.DatabaseError) -> int | None:
    """SQLite's primary result code of ``exc`` (extended codes carry it in their low byte); None when it has none."""
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def _io_error(exc: sqlite3.DatabaseError) -> bool:
    """SQLite's I/O error: what an opener meets when another process moves the damaged files aside under it (tried
    again under the recovery lock, once the move is done; raised if it comes again)."""
    return _primary_code(exc) == _IOERR


def move_aside(directory: Path) -> Path:
    """Move the database files and value folders of the store in ``directory`` into a new ``damaged-*`` folder there."""
    aside = Path(tempfile.mkdtemp(prefix=f"damaged-{time.strftime('%Y%m%d-%H%M%S')}-", dir=directory))
    for entry in directory.iterdir():
        if entry.name in _DB_FILES or (_VALUE_DIR.match(entry.name) and entry.is_dir() and not entry.is_symlink()):
            os.replace(entry, aside / entry.name)
    return aside


def open_cache(directory: Path, open_: Callable[[], T], *, recover: bool) -> T:
    """``open_()`` (diskcache's ``Cache`` on ``directory``); with ``recover``, a damaged store is moved aside
    and a new one opened (see the module doc). Errors that are not damage, and damage without ``recover``,
    are raised as they come."""
    try:
        return open_()
    except sqlite3.DatabaseError as exc:
        if not recover or (damage(exc, directory) is None and not _io_error(exc)):
            raise
    with FileLock(str(directory / LOCK_NAME), timeout=LOCK_TIMEOUT_S):
        try:
            return open_()  # recreated by another process meanwhile
        except sqlite3.DatabaseError as exc:
            why = damage(exc, directory)
            if why is None:
                raise
        aside = move_aside(directory)
        log.warning("the disk store in %s was damaged (%s): moved it aside to %s and started an empty store there; "
                    "delete that folder once you no longer need it", directory, why, aside)  # fmt: skip
        return open_()
