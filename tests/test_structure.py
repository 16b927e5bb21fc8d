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
BENCH_ENTRY = ("controller/cli.py", "main")
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
