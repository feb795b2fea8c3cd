"""bf16 projections on our packed-weight GEMM kernels, and when to use them.

`pack_linears(model, plan)` swaps the plain bf16 `nn.Linear`s of a loaded model (and the LM head
of tied embeddings) for `PackedBf16Linear`s that keep the weight in a kernel's layout: `tiles`
(gemm.cpp: weights widened to fp32 in registers, for CPUs without bf16 dot products), `pairs`
(gemm_bf16_dot.cpp: AVX-512 BF16 dot products) or `amx` (gemm_bf16_amx.cpp: the pairs' bytes as
AMX tiles). Each weight shape is packed only where a kernel beats torch's own bf16 GEMM on this
machine (`bf16_gemm_plan`, measured once per machine, kernel build and shape, cached;
`LLM_FORGE_GEMM_PLAN` forces one plan for every shape, e.g. to run the suite as another CPU
would).
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from triton_backend.engine.cache_dir import cache_root

log = logging.getLogger(__name__)
TILE = 16
LAYOUTS = ("tiles", "pairs", "amx")
PLAN_ENV = "LLM_FORGE_GEMM_PLAN"  # auto (measure) | torch | tiles | pairs | amx
PLAN_CHOICES = ("auto", "torch", *LAYOUTS)
LAYOUT_K_MULTIPLE = {"tiles": 1, "pairs": 2, "amx": 32}  # what in_features must divide into



def _keep_plan(path: Path, text: str) -> None:
    """Cache a measured plan. A cache it cannot write (an image's, under a read-only root
    filesystem, on a CPU the image was not built on) only means measuring again next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        log.warning("GEMM plan not cached (%s); it is measured again at the next start", exc)

def pack_weight(weight: torch.Tensor, layout: str = "tiles") -> torch.Tensor:
    """[N, K] -> bf16 tiles of 16 output columns. `tiles`: [ceil(N / 16), K, 16], tile t holds
    columns 16t..16t+15, k-major. `pairs`: [ceil(N / 16), K / 2, 16, 2], each column's k in
    consecutive pairs (the operand order of a bf16 dot-product instruction); K must be even.
    `amx`: the same bytes viewed as [ceil(N / 16), K / 32, 16, 16, 2], one AMX B tile per 32 k
    (the view tells the op which kernel reads it); K must be a multiple of 32."""
    n, k = weight.shape
    padded = -(-n // TILE) * TILE
    tiles = torch.zeros(padded, k, dtype=torch.bfloat16, device="cpu")
    tiles[:n] = weight
    if layout in ("pairs", "amx"):
        if k % LAYOUT_K_MULTIPLE[layout]:
            raise ValueError(f"the {layout} layout needs in_features divisible by "
                             f"{LAYOUT_K_MULTIPLE[layout]}, got {k}")
        pairs = tiles.view(padded // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return pairs if layout == "pairs" else pairs.view(padded // TILE, k // 32, 16, TILE, 2)
    return tiles.view(padded // TILE, TILE, k).permute(0, 2, 1).contiguous()


def layout_for(layout: str, in_features: int) -> str:
    """The layout a weight of `in_features` takes when `layout` is asked for: the next simpler
    one where K does not fit it (amx -> pairs -> tiles)."""
    while in_features % LAYOUT_K_MULTIPLE[layout]:
        layout = LAYOUTS[LAYOUTS.index(layout) - 1]
    return layout


class PackedBf16Linear(nn.Module):
    """y = x W^T (+ b) with W packed for `torch.ops.llm_forge.linear_bf16_packed` (which reads
    either layout); from `upcast_min_rows` rows on, W is widened to fp32 for torch's fp32 GEMM
    instead. The pairs kernel multiplies bf16 activations only: other dtypes take the widened
    weight, as the tiles kernel would compute them."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 upcast_min_rows: int | None = None, layout: str = "tiles") -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.upcast_min_rows = upcast_min_rows
        self.layout = layout_for(layout, self.in_features)
        self.register_buffer("packed", pack_weight(weight, self.layout))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._widens(x):
            return self.widened(x)
        return torch.ops.llm_forge.linear_bf16_packed(x, self.packed, self.bias,
                                                      self.out_features)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """The same product with fp32 outputs: the kernel's fp32 sums, not rounded to x's dtype
        (the LM head's logits: bf16 rounding at 25 is 0.125 and turns near-ties into ties)."""
        if self._widens(x):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight_rows().float(), bias)
        return torch.ops.llm_forge.linear_bf16_packed(x, self.packed, self.bias,
                                                      self.out_features, True)

    def _widens(self, x: torch.Tensor) -> bool:
        return ((self.upcast_min_rows is not None
                 and x.numel() >= self.upcast_min_rows * self.in_features)
                or (self.layout != "tiles" and x.dtype != torch.bfloat16))

    def _pairs(self) -> torch.Tensor:
        return self.packed.view(self.packed.shape[0], self.in_features // 2, TILE, 2)

    def weight_rows(self) -> torch.Tensor:
        """The bf16 [N, K] weight as a view of the packed one (not contiguous)."""
        if self.layout == "tiles":
            rows = self.packed.permute(0, 2, 1)
        else:
            rows = self._pairs().permute(0, 2, 1, 3)
        return rows.reshape(-1, self.in_features)[:self.out_features]

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        """The fp32 GEMM on the weight widened for this call (rounded once, at the end)."""
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight_rows().float(), bias).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows W[ids] (an embedding lookup when W is a tied embedding table)."""
        if self.layout != "tiles":
            picked = self._pairs()[ids // TILE, :, ids % TILE, :]  # [..., K / 2, 2]
            return picked.reshape(*ids.shape, self.in_features)
        return self.packed[ids // TILE, :, ids % TILE]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"packed bf16 ({self.layout})")


class PackedEmbedding(nn.Module):
    """The token embedding of a tied model, read from the LM head's packed table (one copy)."""

    def __init__(self, table: PackedBf16Linear) -> None:
        super().__init__()
        self.table = [table]  # not a submodule: the LM head owns the weights

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[0].rows(ids)


def pack_linears(model: nn.Module, plan: Bf16GemmPlan) -> int:
    """Swap the model's bf16 `nn.Linear`s (and a tied LM head) for packed ones where `plan`
    packs their shape (`plan.for_shape`); returns how many were swapped."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                shape_plan = plan.for_shape(*child.weight.shape)
                if shape_plan.packed:
                    setattr(parent, name, PackedBf16Linear(
                        child.weight.data, child.bias, shape_plan.upcast_min_rows,
                        shape_plan.layout))
                    count += 1
    if getattr(model, "lm_head", None) is None and model.tie_word_embeddings:
        embedding = model.transformer.vocab_embedding
        shape_plan = plan.for_shape(*embedding.weight.shape)
        if embedding.weight.dtype == torch.bfloat16 and shape_plan.packed:
            model.lm_head = PackedBf16Linear(embedding.weight.data, None,
                                             shape_plan.upcast_min_rows, shape_plan.layout)
            model.transformer.vocab_embedding = PackedEmbedding(model.lm_head)
            count += 1
    return count


def _best_times(fns, repeats: int = 7) -> list[float]:
    """The fastest of `repeats` calls of each of `fns`, timed in turns (one call of each per
    round): other processes only ever add time, so the minimum is the steadiest estimate of a
    kernel's own cost, and taking turns means a burst of load cannot fall on one candidate's
    runs alone (these choices are cached per machine)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return [min(fn_times) for fn_times in times]


@dataclass(frozen=True)
class Bf16GemmPlan:
    """How bf16 projections run on this machine: a packed kernel (`layout`) or torch's own bf16
    GEMM, and from how many rows on (if ever) the packed weights are widened to fp32 for torch's
    fp32 GEMM instead (MKL's blocking for large M beats the packed kernels' register tiles).

    With `measured_in` (a plan key) the plan is the machine's, decided per projection shape:
    `for_shape` measures each (in, out) shape once and caches it under that key, because one
    shape's winner says little about another's (Gemma 3's 262k x 640 LM head against a
    2048 x 1024 projection). Without it (a forced plan, or one shape's) every shape takes it."""

    packed: bool
    upcast_min_rows: int | None = None
    layout: str = "tiles"
    measured_in: str | None = None

    def for_shape(self, out_features: int, in_features: int) -> Bf16GemmPlan:
        if self.measured_in is None:
            return self
        return bf16_shape_plan(self.measured_in, in_features, out_features)


UPCAST_ROWS = (256, 512, 1024)  # where widening for torch's fp32 GEMM is measured
# Shapes above this many weights are not measured widened (an LM head's fp32 copy per call:
# gigabytes at a large vocabulary, never the faster way to a few rows' logits).
UPCAST_MAX_WEIGHTS = 1 << 24
SHAPE_PLAN_VERSION = 1  # plans measured by an older rule or kernel set are measured again


def _upcast_threshold(upcast_over_packed: dict[int, float]) -> int | None:
    """The smallest measured M from which widening wins by 10% at that M and every larger one."""
    threshold = None
    for m in sorted(upcast_over_packed, reverse=True):
        if upcast_over_packed[m] >= 1 / 1.1:
            break
        threshold = m
    return threshold


def _plan_from_timings(torch_over_packed: list[float], upcast_over_packed: dict[int, float],
                       layout: str = "tiles") -> Bf16GemmPlan:
    packed = min(torch_over_packed) > 1.1
    if not packed:
        return Bf16GemmPlan(False)
    return Bf16GemmPlan(True, _upcast_threshold(upcast_over_packed), layout)


def available_layouts() -> tuple[str, ...]:
    """The packed layouts this build of the kernels can run (pairs needs AVX-512 BF16, amx
    AMX-BF16 and the tile state granted to the process)."""
    if not torch.ops.llm_forge.bf16_dot_available():
        return ("tiles",)
    return LAYOUTS if torch.ops.llm_forge.bf16_amx_available() else ("tiles", "pairs")


def forced_plan() -> Bf16GemmPlan | None:
    """The plan `LLM_FORGE_GEMM_PLAN` asks for, or None (auto: measure)."""
    choice = os.environ.get(PLAN_ENV, "auto").strip().lower()
    if choice not in PLAN_CHOICES:
        raise ValueError(f"{PLAN_ENV} must be one of {', '.join(PLAN_CHOICES)}, got {choice!r}")
    if choice == "auto":
        return None
    if choice == "torch":
        return Bf16GemmPlan(False)
    if choice not in available_layouts():
        raise ValueError(f"{PLAN_ENV}={choice}: this build of the kernels has no {choice} kernel "
                         f"(it runs {', '.join(available_layouts())})")
    return Bf16GemmPlan(True, None, choice)


def _measure_layout(layout: str, weight: torch.Tensor, k: int) -> tuple[list[float], dict]:
    """torch's time over the packed kernel's at decode sizes, and widening's over it above
    (not for weights over UPCAST_MAX_WEIGHTS)."""
    layer = PackedBf16Linear(weight, None, layout=layout)
    large = weight.numel() > UPCAST_MAX_WEIGHTS
    torch_over_packed, upcast_over_packed = [], {}
    for m in (1, 16) if large else (1, 16, *UPCAST_ROWS):
        x = torch.randn(m, k, device="cpu").to(torch.bfloat16)
        if m <= 16:
            ours, theirs = _best_times([lambda: layer(x), lambda: F.linear(x, weight)],
                                       5 if large else 15)
            torch_over_packed.append(theirs / ours)
        else:
            ours, widened = _best_times([lambda: layer(x), lambda: layer.widened(x)], 3)
            upcast_over_packed[m] = widened / ours
    return torch_over_packed, upcast_over_packed


def bf16_gemm_plan(key: str) -> Bf16GemmPlan:
    """Forced by `LLM_FORGE_GEMM_PLAN`, else the machine's plan, measured per projection shape
    (`Bf16GemmPlan.for_shape`; `key` names the CPU and kernel build, so another machine measures
    anew)."""
    forced = forced_plan()
    if forced is not None:
        return forced
    return Bf16GemmPlan(True, None, available_layouts()[-1], key)


def bf16_shape_plan(key: str, in_features: int, out_features: int) -> Bf16GemmPlan:
    """The plan for one weight shape: measured once per machine, kernel build and shape, then
    read from the cache. Each layout that fits the shape is timed in turns with torch's GEMM and
    by its fastest run, so load on the machine while it is measured slows every candidate alike
    instead of deciding the plan."""
    path = cache_root() / "kernels" / key / "bf16_shape_plans.json"
    shape = f"{in_features}x{out_features}"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(shape)
    if isinstance(entry, dict) and entry.get("version") == SHAPE_PLAN_VERSION:
        try:
            return Bf16GemmPlan(**entry["plan"])
        except (KeyError, TypeError):
            pass
    weight = torch.randn(out_features, in_features, device="cpu").to(torch.bfloat16)
    layouts = dict.fromkeys(layout_for(name, in_features) for name in available_layouts())
    timings = {layout: _measure_layout(layout, weight, in_features) for layout in layouts}
    # The layout whose worse decode-size ratio over torch is best.
    layout = max(timings, key=lambda name: min(timings[name][0]))
    plan = _plan_from_timings(*timings[layout], layout)
    cached[shape] = {"plan": plan.__dict__, "version": SHAPE_PLAN_VERSION,
                     "torch_over_packed_time": {name: t[0] for name, t in timings.items()},
                     "upcast_over_packed_time": {name: t[1] for name, t in timings.items()}}
    _keep_plan(path, json.dumps(cached, indent=1) + "\n")
    log.info("bf16 GEMM plan for %s: %s", shape, plan)
    return plan


DOT_PANEL = 32  # output columns per panel of the int8-activation kernels (four registers of 8)


def pack_int4_dot(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 q [N, K] (values in [-8, 7]), scales [N, K / group] and optional zeros (w = q * scale
    + zero) -> the INT4 kernel's layout (gemm_int4_dot.cpp): uint8 [ceil(N/32), K/8, 128], the
    stored nibbles u = q + 8 of column 8r + c for k = 8s + j (low) and 8s + 4 + j (high) in byte
    32r + 4c + j of step s; and fp16 [ceil(N/32), K / group, 64], per register r of 8 columns
    their 8 scales then their 8 offsets c = zero - 8 * scale (so that w = u * scale + c). K must
    be a multiple of 8."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"the INT4 kernel needs in_features divisible by 8, got {k}")
    panels = -(-n // DOT_PANEL)
    padded = panels * DOT_PANEL
    u = torch.zeros(padded, k, dtype=torch.uint8, device="cpu")  # padding columns: scale 0, offset 0
    u[:n] = (q.to(torch.int16) + 8).to(torch.uint8)
    u = u.view(panels, 4, 8, k // 8, 2, 4)  # [panel, register, column, step, half, j]
    packed = (u[..., 0, :] | (u[..., 1, :] << 4)).permute(0, 3, 1, 2, 4)  # [p, step, r, c, j]
    groups = scales.shape[1]
    scale = torch.zeros(padded, groups, dtype=torch.float32, device="cpu")
    scale[:n] = scales.float()
    offset = -8 * scale
    if zeros is not None:
        offset[:n] = zeros.float() - 8 * scales.float()
    params = torch.stack((scale.view(panels, 4, 8, groups),
                          offset.view(panels, 4, 8, groups)), dim=2)  # [p, r, 2, c, g]
    params = params.permute(0, 4, 1, 2, 3).reshape(panels, groups, 64)
    return packed.reshape(panels, k // 8, 128).contiguous(), params.to(torch.float16).contiguous()


def pack_int8_dot(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> int8 per column and block of 32 inputs (q = round(w / s), s = max |w| / 127:
    llama.cpp's Q8_0) in the int8 kernel's layout: the values as uint8 [ceil(N/32), K/4, 128],
    column 8r + c's q for k = 4s + j in byte 32r + 4c + j of step s, and fp16 scales
    [ceil(N/32), K/32, 32]. K must be a multiple of 32."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"the int8 kernel needs in_features divisible by 32, got {k}")
    panels = -(-n // DOT_PANEL)
    padded = panels * DOT_PANEL
    blocks = weight.float().reshape(n, k // 32, 32)
    scale = (blocks.abs().amax(-1) / 127).half()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.zeros(padded, k, dtype=torch.int8, device="cpu")
    q[:n] = (blocks / safe[..., None]).round().clamp(-127, 127).reshape(n, k).to(torch.int8)
    scales = torch.zeros(padded, k // 32, dtype=torch.float16, device="cpu")
    scales[:n] = scale
    packed = q.view(panels, 4, 8, k // 4, 4).permute(0, 3, 1, 2, 4)  # [p, step, r, c, j]
    packed = packed.reshape(panels, k // 4, 128).contiguous().view(torch.uint8)
    scales = scales.view(panels, DOT_PANEL, k // 32).permute(0, 2, 1).contiguous()
    return packed, scales


class Int8Head(nn.Module):
    """An LM head in int8 (`quantization.lm_head: int8`): the int8 kernel multiplies it by the
    hidden states quantized to int8 per block of 32, returning fp32 logits. The token embedding
    of a tied model keeps its bf16 table for lookups."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed, scales = pack_int8_dot(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_forge.linear_int8_packed(x, self.packed, self.scales,
                                                      self.out_features, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_fp32(x).to(x.dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 [N, K] weight the kernel multiplies by (for tests and checks)."""
        panels, steps, _ = self.packed.shape
        q = self.packed.view(torch.int8).view(panels, steps, 4, 8, 4).permute(0, 2, 3, 1, 4)
        q = q.reshape(panels * DOT_PANEL, steps * 4)[:self.out_features].float()
        scales = self.scales.permute(0, 2, 1).reshape(-1, self.in_features // 32)
        return q * scales[:self.out_features].float().repeat_interleave(32, 1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_lm_head(model: nn.Module) -> bool:
    """Swap the model's LM head (or the projection of its tied embedding) for an `Int8Head`;
    False when the head is not a bf16/fp32 weight of a width the kernel takes."""
    head = model.lm_head
    if head is None:
        weight = model.transformer.vocab_embedding.weight
    elif isinstance(head, PackedBf16Linear):
        weight = head.weight_rows()
    elif type(head) is nn.Linear:
        weight = head.weight
    else:
        return False
    if weight.shape[1] % 32:
        return False
    model.lm_head = Int8Head(weight.detach())
    return True


@dataclass(frozen=True)
class Int4Choice:
    """For one INT4 weight shape: which kernel runs decode-sized calls ('cpp' ours, 'torch'
    torch's int4pack), from how many rows on the weights are dequantized for torch's dense GEMM
    instead (large prefills), and in which dtype bf16 activations meet them there
    (`upcast_dtype`: 'bfloat16' where torch's bf16 GEMM has the hardware for it and wins, else
    'float32')."""

    kernel: str
    upcast_min_rows: int | None = None
    upcast_dtype: str = "float32"


# Prefill row counts where dequantizing for torch's GEMM is timed against the INT4 kernel: a
# prompt of a hundred tokens already runs a GEMM that a 4-bit kernel does not make cheaper.
INT4_UPCAST_ROWS = (32, 64, 128, 256, 512, 1024)
INT4_PLAN_VERSION = 3  # plans measured by an older rule or kernel are measured again


def int4_kernel_choice(key: str, in_features: int, out_features: int, group_size: int
                       ) -> Int4Choice:
    """Our kernel wins at 1 and 16 tokens (decode batch sizes) or torch's does; measured once
    per machine, kernel build and shape, then read from the cache. Only the winner's layout is
    kept in memory."""
    path = cache_root() / "kernels" / key / "int4_plan.json"
    shape = f"{in_features}x{out_features}/g{group_size}"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if shape in cached and cached[shape].get("version") == INT4_PLAN_VERSION:
        return Int4Choice(**cached[shape]["choice"])
    from triton_backend.engine.quant import int4

    q, scales = int4.quantize_rtn(torch.randn(out_features, in_features, device="cpu"), group_size)
    ours = pack_int4_dot(q, scales)
    theirs = torch._convert_weight_to_int4pack_for_cpu((q.to(torch.int32) + 8).contiguous(), 1)
    scale_t = scales.t().to(torch.bfloat16)
    zeros = torch.stack((scale_t, torch.zeros_like(scale_t)), dim=-1).contiguous()
    kernels = {
        "cpp": lambda x: torch.ops.llm_forge.linear_int4_packed(
            x, ours[0], ours[1], None, None, group_size, out_features),
        "torch": lambda x: torch._weight_int4pack_mm_for_cpu(x, theirs, group_size, zeros)}
    torch_over_ours = []
    for m in (1, 16) if group_size in int4.TORCH_INT4PACK_GROUP_SIZES else ():
        x = torch.randn(m, in_features, device="cpu").to(torch.bfloat16)
        t_ours, t_torch = _best_times([lambda: kernels["cpp"](x), lambda: kernels["torch"](x)], 15)
        torch_over_ours.append(t_torch / t_ours)
    wins = not torch_over_ours or min(torch_over_ours) >= 1.0 or sum(torch_over_ours) >= 2.0
    winner = "cpp" if wins else "torch"
    # Large prefills: the winner against dequantizing (our layout) for torch's dense GEMM.
    dense = lambda: dequantize_int4(ours[0], ours[1], group_size, out_features)  # noqa: E731
    upcast_over_kernel: dict[str, dict[int, float]] = {"float32": {}, "bfloat16": {}}
    for m in INT4_UPCAST_ROWS:
        x = torch.randn(m, in_features, device="cpu").to(torch.bfloat16)
        t_kernel, t_fp32, t_bf16 = _best_times([
            lambda: kernels[winner](x), lambda: F.linear(x.float(), dense()),
            lambda: F.linear(x, dense().to(torch.bfloat16))], 3)
        upcast_over_kernel["float32"][m] = t_fp32 / t_kernel
        upcast_over_kernel["bfloat16"][m] = t_bf16 / t_kernel
    # The dtype whose dequantize-and-GEMM is faster at the largest measured row count.
    largest = max(INT4_UPCAST_ROWS)
    dtype = min(upcast_over_kernel, key=lambda name: upcast_over_kernel[name][largest])
    choice = Int4Choice(winner, _upcast_threshold(upcast_over_kernel[dtype]), dtype)
    cached[shape] = {"choice": choice.__dict__, "torch_over_ours_time": torch_over_ours,
                     "upcast_over_kernel_time": upcast_over_kernel, "version": INT4_PLAN_VERSION}
    _keep_plan(path, json.dumps(cached, indent=1) + "\n")
    log.info("INT4 %s: %s", shape, choice)
    return choice


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int,
                    out_features: int) -> torch.Tensor:
    """The dense fp32 [out, in] weight of the INT4 kernel's packed layout (offsets included)."""
    return torch.ops.llm_forge.dequantize_int4_packed(packed, scales, group_size, out_features)
