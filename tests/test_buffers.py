"""Prompt buffers are reused across requests only when nothing else can still read them."""

import torch

from cachegen_core.engine import KVEngine
from cachegen_core.engine.serving.buffers import BufferPool
from cachegen_core.kv import KVCache
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words
from tests.test_engine import plain_greedy


def test_a_given_back_buffer_serves_the_next_request_that_fits():
    pool = BufferPool(2, 3, 8, torch.float32, torch.device("cpu"))
    a = pool.take(100)
    assert a.shape == (2, 3, 100, 8) and pool.kept_bytes == 0
    pool.give(a)
    pool.give(a)  # twice: kept once
    assert pool.kept_bytes == 2 * 2 * 3 * 100 * 8 * 4
    b = pool.take(60)  # fits in the kept one: its first 60 tokens
    assert b.shape == (2, 3, 60, 8) and b.keys.data_ptr() == a.keys.data_ptr() and pool.kept_bytes == 0
    c = pool.take(60)  # nothing kept: a new one
    assert c.keys.data_ptr() != a.keys.data_ptr()
    pool.give(b)
    assert pool.take(101).keys.data_ptr() != a.keys.data_ptr()  # too small for 101 tokens: a new one, the kept one stays
    assert pool.kept_bytes == 2 * 2 * 3 * 100 * 8 * 4


def test_only_the_largest_buffers_are_kept_and_foreign_ones_never():
    pool = BufferPool(1, 1, 4, torch.float32, torch.device("cpu"), keep=2)
    bufs = [pool.take(n) for n in (10, 30, 20)]
    for b in bufs:
        pool.give(b)
    assert sorted(b.num_tokens for b in pool._spare) == [20, 30]
    assert pool.take(15).keys.data_ptr() == bufs[2].keys.data_ptr()  # the smallest that fits, among several
    assert [b.num_tokens for b in pool._spare] == [30]
    pool.give(bufs[2])
    pool.give(KVCache(torch.zeros(1, 1, 50, 4)[:, :, 5:], torch.zeros(1, 1, 50, 4)[:, :, 5:]))  # not the first tokens
    pool.give(KVCache(torch.zeros(1, 1, 50, 4, dtype=torch.float16), torch.zeros(1, 1, 50, 4, dtype=torch.float16)))
    pool.give(KVCache(torch.zeros(2, 1, 50, 4)[:1], torch.zeros(2, 1, 50, 4)[:1]))  # another geometry's memory
    assert sorted(b.num_tokens for b in pool._spare) == [20, 30]


def test_warm_requests_reuse_one_buffer_cold_ones_leave_theirs_to_the_writer(tiny_llama, tiny_tokenizer):
    e = KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=64, level="lossless", background=True)
    prompt = words(3, 2 * 64 + 5)
    want = plain_greedy(tiny_llama, tiny_tokenizer, prompt, 4)
    text, info = e.generate(prompt, max_new_tokens=4)
    assert text == want and info.chunks_queued > 0 and e.buffers.kept_bytes == 0  # the writer may still read it
    e.flush()
    ptrs = []
    for _ in range(3):
        text, info = e.generate(prompt, max_new_tokens=4)
        assert text == want and info.cached_tokens == 128 and info.chunks_queued == 0
        ptrs.append(e.buffers._spare[0].keys.data_ptr())
    assert len(set(ptrs)) == 1  # the same memory every time
    other = words(9, 30)  # a shorter prompt in the same memory: what the last one left there is never read
    assert e.generate(other, max_new_tokens=4)[0] == plain_greedy(tiny_llama, tiny_tokenizer, other, 4)
