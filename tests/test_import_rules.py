"""The import rules of docs/structure.md, checked on every module (imports inside functions
included): `builder` may import `triton_backend.engine`, never the reverse; the engine never
imports Triton; the block manager and the scheduler import no torch (they are tested, and
reasoned about, without a model), nor does the CPU budget (read before torch sizes its threads);
and no module of `builder` or `triton_backend` imports itself back through others (an import
circle)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRITON_MODULES = ("triton_python_backend_utils", "c_python_backend_utils", "tritonclient",
                  "tritonserver")


def imported(path: Path) -> set[str]:
    """Every module name a file imports, at any depth of its code."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (at any depth of its code, relative imports
    resolved). An edge goes to the module an import names: `from a.b import c` to `a.b.c` when
    that is a module, else to the package `a.b`. Imports under `if TYPE_CHECKING:` never run and
    make no edge."""
    paths = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:  # the module itself, or the package that holds the name
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + [base] if base else up)
                targets.update(known(f"{base}.{alias.name}") for alias in node.names)
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _runtime_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest circle per group of modules that import each other, as [a, b, ..., a]."""
    cycles, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        paths, frontier = {start: [start]}, [start]  # breadth first: shortest way back
        while frontier and start not in seen:
            nxt = []
            for module in frontier:
                for target in sorted(graph[module]):
                    if target == start:
                        cycles.append(paths[module] + [start])
                        seen.update(paths[module])
                        break
                    if target not in paths:
                        paths[target] = paths[module] + [target]
                        nxt.append(target)
                if start in seen:
                    break
            frontier = nxt
    return cycles


def _top(name: str) -> str:
    return name.split(".")[0]


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _files("triton_backend"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_runtime_never_imports_the_builder(path):
    assert not {n for n in imported(path) if _top(n) == "builder"}


@pytest.mark.parametrize("path", _files("triton_backend/engine"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_engine_never_imports_triton(path):
    assert not {n for n in imported(path) if _top(n) in TRITON_MODULES}


@pytest.mark.parametrize("name", ["block_manager.py", "scheduler.py", "cpu_budget.py"])
def test_the_torch_free_modules_import_no_torch(name):
    assert not {n for n in imported(ROOT / "triton_backend/engine" / name) if _top(n) == "torch"}


def test_the_torch_free_modules_load_without_torch():
    """Not even through what they import: loading them leaves torch unloaded."""
    code = ("import sys, triton_backend.engine.scheduler, triton_backend.engine.block_manager, "
            "triton_backend.engine.cpu_budget; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr


def test_the_checker_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from builder.spec import x\n    import torch.nn\n")
    assert imported(source) == {"builder.spec", "torch.nn"}


def test_no_import_circles():
    cycles = import_cycles(import_graph(ROOT, ("builder", "triton_backend")))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_circle_through_a_function(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import B\n")
    (package / "a.py").write_text("from pkg.sub import B\nfrom typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    import pkg.c\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import x\nB = 1\n")
    (package / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.sub"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.a"]]
