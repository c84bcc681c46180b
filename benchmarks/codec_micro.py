"""Codec micro-benchmark: size, error and speed of every level on real KV of the reference model.

    python -m benchmarks.codec_micro [--quick] [--model M] [--data F] [--out F] [--coder NAME]

One JSON line per level: ``level``, ``bits_per_element`` (headers, scales and tables
included), ``size_ratio_vs_fp16``, ``rel_mse_keys``, ``rel_mse_values``, ``encode_s``,
``decode_s`` (per chunk), ``coder``, plus the bit breakdown of the codec.

Speeds are per chunk, best of ``--reps`` after a warm-up, in the engine's way: ``encode_s`` the
whole ``encode`` (quantisation, tables, rANS, container), ``decode_s`` the whole ``decode`` of a
blob into a preallocated cache (checks, rANS, dequantisation, synthesis); ``rans_encode_s`` and
``rans_decode_s`` the coder alone on the same symbols (tables built outside the timing), and
``encode_over_rans`` / ``decode_over_rans`` their ratios: what the rest of the path costs.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import HELD_OUT, Rows, best_time, context_kv, load, parser, setup_threads, transcript_ids, transcripts


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="1 context of one chunk (< 2 minutes)")
    ap.add_argument("--first", type=int, default=HELD_OUT, help="first transcript (0-9 fitted the shipped profile, 0-11 tuned the codec)")
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4608, help="context tokens per transcript")
    ap.add_argument("--chunk-tokens", type=int, default=1536)
    ap.add_argument("--coder", default=None, help="coder name (default: the fastest available)")
    ap.add_argument("--no-profile", action="store_true", help="code without a profile (classes picked on each chunk) even if one exists")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per chunk (best kept)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    with Rows("codec_micro", args.out, argv) as rows:
        run(args, rows)


def run(args: argparse.Namespace, rows: Rows) -> None:
    if args.quick:
        args.contexts, args.tokens = 1, args.chunk_tokens
    setup_threads()

    from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
    from cachegen_core.coders import default_coder, get_coder  # noqa: PLC0415
    from cachegen_core.codec.config import CodecConfig  # noqa: PLC0415
    from cachegen_core.keys.fingerprint import model_fingerprint  # noqa: PLC0415
    from cachegen_core.kv import KVCache  # noqa: PLC0415
    from cachegen_core.codec.profiles import find_profile  # noqa: PLC0415

    model, tok = load(args.model)
    fp = model_fingerprint(model, tok)
    config = CodecConfig()
    profile = None if args.no_profile else find_profile(fp, config)
    coder = get_coder(args.coder) if args.coder else default_coder()
    codec = KVCodec(config, profile, coder=coder, fingerprint=fp)
    texts = transcripts(args.data, args.first)
    chunks: list[KVCache] = []
    for ids in transcript_ids(tok, texts, args.tokens):
        kv = context_kv(model, ids)
        chunks += [(s, kv.slice(s, s + args.chunk_tokens)) for s in range(0, kv.num_tokens, args.chunk_tokens)]
        if len(chunks) * args.chunk_tokens >= args.contexts * args.tokens:
            break
    for level in codec.levels:
        tot = {"bits": 0.0, "el": 0, "enc": 0.0, "dec": 0.0, "renc": 0.0, "rdec": 0.0, "sek": 0.0, "sk": 0.0, "sev": 0.0, "sv": 0.0}
        breakdown: dict[str, float] = {}
        for start, kv in chunks:
            blob, stats = codec.encode_with_stats(kv, level, start=start)  # also the warm-up
            out = KVCache(torch.empty_like(kv.keys), torch.empty_like(kv.values))
            codec.decode(blob, out=out)
            p = codec.prepare(kv, level, start=start)
            payloads = codec.coder.encode(p.symbols, p.layout, p.freqs)
            codec.coder.decode(payloads, p.layout, p.freqs)
            tot["enc"] += best_time(lambda: codec.encode(kv, level, start=start), args.reps)[0]  # noqa: B023
            tot["dec"] += best_time(lambda: codec.decode(blob, out=out), args.reps)[0]  # noqa: B023
            tot["renc"] += best_time(lambda: codec.coder.encode(p.symbols, p.layout, p.freqs), args.reps)[0]  # noqa: B023
            tot["rdec"] += best_time(lambda: codec.coder.decode(payloads, p.layout, p.freqs), args.reps)[0]  # noqa: B023
            tot["bits"] += 8 * len(blob)
            tot["el"] += kv.num_elements
            k, v = kv.keys.float(), kv.values.float()
            tot["sek"] += (out.keys.float() - k).square().sum().item()
            tot["sk"] += k.square().sum().item()
            tot["sev"] += (out.values.float() - v).square().sum().item()
            tot["sv"] += v.square().sum().item()
            for key, val in stats.items():
                if key.endswith("bits_per_element") or key == "payload_excess":
                    breakdown[key] = breakdown.get(key, 0.0) + val * kv.num_elements
        bpe = tot["bits"] / tot["el"]
        rows.emit(
            {
                "level": level,
                "bits_per_element": round(bpe, 4),
                "size_ratio_vs_fp16": round(bpe / 16, 5),
                "rel_mse_keys": tot["sek"] / tot["sk"],
                "rel_mse_values": tot["sev"] / tot["sv"],
                "encode_s": round(tot["enc"] / len(chunks), 4),
                "decode_s": round(tot["dec"] / len(chunks), 4),
                "rans_encode_s": round(tot["renc"] / len(chunks), 4),
                "rans_decode_s": round(tot["rdec"] / len(chunks), 4),
                "encode_over_rans": round(tot["enc"] / tot["renc"], 2),
                "decode_over_rans": round(tot["dec"] / tot["rdec"], 2),
                "coder": codec.coder.name,
                "tables": "profile" if profile else "inline",
                "chunks": len(chunks),
                "chunk_tokens": args.chunk_tokens,
                "model": args.model,
                **{k: round(v / tot["el"], 4) for k, v in breakdown.items() if k != "bits_per_element"},
            }
        )


if __name__ == "__main__":
    main()
