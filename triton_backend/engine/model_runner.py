"""Runs one scheduled step: pack every scheduled token into one flat tensor, attend over the paged
KV cache, project only the rows that sample, and sample (`step_sampling.py`).

Which kernels do the work is the device backend's (`ops.py`), chosen once at load
(`backend.select_ops`): the CPU backend (`cpu/`: C++ kernels, the one-call decode for short
steps), the GPU backend (`gpu/`: Triton kernels, decode steps replayed as CUDA graphs, sampling
on the device), the torch reference elsewhere. The runner hands each step to its backend
(`launch`) and samples what comes back; it never asks which backend it has.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from triton_backend.engine.backend import select_ops
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.kv_pool import PoolPlan, make_kv_cache
from triton_backend.engine.lora.batch import LoRABatch, adapter_runs
from triton_backend.engine.lora.cache import AdapterCache
from triton_backend.engine.progress import Progress
from triton_backend.engine.sampler import Sampler
from triton_backend.engine.scheduler import ScheduledChunk, SchedulerOutput
from triton_backend.engine.step_sampling import sample_step
from triton_backend.engine.weights import load_model, runtime_dtype


@dataclass
class RunnerOutput:
    sampled: dict[int, tuple[int, float]]  # seq_id -> (token id, log prob)
    logits: torch.Tensor | None = None      # [T, V] for every packed token, when asked for
    # seq_id -> the draft tokens (id, log prob) verification kept; they precede `sampled`.
    accepted: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # seq_id -> per kept token (accepted drafts, then the sampled one): the top_log_probs most
    # likely (ids, raw log probs), for requests that asked for them.
    top: dict[int, list[tuple[list[int], list[float]]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, engine_dir: str | Path, config: EngineConfig, pool: PoolPlan,
                 device: str | torch.device = "cpu", lora: AdapterCache | None = None,
                 progress: Progress | None = None, enable_cuda_graphs: bool = True) -> None:
        """`pool`: how the KV pool is sized (kv_pool.plan_pool), resolved once the weights are
        loaded; `lora`: the engine's adapter cache (None: an engine without adapters);
        `progress`: the engine's progress count, which the model advances per layer (a new one
        if None). `enable_cuda_graphs`: False runs every step of the GPU backend eagerly."""
        self.config = config
        self.lora = lora
        self.device = torch.device(device)
        self.dtype = runtime_dtype(config, self.device)
        self.model = load_model(engine_dir, config, self.device)
        self.progress = self.model.progress = progress or Progress()
        self.ops = select_ops(self.device)
        num_blocks = pool.resolve(config, self.dtype, self.device,
                                  self.ops.graph_sizes(config, enable_cuda_graphs))
        self.num_blocks = num_blocks  # the blocks the block manager hands out
        self.kv_cache = make_kv_cache(config, self.dtype, self.device,
                                      num_blocks + self.ops.extra_kv_blocks)
        self.ops.prepare(self.model, self.kv_cache, config, self.dtype, lora, num_blocks,
                         enable_cuda_graphs)
        self.sampler = Sampler(self.ops.greedy_pick)

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's sampling state (its generator or seed)."""
        self.sampler.release(seq_id)
        self.ops.release(seq_id)

    def reset_sampling(self) -> None:
        self.sampler = Sampler(self.ops.greedy_pick)
        self.ops.reset_sampling()

    @torch.inference_mode()
    def run(self, output: SchedulerOutput, eos_ids: dict[int, frozenset[int]],
            return_logits: bool = False, while_running: Callable[[], None] | None = None
            ) -> RunnerOutput:
        """Run one step. Logits, when asked for, are [T, V] in packed-row order (the chunks
        the kernel attends come first). `while_running`: host work that does not depend on
        this step, called once the step is launched and before its results are read (on a GPU
        the two overlap)."""
        chunks = self.ops.inputs.packing_order(output.chunks)
        launched = self.ops.launch(chunks, self._lora_batch(chunks), return_logits)
        if while_running is not None:
            while_running()
        sampling_chunks = [c for c in chunks if c.needs_sample]
        if not sampling_chunks:
            return RunnerOutput({}, launched.all_logits)
        picks = self.ops.greedy_picks(launched, sampling_chunks, eos_ids)
        if picks is not None:
            return RunnerOutput(picks)
        sampled, accepted, top = sample_step(launched.logits, sampling_chunks, eos_ids,
                                             self.sampler, self.ops.device_sampler)
        return RunnerOutput(sampled, launched.all_logits, accepted, top)

    def _lora_batch(self, chunks: list[ScheduledChunk]) -> LoRABatch | None:
        task_ids = [c.lora_task_id for c in chunks]
        if self.lora is None or all(t is None for t in task_ids):
            return None
        adapters = self.lora.activate({t for t in task_ids if t is not None})
        return LoRABatch(adapter_runs([len(c.new_token_ids) for c in chunks], task_ids, adapters),
                         few_rows=self.ops.lora_add_rows)
