"""The packed forward (``engine/model/packed.py``): many requests' new tokens in one forward, each attending to its own
KV and to a prefix shared with others, give the logits the model gives each request alone (every served family).

Floats are compared within a tolerance: the packed forward multiplies matrices of another shape (all the requests'
tokens at once) and combines the shared prefix's attention with the tail's by their log-sum-exp, which reorders sums.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cachegen_core.engine.model import hf, lse, packed
from cachegen_core.kv import KVCache
from cachegen_core.testing import FAMILIES, make_family_model

SERVED = [name for name in FAMILIES if name != "qwen3-next"]
TOL = 2e-4  # float32 logits of a 2-layer model along two orders of summation


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return make_family_model(name)


def _buffer(model, tokens: int) -> KVCache:
    layers, heads, dim = hf.kv_geometry(model.config)
    shape = (layers, heads, tokens, dim)
    return KVCache(torch.full(shape, float("nan")), torch.full(shape, float("nan")))  # NaN: a read of an unwritten slot shows


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", SERVED)
def test_pieces_and_decode_steps_of_requests_sharing_a_prefix_and_not_equal_each_alone(name):
    model = _model(name)
    assert packed.packs(model) is None
    windows = hf.cache_layers(model)
    prefix = _ids(1, 70)  # longer than the sliding windows of the "-window" families (48)
    a, b, c = prefix + _ids(2, 13), prefix + _ids(3, 29), _ids(4, 55)
    shared = _buffer(model, 70)
    packed.forward(model, torch.tensor(prefix), torch.arange(70), packed.Plan([packed.Part(0, 70, shared, 0)], windows), torch.tensor([69]))
    own = {k: _buffer(model, 80) for k in "abc"}
    # one step: the tails of a and b (each attending to the shared prefix) and the whole of c, packed
    ids = torch.tensor(a[70:] + b[70:] + c)
    positions = torch.cat([torch.arange(70, 83), torch.arange(70, 99), torch.arange(0, 55)])
    parts = [packed.Part(0, 13, own["a"], 0, 70, shared), packed.Part(13, 42, own["b"], 0, 70, shared), packed.Part(42, 97, own["c"], 0)]
    logits = packed.forward(model, ids, positions, packed.Plan(parts, windows), torch.tensor([12, 41, 96]))
    for row, full in zip(logits, (a, b, c)):
        torch.testing.assert_close(row, _logits(model, full)[-1], atol=TOL, rtol=TOL)
    # then a decode step of the three, and a piece of c's continuation in the same forward
    nxt = [int(_logits(model, x)[-1].argmax()) for x in (a, b, c)]
    more = _ids(5, 6)
    ids = torch.tensor(nxt[:2] + [nxt[2]] + more)
    positions = torch.tensor([83, 99, 55, *range(56, 62)])
    parts = [packed.Part(0, 1, own["a"], 13, 70, shared), packed.Part(1, 2, own["b"], 29, 70, shared), packed.Part(2, 9, own["c"], 55)]
    logits = packed.forward(model, ids, positions, packed.Plan(parts, windows), torch.tensor([0, 1, 8]))
    for row, full in zip(logits, (a + nxt[:1], b + nxt[1:2], c + [nxt[2]] + more)):
        torch.testing.assert_close(row, _logits(model, full)[-1], atol=TOL, rtol=TOL)


def test_requests_sharing_a_prefix_are_one_attention_group_per_prefix():
    model = _model("llama")
    one, two = _buffer(model, 8), _buffer(model, 8)
    own = [_buffer(model, 4) for _ in range(4)]
    parts = [packed.Part(0, 1, own[0], 0, 8, one), packed.Part(1, 2, own[1], 0, 8, one.slice(0, 8)),
             packed.Part(2, 3, own[2], 0, 4, one.slice(0, 4)), packed.Part(3, 4, own[3], 0, 8, two)]  # fmt: skip
    groups = packed.Plan(parts, [None, None]).groups
    assert [[parts.index(p) for p in g] for g in groups] == [[0, 1], [2], [3]]  # the same memory and length: one group


def test_a_query_whose_window_starts_after_the_shared_prefix_reads_none_of_it():
    """A sliding layer's query past the window of the whole prefix: no weight on it, and no NaN from an empty softmax."""
    model = _model("mistral-window")
    windows = hf.cache_layers(model)
    prefix, tail = _ids(6, 40), _ids(7, 60)  # the tail's last queries are more than a window (48) past the prefix
    shared = _buffer(model, 40)
    packed.forward(model, torch.tensor(prefix), torch.arange(40), packed.Plan([packed.Part(0, 40, shared, 0)], windows), torch.tensor([39]))
    own = _buffer(model, 64)
    logits = packed.forward(model, torch.tensor(tail), torch.arange(40, 100), packed.Plan([packed.Part(0, 60, own, 0, 40, shared)], windows),
                            torch.tensor([59]))  # fmt: skip
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0], _logits(model, prefix + tail)[-1], atol=TOL, rtol=TOL)


def test_a_model_with_alibi_is_not_packed():
    from transformers import FalconConfig, FalconForCausalLM

    model = FalconForCausalLM(FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, alibi=True))
    assert "ALiBi" in (packed.packs(model) or "")


@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma2-window"])
def test_where_no_fused_kernel_applies_the_attention_by_hand_gives_the_same_logits(name, monkeypatch):
    """A device whose fused kernel failed (or has none) computes the shared prefix's and each tail's attention with its
    log-sum-exp by hand in float32 (``lse.manual``), one call per tail: forced here on the CPU, the same logits as alone."""
    monkeypatch.setattr(lse, "UNFUSED", {"cpu": "forced by the test"})
    calls = []
    manual = lse.manual
    monkeypatch.setattr(lse, "manual", lambda *a: calls.append(1) or manual(*a))
    test_pieces_and_decode_steps_of_requests_sharing_a_prefix_and_not_equal_each_alone(name)
    assert calls


def _efficient_as_documented(q, k, v, bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """torch's ``_scaled_dot_product_efficient_attention`` as CUDA runs it, on the CPU: q, k, v of as many heads, an additive
    bias of q's dtype whose rows are 16-element aligned, the log-sum-exp padded to a multiple of 32 queries."""
    assert q.shape[:2] == k.shape[:2] == v.shape[:2] and compute_log_sumexp and not dropout_p and not is_causal
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if bias is not None:
        assert bias.dtype == q.dtype and bias.shape[-1] % 16 == 0, "CUDA's kernel refuses an unaligned bias"
        s = s + bias.float()
    lse = torch.logsumexp(s, dim=-1)
    m = q.shape[2]
    padded = torch.full((*lse.shape[:2], -(-m // 32) * 32), float("nan"))
    padded[..., :m] = lse
    return torch.matmul(torch.softmax(s, -1), v.float()).to(q.dtype), padded, torch.empty(0), torch.empty(0)


@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_the_gpu_kernel_used_as_its_contract_says_gives_the_same_logits(name, monkeypatch):
    """The packed attention's use of CUDA's kernel (``KERNELS["cuda"]``: keys and bias padded to 16, the log-sum-exp cut
    to the queries), run on the CPU against a stand-in that keeps the kernel's contract: each request's logits as alone.
    The kernel itself on a GPU: ``tests/test_gpu_paths.py``."""
    calls = []
    monkeypatch.setattr(
        torch.ops.aten, "_scaled_dot_product_efficient_attention", lambda *a, **k: calls.append(1) or _efficient_as_documented(*a, **k)
    )
    monkeypatch.setitem(lse.KERNELS, "cpu", lse.KERNELS["cuda"])
    monkeypatch.setitem(lse.ALIGN, "cpu", 16)
    monkeypatch.setattr(lse, "UNFUSED", {})
    test_pieces_and_decode_steps_of_requests_sharing_a_prefix_and_not_equal_each_alone(name)
    assert calls and not lse.UNFUSED


def test_a_fused_kernel_that_fails_is_said_once_and_the_attention_computed_by_hand(monkeypatch, caplog):
    def fails(*args):
        raise RuntimeError("no kernel for these inputs")

    monkeypatch.setitem(lse.KERNELS, "cpu", fails)
    monkeypatch.setattr(lse, "UNFUSED", {})
    with caplog.at_level("WARNING", logger="cachegen_core.engine"):
        test_pieces_and_decode_steps_of_requests_sharing_a_prefix_and_not_equal_each_alone("llama")
    assert "no kernel for these inputs" in lse.UNFUSED["cpu"]
    assert len([r for r in caplog.records if "fused attention failed" in r.message]) == 1
