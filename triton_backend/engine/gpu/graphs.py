"""Decode steps captured as CUDA graphs, one per padded batch size, and replayed.

A decode-only step of B sequences (one new token each, no drafts, no adapters) runs the graph of
the smallest captured size P >= B: its inputs are copied into persistent buffers (two copies to
the device, from pinned host memory), the graph replays every layer, the LM head and the greedy
pick of every row without a launch from Python, and the step reads its B rows: the greedy ids
and log probs alone (one small copy) when every row is plain greedy, else the logits. The P - B padded rows attend
nothing (`seq_lens` 0) and write their keys to a slot no sequence owns (`pad_slot`, in a block
the block manager never hands out), so they never touch a real sequence.

Prefill and mixed steps run eagerly. `enabled=False` (the repository's `cuda_graph_mode`
parameter, `LLM_FORGE_CUDA_GRAPHS=0`) runs every step eagerly. Off CUDA the same buffers and
padding run eagerly on each "replay", so the CPU tests exercise everything but the capture.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from triton_backend.engine.attention import AttentionMetadata
from triton_backend.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


CAPTURE_SIZES_ENV = "LLM_FORGE_CUDA_GRAPH_BATCH_SIZES"
CUDA_GRAPHS_ENV = "LLM_FORGE_CUDA_GRAPHS"  # "0": every GPU step eagerly


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256, and max_batch_size itself; or the sizes
    `LLM_FORGE_CUDA_GRAPH_BATCH_SIZES` lists (comma separated; max_batch_size is always one), as
    `forge gpu-check` captures only the batches it runs: each capture costs start-up time."""
    given = os.environ.get(CAPTURE_SIZES_ENV, "").strip()
    if given:
        try:
            sizes = [int(size) for size in given.split(",")]
        except ValueError:
            raise ValueError(f"{CAPTURE_SIZES_ENV}: {given!r} is not a comma-separated list of "
                             f"batch sizes") from None
        if min(sizes) < 1:
            raise ValueError(f"{CAPTURE_SIZES_ENV}: {given!r}: batch sizes start at 1")
    else:
        sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16))
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


@dataclass
class StaticInputs:
    """The persistent buffers a captured step reads: int64 [3 * largest], whose first 3 * P
    hold the P rows' ids, then positions, then slots (so the step of size P reads, and its copy
    writes, one contiguous run), and int32 [P, 1 + W] (keys per sequence, then its block table;
    its first P rows are contiguous too), each filled by one copy from pinned memory."""

    longs: torch.Tensor
    ints: torch.Tensor
    query_start: torch.Tensor  # [P + 1] int32: 0, 1, ..., P (one row per sequence)


class DecodeGraphs:
    """`covers(chunks)` says whether a step can replay a graph; `run(chunks)` replays it and
    returns the logits of the step's rows (float32 [B, V], a view valid until the next run)."""

    def __init__(self, model, kv_cache, ops, max_batch_size: int, max_seq_len: int,
                 pad_slot: int, device: torch.device) -> None:
        self.model, self.kv_cache, self.ops = model, kv_cache, ops
        self.device = device
        self.pad_slot = pad_slot
        self.tokens_per_block = kv_cache.tokens_per_block
        self.max_blocks = -(-max_seq_len // self.tokens_per_block)
        self.max_seq_len = max_seq_len
        self.sizes = capture_sizes(max_batch_size)
        largest = self.sizes[-1]
        self.device_inputs = StaticInputs(
            torch.zeros(3 * largest, dtype=torch.int64, device=device),
            torch.zeros(largest, 1 + self.max_blocks, dtype=torch.int32, device=device),
            torch.arange(largest + 1, dtype=torch.int32, device=device))
        pin = device.type == "cuda"
        self.host_longs = torch.zeros(3 * largest, dtype=torch.int64, device="cpu",
                                      pin_memory=pin)
        self.host_ints = torch.zeros(largest, 1 + self.max_blocks, dtype=torch.int32,
                                     device="cpu", pin_memory=pin)
        self._host_longs, self._host_ints = self.host_longs.numpy(), self.host_ints.numpy()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_replays = 0

    def covers(self, chunks: list[ScheduledChunk]) -> bool:
        return (0 < len(chunks) <= self.sizes[-1]
                and all(len(c.new_token_ids) == 1 and c.num_computed_tokens > 0
                        and c.lora_task_id is None and c.num_draft_tokens == 0
                        and len(c.block_table) <= self.max_blocks for c in chunks))

    def _padded(self, batch: int) -> int:
        return next(size for size in self.sizes if size >= batch)

    def _longs(self, size: int) -> torch.Tensor:
        """[3, size]: ids, positions, slots of a step of `size` rows, each row contiguous."""
        return self.device_inputs.longs[:3 * size].view(3, size)

    def _meta(self, size: int) -> AttentionMetadata:
        longs, ints = self._longs(size), self.device_inputs.ints
        return AttentionMetadata(slot_mapping=longs[2], kernel_rows=size,
                                 block_tables=ints[:size, 1:], seq_lens=ints[:size, 0],
                                 query_start=self.device_inputs.query_start[:size + 1],
                                 max_query_len=1, max_seq_len=self.max_seq_len)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [P, V] float32, greedy picks [P, 2] float64: token id and its log prob)."""
        longs = self._longs(size)
        hidden = self.model(longs[0], longs[1], self.kv_cache, self._meta(size), self.ops)
        logits = self.model.logits(hidden)
        best, token = logits.max(dim=-1)
        log_prob = best - torch.logsumexp(logits, dim=-1)
        return logits, torch.stack([token.double(), log_prob.double()], dim=1)

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones reuse its memory pool); padded
        rows only, so no sequence's cache is written."""
        if self.device.type != "cuda":
            return
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._fill_padding(size, 0)
                self._copy_inputs(size, non_blocking=False)
                self._forward(size)  # compiles the kernels and warms the allocator
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode graphs (batch sizes %s)", len(self.graphs), self.sizes)

    def _host_view(self, size: int):
        return self._host_longs[:3 * size].reshape(3, size)

    def _fill_padding(self, size: int, start: int) -> None:
        """Rows [start, size) of a step of `size` rows: attend nothing, write the spare block."""
        longs = self._host_view(size)
        longs[:2, start:] = 0
        longs[2, start:] = self.pad_slot
        self._host_ints[start:size] = 0

    def _copy_inputs(self, size: int, non_blocking: bool = True) -> None:
        """Two contiguous copies from pinned memory, queued behind the previous step (while
        capturing, waited for: the next size refills the same host buffer at once)."""
        self.device_inputs.longs[:3 * size].copy_(self.host_longs[:3 * size],
                                                  non_blocking=non_blocking)
        self.device_inputs.ints[:size].copy_(self.host_ints[:size], non_blocking=non_blocking)

    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch the step (asynchronously on CUDA): (logits [B, V], greedy picks [B, 2]),
        views of the graph's outputs, valid until the next run."""
        batch = len(chunks)
        size = self._padded(batch)
        tpb = self.tokens_per_block
        longs, ints = self._host_view(size), self._host_ints  # numpy views: cheap writes
        positions = [c.num_computed_tokens for c in chunks]
        longs[0, :batch] = [c.new_token_ids[0] for c in chunks]
        longs[1, :batch] = positions
        longs[2, :batch] = [c.block_table[p // tpb] * tpb + p % tpb
                            for c, p in zip(chunks, positions)]
        ints[:batch, 0] = positions
        ints[:batch, 0] += 1
        for i, chunk in enumerate(chunks):
            ints[i, 1:1 + len(chunk.block_table)] = chunk.block_table
        self._fill_padding(size, batch)
        self._copy_inputs(size)
        self.num_replays += 1
        graph = self.graphs.get(size)
        if graph is None:  # off CUDA: the same step, eagerly
            logits, greedy = self._forward(size)
        else:
            graph.replay()
            logits, greedy = self.outputs[size]
        return logits[:batch], greedy[:batch]
