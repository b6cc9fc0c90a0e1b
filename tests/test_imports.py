"""Layers import downward only: every import of a ``themis_compile`` module points to its own floor of
`LAYERS` or one below, there is no import cycle, and nothing below ``themis_compile.api`` imports it.

The graph is read from the source, not from ``sys.modules``: every ``import`` and ``from ... import``
statement of every module counts, at module level or inside a function (an import moved into a function
to dodge a cycle is still the cycle). ``from pkg import name`` is an edge to ``pkg.name`` when that is a
module (a ``.py`` file, a package or a compiled extension) and to ``pkg`` otherwise. Importing ``a.b.c``
also runs ``a/__init__`` and ``a/b/__init__``; those implicit parent edges are not counted, so a package
``__init__`` that re-exports its own modules is no cycle with them.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

import themis_compile

PACKAGE_ROOT = Path(themis_compile.__file__).parent

# The floors of the package, top to bottom, as docs/architecture.md ("Layers and imports") lists them. A
# module sits on the floor of the longest entry that names it or a package above it; it may import its
# own floor and the floors below, never one above (TYPE_CHECKING and in-function imports included).
# Every module of the package must sit on a floor, so a new package or top-level module is placed here.
LAYERS = (
    ("themis_compile", "themis_compile.__main__", "themis_compile.cli", "themis_compile.api",
     "themis_compile.checkpoint", "themis_compile.export", "themis_compile.integrations", "themis_compile.bench",
     "themis_compile.testing"),                          # the user-facing layer and its tools
    ("themis_compile.sim",),                             # the simulator, `themis-compile inspect`
    ("themis_compile.passes",),                          # detection, rewrites, scheduling, the compile backend
    ("themis_compile.runtime",),                         # the FSSDP and EP executors, collectives, registry
    ("themis_compile.cost_model", "themis_compile.kernels", "themis_compile.models"),
    ("themis_compile.planner",),                         # placement, topology, Alg. 1-3
    ("themis_compile.config", "themis_compile.layer_info", "themis_compile.attention"),   # imports torch only
)

# The user-facing layer: the package's entry points, which may import `themis_compile.api`. Everything
# else (passes, runtime, planner, cost model, kernels, models, testing, ...) sits below it.
ABOVE_API = ("themis_compile", "themis_compile.api", "themis_compile.__main__", "themis_compile.cli",
             "themis_compile.checkpoint", "themis_compile.bench", "themis_compile.integrations")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def extension_modules(root: Path) -> set[str]:
    """Dotted names of the compiled extensions (``.so``/``.pyd``) of the package at ``root``."""
    out = set()
    for path in [*root.rglob("*.so"), *root.rglob("*.pyd")]:
        parts = list(path.relative_to(root.parent).parts)
        parts[-1] = parts[-1].split(".", 1)[0]
        out.add(".".join(parts))
    return out


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {imported module of the same package: line of the first such import}."""
    modules = module_files(root)
    extensions = extension_modules(root)
    top = root.name
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules or sub in extensions else source)
            for target in targets:
                if not (target == top or target.startswith(top + ".")):
                    continue
                while target not in modules and target not in extensions and "." in target:
                    target = target.rpartition(".")[0]         # an attribute path: its module
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle through
    its modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, set(c), c[0]) for c in sorted(components)]


def _cycle_through(graph: dict[str, dict[str, int]], component: set[str], start: str) -> list[str]:
    """One cycle from ``start`` back to itself inside ``component`` (breadth-first: a shortest one)."""
    parent = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in component and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")   # a component always has one


def _describe(graph: dict[str, dict[str, int]], cycle: list[str]) -> str:
    return " -> ".join(f"{a} (l.{graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


@functools.cache
def _package_graph() -> dict[str, dict[str, int]]:
    return import_graph(PACKAGE_ROOT)


def test_no_import_cycle():
    graph = _package_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_nothing_below_api_imports_it():
    graph = _package_graph()
    def above(module: str) -> bool:
        return module == "themis_compile" or any(module == a or module.startswith(a + ".")
                                                 for a in ABOVE_API if a != "themis_compile")

    upward = sorted(f"{m} (l.{edges['themis_compile.api']})" for m, edges in graph.items()
                    if "themis_compile.api" in edges and not above(m))
    assert not upward, "imports of themis_compile.api from below it: " + ", ".join(upward)


def floor_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int | None:
    """Index in ``layers`` (0 = top) of the longest entry naming ``module`` or a package above it."""
    best, floor = -1, None
    for i, entries in enumerate(layers):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best:
                best, floor = len(entry), i
    return floor


def upward_imports(graph: dict[str, dict[str, int]], layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every import from a floor to a floor above it, as ``a (l.N) -> b``, sorted."""
    return sorted(f"{m} (l.{line}) -> {target}" for m, edges in graph.items() for target, line in edges.items()
                  if floor_of(target, layers) < floor_of(m, layers))


def test_every_module_sits_on_a_floor():
    unplaced = sorted(m for m in _package_graph() if floor_of(m) is None)
    assert not unplaced, "modules on no floor of LAYERS (place them there and in docs/architecture.md): " + \
        ", ".join(unplaced)


def test_imports_point_down_the_layers():
    upward = upward_imports(_package_graph())
    assert not upward, "imports from a floor of LAYERS to one above it:\n" + "\n".join(upward)


def test_layers_match_the_architecture_page():
    # Under "Layers and imports" the page lists the floors in an indented block, top to bottom: a line
    # indented 4 spaces names a floor's modules (short names), deeper lines describe it.
    page = (PACKAGE_ROOT.parent / "docs" / "architecture.md").read_text()
    section = page.split("## Layers and imports", 1)[1].split("\n## ", 1)[0]
    floors = [line.strip() for line in section.splitlines()
              if line.startswith("    ") and not line.startswith("     ")]
    short = [", ".join(e if e == "themis_compile" else e.removeprefix("themis_compile.") for e in entries)
             for entries in LAYERS]
    assert floors == short


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_walker_sees_cycles_through_function_level_and_relative_imports(tmp_path):
    # The checks above pass only if the walker would see what they forbid: a cycle closed by an import
    # inside a function, one through `from pkg import module` and a relative import, and a re-exporting
    # `__init__` that is not one.
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "from pkg.low import f\n",
        "low.py": "def f():\n    from pkg.high import g\n    return g\n",
        "high.py": "from pkg import low\n",
        "sub/__init__.py": "",
        "sub/a.py": "from . import b\n",
        "sub/b.py": "from ..sub.a import x\n",
        "sub/c.py": "import pkg.sub.a\n",
    })
    graph = import_graph(root)
    assert graph["pkg.low"] == {"pkg.high": 2}
    assert graph["pkg.high"] == {"pkg.low": 1}
    assert graph["pkg"] == {"pkg.low": 1}
    assert graph["pkg.sub.c"] == {"pkg.sub.a": 1}
    assert find_cycles(graph) == [["pkg.high", "pkg.low", "pkg.high"], ["pkg.sub.a", "pkg.sub.b", "pkg.sub.a"]]


@pytest.mark.parametrize("cycle_len", [2, 3])
def test_cycle_report_names_every_module(tmp_path, cycle_len):
    root = tmp_path / "pkg"
    names = [f"m{i}" for i in range(cycle_len)]
    _write(root, {"__init__.py": ""} | {
        f"{n}.py": f"import pkg.{names[(i + 1) % cycle_len]}\n" for i, n in enumerate(names)})
    (cycle,) = find_cycles(import_graph(root))
    assert cycle[0] == cycle[-1] and sorted(cycle[:-1]) == [f"pkg.{n}" for n in names]


def test_walker_sees_upward_imports_under_type_checking_and_in_functions(tmp_path):
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "",
        "top.py": "import pkg.bottom\n",
        "bottom.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.top import T\n",
        "mid/__init__.py": "",
        "mid/a.py": "def f():\n    from pkg import top\n",
    })
    layers = (("pkg", "pkg.top"), ("pkg.mid",), ("pkg.bottom",))
    assert floor_of("pkg.mid.a", layers) == 1 and floor_of("pkg.elsewhere", layers) == 0
    assert upward_imports(import_graph(root), layers) == ["pkg.bottom (l.3) -> pkg.top", "pkg.mid.a (l.2) -> pkg.top"]
