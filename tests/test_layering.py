"""The package's structure, held: no import circles (every import counted: at the top, inside functions,
under `if TYPE_CHECKING:`), no module reaching for another's underscore names, and the layering that
pyproject.toml's [tool.importlinter] states (`lint-imports`, which CI also runs before the tests)."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "streamload"

# Attributes of other libraries' objects that a module of ours reads, and that one of our own classes
# also happens to name: (module, attribute) -> why.
FOREIGN = {
    ("cooperative/group.py", "_timeout"): "torch's: a process group backend's options (the exchange's deadline)",
    ("storage/remote.py", "_store"): "obstore's: its native module, loaded afresh in a forked child",
}


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a package is its `__init__`)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(package: Path) -> Iterator[tuple[str, str, str, int]]:
    """(importer, imported module, name, line) for every import of the package's own modules, wherever
    it stands; `name` is what `from m import name` takes ("" for `import m`)."""
    known = modules(package)
    for importer, path in known.items():
        base = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                    target = ".".join(parts + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if full in known:  # `from . import module`
                        yield importer, full, "", node.lineno
                    elif target in known:
                        yield importer, target, alias.name, node.lineno
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known:
                        yield importer, alias.name, "", node.lineno


def circles(package: Path) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan's)."""
    edges: dict[str, set[str]] = {m: set() for m in modules(package)}
    for importer, imported, _, _ in imports(package):
        if imported != importer:
            edges[importer].add(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def private_reaches(package: Path) -> list[str]:
    """Each place a module takes another module's underscore name: imported (`from .m import _x`), read
    off a module (`m._x`), or read off an object (`thing._x`, not `self`'s or `cls`'s) where `_x` is
    defined in other modules only."""
    known = modules(package)
    found = []
    mine: dict[str, set[str]] = {}  # module -> the underscore names it defines (functions, classes, attributes)
    trees = {m: ast.parse(path.read_text(), str(path)) for m, path in known.items()}
    for m, tree in trees.items():
        mine[m] = {_private(node) for node in ast.walk(tree)} - {""}
    for importer, imported, name, line in imports(package):
        if _is_private(name) and imported != importer:
            found.append(f"{known[importer].relative_to(package.parent)}:{line}: from {imported} import {name}")
    for m, tree in trees.items():
        here, where = str(known[m].relative_to(package)), known[m].relative_to(package.parent)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            elsewhere = [other for other, names in mine.items() if other != m and node.attr in names]
            if elsewhere and node.attr not in mine[m] and (here, node.attr) not in FOREIGN:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} ({elsewhere[0]}'s)")
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _private(node: ast.AST) -> str:
    """The underscore name `node` defines, or ""."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        name = node.name
    elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
        name = node.attr
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        name = node.id
    else:
        return ""
    return name if _is_private(name) else ""


def test_no_import_circles_in_the_package() -> None:
    found = circles(PACKAGE)
    assert not found, f"import circles: {found}"


def test_no_module_takes_another_modules_private_names() -> None:
    found = private_reaches(PACKAGE)
    assert not found, "underscore names used across modules (make what is shared public):\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    """A circle through a function-level import, a private name imported and one read off an object:
    each found (so the two tests above can fail)."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n\n\ndef _hidden():\n    pass\n")
    (package / "sub" / "b.py").write_text(
        "def f(thing):\n    from ..a import _hidden\n\n    return thing._state\n\n\nclass C:\n    pass\n"
    )
    (package / "c.py").write_text("class D:\n    def __init__(self):\n        self._state = 1\n")
    assert circles(package) == [["pkg.a", "pkg.sub.b"]]
    assert private_reaches(package) == [
        "pkg/sub/b.py:2: from pkg.a import _hidden",
        "pkg/sub/b.py:4: thing._state (pkg.c's)",
    ]


def test_the_layering_contracts_hold() -> None:
    """`lint-imports` over pyproject.toml's contracts: the layers, the integrations apart, no circles."""
    pytest.importorskip("importlinter", reason="import-linter is not installed (the test extra has it)")
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert command is not None, "import-linter is installed without its lint-imports command"
    ran = subprocess.run(
        [command, "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert ran.returncode == 0, f"lint-imports:\n{ran.stdout}{ran.stderr}"
    assert "0 broken" in ran.stdout, ran.stdout


DOTTED = r"\w+(\.\w+)+"


def reached(path: Path, forbidden: set[str]) -> list[str]:
    """`path:line: name` for each import of, or module started by name (`python -m tests.x`) from, one of the
    `forbidden` top-level modules in the file at `path`: at the top, inside functions, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(DOTTED, node.value):
            names = [node.value]  # a module's dotted name, as `-m` takes it
        else:
            continue
        found += [f"{path}:{node.lineno}: {n}" for n in names if n.split(".")[0] in forbidden]
    return found


def test_benchmarks_and_examples_import_no_tests_and_the_package_no_scaffolding(tmp_path: Path) -> None:
    """bench/ and examples/ build on testbed/ (simulated networks, small pipelines, quantized layouts), never
    on tests/: a benchmark or an example runs without the suite; and the package imports neither."""
    outside = [p for folder in ("bench", "examples", "testbed") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert outside and len(modules(ROOT / "testbed")) > 1
    found = [line for path in outside for line in reached(path, {"tests"})]
    found += [line for path in sorted(PACKAGE.rglob("*.py")) for line in reached(path, {"tests", "testbed"})]
    assert found == []
    planted = tmp_path / "bench.py"  # the check finds what it looks for
    planted.write_text('import os\nimport tests.servers\nfrom tests import netsim\nargv = ["-m", "tests.fleet_node"]\n')
    got = [line.split(": ", 1)[1] for line in reached(planted, {"tests"})]
    assert sorted(got) == ["tests", "tests.fleet_node", "tests.servers"]


FUNCTION_LINES = 80  # a function longer than this is split where its steps are
MODULE_LINES = {"integrations/vllm/__init__.py": 150}  # the plugin's entry: registration only


def test_functions_and_the_plugins_entry_stay_short() -> None:
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {lines} lines")
    for name, most in MODULE_LINES.items():
        lines = len((PACKAGE / name).read_text().splitlines())
        if lines > most:
            long.append(f"{name}: {lines} lines (at most {most})")
    assert not long, "\n".join(long)
