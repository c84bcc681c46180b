"""No unsafe deserialisation or code execution anywhere near stored bytes: an AST scan of the source.

Whoever can write to a shared KV store (or drop a profile file beside a model) controls
the bytes the decoder reads. Those bytes must only ever be *parsed* (JSON, raw arrays,
safetensors), never unpickled or executed. This test walks the syntax tree of every
module of the packages (and of the CLI, benchmarks, examples and tests, which have no
legitimate use for any of it either) and fails naming ``file:line`` for:

- importing ``pickle``/``cPickle``/``_pickle``/``dill``/``cloudpickle``/``joblib``/
  ``jsonpickle``/``marshal``/``shelve`` (also through ``__import__`` or
  ``importlib.import_module`` with a constant name);
- calling ``eval``, ``exec`` or ``compile`` (the builtins; ``model.eval()`` is fine),
  ``torch.load``, ``torch.jit.load``, ``pandas.read_pickle``, ``yaml.load`` without a
  safe loader, ``yaml.unsafe_load``;
- ``numpy.load`` with ``allow_pickle`` set to anything but the constant ``False``
  (or with ``**kwargs`` that could set it);
- in the packages: a ``diskcache`` cache built without ``disk=`` (its default ``Disk``
  pickles every non-bytes value and unpickles what it finds in the directory).

Import aliases are resolved (``import torch as t; t.load(...)``, ``from pickle import
loads as l``), so renaming does not hide a call.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cachegen_core", "langchain_cachegen")
ALSO_SCANNED = ("benchmarks", "examples", "tests")

BANNED_MODULES = frozenset({"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "jsonpickle", "marshal", "shelve"})
BANNED_BUILTINS = frozenset({"eval", "exec", "compile"})
BANNED_CALLS = frozenset({
    "torch.load", "torch.jit.load", "torch.serialization.load", "pandas.read_pickle", "yaml.unsafe_load",
    "yaml.full_load", "numpy.lib.format.read_array",
})  # fmt: skip
SAFE_YAML_LOADERS = frozenset({"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader"})
DISKCACHE_CACHES = frozenset({
    "diskcache.Cache", "diskcache.FanoutCache", "diskcache.Index", "diskcache.Deque", "diskcache.core.Cache",
    "diskcache.fanout.FanoutCache",
})  # fmt: skip


class _Scanner(ast.NodeVisitor):
    """Collects findings for one module; ``aliases`` maps local names to dotted module paths."""

    def __init__(self, filename: str, package_rules: bool) -> None:
        self.filename = filename
        self.package_rules = package_rules
        self.aliases: dict[str, str] = {}
        self.found: list[str] = []

    def _hit(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.filename}:{getattr(node, 'lineno', 0)}: {what}")

    def _check_module(self, node: ast.AST, module: str) -> None:
        if module.split(".")[0] in BANNED_MODULES:
            self._hit(node, f"imports {module}")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._check_module(node, a.name)
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                top = a.name.split(".")[0]
                self.aliases[top] = top
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0:
            self._check_module(node, module)
        for a in node.names:
            full = f"{module}.{a.name}" if module else a.name
            self.aliases[a.asname or a.name] = full if node.level == 0 else f".{a.name}"
        self.generic_visit(node)

    def resolve(self, node: ast.AST) -> str:
        """Dotted name of an expression, import aliases resolved ('' if not a plain name chain)."""
        if isinstance(node, ast.Name):
            base = self.aliases.get(node.id, node.id)
            return {"np": "numpy", "pd": "pandas"}.get(base, base) if base == node.id else base
        if isinstance(node, ast.Attribute):
            inner = self.resolve(node.value)
            return f"{inner}.{node.attr}" if inner else ""
        return ""

    def visit_Call(self, node: ast.Call) -> None:
        name = self.resolve(node.func)
        kwargs = {k.arg: k.value for k in node.keywords}
        splat = None in kwargs
        if isinstance(node.func, ast.Name) and node.func.id in BANNED_BUILTINS and node.func.id not in self.aliases:
            self._hit(node, f"calls builtin {node.func.id}()")
        elif name in BANNED_CALLS:
            self._hit(node, f"calls {name}")
        elif name == "numpy.load":
            ap = kwargs.get("allow_pickle")
            if splat or (ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False)):
                self._hit(node, "calls numpy.load with allow_pickle not False")
        elif name == "yaml.load":
            loader = kwargs.get("Loader", node.args[1] if len(node.args) > 1 else None)
            if loader is None or self.resolve(loader) not in SAFE_YAML_LOADERS:
                self._hit(node, "calls yaml.load without a safe loader")
        elif name in ("__import__", "importlib.import_module") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self._check_module(node, arg.value)
        elif self.package_rules and name in DISKCACHE_CACHES and "disk" not in kwargs and not splat:
            self._hit(node, f"builds {name} without disk= (the default Disk pickles)")
        self.generic_visit(node)


def findings(source: str, filename: str, *, package_rules: bool = True) -> list[str]:
    """Every unsafe construct of one module's source, as ``file:line: what``."""
    scanner = _Scanner(filename, package_rules)
    scanner.visit(ast.parse(source, filename))
    return scanner.found


def _sources(dirs: tuple[str, ...]) -> list[Path]:
    return sorted(p for d in dirs if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py"))


# ------------------------------------------------------------------ the scanner itself
@pytest.mark.parametrize(
    "src",
    [
        "import pickle",
        "import cPickle as cp",
        "from _pickle import loads",
        "from dill import loads",
        "import joblib",
        "import marshal",
        "import shelve",
        "from jsonpickle import decode",
        "import torch\ntorch.load('x')",
        "import torch as t\nt.load('x', weights_only=True)",
        "from torch import load\nload('x')",
        "from torch import load as l\nl('x')",
        "import torch\ntorch.jit.load('m.pt')",
        "eval('1')",
        "exec('x = 1')",
        "compile('1', 'f', 'eval')",
        "import numpy as np\nnp.load('f', allow_pickle=True)",
        "import numpy\nnumpy.load('f', allow_pickle=flag)",
        "import numpy as np\nnp.load('f', **opts)",
        "from numpy import load\nload('f', allow_pickle=True)",
        "import pandas as pd\npd.read_pickle('f')",
        "import yaml\nyaml.load(s)",
        "import yaml\nyaml.load(s, Loader=yaml.FullLoader)",
        "import yaml\nyaml.unsafe_load(s)",
        "__import__('pickle')",
        "import importlib\nimportlib.import_module('marshal')",
        "import diskcache\ndiskcache.Cache('/tmp/x')",
        "from diskcache import FanoutCache\nFanoutCache('/tmp/x')",
    ],
)
def test_scanner_flags(src):
    assert len(findings(src, "bad.py")) == 1, (src, findings(src, "bad.py"))


@pytest.mark.parametrize(
    "src",
    [
        "model.eval()",
        "self.model.eval()",
        "import numpy as np\nnp.load('f')",
        "import numpy as np\nnp.load('f', allow_pickle=False)",
        "import re\nre.compile('x')",
        "import yaml\nyaml.load(s, Loader=yaml.SafeLoader)",
        "import yaml\nyaml.safe_load(s)",
        "import json\njson.loads(s)",
        "from safetensors.numpy import load_file\nload_file('f')",
        "import diskcache\ndiskcache.Cache('/tmp/x', disk=MyDisk)",
        "x = 'import pickle; eval(1)'",  # text in a string is not code
    ],
)
def test_scanner_passes(src):
    assert findings(src, "ok.py") == []


def test_scanner_names_file_and_line():
    assert findings("import json\n\nimport pickle\n", "pkg/mod.py") == ["pkg/mod.py:3: imports pickle"]


# ---------------------------------------------------------------------------- the scan
def test_packages_never_deserialise_unsafely():
    files = _sources(PACKAGES)
    assert len(files) > 10, "the scan found no sources: wrong root?"
    hits = [h for p in files for h in findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert hits == [], "\n".join(hits)


def test_cli_benchmarks_examples_and_tests_do_not_either():
    files = [p for p in _sources(ALSO_SCANNED) if p.name != Path(__file__).name]
    hits = [h for p in files for h in findings(p.read_text(), str(p.relative_to(ROOT)), package_rules=False)]
    assert hits == [], "\n".join(hits)
