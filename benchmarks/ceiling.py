"""What batching allows on this machine, measured with plain transformers: one decode step of U requests at once.

``decode_step_s(model, users, tokens, shared)`` times the model's own forward (its attention: what
``benchmarks.common.load`` gives it, as the engine's) of one new token for each of ``users`` requests after
``tokens`` cached tokens each: their own KV each (``shared=False``: a batch of ``users`` caches), or one KV read by
all of them (``shared=True``: the one cache broadcast over the batch, no copy). The cache writes nothing and copies
nothing per step (transformers' ``DynamicCache`` would concatenate the whole cache every step), so the step is the
model's work alone. ``ceiling(...)``: the throughput ``users`` such steps allow over one request's, the most a
serving engine can gain from batching that workload here.

``--engine``: beside each plain step, the engine's own decode step of the same requests (``model/packed.py``, as the
scheduler runs it: each request's own buffer, or the shared prefix read once and a 24-token tail each), the two
alternated ``--pairs`` times so that both see the same machine; ``engine_step_s``, ``engine_of_plain`` (plain over
engine seconds) and ``engine_speedup`` (its throughput at ``users`` over its one request's).

    python -m benchmarks.ceiling [--users 1 8 16] [--tokens 512 1536 4608] [--engine] [--pairs N] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache

from benchmarks.common import Rows, load, parser, setup_threads
from cachegen_core.hfcompat import cache_arg


#: Tokens of each request's own tail after a shared prefix (about a question's) in the engine's step.
TAIL = 24


class _StaticKV(Cache):
    """A cache that hands every layer the same preallocated keys and values (the new token's are not kept)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__(layers=[])
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys.shape[-2]

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[int, int]:
        return self.keys.shape[-2], 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.keys.shape[-2]


def _geometry(model: Any) -> tuple[int, int, int, torch.dtype, torch.device]:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim, next(model.parameters()).dtype, model.device


def plain_step(model: Any, users: int, tokens: int, shared: bool) -> Callable[[], None]:
    """One decode step of plain transformers for ``users`` requests after ``tokens`` cached tokens (the module doc)."""
    _, heads, head_dim, dtype, device = _geometry(model)
    batch = 1 if shared else users
    keys = torch.randn(batch, heads, tokens, head_dim, dtype=dtype, device=device)
    values = torch.randn(batch, heads, tokens, head_dim, dtype=dtype, device=device)
    if shared:
        keys, values = keys.expand(users, -1, -1, -1), values.expand(users, -1, -1, -1)
    ids = torch.full((users, 1), 5, device=device)
    positions = torch.full((users, 1), tokens, device=device)

    @torch.no_grad()
    def step() -> None:
        model(input_ids=ids, position_ids=positions, **cache_arg(model, _StaticKV(keys, values)), use_cache=True, logits_to_keep=1)

    return step


def engine_step(model: Any, users: int, tokens: int, shared: bool) -> Callable[[], None]:
    """The engine's packed decode step of the same requests: its own buffer each (``tokens`` computed), or one shared
    prefix of ``tokens - 24`` and a 24-token tail each (the new token written at the same place every step)."""
    from cachegen_core.engine.model import hf, packed  # noqa: PLC0415
    from cachegen_core.kv import KVCache  # noqa: PLC0415

    layers, heads, head_dim, dtype, device = _geometry(model)

    def kv(n: int) -> KVCache:
        return KVCache(*(torch.randn(layers, heads, n, head_dim, dtype=dtype, device=device) for _ in range(2)))

    tail = TAIL if shared else tokens
    prefix = kv(tokens - TAIL) if shared else None
    parts = [(kv(tail + 1), tail) for _ in range(users)]
    windows = hf.cache_layers(model)
    ids, positions, keep = torch.full((users,), 5, device=device), torch.full((users,), tokens, device=device), torch.arange(users, device=device)

    def step() -> None:
        plan = [packed.Part(i, i + 1, own, filled, tokens - tail, prefix) for i, (own, filled) in enumerate(parts)]
        packed.forward(model, ids, positions, packed.Plan(plan, windows), keep)

    return step


def _timed(step: Callable[[], None], device: torch.device) -> float:
    t = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def decode_step_s(model: Any, users: int, tokens: int, shared: bool, reps: int = 7) -> float:
    """Median seconds of one decode step of ``users`` requests after ``tokens`` cached tokens (see the module doc)."""
    step = plain_step(model, users, tokens, shared)
    return statistics.median([_timed(step, model.device) for _ in range(reps + 1)][1:])


def paired_steps_s(model: Any, users: int, tokens: int, shared: bool, pairs: int) -> tuple[float, float]:
    """Median seconds of plain transformers' step and of the engine's, alternated ``pairs`` times (after one of each)."""
    steps = (plain_step(model, users, tokens, shared), engine_step(model, users, tokens, shared))
    times = [[_timed(step, model.device) for step in steps] for _ in range(pairs + 1)][1:]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def ceiling(model: Any, users: int, tokens: int, shared: bool, one: float | None = None) -> tuple[float, float]:
    """(the throughput ``users`` requests batched allow over one request's, the step's seconds); ``one``: one
    request's step, if already measured."""
    one = decode_step_s(model, 1, tokens, shared) if one is None else one
    step = decode_step_s(model, users, tokens, shared)
    return users * one / step, step


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, data=False, device=True, quick_help="1 and 8 users after 1536 tokens")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1536, 4608])
    ap.add_argument("--engine", action="store_true", help="the engine's packed step beside each plain one, alternated")
    ap.add_argument("--pairs", type=int, default=21, metavar="N", help="with --engine: alternations of the two steps")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    if args.quick:
        args.users, args.tokens = [1, 8], [1536]
    setup_threads()
    model, _ = load(args.model, device=args.device)
    with Rows("ceiling", args.out, argv) as out:
        for tokens in args.tokens:
            for shared in (False, True):
                if args.engine:
                    one, engine_one = paired_steps_s(model, 1, tokens, shared, args.pairs)
                else:
                    one = decode_step_s(model, 1, tokens, shared)
                for users in args.users:
                    row = {"model": args.model, "device": args.device, "tokens": tokens, "shared": shared, "users": users}
                    if args.engine:
                        step, engine = paired_steps_s(model, users, tokens, shared, args.pairs) if users > 1 else (one, engine_one)
                        row.update(step_s=round(step, 5), speedup=round(users * one / step, 3), engine_step_s=round(engine, 5),
                                   engine_of_plain=round(step / engine, 3), engine_speedup=round(users * engine_one / engine, 3))  # fmt: skip
                    else:
                        speedup, step = ceiling(model, users, tokens, shared, one) if users > 1 else (1.0, one)
                        row.update(step_s=round(step, 5), speedup=round(speedup, 3))
                    out.emit(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
