"""Bounded fuzz run of the container parser, ``KVCodec.decode`` and every coder; JSON lines out.

    python -m benchmarks.fuzz [--quick] [--inputs 100000] [--seconds 900] [--seed 0] [--out F]
                              [--atheris-seconds S] [--libfuzzer-seconds S] [--artifacts DIR]

The structured fuzzer of ``cachegen_core.testing.fuzz`` runs until ``--inputs`` inputs or
``--seconds`` have passed; one JSON line per target (``container``, ``codec``,
``coder-<name>`` for every coder in ``available_coders()``) and a ``total`` line are
printed (``--quick``: 2000 inputs). ``--atheris-seconds`` adds a coverage-guided atheris run
of ``KVCodec.decode`` (when atheris is installed) and ``--libfuzzer-seconds`` a libFuzzer +
ASan/UBSan run of the native decoder (when clang is installed), each in a subprocess, each one
more line.
Findings (crash, hang, overalloc, wrong_kv_accepted) are written to ``--artifacts`` and
make the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Rows, parser

ROOT = Path(__file__).resolve().parents[1]


def structured(
    inputs: int, seconds: float, seed: int, trace_every: int, quiet: bool, artifacts: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the structured fuzzer; (JSON rows, findings). Findings are also written as they come."""
    from cachegen_core.testing import fuzz as H  # noqa: PLC0415

    def progress(rep: Any) -> None:
        if rep.findings:
            (artifacts / "findings.jsonl").write_text("".join(json.dumps(f) + "\n" for f in rep.findings))
        if not quiet:
            print(f"# {rep.inputs} inputs, {rep.seconds:.0f}s, findings {len(rep.findings)}", file=sys.stderr, flush=True)

    H.warm_up()
    rep = H.run(inputs, seconds, seed=seed, trace_every=trace_every, progress=progress)
    prof = H.run_profiles(max(200, inputs // 20), seed=seed)
    rep.targets["profile-file"] = prof
    rows = [{"target": name, **t.summary()} for name, t in rep.targets.items()]
    s = rep.summary()
    rows.append({"target": "total", "inputs": s["inputs"], "seconds": s["seconds"], "inputs_per_s": s["inputs_per_s"],
                 "seeds": s["seeds"], "coders": s["coders"], "rss_growth_mb": s["rss_growth_mb"],
                 "findings": s["findings"], "trace_every": trace_every})  # fmt: skip
    return rows, rep.findings


def atheris_run(seconds: float, workdir: Path) -> dict[str, Any]:
    """Coverage-guided atheris run of ``cachegen_core.testing.fuzz.atheris_target`` in a subprocess."""
    try:
        import atheris  # noqa: F401, PLC0415
    except ImportError:
        return {"target": "atheris-codec", "available": False, "reason": "pip install atheris"}
    corpus = workdir / "atheris-corpus"
    cmd = [sys.executable, "-m", "cachegen_core.testing.fuzz.atheris_target", f"-max_total_time={int(seconds)}", "-timeout=5",
           "-rss_limit_mb=4096", f"-artifact_prefix={workdir}/atheris-", str(corpus)]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT, timeout=seconds + 300)
    log = proc.stdout + proc.stderr
    done = re.search(r"Done (\d+) runs", log)
    cov = re.findall(r"cov: (\d+)", log)
    artifacts = sorted(p.name for p in workdir.glob("atheris-*") if p.is_file())
    return {
        "target": "atheris-codec",
        "available": True,
        "inputs": int(done.group(1)) if done else 0,
        "seconds": round(time.perf_counter() - t, 1),
        "coverage_edges": int(cov[-1]) if cov else 0,
        "crashes": len([a for a in artifacts if "crash" in a or "oom" in a]) or int(proc.returncode != 0),
        "hangs": len([a for a in artifacts if "timeout" in a]),
        "returncode": proc.returncode,
        **({"log_tail": log[-2000:]} if proc.returncode else {}),
    }


def arguments() -> argparse.ArgumentParser:
    ap = parser(__doc__, model=False, data=False, quick_help="2000 structured inputs (as benchmarks.robustness --quick)")
    ap.add_argument("--inputs", type=int, default=100_000, help="structured inputs (default 100000)")
    ap.add_argument("--seconds", type=float, default=1800, help="time limit of the structured run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-every", type=int, default=1, help="watch allocations on every n-th input (0: never)")
    ap.add_argument("--atheris-seconds", type=float, default=0, help="also run atheris on KVCodec.decode")
    ap.add_argument("--libfuzzer-seconds", type=float, default=0, help="also run libFuzzer+ASan on the native decoder")
    ap.add_argument("--artifacts", type=Path, default=None, help="where findings are written (default: a temp dir)")
    ap.add_argument("--quiet", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    if args.quick:
        args.inputs = min(args.inputs, 2000)
    with Rows("fuzz", args.out, argv) as out:
        return run(args, out)


def run(args: argparse.Namespace, out: Rows) -> int:
    sys.path.insert(0, str(ROOT))
    artifacts = args.artifacts or Path(tempfile.mkdtemp(prefix="cachegen-fuzz-"))
    artifacts.mkdir(parents=True, exist_ok=True)
    bad = 0
    if args.inputs > 0:
        rows, findings = structured(args.inputs, args.seconds, args.seed, args.trace_every, args.quiet, artifacts)
        for row in rows:
            out.emit(row)
        if findings:
            (artifacts / "findings.jsonl").write_text("".join(json.dumps(f) + "\n" for f in findings))
            print(f"# {len(findings)} findings written to {artifacts / 'findings.jsonl'}", file=sys.stderr)
        bad += len(findings)
    if args.atheris_seconds > 0:
        row = atheris_run(args.atheris_seconds, artifacts)
        out.emit(row)
        bad += row.get("crashes", 0) + row.get("hangs", 0)
    if args.libfuzzer_seconds > 0:
        from cachegen_core.testing.fuzz import native  # noqa: PLC0415

        row = {"target": "libfuzzer-native-decode", **native.run(args.libfuzzer_seconds, workdir=artifacts / "libfuzzer")}
        out.emit(row)
        bad += row.get("crashes", 0) + row.get("hangs", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
