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
import resource
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



# A plan measured while other processes used more than this share of the machine's CPU time
# is measured again at the next start (a build or a benchmark beside it can turn a 5x win into
# a tie).
BUSY_SHARE = 0.25


def cached_plan(path: Path, shape: str, version: int) -> tuple[dict, dict | None]:
    """A plan cache's entries, and `shape`'s where it was measured by this `version` of the
    rule on a machine other processes left mostly to it (plans measured by an older rule or
    kernel set, or while the machine was busy, are measured again)."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    entry = cached.get(shape)
    if not isinstance(entry, dict) or entry.get("version") != version:
        return cached, None
    busy = entry.get("others_cpu_share", 0.0)
    if busy > BUSY_SHARE:
        log.info("plan for %s was measured while other processes used %.0f%% of the CPUs; "
                 "measuring it again", shape, 100 * busy)
        return cached, None
    return cached, entry


def _machine_cpu_seconds() -> tuple[float, float] | None:
    """(busy, all) CPU seconds of every CPU since boot (/proc/stat), None where it is absent."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields) - idle) / tick, sum(fields) / tick


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


class OthersCpuShare:
    """`with OthersCpuShare() as busy:` ... `busy.share`: the share of the machine's CPU time
    that other processes used meanwhile (0.0 where /proc/stat is absent)."""

    share = 0.0

    def __enter__(self) -> "OthersCpuShare":
        self._machine, self._own = _machine_cpu_seconds(), _own_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        machine, own = _machine_cpu_seconds(), _own_cpu_seconds()
        if machine is None or self._machine is None or machine[1] <= self._machine[1]:
            return
        others = machine[0] - self._machine[0] - (own - self._own)
        self.share = round(max(0.0, others / (machine[1] - self._machine[1])), 3)


def keep_plan(path: Path, cached: dict) -> None:
    """Cache measured plans. A cache it cannot write (an image's, under a read-only root
    filesystem, on a CPU the image was not built on) only means measuring again next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1) + "\n")
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


def best_times(fns, repeats: int = 7) -> list[float]:
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
SHAPE_PLAN_VERSION = 2  # plans measured by an older rule or kernel set are measured again


def upcast_threshold(upcast_over_packed: dict[int, float]) -> int | None:
    """The smallest measured M from which widening wins by 10% at that M and every larger one."""
    threshold = None
    for m in sorted(upcast_over_packed, reverse=True):
        if upcast_over_packed[m] >= 1 / 1.1:
            break
        threshold = m
    return threshold


def _plan_from_timings(torch_over_packed: list[float], upcast_over_packed: dict[int, float],
                       layout: str = "tiles",
                       torch_over_prefill: dict[int, float] | None = None) -> Bf16GemmPlan:
    """Packed where it is not slower than torch's GEMM at any decode size (within 5%: at one
    row both read the weight once, at the memory's speed) and 10% faster at one measured size,
    a prefill's included (`torch_over_prefill`: torch's time over the faster of the kernel and
    widening; on a CPU without AVX-512 BF16, torch's bf16 GEMM is the slow one there)."""
    wins = [*torch_over_packed, *(torch_over_prefill or {}).values()]
    if min(torch_over_packed) < 0.95 or max(wins) <= 1.1:
        return Bf16GemmPlan(False)
    return Bf16GemmPlan(True, upcast_threshold(upcast_over_packed), layout)


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


def _measure_layout(layout: str, weight: torch.Tensor, k: int
                    ) -> tuple[list[float], dict[int, float], dict[int, float]]:
    """torch's time over the packed kernel's at decode sizes; above them (not for weights over
    UPCAST_MAX_WEIGHTS) widening's over the kernel's, and torch's over the faster of the two."""
    layer = PackedBf16Linear(weight, None, layout=layout)
    large = weight.numel() > UPCAST_MAX_WEIGHTS
    torch_over_packed, upcast_over_packed, torch_over_prefill = [], {}, {}
    for m in (1, 16) if large else (1, 16, *UPCAST_ROWS):
        x = torch.randn(m, k, device="cpu").to(torch.bfloat16)
        if m <= 16:
            ours, theirs = best_times([lambda: layer(x), lambda: F.linear(x, weight)],
                                       5 if large else 15)
            torch_over_packed.append(theirs / ours)
        else:
            ours, widened, theirs = best_times(
                [lambda: layer(x), lambda: layer.widened(x), lambda: F.linear(x, weight)], 3)
            upcast_over_packed[m] = widened / ours
            torch_over_prefill[m] = theirs / min(ours, widened)
    return torch_over_packed, upcast_over_packed, torch_over_prefill


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
    cached, entry = cached_plan(path, shape, SHAPE_PLAN_VERSION)
    if entry is not None:
        try:
            return Bf16GemmPlan(**entry["plan"])
        except (KeyError, TypeError):
            pass
    weight = torch.randn(out_features, in_features, device="cpu").to(torch.bfloat16)
    layouts = dict.fromkeys(layout_for(name, in_features) for name in available_layouts())
    with OthersCpuShare() as busy:
        timings = {layout: _measure_layout(layout, weight, in_features) for layout in layouts}
    # The layout whose worse decode-size ratio over torch is best.
    layout = max(timings, key=lambda name: min(timings[name][0]))
    decode, upcast, prefill = timings[layout]
    plan = _plan_from_timings(decode, upcast, layout, prefill)
    cached[shape] = {"plan": plan.__dict__, "version": SHAPE_PLAN_VERSION,
                     "others_cpu_share": busy.share,
                     "torch_over_packed_time": {name: t[0] for name, t in timings.items()},
                     "upcast_over_packed_time": {name: t[1] for name, t in timings.items()},
                     "torch_over_prefill_time": {name: t[2] for name, t in timings.items()}}
    keep_plan(path, cached)
    log.info("bf16 GEMM plan for %s: %s", shape, plan)
    return plan
