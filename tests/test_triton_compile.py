"""The GPU decoder's Triton kernels compile for a real GPU, here, without one.

CI runs the kernels in Triton's interpreter, which accepts what the compiler refuses: a kernel that read a
plain module global compiled on no GPU at all (found on an H100, 2026-11-28). So every configuration the
decoder launches is also compiled for sm_90 down to machine code (Triton's bundled ptxas; no GPU needed), in a
process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachegen_core.coders.triton_decoder import _triton_error
from cachegen_core.testing.redis_server import in_ci
from tests.triton_compile import configurations

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_configuration_compiles_for_an_h100(tmp_path):
    reason = _triton_error()
    if reason is not None:
        if in_ci():
            pytest.fail(f"{reason} (the GPU decoder's kernels must compile when CI is set)", pytrace=False)
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled, not read back from an earlier run's cache
    run = subprocess.run([sys.executable, "-m", "tests.triton_compile"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if run.stdout.startswith("SKIP"):
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    compiled = [line for line in run.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == len(configurations()) and all("cubin=0" not in line for line in compiled)
