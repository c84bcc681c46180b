"""A progress bar on long cold work: on a terminal only, and off by argument or CACHEGEN_PROGRESS=0."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import os, sys
    from cachegen_core.engine import KVEngine
    from cachegen_core.stores import MemoryStore
    from cachegen_core.testing import make_tiny_llama, make_tiny_tokenizer, words
    model, tok = make_tiny_llama(), make_tiny_tokenizer()
    for case, progress, env in [("default", None, None), ("off", False, None), ("env-off", None, "0")]:
        if env is not None:
            os.environ["CACHEGEN_PROGRESS"] = env
        print(f"<{case}>", file=sys.stderr, flush=True)
        eng = KVEngine(model, tok, store=MemoryStore(), chunk_tokens=32, background=False, progress=progress)
        assert len(eng.store_kv(words(1, 4 * 32 + 3))) == 4
        assert len(eng.store_documents([words(2, 40), words(3, 40)]).stored) == 2
        print(f"</{case}>", file=sys.stderr, flush=True)
    print("done", flush=True)
""")


def cases(stderr: str) -> dict[str, str]:
    """What each case of the script wrote to stderr."""
    return {c: stderr.split(f"<{c}>")[1].split(f"</{c}>")[0] for c in ("default", "off", "env-off")}


def run(*, tty: bool) -> str:
    """stderr of the script, run with stderr on a pseudo-terminal (``tty``) or a pipe."""
    full_env = {k: v for k, v in os.environ.items() if k != "CACHEGEN_PROGRESS"}
    cmd = [sys.executable, "-c", SCRIPT]
    if not tty:
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
        return proc.stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=120)
    os.close(master)
    assert proc.returncode == 0 and "done" in out
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_a_bar_on_a_terminal_and_none_otherwise():
    on_tty, off_tty = cases(run(tty=True)), cases(run(tty=False))
    for bar in ("encoding KV chunks", "caching documents"):
        assert bar in on_tty["default"]
        assert bar not in on_tty["off"]  # progress=False
        assert bar not in on_tty["env-off"]  # CACHEGEN_PROGRESS=0
        assert all(bar not in err for err in off_tty.values())  # a log file or CI: silent
