"""The coverage-guided atheris target starts, instruments the library (not the harness) and finds nothing in a short run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cachegen_core.testing import in_ci

ROOT = Path(__file__).resolve().parents[2]


def test_atheris_target_short_run(tmp_path):
    if importlib.util.find_spec("atheris") is None:
        msg = "atheris not installed (the fuzz extra; make test installs it)"
        if in_ci():
            pytest.fail(msg + "; it is required when CI is set", pytrace=False)
        pytest.skip(msg)
    cmd = [sys.executable, "-m", "cachegen_core.testing.fuzz.atheris_target", "-runs=300", "-seed=1", "-timeout=20",
           f"-artifact_prefix={tmp_path}/", str(tmp_path / "corpus")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    instrumented = set(re.findall(r"Instrumenting (\S+)", log))
    assert {"cachegen_core.codec.kvcodec", "cachegen_core.codec.format", "cachegen_core.coders.base"} <= instrumented, instrumented
    assert not any(m.startswith("cachegen_core.testing") for m in instrumented), instrumented
    cov = [int(c) for c in re.findall(r"cov: (\d+)", log)]
    assert cov and cov[-1] > 100, log[-2000:]  # coverage of the decoder is seen, not only of the entry point
    assert (tmp_path / "corpus" / "seed-000").is_file()
