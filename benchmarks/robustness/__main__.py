"""``python -m benchmarks.robustness``: every scenario (or those ``--only`` names), one JSON line each; the exit
status is 1 when any request crashed, hung, used a bad blob or went unanswered."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

import benchmarks.robustness as R
from benchmarks.common import Rows, parser

ENGINE_SCENARIOS: dict[str, Callable[[R.Bench], dict[str, Any]]] = {
    "foreign-model blob": R.scenario_foreign_blob,
    "other-codec blob": R.scenario_other_codec_blob,
    "corrupted blob in store": R.scenario_corrupted_blob,
    "redis killed mid-stream": R.scenario_redis_killed_mid_stream,
    "redis restarted": R.scenario_redis_restarted,
    "redis cluster failover": R.scenario_redis_cluster_failover,
    "slow redis": R.scenario_slow_redis,
    "diskcache full": R.scenario_diskcache_full,
    "read-only cache dir": R.scenario_read_only_dir,
    "concurrent 8 threads": R.scenario_concurrent,
    "batched faults": R.scenario_batched_faults,
}


def arguments() -> argparse.ArgumentParser:
    ap = parser(R.__doc__, model=False, data=False,
                quick_help="fewer fuzz inputs (2000 instead of 20000; the 100k run is benchmarks.fuzz), shorter libFuzzer run")  # fmt: skip
    ap.add_argument("--only", nargs="*", default=None, help="scenario names (or prefixes) to run")
    ap.add_argument("--fuzz-inputs", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    with Rows("robustness", args.out, argv) as out:
        return run(args, out)


def run(args: argparse.Namespace, out: Rows) -> int:
    logging.basicConfig(level=logging.ERROR)  # warnings are counted per scenario, not printed
    torch.manual_seed(args.seed)

    def wanted(name: str) -> bool:
        return args.only is None or any(name.startswith(o) for o in args.only)

    bad = 0

    def emit(row: dict[str, Any]) -> None:
        nonlocal bad
        out.emit(row)
        bad += row.get("crashes", 0) + row.get("hangs", 0) + row.get("wrong_kv_accepted", 0)
        bad += row.get("requests", 0) - row.get("answered", 0) if "skipped" not in row else 0

    if wanted("fuzz"):
        inputs = args.fuzz_inputs or (2000 if args.quick else 20_000)
        for row in R.scenario_fuzz(inputs, 3600, args.seed):
            emit(row)
        emit(R.scenario_libfuzzer(10 if args.quick else 120))
    bench = R.Bench.tiny()
    for name, fn in ENGINE_SCENARIOS.items():
        if wanted(name):
            t = time.perf_counter()
            row = fn(bench)
            row.setdefault("seconds", round(time.perf_counter() - t, 2))
            emit(row)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
