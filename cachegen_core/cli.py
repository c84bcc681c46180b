"""The ``cachegen`` command line: inspect blobs, prepare models, fit profiles.

    cachegen inspect BLOB
    cachegen model prepare [NAME]      convert the bundled reference model (or a .gguf) once
    cachegen model path [NAME]
    cachegen profile --model MODEL --texts FILE.jsonl [--field prompt] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

Command = Callable[[argparse.Namespace], int]


def _inspect(args: argparse.Namespace) -> int:
    from .errors import CacheGenFormatError  # noqa: PLC0415
    from .format import read_header  # noqa: PLC0415

    data = Path(args.blob).read_bytes()
    try:
        header = read_header(data)
    except CacheGenFormatError as e:
        print(f"error: {args.blob}: {e}", file=sys.stderr)
        return 2
    header["blob_bytes"] = len(data)
    print(json.dumps(header, indent=2, sort_keys=True))
    return 0


def _model(args: argparse.Namespace) -> int:
    from .models import resolve_model  # noqa: PLC0415

    print(resolve_model(args.name))
    return 0


def _profile(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415
    from tqdm import tqdm  # noqa: PLC0415

    from .config import CodecConfig  # noqa: PLC0415
    from .fingerprint import model_fingerprint  # noqa: PLC0415
    from .kv import KVCache  # noqa: PLC0415
    from .models import load_model  # noqa: PLC0415
    from .profile import Profile, default_profile_path  # noqa: PLC0415

    model, tok = load_model(args.model)
    texts = []
    with open(args.texts) as f:
        for i, line in enumerate(f):
            if line.strip() and args.first <= i < args.last:
                texts.append(json.loads(line)[args.field])
    if not texts:
        print(f"error: no records in {args.texts}[{args.first}:{args.last}] with field {args.field!r}", file=sys.stderr)
        return 2
    max_tokens = args.max_tokens or min(getattr(model.config, "max_position_embeddings", 8192), 8192)
    fp = model_fingerprint(model, tok)
    config = CodecConfig()

    def caches():
        for text in tqdm(texts, desc="profiling", unit="text", file=sys.stderr):
            ids = tok(text)["input_ids"][:max_tokens]
            with torch.no_grad():
                out = model(torch.tensor([ids]), use_cache=True)
            yield KVCache.from_dynamic_cache(out.past_key_values)

    profile = Profile.fit(config, caches(), chunk_tokens=args.chunk_tokens, model_fingerprint=fp)
    out = Path(args.out) if args.out else default_profile_path(fp, config)
    profile.save(out)
    print(json.dumps({"profile": str(out), "profile_id": profile.id, "tables": int(profile.freqs.shape[0]),
                      "chunks": profile.meta["n_chunks"], "bytes": out.stat().st_size}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subcommand is a small function set as ``func``."""
    ap = argparse.ArgumentParser(prog="cachegen", description="CacheGen KV-cache compression tools")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="print a blob's header as JSON")
    p.add_argument("blob")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("model", help="locate or convert a model")
    p.add_argument("action", choices=["prepare", "path"])
    p.add_argument("name", nargs="?", default="smollm2-135m")
    p.set_defaults(func=_model)

    p = sub.add_parser("profile", help="fit the codec's frequency tables on real contexts of a model")
    p.add_argument("--model", default="smollm2-135m", help="transformers dir, .gguf file or smollm2-135m")
    p.add_argument("--texts", required=True, help="JSONL file with one text per line")
    p.add_argument("--field", default="prompt")
    p.add_argument("--first", type=int, default=0, help="first record used")
    p.add_argument("--last", type=int, default=10, help="one past the last record used")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per text (default: the model's context, max 8192)")
    p.add_argument("--chunk-tokens", type=int, default=1536)
    p.add_argument("--out", default=None, help="default: beside the model in the user cache, found by fingerprint")
    p.set_defaults(func=_profile)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
