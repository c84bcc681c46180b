"""Tiers inside a bounded store: raw forms a bounded share of the budget, levels the capacity, and a chunk
whose raw form went still a hit at its level (``cachegen_core/stores/tiers.py``)."""

from __future__ import annotations

import pytest

from cachegen_core.engine import KVEngine
from cachegen_core.stores import DiskCacheStore, MemoryStore
from cachegen_core.stores.tiers import CAPACITY_TIER, RAW_TIER, chunk_of, tier_of, yielding_tier
from cachegen_core.testing import words
from tests.test_engine import plain_greedy

CHUNK = 64
RAW, LEVEL, MANIFEST = 150_000, 40_000, 100
LIMIT = 1_000_000  # room for 20 levels (and manifests) and one raw form at the default share (0.2)


def h(i: int) -> str:
    return f"{i:064x}"


def write_chunk(store, i: int) -> None:
    """A chunk as the writer stores it: raw form, manifest, level, manifest."""
    store.put_many([(h(i) + "-Lraw", b"r" * RAW)])
    store.put(h(i) + "-M", b"m" * MANIFEST)
    store.put_many([(h(i) + "-L1", b"l" * LEVEL)])
    store.put(h(i) + "-M", b"n" * MANIFEST)


def tiered_store(kind: str, tmp_path, **kw):
    if kind == "memory":
        return MemoryStore(max_bytes=LIMIT, **kw)
    return DiskCacheStore(tmp_path / "kv", size_limit=LIMIT, disk_min_file_size=0, **kw)


def test_keys_belong_to_tiers_and_chunks():
    assert tier_of("ns:" + h(1) + "-Lraw") == tier_of(h(1) + "-Llossless") == RAW_TIER
    assert tier_of(h(1) + "-L1") == tier_of(h(1) + "-M") == tier_of("anything") == CAPACITY_TIER
    assert chunk_of("ns:" + h(1) + "-L12") == chunk_of("ns:" + h(1) + "-M") == "ns:" + h(1)
    assert chunk_of("plain-key") == "plain-key"
    assert yielding_tier(100, 0.2, 10, 80) is None  # within the budget: nothing goes
    assert yielding_tier(100, 0.2, 30, 80) == RAW_TIER  # raw over its share gives back first
    assert yielding_tier(100, 0.2, 15, 90) == CAPACITY_TIER  # levels borrowed the raw share's room: they give it back
    assert yielding_tier(100, 0.2, 120, 0) == RAW_TIER


def test_an_eviction_plan_takes_raw_forms_over_their_share_then_whole_chunks():
    from cachegen_core.stores.tiers import eviction_plan

    raw = [(h(1) + "-Lraw", 30), (h(2) + "-Lraw", 30)]  # least recently used first
    units = [(h(1), [(h(1) + "-L1", 10), (h(1) + "-M", 1)]), (h(2), [(h(2) + "-M", 1), (h(2) + "-L1", 10)])]
    assert eviction_plan(70, 0.2, raw, units) == [h(1) + "-Lraw"]  # raw 60 > 14: the oldest raw form goes
    assert eviction_plan(82, 0.5, raw, units) == []  # within the budget
    assert eviction_plan(80, 0.9, raw, units) == [h(1) + "-M", h(1) + "-L1", h(1) + "-Lraw"]  # levels borrowed: a whole chunk
    assert eviction_plan(20, 0.5, raw, units, overhead=5) == [h(1) + "-Lraw", h(2) + "-Lraw", h(1) + "-M", h(1) + "-L1"]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_levels_fill_the_budget_and_raw_forms_take_the_room_left(kind, tmp_path):
    s = tiered_store(kind, tmp_path)
    for i in range(20):
        write_chunk(s, i)
    keys = set(s.keys())
    assert all(h(i) + "-L1" in keys and h(i) + "-M" in keys for i in range(20)), "every chunk stays stored at its level"
    assert [k for k in keys if k.endswith("-Lraw")] == [h(19) + "-Lraw"], "room for one raw form is left: the newest"
    held = sum(n for _, n, _ in s.entries())
    assert held <= LIMIT


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_reserve_keeps_raw_forms_where_levels_want_the_room(kind, tmp_path):
    plain, reserved = tiered_store(kind, tmp_path / "a"), tiered_store(kind, tmp_path / "b", raw_share=0.2)
    for s in (plain, reserved):
        for i in range(26):  # 26 levels alone exceed the budget
            write_chunk(s, i)
    raws = [[k for k in s.keys() if k.endswith("-Lraw")] for s in (plain, reserved)]
    levels = [sum(k.endswith("-L1") for k in s.keys()) for s in (plain, reserved)]
    assert raws == [[], [h(25) + "-Lraw"]]  # raw forms go first; the reserve keeps the newest
    assert levels[0] > levels[1] >= 20  # at the cost of levels


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_with_room_to_spare_raw_forms_use_it_least_recently_used_first(kind, tmp_path):
    s = tiered_store(kind, tmp_path)
    for i in range(6):  # 6 raw forms (900 KB) do not fit beside 6 levels: raw uses the levels' unused room
        write_chunk(s, i)
        s.get(h(0) + "-M")
        s.get(h(0) + "-Lraw")  # chunk 0 is read after every write: never the least recently used
    raws = sorted(k for k in s.keys() if k.endswith("-Lraw"))
    n = 5 if kind == "memory" else 4  # on disk the database's pages count too
    assert raws == [h(i) + "-Lraw" for i in (0, *range(6 - n + 1, 6))], "the least recently used went"


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_the_capacity_tier_evicts_whole_chunks_least_recently_used(kind, tmp_path):
    s = tiered_store(kind, tmp_path, raw_share=0.0)
    for i in range(30):  # 30 levels do not fit: the oldest chunks go whole (manifest, level and raw form)
        write_chunk(s, i)
        s.get_many([h(0) + "-M"])  # a lookup of chunk 0's manifest keeps that whole chunk
    keys = set(s.keys())
    chunks = {k[:64] for k in keys}
    assert h(0) in chunks and h(1) not in chunks and h(29) in chunks
    assert all((c + "-M" in keys) == (c + "-L1" in keys) for c in chunks), "no chunk left half evicted"
    assert h(0) + "-Lraw" not in keys


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_without_tiers_one_eviction_order(kind, tmp_path):
    s = tiered_store(kind, tmp_path, raw_share=None)
    for i in range(20):
        write_chunk(s, i)
    raws = [k for k in s.keys() if k.endswith("-Lraw")]
    assert len(raws) >= 2 and h(0) + "-L1" not in set(s.keys())  # raw forms crowd levels out, as before tiers


def test_disk_rejects_an_eviction_policy_beside_tiers(tmp_path):
    with pytest.raises(ValueError, match="raw_share=None"):
        DiskCacheStore(tmp_path, eviction_policy="least-recently-used")
    DiskCacheStore(tmp_path, eviction_policy="least-recently-used", raw_share=None).close()
    with pytest.raises(ValueError, match="raw_share"):
        MemoryStore(max_bytes=10, raw_share=1.5)


def test_disk_ages_are_since_the_last_use(tmp_path):
    s = tiered_store("disk", tmp_path)
    s.put("old", b"x" * 10)
    s.put("new", b"x" * 10)
    s._cache._sql("UPDATE Cache SET access_time = access_time - 3600")  # both stored an hour ago
    s.get("old")  # read now: kept in memory, not written
    ages = {k: a for k, _, a in s.entries()}
    assert ages["old"] < 60 and ages["new"] > 3500


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_chunk_whose_raw_form_was_evicted_is_a_hit_at_its_level(kind, tmp_path, tiny_llama, tiny_tokenizer):
    prompt = words(41, 3 * CHUNK + 5)
    probe = MemoryStore()
    KVEngine(tiny_llama, tiny_tokenizer, store=probe, chunk_tokens=CHUNK, background=False).generate(prompt, max_new_tokens=1)
    sizes = {k: n for k, n, _ in probe.entries()}
    raw = max(n for k, n in sizes.items() if k.endswith("-Lraw"))
    levels = sum(n for k, n in sizes.items() if not k.endswith("-Lraw"))
    limit = levels + 3 * raw // 2  # every level and one raw form (the raw tier's share: one and a half)
    store = MemoryStore(max_bytes=limit, raw_share=1.5 * raw / limit) if kind == "memory" else DiskCacheStore(
        tmp_path / "kv", size_limit=8 << 20, raw_share=1.0, disk_min_file_size=0)  # fmt: skip
    # allow_text=False: on the tiny model recomputing a chunk may be predicted faster than decoding its level
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, background=False, allow_text=False)
    want, _ = e.generate(prompt, max_new_tokens=4)
    if kind == "disk":  # the disk store's database outweighs the tiny model's blobs: evict two raw forms as it would
        chunks = sorted({k[:64] for k in store.keys()})
        store.delete_many([c + "-Lraw" for c in chunks if c + "-Lraw" in set(store.keys())][:2])
    kept = [k for k in store.keys() if k.endswith("-Lraw")]
    assert len(kept) == 1
    got, info = e.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == 3 * CHUNK and not info.errors
    # the manifests still name every raw form: the two chunks that lost theirs come at their level (the one left may
    # come raw or at its level, whichever the controller predicts faster on a loaded machine)
    assert info.levels.count(e.level) >= 2 and set(info.levels) <= {e.level, "raw"}
    plain = plain_greedy(tiny_llama, tiny_tokenizer, prompt, 4)
    assert want == plain and isinstance(got, str)


def test_redis_tiers_are_expiries_from_the_last_use(redis_server):
    from cachegen_core.stores import RedisStore

    redis_server.flushall()
    s = RedisStore(redis_server.url, namespace="ttl:", ttl_s=100, raw_ttl_s=2)
    s.put_many([(h(1) + "-Lraw", b"r"), (h(1) + "-L1", b"l")])
    s.put(h(1) + "-M", b"m")
    c = s.client
    assert 1000 < c.pttl("ttl:" + h(1) + "-Lraw") <= 2000 and 99_000 < c.pttl("ttl:" + h(1) + "-M") <= 100_000
    assert RedisStore(redis_server.url, ttl_s=1).raw_ttl_ms == 1000  # raw forms never outlive the rest
    import time

    time.sleep(1.2)
    assert s.get(h(1) + "-Lraw") == b"r"  # a use: its expiry counts from now again
    assert c.pttl("ttl:" + h(1) + "-Lraw") > 1500
    time.sleep(2.1)
    assert s.get_many([h(1) + "-Lraw", h(1) + "-L1"]) == [None, b"l"]  # unused for its TTL: gone, the level stays
    plain = RedisStore(redis_server.url, namespace="ttl:", raw_ttl_s=None)
    plain.put(h(2) + "-Lraw", b"r")
    assert c.pttl("ttl:" + h(2) + "-Lraw") == -1  # no expiry


def test_a_redis_user_that_may_only_read_still_reads(fresh_redis_server, caplog):
    from cachegen_core.stores import RedisStore

    admin = fresh_redis_server.client()
    admin.execute_command("ACL", "SETUSER", "reader", "on", ">pw", "~*", "+@read", "+multi", "+exec")
    admin.close()
    RedisStore(fresh_redis_server.url, namespace="ro:").put_many([(h(1) + "-Lraw", b"r"), (h(1) + "-M", b"m")])
    reader = RedisStore(f"redis://reader:pw@127.0.0.1:{fresh_redis_server.port}/0", namespace="ro:", ttl_s=60)
    assert reader.get_many([h(1) + "-M", h(1) + "-Lraw"]) == [b"m", b"r"]  # its reads cannot set expiries: plain reads
    assert reader.get(h(1) + "-Lraw") == b"r" and sum("may not PEXPIRE" in r.getMessage() for r in caplog.records) == 1
