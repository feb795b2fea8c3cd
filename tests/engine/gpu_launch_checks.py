"""Kernel launches of one decode step of the GPU backend, counted on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, in a process of its own): every torch op that would launch a
CUDA kernel (views and allocations launch none) plus every Triton kernel launch (the torch ops
the interpreter itself runs inside a launch are part of it). The engine's projections are FP8 on
`torch._scaled_mm` (quantized here from its weights, as a GPU with FP8 tensor cores runs them);
the step is counted with the activations quantized by the torch ops, then by the fused kernel
(`gpu/fp8.py`, whose bytes `gpu_kernel_checks.py` holds to the torch ops'). Prints both counts."""
from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

assert os.environ.get("TRITON_INTERPRET") == "1", "run under Triton's interpreter"

import triton.runtime.interpreter as interpreter  # noqa: E402

from triton_backend.engine import Request  # noqa: E402
from triton_backend.engine.gpu.fp8 import fuse_fp8_inputs  # noqa: E402
from triton_backend.engine.llm_engine import LLMEngine  # noqa: E402
from triton_backend.engine.quant.linear import Fp8Linear  # noqa: E402

aten = torch.ops.aten
NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided, aten.detach, aten.lift_fresh,
             aten.alias}
PROJECTIONS = ("qkv", "dense", "gate_up", "proj")


class LaunchCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.torch_ops: dict[str, int] = {}
        self.triton = 0
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket.__name__)
        if not self.inside_triton and func.overloadpacket not in NO_KERNEL and (
                name.endswith("_") or not _aliases(out, args)):
            self.torch_ops[name] = self.torch_ops.get(name, 0) + 1
        return out

    @property
    def total(self) -> int:
        return sum(self.torch_ops.values()) + self.triton


def _aliases(out, args) -> bool:
    """The op returned a view of an input (a view, a `to` or `reshape` that had nothing to do):
    no kernel ran. In-place ops are counted by name before this."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    return all(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in inputs
               for o in outs)


def _to_fp8(model: torch.nn.Module) -> int:
    """Every projection as an FP8 `_scaled_mm` linear of its own weights; how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name not in PROJECTIONS or not isinstance(child, torch.nn.Linear):
                continue
            weight = child.weight.detach().float()
            w_scale = (weight.abs().max() / 448).reshape(1)
            fp8 = Fp8Linear(child.in_features, child.out_features, child.bias is not None, name)
            fp8.load_quantized((weight / w_scale).to(torch.float8_e4m3fn), w_scale,
                               torch.tensor([4.0 / 448]), child.bias, use_scaled_mm=True)
            setattr(parent, name, fp8)
            count += 1
    return count


def _count_decode_step(engine: LLMEngine, counter: LaunchCount) -> None:
    """The next step (every running sequence decodes one token), counted."""
    runner = engine.runner
    output = engine.scheduler.schedule()
    chunks = runner.ops.inputs.packing_order(output.chunks)
    assert runner.ops.graphs.covers(chunks)  # a captured decode step (replayed eagerly here)
    with counter, torch.inference_mode():
        runner.ops.graphs.run(chunks)


def main(engine_dir: str) -> int:
    original = interpreter.GridExecutor.__call__
    counters: list[LaunchCount] = []

    def launch(self, *args, **kwargs):
        counter = counters[-1] if counters else None
        if counter is None:
            return original(self, *args, **kwargs)
        counter.triton += 1
        counter.inside_triton += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.inside_triton -= 1

    interpreter.GridExecutor.__call__ = launch
    results = []
    for fused in (False, True):  # the torch ops quantize the activations, then the kernel
        engine = LLMEngine(engine_dir)
        projections = _to_fp8(engine.runner.model)
        if fused:
            assert fuse_fp8_inputs(engine.runner.model) == projections
        for prompt in ([5, 6, 7, 8], [9, 10, 11]):
            engine.add_request(Request(prompt, 4, ignore_eos=True))
        engine.step()  # the prefills
        counters.append(LaunchCount())
        _count_decode_step(engine, counters[-1])
        results.append(counters.pop())
    before, after = results
    layers = len(engine.runner.model.transformer.layers)
    print(f"fp8 projections {projections}, layers {layers}")
    print(f"decode step launches: before {before.total} after {after.total}")
    print(f"  before: torch {before.torch_ops} triton {before.triton}")
    print(f"  after: torch {after.torch_ops} triton {after.triton}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
