"""``benchmarks.warm_path``'s summaries and picture: each run's ``cachegen-auto`` against ``fp16``, every policy against
``fp16`` over the runs (median, min, max), TTFT against context length a panel per store."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import Rows
from benchmarks.plotting import Panels, line_panels

PLOTTED = {
    "text": "recompute",
    "fp16": "fp16",
    "uniform8": "uniform8",
    "cachegen-1": "level 1",
    "cachegen-4": "level 4",
    "cachegen-auto": "cachegen-auto",
}  # what a plot draws, and its legend


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Warm TTFT against context tokens, a panel per store and device (titled by a row's ``panel`` where set); with
    several runs, the median of theirs."""
    points: dict[str, dict[str, dict[int, list[float]]]] = {}
    for r in rows:
        if r.get("policy") in PLOTTED:
            title = r.get("panel") or f"{r['store']}, {r['model']} on {r['device']}"
            series = points.setdefault(title, {label: {} for label in PLOTTED.values()})[PLOTTED[r["policy"]]]
            series.setdefault(r["context_tokens"], []).append(r["ttft_s"])
    panels: Panels = {title: {label: [(x, statistics.median(ys)) for x, ys in by_x.items()] for label, by_x in series.items()}
                      for title, series in points.items()}  # fmt: skip
    line_panels(panels, path, xlabel="context (tokens)", ylabel="warm TTFT (s, log scale)", bold=PLOTTED["cachegen-auto"])


def run_summary(rows: list[dict[str, Any]], store: str, tokens: int, out: Rows, run: int = 0) -> None:
    """``cachegen-auto``'s TTFT against ``fp16``'s (and text's) of one run of a store and context, when both were timed."""
    by = {r["policy"]: r for r in rows}
    auto, fp16 = by.get("cachegen-auto"), by.get("fp16")
    if auto and fp16:
        out.emit({"summary": "auto_vs_fp16", "store": store, "context_tokens": auto["context_tokens"], "run": run,
                  "auto_over_fp16": round(auto["ttft_s"] / fp16["ttft_s"], 3),
                  "fp16_over_auto": round(fp16["ttft_s"] / auto["ttft_s"], 3),
                  "text_over_auto": round(by["text"]["ttft_s"] / auto["ttft_s"], 3) if "text" in by else None})  # fmt: skip


def runs_summary(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per policy but ``fp16``, over the runs of one store and context: ``fp16``'s TTFT over the policy's in each run
    (the same store, the same run), and their median, min and max; none without ``fp16`` rows."""
    ratios: dict[str, list[float]] = {}
    first: dict[str, Any] = {}
    for rows in runs:
        by = {r["policy"]: r for r in rows}
        if "fp16" not in by:
            return []
        first = first or by["fp16"]
        for name, r in by.items():
            if name != "fp16":
                ratios.setdefault(name, []).append(by["fp16"]["ttft_s"] / r["ttft_s"])
    return [{"summary": "vs_fp16_over_runs", "store": first["store"], "context_tokens": first["context_tokens"], "compared": name,
             "runs": len(rs), "fp16_over_policy_median": round(statistics.median(rs), 3), "min": round(min(rs), 3),
             "max": round(max(rs), 3), "per_run": [round(x, 3) for x in rs]} for name, rs in ratios.items()]  # fmt: skip
