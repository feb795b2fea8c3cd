"""The import rules of docs/structure.md, checked on every module (imports inside functions
included): `builder` may import `triton_backend.engine`, never the reverse; the engine never
imports Triton; the block manager and the scheduler import no torch (they are tested, and
reasoned about, without a model), nor does the CPU budget (read before torch sizes its threads);
and no module of `builder` or `triton_backend` imports itself back through others (an import
circle). Under that last rule a type-only import (`if TYPE_CHECKING:`) is an edge like any other
(it may point down, never up), and so is a registry's loading of its modules (`importlib`,
`pkgutil`): a package that imports its modules by name depends on each of them."""
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
    """Module -> the modules of `packages` it imports (at any depth of its code, under
    `TYPE_CHECKING` too, relative imports resolved). An edge goes to the module an import names:
    `from a.b import c` to `a.b.c` when that is a module, else to the package `a.b`. A module
    that loads modules at run time (`importlib.import_module`, `pkgutil.iter_modules`) has an
    edge to the module a literal name names, else to every module of its package."""
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
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + [base] if base else up)
                targets.update(known(f"{base}.{alias.name}") for alias in node.names)
            elif isinstance(node, ast.Call) and _loads_modules(node):
                name = node.args[0] if node.args else None
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    targets.add(known(name.value))
                else:
                    targets.update(m for m in paths if m.rpartition(".")[0] == package)
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _loads_modules(call: ast.Call) -> bool:
    """`importlib.import_module(...)`, `pkgutil.iter_modules(...)` and their kin."""
    name = ast.unparse(call.func)
    return name.rpartition(".")[2] in ("import_module", "__import__", "iter_modules",
                                       "walk_packages")


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
    source.write_text("def f():\n    from builder.spec.build_spec import x\n    import torch.nn\n")
    assert imported(source) == {"builder.spec.build_spec", "torch.nn"}


def test_no_import_circles():
    cycles = import_cycles(import_graph(ROOT, ("builder", "triton_backend")))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _package(root: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, source in {"pkg/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return import_graph(root, ("pkg",))


def test_the_cycle_check_finds_a_circle_through_a_function(tmp_path):
    graph = _package(tmp_path, {"pkg/sub/__init__.py": "from .b import B\n",
                                "pkg/a.py": "from pkg.sub import B\n",
                                "pkg/sub/b.py": "def f():\n    from ..a import x\nB = 1\n"})
    assert graph["pkg.a"] == {"pkg.sub"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert import_cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.a"]]


def test_a_type_only_import_may_point_down_never_up(tmp_path):
    down = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.low import L\n"
    graph = _package(tmp_path, {"pkg/high.py": "import pkg.low\n" + down,
                                "pkg/low.py": "L = 1\n"})
    assert graph["pkg.high"] == {"pkg.low"} and not import_cycles(graph)
    up = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import H\n"
    graph = _package(tmp_path, {"pkg/low.py": up})
    assert import_cycles(graph) == [["pkg.high", "pkg.low", "pkg.high"]]


def test_a_registry_depends_on_the_modules_it_loads(tmp_path):
    registry = ("import importlib, pkgutil\n"
                "def load():\n    for m in pkgutil.iter_modules(__path__):\n"
                "        importlib.import_module(f'{__name__}.{m.name}')\n")
    graph = _package(tmp_path, {"pkg/fam/__init__.py": registry,
                                "pkg/fam/one.py": "import pkg.model\n",
                                "pkg/model.py": "import importlib\n"
                                                "def f():\n    return importlib.import_module('pkg.fam')\n"})
    assert graph["pkg.fam"] == {"pkg.fam.one"} and graph["pkg.model"] == {"pkg.fam"}
    assert import_cycles(graph) == [["pkg.fam", "pkg.fam.one", "pkg.model", "pkg.fam"]]
