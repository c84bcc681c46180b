"""Coding without a profile: plain steps, steps weighted by the model's measured sensitivity, a Hadamard rotation.

    python -m benchmarks.unprofiled [--quick] [--first 12 --last 25] [--contexts 1536 4096 7680] [--levels 1 2]
        [--variants identity weighted refined hadamard identity:s=3.0 refined:g=1.1] [--out F]

A codec with no profile codes each head's channels as they are (keys before the rotary
embedding), with a step per layer (``CodecConfig.unprofiled_scale`` times the level's, in units
of the layer's RMS): ``identity``. ``weighted`` is what an engine codes a model without a profile
with (``engine.profiles.measure_weights``) when it is built: the same, each component's step times its weight
(``codec.weights``), measured by ``codec.fitting.fit_weights`` (one Fisher draw on the first 640
tokens of the shipped calibration text; its time is reported) and ``CodecConfig.weighted_scale``
times the level's. ``refined`` is what it codes with once it has measured each layer's sensitivity in the
background (``codec.fitting.weights_by_layer``: the weights times a multiplier per kind and layer; its time is
reported). The data-free alternative ``hadamard`` rotates every head's channels (keys
before the rotary embedding) by ``H diag(signs) / sqrt(dim)``, ``H`` the Sylvester Hadamard
matrix and the signs drawn from a seed of the codec id, as QuaRot and TurboQuant do before
scalar quantisation; then the same steps and per-chunk table classes. ``name:s=X`` sets the
variant's scale (``unprofiled_scale``, or ``weighted_scale`` for ``weighted`` and ``refined``) to X;
``c=N`` scores N continuation tokens in the Fisher draw (the engine's: 128); ``refined:`` also takes
``weights_by_layer``'s options: ``p=P`` the power of the sensitivity (1), ``g=G`` the multipliers' geometric
mean (``LAYER_GAIN``), ``l=L`` the level each layer is probed at (3), ``n=N`` the tokens scored (128);
several at once: ``refined:s=X,p=1,g=1.1``. Each context
is the first ``--contexts`` tokens of a transcript, coded in chunks of 1536; the next 256 tokens
are scored teacher-forced on the reconstruction against the fp16 KV (as ``quality_size``). The
rotated variant runs the codec's torch path (the native one-pass paths know only the identity):
the same arithmetic, slower. One JSON line per (variant, level). ``--quick``: 2 contexts of 1536
tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks import baselines
from benchmarks.common import HELD_OUT, Rows, context_kv, load, parser, read_jsonl, setup_threads
from benchmarks.quality_size import Tally, score_logp


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
    ap.add_argument("--first", type=int, default=HELD_OUT, help="first transcript (0-11 tuned the codec)")
    ap.add_argument("--last", type=int, default=25, help="one past the last one")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096], help="tokens of each context (one run per length)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["identity", "weighted", "refined"],
        help="identity, weighted, refined, hadamard, name:s=SCALE (see the module doc)",
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    if args.quick:
        args.last, args.contexts = args.first + 2, [1536]
    setup_threads()
    with Rows("unprofiled", args.out, argv) as out:
        run(args, out)


#: Options of ``weighted`` and ``refined`` naming ``fit_weights``' and ``weights_by_layer``'s arguments.
FIT_OPTIONS = {"c": "continuation"}
LAYER_OPTIONS = {"p": "power", "g": "gain", "l": "level", "n": "continuation"}
INTEGERS = ("continuation", "level")


def variant_options(variant: str) -> tuple[str, dict[str, float]]:
    """``name:s=X,c=N`` -> (name, {"s": X, "c": N}); ``SystemExit`` on an unknown name or option."""
    name, _, text = variant.partition(":")
    pairs = [o.partition("=") for o in text.split(",") if o]
    allowed = {"s"} | ({"c"} if name in ("weighted", "refined") else set()) | ({"p", "g", "l", "n"} if name == "refined" else set())
    numbers = all(x.replace(".", "", 1).isdigit() for _, _, x in pairs)
    if name not in ("identity", "weighted", "refined", "hadamard") or not {k for k, _, _ in pairs} <= allowed or not numbers:
        raise SystemExit(
            f"unknown variant {variant!r}: identity, weighted, refined or hadamard, with optional :s=SCALE "
            "(weighted and refined also c=TOKENS; refined also p=POWER, g=GAIN, l=PROBE_LEVEL, n=PROBE_TOKENS)"
        )
    return name, {k: float(x) for k, _, x in pairs}


def run(args: argparse.Namespace, out: Rows) -> None:
    from cachegen_core.codec.config import CodecConfig  # noqa: PLC0415
    from cachegen_core.codec.fitting import fit_weights, weights_by_layer  # noqa: PLC0415
    from cachegen_core.codec.kvcodec import KVCodec  # noqa: PLC0415
    from cachegen_core.codec.rotary import RotarySpec  # noqa: PLC0415

    class Rotated(KVCodec):
        def _transform(self, layers: int, heads: int, dim: int) -> Any:
            seed = int.from_bytes(hashlib.blake2b(self.codec_id.encode(), digest_size=4).digest(), "little")
            return hadamard(layers, heads, dim, seed)

    model, tok = load(args.model)
    rotary = RotarySpec.from_model(model)
    codecs, fitted = {}, {}

    def measured(what: str, fn: Any, opts: dict[str, Any]) -> Any:
        """``fn(**opts)``, once per ``what`` and options, its time emitted."""
        key = (what, *sorted(opts.items()))
        if key not in fitted:
            t0 = time.perf_counter()
            fitted[key] = fn(**opts)
            out.emit({"what": what, **opts, "seconds": round(time.perf_counter() - t0, 2), "threads": torch.get_num_threads()})
        return fitted[key]

    for v in args.variants:
        name, opts = variant_options(v)
        kw = {("weighted_scale" if name in ("weighted", "refined") else "unprofiled_scale"): opts["s"]} if "s" in opts else {}
        weights = None
        if name in ("weighted", "refined"):
            fit = {FIT_OPTIONS[k]: int(x) for k, x in opts.items() if k in FIT_OPTIONS}  # absent: the engine's
            weights = measured("fit_weights", lambda **o: fit_weights(model, tok, config=CodecConfig(), rotary=rotary, **o), fit)
        if name == "refined":
            by = {LAYER_OPTIONS[k]: (int(x) if LAYER_OPTIONS[k] in INTEGERS else x) for k, x in opts.items() if k in LAYER_OPTIONS}
            weights = measured(
                "weights_by_layer", lambda w=weights, **o: weights_by_layer(model, tok, w, config=CodecConfig(), rotary=rotary, **o), by
            )
        codec = (Rotated if name == "hadamard" else KVCodec)(CodecConfig(**kw), rotary=rotary, weights=weights)
        codecs[v] = (codec, name == "hadamard")
    records = read_jsonl(args.data)[args.first : args.last]
    for c in args.contexts:
        measure(model, tok, records, c, codecs, args, out)


def measure(model: Any, tok: Any, records: list[dict[str, Any]], context: int, codecs: dict[str, tuple[Any, bool]],
            args: argparse.Namespace, out: Rows) -> None:  # fmt: skip
    """Every variant at every level on the first ``context`` tokens of each record long enough: one row each."""
    from cachegen_core.kv import KVCache  # noqa: PLC0415

    tally: dict[tuple[str, int], Tally] = {}
    ref_nll = ref_count = 0.0
    contexts = 0
    for r in records:
        ids = tok(r["prompt"])["input_ids"]
        if len(ids) < context + 256:
            continue
        ctx, cont = ids[:context], ids[context : context + 256]
        kv = context_kv(model, ctx)
        ref = score_logp(model, baselines.fp16(kv)[0], cont)  # the reference: the fp16 KV, as in quality_size
        ref_nll, ref_count, contexts = ref_nll + ref[0], ref_count + ref[1], contexts + 1
        for v, (codec, rotated) in codecs.items():
            for lv in args.levels:
                with torch_paths() if rotated else contextlib.nullcontext():
                    blobs = [codec.encode(kv.slice(s, s + 1536), lv, start=s) for s in range(0, context, 1536)]
                    hat = KVCache.concat([codec.decode(b) for b in blobs])
                tally.setdefault((v, lv), Tally()).add(sum(map(len, blobs)), kv.num_elements, score_logp(model, hat, cont), ref)
    ref_ppl = math.exp(ref_nll / max(ref_count, 1))
    for (v, lv), t in tally.items():
        out.emit({"variant": v, "level": lv, "context_tokens": context, "n_contexts": contexts,
                  "transcripts": f"{args.first}-{args.last - 1}", "bits_per_element": round(8 * t.bytes / t.elements, 4),
                  "ppl_rel_delta": round(math.exp(t.nll / t.count) / ref_ppl - 1, 6), "top1_agreement": round(t.agree / t.count, 5),
                  "kl_mnat_per_token": round(1000 * t.kl / t.count, 4)})  # fmt: skip


if __name__ == "__main__":
    main()
