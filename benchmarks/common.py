"""The benchmarks' harness: shared options, data, JSON-lines output, the model, timing.

Every benchmark (``python -m benchmarks.<name>``) builds its options with :func:`parser`, so they
share ``--quick`` (a short run), ``--out F`` (append the rows to F, after a ``meta`` row: command,
date, machine, versions, commit), and where they apply ``--data F`` (LongChat-style JSON lines,
fields ``prompt`` and ``label``; default: the dev set in ``../shared/data/`` beside the checkout,
e.g. the demo excerpt ``examples/data/longchat_demo.jsonl`` works too), ``--model M`` and
``--device D``. Rows go through :class:`Rows`: one JSON line each on stdout and in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
LONGCHAT = DATA / "longchat_dev.jsonl"
TRACES = DATA / "bandwidth_traces_dev.jsonl"
DEFAULT_MODEL = "smollm2-135m"
#: Transcripts 0-9 fitted the reference model's profile and 0-11 tuned the codec: measurements start at 12.
HELD_OUT = 12


# ------------------------------------------------------------------ options
def parser(doc: str | None, *, model: bool = True, data: bool = True, device: bool = False,
           quick_help: str = "a short run") -> argparse.ArgumentParser:  # fmt: skip
    """A benchmark's argument parser with the shared options: ``--quick``, ``--out F``, and ``--data F``,
    ``--model M``, ``--device D`` where the benchmark has them (``data``, ``model``, ``device``)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", type=Path, default=None, metavar="F",
                    help="also append the JSON lines to F, after a meta row (command, date, machine, versions, commit)")  # fmt: skip
    if data:
        add_data_option(ap)
    if model:
        ap.add_argument("--model", default=DEFAULT_MODEL, metavar="M", help="model name or path (default: %(default)s)")
    if device:
        ap.add_argument("--device", default="cpu", metavar="D", help="torch device of the model (default: %(default)s)")
    return ap


def add_data_option(ap: argparse.ArgumentParser) -> None:
    """``--data F``: the transcripts to read (default: the LongChat dev set in ``../shared/data``)."""
    ap.add_argument("--data", type=Path, default=LONGCHAT, metavar="F",
                    help=f"LongChat-style JSON-lines transcripts (default: {LONGCHAT})")  # fmt: skip


# ------------------------------------------------------------------ data
def read_jsonl(path: str | Path, field: str | None = None) -> list[Any]:
    """Records of a JSON-lines file (or one field of each)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found: the dev data lives in ../shared/data beside the checkout "
                                "(or pass another file with --data / --traces)")  # fmt: skip
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r[field] for r in rows] if field else rows


def transcripts(path: str | Path, first: int = 0, count: int | None = None) -> list[str]:
    """The texts (``prompt``) of records ``first``, ``first + 1``, ... (``count`` of them, or all); ``SystemExit``
    saying so when there is none (a data file shorter than the held-out offset)."""
    texts = read_jsonl(path, "prompt")[first:]
    if not texts:
        raise SystemExit(f"{path} has no record from number {first} on (records 0-{HELD_OUT - 1} are held back for tuning)")
    return texts if count is None else texts[:count]


def long_transcripts(path: str | Path, first: int, count: int, tokenizer: Any, n_tokens: int) -> list[str]:
    """``count`` texts of at least ``n_tokens`` tokens where the data has that many: transcripts ``first``, ``first + 1``,
    ... joined one after another as far as each needs (a 30K-token context of 10K-token LongChat transcripts)."""
    pool = transcripts(path, first)
    out, i = [], 0
    for _ in range(count):
        parts = [pool[i % len(pool)]]
        i += 1
        while len(tokenizer("\n".join(parts))["input_ids"]) < n_tokens and len(parts) < len(pool):
            parts.append(pool[i % len(pool)])
            i += 1
        out.append("\n".join(parts))
    return out


def transcript_ids(tokenizer: Any, texts: list[str], n_tokens: int) -> Iterator[list[int]]:
    """Token ids of each transcript, cut to ``n_tokens`` (skipping shorter ones)."""
    for t in texts:
        ids = tokenizer(t)["input_ids"]
        if len(ids) >= n_tokens:
            yield ids[:n_tokens]


def results(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a benchmark's ``--out`` file, without its meta rows."""
    return [r for r in read_jsonl(path) if r.get("row") != "meta"]


# ------------------------------------------------------------------ output
def emit(record: dict[str, Any], out: TextIO | None = None) -> None:
    """Print one JSON line (and append it to the open file ``out`` if given)."""
    line = json.dumps(record, sort_keys=False)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


class Rows:
    """Where a benchmark's rows go: each printed as one JSON line, and appended to ``out`` when given.

    Opening ``out`` writes a :func:`meta` row there first (not on stdout, which carries rows only):
    what produced the rows that follow, for ``docs/results.md`` to cite. ``argv``: the arguments the
    benchmark parsed (default: this process's). Use as a context manager; it closes ``out``.
    """

    def __init__(self, benchmark: str, out: str | Path | None = None, argv: Sequence[str] | None = None) -> None:
        self.file: TextIO | None = None
        self.rows: list[dict[str, Any]] = []  # every row emitted, for a plot at the end
        if out is not None:
            self.file = open(out, "a")  # noqa: SIM115  # closed by __exit__
            self.file.write(json.dumps(meta(benchmark, argv)) + "\n")
            self.file.flush()

    def emit(self, record: dict[str, Any]) -> None:
        """One row: a JSON line on stdout and in the file."""
        self.rows.append(record)
        emit(record, self.file)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def __enter__(self) -> Rows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def meta(benchmark: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``meta`` row: the command, the date (UTC), the machine, torch and transformers versions, the commit."""
    argv = sys.argv[1:] if argv is None else argv
    return {
        "row": "meta",
        "benchmark": benchmark,
        "command": shlex.join(["python", "-m", f"benchmarks.{benchmark}", *map(str, argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": cpu_name(),
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "commit": _commit(),
    }


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# ------------------------------------------------------------------ stores
@contextlib.contextmanager
def fresh_store(kind: str, redis_url: str | None = None, **redis_options: Any) -> Iterator[Any]:
    """An empty store for one run, closed on exit: ``memory``; ``disk`` (diskcache in a temporary directory, removed
    afterwards); ``redis`` or ``redis@<link>`` (a ``RedisStore`` at ``redis_url`` with ``redis_options``, or on a
    throwaway redis-server on loopback when no URL is given)."""
    from cachegen_core.stores import DiskCacheStore, MemoryStore, RedisStore  # noqa: PLC0415
    from cachegen_core.testing import running_redis_server  # noqa: PLC0415

    with contextlib.ExitStack() as stack:
        if kind == "memory":
            store: Any = MemoryStore()
        elif kind == "disk":
            store = DiskCacheStore(stack.enter_context(tempfile.TemporaryDirectory(prefix="cachegen-bench-")))
        elif kind.startswith("redis"):
            store = RedisStore(redis_url or stack.enter_context(running_redis_server()).url, **redis_options)
        else:
            raise ValueError(f"unknown store {kind!r} (memory, disk, redis)")
        yield stack.enter_context(store)


# ------------------------------------------------------------------ model and timing
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


#: A 7B-class decoder's shape (Mistral-7B, Llama-3-8B: 32 layers, 32 query and 8 KV heads of 128, MLP 14336).
SHAPE_7B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336}
SHAPED = "llama-7b-shaped"


def load(model: str = DEFAULT_MODEL, *, device: str = "cpu", dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """The model and tokenizer (reference model by default), in eval mode, on ``device``.

    ``llama-7b-shaped`` (or ``llama-shaped:layers=2,hidden=256,...``, any keys of :data:`SHAPE_7B`): a Llama of
    that shape with random weights (seed 0) and the reference model's tokenizer, built on ``device`` in ``dtype``
    (default bfloat16): for timing only, its outputs mean nothing. ``$CACHEGEN_TOKENIZER_DIR``, when set, is the
    tokenizer's directory instead (a machine without the reference model, e.g. a GPU box).

    Its attention is the one ``KVEngine.from_pretrained`` gives the models it loads (``engine/model/attention.py``): every
    benchmark, baselines included, times what a user of ``from_pretrained`` or ``CacheGenLLM.from_model_id`` gets.
    """
    from cachegen_core.engine.model.attention import use_gqa_attention  # noqa: PLC0415
    from cachegen_core.models import load_model  # noqa: PLC0415

    t = time.perf_counter()
    if is_shaped(model):
        m, tok = shaped_model(model, device, dtype or torch.bfloat16)
    else:
        m, tok = load_model(model, device=device, dtype=dtype)
    use_gqa_attention(m)
    print(f"# loaded {model} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return m, tok


def is_shaped(model: str) -> bool:
    """Whether ``model`` names a random-init shaped model (see :func:`load`)."""
    return model == SHAPED or model.startswith("llama-shaped")


def shaped_model(spec: str, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """A random-init Llama of the shape ``spec`` names (see :func:`load`), with the reference tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    from cachegen_core.models import resolve_model  # noqa: PLC0415

    shape = dict(SHAPE_7B)
    for item in filter(None, spec.partition(":")[2].split(",")):
        key, _, value = item.partition("=")
        if key not in shape:
            raise ValueError(f"unknown shape key {key!r} in {spec!r} (known: {sorted(shape)})")
        shape[key] = int(value)
    source = os.environ.get("CACHEGEN_TOKENIZER_DIR") or resolve_model(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(source, local_files_only=True)  # its tokenizer alone
    config = LlamaConfig(vocab_size=len(tok), hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                         num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], max_position_embeddings=32768, rope_theta=1e6,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tok.eos_token_id
    model.name_or_path = spec
    return model.eval(), tok


@torch.no_grad()
def context_kv(model: Any, ids: list[int]) -> Any:
    """Real KV cache of ``ids`` on ``model``."""
    from cachegen_core.hfcompat import output_cache  # noqa: PLC0415
    from cachegen_core.kv import KVCache  # noqa: PLC0415

    out = model(torch.tensor([ids], device=model.device), use_cache=True)
    return KVCache.from_dynamic_cache(output_cache(out))
