"""The device backends' rooms (docs/structure.md): only `engine/cpu/` and `engine/gpu/` know which
backend runs. Everywhere else (the runner, the sampler, LoRA, the builder, the bench) no code asks
`isinstance(..., <backend>Ops)` or compares a backend's name, and the model runner has one step
path: it hands each step to its backend's `launch`."""
import ast
import inspect
from pathlib import Path

import pytest

from triton_backend.engine.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("triton_backend/engine/cpu/", "triton_backend/engine/gpu/")
BACKEND_NAMES = {"cpp", "gpu", "torch"}


def asks_which_backend(source: str) -> list[str]:
    """Each place `source` asks which backend it has: an isinstance on an `...Ops` class, or a
    backend's name (`x.name`) compared with a backend name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance" and len(node.args) == 2):
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for cls in classes:
                name = cls.attr if isinstance(cls, ast.Attribute) else getattr(cls, "id", "")
                if name.endswith("Ops"):
                    found.append(f"line {node.lineno}: isinstance(..., {name})")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
            constants = {c.value for s in sides for c in ast.walk(s)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if named and constants & BACKEND_NAMES:
                found.append(f"line {node.lineno}: a backend's name compared with "
                             f"{sorted(constants & BACKEND_NAMES)}")
    return found


def outside_the_rooms() -> list[Path]:
    paths = []
    for package in ("triton_backend", "builder"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if not relative.startswith(ROOMS):
                paths.append(path)
    return paths


def test_no_code_outside_the_backend_rooms_asks_which_backend_runs():
    offences = {path.relative_to(ROOT).as_posix(): asks_which_backend(path.read_text())
                for path in outside_the_rooms()}
    assert {path: found for path, found in offences.items() if found} == {}


@pytest.mark.parametrize("source, expected", [
    ("if isinstance(self.ops, CppOps):\n    pass\n", ["line 1: isinstance(..., CppOps)"]),
    ("ok = isinstance(ops, (ops_module.GpuOps, int))\n", ["line 1: isinstance(..., GpuOps)"]),
    ("padded = self.ops.name == 'gpu'\n",
     ["line 1: a backend's name compared with ['gpu']"]),
    ("fast = runner.ops.name in ('cpp', 'gpu')\n",
     ["line 1: a backend's name compared with ['cpp', 'gpu']"]),
    ("stats = dict(name=ops.name)\nok = isinstance(x, dict)\nsame = a.kind == 'gpu'\n", []),
])
def test_the_check_finds_a_backend_asked_for(source, expected):
    assert asks_which_backend(source) == expected


def test_only_the_backend_choice_imports_a_backend_room():
    """The engine outside the rooms (quant, lora, the sampler, the families) reaches kernels
    through the backend it is handed; only `backend.py`, which picks one, imports a room."""
    from tests.test_import_rules import imported

    rooms = tuple(room.rstrip("/").replace("/", ".") for room in ROOMS)
    importers = sorted(path.relative_to(ROOT).as_posix() for path in outside_the_rooms()
                       if path.is_relative_to(ROOT / "triton_backend")
                       and any(name == room or name.startswith(room + ".")
                               for name in imported(path) for room in rooms))
    assert importers == ["triton_backend/engine/backend.py"]


def test_the_runner_has_one_step_path():
    """`ModelRunner.run` launches every step through its backend, once, and touches neither the
    model nor a backend's fast step itself."""
    source = inspect.getsource(ModelRunner.run)
    assert source.count("self.ops.launch(") == 1
    for backend_detail in ("self.model(", "graphs", "decode_forward", "isinstance"):
        assert backend_detail not in source, backend_detail
