"""KV stores: the common contract on every backend, then each backend's limits and failures."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import diskcache
import pytest
from langchain_core.stores import InMemoryByteStore

from cachegen_core.keys.chunks import blob_key
from cachegen_core.errors import CacheGenError, StoreError
from cachegen_core.stores import DiskCacheStore, KVStore, MemoryStore, RedisStore, default_directory
from cachegen_core.stores.base import fetches_on_cpu
from cachegen_core.stores.signed import SignedStore
from langchain_cachegen.stores import ByteStoreKVStore
from cachegen_core.testing import free_port, start_redis_server
from tests.redis_fixture import redis_server_binary
from tests.tls_fixture import make_tls_files

REPO = Path(__file__).resolve().parents[1]
KINDS = ["memory", "disk", "redis", "bytestore"]

# A factory makes stores of one kind that share one backend: factory(namespace=..., **kw).
Factory = Callable[..., KVStore]


@pytest.fixture(params=KINDS)
def make_store(request, tmp_path) -> Iterator[Factory]:
    kind = request.param
    made: list[KVStore] = []
    shared_bytestore = InMemoryByteStore()
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        server.flushall()

    def factory(namespace: str = "test:", **kw) -> KVStore:
        if kind == "memory":
            store: KVStore = MemoryStore(namespace=namespace, **kw)
        elif kind == "disk":
            store = DiskCacheStore(tmp_path / "kv", namespace=namespace, **kw)
        elif kind == "redis":
            store = RedisStore(server.url, namespace=namespace, **kw)
        else:
            store = ByteStoreKVStore(shared_bytestore, namespace=namespace, **kw)
        made.append(store)
        return store

    factory.kind = kind  # type: ignore[attr-defined]
    yield factory
    for s in made:
        s.close()


@pytest.fixture
def store(make_store) -> KVStore:
    return make_store()


def blob(i: int, n: int = 1000) -> bytes:
    """A self-describing value: anything torn or mixed up is detected by ``check_blob``."""
    head = f"{i:08d}:{n:08d}:".encode()
    body = bytes((i * 31 + j) % 256 for j in range(n))
    return head + body


def check_blob(data: bytes) -> int:
    i, n = int(data[:8]), int(data[9:17])
    assert data == blob(i, n), "torn or mixed-up value"
    return i


# --- the common contract ---------------------------------------------------------------


def test_is_a_kvstore(store):
    assert isinstance(store, KVStore)


def test_round_trip(store):
    assert store.get("missing") is None
    every_byte = bytes(range(256)) * 4
    store.put("a", every_byte)
    store.put("b", bytearray(b"\x00\x01"))
    store.put("c", memoryview(b"view"))
    store.put("big", blob(7, 300_000))
    store.put("empty", b"")
    assert store.get("a") == every_byte and type(store.get("a")) is bytes
    assert store.get("b") == b"\x00\x01" and store.get("c") == b"view"
    assert check_blob(store.get("big")) == 7
    assert store.get("empty") == b"" and store.contains("empty")
    store.put("a", b"overwritten")
    assert store.get("a") == b"overwritten"


def test_batch_ops(store):
    store.put_many([("k1", b"1"), ("k2", b"2")])
    store.put_many({"k3": b"3", "k4": blob(4)})
    assert store.get_many(["k1", "nope", "k3", "k1", "k4"]) == [b"1", None, b"3", b"1", blob(4)]
    assert store.get_many([]) == []
    store.put_many([])
    store.delete_many(["k1", "k3", "never-there"])
    store.delete_many([])
    assert store.get_many(["k1", "k2", "k3"]) == [None, b"2", None]


def test_contains_delete(store):
    assert not store.contains("x")
    store.put("x", b"1")
    assert store.contains("x")
    store.delete("x")
    store.delete("x")  # absent: no error
    assert not store.contains("x") and store.get("x") is None


def test_keys_with_prefix(store):
    key0, key1 = blob_key("ab" * 32, 0), blob_key("ab" * 32, 1)
    store.put_many([(key0, b"0"), (key1, b"1"), ("other", b"2")])
    assert sorted(store.keys()) == sorted([key0, key1, "other"])
    assert sorted(store.keys("abab")) == sorted([key0, key1])
    assert list(store.keys("zzz")) == []


def test_argument_types_are_checked(store):
    with pytest.raises(TypeError):
        store.put(b"bytes-key", b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.put("k", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.get(3)  # type: ignore[arg-type]


def test_max_value_bytes(make_store):
    s = make_store(max_value_bytes=100)
    s.put("ok", b"x" * 100)
    with pytest.raises(StoreError, match="max_value_bytes"):
        s.put("too-big", b"x" * 101)
    with pytest.raises(StoreError):
        s.put_many([("fine", b"1"), ("too-big", b"x" * 101)])
    assert s.get("too-big") is None


def test_namespaces_are_isolated(make_store):
    if make_store.kind == "memory":
        pytest.skip("MemoryStore instances never share a backend")
    a, b = make_store(namespace="app-a:"), make_store(namespace="app-b:")
    a.put("k", b"from a")
    assert b.get("k") is None and not b.contains("k") and b.get_many(["k"]) == [None]
    b.put("k", b"from b")
    b.delete("k")
    assert a.get("k") == b"from a"
    a.put("only-a", b"1")
    assert list(b.keys()) == [] and sorted(a.keys()) == ["k", "only-a"]
    c = make_store(namespace="app-c:")
    assert c.get("k") is None and list(c.keys()) == []


def test_concurrent_writers_and_readers_never_see_torn_values(make_store):
    """8 threads write and read 40 overlapping keys through one store."""
    s = make_store()
    errors: list[BaseException] = []
    n_keys, rounds = 40, 30

    def worker(t: int) -> None:
        try:
            for r in range(rounds):
                k = (t * 7 + r) % n_keys
                s.put(f"key{k}", blob(k * 1000 + t, 2000 + 37 * t))
                for got in s.get_many([f"key{(k + d) % n_keys}" for d in range(3)]):
                    if got is not None:
                        check_blob(got)
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert not errors, errors[:3]
    for k in range(n_keys):
        got = s.get(f"key{k}")
        assert got is None or check_blob(got) // 1000 == k


def test_store_error_is_typed():
    assert issubclass(StoreError, CacheGenError)


# --- MemoryStore --------------------------------------------------------------------


def test_memory_lru_eviction():
    s = MemoryStore(max_bytes=300)
    s.put("a", b"a" * 100)
    s.put("b", b"b" * 100)
    s.put("c", b"c" * 100)
    assert s.get("a") is not None  # a is now the most recently used
    s.put("d", b"d" * 100)
    assert s.get("b") is None, "the least recently used entry goes first"
    assert all(s.contains(k) for k in "acd")
    assert s.total_bytes == 300
    s.put("e", b"e" * 250)
    assert s.total_bytes <= 300 and s.get("e") == b"e" * 250
    with pytest.raises(StoreError):
        s.put("huge", b"x" * 301)


def test_memory_overwrite_keeps_byte_count():
    s = MemoryStore(max_bytes=1000)
    for _ in range(10):
        s.put("k", b"x" * 400)
    assert s.total_bytes == 400 and len(s) == 1
    s.delete("k")
    assert s.total_bytes == 0


def test_memory_closed_store_raises_store_error():
    s = MemoryStore()
    s.put("k", b"v")
    s.close()
    with pytest.raises(StoreError):
        s.get("k")


# --- DiskCacheStore -------------------------------------------------------------------


def test_disk_default_directory_is_the_user_cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("CACHEGEN_CACHE_DIR", raising=False)  # it would override the user cache dir
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert default_directory() == tmp_path / "xdg" / "langchain-cachegen" / "kv"
    with DiskCacheStore() as s:
        assert s.directory == default_directory()
        s.put("k", b"v")
    assert default_directory().is_dir()
    assert DiskCacheStore(size_limit=1 << 20).size_limit == 1 << 20
    assert DiskCacheStore.__init__.__kwdefaults__["size_limit"] == 10 * (1 << 30)


def test_disk_size_limit_evicts_oldest(tmp_path):
    limit = 1 << 20
    s = DiskCacheStore(tmp_path, size_limit=limit)
    for i in range(100):
        s.put(f"k{i}", blob(i, 64 << 10))  # file-backed values
        assert s.volume <= limit + (128 << 10)
    for i in range(150):
        s.put(f"s{i}", blob(i, 10 << 10))  # inline values
        assert s.volume <= limit + (128 << 10)
    assert check_blob(s.get("s149")) == 149
    assert s.get("k0") is None and s.get("s0") is None
    with pytest.raises(StoreError, match="max_value_bytes"):
        s.put("bigger-than-the-cache", b"x" * (limit + 1))


def test_disk_is_shared_across_instances_and_persistent(tmp_path):
    with DiskCacheStore(tmp_path) as a:
        a.put("k", blob(1, 100_000))
    b = DiskCacheStore(tmp_path)
    c = DiskCacheStore(tmp_path)
    assert check_blob(b.get("k")) == 1
    c.delete("k")
    assert b.get("k") is None


class _Boom:
    """Unpickling this runs code: the store must never do it."""

    def __reduce__(self):
        return (Path(tempfile.gettempdir(), "cachegen-pickle-canary").touch, ())


def test_disk_never_unpickles_planted_entries(tmp_path):
    canary = Path(tempfile.gettempdir(), "cachegen-pickle-canary")
    canary.unlink(missing_ok=True)
    s = DiskCacheStore(tmp_path, namespace="ns:")
    s.put("good", b"fine")
    raw = diskcache.Cache(str(tmp_path))  # plain diskcache: pickles whatever it is given
    raw.set("ns:evil", _Boom())
    raw.set("ns:evil-file", [_Boom()] * 2, read=False)
    raw.set(("ns:tuple-key",), b"pickled key")
    raw.set("ns:text", "a str value")
    raw.close()
    for key in ("evil", "evil-file", "text"):
        with pytest.raises(StoreError, match="refused|expected bytes"):
            s.get(key)
        with pytest.raises(StoreError, match="refused|expected bytes"):
            s.read_into(key, bytearray(1 << 20))
    with pytest.raises(StoreError):
        s.get_many(["good", "evil"])
    assert sorted(s.keys()) == ["evil", "evil-file", "good", "text"]  # the pickled key is skipped
    assert s.get("good") == b"fine"
    assert not canary.exists(), "a planted pickle was executed"
    raw = diskcache.Cache(str(tmp_path))
    raw.get("ns:evil")  # what plain diskcache would have done: proves the planted pickle is live
    raw.close()
    assert canary.exists()
    canary.unlink()


def test_disk_value_file_outside_the_directory_is_refused(tmp_path):
    s = DiskCacheStore(tmp_path / "kv", namespace="")
    s.put("k", b"x" * 100_000)  # file-backed
    (tmp_path / "outside.val").write_bytes(b"secret")
    raw = diskcache.Cache(str(tmp_path / "kv"))
    raw._sql("UPDATE Cache SET filename = ? WHERE key = ?", ("../outside.val", "k"))
    raw.close()
    with pytest.raises(StoreError, match="outside the cache directory"):
        s.get("k")
    with pytest.raises(StoreError, match="outside the cache directory"):
        s.read_into("k", bytearray(1 << 20))


def test_disk_oversized_stored_value_is_refused(tmp_path):
    DiskCacheStore(tmp_path).put("k", b"x" * 100_000)
    reader = DiskCacheStore(tmp_path, max_value_bytes=50_000)
    with pytest.raises(StoreError, match="exceeds max_value_bytes"):
        reader.get("k")
    with pytest.raises(StoreError, match="exceeds max_value_bytes"):
        reader.read_into("k", bytearray(1 << 20))


def test_disk_read_into_reads_a_file_value_into_the_callers_buffer(tmp_path):
    s = DiskCacheStore(tmp_path)
    big, small = bytes(range(256)) * 1000, b"inline"
    s.put("big", big)  # file-backed
    s.put("small", small)  # inline in SQLite
    buf = bytearray(300_000)
    view = s.read_into("big", buf)
    assert isinstance(view, memoryview) and view.obj is buf and view == big
    assert s.read_into("small", buf) == small and s.read_into("absent", buf) is None
    assert s.read_into("big", bytearray(10)) == big  # too small a buffer: read the plain way


_READONLY_PROBE = r"""
import codecs, json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
from cachegen_core.errors import StoreError
from cachegen_core.stores.disk import DiskCacheStore
codecs.encode(b"", "hex")  # diskcache names files with it; load it before losing access to the stdlib
if os.geteuid() == 0:  # root ignores file modes: drop to nobody so that read-only means read-only
    os.setgid(65534)
    os.setuid(65534)
out = {}
def attempt(name, fn):
    try:
        value = fn()
        out[name] = ["ok", len(value) if isinstance(value, bytes) else value]
    except StoreError as exc:
        out[name] = ["StoreError", str(exc)]
    except BaseException as exc:
        out[name] = ["other", repr(exc)]
d = tempfile.mkdtemp(prefix="cachegen-ro-")
out["dir"] = d
s = DiskCacheStore(d)
s.put("small", b"s" * 100)
s.put("big", b"b" * 100_000)
for root, dirs, files in os.walk(d):
    for f in files:
        os.chmod(os.path.join(root, f), 0o444)
    os.chmod(root, 0o555)
attempt("get_small", lambda: s.get("small"))
attempt("get_big", lambda: s.get("big"))
attempt("put_big", lambda: s.put("big2", b"x" * 100_000))
attempt("put_small", lambda: s.put("small2", b"x" * 10))
s.close()
attempt("reopen", lambda: DiskCacheStore(d).get("small"))
print(json.dumps(out))
"""


def test_disk_read_only_directory_fails_typed(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_READONLY_PROBE)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(REPO)], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        assert out["get_small"] == ["ok", 100] and out["get_big"] == ["ok", 100_000], "reads keep working"
        assert out["put_big"][0] == "StoreError" and "not writable" in out["put_big"][1]
        assert out["put_small"][0] in ("ok", "StoreError")  # an open SQLite handle may still write
        assert out["reopen"][0] in ("ok", "StoreError")
        assert not any(v[0] == "other" for k, v in out.items() if k != "dir"), out
        assert time.monotonic() - t0 < 30
    finally:
        for root, _, _ in os.walk(out["dir"]):
            os.chmod(root, stat.S_IRWXU)
        shutil.rmtree(out["dir"], ignore_errors=True)


# --- RedisStore -----------------------------------------------------------------------


def _exercise_all_ops(s: RedisStore) -> list[str]:
    """Every op against a dead server: all must raise StoreError, each within ~2 s."""
    ops = {
        "get": lambda: s.get("k"),
        "put": lambda: s.put("k", b"v"),
        "get_many": lambda: s.get_many(["k", "j"]),
        "put_many": lambda: s.put_many([("k", b"v")]),
        "contains": lambda: s.contains("k"),
        "delete": lambda: s.delete("k"),
        "keys": lambda: list(s.keys()),
    }
    slow = []
    for name, op in ops.items():
        t0 = time.monotonic()
        with pytest.raises(StoreError) as info:
            op()
        assert isinstance(info.value.__cause__, Exception)
        if time.monotonic() - t0 > 2.0:
            slow.append(name)
    return slow


def test_redis_server_killed_then_restarted(fresh_redis_server):
    s = RedisStore(fresh_redis_server.url)
    s.put("k", blob(1))
    assert check_blob(s.get("k")) == 1
    fresh_redis_server.stop(kill=True)
    assert _exercise_all_ops(s) == [], "a dead server must fail fast"
    fresh_redis_server.start()
    assert s.get("k") is None  # no persistence: the restarted server is empty, and reachable
    s.put("k", blob(2))
    assert check_blob(s.get("k")) == 2
    assert s.ping()


def test_redis_hung_server_times_out(fresh_redis_server):
    s = RedisStore(fresh_redis_server.url, socket_timeout=0.3)
    s.put("k", b"v")
    fresh_redis_server.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="Timeout"):
            s.get("k")
        assert time.monotonic() - t0 < 2.0
    finally:
        fresh_redis_server.resume()
    assert s.get("k") == b"v"


def test_redis_nothing_listening_fails_fast():
    s = RedisStore(host="127.0.0.1", port=free_port())
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="127.0.0.1"):
        s.get("k")
    assert time.monotonic() - t0 < 2.0


def test_redis_default_retry_is_bounded():
    s = RedisStore(host="127.0.0.1", port=1)
    retry = s.client.get_retry()
    assert retry.get_retries() == 1


def test_redis_password_and_acl_user_pass_through(fresh_redis_server):
    admin = fresh_redis_server.client()
    admin.config_set("requirepass", "s3cret-pw")
    admin.close()
    fresh_redis_server.password = "s3cret-pw"
    port = fresh_redis_server.port
    with pytest.raises(StoreError) as info:
        RedisStore(host="127.0.0.1", port=port).put("k", b"v")
    assert "s3cret" not in str(info.value)
    with pytest.raises(StoreError) as info:
        RedisStore(f"redis://:wrong-pw@127.0.0.1:{port}/0").get("k")
    assert "wrong-pw" not in str(info.value)
    RedisStore(host="127.0.0.1", port=port, password="s3cret-pw").put("k", b"v")
    assert RedisStore(f"redis://:s3cret-pw@127.0.0.1:{port}/0").get("k") == b"v"
    # an ACL user confined to its deployment's namespace
    admin = fresh_redis_server.client()
    admin.acl_setuser("app", enabled=True, passwords=["+app-pw"], keys=["app:*"], commands=["+@all"])
    admin.close()
    app = RedisStore(host="127.0.0.1", port=port, username="app", password="app-pw", namespace="app:")
    app.put("k", b"app value")
    assert app.get("k") == b"app value"
    intruder = RedisStore(host="127.0.0.1", port=port, username="app", password="app-pw", namespace="other:")
    with pytest.raises(StoreError, match="NoPermission|NOPERM"):
        intruder.get("k")


def test_redis_tls_pass_through(tmp_path):
    tls = make_tls_files(tmp_path)
    try:
        server = start_redis_server(redis_server_binary(), tls=tls)
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server has no TLS support: {exc}")
        raise
    try:
        s = RedisStore(host="127.0.0.1", port=server.port, ssl=True, ssl_ca_certs=tls["ca"])
        s.put("k", b"over tls")
        assert s.get("k") == b"over tls"
        assert RedisStore(server.url, ssl_ca_certs=tls["ca"]).get("k") == b"over tls"  # rediss:// URL
        with pytest.raises(StoreError):  # the server's certificate is not trusted by default
            RedisStore(server.url).get("k")
        with pytest.raises(StoreError):  # plain text against a TLS port
            RedisStore(host="127.0.0.1", port=server.port).get("k")
    finally:
        server.close()


def test_redis_oversized_value_is_not_read(redis_server):
    redis_server.flushall()
    s = RedisStore(redis_server.url, namespace="ns:", max_value_bytes=1000)
    raw = redis_server.client()
    raw.set("ns:huge", b"x" * 1001)
    raw.set("ns:fits", b"y" * 1000)
    raw.rpush("ns:list", b"not a string")
    raw.close()
    assert s.get("fits") == b"y" * 1000
    with pytest.raises(StoreError, match="max_value_bytes"):
        s.get("huge")
    with pytest.raises(StoreError, match="WRONGTYPE"):
        s.get("list")
    unbounded = RedisStore(redis_server.url, namespace="ns:", max_value_bytes=None)
    assert unbounded.get_many(["huge", "nope"]) == [b"x" * 1001, None]


def test_redis_ttl(redis_server):
    s = RedisStore(redis_server.url, namespace="ttl:", ttl_s=60)
    s.put("a", b"1")
    s.put_many([("b", b"2")])
    raw = redis_server.client()
    try:
        assert 0 < raw.pttl("ttl:a") <= 60_000 and 0 < raw.pttl("ttl:b") <= 60_000
    finally:
        raw.close()


def test_redis_glob_characters_in_namespace_and_prefix(redis_server):
    redis_server.flushall()
    odd = RedisStore(redis_server.url, namespace="n[1]*?\\:")
    other = RedisStore(redis_server.url, namespace="n1xx\\:")
    odd.put("a*b", b"1")
    odd.put("a?c", b"2")
    other.put("a*b", b"3")
    assert sorted(odd.keys()) == ["a*b", "a?c"]
    assert list(odd.keys("a*")) == ["a*b"]
    assert list(other.keys()) == ["a*b"]


def test_redis_kwargs_pass_through():
    s = RedisStore(host="10.255.255.1", port=6390, db=3, socket_timeout=7.0, client_name="cachegen-test")
    kw = s.client.connection_pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["socket_timeout"], kw["client_name"]) == ("10.255.255.1", 6390, 3, 7.0, "cachegen-test")
    assert "10.255.255.1:6390/3" in repr(s)
    u = RedisStore("redis://user:pw@example.invalid:6391/2", socket_connect_timeout=0.1)
    kw = u.client.connection_pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["username"], kw["password"]) == ("example.invalid", 6391, 2, "user", "pw")
    assert "pw" not in repr(u)


@pytest.mark.parametrize(("address", "same"), [
    ({"host": "127.0.0.1"}, True), ({"host": "localhost"}, True), ({"host": "::1"}, True), ({"url": "redis://127.0.0.2:6390/0"}, True),
    ({"url": "unix:///tmp/redis.sock"}, True), ({"host": "10.255.255.1"}, False), ({"url": "redis://example.invalid:6391/2"}, False),
    ({"url": "redis-cluster://127.0.0.1:7000"}, True), ({"url": "redis-cluster://10.0.0.7:7000"}, False),
])  # fmt: skip
def test_redis_same_host_is_read_from_the_address(address, same):
    """A server on loopback or a Unix socket shares this machine's cores (the engine plans its fetches in turns
    with a CPU decode); nothing is connected to find out."""
    url, host = address.get("url"), {k: v for k, v in address.items() if k != "url"}  # the parameter left as it is
    assert RedisStore(url, **host).same_host is same
    assert RedisStore(url, same_host=not same, **host).same_host is (not same)  # the caller knows better


def test_fetches_on_cpu_for_each_store(tmp_path):
    assert fetches_on_cpu(MemoryStore()) and fetches_on_cpu(DiskCacheStore(tmp_path / "d"))
    assert fetches_on_cpu(SignedStore(RedisStore(host="127.0.0.1"), b"k" * 32))
    assert not fetches_on_cpu(SignedStore(RedisStore(host="10.255.255.1"), b"k" * 32))
    assert not fetches_on_cpu(object())  # says nothing: planned as a remote store, as before


# --- ByteStoreKVStore over a failing / misbehaving LangChain store ---------------------------------


class _BrokenByteStore(InMemoryByteStore):
    def mget(self, keys):
        raise ConnectionResetError("backend went away")


class _StrByteStore(InMemoryByteStore):
    def mget(self, keys):
        return ["not bytes" for _ in keys]


def test_bytestore_backend_failures_become_store_errors():
    with pytest.raises(StoreError, match="backend went away"):
        ByteStoreKVStore(_BrokenByteStore()).get("k")
    with pytest.raises(StoreError, match="expected bytes"):
        ByteStoreKVStore(_StrByteStore()).get_many(["k"])
