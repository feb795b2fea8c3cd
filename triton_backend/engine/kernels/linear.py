"""bf16 projections on the packed-weight GEMM kernel, and when to use it.

`pack_linears(model)` swaps every plain bf16 `nn.Linear` of a loaded model (and the LM head of
tied embeddings) for a `PackedBf16Linear` that keeps the weight in the kernel's tile layout. It
is applied only where the kernel beats torch's own bf16 GEMM on this machine (`packed_gemm_wins`,
measured once per machine and cached): on CPUs with bf16 matrix instructions (AMX, AVX512-BF16)
torch's oneDNN path is the faster one and the model is left as it is.
"""
from __future__ import annotations

import json
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from triton_backend.engine.cache_dir import cache_root

log = logging.getLogger(__name__)
TILE = 16


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), K, 16] bf16: tile t holds columns 16t..16t+15, k-major."""
    n, k = weight.shape
    padded = -(-n // TILE) * TILE
    tiles = torch.zeros(padded, k, dtype=torch.bfloat16)
    tiles[:n] = weight
    return tiles.view(padded // TILE, TILE, k).permute(0, 2, 1).contiguous()


class PackedBf16Linear(nn.Module):
    """y = x W^T (+ b) with W packed for `torch.ops.llm_forge.linear_bf16_packed`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed", pack_weight(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_forge.linear_bf16_packed(x, self.packed, self.bias,
                                                      self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows W[ids] (an embedding lookup when W is a tied embedding table)."""
        return self.packed[ids // TILE, :, ids % TILE]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed bf16"


class PackedEmbedding(nn.Module):
    """The token embedding of a tied model, read from the LM head's packed table (one copy)."""

    def __init__(self, table: PackedBf16Linear) -> None:
        super().__init__()
        self.table = [table]  # not a submodule: the LM head owns the weights

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[0].rows(ids)


def pack_linears(model: nn.Module) -> int:
    """Swap the model's bf16 `nn.Linear`s (and a tied LM head) for packed ones; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, PackedBf16Linear(child.weight.data, child.bias))
                count += 1
    if getattr(model, "lm_head", None) is None and model.tie_word_embeddings:
        embedding = model.transformer.vocab_embedding
        if embedding.weight.dtype == torch.bfloat16:
            model.lm_head = PackedBf16Linear(embedding.weight.data, None)
            model.transformer.vocab_embedding = PackedEmbedding(model.lm_head)
            count += 1
    return count


def _median_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def packed_gemm_wins(key: str) -> bool:
    """Whether the packed kernel beats torch's bf16 GEMM here, at one token and at 16 (decode
    batch sizes). Measured once per machine and kernel build (`key`), then read from the cache."""
    path = cache_root() / "kernels" / key / "bf16_gemm_choice.json"
    try:
        return bool(json.loads(path.read_text())["packed"])
    except (OSError, ValueError, KeyError):
        pass
    weight = torch.randn(2048, 1024).to(torch.bfloat16)
    packed = pack_weight(weight)
    ratios = []
    for m in (1, 16):
        x = torch.randn(m, 1024).to(torch.bfloat16)
        ours = _median_time(lambda: torch.ops.llm_forge.linear_bf16_packed(x, packed, None, 2048))
        theirs = _median_time(lambda: F.linear(x, weight))
        ratios.append(theirs / ours)
    packed_wins = min(ratios) > 1.1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"packed": packed_wins, "torch_over_packed_time": ratios}) + "\n")
    log.info("bf16 GEMM: packed kernel %s torch (torch/packed time at M=1, 16: %.2f, %.2f)",
             "beats" if packed_wins else "does not beat", *ratios)
    return packed_wins
