"""``RedisStore.read_into`` (``stores/resp.py``): a value received straight into a caller's buffer, on a real
redis-server: what ``get`` returns, bounded, expiries set again, the connection healed after a restart, a password,
TLS left to ``get``; and an engine reading its chunks through it into pinned buffers answers as without a cache."""

from __future__ import annotations

import pytest
import torch

from cachegen_core.engine import KVEngine
from cachegen_core.errors import StoreError
from cachegen_core.pinned import HostArena, HostBlock
from cachegen_core.stores.redis import RedisStore
from cachegen_core.testing import running_redis_server, words
from tests.redis_fixture import redis_server_binary
from tests.tls_fixture import tls_redis_server  # noqa: F401  (fixture)

CHUNK = 32


def test_a_value_lands_in_the_buffer_when_it_fits(redis_server):
    s = RedisStore(redis_server.url, namespace="ri1:")
    big = bytes(range(256)) * 4000  # past one recv: the reply arrives in many pieces
    s.put("k-Lraw", big)
    buf = bytearray(len(big) + 10)
    view = s.read_into("k-Lraw", buf)
    assert isinstance(view, memoryview) and view.obj is buf and bytes(view) == big
    small = bytearray(10)
    assert s.read_into("k-Lraw", small) == big and not any(small)  # too big for it: bytes, the buffer untouched
    assert s.read_into("absent", buf) is None
    s.put("e", b"")
    assert s.read_into("e", buf) is None  # empty reads as absent (no stored blob is)
    for _ in range(3):  # the socket stays in step across reads
        assert bytes(s.read_into("k-Lraw", buf)) == big
    s.close()


def test_reads_are_bounded_and_set_the_expiry_again(redis_server):
    s = RedisStore(redis_server.url, namespace="ri2:", max_value_bytes=1000, raw_ttl_s=100.0)
    s.put("ok-Lraw", b"x" * 1000)
    client = redis_server.client()
    client.pexpire("ri2:ok-Lraw", 5000)
    assert bytes(s.read_into("ok-Lraw", bytearray(2000))) == b"x" * 1000
    assert client.pttl("ri2:ok-Lraw") > 90_000  # the raw tier's expiry, set again by the read
    client.set("ri2:huge-Lraw", b"y" * 5000)  # written behind the store's back
    with pytest.raises(StoreError, match="max_value_bytes"):
        s.read_into("huge-Lraw", bytearray(10_000))
    assert bytes(s.read_into("ok-Lraw", bytearray(2000))) == b"x" * 1000  # and the connection is still usable
    s.close()


def test_a_restarted_server_is_read_again_and_a_dead_one_is_a_store_error(fresh_redis_server):
    s = RedisStore(fresh_redis_server.url, namespace="ri3:")
    s.put("k", b"v" * 100)
    assert bytes(s.read_into("k", bytearray(200))) == b"v" * 100
    fresh_redis_server.stop(kill=True)
    with pytest.raises(StoreError):
        s.read_into("k", bytearray(200))
    fresh_redis_server.start()
    s.put("k", b"w" * 100)
    assert bytes(s.read_into("k", bytearray(200))) == b"w" * 100  # a new socket, after the dead one was dropped
    s.close()


def test_a_password_is_sent_and_a_wrong_one_refused():
    with running_redis_server(redis_server_binary(), password="s3cret-pass") as server:
        url = f"redis://:s3cret-pass@{server.host}:{server.port}/3"
        s = RedisStore(url, namespace="ri4:")
        s.put("k", b"z" * 50)
        assert bytes(s.read_into("k", bytearray(64))) == b"z" * 50  # AUTH, then SELECT 3
        bad = RedisStore(f"redis://:wrong@{server.host}:{server.port}/0", namespace="ri4:")
        with pytest.raises(StoreError):
            bad.read_into("k", bytearray(64))


def test_tls_is_read_through_get(tls_redis_server):  # noqa: F811
    s = RedisStore(tls_redis_server.url, namespace="ri6:", ssl_ca_certs=tls_redis_server.tls["ca"])
    s.put("k", b"t" * 100)
    got = s.read_into("k", bytearray(200))
    assert got == b"t" * 100 and type(got) is bytes  # redis-py's TLS connection, not a plain socket
    s.close()


def test_an_engine_reads_redis_chunks_into_pinned_buffers(redis_server, tiny_llama, tiny_tokenizer):
    arena = HostArena(32 << 20, slab_bytes=8 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    store = RedisStore(redis_server.url, namespace="ri5:")
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level="lossless", background=False,
                 allow_text=False)  # fmt: skip
    e.reader.use_device(torch.device("cpu"), arena=arena)  # a GPU's reader: every blob into a pinned buffer
    prompt = words(70, 3 * CHUNK + 4)
    cold, _ = e.generate(prompt, max_new_tokens=6)
    warm, info = e.generate(prompt, max_new_tokens=6)
    assert info.levels == ["lossless"] * 3 and not info.errors and warm == cold
    assert e.reader._read_buffers and all(isinstance(b, HostBlock) for b in e.reader._read_buffers)
    store.close()
