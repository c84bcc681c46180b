"""The emulated link of the benchmarks (``benchmarks/emulated_link.py``): reads released at the link's rate on a
fake clock, concurrent reads sharing the link, fresh copies, a remote store to the engine, whose answers stay the
no-cache answers."""

from __future__ import annotations

import pytest

from benchmarks.emulated_link import LinkStore
from cachegen_core.engine import KVEngine
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words


class FakeClock:
    """A clock that moves only by what is slept (``advance``), or not at all: reads asked at one instant."""

    def __init__(self, advance: bool = True) -> None:
        self.t, self.advance = 0.0, advance
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s if self.advance else 0.0


def test_a_read_takes_its_bytes_over_the_link_rate_plus_the_round_trip():
    clock = FakeClock()
    store = LinkStore(MemoryStore(pinned=False), gbps=8.0, rtt_s=0.001, clock=clock, sleep=clock.sleep)  # 1 GB/s
    store.put("k", b"x" * 1_000_000)
    value = store.get("k")
    assert value == b"x" * 1_000_000 and value is not store.store.get("k")  # received: a fresh copy
    assert clock.slept == [pytest.approx(0.001 + 0.001)]  # 1 MB at 1 GB/s, and the round trip
    assert store.get("absent") is None and clock.slept[-1] == pytest.approx(0.001)  # a miss costs the round trip


def test_reads_queue_on_one_link():
    clock = FakeClock(advance=False)
    store = LinkStore(MemoryStore(pinned=False), gbps=8.0, clock=clock, sleep=clock.sleep)
    store.put_many({"a": b"a" * 500_000, "b": b"b" * 500_000})
    store.get("a")
    store.get("b")  # asked at the same instant: it arrives after a's bytes
    assert clock.slept == [pytest.approx(0.0005), pytest.approx(0.001)]
    assert store.get_many(["a", "b"]) == [b"a" * 500_000, b"b" * 500_000]
    assert clock.slept[-1] == pytest.approx(0.002)  # 1 MB more, behind the 1 MB already queued
    assert store.bytes_sent == 2_000_000


def test_read_into_lands_in_the_buffer_when_it_fits():
    clock = FakeClock()
    store = LinkStore(MemoryStore(pinned=False), gbps=8.0, clock=clock, sleep=clock.sleep)
    store.put("k", bytes(range(256)) * 10)
    buf = bytearray(4000)
    view = store.read_into("k", buf)
    assert view.obj is buf and bytes(view) == bytes(range(256)) * 10
    assert store.read_into("k", bytearray(10)) == bytes(range(256)) * 10
    assert store.read_into("absent", buf) is None
    assert not store.local and not store.same_host and not store.shares_values and not store.views


def test_an_engine_over_the_link_streams_remote_chunks_and_answers_as_before(tiny_llama, tiny_tokenizer):
    store = LinkStore(MemoryStore(), gbps=100.0)
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=32, level="lossless", background=False, allow_text=False)
    prompt = words(80, 3 * 32 + 3)
    cold, _ = e.generate(prompt, max_new_tokens=6)
    sent = store.bytes_sent
    warm, info = e.generate(prompt, max_new_tokens=6)
    assert info.levels == ["lossless"] * 3 and warm == cold and store.bytes_sent - sent >= info.bytes_fetched > 0
