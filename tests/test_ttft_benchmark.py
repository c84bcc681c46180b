"""The TTFT benchmark's event timeline and summary, on hand-made workloads (no model)."""

import pytest

from benchmarks.ttft import Link, Workload, simulate, summarise
from cachegen_core.streaming import TEXT, ChunkCost

MB = 1_000_000
LEVELS = [0, 1, 2, 3]


def workload(n=4, prefill=1e-4, decode=0.01):
    """Level L costs (4 - L) MB, fp16 16 MB and uniform8 8 MB per chunk of 1000 tokens."""
    cost = ChunkCost({lv: (4 - lv) * MB for lv in LEVELS}, dict.fromkeys(LEVELS, decode), 1000)
    return Workload([cost] * n, 0, prefill, [16 * MB] * n, [8 * MB] * n, 0.0)


def test_link_follows_the_trace_across_slices():
    link = Link([8.0, 0.8], slice_s=1.0)  # 1 GB/s then 0.1 GB/s, cycled
    assert link.transfer(0.0, 0.5e9) == pytest.approx(0.5)
    assert link.transfer(0.5, 0.6e9) == pytest.approx(1.0 + 0.1 / 0.1)  # 0.5 GB in slice 0, 0.1 GB in slice 1
    assert link.transfer(1.0, 0.1e9) == pytest.approx(2.0)


def test_timeline_pipelines_fetch_and_decode():
    w = workload(n=3, decode=0.5)
    r = simulate(w, Link([8.0], 1.0), "cachegen-fixed-0", None, LEVELS)  # 4 MB at 1 GB/s: 4 ms a fetch
    assert r["ttft_s"] == pytest.approx(0.004 + 3 * 0.5)  # decodes back to back after the first arrival
    assert r["bytes"] == 12 * MB and r["mean_level"] == 0 and r["text_chunks"] == 0
    text = simulate(w, Link([8.0], 1.0), "text", None, LEVELS)
    assert text["ttft_s"] == pytest.approx(3 * 1000 * 1e-4) and text["bytes"] == 0 and text["text_chunks"] == 3


def test_adaptive_meets_a_feasible_slo_and_recomputes_on_a_dead_slow_link():
    w = workload(n=6)
    fast = simulate(w, Link([8.0], 0.05), "cachegen-adaptive", 0.6, LEVELS)
    assert fast["ttft_s"] <= 0.6 and fast["text_chunks"] == 0
    # 1 MB/s: the medium first chunk (2 MB) is blind, after it text (0.1 s a chunk) beats every level
    slow = simulate(w, Link([0.008], 0.05), "cachegen-adaptive", 10.0, LEVELS)
    assert slow["options"] == [2] + [TEXT] * 5
    # a warm engine (its estimator has seen this link) recomputes from the first chunk: as fast as text
    warm = simulate(w, Link([0.008], 0.05), "cachegen-adaptive-warm", 10.0, LEVELS)
    text = simulate(w, Link([0.008], 0.05), "text", None, LEVELS)
    assert warm["options"] == [TEXT] * 6 and warm["ttft_s"] == pytest.approx(text["ttft_s"])


def test_summary_ratios_and_the_text_best_check():
    rows = []
    for trace, by in enumerate([{"fp16": 4.0, "uniform8": 2.0, "text": 3.0, "cachegen-adaptive": 1.0},
                                {"fp16": 8.0, "uniform8": 6.0, "text": 1.0, "cachegen-adaptive": 1.02}]):  # fmt: skip
        for pol, t in by.items():
            rows.append({"trace": trace, "slo_factor": 1.0, "context_tokens": 10, "policy": pol, "ttft_s": t,
                         "slo_met": t <= 3.0, "quality_proxy": None})  # fmt: skip
    s = {r["policy"]: r for r in summarise(rows)}
    a = s["cachegen-adaptive"]
    assert a["speedup_vs_uniform8"] == pytest.approx((2.0 * 6.0 / 1.02) ** 0.5, rel=1e-3)
    assert a["speedup_vs_fp16_1x"] == pytest.approx((4.0 * 8.0 / 1.02) ** 0.5, rel=1e-3)
    assert a["text_best_runs"] == 1 and a["over_text_max"] == pytest.approx(1.02)
    assert s["uniform8"]["speedup_vs_uniform8"] == 1.0 and s["text"]["over_text_max"] == 1.0


def test_live_baseline_wire_formats_round_trip():
    import torch

    from benchmarks import baselines
    from benchmarks.ttft_live import pack_fp16, pack_uniform8, unpack_fp16, unpack_uniform8
    from cachegen_core.kv import KVCache

    g = torch.Generator().manual_seed(0)
    kv = KVCache(torch.randn(3, 2, 17, 8, generator=g) * 4, torch.randn(3, 2, 17, 8, generator=g))
    blob = pack_fp16(kv)
    assert len(blob) == 2 * kv.num_elements
    back = unpack_fp16(blob, tuple(kv.shape))
    assert torch.equal(back.keys, kv.keys.half().float()) and torch.equal(back.values, kv.values.half().float())
    blob8 = pack_uniform8(kv)
    ref, nbytes = baselines.uniform_per_token(kv, 8)
    assert len(blob8) == nbytes  # the size the quality benchmark counts
    back8 = unpack_uniform8(blob8, tuple(kv.shape))
    assert torch.allclose(back8.keys, ref.keys, atol=1e-5) and torch.allclose(back8.values, ref.values, atol=1e-5)
