"""The ``cachegen`` command line: inspect blobs and stores, prepare models, fit profiles.

    cachegen inspect FILE              a blob file's header (JSON)
    cachegen inspect STORE KEY         an entry of a store (a blob's header, a manifest), or a chunk by its id's start
    cachegen ls [STORE] [--json] [--no-headers]   (alias: keys) a store's chunks: options, bytes, age, model
    cachegen model prepare [NAME] [--gguf-file F] [--revision R]
                                       download a hub model into the Hugging Face cache, or convert the bundled
                                       reference model (or a .gguf) once; print its dir
    cachegen model path [NAME] [--gguf-file F] [--revision R]
                                       print its dir without downloading or converting (exit 1: not prepared yet)
    cachegen profile [--model MODEL] [--texts FILE.jsonl] [--field prompt] [--first I] [--last J] [--max-tokens N]
                     [--layer-power P] [--sensitivity-texts N] [--out PATH]
    cachegen stats [STORE] [--namespace NS] [--no-headers]
    cachegen gc [STORE] [--older-than 7d] [--max-bytes 5G] [--model FP] [--orphans] [--tier raw] [--dry-run]

STORE is a store URL (``disk``, a directory, ``memory``, ``redis://``, ``rediss://``, ``redis-cluster://``;
default ``$CACHEGEN_STORE``, else ``disk``), see ``cachegen_core.stores.url``. A command opens an existing
store only: a directory that holds none is an error, never created (nor a damaged one moved aside), and a bare
word naming no store (``dsik``) is an unknown store, with the closest store word suggested.

Adding a subcommand: write ``_register_<name>(sub)`` that adds its parser with
``set_defaults(func=handler)`` (``handler(args) -> exit code``) and append it to
:data:`REGISTRY`. Handlers import what they need lazily so ``cachegen --help`` stays fast, and raise
on failure: any exception escaping a handler is printed as one line, ``error: ...``, with exit code 2
(``--traceback`` shows it whole).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import CacheGenFormatError

#: A subcommand handler: parsed arguments in, exit code out.
Command = Callable[[argparse.Namespace], int]
#: Adds one subcommand (with ``set_defaults(func=...)``) to the top-level subparsers.
Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def _inspect(args: argparse.Namespace) -> int:
    if args.key is not None:
        from .stores.listing import describe  # noqa: PLC0415

        with _open_store(args, args.target) as store:
            out = describe(store, args.key)
    else:
        from .codec.format import read_header  # noqa: PLC0415

        path = Path(args.target)
        if path.is_dir() or not path.exists():
            what = "is a directory" if path.is_dir() else "no such file"
            raise ValueError(f"{args.target}: {what} (a blob file, or a store and a key: cachegen inspect STORE KEY)")
        data = path.read_bytes()
        try:
            out = read_header(data)
        except CacheGenFormatError as e:
            raise CacheGenFormatError(f"{args.target}: {e}") from None
        out["blob_bytes"] = len(data)
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


def _ls(args: argparse.Namespace) -> int:
    from .stores.listing import chunk_rows  # noqa: PLC0415

    with _open_store(args) as store:
        rows, pointers, others = chunk_rows(store, headers=not args.no_headers)
    if args.json:
        for row in [*rows, *pointers, *others]:
            print(json.dumps(row))
        return 0
    table = [("CHUNK", "MANIFEST", "OPTIONS", "BYTES", "AGE", "MODEL")]
    table += [(r["chunk"][:16], "yes" if r["manifest"] is not None else "-", ",".join(r["options"]) or "-", _size(r["bytes"]),
               _age(r["age_s"]), (r.get("model") or "-")[:12]) for r in rows]  # fmt: skip
    if pointers:
        table += [("", "", "", "", "", ""), ("POINTER", "", "", "BYTES", "AGE", "")]
        table += [(p["pointer"][:16], "", "", _size(p["bytes"]), _age(p["age_s"]), "") for p in pointers]
    if others:
        table += [("", "", "", "", "", ""), ("OTHER KEY", "", "", "BYTES", "AGE", "")]
        table += [(o["key"], "", "", _size(o["bytes"]), _age(o["age_s"]), "") for o in others]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    total = sum(r["bytes"] for r in [*rows, *pointers, *others])
    bare = sum(r["manifest"] is None for r in rows)
    some = f"{_count(len(pointers), 'pointer')}, " if pointers else ""
    print(f"{_count(len(rows), 'chunk')} ({bare} without a manifest), {some}{_count(len(others), 'other key')}, {_size(total)}")
    return 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def _age(seconds: float | None) -> str:
    """An age for people: ``42s``, ``5m``, ``3h``, ``2d`` (``-``: the store keeps no times)."""
    if seconds is None:
        return "-"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _model_prepare(args: argparse.Namespace) -> int:
    from .hub import HubOptions  # noqa: PLC0415
    from .models import resolve_model  # noqa: PLC0415

    print(resolve_model(args.name, HubOptions(revision=args.revision, gguf_file=args.gguf_file)))
    return 0


def _model_path(args: argparse.Namespace) -> int:
    from .hub import HubOptions  # noqa: PLC0415
    from .models import model_dir_for  # noqa: PLC0415

    path, ready = model_dir_for(args.name, HubOptions(revision=args.revision, gguf_file=args.gguf_file))
    print(path)
    if not ready:
        print(f"not prepared yet: run `cachegen model prepare {args.name}`", file=sys.stderr)
        return 1
    return 0


def _profile(args: argparse.Namespace) -> int:
    import time  # noqa: PLC0415

    from tqdm import tqdm  # noqa: PLC0415

    from .codec.config import CodecConfig  # noqa: PLC0415
    from .codec.fitting import CALIBRATION, FitPlan, calibration_texts, fit_profile  # noqa: PLC0415
    from .codec.profiles import default_profile_path  # noqa: PLC0415
    from .codec.rotary import RotarySpec  # noqa: PLC0415
    from .keys.fingerprint import model_fingerprint, model_identity  # noqa: PLC0415
    from .models import load_model  # noqa: PLC0415

    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    texts = calibration_texts(args.texts or CALIBRATION, args.field)[args.first : args.last]
    if not texts:
        print(f"error: no records in {args.texts}[{args.first}:{args.last}] with field {args.field!r}", file=sys.stderr)
        return 2
    fp = model_fingerprint(model, tok)
    config = CodecConfig()
    context = args.chunk_tokens if args.chunk_tokens + 256 <= args.max_tokens else args.max_tokens // 2
    plan = FitPlan(texts=len(texts), tokens=args.max_tokens, chunk_tokens=args.chunk_tokens, contexts=(context,),
                   layer_power=args.layer_power, sensitivity_texts=args.sensitivity_texts)  # fmt: skip
    t1 = time.perf_counter()
    profile = fit_profile(model, tok, texts, config, plan=plan, fingerprint=fp, rotary=RotarySpec.from_model(model),
                          identity=model_identity(model, tok),
                          progress=lambda xs: tqdm(xs, desc="fitting", unit="text", file=sys.stderr),
                          source=f"{args.texts or 'the shipped calibration text'} records {args.first}-{args.first + len(texts) - 1}")  # fmt: skip
    out = Path(args.out) if args.out else default_profile_path(fp, config)
    profile.save(out)
    print(json.dumps({"profile": str(out), "profile_id": profile.id, "codec_id": profile.codec_id, "texts": len(texts),
                      "tokens": profile.meta["fitted_on"]["tokens"], "transform": config.transform if profile.transform else "none",
                      "bytes": out.stat().st_size, "fit_seconds": round(time.perf_counter() - t1, 1),
                      "total_seconds": round(time.perf_counter() - t0, 1)}))  # fmt: skip
    return 0


def _register_inspect(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("inspect", help="print a blob's header as JSON: of a file, or of an entry or chunk of a store",
                       description="cachegen inspect FILE: the header of a blob file. cachegen inspect STORE KEY: the entry "
                       "under KEY in the store (a blob's header, a manifest's options), or the chunk whose id starts with "
                       "KEY (8 hex digits at least, as `cachegen ls` prints them): its manifest and each blob's header.")  # fmt: skip
    p.add_argument("target", metavar="FILE|STORE", help="a blob file, or a store URL (disk, a directory, redis://...) with KEY")
    p.add_argument("key", nargs="?", default=None, metavar="KEY", help="a key of the store, or the start of a chunk id")
    p.add_argument("--namespace", default=None, help="key prefix (default: $CACHEGEN_NAMESPACE, else cachegen:)")
    p.set_defaults(func=_inspect)


def _register_ls(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("ls", aliases=["keys"], help="list a store's chunks (options, bytes, age, model) and other keys",
                       description="One line per chunk: its id (the first 16 hex digits; `cachegen inspect STORE ID` shows "
                       "it), whether its manifest is there, the options stored (levels, raw forms), bytes (on Redis: its "
                       "memory usage), age (since last use) and model fingerprint; then the pointers to partial chunks (under the "
                       "id of the prefix that finds them) and the keys that are no chunk's.")  # fmt: skip
    _store_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object per line, chunk ids whole")
    p.add_argument("--no-headers", action="store_true", help="skip reading blob headers (no model column)")
    p.set_defaults(func=_ls)


def _register_model(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("model", help="locate, download or convert a model (transformers dir, .gguf file, hub id or smollm2-135m)")
    actions = p.add_subparsers(dest="action", required=True)
    for action, func, text in [
        ("prepare", _model_prepare, "download a hub model into the Hugging Face cache, or convert a .gguf (or the bundled "
                                    "reference model) once, and print its directory"),
        ("path", _model_path, "print the model's directory without downloading or converting; exit 1 when not prepared yet"),
    ]:  # fmt: skip
        a = actions.add_parser(action, help=text, description=text)
        a.add_argument("name", nargs="?", default="smollm2-135m", help="default: smollm2-135m")
        a.add_argument("--gguf-file", default=None, help="a GGUF file of the hub repository (or directory) NAME")
        a.add_argument("--revision", default=None, help="a hub model's branch, tag or commit (default: main)")
        a.set_defaults(func=func)


def _register_profile(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("profile", help="fit the codec's profile (transform and table classes) on texts of a model")
    p.add_argument("--model", default="smollm2-135m", help="transformers dir, .gguf file, hub id or smollm2-135m")
    p.add_argument("--texts", default=None, help="JSONL file with one text per line (default: the shipped calibration text)")
    p.add_argument("--field", default="prompt")
    p.add_argument("--first", type=int, default=0, help="first record used")
    p.add_argument("--last", type=int, default=2, help="one past the last record used")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per text")
    p.add_argument("--chunk-tokens", type=int, default=1536)
    p.add_argument(
        "--layer-power",
        type=float,
        default=0.0,
        help="scale each (kind, layer)'s step by its measured sensitivity to the power -P/2 (0: one step for all)",
    )
    p.add_argument("--sensitivity-texts", type=int, default=1, help="texts the sensitivity is measured on (one forward pass per kind and layer each)")
    p.add_argument("--out", default=None, help="default: beside the model in the user cache, found by fingerprint")
    p.set_defaults(func=_profile)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400,
          "": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}  # fmt: skip


def parse_quantity(text: str, units: str) -> float:
    """``"7d"``, ``"90m"``, ``"30"`` (seconds) for ``units="time"``; ``"5G"``, ``"500MiB"``, ``"1024"`` (bytes) for sizes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m[2].lower() if m else ""
    allowed = ("s", "m", "h", "d", "w", "") if units == "time" else tuple(u for u in _UNITS if u not in ("s", "h", "d", "w"))
    if m is None or unit not in allowed:
        raise argparse.ArgumentTypeError(f"bad {'duration' if units == 'time' else 'size'} {text!r}")
    return float(m[1]) * _UNITS[unit if units == "time" or unit != "m" else "mb"]


def _open_store(args: argparse.Namespace, url: str | None = None) -> Any:
    """The store the command names (``url``, else ``args.store``, else ``$CACHEGEN_STORE``): an existing one, never
    created or repaired by a command that reads it."""
    from .ops.settings import load  # noqa: PLC0415
    from .stores.url import open_store  # noqa: PLC0415

    settings = load()
    namespace = args.namespace or settings.namespace
    if url or args.store:
        return open_store(url or args.store, namespace=namespace, cache_dir=settings.cache_dir, create=False)
    return settings.open_store(namespace=namespace, create=False)  # an error names $CACHEGEN_STORE


def _stats(args: argparse.Namespace) -> int:
    from .stores.admin import stats  # noqa: PLC0415

    with _open_store(args) as store:
        print(json.dumps(stats(store, headers=not args.no_headers), indent=2))
    return 0


def _gc(args: argparse.Namespace) -> int:
    from .stores.admin import GcPolicy, gc  # noqa: PLC0415

    policy = GcPolicy(args.older_than, None if args.max_bytes is None else int(args.max_bytes), args.model, args.orphans,
                      tier=args.tier)  # fmt: skip
    with _open_store(args) as store:
        print(json.dumps(gc(store, policy, dry_run=args.dry_run), indent=2))
    return 0


def _store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", nargs="?", default=None, help="store URL (default: $CACHEGEN_STORE, else disk)")
    p.add_argument("--namespace", default=None, help="key prefix (default: $CACHEGEN_NAMESPACE, else cachegen:)")


def _register_stats(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("stats", help="what a store holds: entries, bytes per level, chunks, models (JSON)")
    _store_arguments(p)
    p.add_argument("--no-headers", action="store_true", help="skip reading blob headers (no models by fingerprint)")
    p.set_defaults(func=_stats)


def _register_gc(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("gc", help="evict whole chunks from a store by age, total size or model (JSON report)")
    _store_arguments(p)
    p.add_argument("--older-than", type=lambda t: parse_quantity(t, "time"), default=None, metavar="AGE",
                   help="chunks not stored (disk) or used (Redis) for AGE: 90s, 30m, 12h, 7d")  # fmt: skip
    p.add_argument("--max-bytes", type=lambda t: parse_quantity(t, "size"), default=None, metavar="SIZE",
                   help="then the oldest chunks until the store holds at most SIZE: 500M, 5G")  # fmt: skip
    p.add_argument("--model", default=None, metavar="FP", help="chunks of the model whose fingerprint starts with FP")
    p.add_argument("--orphans", action="store_true", help="chunks without a manifest, 10 minutes after their last write, "
                   "and pointers whose chunk is gone (deleted whenever gc deletes chunks too)")  # fmt: skip
    p.add_argument("--tier", choices=("all", "raw"), default="all",
                   help="raw: delete raw (16-bit) forms only, each by its own age; their chunks stay hits at their levels")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="report what would be deleted, delete nothing")
    p.set_defaults(func=_gc)


#: Every subcommand, in the order ``--help`` lists them; append yours.
REGISTRY: list[Register] = [_register_inspect, _register_ls, _register_model, _register_profile, _register_stats, _register_gc]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand of :data:`REGISTRY`."""
    ap = argparse.ArgumentParser(prog="cachegen", description="CacheGen KV-cache compression tools")
    ap.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    ap.add_argument("--traceback", action="store_true", help="show the full traceback of an error (for bug reports)")
    sub = ap.add_subparsers(dest="command", required=True)
    for register in REGISTRY:
        register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``cachegen`` console script; returns the exit code: 0, 2 on any error (printed as
    ``error: ...``, without a traceback unless ``--traceback``), 130 when interrupted."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="cachegen: %(message)s")
    logging.getLogger("cachegen_core").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`cachegen ls | head`): not an error of the command
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0
    except Exception as e:  # every failure of a command: one line, exit code 2
        if args.traceback:
            raise
        print(f"error: {_message(e)}", file=sys.stderr)
        return 2


def _message(e: Exception) -> str:
    """One line saying what went wrong: the error's own words for the errors a command expects, its type as well
    for any other (a bug: ``--traceback`` shows where)."""
    from .errors import CacheGenError  # noqa: PLC0415

    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    if isinstance(e, (CacheGenError, OSError, ValueError, LookupError, ImportError)):
        return str(e)
    return f"{type(e).__name__}: {e} (run with --traceback for where)"


if __name__ == "__main__":
    sys.exit(main())
