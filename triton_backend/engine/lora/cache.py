"""The adapter cache: which adapters the engine knows, which are in host memory, which are
resident for compute.

Two tiers, both least recently used first out:

- host (`max_cpu_loras`): adapters in the runtime layout as stored. Built-in adapters are read
  from the engine directory on first use and come back from there after an eviction; adapters
  sent with a request (NVIDIA's `lora_weights` + `lora_config`) live only here: once evicted,
  a request naming their task id alone is refused until the weights are sent again (NVIDIA's
  semantics).
- resident (`max_loras`): the host copy made ready for `x @ A^T @ B^T` when a step first needs
  the adapter. A bf16 engine whose projections use the packed bf16 kernel (`cpu/linear.py`)
  also packs A and B for that kernel (from 4 rows on about twice as fast as torch's fp32 GEMM
  here); A^T and B^T are always kept in float32, for fewer rows and for other engines: torch's
  CPU GEMM for rank-wide shapes is several times faster in float32 than in bfloat16 (one
  576 x 48 x 960 pair at one row: 8 us vs 70-100 us).

An adapter held by a request in flight (waiting or running) is never evicted from the host tier;
the scheduler never runs more than `max_loras` distinct adapters in one step, so `activate` can
always make room in the resident tier.

Loads run on the engine loop's thread (a request's adapter when the loop admits it, a resident copy
when a step first needs it), so they advance the engine's progress count between their phases and
per projection: the watchdog sees a large adapter load as work, not as a frozen engine.
"""
from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from triton_backend.engine.config import EngineConfig, LoraAdapterInfo
from triton_backend.engine.lora.layout import Projections, check_runtime_state, fuse, parse_key
from triton_backend.engine.lora.nvidia import contributions_from_nvidia
from triton_backend.engine.progress import Progress


@dataclass
class HostAdapter:
    task_id: int
    name: str
    state: dict[str, torch.Tensor]  # runtime layout (layout.py)
    fingerprint: str                # names the weights: the prefix cache's salt
    builtin: bool


@dataclass
class ResidentAdapter:
    task_id: int
    # (layer, runtime projection) -> (A^T [in, R], B^T [R, out]) in float32
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # the same (A, B) as PackedBf16Linear modules, when the engine uses that kernel
    packed: dict[tuple[int, str], tuple] = field(default_factory=dict)
    # (A^T, B^T) as stored (bf16 on a bf16 engine) for the C++ few-rows kernel, which widens
    # them exactly: the same sums as `pairs`, half the bytes; absent: use `pairs`
    stored: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def few_rows_pair(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.stored.get(key) or self.pairs.get(key)


class AdapterCache:
    def __init__(self, engine_dir: str | Path, config: EngineConfig, dtype: torch.dtype,
                 lora_parts: list, progress: Progress | None = None) -> None:
        """`lora_parts`: the model family's; `progress`: the engine's count (a new one if None)."""
        if config.lora is None:
            raise ValueError("lora: the engine was built without a lora section")
        self.engine_dir = Path(engine_dir)
        self.shape, self.projections = config.model, Projections.of(lora_parts)
        self.limits = config.lora
        self.dtype = dtype
        self.storage_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        self.builtin: dict[int, LoraAdapterInfo] = {a.task_id: a for a in config.lora.adapters}
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()
        self.resident: OrderedDict[int, ResidentAdapter] = OrderedDict()
        self.holds: Counter[int] = Counter()
        # The backend's packing of a resident adapter's A and B for its GEMM (None: none).
        self.pack = None
        self.progress = progress or Progress()
        self.stats = {"lora_num_loads": 0, "lora_num_evictions": 0,
                      "lora_num_host_loads": 0, "lora_num_host_evictions": 0,
                      "lora_load_seconds": 0.0}

    # -- requests ---------------------------------------------------------------------------
    def acquire(self, task_id: int, weights=None, config=None) -> HostAdapter:
        """The adapter a request names (loading the weights it carries under `task_id`), held
        until `release`. Raises ValueError naming the task id when it cannot be served."""
        if weights is not None or config is not None:
            adapter = self._from_request(task_id, weights, config)
        elif task_id in self.host:
            adapter = self.host[task_id]
            self.host.move_to_end(task_id)
        elif task_id in self.builtin:
            adapter = self._insert_host(self._read_builtin(self.builtin[task_id]))
        else:
            raise ValueError(f"lora_task_id {task_id}: no LoRA adapter is cached under this id; "
                             f"send lora_weights and lora_config with it to load one")
        self.holds[task_id] += 1
        return adapter

    def release(self, task_id: int) -> None:
        self.holds[task_id] -= 1
        if self.holds[task_id] <= 0:
            del self.holds[task_id]

    def release_all(self) -> None:
        self.holds.clear()

    def name_of(self, task_id: int) -> str:
        adapter = self.host.get(task_id)
        return adapter.name if adapter else self.builtin[task_id].name

    def _from_request(self, task_id: int, weights, config) -> HostAdapter:
        if weights is None or config is None:
            raise ValueError(f"lora_task_id {task_id}: lora_weights and lora_config come "
                             f"together (got only {'lora_config' if weights is None else 'lora_weights'})")
        if task_id in self.builtin:
            raise ValueError(f"lora_task_id {task_id} names the built-in adapter "
                             f"{self.builtin[task_id].name!r}; send new weights under another id")
        weights, config = np.asarray(weights), np.asarray(config)
        self.progress.tick()
        digest = hashlib.sha256(weights.astype(np.float32).tobytes()
                                + config.astype(np.int64).tobytes()).hexdigest()
        self.progress.tick()
        cached = self.host.get(task_id)
        if cached is not None and cached.fingerprint == digest:
            self.host.move_to_end(task_id)
            return cached
        if cached is not None and self.holds[task_id]:
            raise ValueError(f"lora_task_id {task_id}: other weights are cached under this id "
                             f"and in use by requests in flight")
        started = time.perf_counter()
        contributions = contributions_from_nvidia(weights, config, self.shape, self.projections,
                                                  self.limits.max_rank, task_id)
        self.progress.tick()
        state = fuse(contributions, self.shape, self.projections, self.storage_dtype)
        self.progress.tick()
        self.stats["lora_load_seconds"] += time.perf_counter() - started
        self._drop(task_id)
        return self._insert_host(HostAdapter(task_id, f"task-{task_id}", state, digest, False))

    def _read_builtin(self, info: LoraAdapterInfo) -> HostAdapter:
        from safetensors.torch import load_file

        started = time.perf_counter()
        state = load_file(str(self.engine_dir / info.file))
        self.progress.tick()
        check_runtime_state(f"lora.adapters.{info.name}", state, self.shape,
                            self.projections)
        self.stats["lora_load_seconds"] += time.perf_counter() - started
        return HostAdapter(info.task_id, info.name, state, info.sha256, True)

    def _insert_host(self, adapter: HostAdapter) -> HostAdapter:
        while len(self.host) >= self.limits.max_cpu_loras:
            victim = next((tid for tid in self.host if not self.holds[tid]), None)
            if victim is None:
                raise ValueError(f"lora_task_id {adapter.task_id}: every one of the "
                                 f"lora.max_cpu_loras={self.limits.max_cpu_loras} cached "
                                 f"adapters is in use by requests in flight; retry later")
            self._drop(victim)
            self.stats["lora_num_host_evictions"] += 1
        self.host[adapter.task_id] = adapter
        self.stats["lora_num_host_loads"] += 1
        return adapter

    def _drop(self, task_id: int) -> None:
        self.host.pop(task_id, None)
        self.resident.pop(task_id, None)

    # -- steps ------------------------------------------------------------------------------
    def activate(self, task_ids: set[int]) -> dict[int, ResidentAdapter]:
        """Make the adapters of a step resident (at most max_loras of them, held)."""
        if len(task_ids) > self.limits.max_loras:
            raise RuntimeError(f"a step with {len(task_ids)} adapters, over lora.max_loras="
                               f"{self.limits.max_loras}")
        out = {}
        for task_id in task_ids:
            if task_id in self.resident:
                self.resident.move_to_end(task_id)
            else:
                self._make_resident(task_id, keep=task_ids)
            out[task_id] = self.resident[task_id]
        return out

    def _make_resident(self, task_id: int, keep: set[int]) -> None:
        while len(self.resident) >= self.limits.max_loras:
            victim = next(tid for tid in self.resident if tid not in keep)
            del self.resident[victim]
            self.stats["lora_num_evictions"] += 1
        started = time.perf_counter()
        state = self.host[task_id].state
        pairs, packed, stored = {}, {}, {}
        for key in state:
            self.progress.tick()
            if key.endswith(".lora_a"):
                a, b = state[key], state[f"{key[:-len('.lora_a')]}.lora_b"]
                slot = parse_key(key, self.projections)
                pairs[slot] = (a.float().t().contiguous(), b.float().t().contiguous())
                if a.dtype == torch.bfloat16:
                    stored[slot] = (a.t().contiguous(), b.t().contiguous())
                if self.pack is not None:
                    packed[slot] = (self.pack(a), self.pack(b))
        self.resident[task_id] = ResidentAdapter(task_id, pairs, packed, stored)
        self.stats["lora_num_loads"] += 1
        self.stats["lora_load_seconds"] += time.perf_counter() - started

    def get_stats(self) -> dict:
        return dict(self.stats, lora_num_resident=len(self.resident),
                    lora_num_host_adapters=len(self.host))
