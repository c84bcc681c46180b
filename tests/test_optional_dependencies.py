"""What works without the optional dependencies: the stores without redis-py, the test helpers without test tools.

Each check runs in a fresh interpreter where the missing packages are made unimportable
(``sys.modules[name] = None``), since this process has them all loaded.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (cwd: the checkout) where ``modules`` cannot be imported."""
    prelude = f"import sys\nfor m in {modules!r}:\n    sys.modules[m] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_memory_and_disk_stores_work_without_redis_py(tmp_path):
    proc = run_without(
        ["redis"],
        f"""
        from cachegen_core.stores import DiskCacheStore, MemoryStore
        for store in (MemoryStore(), DiskCacheStore({str(tmp_path)!r})):
            store.put("k", b"v")
            assert store.get("k") == b"v"
        import langchain_cachegen  # the LangChain face does not need redis-py either
        print("ok")
    """,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_redis_store_without_redis_py_names_the_extra():
    proc = run_without(
        ["redis"],
        """
        try:
            from cachegen_core.stores import RedisStore
        except ImportError as e:
            print(e)
        import cachegen_core.stores as stores
        try:
            stores.RedisStore("redis://localhost:6379")
        except ImportError as e:
            print(e)
    """,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr
    assert len(lines) == 2 and all("pip install 'langchain-cachegen[redis]'" in line for line in lines), proc.stdout


def test_testing_helpers_import_without_test_tools():
    """``cachegen_core.testing`` is library code: no pytest, hypothesis, atheris or redis-py at import time."""
    proc = run_without(
        ["pytest", "_pytest", "hypothesis", "atheris", "redis"],
        """
        import cachegen_core.testing as t
        from cachegen_core.testing import fuzz
        from cachegen_core.testing.fuzz import (blobs, coder_cases, edits, mutations, native, oracle, profile_files,
                                                runner, seeds)
        assert t.words(0, 3).count(" ") == 2
        assert callable(fuzz.run) and callable(fuzz.make_seeds)
        print("ok")
    """,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_importing_the_fuzz_package_loads_no_library_module():
    """The atheris target instruments the library's modules as it imports them, after this package."""
    proc = run_without(
        [],
        """
        import sys
        import cachegen_core.testing.fuzz
        print(sorted(m for m in sys.modules if m.startswith("cachegen_core.") and not m.startswith("cachegen_core.testing")))
    """,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)
