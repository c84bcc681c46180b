"""The trace-shaped link: its maths, the sleeping store wrapper, and the TCP proxy in front of a real redis-server."""

import os
import time

import pytest

from benchmarks.throttled_proxy import ThrottledProxy, ThrottledStore, TraceLink
from cachegen_core.stores.memory import MemoryStore

GBIT = 1e9 / 8  # bytes/s


def test_finish_walks_the_slices_and_cycles():
    link = TraceLink([8.0, 0.8], slice_s=1.0)  # 1 GB/s, then 100 MB/s, cycled
    assert link.finish(0.0, 0.5e9) == pytest.approx(0.5)
    assert link.finish(0.5, 0.5e9 + 50e6) == pytest.approx(1.5)  # 0.5 GB in slice 0, 50 MB in slice 1
    assert link.finish(1.5, 50e6 + 1e9) == pytest.approx(3.0)  # slice 1, then all of slice 2 (= slice 0)
    assert link.rate_at(2.2) == pytest.approx(8 * GBIT) and link.rate_at(-0.5) == pytest.approx(0.8 * GBIT)
    zero = TraceLink([0.0, 8.0], slice_s=1.0)  # an outage: nothing moves until the next slice
    assert zero.finish(0.2, 1e9) == pytest.approx(2.0)
    fine = TraceLink([1.0] * 3, slice_s=0.1)  # float boundaries (0.3 // 0.1 == 2.0) must not stall
    assert fine.finish(0.0, 3 * 0.1 * GBIT + 1) == pytest.approx(0.3, abs=1e-6)
    for bad in ([], [0.0], [-1.0, 1.0], [float("nan")]):
        with pytest.raises(ValueError):
            TraceLink(bad)


def test_reserve_queues_transfers_and_limits_bursts():
    link = TraceLink([0.8], slice_s=1.0, burst_s=0.01)  # 100 MB/s
    assert link.reserve(10_000_000, now=5.0) == pytest.approx(5.09)  # idle: 10 ms of credit
    assert link.reserve(10_000_000, now=5.0) == pytest.approx(5.19)  # queued behind the first
    assert link.reserve(1_000_000, now=9.0) == pytest.approx(9.0)  # idle again: within the credit
    link.restart(20.0)
    assert link.reserve(1_000_000, now=20.0) == pytest.approx(20.01)  # no credit from before the trace started


def test_throttled_store_sleeps_as_the_trace_says():
    now = [100.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    inner = MemoryStore()
    inner.put("a", b"x" * 1_000_000)
    store = ThrottledStore(inner, [0.08] + [0.008] * 20, slice_s=0.1, clock=lambda: now[0], sleep=sleep)  # 10 MB/s, then 1 MB/s
    assert store.get("a") == b"x" * 1_000_000
    assert slept == [pytest.approx(0.1)]
    assert store.get("a") is not None and slept[-1] == pytest.approx(1.0)  # the whole MB in the slow slice
    assert store.get("missing") is None and len(slept) == 2
    assert store.get_many(["a", "missing"])[0] is not None and len(slept) == 3
    assert store.contains("a") and store.namespace == inner.namespace  # everything else passes through


@pytest.mark.redis
def test_proxy_shapes_a_real_redis_get_and_keeps_the_data(redis_server):
    payload = os.urandom(4 * 1024 * 1024)
    direct = redis_server.client(socket_timeout=10)
    direct.set("throttled:blob", payload)
    with ThrottledProxy(redis_server.port, gbps=[0.1], slice_s=1.0) as proxy:
        client = direct.__class__(host=proxy.host, port=proxy.port, socket_timeout=10)
        assert client.ping()
        proxy.restart_trace()
        t = time.perf_counter()
        got = client.get("throttled:blob")
        slow_s = time.perf_counter() - t
        client.close()
    assert got == payload
    # 4 MiB at 0.1 Gbit/s is 0.34 s; pacing cannot be faster (less 5 ms of burst credit)
    assert 0.3 < slow_s < 2.0, slow_s
    with ThrottledProxy(redis_server.port, gbps=[20.0], slice_s=1.0) as proxy:
        client = direct.__class__(host=proxy.host, port=proxy.port, socket_timeout=10)
        client.set("throttled:up", payload)  # the upload direction passes (and is shaped) too
        t = time.perf_counter()
        got = client.get("throttled:up")
        fast_s = time.perf_counter() - t
        client.close()
    assert got == payload and fast_s < slow_s
    direct.delete("throttled:blob", "throttled:up")
    direct.close()


@pytest.mark.redis
def test_proxy_follows_a_changing_trace(redis_server):
    """Slices of 0.05 then 0.5 Gbit/s: 1 MiB takes ~0.17 s from the slow slice, ~0.017 s from the fast one."""
    payload = os.urandom(1024 * 1024)
    direct = redis_server.client(socket_timeout=10)
    direct.set("throttled:mb", payload)
    with ThrottledProxy(redis_server.port, gbps=[0.05, 0.5], slice_s=0.5, shape_upload=False) as proxy:
        client = direct.__class__(host=proxy.host, port=proxy.port, socket_timeout=10)
        client.ping()
        proxy.restart_trace()
        t = time.perf_counter()
        assert client.get("throttled:mb") == payload
        slow_s = time.perf_counter() - t
        assert slow_s > 0.15  # paced at 6.25 MB/s
        time.sleep(max(0.0, 0.55 - (time.perf_counter() - t)))  # into the fast slice
        t = time.perf_counter()
        assert client.get("throttled:mb") == payload
        fast_s = time.perf_counter() - t
        client.close()
    assert fast_s < slow_s
    direct.delete("throttled:mb")
    direct.close()


def test_proxy_closes_cleanly_when_upstream_is_down():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens here once closed
    with ThrottledProxy(dead_port, gbps=[1.0]) as proxy, socket.create_connection((proxy.host, proxy.port), timeout=5) as c:
        c.settimeout(5)
        assert c.recv(1) == b""  # the proxy hangs up instead of hanging
