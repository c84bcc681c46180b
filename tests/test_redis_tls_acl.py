"""A trusted shared store for real: Redis over TLS, an ACL user confined to its namespace, HMAC-signed values.

Configured the way a deployment would: ``CACHEGEN_STORE=rediss://app1:pass@host:port/0?ssl_ca_certs=CA``,
``CACHEGEN_NAMESPACE=app1:`` and ``CACHEGEN_HMAC_KEY``; the server is a real ``redis-server`` with
TLS on its only port (``tests/tls_fixture.py`` skips with the exact reason where that cannot run).
"""

from __future__ import annotations

import pytest

from cachegen_core.engine import KVEngine
from cachegen_core.errors import StoreError
from cachegen_core.ops.settings import load
from cachegen_core.stores import RedisStore
from cachegen_core.stores.signed import SignedStore
from cachegen_core.stores.url import open_store
from cachegen_core.testing import words
from tests.tls_fixture import tls_redis_server  # noqa: F401  (fixture)

PASSWORD = "app1-s3cret"
KEY = "per-deployment-hmac-key-0123456789"
CHUNK = 64


@pytest.fixture
def app1_url(tls_redis_server, monkeypatch):  # noqa: F811
    """The URL of ACL user app1 (keys ``app1:*`` only), with the test CA; the CACHEGEN_* variables set to use it."""
    admin = tls_redis_server.client()
    admin.execute_command("ACL", "SETUSER", "app1", "on", f">{PASSWORD}", "~app1:*", "+@all")
    admin.close()
    host, port, ca = tls_redis_server.host, tls_redis_server.port, tls_redis_server.tls["ca"]
    url = f"rediss://app1:{PASSWORD}@{host}:{port}/0?ssl_ca_certs={ca}"
    monkeypatch.setenv("CACHEGEN_STORE", url)
    monkeypatch.setenv("CACHEGEN_NAMESPACE", "app1:")
    monkeypatch.setenv("CACHEGEN_HMAC_KEY", KEY)
    return url


def test_the_configured_store_is_tls_acl_and_signed(app1_url, tls_redis_server):  # noqa: F811
    store = open_store(load().store, namespace=load().namespace)
    assert isinstance(store, RedisStore) and store.client.connection_pool.connection_class.__name__ == "SSLConnection"
    store.put("k", b"over tls, as app1")
    assert store.get("k") == b"over tls, as app1"
    admin = tls_redis_server.client()
    assert admin.get("app1:k") == b"over tls, as app1" and admin.acl_whoami() == "default"
    admin.close()


def test_another_namespace_is_refused_by_the_server(app1_url):
    intruder = open_store(app1_url, namespace="app2:")
    with pytest.raises(StoreError, match="NOPERM|NoPermission") as info:
        intruder.put("k", b"v")
    with pytest.raises(StoreError, match="NOPERM|NoPermission"):
        intruder.get("k")
    assert PASSWORD not in str(info.value)


def test_wrong_password_untrusted_certificate_and_plain_text_are_refused(app1_url, tls_redis_server):  # noqa: F811
    with pytest.raises(StoreError) as info:
        open_store(app1_url.replace(PASSWORD, "wrong-pw"), namespace="app1:").get("k")
    assert "wrong-pw" not in str(info.value)
    no_ca = app1_url.split("?")[0]
    with pytest.raises(StoreError, match="(?i)certificate|ssl"):
        open_store(no_ca, namespace="app1:").get("k")
    plain = no_ca.replace("rediss://", "redis://")
    with pytest.raises(StoreError):
        open_store(plain, namespace="app1:").get("k")


def test_an_engine_configured_from_the_environment_reuses_over_tls(app1_url, tls_redis_server, tiny_llama, tiny_tokenizer):  # noqa: F811
    eng = KVEngine.from_pretrained(tiny_llama, tokenizer=tiny_tokenizer, profile=None, chunk_tokens=CHUNK, background=False)
    assert isinstance(eng.store, SignedStore) and isinstance(eng.store.inner, RedisStore)
    prompt = words(31, 2 * CHUNK + 9)
    first, _ = eng.generate(prompt, max_new_tokens=4)
    again, info = eng.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == 2 * CHUNK and not info.errors and info.bytes_fetched > 0
    admin = tls_redis_server.client()
    keys = admin.keys("*")
    admin.close()
    assert keys and all(k.startswith(b"app1:") for k in keys)
    # a writer without the key (plain credentials, same namespace) plants a value: a miss, never decoded
    unsigned = open_store(app1_url, namespace="app1:")
    for k in list(unsigned.keys()):
        if k.endswith("-M"):
            unsigned.put(k, b'{"format":"cachegen-manifest-v1","options":{"1":10}}')
    _, info = eng.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == 0 and eng.store.rejected >= 1 and eng.metrics().rejected_values >= 1
