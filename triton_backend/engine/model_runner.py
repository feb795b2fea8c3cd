"""Runs one scheduled step: pack every scheduled token into one flat tensor, attend over the paged
KV cache, project only the rows that sample, and sample (`step_sampling.py`).

Which kernels do the work is the ops backend's choice, made once at load
(`backend.select_ops`): the C++ kernels on a CPU (with the one-call decode path for short
steps), the GPU backend on CUDA (decode steps replayed as CUDA graphs, `gpu/graphs.py`;
sampling on the device), the torch reference elsewhere. The runner asks the backend which chunks its kernel attends in place
(packed first) and otherwise never looks at the device.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Callable

import torch

from triton_backend.engine.attention import AttentionMetadata, PrefillChunk, PrefillRun
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.device import host_to_device
from triton_backend.engine.kv_pool import free_memory_blocks, make_kv_cache
from triton_backend.engine.lora.batch import LoRABatch, adapter_runs
from triton_backend.engine.lora.cache import AdapterCache
from triton_backend.engine.backend import select_ops
from triton_backend.engine.ops import CppOps
from triton_backend.engine.progress import Progress
from triton_backend.engine.sampler import Sampler, below_min_tokens
from triton_backend.engine.scheduler import ScheduledChunk, SchedulerOutput
from triton_backend.engine.step_sampling import sample_step
from triton_backend.engine.weights import load_model, runtime_dtype

CUDA_GRAPHS_ENV = "LLM_FORGE_CUDA_GRAPHS"  # "0": every GPU step eagerly


# Which attention a chunk takes: the backend's paged kernel in place (packed first), its prefill
# kernel in place (packed after: `PrefillRun`s), or the torch path (`PrefillChunk`s, decodes).
PAGED, PREFILL, TORCH = "paged", "prefill", "torch"
# The one-call decode path runs a whole step inside one C++ call, where the engine's progress
# count (progress.py) cannot move; what it saves is per-op dispatch, which matters only in short
# steps. So only steps of at most this much work (rows x projection weights) take it: 256 rows
# of SmolLM2-135M (2048 rows ran 40 s in one call on a heavily loaded 2-core machine, where the
# watchdog would have killed it); decode batches of small models stay in it.
ONE_CALL_MAX_WORK = 256 * 110_000_000


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
    def __init__(self, engine_dir: str | Path, config: EngineConfig, num_blocks: int | None,
                 device: str | torch.device = "cpu", lora: AdapterCache | None = None,
                 progress: Progress | None = None, kv_free_fraction: float | None = None,
                 enable_cuda_graphs: bool = True) -> None:
        """`lora`: the engine's adapter cache (None: an engine without adapters); `progress`:
        the engine's progress count, which the model advances per layer (a new one if None).
        `num_blocks` None: on a CUDA device, the KV pool takes `kv_free_fraction` of the memory
        free once the weights are loaded (kv_pool.free_memory_blocks). `enable_cuda_graphs`:
        False runs every step of the GPU backend eagerly."""
        self.enable_cuda_graphs = enable_cuda_graphs
        self.config = config
        self.lora = lora
        self.device = torch.device(device)
        self.dtype = runtime_dtype(config, self.device)
        self.tokens_per_block = config.kv_cache.tokens_per_block
        self.model = load_model(engine_dir, config, self.device)
        self.progress = self.model.progress = progress or Progress()
        self.ops = select_ops(self.device)
        if num_blocks is None:
            if self.device.type != "cuda" or kv_free_fraction is None:
                raise ValueError("the KV pool needs a block count, a memory budget, or a CUDA "
                                 "device and kv_cache_free_gpu_mem_fraction")
            num_blocks = free_memory_blocks(config, self.dtype, self.device, kv_free_fraction,
                                            self._graph_sizes())
        # The blocks the block manager hands out; the GPU backend's captured steps write their
        # padded rows to one more block, which nobody owns.
        self.num_blocks = num_blocks
        padded = self.ops.name == "gpu"
        self.kv_cache = make_kv_cache(config, self.dtype, self.device, num_blocks + padded)
        self.sampler = Sampler()
        self.device_sampler = None
        # The paged kernel reads the cache in place: in the activations' dtype, or one byte per
        # element (quantized on write, widened on read).
        self.kernel_attention = self.ops.reads_cache_in_place(self.kv_cache, self.dtype)
        self.one_byte_cache = self.kv_cache.k.element_size() == 1
        self.decode_forward = None
        self.one_call_max_rows = 0
        self.graphs = None
        if isinstance(self.ops, CppOps):
            self._prepare_cpu_kernels()
        elif config.quantization.lm_head == "int8":
            raise ValueError("quantization.lm_head: int8 needs the CPU kernels and an "
                             "in_features divisible by 32")
        if self.ops.name == "gpu":
            self._prepare_gpu_backend()

    def _prepare_cpu_kernels(self) -> None:
        """Pack the projections for the measured bf16 GEMM, quantize the LM head when asked,
        and set up the one-call decode path."""
        if self.dtype == torch.bfloat16:
            from triton_backend.engine.cpu.kernels import plan_key
            from triton_backend.engine.cpu.linear import bf16_gemm_plan, pack_linears

            plan = bf16_gemm_plan(plan_key())
            if plan.packed:
                pack_linears(self.model, plan)
                if self.lora is not None:  # adapters take the same kernel
                    self.lora.packed_plan = plan
        if self.config.quantization.lm_head == "int8":
            from triton_backend.engine.cpu.linear import quantize_lm_head

            if not quantize_lm_head(self.model):
                raise ValueError("quantization.lm_head: int8 needs the CPU kernels and an "
                                 "in_features divisible by 32")
        if self.kernel_attention:
            from triton_backend.engine.cpu.forward import DecodeForward

            self.decode_forward = DecodeForward(self.model, self.kv_cache, self.dtype)
            weights = sum(t.numel() for t in self.decode_forward.weights if t is not None)
            self.one_call_max_rows = max(1, ONE_CALL_MAX_WORK // max(1, weights))

    def _prepare_gpu_backend(self) -> None:
        """Sampling on the device, every Triton kernel variant compiled (gpu/warmup.py), and
        decode steps captured as CUDA graphs (unless turned off), their padded rows writing to
        the block past the pool."""
        from triton_backend.engine.gpu.sampling import DeviceSampler
        from triton_backend.engine.gpu.warmup import warm_up

        shape = self.config.model
        if shape.sliding_window is not None:
            raise ValueError(f"model.sliding_window ({shape.sliding_window}): the GPU backend's "
                             f"paged kernel does not attend local windows yet; run this engine "
                             f"on the CPU (forge generate --device cpu)")
        self.device_sampler = DeviceSampler()
        self.ops.prepare_model(self.model)
        with warm_up(self.model, self.kv_cache, self.ops, self.num_blocks * self.tokens_per_block,
                     self.config.limits.max_seq_len):
            if self._graph_sizes():
                self.capture_graphs()

    def _graph_sizes(self) -> list[int]:
        """The decode batch sizes the GPU backend captures at load (none without graphs). A
        mixture of experts groups its rows by expert (a data-dependent shape), which a captured
        graph cannot replay: its steps run eagerly."""
        if (self.ops.name != "gpu" or os.environ.get(CUDA_GRAPHS_ENV, "1") == "0"
                or not self.enable_cuda_graphs or self.config.model.num_experts):
            return []
        from triton_backend.engine.gpu.graphs import capture_sizes

        return capture_sizes(self.config.limits.max_batch_size)

    def capture_graphs(self) -> None:
        """Capture the decode steps (GPU backend); from then on they replay."""
        from triton_backend.engine.gpu.graphs import DecodeGraphs

        limits = self.config.limits
        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.ops, limits.max_batch_size,
                                   limits.max_seq_len, self.num_blocks * self.tokens_per_block,
                                   self.device)
        with torch.inference_mode():
            self.graphs.capture()

    def graph_stats(self) -> dict[str, int]:
        """Captured decode graphs and how many steps replayed one (0 without graphs); on the GPU
        backend, its kernel variants and those first met after the start-up warm-up."""
        graphs = self.graphs
        stats = {"cuda_graphs": len(graphs.graphs) if graphs is not None else 0,
                 "cuda_graph_replays": graphs.num_replays if graphs is not None else 0}
        kernel_stats = getattr(self.ops, "kernel_stats", None)
        return {**stats, **kernel_stats()} if kernel_stats is not None else stats

    def release(self, seq_id: int) -> None:
        """Forget a finished sequence's sampling state (its generator or seed)."""
        self.sampler.release(seq_id)
        if self.device_sampler is not None:
            self.device_sampler.release(seq_id)

    def reset_sampling(self) -> None:
        self.sampler = Sampler()
        if self.device_sampler is not None:
            self.device_sampler = type(self.device_sampler)()

    @torch.inference_mode()
    def run(self, output: SchedulerOutput, eos_ids: dict[int, frozenset[int]],
            return_logits: bool = False, while_running: Callable[[], None] | None = None
            ) -> RunnerOutput:
        """Run one step. Logits, when asked for, are [T, V] in packed-row order (the chunks
        the kernel attends come first). `while_running`: host work that does not depend on
        this step, called once the step is launched and before its results are read (on a GPU
        the two overlap)."""
        chunks = self._packing_order(output.chunks)
        if self.graphs is not None and not return_logits and self.graphs.covers(chunks):
            logits, greedy = self.graphs.run(chunks)  # every row samples: one per decode
            if while_running is not None:
                while_running()
            if all(self._plain_greedy(c, eos_ids[c.seq_id]) for c in chunks):
                picks = greedy.cpu().tolist()  # the step's one copy to the host
                if all(math.isfinite(log_prob) for _, log_prob in picks):
                    return RunnerOutput({c.seq_id: (int(token), log_prob)
                                         for c, (token, log_prob) in zip(chunks, picks)})
            return self._sample(logits, chunks, eos_ids, None)
        input_ids, positions, meta, sample_rows = self._prepare(chunks)
        lora = self._lora_batch(chunks)
        if (self.decode_forward is not None and len(input_ids) <= self.one_call_max_rows
                and self.decode_forward.covers(meta, len(input_ids))):
            hidden = self.decode_forward(input_ids, positions, meta, lora)  # all layers, one call
        else:
            hidden = self.model(input_ids, positions, self.kv_cache, meta, self.ops, lora)
        if while_running is not None:
            while_running()
        all_logits = self.model.logits(hidden) if return_logits else None
        sampling_chunks = [c for c in chunks if c.needs_sample]
        if not sampling_chunks:
            return RunnerOutput({}, all_logits)
        rows = host_to_device(sample_rows, torch.long, self.device)
        logits = all_logits[rows] if all_logits is not None else self.model.logits(hidden[rows])
        return self._sample(logits, sampling_chunks, eos_ids, all_logits)

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk],
                eos_ids: dict[int, frozenset[int]], all_logits: torch.Tensor | None
                ) -> RunnerOutput:
        sampled, accepted, top = sample_step(logits, chunks, eos_ids, self.sampler,
                                             self.device_sampler)
        return RunnerOutput(sampled, all_logits, accepted, top)

    def _plain_greedy(self, chunk: ScheduledChunk, eos: frozenset[int]) -> bool:
        """A row the graph's own greedy pick serves: nothing masked, no alternatives asked."""
        request = chunk.request
        return (request.sampling.greedy and not request.top_log_probs
                and self.device_sampler.takes(chunk) and not below_min_tokens(chunk, eos))

    def _route(self, chunk: ScheduledChunk) -> str:
        """PAGED, PREFILL or TORCH, as the backend attends a chunk of this shape."""
        if not self.kernel_attention:
            return TORCH
        shape = (len(chunk.new_token_ids), chunk.num_computed_tokens, self.one_byte_cache)
        if self.ops.attends_in_place(*shape):
            return PAGED
        return PREFILL if self.ops.prefills_in_place(*shape) else TORCH

    def _keys_as_computed(self, chunk: ScheduledChunk) -> bool:
        """A prompt's first chunk over a one-byte cache attends its keys as computed, not as
        stored (as the torch path does, and TensorRT-LLM's context phase)."""
        return self.one_byte_cache and chunk.num_computed_tokens == 0

    def _packing_order(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The paged kernel's chunks first, then the prefill kernel's (those reading their keys as
        computed first, so each source is one run of rows); within each group, the chunks of one
        adapter side by side, so each adapter's rows are one run."""
        if any(c.lora_task_id is not None for c in chunks):
            chunks = sorted(chunks, key=lambda c: -1 if c.lora_task_id is None else c.lora_task_id)
        if not self.kernel_attention:
            return chunks

        def group(chunk: ScheduledChunk) -> int:
            route = self._route(chunk)
            if route == PREFILL:
                return 1 if self._keys_as_computed(chunk) else 2
            return 0 if route == PAGED else 3

        return sorted(chunks, key=group)  # stable: adapters stay side by side

    def _lora_batch(self, chunks: list[ScheduledChunk]) -> LoRABatch | None:
        task_ids = [c.lora_task_id for c in chunks]
        if self.lora is None or all(t is None for t in task_ids):
            return None
        adapters = self.lora.activate({t for t in task_ids if t is not None})
        return LoRABatch(adapter_runs([len(c.new_token_ids) for c in chunks], task_ids, adapters),
                         few_rows_kernel=isinstance(self.ops, CppOps))

    def _prepare(self, chunks: list[ScheduledChunk]):
        tpb = self.tokens_per_block
        ids, positions, slots, sample_rows = [], [], [], []
        prefills, decodes, kernel_chunks, prefill_chunks = [], [], [], []
        for chunk in chunks:
            start, q_len = chunk.num_computed_tokens, len(chunk.new_token_ids)
            q_start = len(ids)
            table = chunk.block_table
            ids.extend(chunk.new_token_ids)
            positions.extend(range(start, start + q_len))
            slots.extend(table[p // tpb] * tpb + p % tpb for p in range(start, start + q_len))
            route = self._route(chunk)
            if route == PAGED:
                kernel_chunks.append(chunk)
            elif route == PREFILL:
                prefill_chunks.append((q_start, chunk))
            elif q_len == 1 and start > 0:
                decodes.append((q_start, chunk))
            else:
                cached = None
                if start > 0:
                    cached = torch.tensor([table[p // tpb] * tpb + p % tpb
                                           for p in range(start + q_len)], device=self.device)
                prefills.append(PrefillChunk(q_start, q_start + q_len, start, cached))
            if chunk.needs_sample:  # the last row, and one more per draft token before it
                sample_rows.extend(range(len(ids) - 1 - chunk.num_draft_tokens, len(ids)))
        meta = AttentionMetadata(slot_mapping=self._long(slots), prefills=prefills)
        if decodes:
            self._add_decodes(meta, decodes)
        if kernel_chunks:
            self._add_kernel_chunks(meta, kernel_chunks)
        for as_computed, run in groupby(prefill_chunks, key=lambda c: self._keys_as_computed(c[1])):
            meta.prefill_runs.append(self._prefill_run(list(run), as_computed))
        return self._long(ids), self._long(positions), meta, sample_rows

    def _long(self, values: list[int]) -> torch.Tensor:
        return host_to_device(values, torch.long, self.device)

    def _add_kernel_chunks(self, meta: AttentionMetadata, chunks: list[ScheduledChunk]) -> None:
        """Block tables (0-padded), key counts and row offsets of the packed-first chunks."""
        width = max(len(c.block_table) for c in chunks)
        tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
        seq_lens = [c.num_computed_tokens + len(c.new_token_ids) for c in chunks]
        query_start = [0]
        for chunk in chunks:
            query_start.append(query_start[-1] + len(chunk.new_token_ids))
        as_int = lambda xs: host_to_device(xs, torch.int32, self.device)  # noqa: E731
        meta.kernel_rows = query_start[-1]
        meta.block_tables, meta.seq_lens = as_int(tables), as_int(seq_lens)
        meta.query_start = as_int(query_start)
        meta.max_query_len = max(len(c.new_token_ids) for c in chunks)
        meta.max_seq_len = max(seq_lens)

    def _prefill_run(self, chunks: list[tuple[int, ScheduledChunk]], as_computed: bool
                     ) -> PrefillRun:
        """One run of the prefill kernel's chunks (packed side by side from their first row):
        block tables of the cache, or, for keys as computed, each chunk's own rows in the run
        (blocks of one row)."""
        begin = chunks[0][0]
        query_start, tables, seq_lens = [0], [], []
        for q_start, chunk in chunks:
            q_len = len(chunk.new_token_ids)
            query_start.append(q_start + q_len - begin)
            if as_computed:
                tables.append(list(range(q_start - begin, q_start - begin + q_len)))
                seq_lens.append(q_len)
            else:
                tables.append(chunk.block_table)
                seq_lens.append(chunk.num_computed_tokens + q_len)
        width = max(len(t) for t in tables)
        as_int = lambda xs: host_to_device(xs, torch.int32, self.device)  # noqa: E731
        return PrefillRun(begin, begin + query_start[-1],
                          as_int([t + [0] * (width - len(t)) for t in tables]),
                          as_int(seq_lens), as_int(query_start),
                          1 if as_computed else self.tokens_per_block, as_computed,
                          max(seq_lens))

    def _add_decodes(self, meta: AttentionMetadata, decodes: list[tuple[int, ScheduledChunk]]) -> None:
        """Padded key slots [n, max_k] and a mask of the real keys for all decodes at once."""
        tpb = self.tokens_per_block
        key_lens = torch.tensor([c.num_computed_tokens + 1 for _, c in decodes], device="cpu")
        max_k = int(key_lens.max())
        max_blocks = -(-max_k // tpb)
        tables = torch.zeros(len(decodes), max_blocks, dtype=torch.long, device="cpu")
        for i, (_, chunk) in enumerate(decodes):
            table = chunk.block_table[:max_blocks]
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.long, device="cpu")
        positions = torch.arange(max_k, device="cpu")
        slots = tables[:, positions // tpb] * tpb + positions % tpb
        mask = (positions.unsqueeze(0) < key_lens.unsqueeze(1))[:, None, None, :]
        meta.decode_token_index = torch.tensor([q for q, _ in decodes], device=self.device)
        meta.decode_key_slots = slots.to(self.device)
        meta.decode_key_mask = mask.to(self.device)
