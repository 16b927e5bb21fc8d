"""The shape DESIGN.md promises, held by tests: the import direction, small functions and modules, ruff clean.

Imports are read from the AST of every module (function-level imports included), so a lazy
import breaks the direction just as a module-level one does. Product code is starjar/,
draft_server/, target_worker/ and controller/; the generated *_pb2*.py stubs are left out
of the size limits.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("starjar", "draft_server", "target_worker", "controller")
OURS = {*PRODUCT, "benchmarks", "tests"}
# DESIGN.md: starjar -> nothing of ours; draft_server and target_worker -> starjar only (never each
# other); controller -> all but benchmarks; benchmarks -> all; nothing -> benchmarks.
MAY_IMPORT = {
    "starjar": {"starjar"},
    "draft_server": {"draft_server", "starjar"},
    "target_worker": {"target_worker", "starjar"},
    "controller": {"controller", "draft_server", "target_worker", "starjar"},
}
# The one place product code may reach benchmark code: a lazy import in the function that runs
# `starjar bench` (the command stays the user's; its code is loaded only when asked for).
BENCH_ENTRY = ("controller/cli/main.py", "main")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _generated(path: Path) -> bool:
    return "_pb2" in path.name


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _package_of(path: Path, root: Path) -> list[str]:
    """The package a module sits in, as parts (an __init__.py is its own package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1]  # drops the module's own name, or "__init__"


def _imported_tops(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    """Top-level package names an import statement reaches (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if node.level == 0:
        return [node.module.split(".")[0]]
    dotted = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    return dotted[:1]


class _ImportCollector(ast.NodeVisitor):
    """Every import of ours in a module, with the function it sits in ('' at module level)."""

    def __init__(self, path: Path, root: Path = ROOT) -> None:
        self.package = _package_of(path, root)
        self.scope: list[str] = []  # enclosing classes and functions
        self.found: list[tuple[int, str, str]] = []  # (line, qualified function, top-level package)

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        for top in _imported_tops(node, self.package):
            if top in OURS:
                self.found.append((node.lineno, ".".join(self.scope), top))

    visit_Import = visit_ImportFrom = _import


def _import_offenders() -> list[str]:
    offenders = []
    for package, allowed in MAY_IMPORT.items():
        for path in _modules(package):
            collector = _ImportCollector(path)
            collector.visit(ast.parse(path.read_text(), str(path)))
            for line, function, top in collector.found:
                if top in allowed:
                    continue
                if top == "benchmarks" and (_rel(path), function) == BENCH_ENTRY:
                    continue
                where = f"in {function}()" if function else "at module level"
                offenders.append(f"{_rel(path)}:{line} ({package}) imports {top} {where}")
    return offenders


def test_import_direction_of_design_md():
    offenders = _import_offenders()
    assert not offenders, (
        "imports against DESIGN.md's direction (starjar -> nothing of ours; draft_server, target_worker -> "
        f"starjar only; controller -> all but benchmarks; benchmarks only lazily in {':'.join(BENCH_ENTRY)}):\n  "
        + "\n  ".join(offenders))


def test_the_import_reader_sees_lazy_and_relative_imports(tmp_path):
    """The checker itself: function-level, method-level and relative imports are found and resolved."""
    module = tmp_path / "draft_server" / "sub" / "m.py"
    source = ("from .. import engine\nfrom . import x\nimport numpy, starjar.v1\n"
              "def f():\n    import target_worker.engine\n"
              "class C:\n    def g(self):\n        from benchmarks.registry import run_bench\n")
    collector = _ImportCollector(module, root=tmp_path)
    collector.visit(ast.parse(source))
    assert collector.found == [(1, "", "draft_server"), (2, "", "draft_server"), (3, "", "starjar"),
                               (5, "f", "target_worker"), (8, "C.g", "benchmarks")]


def _long_functions(tree: ast.AST, path: Path) -> list[str]:
    offenders = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1  # from `def` to its last line, docstring included
                    if lines > MAX_FUNCTION_LINES:
                        offenders.append(f"{_rel(path)}:{child.lineno} {name}() has {lines} lines")
                name += "."
            walk(child, name)

    walk(tree, "")
    return offenders


def _product_modules() -> list[Path]:
    return [p for package in PRODUCT for p in _modules(package) if not _generated(p)]


def test_no_function_in_product_code_over_60_lines():
    offenders = [o for path in _product_modules() for o in _long_functions(ast.parse(path.read_text()), path)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(offenders)


def test_no_module_in_product_code_over_400_lines():
    sizes = {_rel(p): len(p.read_text().splitlines()) for p in _product_modules()}
    offenders = [f"{name} has {n} lines" for name, n in sizes.items() if n > MAX_MODULE_LINES]
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(offenders)


def _ruff() -> list[str] | None:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def test_ruff_clean():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra: pip install -e '.[test]')")
    # The rules and exclusions are pyproject.toml's [tool.ruff]; cwd makes ruff find them.
    done = subprocess.run([*ruff, "check", "--no-cache", "--output-format=concise", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, "ruff check found:\n" + done.stdout + done.stderr


# A path into a folder beside the repository: `../shared`, `parents[2] / "shared"` and the like. A user's clone
# has nothing beside it, so nothing the product, its tests, benchmarks or scripts need may be read from there
# (.ci/run also runs the suite in a clone with nothing beside it, where such a read fails).
OUTSIDE = re.compile(r"""\.\./shared|parents\[\d+\]\s*/\s*["']shared|STARJAR_DATA""")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split()]


def test_nothing_reads_beside_the_repository():
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in _tracked("*.py", "*.sh", ".ci/*")
            if p.name != Path(__file__).name
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, "reads outside the repository:\n" + "\n".join(hits)


def test_the_outside_pattern_catches_what_it_should():
    for line in ('p = ROOT.parent / "shared"/"x"  # ../shared/data', 'Path(__file__).parents[2] / "shared"',
                 'os.environ["STARJAR_DATA"]'):
        assert OUTSIDE.search(line), line
    assert not OUTSIDE.search('resources.files("starjar").joinpath("data", "prompts.jsonl")')


# The layout by architecture. Modules are read with every import they make, function-level ones included
# (a lazy import closes a circle as surely as one at the top), and `from a.b import c` counts as an import of
# a.b.c where that is a module.
CODE = (*PRODUCT, "benchmarks")
# Inside starjar/ and controller/, a layer may import its own and those after it, never one before it; in
# controller/, frontend, fleet and tuning are siblings that do not import each other.
STARJAR_LAYERS = (("top", ("starjar.client", "starjar.workloads")), ("service", ("starjar.service",)),
                  ("wire", ("starjar.wire",)), ("spec", ("starjar.spec",)), ("model", ("starjar.model",)),
                  ("cpu", ("starjar.cpu",)), ("base", ("starjar.errors", "starjar.version", "starjar.v1")))
CONTROLLER_LAYERS = (("cli", ("controller.cli",)), ("cluster", ("controller.cluster",)),
                     ("frontend", ("controller.frontend",)), ("fleet", ("controller.fleet",)),
                     ("tuning", ("controller.tuning",)), ("colocated", ("controller.colocated",)))
SIBLINGS = {"frontend", "fleet", "tuning"}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_paths(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    return {_module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))
            if "__pycache__" not in p.parts and not _generated(p)}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """The modules of ours `path` imports, and each `_private` name it takes from another module."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    reached, private = set(), []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            reached.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]) if node.level \
                else node.module
            base = base.strip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                reached.add(full if full in modules else base)
                dunder = alias.name.endswith("__")
                theirs = full not in modules and base in modules and base != name
                if alias.name.startswith("_") and not dunder and theirs:
                    private.append(f"{_rel_to(path)}:{node.lineno} takes {alias.name} from {base}")
    return {m for m in reached if m in modules and m != name}, private


def _rel_to(path: Path) -> str:
    try:
        return _rel(path)
    except ValueError:
        return path.name


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = CODE) -> tuple[dict[str, set[str]], list[str]]:
    modules = _module_paths(root, packages)
    graph, private = {}, []
    for name, path in modules.items():
        graph[name], taken = _imports(path, name, modules)
        private += taken
    return graph, private


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles_even_through_function_level_imports():
    circles = import_circles(import_graph()[0])
    assert not circles, "import circles:\n  " + "\n  ".join(" <-> ".join(c) for c in circles)


def test_no_module_takes_another_modules_private_names():
    private = import_graph()[1]
    assert not private, "imports of another module's private names:\n  " + "\n  ".join(private)


def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_planted_circle_and_a_planted_private_import_are_found(tmp_path):
    _plant(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "def f():\n    from pkg import b\n    return b\n",
                      "pkg/b.py": "from pkg.a import f\n", "pkg/c.py": "from pkg.d import _hidden\n",
                      "pkg/d.py": "_hidden = 1\n"})
    graph, private = import_graph(tmp_path, ("pkg",))
    assert import_circles(graph) == [["pkg.a", "pkg.b"]]
    assert private == ["c.py:1 takes _hidden from pkg.d"]


def _layer(module: str, layers) -> str | None:
    return next((name for name, prefixes in layers for p in prefixes if module == p or module.startswith(p + ".")),
                None)


def layer_offenders(graph: dict[str, set[str]], layers) -> list[str]:
    order = [name for name, _ in layers]
    offenders = []
    for module, reached in sorted(graph.items()):
        mine = _layer(module, layers)
        for other in sorted(reached):
            theirs = _layer(other, layers)
            if None in (mine, theirs) or mine == theirs:
                continue
            if order.index(theirs) < order.index(mine) or {mine, theirs} <= SIBLINGS:
                offenders.append(f"{module} ({mine}) imports {other} ({theirs})")
    return offenders


def test_the_layer_order_inside_starjar_and_controller():
    graph = import_graph()[0]
    offenders = layer_offenders(graph, STARJAR_LAYERS) + layer_offenders(graph, CONTROLLER_LAYERS)
    assert not offenders, "imports against the layer order:\n  " + "\n  ".join(offenders)


def test_a_planted_layer_breach_is_found():
    graph = {"controller.fleet.fleet": {"controller.cluster.spec", "controller.tuning.pair_check"},
             "starjar.cpu.kernels": {"starjar.model.loading", "starjar.errors"}}
    assert layer_offenders(graph, CONTROLLER_LAYERS) == [
        "controller.fleet.fleet (fleet) imports controller.cluster.spec (cluster)",
        "controller.fleet.fleet (fleet) imports controller.tuning.pair_check (tuning)"]
    assert layer_offenders(graph, STARJAR_LAYERS) == ["starjar.cpu.kernels (cpu) imports starjar.model.loading (model)"]


WIRE_KEYS = ("starjar-tag", "starjar-reason", "starjar-field", "authorization")  # starjar/wire/keys.py's


def wire_key_literals(paths: list[Path]) -> list[str]:
    return [f"{_rel_to(p)}:{node.lineno} {node.value!r}" for p in paths
            for node in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(node, ast.Constant) and node.value in WIRE_KEYS]


def test_wire_keys_are_spelled_only_in_starjar_wire_keys():
    from starjar.wire import keys

    assert set(WIRE_KEYS) == {keys.AUTH_METADATA, keys.TAG_METADATA, keys.REASON_METADATA, keys.FIELD_METADATA}
    owner = ROOT / "starjar" / "wire" / "keys.py"
    hits = wire_key_literals([p for p in _product_modules() if p != owner])
    assert not hits, "metadata keys spelled outside starjar/wire/keys.py:\n  " + "\n  ".join(hits)
    assert wire_key_literals([owner])  # the check sees the keys where they are
