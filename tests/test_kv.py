import pytest
import torch

from cachegen_core.hfcompat import cache_arg
from cachegen_core.kv import KVCache, KVShapeError, merge_heads, split_heads


def test_dynamic_cache_round_trip(tiny_llama, tiny_kv):
    assert tiny_kv.shape == (3, 2, 157, 16)  # GQA: 2 KV heads for 4 query heads
    cache = tiny_kv.to_dynamic_cache(tiny_llama.config)
    assert cache.get_seq_length() == 157
    back = KVCache.from_dynamic_cache(cache)
    assert torch.equal(back.keys, tiny_kv.keys) and torch.equal(back.values, tiny_kv.values)


def test_slice_and_concat(tiny_kv):
    parts = [tiny_kv.slice(0, 50), tiny_kv.slice(50, 51), tiny_kv.slice(51)]
    assert [p.num_tokens for p in parts] == [50, 1, 106]
    joined = KVCache.concat(parts)
    assert torch.equal(joined.keys, tiny_kv.keys) and torch.equal(joined.values, tiny_kv.values)


def test_generate_with_converted_cache_matches_plain(tiny_llama):
    torch.manual_seed(3)
    ids = torch.randint(3, 128, (1, 40))
    with torch.no_grad():
        plain = tiny_llama.generate(ids, max_new_tokens=8, do_sample=False)
        kv = KVCache.from_dynamic_cache(tiny_llama(ids[:, :-1], use_cache=True).past_key_values)
        cached = tiny_llama.generate(ids, **cache_arg(tiny_llama, kv.to_dynamic_cache(tiny_llama.config)), max_new_tokens=8, do_sample=False)
    assert torch.equal(plain, cached)


def test_shape_errors(tiny_llama, tiny_kv):
    with pytest.raises(KVShapeError, match="4-D"):
        KVCache(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(KVShapeError, match="differ in shape"):
        KVCache(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 3, 4))
    with pytest.raises(KVShapeError, match="layers"):
        KVCache(tiny_kv.keys[:2], tiny_kv.values[:2]).to_dynamic_cache(tiny_llama.config)
    with pytest.raises(KVShapeError, match="empty"):
        KVCache.concat([])
    with pytest.raises(KVShapeError, match="concatenate"):
        KVCache.concat([tiny_kv, tiny_kv.to(torch.float16)])


def test_merge_and_split_heads():
    x = torch.arange(2 * 3 * 5 * 4).reshape(2, 3, 5, 4)  # (layers, kv_heads, tokens, head_dim)
    m = merge_heads(x)
    assert m.shape == (2, 5, 12)
    assert m[1, 4, 2 * 4 + 3] == x[1, 2, 4, 3]  # channel = head * head_dim + dim
    assert torch.equal(split_heads(m, 3), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_empty_tensor_is_plain_writable_memory_that_outlives_its_mapping(dtype):
    import gc

    from cachegen_core.kv import HUGE_PAGE_MIN_BYTES, empty_tensor

    shape = (4, 2, HUGE_PAGE_MIN_BYTES // 128 + 3, 64)  # past the huge-page threshold
    t = empty_tensor(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).remainder(251).view(shape))
    view = t[1:3, :, 7:9]
    expected = view.clone()
    del t
    gc.collect()
    assert torch.equal(view, expected)  # the slice keeps the mapping alive
    small = empty_tensor((3, 5), dtype)
    assert small.shape == (3, 5) and small.dtype == dtype


def test_a_spare_buffer_is_reused_when_free_and_never_shared():
    from cachegen_core.kv import HUGE_PAGE_MIN_BYTES, SpareBuffer

    spare = SpareBuffer()
    big = (2, HUGE_PAGE_MIN_BYTES // 64, 8)
    with spare.take(big, torch.float32) as a:
        assert a.shape == big and a.dtype == torch.float32 and a.is_contiguous()
        a.fill_(1.0)
        with spare.take(big, torch.float32) as b:  # taken while the first is in use: another buffer
            assert b.data_ptr() != a.data_ptr()
        kept = b.data_ptr()  # given back first; the first one, no larger, is dropped
    with spare.take((3, 5), torch.float16) as c:  # smaller, another dtype: the start of the kept one
        assert c.shape == (3, 5) and c.dtype == torch.float16 and c.data_ptr() == kept
    with spare.take((2, HUGE_PAGE_MIN_BYTES // 32, 8), torch.float32) as d:  # larger than any kept: a new one
        assert d.data_ptr() != kept
    with spare.take(big, torch.float32) as e:  # the larger one is kept from now on
        assert e.data_ptr() == d.data_ptr()


def test_host_ready_waits_for_a_to_host_copy_once_and_forgets_it():
    """``to_host`` marks its pinned copy with the CUDA event the copy ends with; ``host_ready`` waits on it once.
    On a GPU the marks were a dict keyed by tensors, whose lookup compared tensors with ``==`` and raised for
    every chunk stored from a GPU (found on an H100, 2026-11-28); an event's stand-in records the waits here."""
    from cachegen_core.kv import _COPY_EVENT, host_ready, to_host

    class Event:
        waits = 0

        def synchronize(self) -> None:
            Event.waits += 1

    kv = KVCache(torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4))
    assert to_host(kv) is kv  # host memory already: no copy, no mark
    setattr(kv.keys, _COPY_EVENT, Event())
    assert host_ready(kv) is kv and Event.waits == 1
    assert host_ready(kv) is kv and Event.waits == 1  # waited for once, then forgotten
