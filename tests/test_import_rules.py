"""The import rules of docs/structure.md, checked on every module (imports inside functions
included): `builder` may import `triton_backend.engine`, never the reverse; the engine never
imports Triton; the block manager and the scheduler import no torch (they are tested, and
reasoned about, without a model), nor does the CPU budget (read before torch sizes its threads)."""
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
