"""A damaged disk store does not stop the application: real diskcache files damaged in each way are moved aside
(logged once, with where they went) and a new store is started; damage found later degrades to recomputation."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cachegen_core.engine import KVEngine
from cachegen_core.errors import StoreError
from cachegen_core.stores import DiskCacheStore
from cachegen_core.testing import words
from langchain_cachegen import CacheGenLLM
from tests.test_engine import plain_greedy

CHUNK = 32
BIG = b"v" * 100_000  # stored in a value file of its own, beside the database


def _truncate(n: Callable[[int], int]) -> Callable[[Path], None]:
    def damage(db: Path) -> None:
        data = db.read_bytes()
        db.write_bytes(data[: n(len(data))])

    return damage


def _replace_by_directory(db: Path) -> None:
    db.unlink()
    db.mkdir()
    (db / "x").write_bytes(b"x")


def _replace_by_link_loop(db: Path) -> None:
    db.unlink()
    os.symlink(db.name, db)


def _unreadable(db: Path) -> None:
    db.chmod(0)


DAMAGE = {
    "overwritten": lambda db: db.write_bytes(b"this is not a database " * 200),
    "zeroed": lambda db: db.write_bytes(bytes(db.stat().st_size)),
    "truncated-half": _truncate(lambda n: n // 2),
    "truncated-header": _truncate(lambda n: 100),
    "a-directory": _replace_by_directory,
    "a-link-loop": _replace_by_link_loop,
    "unreadable": pytest.param(_unreadable, marks=pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")),
}


def damaged_store(d: Path, damage: Callable[[Path], None]) -> None:
    with DiskCacheStore(d) as store:
        store.put("small", b"s")
        store.put("big", BIG)
    assert [p.name for p in d.iterdir() if p.is_dir()]  # the big value's folder
    damage(d / "cache.db")


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_damaged_store_is_moved_aside_and_started_afresh(tmp_path, caplog, damage):
    d = tmp_path / "kv"
    damaged_store(d, damage)
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(StoreError, match="is damaged"):
        DiskCacheStore(d, create=False)  # as the commands open it: reported, nothing moved (SQLite may add its -wal)
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith("cache.db-")) == before
    caplog.clear()  # damaged_store's creation of the store
    with caplog.at_level(logging.INFO, logger="cachegen_core.stores.disk"):  # the recovery's one line, not "created" as well
        store = DiskCacheStore(d)
    (aside,) = d.glob("damaged-*")
    assert sorted(p.name for p in aside.iterdir() if not p.name.startswith("cache.db-")) == before  # all of it, nothing else
    assert [r.getMessage() for r in caplog.records if str(aside) in r.getMessage()] == [r.getMessage() for r in caplog.records]
    assert len(caplog.records) == 1
    assert store.get("small") is None and list(store.keys()) == []  # a new, empty store
    store.put("big", BIG)
    assert store.get("big") == BIG
    store.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cachegen_core.stores.disk"), DiskCacheStore(d) as again:
        assert again.get("big") == BIG
    assert not caplog.records and len(list(d.glob("damaged-*"))) == 1


def test_what_is_not_damage_is_not_moved(tmp_path):
    d = tmp_path / "kv"
    with DiskCacheStore(d) as store:
        store.put("k", b"v")
    (d / "notes.txt").write_text("mine")
    (d / "ab").mkdir(exist_ok=True)
    (d / "cache.db").write_bytes(b"junk" * 100)
    DiskCacheStore(d).close()
    (aside,) = d.glob("damaged-*")
    assert (d / "notes.txt").read_text() == "mine" and not (aside / "notes.txt").exists() and (aside / "ab").is_dir()
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "cache.db").mkdir()
    ro.chmod(0o555)
    try:
        if os.geteuid() != 0:  # a directory the process may not write in: reported, never moved
            with pytest.raises(StoreError):
                DiskCacheStore(ro)
            assert (ro / "cache.db").is_dir()
    finally:
        ro.chmod(0o755)


def test_processes_opening_it_together_move_it_once(tmp_path):
    d = tmp_path / "kv"
    damaged_store(d, DAMAGE["overwritten"])
    start = threading.Barrier(8)
    with ThreadPoolExecutor(8) as pool:  # eight openers at once (a thread's lock file handle is its own)
        stores = list(pool.map(lambda _: (start.wait(), DiskCacheStore(d))[1], range(8)))
    assert len(list(d.glob("damaged-*"))) == 1
    stores[0].put("k", b"v")
    assert all(s.get("k") == b"v" for s in stores)  # one store, shared


def test_the_engine_starts_on_a_damaged_default_store(tmp_path, monkeypatch, tiny_model_dir, tiny_llama, tiny_tokenizer):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CACHEGEN_STORE", raising=False)
    damaged_store(tmp_path / "cache" / "kv", DAMAGE["overwritten"])
    # raw forms only: the answer is then the plain one (the controller may prefer a level's, lossy, on chunks this small)
    e = KVEngine.from_pretrained(tiny_model_dir, profile=None, chunk_tokens=CHUNK, background=False, store_options=["raw"])
    prompt = words(3, 2 * CHUNK + 5)
    want = plain_greedy(tiny_llama, tiny_tokenizer, prompt, 4)
    assert e.generate(prompt, max_new_tokens=4)[0] == want
    text, info = e.generate(prompt, max_new_tokens=4)
    assert text == want and info.cached_tokens == 2 * CHUNK and not info.errors  # the new store works
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "other"))  # (e's threads keep the first one open)
    damaged_store(tmp_path / "other" / "kv", DAMAGE["zeroed"])
    llm = CacheGenLLM.from_model_id(tiny_model_dir, profile=None, chunk_tokens=CHUNK, background=False)  # as a user starts
    assert isinstance(llm.invoke(prompt), str) and len(list((tmp_path / "other" / "kv").glob("damaged-*"))) == 1


def test_damage_found_later_degrades_to_recomputation(tmp_path, tiny_llama, tiny_tokenizer):
    d = tmp_path / "kv"
    store = DiskCacheStore(d)
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level=0, store_options=[0], background=False,
                 partial_step=0)  # fmt: skip
    stored, new = words(4, 3 * CHUNK + 5), words(5, 3 * CHUNK + 5)
    assert e.generate(stored, max_new_tokens=4)[1].chunks_queued == 3
    for name in ("cache.db", "cache.db-wal"):  # the same files, overwritten under the open store
        with open(d / name, "r+b") as f:
            f.write(bytes(os.fstat(f.fileno()).st_size))
    answers: list = []
    reader = threading.Thread(target=lambda: answers.append(e.generate(stored, max_new_tokens=4)))
    reader.start()  # a thread of its own: a connection of its own, which reads the damaged file
    reader.join()
    ((text, info),) = answers
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, stored, 4) and info.cached_tokens == 0
    assert any("DiskCacheStore" in err and "not a database" in err for err in info.errors), info.errors
    text, info = e.generate(new, max_new_tokens=4)  # its chunks cannot be stored: answered all the same
    assert text == plain_greedy(tiny_llama, tiny_tokenizer, new, 4) and info.cached_tokens == 0
    assert any("DiskCacheStore put" in err for err in info.errors), info.errors


def test_an_opener_whose_files_were_moved_aside_under_it_opens_the_new_store(tmp_path):
    from cachegen_core.stores.disk_recovery import open_cache

    tries = []

    def open_():  # the first try meets the I/O error SQLite gives when another opener moves the files under it
        tries.append(1)
        if len(tries) == 1:
            err = sqlite3.OperationalError("disk I/O error")
            err.sqlite_errorcode = 10
            raise err
        return "opened"

    assert open_cache(tmp_path, open_, recover=True) == "opened" and len(tries) == 2
    tries.clear()
    with pytest.raises(sqlite3.OperationalError):  # without recovery (a read command), raised as it came
        open_cache(tmp_path, open_, recover=False)
