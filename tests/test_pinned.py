"""The pinned-memory slab allocator (``cachegen_core/pinned.py``), its logic on plain memory: CPU-only torch cannot
pin, so the slabs are injected. Reuse, first fit in address order, merging of free neighbours, a full arena
falling back (None), blocks held by a pending copy, and many threads at once."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch

from cachegen_core import pinned
from cachegen_core.pinned import HostArena, hold_until, parse_bytes, settle

PAGE = 4096


def plain(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def arena(pages: int = 16, slab_pages: int = 16) -> HostArena:
    return HostArena(pages * PAGE, slab_bytes=slab_pages * PAGE, allocate=plain)


def addr(block) -> int:
    return block.__array_interface__["data"][0]


class FakeEvent:
    """A CUDA event stand-in: done once ``finish`` or ``synchronize`` is called."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def test_a_freed_block_is_reused_and_sizes_round_up_to_pages():
    a = arena()
    b = a.alloc(100)
    assert b.dtype == np.uint8 and b.shape == (100,)
    first = addr(b)
    assert a.free_bytes == 15 * PAGE  # 100 bytes take one page
    del b
    assert a.free_bytes == 16 * PAGE
    assert addr(a.alloc(PAGE)) == first


def test_first_fit_in_address_order_and_free_neighbours_merge():
    a = arena()
    x, y, z = a.alloc(PAGE), a.alloc(PAGE), a.alloc(PAGE)
    hole = addr(y)
    del y
    two = a.alloc(2 * PAGE)  # does not fit the one-page hole: after z
    assert addr(two) == addr(z) + PAGE
    one = a.alloc(PAGE)  # fits the hole
    assert addr(one) == hole
    start = addr(x)
    del x, one  # two neighbouring free pages, merged into one run
    merged = a.alloc(2 * PAGE)
    assert addr(merged) == start
    del merged, z, two
    assert a.free_bytes == 16 * PAGE and a.alloc(16 * PAGE) is not None  # everything merged back into one run


def test_a_full_arena_returns_none_and_counts_the_fallback():
    a = arena(pages=4, slab_pages=4)
    held = [a.alloc(PAGE) for _ in range(4)]
    assert all(h is not None for h in held)
    assert a.alloc(1) is None and a.fallbacks == 1
    assert a.alloc(5 * PAGE) is None  # bigger than the limit
    del held[0]
    assert a.alloc(PAGE) is not None


def test_a_reserve_leaves_room_for_others():
    a = arena(pages=8, slab_pages=4)
    assert a.alloc(5 * PAGE, reserve=4 * PAGE) is None  # would leave 3 pages of the 8
    held = a.alloc(4 * PAGE, reserve=4 * PAGE)
    assert held is not None and a.alloc(PAGE, reserve=4 * PAGE) is None and a.alloc(PAGE) is not None


def test_slabs_are_made_on_demand_and_a_big_block_gets_a_slab_of_its_own():
    a = arena(pages=16, slab_pages=4)
    assert a.pinned_bytes == 0
    small = a.alloc(PAGE)
    assert a.pinned_bytes == 4 * PAGE
    big = a.alloc(6 * PAGE)
    assert big is not None and a.pinned_bytes == 10 * PAGE
    assert a.alloc(7 * PAGE) is None  # 17 pages would pass the limit
    del small, big


def test_a_slab_that_cannot_be_pinned_ends_growth_without_an_error():
    def refuse(n: int) -> torch.Tensor:
        raise RuntimeError("cudaHostAlloc: out of memory")

    a = HostArena(1 << 20, slab_bytes=PAGE, allocate=refuse)
    assert a.alloc(10) is None and a.limit_bytes == 0


def test_a_block_is_not_reused_while_a_copy_holds_it():
    a = arena(pages=2, slab_pages=2)
    b = a.alloc(PAGE)
    first = addr(b)
    copy = FakeEvent()
    hold_until(b[10:20], copy)  # recorded through a view, on its block
    del b
    other = a.alloc(PAGE)
    assert addr(other) != first  # the held page was skipped
    copy.done = True
    assert addr(a.alloc(PAGE)) == first


def test_a_full_arena_waits_for_a_pending_copy_rather_than_falling_back():
    a = arena(pages=1, slab_pages=1)
    b = a.alloc(PAGE)
    copy = FakeEvent()
    hold_until(memoryview(b), copy)
    del b
    again = a.alloc(PAGE)
    assert again is not None and copy.waited == 1 and a.fallbacks == 0


def test_settle_waits_for_the_copies_of_a_block_before_it_is_written_again():
    a = arena()
    b = a.alloc(PAGE)
    events = [FakeEvent(), FakeEvent()]
    for e in events:
        hold_until(b, e)
    settle(b)
    assert all(e.done for e in events)
    settle(np.zeros(3))  # memory of no block: nothing to wait for


def test_tensor_maps_a_view_to_the_same_bytes_and_refuses_other_memory():
    a = arena()
    b = a.alloc(3 * PAGE)
    t = a.tensor(memoryview(b)[PAGE : PAGE + 10])
    assert t is not None and t.numel() == 10
    t.copy_(torch.arange(10, dtype=torch.uint8))
    assert list(b[PAGE : PAGE + 10]) == list(range(10))
    assert a.tensor(b"not pinned") is None and a.tensor(bytearray(10)) is None and a.tensor(object()) is None


def test_threads_never_get_overlapping_blocks_and_everything_comes_back():
    a = HostArena(64 * PAGE, slab_bytes=16 * PAGE, allocate=plain)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        for _ in range(300):
            if held and rng.random() < 0.5:
                mark, block = held.pop(rng.randrange(len(held)))
                if not (block == mark).all():
                    errors.append("a block was overwritten by another thread's")
                continue
            block = a.alloc(rng.randrange(1, 3 * PAGE))
            if block is not None:
                mark = rng.randrange(256)
                block[:] = mark
                held.append((mark, block))
        for mark, block in held:
            if not (block == mark).all():
                errors.append("a block was overwritten by another thread's")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert a.free_bytes == a.pinned_bytes > 0


def test_limits_from_the_environment(monkeypatch):
    assert parse_bytes("16G") == 16 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("4096") == 4096
    monkeypatch.setenv("CACHEGEN_PINNED_BYTES", "2g")
    assert pinned.default_limit() == 2 << 30
    monkeypatch.setenv("CACHEGEN_PINNED_BYTES", "0")
    assert pinned.default_limit() == 0
    monkeypatch.setenv("CACHEGEN_PINNED_BYTES", "lots")
    with pytest.raises(ValueError, match="CACHEGEN_PINNED_BYTES='lots' is not a size"):
        pinned.default_limit()
    monkeypatch.delenv("CACHEGEN_PINNED_BYTES")
    assert 0 < pinned.default_limit() <= pinned.DEFAULT_LIMIT


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only torch")
def test_no_arena_without_a_gpu():
    assert pinned.host_arena() is None and pinned.pinned_tensor(b"x") is None


def test_parallel_copy_copies_every_byte(monkeypatch):
    monkeypatch.setattr(pinned, "PARALLEL_COPY_BYTES", 10_000)
    src = np.frombuffer(np.random.default_rng(0).bytes(123_457), np.uint8)
    dst = np.zeros_like(src)
    pinned.parallel_copy(dst, src, threads=4)
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError):
        pinned.parallel_copy(dst[:-1], src)
