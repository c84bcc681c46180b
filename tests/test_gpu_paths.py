"""Pinned memory and the copies beside it on a real GPU (issue 46, parts 2-4): skipped without CUDA (CPU-only torch
cannot pin), run by ``benchmarks/gpu/run.sh``. The same logic on plain memory is tested everywhere
(``test_pinned.py``, ``test_pinned_paths.py``, ``test_raw.py``, ``test_writer.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen_core.codec.raw import RawCodec
from cachegen_core.engine import KVEngine
from cachegen_core.errors import CacheGenFormatError
from cachegen_core.kv import KVCache, upload
from cachegen_core.pinned import HostArena, HostBlock, host_arena
from cachegen_core.stores.disk import DiskCacheStore
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.testing import make_tiny_llama, words

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory)")
CHUNK = 32


def test_arena_blocks_are_pinned_and_go_to_the_device_as_they_are():
    arena = HostArena(64 << 20, slab_bytes=32 << 20)
    block = arena.alloc(5 << 20)
    block[:] = np.arange(block.size, dtype=np.uint64).astype(np.uint8)
    t = arena.tensor(block)
    assert t is not None and t.is_pinned()
    (dev,) = upload(block, device="cuda")
    assert torch.equal(dev.cpu(), torch.from_numpy(np.asarray(block)))
    assert host_arena() is not None


def test_raw_checks_beside_the_copy_on_a_gpu(tiny_kv):
    rc = RawCodec("fp")
    kv = tiny_kv.slice(0, 20)
    blob = rc.encode(kv, "lossless")
    arena = host_arena()
    block = arena.alloc(len(blob))
    block[:] = np.frombuffer(blob, np.uint8)
    out = KVCache(torch.zeros(kv.shape, device="cuda"), torch.zeros(kv.shape, device="cuda"))
    rc.decode(rc.check(block, "lossless", payloads=False), "lossless", out=out)  # from pinned memory, checked beside
    assert torch.equal(out.keys.cpu(), kv.keys) and torch.equal(out.values.cpu(), kv.values)
    block[-3] ^= 0xFF
    fresh = KVCache(torch.zeros(kv.shape, device="cuda"), torch.zeros(kv.shape, device="cuda"))
    with pytest.raises(CacheGenFormatError, match="checksum"):
        rc.decode(rc.check(block, "lossless", payloads=False), "lossless", out=fresh)
    assert not fresh.keys.any() and not fresh.values.any()


def test_a_chunk_staged_from_the_gpu_is_the_encoded_blob(tiny_kv):
    rc = RawCodec("fp")
    on_gpu = KVCache(tiny_kv.keys.cuda().bfloat16(), tiny_kv.values.cuda().bfloat16()).slice(5, 60)
    staged = rc.stage(on_gpu, "lossless", host_arena().alloc)
    assert isinstance(staged.block, HostBlock)
    assert bytes(staged.finish()) == rc.encode(on_gpu, "lossless")


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_an_engine_on_the_gpu_stores_without_waiting_and_answers_as_without_a_cache(kind, tiny_tokenizer, tmp_path):
    model = make_tiny_llama().cuda()
    store = MemoryStore() if kind == "memory" else DiskCacheStore(tmp_path / "kv")
    e = KVEngine(model, tiny_tokenizer, store=store, chunk_tokens=CHUNK, level="lossless", store_options=["lossless", 1],
                 background=True, allow_text=False)  # fmt: skip
    assert e.reader.arena is not None  # pinned read buffers, raw checksums beside the copy
    prompt = words(90, 4 * CHUNK + 3)
    cold, info = e.generate(prompt, max_new_tokens=8)
    assert info.chunks_queued == 4
    assert e.flush(timeout=120)
    warm, info = e.generate(prompt, max_new_tokens=8)
    assert info.levels == ["lossless"] * 4 and not info.errors and warm == cold
    if kind == "memory":
        assert store.views and isinstance(store.view(next(k for k in store.keys() if k.endswith("-Llossless"))), np.ndarray)
    e.close()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_requests_sharing_a_prefix_decode_on_the_gpu_by_its_fused_kernel_as_each_alone(dtype, tol, monkeypatch):
    """The packed forward on CUDA without the decode kernel: the shared prefix's attention and the decoding tails' by
    torch's memory-efficient kernel (with its log-sum-exp), never falling back by hand; each request's logits as the
    model gives it alone."""
    from cachegen_core.engine.model import lse, own_decode
    from tests.test_own_decode import _decode_steps

    monkeypatch.setattr(lse, "UNFUSED", {})
    monkeypatch.setattr(own_decode, "DEVICES", set())
    _decode_steps("llama", "cuda", dtype, tol)
    assert not lse.UNFUSED  # the fused kernel ran: no float32 copies of the prefix by hand


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_decoding_requests_on_the_gpu_are_read_by_one_kernel_launch_a_layer_as_each_alone(dtype, tol, monkeypatch):
    """The decode attention kernel (``own_decode.py``) compiled and run on the GPU: a packed forward's decoding requests,
    on a shared prefix and on their own KV, each with the logits the model gives it alone; the kernel launched, never
    failed."""
    from cachegen_core.engine.model import own_decode
    from tests.test_own_decode import _decode_steps, record_launches

    launches = record_launches(monkeypatch)
    _decode_steps("llama", "cuda", dtype, tol)
    assert launches == [2] * 8 and not own_decode.FAILED
