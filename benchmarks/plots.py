"""The pictures on ``docs/results.md``, redrawn from the rows it cites in ``docs/data/`` by the benchmarks' own
``--plot`` functions (nothing measured here):

    python -m benchmarks.plots [--data DIR] [--out DIR]      # or: make plots (docs/data -> docs/img)

- ``warm_ttft.png``: warm TTFT against context length per policy (``warm_path``), the CPU box and the H100;
- ``quality_bits.png``: bits per element against next tokens unlike fp16's, per method (``quality_size``);
- ``store_budget.png``: mean TTFT against a store's budget, per policy and trace (``store_budget``);
- ``concurrency.png``, ``concurrency-ttft.png``: requests a minute and TTFT p95 against users, per workload (``concurrency``).

A new run shown on the page: add its file to the lists below (and cite it on the page).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import concurrency, quality_size, store_budget, warm_path
from benchmarks.common import ROOT, results

#: (file, {store: panel title}) per warm-path run drawn, in panel order.
WARM_PATH = [
    ("warm_path_local_2026-11-28.jsonl", {"memory": "CPU, memory store", "disk": "CPU, disk store"}),
    ("warm_path_redis_2026-11-28.jsonl", {"redis": "CPU, Redis on loopback"}),
    ("warm_path_links_2026-11-28_positions.jsonl", {"redis@1gbps": "CPU, Redis at 1 Gbit/s", "redis@0.2gbps": "CPU, Redis at 0.2 Gbit/s"}),
    ("warm_path_7b_h100.jsonl", {"memory": "H100, 7B-shaped, memory store", "redis@10gbps": "H100, 7B-shaped, Redis ~1.6 Gbit/s"}),
]
#: (file, {method: legend label}) per quality run drawn: 13 held-out transcripts, the older baselines on 2.
QUALITY = [
    ("quality_size_v3_held_out_2026-11-29.jsonl", {"cachegen": "cachegen"}),
    *((f"quality_size_v2_c{c}_held_out13.jsonl", {"uniform8": "uniform8"}) for c in (1536, 4096, 7680)),
    ("quality_size_v2.jsonl", {m: f"{m} (2 transcripts)" for m in ("uniform4", "kivi4", "kivi2", "quanto4", "quanto2")}),
]
STORE_BUDGET = "store_budget_quick_2026-11-29.jsonl"
#: The concurrency runs drawn together (one invocation per set of workloads).
CONCURRENCY = ["concurrency_2026-12-06.jsonl", "concurrency_own_2026-12-06.jsonl"]


def warm_path_rows(data: Path) -> list[dict[str, Any]]:
    """The warm-path rows drawn, each titled with its machine and store."""
    return [{**r, "panel": stores[r["store"]]} for name, stores in WARM_PATH for r in results(data / name)
            if r.get("store") in stores and "policy" in r]  # fmt: skip


def quality_rows(data: Path) -> list[dict[str, Any]]:
    """The quality rows drawn, labelled by method (and by the number of transcripts, where fewer)."""
    return [{**r, "label": methods[r["method"]]} for name, methods in QUALITY for r in results(data / name)
            if r.get("method") in methods]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "docs" / "data", help="where the rows are (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where the PNGs go (default: %(default)s)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    warm_path.plot(warm_path_rows(args.data), str(args.out / "warm_ttft.png"))
    quality_size.plot(quality_rows(args.data), str(args.out / "quality_bits.png"))
    store_budget.plot(results(args.data / STORE_BUDGET), str(args.out / "store_budget.png"))
    concurrency.plot([r for name in CONCURRENCY for r in results(args.data / name)], str(args.out / "concurrency.png"))
    for name in ("warm_ttft.png", "quality_bits.png", "store_budget.png", "concurrency.png", "concurrency-ttft.png"):
        print(f"{args.out / name}: {(args.out / name).stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
