"""Adapters in the runtime layout, and the checks every adapter passes on its way there.

An adapter is a set of low-rank pairs (A [r, in], B [out, r]) on some of the Hugging Face
projections q/k/v/o/gate/up/down of some layers. The runtime fuses q/k/v into `attention.qkv`
and gate/up into `mlp.gate_up`, so an adapter is stored per runtime projection: the A's of its
parts stacked along the rank, and B block-diagonal, each part's B on the output rows that part
owns (rows of a part the adapter leaves alone stay zero). The scaling (alpha / r) is folded into
B. Keys: `transformer.layers.{i}.{attention.qkv|attention.dense|mlp.gate_up|mlp.proj}.lora_a`
([R, in]) and `.lora_b` ([out, R]).

Both sources, a PEFT checkpoint (`builder/pipeline/lora.py`) and NVIDIA's `lora_weights`/
`lora_config` request tensors (`nvidia.py`), are turned into `Contribution`s and go through
`fuse`. Which projections exist is the model family's (`Projections.of(family.lora_parts())`),
handed in by whoever holds the family: nothing here looks a family up.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_backend.engine.config import ModelShape


@dataclass(frozen=True)
class Projections:
    """The projections LoRA may adapt in one model family, from the family's weight-name table
    (`lora_parts`), so each family brings its own names."""

    hf_modules: dict[str, tuple[str, int]]  # HF projection -> (runtime short name, part index)
    hf_parent: dict[str, str]               # q_proj -> self_attn
    runtime_prefix: dict[str, str]          # qkv -> attention.qkv

    @classmethod
    def of(cls, parts: list[tuple[str, str, str, int]]) -> "Projections":
        """From a family's `lora_parts()`: (HF parent, HF projection, runtime name, part index)."""
        return cls({name: (runtime.split(".")[1], index) for _, name, runtime, index in parts},
                   {name: parent for parent, name, _, _ in parts},
                   {runtime.split(".")[1]: runtime for _, _, runtime, _ in parts})

    def hf_module_name(self, layer: int, module: str) -> str:
        return f"model.layers.{layer}.{self.hf_parent[module]}.{module}"


class AdapterError(ValueError):
    """An adapter that does not fit the base model; the message names the adapter and module."""


@dataclass
class Contribution:
    """One low-rank pair on `rows` of a runtime projection's output: delta = x @ a.T @ b.T."""

    layer: int
    module: str          # runtime projection: qkv, dense, gate_up, proj
    row_offset: int      # first output row of the fused projection this pair writes
    a: torch.Tensor      # [r, in]
    b: torch.Tensor      # [rows, r], scaling folded in
    label: str           # how errors name it (the source's module name)


def runtime_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each runtime projection."""
    return {"qkv": (shape.hidden_size, shape.q_size + 2 * shape.kv_size),
            "dense": (shape.q_size, shape.hidden_size),
            "gate_up": (shape.hidden_size, 2 * shape.intermediate_size),
            "proj": (shape.intermediate_size, shape.hidden_size)}


def hf_part(shape: ModelShape, names: Projections, module: str) -> tuple[str, int, int, int]:
    """(runtime projection, in_features, first output row, output rows) of an HF projection."""
    runtime, part = names.hf_modules[module]
    in_features = runtime_dims(shape)[runtime][0]
    sizes = {"qkv": [shape.q_size, shape.kv_size, shape.kv_size],
             "dense": [shape.hidden_size],
             "gate_up": [shape.intermediate_size, shape.intermediate_size],
             "proj": [shape.hidden_size]}[runtime]
    return runtime, in_features, sum(sizes[:part]), sizes[part]


def check_pair(where: str, a: torch.Tensor, b: torch.Tensor, in_features: int, out_rows: int,
               max_rank: int) -> int:
    """Check one pair against the base projection it adapts; returns its rank. `where` names
    the adapter and the module for the error."""
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(f"{where}: lora_A and lora_B must be matrices, got shapes "
                           f"{tuple(a.shape)} and {tuple(b.shape)}")
    rank = a.shape[0]
    if a.shape[1] != in_features:
        raise AdapterError(f"{where}: lora_A is {tuple(a.shape)}, the base model's projection "
                           f"takes {in_features} inputs (an adapter for another base model?)")
    if b.shape[0] != out_rows:
        raise AdapterError(f"{where}: lora_B is {tuple(b.shape)}, the base model's projection "
                           f"has {out_rows} outputs (an adapter for another base model?)")
    if b.shape[1] != rank:
        raise AdapterError(f"{where}: lora_A has rank {rank} but lora_B has rank {b.shape[1]}")
    if not 1 <= rank <= max_rank:
        raise AdapterError(f"{where}: rank {rank} is over lora.max_rank={max_rank}"
                           if rank > max_rank else f"{where}: rank must be >= 1, got {rank}")
    for name, t in (("lora_A", a), ("lora_B", b)):
        if not torch.isfinite(t).all():
            raise AdapterError(f"{where}: {name} has non-finite values (NaN or inf)")
    return rank


def fuse(contributions: list[Contribution], shape: ModelShape, names: Projections,
         dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The runtime state dict of an adapter (see the module docstring), in `dtype`."""
    grouped: dict[tuple[int, str], list[Contribution]] = {}
    for c in contributions:
        if not 0 <= c.layer < shape.num_hidden_layers:
            raise AdapterError(f"{c.label}: layer {c.layer} does not exist, the base model has "
                               f"{shape.num_hidden_layers} layers (an adapter for another base "
                               f"model?)")
        grouped.setdefault((c.layer, c.module), []).append(c)
    dims, prefix = runtime_dims(shape), names.runtime_prefix
    state: dict[str, torch.Tensor] = {}
    for (layer, module), parts in sorted(grouped.items()):
        in_features, out_features = dims[module]
        total_rank = sum(p.a.shape[0] for p in parts)
        a = torch.cat([p.a.float() for p in parts], dim=0)
        b = torch.zeros(out_features, total_rank, device=a.device)
        column = 0
        for p in parts:
            r, rows = p.a.shape[0], p.b.shape[0]
            b[p.row_offset:p.row_offset + rows, column:column + r] = p.b.float()
            column += r
        key = f"transformer.layers.{layer}.{prefix[module]}"
        state[f"{key}.lora_a"] = a.to(dtype).contiguous()
        state[f"{key}.lora_b"] = b.to(dtype).contiguous()
    return state


def parse_key(key: str, names: Projections) -> tuple[int, str]:
    """(layer, runtime projection) of a runtime-layout key's prefix."""
    parts = key.split(".")
    module = {v: k for k, v in names.runtime_prefix.items()}[".".join(parts[3:5])]
    return int(parts[2]), module


def check_runtime_state(where: str, state: dict[str, torch.Tensor], shape: ModelShape,
                        names: Projections) -> None:
    """A runtime-layout state dict (read back from the engine directory) fits `shape`."""
    dims = runtime_dims(shape)
    for key, tensor in state.items():
        if not key.endswith((".lora_a", ".lora_b")):
            raise AdapterError(f"{where}: unexpected key {key!r}")
        try:
            layer, module = parse_key(key, names)
        except (KeyError, ValueError, IndexError):
            raise AdapterError(f"{where}: unexpected key {key!r}") from None
        if layer >= shape.num_hidden_layers:
            raise AdapterError(f"{where}: {key}: layer {layer} does not exist")
        in_features, out_features = dims[module]
        expected = in_features if key.endswith("lora_a") else out_features
        dim = 1 if key.endswith("lora_a") else 0
        if tensor.dim() != 2 or tensor.shape[dim] != expected:
            raise AdapterError(f"{where}: {key} has shape {tuple(tensor.shape)}, expected "
                               f"{expected} along dim {dim}")


def hf_contribution(where: str, layer: int, module: str, a: torch.Tensor, b: torch.Tensor,
                    shape: ModelShape, names: Projections, max_rank: int) -> Contribution:
    """Check the pair (A [r, in], B [out, r], scaling folded in) on HF projection `module` of
    `layer` against the base and place it in the fused projection."""
    supported = names.hf_modules
    if module not in supported:
        raise AdapterError(f"{where}: LoRA on {module!r} is not supported (supported: "
                           f"{sorted(supported)})")
    runtime, in_features, row_offset, rows = hf_part(shape, names, module)
    if not 0 <= layer < shape.num_hidden_layers:
        raise AdapterError(f"{where}: layer {layer} does not exist, the base model has "
                           f"{shape.num_hidden_layers} layers (an adapter for another base model?)")
    check_pair(where, a, b, in_features, rows, max_rank)
    return Contribution(layer, runtime, row_offset, a, b, where)
