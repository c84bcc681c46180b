"""``cachegen_core.openmp.release``: a thread done with torch lets its OpenMP worker threads go (they would slow the
scheduler's steps), and computes as before afterwards. Run in a fresh interpreter: the count of the process's threads
is the measure, and no other test's threads may come and go meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cachegen_core import openmp

SCRIPT = r"""
import json, os, threading, time
import torch
from cachegen_core import openmp

torch.set_num_threads(2)
def tasks():
    return len(os.listdir("/proc/self/task"))
out = {}
def work():
    x = torch.randn(8_000_000)
    out["value"] = float((x * 0 + 2).sum())  # a parallel op: this thread's team of 2 starts (sums of 2s < 2**24: exact)
    out["with"] = tasks()
    openmp.release()
    deadline = time.monotonic() + 5
    while tasks() >= out["with"] and time.monotonic() < deadline:
        time.sleep(0.01)
    out["released"] = tasks()
    out["again"] = float((torch.ones(4_000_000) * 3).sum())  # computes after, on a new team (every partial sum < 2**24: exact)
t = threading.Thread(target=work)
t.start()
t.join()
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or openmp._libgomp() is None, reason="torch runs on libgomp on Linux only")
def test_a_thread_that_releases_lets_its_openmp_workers_go_and_computes_as_before():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["value"] == 16_000_000 and out["again"] == 12_000_000
    assert out["released"] < out["with"]  # its worker thread is gone


def test_release_is_harmless_in_a_thread_without_openmp_workers():
    openmp.release()
    openmp.release()
