"""Where a GPU is, blobs live in pinned memory from the store to the copy (``pinned.py``): the memory store holds big
values in blocks, the reader reads the disk store's blobs into pinned buffers and checks raw payloads beside the
copy. CPU-only torch cannot pin, so these tests inject an arena of plain memory: the logic is the GPU path's, and
every answer stays the no-cache answer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen_core.engine import KVEngine
from cachegen_core.keys.chunks import blob_key
from cachegen_core.pinned import HostArena, HostBlock
from cachegen_core.stores import memory
from cachegen_core.stores.disk import DiskCacheStore
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import words

CHUNK = 32
PAGE = 4096


@pytest.fixture
def arena(monkeypatch) -> HostArena:
    monkeypatch.setattr(memory, "PIN_MIN_BYTES", 1000)  # the tiny model's chunks are small
    return HostArena(64 << 20, slab_bytes=16 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8))


def test_the_memory_store_holds_big_values_in_blocks_and_gives_them_back(arena):
    store = MemoryStore(pinned=arena)
    assert store.views
    big, small = bytes(range(256)) * 20, b"manifest"
    store.put_many({"c-Lraw": big, "c-M": small})
    held = store.view("c-Lraw")
    assert isinstance(held, HostBlock) and held.tobytes() == big
    assert store.get("c-Lraw") == big and type(store.get("c-Lraw")) is bytes  # get keeps its bytes contract
    assert store.view("c-M") is store.get("c-M") == small and store.get_many(["c-Lraw", "c-M"]) == [big, small]
    assert store.total_bytes == len(big) + len(small)
    block = arena.alloc(len(big))
    block[:] = np.frombuffer(big, np.uint8)
    store.put("d-Lraw", memoryview(block)[100:])  # bytes in a block of its arena (a chunk staged by a GPU): not copied
    assert np.shares_memory(store.view("d-Lraw"), block) and store.get("d-Lraw") == big[100:]
    del block
    store.delete("c-Lraw")
    del held
    assert arena.free_bytes == arena.pinned_bytes - 2 * PAGE  # c's block is free again, d's (5120 bytes: 2 pages) held
    store.close()


def test_values_the_arena_cannot_hold_are_plain_bytes(monkeypatch):
    monkeypatch.setattr(memory, "PIN_MIN_BYTES", 1000)
    full = HostArena(2 * PAGE, slab_bytes=2 * PAGE, allocate=lambda n: torch.empty(n, dtype=torch.uint8))  # room for one value and the reserve
    store = MemoryStore(pinned=full)
    store.put("a-Lraw", b"a" * 3000)
    store.put("b-Lraw", b"b" * 3000)
    assert isinstance(store.view("a-Lraw"), HostBlock) and type(store.view("b-Lraw")) is bytes
    assert store.get("b-Lraw") == b"b" * 3000 and full.fallbacks == 1
    bounded = MemoryStore(max_bytes=5000, pinned=full)
    bounded.put("x-L1", b"x" * 4000)
    bounded.put("y-L1", b"y" * 4000)  # evicts x
    assert bounded.get("x-L1") is None and bounded.get("y-L1") == b"y" * 4000


def test_a_store_that_reads_its_own_way_is_read_through_get(arena):
    class Counting(MemoryStore):
        def get(self, key):
            return super().get(key)

    assert not Counting(pinned=arena).views and not MemoryStore(pinned=False).views


def _plain_answer(model, tok, prompt: str, n: int) -> str:
    ids = torch.tensor([tok(prompt)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=2)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_a_warm_request_from_pinned_blocks_answers_as_without_a_cache(arena, tiny_llama, tiny_tokenizer):
    store = MemoryStore(pinned=arena)
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level="lossless", background=False)
    prompt = words(60, 3 * CHUNK + 5)
    cold, _ = e.generate(prompt, max_new_tokens=8)
    warm, info = e.generate(prompt, max_new_tokens=8)
    assert info.cached_tokens == 3 * CHUNK and set(info.levels) <= {"lossless", "text"} and "lossless" in info.levels
    assert warm == cold == _plain_answer(tiny_llama, tiny_tokenizer, prompt, 8)
    assert all(isinstance(blob, HostBlock) for blob, _ in e.reader._verified.values())  # fetched as held, no copy


@pytest.mark.parametrize("level", ["lossless", 1])
def test_disk_blobs_read_into_pinned_buffers_answer_as_without_a_cache(arena, level, tiny_llama, tiny_tokenizer, tmp_path):
    store = DiskCacheStore(tmp_path / "kv")
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level=level, store_options=[level],
                 background=False, allow_text=False)  # fmt: skip
    e.reader.use_device(torch.device("cpu"), arena=arena)  # a GPU's reader: pinned read buffers, any form read into them
    prompt = words(61, 3 * CHUNK + 5)
    e.generate(prompt, max_new_tokens=6)
    warm, info = e.generate(prompt, max_new_tokens=6)
    assert info.levels == [level] * 3 and not info.errors
    if level == "lossless":
        assert warm == _plain_answer(tiny_llama, tiny_tokenizer, prompt, 6)
    assert e.reader._read_buffers and all(isinstance(b, HostBlock) for b in e.reader._read_buffers)


def test_a_corrupted_raw_payload_is_caught_beside_the_copy_and_recomputed(arena, tiny_llama, tiny_tokenizer, tmp_path):
    store = DiskCacheStore(tmp_path / "kv")
    e = KVEngine(tiny_llama, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level="lossless", background=False,
                 allow_text=False)  # fmt: skip
    e.reader.use_device(torch.device("cpu"), arena=arena)
    prompt = words(62, 3 * CHUNK + 2)
    e.generate(prompt, max_new_tokens=4)
    key = blob_key(e.chunks(prompt)[1].key, "lossless")
    blob = bytearray(store.get(key))
    blob[-3] ^= 0xFF  # a payload byte: the header, table and lengths all still check
    store.put(key, bytes(blob))
    warm, info = e.generate(prompt, max_new_tokens=4)
    assert info.cached_tokens == CHUNK and "bad blob for chunk 1" in info.errors[0] and "checksum" in info.errors[0]
    assert warm == _plain_answer(tiny_llama, tiny_tokenizer, prompt, 4)
