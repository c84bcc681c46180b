"""What batching allows on this machine, measured with plain transformers: one decode step of U requests at once.

``decode_step_s(model, users, tokens, shared)`` times the model's own forward (its attention: what
``benchmarks.common.load`` gives it, as the engine's) of one new token for each of ``users`` requests after
``tokens`` cached tokens each: their own KV each (``shared=False``: a batch of ``users`` caches), or one KV read by
all of them (``shared=True``: the one cache broadcast over the batch, no copy). The cache writes nothing and copies
nothing per step (transformers' ``DynamicCache`` would concatenate the whole cache every step), so the step is the
model's work alone. ``ceiling(...)``: the throughput ``users`` such steps allow over one request's, the most a
serving engine can gain from batching that workload here.

    python -m benchmarks.ceiling [--users 1 8 16] [--tokens 512 1536 4608] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from transformers.cache_utils import Cache

from benchmarks.common import Rows, load, parser, setup_threads
from cachegen_core.hfcompat import cache_arg


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


@torch.no_grad()
def decode_step_s(model: Any, users: int, tokens: int, shared: bool, reps: int = 7) -> float:
    """Median seconds of one decode step of ``users`` requests after ``tokens`` cached tokens (see the module doc)."""
    config = model.config
    heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype, device = next(model.parameters()).dtype, model.device
    batch = 1 if shared else users
    keys = torch.randn(batch, heads, tokens, head_dim, dtype=dtype, device=device)
    values = torch.randn(batch, heads, tokens, head_dim, dtype=dtype, device=device)
    if shared:
        keys, values = keys.expand(users, -1, -1, -1), values.expand(users, -1, -1, -1)
    ids = torch.full((users, 1), 5, device=device)
    positions = torch.full((users, 1), tokens, device=device)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        model(input_ids=ids, position_ids=positions, **cache_arg(model, _StaticKV(keys, values)), use_cache=True, logits_to_keep=1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


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
                one = decode_step_s(model, 1, tokens, shared)
                for users in args.users:
                    speedup, step = ceiling(model, users, tokens, shared, one) if users > 1 else (1.0, one)
                    out.emit({"model": args.model, "device": args.device, "tokens": tokens, "shared": shared, "users": users,
                              "step_s": round(step, 5), "speedup": round(speedup, 3)})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
