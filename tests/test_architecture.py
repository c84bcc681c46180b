"""The structure docs/architecture.md describes, checked on the code: one-way imports, no cycles,
no LangChain in the core, nothing importing tests/, no module over 400 lines."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400

#: Each layer of cachegen_core may import only the layers listed before it (docs/architecture.md): a unit is a
#: top-level module or subpackage.
LAYERS = [
    {"errors", "paths", "hfcompat", "openmp"},
    {"kv", "models", "pinned", "hub"},
    {"keys"},
    {"coders"},
    {"codec"},
    {"stores"},
    {"ops"},
    {"streaming"},
    {"engine"},
    {"cli", "__init__"},
    {"testing"},
]
#: Inside the engine, each subpackage may import only those listed before it; the engine's top-level modules (the
#: facade: ``engine``, ``loading``, ``profiles``, ``aio``) may import all of them (docs/architecture.md).
ENGINE_LAYERS = [{"model"}, {"serving"}, {"costs"}, {"chunks"}, {"documents"}]
#: At most this many modules at the top of cachegen_core besides its subpackages: the tree is the map.
MAX_TOP_LEVEL_MODULES = 10


def _imports(path: Path, package: str) -> set[str]:
    """Absolute names ``path`` (in dotted ``package``) imports, type-only imports (under ``TYPE_CHECKING``) and
    imports inside functions included: ``from x import y`` gives ``x.y`` (the module ``x.y`` or the name ``y`` of
    ``x``: see :func:`_resolve`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _resolve(target: str, mods: dict[str, Path]) -> str | None:
    """The module a name from :func:`_imports` lives in: itself when it is a module, else its parent."""
    for cand in (target, target.rsplit(".", 1)[0]):
        if cand in mods:
            return cand
    return None


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
    mods = _modules("cachegen_core")
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for target in _imports(path, package):
            target = _resolve(target, mods) or target
            assert not target.startswith("langchain"), f"{name} imports {target}"
            if not target.startswith("cachegen_core.") or _unit(name) == _unit(target):
                continue
            if _unit(name) not in rank or _unit(target) not in rank:
                bad.append(f"{name} -> {target}: a module not placed in a layer")
            elif rank[_unit(target)] > rank[_unit(name)] and _unit(name) != "__init__":
                bad.append(f"{name} -> {target}")
    assert bad == [], "imports against the layering of docs/architecture.md:\n" + "\n".join(bad)


def test_engine_subpackages_import_only_downwards():
    rank = {unit: i for i, layer in enumerate(ENGINE_LAYERS) for unit in layer}
    mods = _modules("cachegen_core")
    engine = {n: p for n, p in mods.items() if n.startswith("cachegen_core.engine.")}
    sub = lambda name: name.split(".")[2]  # noqa: E731
    bad, placed = [], set()
    for name, path in engine.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        if path.parent.name != "engine":  # a module of a subpackage
            placed.add(sub(name))
        elif path.name != "__init__.py":
            continue  # the facade imports every subpackage
        for target in _imports(path, package):
            target = _resolve(target, mods) or target
            if not target.startswith("cachegen_core.engine.") or sub(target) == sub(name):
                continue
            if sub(target) not in rank:
                bad.append(f"{name} -> {target}: the engine's facade, imported from below it")
            elif sub(name) in rank and rank[sub(target)] > rank[sub(name)]:
                bad.append(f"{name} -> {target}")
    assert placed <= set(rank), f"engine subpackages not placed in ENGINE_LAYERS: {placed - set(rank)}"
    assert bad == [], "imports against the engine's layering (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    mods = {**_modules("cachegen_core"), **_modules("langchain_cachegen")}
    graph = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for target in _imports(path, package):
            cand = _resolve(target, mods)
            if cand is not None and cand != name and not (path.name == "__init__.py" and cand.startswith(name + ".")):
                graph[name].add(cand)
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


def test_the_core_top_level_holds_few_modules_beside_its_layer_packages():
    top = sorted(p.stem for p in (ROOT / "cachegen_core").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    units = {unit for layer in LAYERS for unit in layer}
    packages = {p.name for p in (ROOT / "cachegen_core").iterdir() if (p / "__init__.py").exists()}
    assert set(top) | packages <= units, "every top-level module and package has a layer"
    for pkg in packages:  # each layer package says what lives there and what it may import
        doc = ast.get_docstring(ast.parse((ROOT / "cachegen_core" / pkg / "__init__.py").read_text())) or ""
        assert doc, f"cachegen_core/{pkg}/__init__.py has no docstring"


def test_no_module_over_400_lines():
    for pkg in ("cachegen_core", "langchain_cachegen", "benchmarks"):
        long = {n: len(p.read_text().splitlines()) for n, p in _modules(pkg).items()}
        assert {n: k for n, k in long.items() if k > MAX_LINES} == {}
