"""Shared pieces of the benchmarks: real transcripts, the reference model, JSON-lines output.

The benchmarks read the project's dev data from ``../shared/data/`` (beside the
checkout) by default; ``--data F`` points them at any LongChat-style JSON-lines file
(fields ``prompt``, ``label``), e.g. the demo excerpt ``examples/data/longchat_demo.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
LONGCHAT = DATA / "longchat_dev.jsonl"
TRACES = DATA / "bandwidth_traces_dev.jsonl"
DEFAULT_MODEL = "smollm2-135m"


def add_data_option(ap: argparse.ArgumentParser) -> None:
    """``--data F``: the transcripts to read (default: the LongChat dev set in ``../shared/data``)."""
    ap.add_argument("--data", type=Path, default=LONGCHAT, metavar="F",
                    help=f"LongChat-style JSON-lines transcripts (default: {LONGCHAT})")  # fmt: skip


def read_jsonl(path: str | Path, field: str | None = None) -> list[Any]:
    """Records of a JSON-lines file (or one field of each)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found: the dev data lives in ../shared/data beside the checkout "
                                "(or pass another file with --data / --traces)")  # fmt: skip
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r[field] for r in rows] if field else rows


def emit(record: dict[str, Any], out: Any = None) -> None:
    """Print one JSON line (and append it to ``out`` if given)."""
    line = json.dumps(record, sort_keys=False)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def best_time(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    """Smallest wall time of ``reps`` calls (at least one), and the last result."""
    best, out = float("inf"), None
    for _ in range(max(1, reps)):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def setup_threads() -> int:
    """Use every core of this machine for torch (CI boxes have 2)."""
    n = os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def load(model: str = DEFAULT_MODEL) -> tuple[Any, Any]:
    """The model and tokenizer (reference model by default), in eval mode."""
    from cachegen_core.models import load_model

    t = time.perf_counter()
    m, tok = load_model(model)
    print(f"# loaded {model} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return m, tok


@torch.no_grad()
def context_kv(model: Any, ids: list[int]) -> Any:
    """Real KV cache of ``ids`` on ``model``."""
    from cachegen_core.kv import KVCache

    out = model(torch.tensor([ids], device=model.device), use_cache=True)
    return KVCache.from_dynamic_cache(out.past_key_values)


def transcript_ids(tokenizer: Any, texts: list[str], n_tokens: int) -> Iterator[list[int]]:
    """Token ids of each transcript, cut to ``n_tokens`` (skipping shorter ones)."""
    for t in texts:
        ids = tokenizer(t)["input_ids"]
        if len(ids) >= n_tokens:
            yield ids[:n_tokens]
