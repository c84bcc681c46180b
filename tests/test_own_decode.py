"""The decode attention kernel (``engine/model/own_decode.py``, ``decode_kernel.py``): every decoding request's
attention over its own KV buffer in one launch a layer, its new key and value written by it.

On a GPU it replaces a call per request; here it runs in Triton's interpreter on CPU tensors (``tests/conftest.py``
sets ``TRITON_INTERPRET=1``; the tests add the CPU to the kernel's devices). Against attention in float64: its output
rows and log-sum-exp, what it writes (the new token, nowhere else); in the packed forward and the scheduler: each
request's logits and answer as alone, every family served; a launch that fails is said once and the forward goes on
a call per request. The kernel compiles for an H100 in ``tests/test_triton_compile.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from cachegen_core.coders.triton_decoder import interpreting
from cachegen_core.engine.model import hf, own_decode, packed
from cachegen_core.kv import KVCache
from cachegen_core.stores.memory import MemoryStore
from cachegen_core.engine import KVEngine
from cachegen_core.testing import make_family_model, make_tiny_tokenizer, words
from tests import test_packed


NOT_INTERPRETED = "the kernel runs on CPU tensors in Triton's interpreter only (a GPU: tests/test_gpu_paths.py)"


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """The kernel runs on CPU tensors (the interpreter); the sizes of its launches are recorded."""
    if not interpreting():
        pytest.skip(NOT_INTERPRETED)
    monkeypatch.setattr(own_decode, "DEVICES", {"cuda", "cpu"})
    return record_launches(monkeypatch)


def record_launches(monkeypatch) -> list[int]:
    """The kernel's launches from now on (how many requests each read), none failed before."""
    monkeypatch.setattr(own_decode, "FAILED", {})
    launches: list[int] = []
    attend = own_decode.attend
    monkeypatch.setattr(own_decode, "attend", lambda *a, **k: launches.append(len(a[3])) or attend(*a, **k))
    return launches


@pytest.mark.skipif(not interpreting(), reason=NOT_INTERPRETED)
@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "dtype"), [(2, 3, 24, torch.float32), (1, 4, 16, torch.bfloat16), (3, 1, 32, torch.float32)]
)
def test_the_kernel_attends_each_request_over_its_own_buffer_and_writes_only_its_new_token(kv_heads, group, head_dim, dtype):
    torch.manual_seed(0)
    layers, rows, heads = 3, 6, kv_heads * group
    parts = []  # buffers of other sizes, one a view past a prefix (as the request holding a shared prefix reads its own)
    for row, (capacity, filled, offset) in zip((1, 3, 4, 5), ((10, 0, 0), (80, 33, 0), (90, 65, 7), (50, 49, 0))):
        whole = KVCache(
            torch.randn(layers, kv_heads, capacity + offset, head_dim, dtype=dtype),
            torch.randn(layers, kv_heads, capacity + offset, head_dim, dtype=dtype),
        )
        parts.append(SimpleNamespace(start=row, stop=row + 1, tokens=1, own=whole.slice(offset, capacity + offset), filled=filled))
    query = torch.randn(1, rows, heads, head_dim, dtype=dtype).transpose(1, 2)  # as a model's projection gives them
    key, value = (torch.randn(1, rows, kv_heads, head_dim, dtype=dtype).transpose(1, 2) for _ in range(2))
    before = [(p.own.keys.clone(), p.own.values.clone()) for p in parts]
    assert own_decode.Batch.fits(parts, dtype, torch.device("cpu"))
    batch = own_decode.Batch(parts, [p.start for p in parts], torch.device("cpu"))
    out, lse = torch.zeros(1, rows, heads, head_dim, dtype=dtype), torch.zeros(rows, heads)
    layer, window, scale = 1, 20, head_dim**-0.5
    assert own_decode.attend(query, key, value, batch, layer, window, scale, out, lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for p, (keys, values) in zip(parts, before):
        first = max(0, p.filled - window + 1)  # a sliding window of 20: keys after position - 20
        k = torch.cat([keys[layer, :, first : p.filled], key[0, :, p.start, None]], 1).double()
        v = torch.cat([values[layer, :, first : p.filled], value[0, :, p.start, None]], 1).double()
        q = query[0, :, p.start].double().view(kv_heads, group, head_dim)
        scores = q @ k.transpose(1, 2) * scale
        torch.testing.assert_close(out[0, p.start].double().view(kv_heads, group, head_dim), torch.softmax(scores, -1) @ v, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[p.start].double().view(kv_heads, group), torch.logsumexp(scores, -1), atol=tol, rtol=tol)
        keys[layer, :, p.filled], values[layer, :, p.filled] = key[0, :, p.start], value[0, :, p.start]
        assert torch.equal(p.own.keys, keys) and torch.equal(p.own.values, values)  # the new token, and nothing else
    assert out[0, [0, 2]].abs().sum() == 0 and lse[[0, 2]].abs().sum() == 0  # rows of no part untouched


def test_a_buffer_the_kernel_could_write_past_is_not_given_to_it():
    full = KVCache(torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16))
    part = SimpleNamespace(start=0, stop=1, tokens=1, own=full, filled=8)  # no room for the new token
    assert not own_decode.Batch.fits([part], torch.float32, torch.device("cpu"))
    part.filled = 7
    assert own_decode.Batch.fits([part], torch.float32, torch.device("cpu"))
    assert not own_decode.Batch.fits([part], torch.bfloat16, torch.device("cpu"))  # not the keys' dtype
    strided = KVCache(torch.zeros(2, 2, 16, 16)[:, :, ::2], torch.zeros(2, 2, 16, 16)[:, :, ::2])  # tokens not contiguous
    assert not own_decode.Batch.fits([SimpleNamespace(start=0, stop=1, tokens=1, own=strided, filled=3)], torch.float32, torch.device("cpu"))


def _decode_steps(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32, tol: float = test_packed.TOL) -> None:
    """Two requests on a shared prefix and two on their own KV: their prompts packed, then two decode steps of all four
    (the second reads what the kernel wrote in the first); each request's logits against the model's alone."""
    model = make_family_model(name).to(device, dtype)
    windows = hf.cache_layers(model)
    layers, heads, dim = hf.kv_geometry(model.config)

    def buffer(tokens: int) -> KVCache:  # NaN: a read of an unwritten slot shows
        return KVCache(*(torch.full((layers, heads, tokens, dim), float("nan"), dtype=dtype, device=device) for _ in range(2)))

    def alone(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids], device=device)).logits[0, -1].float()

    def step(ids: list[int], positions: list[int], parts: list[packed.Part], keep: list[int]) -> torch.Tensor:
        on = {"device": device}
        return packed.forward(model, torch.tensor(ids, **on), torch.tensor(positions, **on), packed.Plan(parts, windows), torch.tensor(keep, **on))

    prefix = test_packed._ids(1, 70)
    prompts = [prefix + test_packed._ids(2, 13), prefix + test_packed._ids(3, 29), test_packed._ids(4, 55), test_packed._ids(8, 61)]
    shared = buffer(70)
    step(prefix, list(range(70)), [packed.Part(0, 70, shared, 0)], [69])
    own = [buffer(80) for _ in prompts]
    tails = [p[70:] for p in prompts[:2]] + prompts[2:]
    starts = [0, 13, 42, 97]
    parts = [packed.Part(s, s + len(t), o, 0, 70 if i < 2 else 0, shared if i < 2 else None) for i, (s, t, o) in enumerate(zip(starts, tails, own))]
    positions = [*range(70, 83), *range(70, 99), *range(0, 55), *range(0, 61)]
    logits = step(sum(tails, []), positions, parts, [12, 41, 96, 157])
    for _ in range(2):
        nxt = [int(row.argmax()) for row in logits]
        prompts = [p + [t] for p, t in zip(prompts, nxt)]
        filled = [len(p) - 1 - (70 if i < 2 else 0) for i, p in enumerate(prompts)]
        parts = [packed.Part(i, i + 1, own[i], filled[i], 70 if i < 2 else 0, shared if i < 2 else None) for i in range(4)]
        logits = step(nxt, [len(p) - 1 for p in prompts], parts, [0, 1, 2, 3])
        for row, full in zip(logits, prompts):
            torch.testing.assert_close(row, alone(full), atol=tol, rtol=tol)


@pytest.mark.parametrize("name", test_packed.SERVED)
def test_decoding_requests_read_by_one_launch_a_layer_give_each_requests_logits_alone(name, kernel_on_cpu):
    _decode_steps(name)
    softcapped = getattr(test_packed._model(name).config, "attn_logit_softcapping", None)
    assert kernel_on_cpu == ([] if softcapped else [2] * 8)  # 2 decode steps x 2 layers: the shared group's, the others'


def test_a_launch_that_fails_is_said_once_and_the_requests_are_read_a_call_each(kernel_on_cpu, monkeypatch, caplog):
    class Fails:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel image for this device")

            return launch

    monkeypatch.setattr(own_decode, "_kernel", Fails)
    with caplog.at_level(logging.WARNING, logger="cachegen_core.engine"):
        _decode_steps("llama")
    assert "no kernel image" in own_decode.FAILED["cpu"]
    assert len([r for r in caplog.records if "decode attention kernel failed" in r.message]) == 1
    assert kernel_on_cpu == [2]  # tried once, then never on this device


def test_requests_batched_by_the_scheduler_answer_as_alone_with_the_kernel(tiny_llama, tiny_tokenizer, kernel_on_cpu):
    def engine():
        return KVEngine(tiny_llama, tiny_tokenizer, store=MemoryStore(), chunk_tokens=32, partial_step=8, level="lossless", background=False)

    context = words(40, 100)
    prompts = [context + " " + words(50 + q, 6) for q in range(3)] + [words(60 + q, 45) for q in range(3)]
    alone = [engine().generate(p, max_new_tokens=10)[0] for p in prompts]
    launches = len(kernel_on_cpu)
    eng = engine()
    eng.generate(context, max_new_tokens=1)  # the shared context stored: the others read it
    answers = eng.generate_many(prompts, max_new_tokens=10)
    assert [text for text, _ in answers] == alone
    assert len(kernel_on_cpu) > launches and max(kernel_on_cpu) >= 3  # decode steps of several requests in one launch


def test_cachegen_decode_kernel_0_reads_each_request_a_call(kernel_on_cpu, monkeypatch):
    monkeypatch.setenv("CACHEGEN_DECODE_KERNEL", "0")
    own_decode.enabled.cache_clear()
    try:
        _decode_steps("llama")
        assert kernel_on_cpu == []  # never launched: the same logits by a call per request
        monkeypatch.setenv("CACHEGEN_DECODE_KERNEL", "fast")
        own_decode.enabled.cache_clear()
        with pytest.raises(ValueError, match="CACHEGEN_DECODE_KERNEL='fast'"):  # when an engine is built, not in a step
            KVEngine(make_family_model("llama"), make_tiny_tokenizer(), store=MemoryStore(), background=False)
    finally:
        monkeypatch.delenv("CACHEGEN_DECODE_KERNEL")
        own_decode.enabled.cache_clear()
