"""langchain-tests' standard ByteStore suites on our stores, and our stores over LangChain's."""

from __future__ import annotations

import pytest
from langchain_core.stores import ByteStore, InMemoryByteStore
from langchain_tests.integration_tests.base_store import BaseStoreAsyncTests, BaseStoreSyncTests

from cachegen_core.keys.chunks import blob_key, chunk_keys
from cachegen_core.errors import StoreError
from cachegen_core.stores import DiskCacheStore, MemoryStore, RedisStore
from langchain_cachegen.stores import ByteStoreKVStore, KVByteStore

THREE = (b"foo-value\x00\xff", b"bar-value" * 100, bytes(range(256)))


@pytest.fixture(params=["memory", "disk", "redis", "memory-over-bytestore"])
def byte_store(request, tmp_path) -> ByteStore:
    kind = request.param
    if kind == "memory":
        kv = MemoryStore()
    elif kind == "disk":
        kv = DiskCacheStore(tmp_path / "kv", size_limit=1 << 26)
    elif kind == "redis":
        server = request.getfixturevalue("redis_server")
        server.flushall()
        kv = RedisStore(server.url)
    else:  # round trip through both adapters
        kv = ByteStoreKVStore(KVByteStore(MemoryStore()))
    store = KVByteStore(kv)
    yield store
    kv.close()


class TestKVByteStoreSync(BaseStoreSyncTests[bytes]):
    @pytest.fixture
    def kv_store(self, byte_store) -> ByteStore:
        return byte_store

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return THREE


class TestKVByteStoreAsync(BaseStoreAsyncTests[bytes]):
    @pytest.fixture
    async def kv_store(self, byte_store) -> ByteStore:
        return byte_store

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return THREE


def test_kvstore_over_a_langchain_bytestore_holds_chunk_blobs():
    backend = InMemoryByteStore()
    kv = ByteStoreKVStore(backend)
    chunks = chunk_keys(list(range(20)), chunk_tokens=8, fingerprint="f", codec_id="c", profile_id="p")
    items = [(blob_key(c.key, level), f"{c.index}/{level}".encode()) for c in chunks for level in range(3)]
    kv.put_many(items)
    assert kv.get_many([k for k, _ in items]) == [v for _, v in items]
    assert all(k.startswith("cachegen/") for k in backend.yield_keys())
    assert sorted(kv.keys(chunks[0].key)) == sorted(blob_key(chunks[0].key, lv) for lv in range(3))
    assert kv.contains(items[0][0]) and not kv.contains("absent")
    kv.delete(items[0][0])
    assert kv.get(items[0][0]) is None


def test_store_errors_surface_through_the_bytestore(fresh_redis_server):
    store = KVByteStore(RedisStore(fresh_redis_server.url))
    store.mset([("k", b"v")])
    fresh_redis_server.stop(kill=True)
    with pytest.raises(StoreError):
        store.mget(["k"])
    with pytest.raises(StoreError):
        list(store.yield_keys())
