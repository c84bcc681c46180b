"""``RedisStore`` on a real Redis Cluster: 6 ``redis-server`` processes on loopback (3 masters, 3 replicas)
joined by ``redis-cli --cluster create`` (``cachegen_core/testing/redis_cluster.py``)."""

from __future__ import annotations

import json
import time

import pytest
import redis.cluster

from cachegen_core.codec.config import CodecConfig
from cachegen_core import cli
from cachegen_core.engine import KVEngine
from cachegen_core.errors import StoreError
from cachegen_core.keys.chunks import blob_key
from cachegen_core.keys.manifest import manifest_key
from cachegen_core.ops.settings import load
from cachegen_core.stores import RedisStore
from cachegen_core.stores.signed import SignedStore
from cachegen_core.stores.url import open_store
from cachegen_core.testing import words
from cachegen_core.testing.redis_cluster import running_redis_cluster
from tests.redis_fixture import redis_cluster, fresh_redis_cluster, redis_cluster_binary  # noqa: F401  (fixtures)
from tests.test_engine import plain_greedy
from tests.tls_fixture import make_tls_files

CHUNK = 64
HANG_S = 10.0  # a request answered later than this counts as hung


def h(i: int) -> str:
    return f"{i:064x}"


def test_every_store_operation_on_a_cluster(redis_cluster):  # noqa: F811
    s = open_store(redis_cluster.url, namespace="ops:")
    assert isinstance(s, RedisStore) and s.cluster and isinstance(s.client, redis.cluster.RedisCluster)
    assert repr(s).startswith("RedisStore('cluster 127.0.0.1:")
    items = [(h(i) + "-L1", bytes([i]) * (100 + i)) for i in range(40)]
    s.put_many(items)
    s.put(h(0) + "-Lraw", b"")  # an empty value is a value
    assert s.get_many([k for k, _ in items] + ["absent"]) == [v for _, v in items] + [None]
    assert s.get(h(0) + "-Lraw") == b"" and s.contains(h(1) + "-L1") and not s.contains("absent")
    assert sorted(s.keys()) == sorted([k for k, _ in items] + [h(0) + "-Lraw"])
    assert {k for k, _, _ in s.entries()} == set(s.keys())
    assert s.head(h(5) + "-L1", 3) == bytes([5]) * 3 and s.head("absent", 3) is None and s.ping()
    s.delete_many([k for k, _ in items[:30]])  # keys of many slots on every master
    assert len(list(s.keys())) == 11
    slots = {redis_cluster_slot(s, k) for k, _ in items}
    assert len({s.client.get_node_from_key(s.namespace + k).name for k, _ in items}) == 3 and len(slots) > 30


def test_a_cluster_down_at_start_fails_typed_and_fast():
    from cachegen_core.testing import free_port

    s = open_store(f"redis-cluster://127.0.0.1:{free_port()}")  # nobody there: made anyway, it connects on first use
    t = time.monotonic()
    for op in (lambda: s.get_many(["a", "b"]), lambda: s.put("a", b"v"), lambda: list(s.keys())):
        with pytest.raises(StoreError, match="RedisStore .* failed on cluster 127.0.0.1"):
            op()
    assert time.monotonic() - t < 10


def redis_cluster_slot(s: RedisStore, key: str) -> int:
    return s.client.keyslot(s.namespace + key)


def test_get_many_is_one_round_trip_per_node(redis_cluster, monkeypatch):  # noqa: F811
    s = RedisStore(redis_cluster.url, namespace="trips:", max_value_bytes=1 << 20)
    keys = [manifest_key(h(i)) for i in range(24)]  # a long prompt's manifests, spread over every master
    s.put_many([(k, b"m" * 50) for k in keys])
    s.get_many(keys)  # the client knows every node now
    trips: list[str] = []
    write = redis.cluster.NodeCommands.write

    def counted(self):
        trips.append(f"{self.connection.host}:{self.connection.port}")
        return write(self)

    monkeypatch.setattr(redis.cluster.NodeCommands, "write", counted)
    assert s.get_many(keys) == [b"m" * 50] * 24
    owners = {s.client.get_node_from_key(s.namespace + k).name for k in keys}
    assert sorted(trips) == sorted(owners) and len(owners) == 3  # one pipeline per node, each node once
    RedisStore(redis_cluster.url, namespace="trips:", max_value_bytes=None).put(keys[0], b"x" * ((1 << 20) + 1))  # hostile
    with pytest.raises(StoreError, match="max_value_bytes"):  # reads stay bounded
        s.get_many(keys)


def test_a_manifest_is_written_after_its_blobs_on_other_nodes(redis_cluster, tiny_llama, tiny_tokenizer):  # noqa: F811
    reader = RedisStore(redis_cluster.url, namespace="order:")
    seen: list[tuple[str, list[bool]]] = []

    class Watched(RedisStore):
        def put(self, key, value):
            if key.endswith("-M"):  # every blob it names is readable, by another client, before it is written
                seen.append((key, [reader.get(blob_key(key[:-2], o)) is not None for o in ("raw", CodecConfig().default_level)]))
            super().put(key, value)

    store = Watched(redis_cluster.url, namespace="order:")
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, background=False)
    prompt = words(51, 4 * CHUNK + 7)
    e.generate(prompt, max_new_tokens=2)
    assert len(seen) == 4 and all(all(ok) for _, ok in seen)
    nodes = {store.client.get_node_from_key(store.namespace + k).name for k in store.keys()}
    assert len(nodes) == 3  # a chunk's blobs and manifest lie on several nodes
    _, info = e.generate(prompt, max_new_tokens=2)
    assert info.cached_tokens == 4 * CHUNK and not info.errors


def test_cachegen_ls_and_inspect_a_cluster(redis_cluster, capsys, tiny_llama, tiny_tokenizer):  # noqa: F811
    store = RedisStore(redis_cluster.url, namespace="cli:")
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, store_options=["raw", 1], background=False, partial_step=0)
    e.generate(words(52, 3 * CHUNK + 7), max_new_tokens=1)
    assert cli.main(["ls", redis_cluster.url, "--namespace", "cli:", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 3 and all(r["model"] == e.fingerprint and list(r["options"]) == ["1", "raw"] and r["manifest"] for r in rows)
    assert cli.main(["inspect", redis_cluster.url, rows[0]["chunk"][:12], "--namespace", "cli:"]) == 0
    shown = json.loads(capsys.readouterr().out)  # a chunk's entries lie on several nodes
    assert shown["chunk"] == rows[0]["chunk"] and shown["blobs"]["1"]["level"] == 1  # ls: Redis' memory usage; these: bytes
    assert shown["manifest"] == {o: b["blob_bytes"] for o, b in shown["blobs"].items()} and list(shown["manifest"]) == ["1", "raw"]


def test_a_master_killed_mid_stream_fails_over_and_reuse_resumes(fresh_redis_cluster, tiny_llama, tiny_tokenizer):  # noqa: F811
    cluster = fresh_redis_cluster
    killed: list = []

    class KillsAMaster(RedisStore):
        def get(self, key):
            if self.armed and not killed:  # the first blob of a hit: the stream is under way
                killed.append(cluster.kill_master())
            return super().get(key)

    store = KillsAMaster(cluster.url, namespace="fo:", socket_timeout=1.0)
    store.armed = False
    # the exact form of the float32 tiny model: every answer must be the model's own greedy answer
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level="lossless", store_options=["lossless"],
                 background=False)  # fmt: skip
    prompts = [words(60 + i, 4 * CHUNK + 5) for i in range(3)]
    want = {p: plain_greedy(tiny_llama, tiny_tokenizer, p, 4) for p in prompts}
    tally = {"requests": 0, "wrong": 0, "crashes": 0, "hangs": 0, "reused": []}

    def ask(p: str) -> int:
        tally["requests"] += 1
        t = time.monotonic()
        try:
            text, info = e.generate(p, max_new_tokens=4)
        except Exception:  # noqa: BLE001
            tally["crashes"] += 1
            return -1
        tally["hangs"] += time.monotonic() - t > HANG_S
        tally["wrong"] += text != want[p]
        tally["reused"].append(info.cached_tokens)
        return info.cached_tokens

    for p in prompts:
        ask(p)  # misses: stored
    cluster.wait_ok()  # every replica has them
    store.armed = True
    ask(prompts[0])  # dies under this stream
    store.armed = False
    assert killed
    t = time.monotonic()
    resumed = False
    while time.monotonic() - t < 30 and not resumed:  # requests keep coming while the cluster fails over
        resumed = all(ask(p) == 4 * CHUNK for p in prompts)
    assert cluster.roles()[killed[0].address] == "fail"
    assert (tally["wrong"], tally["crashes"], tally["hangs"]) == (0, 0, 0), tally
    assert resumed, tally  # every prompt is reused again, served by the promoted replicas
    assert any(r < 4 * CHUNK for r in tally["reused"][3:]), "the kill cost some reuse while it failed over"


def test_a_cluster_over_tls_for_an_acl_user_from_the_environment(tmp_path, monkeypatch, tiny_llama, tiny_tokenizer):
    tls = make_tls_files(tmp_path)
    with running_redis_cluster(redis_cluster_binary(), tls=tls) as cluster:
        for node in cluster.nodes:  # ACL users are per node: every node learns app1
            c = node.client()
            c.execute_command("ACL", "SETUSER", "app1", "on", ">app1-pw", "~app1:*", "+@all")
            c.close()
        host_port = cluster.nodes[0].address
        url = f"rediss-cluster://app1:app1-pw@{host_port}?ssl_ca_certs={tls['ca']}"
        monkeypatch.setenv("CACHEGEN_STORE", url)
        monkeypatch.setenv("CACHEGEN_NAMESPACE", "app1:")
        monkeypatch.setenv("CACHEGEN_HMAC_KEY", "per-deployment-hmac-key-0123456789")
        e = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, profile=None, chunk_tokens=CHUNK, background=False)
        assert isinstance(e.store, SignedStore) and e.store.inner.cluster
        prompt = words(70, 3 * CHUNK + 5)
        e.generate(prompt, max_new_tokens=2)
        _, info = e.generate(prompt, max_new_tokens=2)
        assert info.cached_tokens == 3 * CHUNK and not info.errors
        assert str(load().store) == url
        with pytest.raises(StoreError, match="NOPERM|NoPermission"):
            open_store(url, namespace="app2:").put("k", b"v")
        with pytest.raises(StoreError) as err:
            open_store(url.replace("app1-pw", "wrong-pw"), namespace="app1:").get("k")
        assert "wrong-pw" not in str(err.value)
        with pytest.raises(StoreError, match="(?i)certificate|ssl"):
            open_store(url.split("?")[0], namespace="app1:").get("k")
