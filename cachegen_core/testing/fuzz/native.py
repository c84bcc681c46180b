"""Build and run the libFuzzer target of the native coder (``csrc/fuzz/native_decode_fuzzer.cpp``) under ASan/UBSan.

Needs a source checkout (the C++ sources live in ``csrc/``, beside the package) and
``clang++`` with the libFuzzer runtime (Debian: ``apt-get install clang
libclang-rt-14-dev``); ``build`` returns None where any of them is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CSRC = Path(__file__).resolve().parents[3] / "csrc"  # cachegen_core/testing/fuzz/ -> the checkout's csrc/
TARGET = CSRC / "fuzz" / "native_decode_fuzzer.cpp"
SOURCES = [CSRC / "rans_cpu.cpp"]
FLAGS = ["-std=c++17", "-g", "-O1", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all", "-pthread"]


def compiler() -> str | None:
    """A clang++ on PATH (plain or versioned), or None."""
    for name in ("clang++", "clang++-18", "clang++-17", "clang++-16", "clang++-15", "clang++-14"):
        path = shutil.which(name)
        if path:
            return path
    return None


def build(out_dir: Path) -> tuple[Path | None, str]:
    """Compile the fuzzer into ``out_dir``; (path, '') or (None, why not)."""
    cxx = compiler()
    if cxx is None:
        return None, "clang++ not found (apt-get install clang libclang-rt-14-dev)"
    if not all(p.exists() for p in (TARGET, *SOURCES)):
        return None, f"native coder sources not found in {CSRC} (a source checkout is needed)"
    exe = out_dir / "native_decode_fuzzer"
    cmd = [cxx, *FLAGS, "-I", str(CSRC), str(TARGET), *map(str, SOURCES), "-o", str(exe)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if proc.returncode:
        return None, f"build failed: {proc.stderr[-1500:]}"
    return exe, ""


def run(seconds: float, *, runs: int = -1, workdir: Path | None = None, seed: int = 1) -> dict[str, Any]:
    """Fuzz for ``seconds`` (or ``runs`` inputs); summary with inputs, crashes (0/1), hangs, log tail."""
    own = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="cachegen-libfuzzer-")) if workdir is None else workdir
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        exe, why = build(workdir)
        if exe is None:
            return {"available": False, "reason": why}
        corpus = workdir / "corpus"
        corpus.mkdir(exist_ok=True)
        args = [str(exe), f"-max_total_time={max(1, int(seconds))}", f"-runs={runs}", "-timeout=2",
                "-rss_limit_mb=2048", "-malloc_limit_mb=1024", f"-seed={seed}", "-print_final_stats=1",
                f"-artifact_prefix={workdir}/", str(corpus)]  # fmt: skip
        env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1", "UBSAN_OPTIONS": "print_stacktrace=1"}
        t = time.perf_counter()
        proc = subprocess.run(args, check=False, capture_output=True, text=True, timeout=seconds + 120, env=env)
        log = proc.stdout + proc.stderr
        done = re.search(r"Done (\d+) runs", log)
        execs = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
        inputs = int(done.group(1)) if done else int(execs.group(1)) if execs else 0
        artifacts = sorted(p.name for p in workdir.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-", "leak-")))
        return {
            "available": True,
            "inputs": inputs,
            "seconds": round(time.perf_counter() - t, 1),
            "crashes": sum(a.startswith(("crash-", "leak-", "oom-")) for a in artifacts) or int(proc.returncode != 0 and not artifacts),
            "hangs": sum(a.startswith("timeout-") for a in artifacts),
            "returncode": proc.returncode,
            "artifacts": artifacts,
            "log_tail": log[-3000:] if proc.returncode else "",
        }
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
