"""The structure docs/architecture.md describes, checked on the code: one-way imports, no cycles,
no LangChain in the core, nothing importing tests/, no module over 400 lines."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400

#: Each layer of cachegen_core may import only the layers listed before it (docs/architecture.md).
LAYERS = [
    {"errors", "paths", "hfcompat"},
    {"kv", "chunks", "manifest", "format", "quantize", "config", "fingerprint", "models", "raw", "rotary", "transform",
     "pipeline", "kvstats", "segments"},
    {"coders"},
    {"substreams", "profile", "bitstats", "fused", "fused_encode", "blob", "codec", "limits"},
    {"stores"},
    {"settings", "progress", "metrics", "prometheus"},
    {"streaming"},
    {"engine"},
    {"cli", "__init__"},
    {"testing"},
]


def _runtime_nodes(tree: ast.AST):
    """Every node, except those under ``if TYPE_CHECKING:`` (imports for type hints only)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None)
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(test):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def _imports(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` (in dotted ``package``) imports at run time."""
    out = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            else:
                out.add(node.module or "")
    return out


def _modules(pkg: str) -> dict[str, Path]:
    mods = {}
    for f in (ROOT / pkg).rglob("*.py"):
        rel = f.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        mods[name] = f
    return mods


def _unit(module: str) -> str:
    """The layer unit of a cachegen_core module: its first component below the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_core_layers_import_only_downwards_and_never_langchain():
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    bad = []
    for name, path in _modules("cachegen_core").items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for target in _imports(path, package):
            assert not target.startswith("langchain"), f"{name} imports {target}"
            if not target.startswith("cachegen_core.") or _unit(name) == _unit(target):
                continue
            if _unit(name) not in rank or _unit(target) not in rank:
                bad.append(f"{name} -> {target}: a module not placed in a layer")
            elif rank[_unit(target)] > rank[_unit(name)] and _unit(name) != "__init__":
                bad.append(f"{name} -> {target}")
    assert bad == [], "imports against the layering of docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    mods = {**_modules("cachegen_core"), **_modules("langchain_cachegen")}
    graph = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for target in _imports(path, package):
            # "from .x import y" names either the module x.y or the name y of x
            for cand in (target, target.rsplit(".", 1)[0]):
                if cand in mods and cand != name and not (path.name == "__init__.py" and cand.startswith(name + ".")):
                    graph[name].add(cand)
                    break
    # a package __init__ re-exporting its own submodules is not a cycle; any other back edge is
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_nothing_imports_tests():
    for pkg in ("cachegen_core", "langchain_cachegen", "benchmarks", "examples"):
        for name, path in _modules(pkg).items():
            assert not any(t == "tests" or t.startswith("tests.") for t in _imports(path, name)), name


def test_no_module_over_400_lines():
    for pkg in ("cachegen_core", "langchain_cachegen"):
        long = {n: len(p.read_text().splitlines()) for n, p in _modules(pkg).items()}
        assert {n: k for n, k in long.items() if k > MAX_LINES} == {}
