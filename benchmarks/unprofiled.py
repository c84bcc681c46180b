"""Coding without a profile: the identity against a randomized Hadamard rotation per head, and step scales.

    python -m benchmarks.unprofiled [--quick] [--first 12 --last 25] [--context 4096] [--levels 1 2]
        [--variants identity hadamard identity:s=3.0 hadamard:s=3.0] [--out F]

A codec with no profile codes each head's channels as they are (keys before the rotary
embedding), with a step per layer (``CodecConfig.unprofiled_scale`` times the level's, in units
of the layer's RMS). The data-free alternative measured here rotates every head's channels (keys
before the rotary embedding) by ``H diag(signs) / sqrt(dim)``, ``H`` the Sylvester Hadamard
matrix and the signs drawn from a seed of the codec id, as QuaRot and TurboQuant do before
scalar quantisation; then the same steps and per-chunk table classes. ``name:s=X`` sets
``unprofiled_scale`` to X. Each context is the first ``--context`` tokens of a transcript, coded
in chunks of 1536; the next 256 tokens are scored teacher-forced on the reconstruction against
the fp16 KV (as ``quality_size``). The rotated variant runs the codec's torch path (the native
one-pass paths know only the identity): the same arithmetic, slower. One JSON line per
(variant, level). ``--quick``: 2 contexts of 1536 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.common import Rows, context_kv, load, parser, read_jsonl, setup_threads
from benchmarks.quality_size import score


def hadamard(layers: int, heads: int, dim: int, seed: int) -> Any:
    """The per-head randomized Hadamard rotation as a codec ``Transform`` (orthonormal: synthesis = analysis^T)."""
    from cachegen_core.codec.transform import Transform  # noqa: PLC0415

    if dim & (dim - 1):
        raise ValueError("a Sylvester Hadamard matrix needs a power-of-two head_dim")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (2, layers, heads, dim), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    a = (h / math.sqrt(dim))[None, None, None] * signs[..., None, :]
    return Transform(a.contiguous(), a.transpose(-1, -2).contiguous(), torch.ones(2, layers, heads, dim))


@contextlib.contextmanager
def torch_paths() -> Iterator[None]:
    """The codec's torch encode and decode paths, which apply any transform."""
    from cachegen_core.codec import fused, fused_encode  # noqa: PLC0415

    saved = fused.supports, fused_encode.supports
    fused.supports, fused_encode.supports = (lambda coder: False), (lambda kv: False)
    try:
        yield
    finally:
        fused.supports, fused_encode.supports = saved


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, quick_help="2 contexts of 1536 tokens")
    ap.add_argument("--first", type=int, default=12, help="first transcript (0-9 fitted the shipped profile)")
    ap.add_argument("--last", type=int, default=25, help="one past the last one")
    ap.add_argument("--context", type=int, default=4096, help="tokens of each context")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variants", nargs="+", default=["identity", "hadamard"], help="identity, hadamard, name:s=SCALE")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.last, args.context = args.first + 2, 1536
    setup_threads()
    with Rows("unprofiled", args.out, argv) as out:
        run(args, out)


def run(args: argparse.Namespace, out: Rows) -> None:
    from cachegen_core.codec.config import CodecConfig  # noqa: PLC0415
    from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
    from cachegen_core.codec.rotary import RotarySpec  # noqa: PLC0415
    from cachegen_core.kv import KVCache  # noqa: PLC0415

    class Rotated(KVCodec):
        def _transform(self, layers: int, heads: int, dim: int) -> Any:
            seed = int.from_bytes(hashlib.blake2b(self.codec_id.encode(), digest_size=4).digest(), "little")
            return hadamard(layers, heads, dim, seed)

    model, tok = load(args.model)
    rotary = RotarySpec.from_model(model)
    codecs = {}
    for v in args.variants:
        name, _, opts = v.partition(":")
        kw = {"unprofiled_scale": float(opts.removeprefix("s="))} if opts else {}
        codecs[v] = ((Rotated if name == "hadamard" else KVCodec)(CodecConfig(**kw), rotary=rotary), name == "hadamard")
    tally: dict[tuple[str, int], list[float]] = {}  # bytes, elements, nll, agree, count
    ref_nll = ref_count = 0.0
    contexts = 0
    for r in read_jsonl(args.data)[args.first : args.last]:
        ids = tok(r["prompt"])["input_ids"]
        if len(ids) < args.context + 256:
            continue
        ctx, cont = ids[: args.context], ids[args.context : args.context + 256]
        kv = context_kv(model, ctx)
        nll, n, ref_top = score(model, kv, cont)
        ref_nll, ref_count, contexts = ref_nll + nll, ref_count + n, contexts + 1
        for v, (codec, rotated) in codecs.items():
            for lv in args.levels:
                with torch_paths() if rotated else contextlib.nullcontext():
                    blobs = [codec.encode(kv.slice(s, s + 1536), lv, start=s) for s in range(0, args.context, 1536)]
                    hat = KVCache.concat([codec.decode(b) for b in blobs])
                nll, n, top = score(model, hat, cont)
                t = tally.setdefault((v, lv), [0, 0, 0.0, 0, 0])
                for i, x in enumerate((sum(map(len, blobs)), kv.num_elements, nll, int((top == ref_top).sum()), n)):
                    t[i] += x
    ref_ppl = math.exp(ref_nll / max(ref_count, 1))
    for (v, lv), (nbytes, elements, nll, agree, count) in tally.items():
        out.emit({"variant": v, "level": lv, "context_tokens": args.context, "n_contexts": contexts,
                  "transcripts": f"{args.first}-{args.last - 1}", "bits_per_element": round(8 * nbytes / elements, 4),
                  "ppl_rel_delta": round(math.exp(nll / count) / ref_ppl - 1, 6), "top1_agreement": round(agree / count, 5)})  # fmt: skip


if __name__ == "__main__":
    main()
