"""How far can the delta step go? Coarser levels than the codec ships, measured like quality_size.

    python -m benchmarks.level_sweep [--quick] [--extra 0.5 0.8 ...] [--eval-first 6 --eval-last 10] [--out F]

Builds a codec configuration with the default levels plus ``--extra`` coarser steps, fits a
profile for it on the first ``--train-tokens`` tokens of transcripts
``--train-first``..``--train-last`` (the transform: covariance and Fisher of the same
transcripts), and scores every level on ``--context`` tokens of the evaluated transcripts (the
next 256 teacher-forced): bits per element, perplexity change and top-1 agreement against the
fp16 KV. One JSON line per level. Defaults stay inside the tuning transcripts 0-9. ``--quick``:
one training and one evaluated transcript.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import Rows, context_kv, load, parser, read_jsonl, setup_threads
from benchmarks.quality_size import score


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="one training and one evaluated transcript")
    ap.add_argument("--extra", nargs="*", type=float, default=[0.5, 0.8])
    ap.add_argument("--train-first", type=int, default=0)
    ap.add_argument("--train-last", type=int, default=3)
    ap.add_argument("--train-tokens", type=int, default=4352)
    ap.add_argument("--eval-first", type=int, default=6)
    ap.add_argument("--eval-last", type=int, default=10)
    ap.add_argument("--context", type=int, default=1536)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    with Rows("level_sweep", args.out, argv) as rows:
        run(args, rows)


def run(args: argparse.Namespace, rows: Rows) -> None:
    if args.quick:
        args.train_last, args.eval_last = args.train_first + 1, args.eval_first + 1
    setup_threads()

    from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
    from cachegen_core.codec.config import DEFAULT_LEVELS, CodecConfig  # noqa: PLC0415
    from cachegen_core.codec.kvstats import kv_statistics  # noqa: PLC0415
    from cachegen_core.codec.profile import Profile  # noqa: PLC0415
    from cachegen_core.codec.rotary import RotarySpec  # noqa: PLC0415
    from cachegen_core.codec.transform import fit_transform  # noqa: PLC0415
    from cachegen_core.engine.model.hf import kv_geometry  # noqa: PLC0415

    levels = DEFAULT_LEVELS + tuple(args.extra)
    config = CodecConfig(levels=levels)
    model, tok = load(args.model)
    rotary = RotarySpec.from_model(model)
    records = read_jsonl(args.data)
    ids = [tok(r["prompt"])["input_ids"][: args.train_tokens] for r in records[args.train_first : args.train_last]]
    _, heads, dim = kv_geometry(model.config)
    stats = kv_statistics(model, ids, rotary=rotary, contexts=(1536, 4096), group=config.head_group(heads, dim))
    transform = fit_transform(stats.covariance, stats.fisher, config.fisher_eps, group=stats.group)
    train = (context_kv(model, x) for x in ids)
    codec = KVCodec(config, Profile.fit(config, train, transform=transform, rotary=rotary))
    tally = {lv: [0, 0, 0.0, 0.0, 0, 0] for lv in range(config.n_levels)}  # bytes, elements, nll, ref nll, agree, count
    for r in records[args.eval_first : args.eval_last]:
        ids = tok(r["prompt"])["input_ids"]
        ctx, cont = ids[: args.context], ids[args.context : args.context + 256]
        kv = context_kv(model, ctx)
        ref, n, ref_top = score(model, kv.to(dtype=torch.float16).to(dtype=kv.dtype), cont)
        for lv in range(config.n_levels):
            blob = codec.encode(kv, lv, start=0)
            nll, n, top = score(model, codec.decode(blob), cont)
            t = tally[lv]
            t[0] += len(blob)
            t[1] += kv.num_elements
            t[2] += nll
            t[3] += ref
            t[4] += int((top == ref_top).sum())
            t[5] += n
    for lv, (nbytes, elements, nll, ref, agree, count) in tally.items():
        rows.emit({"level": lv, "step": levels[lv], "shipped": lv < len(DEFAULT_LEVELS), "context_tokens": args.context,
                   "n_contexts": args.eval_last - args.eval_first, "bits_per_element": round(8 * nbytes / elements, 4),
                   "ppl_rel_delta": round(math.exp((nll - ref) / count) - 1, 5), "top1_agreement": round(agree / count, 5)})  # fmt: skip


if __name__ == "__main__":
    main()
