"""The ``cachegen`` commands that read stores: one-line errors with exit code 2, nothing created by a read,
``ls`` and ``inspect STORE KEY`` on real stores (disk, a real redis-server) filled by a real engine."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from cachegen_core.cli import main
from cachegen_core.codec.format import read_header
from cachegen_core.engine import KVEngine
from cachegen_core.keys.manifest import Manifest
from cachegen_core.stores import DiskCacheStore, RedisStore
from cachegen_core.stores.admin import scan
from cachegen_core.stores.signed import OVERHEAD, SignedStore
from cachegen_core.testing import words

CHUNK = 32
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ("CACHEGEN_STORE", "CACHEGEN_NAMESPACE", "CACHEGEN_HMAC_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache"))  # the default `disk` store: not there yet
    core = logging.getLogger("cachegen_core")
    level = core.level
    yield
    core.setLevel(level)  # main() sets it: put back for the tests after these (their caplog would see INFO records)


def fill(store, tiny_llama, tiny_tokenizer, seed: int = 1, chunks: int = 3) -> KVEngine:
    eng = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 0, 1], level=1,
                   background=False, partial_step=0)  # fmt: skip
    eng.generate(words(seed, chunks * CHUNK + 5), max_new_tokens=1)
    return eng


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def failure(capsys, *argv: str) -> str:
    """The one line a failing command prints (exit code 2, no traceback)."""
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_every_failure_is_one_line_with_exit_code_2(tmp_path, capsys):
    assert "no such file" in failure(capsys, "inspect", str(tmp_path / "nonexistent"))
    assert "is a directory" in failure(capsys, "inspect", str(tmp_path))
    (tmp_path / "junk.bin").write_bytes(b"not a blob at all")
    assert "not a CacheGen blob" in failure(capsys, "inspect", str(tmp_path / "junk.bin"))
    assert "unknown store URL scheme" in failure(capsys, "stats", "mongodb://x")
    assert "unknown option" in failure(capsys, "ls", "disk?colour=blue")
    assert "Connection refused" in failure(capsys, "stats", "redis://127.0.0.1:1")
    assert "Connection refused" in failure(capsys, "ls", "redis://127.0.0.1:1")
    assert "nothing to collect" in failure(capsys, "gc", str(tmp_path))
    DiskCacheStore(tmp_path / "kv").put("k", b"v")
    assert "no entry or chunk 'abcdef0123'" in failure(capsys, "inspect", str(tmp_path / "kv"), "abcdef0123")
    assert "at least 8 hex digits" in failure(capsys, "inspect", str(tmp_path / "kv"), "nope")


def test_a_read_never_creates_a_store(tmp_path, capsys):
    typo = tmp_path / "typo_dir"
    for argv in (["stats", str(typo)], ["ls", str(typo)], ["keys", str(typo)], ["inspect", str(typo), "k" * 8],
                 ["gc", str(typo), "--older-than", "1d"], ["stats"], ["ls", "disk"]):  # fmt: skip
        assert "no such directory" in failure(capsys, *argv), argv
    assert not typo.exists() and not (tmp_path / "cache").exists()
    typo.mkdir()
    assert f"no disk store in {str(typo)!r}: it holds no cache.db" in failure(capsys, "stats", str(typo))
    assert list(typo.iterdir()) == []


def test_a_store_word_typo_is_named_and_a_store_s_name_opens_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert failure(capsys, "stats", "dsik").startswith("error: unknown store 'dsik': did you mean 'disk'? ")
    assert failure(capsys, "ls", "memroy").startswith("error: unknown store 'memroy': did you mean 'memory'? ")
    query = failure(capsys, "ls", "./kv?size_limit=5G")
    assert "a plain path takes no options ('./kv?size_limit=5G'): write disk://./kv?size_limit=5G" in query
    monkeypatch.setenv("CACHEGEN_STORE", "dsik")  # the command's default store: the variable is named
    assert failure(capsys, "stats").startswith("error: CACHEGEN_STORE='dsik': unknown store 'dsik': did you mean 'disk'? ")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with DiskCacheStore(tmp_path / "kv") as s:
        s.put("k", b"v")
    code, out, _ = run(capsys, "stats", "kv", "--no-headers")  # a bare word naming a store, given or from the variable
    assert code == 0 and json.loads(out)["entries"] == 1
    monkeypatch.setenv("CACHEGEN_STORE", "kv")
    code, out, _ = run(capsys, "stats", "--no-headers")
    assert code == 0 and json.loads(out)["entries"] == 1


def test_a_damaged_store_is_reported_not_moved(tmp_path, capsys):
    d = tmp_path / "kv"
    with DiskCacheStore(d) as store:
        store.put("k", b"v")
    (d / "cache.db").write_bytes(b"garbage" * 100)
    for argv in (["stats", str(d)], ["ls", str(d)], ["gc", str(d), "--max-bytes", "0"]):
        assert "is damaged (file is not a database)" in failure(capsys, *argv)
    assert (d / "cache.db").read_bytes() == b"garbage" * 100 and not list(d.glob("damaged-*"))


def test_ls_and_inspect_a_disk_store(tmp_path, capsys, tiny_llama, tiny_tokenizer):
    d = str(tmp_path / "kv")
    store = DiskCacheStore(d)
    eng = fill(store, tiny_llama, tiny_tokenizer)
    store.put("not-a-chunk", b"xyz")
    twins = ["abababab" + c * 56 for c in "01"]  # two chunks whose ids start alike (manifests alone)
    for t in twins:
        store.put(f"{t}-M", Manifest({1: 10}).to_bytes())

    code, out, _ = run(capsys, "ls", d, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    chunks, others = [r for r in rows if "chunk" in r], [r for r in rows if "key" in r]
    assert code == 0 and others == [{"key": "not-a-chunk", "bytes": 3, "age_s": others[0]["age_s"]}]
    s = scan(store)
    assert sorted(r["chunk"] for r in chunks) == sorted(s.chunks) and len(chunks) == 5
    engine_rows = [r for r in chunks if r["chunk"] not in twins]
    for r in engine_rows:
        assert r["options"] == {k: len(store.get(f"{r['chunk']}-L{k}")) for k in ("0", "1", "raw")}
        assert list(r["options"]) == ["0", "1", "raw"] and r["model"] == eng.fingerprint and r["age_s"] >= 0
        assert r["bytes"] == r["manifest"] + sum(r["options"].values())
    assert [r["model"] for r in chunks if r["chunk"] in twins] == [None, None]  # no blob to read a model from

    code, out, _ = run(capsys, "keys", d, "--no-headers")  # the table, for people
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["CHUNK", "MANIFEST", "OPTIONS", "BYTES", "AGE", "MODEL"]
    assert any(line.startswith(engine_rows[0]["chunk"][:16]) and "0,1,raw" in line for line in lines)
    assert lines[-1].startswith("5 chunks (0 without a manifest), 1 other key, ")

    chunk = engine_rows[0]["chunk"]
    code, out, _ = run(capsys, "inspect", d, f"{chunk}-L1")  # one blob: its header, as `inspect FILE` prints it
    blob = store.get(f"{chunk}-L1")
    assert code == 0 and json.loads(out) == {**read_header(blob), "key": f"{chunk}-L1", "blob_bytes": len(blob)}
    (tmp_path / "blob.bin").write_bytes(blob)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "blob.bin"))
    assert code == 0 and json.loads(out) == {**read_header(blob), "blob_bytes": len(blob)}
    code, out, _ = run(capsys, "inspect", d, chunk[:10])  # a chunk by the start of its id
    shown = json.loads(out)
    assert code == 0 and shown["chunk"] == chunk and shown["manifest"] == engine_rows[0]["options"]
    assert list(shown["blobs"]) == ["0", "1", "raw"] and shown["blobs"]["raw"]["codec"] == "cachegen-raw"
    assert shown["blobs"]["1"]["level"] == 1 and shown["blobs"]["1"]["model_fingerprint"] == eng.fingerprint
    code, out, _ = run(capsys, "inspect", d, f"{chunk}-M")
    assert json.loads(out) == {"key": f"{chunk}-M", "manifest": engine_rows[0]["options"], "bytes": engine_rows[0]["manifest"]}
    assert "2 chunks start with 'abababab'" in failure(capsys, "inspect", d, "abababab")
    assert json.loads(run(capsys, "inspect", d, "not-a-chunk")[1]) == {"key": "not-a-chunk", "bytes": 3}


def test_ls_and_inspect_a_signed_redis_store(redis_server, capsys, tiny_llama, tiny_tokenizer):
    redis_server.flushall()
    url = redis_server.url
    eng = fill(SignedStore(RedisStore(url, namespace="cli:"), b"k" * 32), tiny_llama, tiny_tokenizer, seed=2, chunks=2)
    RedisStore(url, namespace="else:").put("x", b"y")  # another namespace: not listed
    code, out, _ = run(capsys, "ls", url, "--namespace", "cli:", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 2 and all(r["model"] == eng.fingerprint and list(r["options"]) == ["0", "1", "raw"] for r in rows)
    code, out, _ = run(capsys, "inspect", url, rows[0]["chunk"][:8], "--namespace", "cli:")
    shown = json.loads(out)
    assert code == 0 and list(shown["manifest"]) == list(shown["blobs"]) == ["0", "1", "raw"]  # the manifest read through its tag
    for option, b in shown["blobs"].items():  # headers read without the key
        assert b["signed"] and b["model_fingerprint"] == eng.fingerprint and b["blob_bytes"] == shown["manifest"][option] + OVERHEAD
    assert "no entry or chunk" in failure(capsys, "inspect", url, rows[0]["chunk"][:8])  # the default namespace: not there


def test_the_console_script_prints_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cachegen_core.cli", "stats", str(tmp_path / "typo")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: no disk store in {str(tmp_path / 'typo')!r}: no such directory\n"
    assert not (tmp_path / "typo").exists()
