"""What coding every component with one of the codec's 64 fixed tables costs against a table per component.

    python -m benchmarks.table_classes [--quick] [--fit-first 0 --fit-last 10] [--first 12 --last 25] [--context 4096] [--out F]

Codec v2 fitted one 16-bit table per (level, kind, layer, component) on the profile's texts
(57,600 tables for the reference model); v3 fits only each component's class, which of the
fixed discrete Gaussian tables of ``codec.classes`` codes it. Both are fitted here on the same
symbols (the first ``--context`` tokens of transcripts ``--fit-first``..``--fit-last``, coded
with the shipped profile's transform) and scored on held-out transcripts: the cross-entropy of
their symbols under each, bits per element, per level. The coded payload is within 0.3 % of
it (``codec_micro``). One JSON line per level. ``--quick``: fitted on 3 transcripts, scored on 2, at
1536 tokens.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import HELD_OUT, Rows, context_kv, load, parser, read_jsonl, setup_threads


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="fitted on transcripts 0-2, scored on 12-13, 1536 tokens each")
    ap.add_argument("--fit-first", type=int, default=0, help="first transcript the tables and classes are fitted on")
    ap.add_argument("--fit-last", type=int, default=10, help="one past the last one")
    ap.add_argument("--first", type=int, default=HELD_OUT, help="first held-out transcript scored")
    ap.add_argument("--last", type=int, default=25, help="one past the last one")
    ap.add_argument("--context", type=int, default=4096, help="tokens of each transcript")
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.fit_last, args.last, args.context = args.fit_first + 3, args.first + 2, 1536
    setup_threads()
    with Rows("table_classes", args.out, argv) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Rows) -> None:
    from cachegen_core.codec.classes import classes_from_counts, code_lengths, counts_to_freqs  # noqa: PLC0415
    from cachegen_core.codec.config import CodecConfig  # noqa: PLC0415
    from cachegen_core.codec.pipeline import components, quantise  # noqa: PLC0415
    from cachegen_core.codec.profile import symbol_histogram  # noqa: PLC0415
    from cachegen_core.codec.profiles import find_profile  # noqa: PLC0415
    from cachegen_core.keys.fingerprint import model_fingerprint  # noqa: PLC0415

    model, tok = load(args.model)
    config = CodecConfig()
    profile = find_profile(model_fingerprint(model, tok), config)
    if profile is None or profile.transform is None:
        raise SystemExit("no profile with a transform for this model: run `cachegen profile` first")
    records = read_jsonl(args.data)

    def counts(first: int, last: int) -> np.ndarray:
        """Symbol counts (levels, 2 * layers * channels, 256) of the transcripts' first ``--context`` tokens."""
        total = None
        for r in records[first:last]:
            kv = context_kv(model, tok(r["prompt"])["input_ids"][: args.context])
            for s in range(0, kv.num_tokens, args.chunk_tokens):
                comp = components(kv.slice(s, s + args.chunk_tokens), profile.transform, start=s,
                                  sink_tokens=config.sink_tokens, rotary=profile.rotary)  # fmt: skip
                h = torch.stack([symbol_histogram(quantise(comp, config.level_step(lv), fitted=True).symbols)
                                 for lv in range(config.n_levels)])  # fmt: skip
                total = h if total is None else total + h
        assert total is not None, "no transcripts in that range"
        return total.double().numpy()

    fit, held = counts(args.fit_first, args.fit_last), counts(args.first, args.last)
    lengths = code_lengths(config.table_classes)
    for lv in range(config.n_levels):
        n = held[lv].sum()  # symbols; the exact sink tokens are left out of both
        per_component = 16.0 - np.log2(counts_to_freqs(fit[lv], alpha=0.05).astype(np.float64))
        by_class = lengths[classes_from_counts(fit[lv], config.table_classes)]
        p = held[lv] / np.maximum(held[lv].sum(axis=1, keepdims=True), 1)
        own = -(held[lv] * np.log2(np.where(p > 0, p, 1))).sum() / n
        v2, v3 = (float((held[lv] * t).sum() / n) for t in (per_component, by_class))
        out.emit({"level": lv, "context_tokens": args.context, "fit": f"{args.fit_first}-{args.fit_last - 1}",
                  "held_out": f"{args.first}-{args.last - 1}", "tables_per_component": int(fit[lv].shape[0]),
                  "classes": config.table_classes, "bits_per_component_tables": round(v2, 4), "bits_by_class": round(v3, 4),
                  "class_cost": round(v3 / v2 - 1, 5), "bits_own_empirical": round(float(own), 4)})  # fmt: skip


if __name__ == "__main__":
    main()
