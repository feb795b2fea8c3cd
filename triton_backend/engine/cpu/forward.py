"""The decode fast path: every decoder layer of a step in one C++ call (`llm_forge.decode_forward`).

A decode step runs about ten kernels per layer; called one by one from Python each costs a few
microseconds of dispatch, a few milliseconds per step on a small model. `DecodeForward` gathers
the loaded model's weights once, in the order the C++ side reads them, and runs a step there when
the step is one it covers: every row attended by the paged kernel (decodes) or, after them, by the
prefill kernel over the cache (chunks of several rows, verify steps), a cache the kernels read (in
the activation dtype, or one byte per element), and projections that are
packed bf16, packed INT4 (our kernel) or dense in the activation dtype (below the row count where
bf16 projections switch to torch's GEMM).
A layer may norm each head of q and k first (QK-norm: Qwen3); it may be Gemma 3's (a window of
keys and a rotary table of its own on local layers, the attention's and the MLP's outputs normed
before each residual add, a GELU-tanh gate, its own softmax scale; the embeddings' scale is
applied here before the call), and it may be a mixture of experts
(Qwen3-MoE, Mixtral) whose experts the fused kernel covers (`moe.py`): the router is projected
like an MLP's gate_up, routed as `engine/moe.py` routes, and the experts' stacks run in one call
(such steps run op by op in C++, not in the single parallel region).
Rows with LoRA adapters run there too: each projection adds its runs' deltas as the Python
model does (`lora/batch.py`). Anything else, and every other device, takes the Python model,
which stays the reference.
"""
from __future__ import annotations

import torch
from torch import nn

from triton_backend.engine import families
from triton_backend.engine.attention import AttentionMetadata
from triton_backend.engine.cpu.linear import PackedBf16Linear
from triton_backend.engine.kv_cache import PagedKVCache
from triton_backend.engine.lora.batch import LoRABatch
from triton_backend.engine.model import Attention
from triton_backend.engine.moe import SparseMoE

PACKED_BF16, PACKED_INT4, DENSE, TORCH_INT4 = 0, 1, 2, 3


def _projection_slots(module: nn.Module, dtype: torch.dtype) -> tuple[int, list, int] | None:
    """(kind, [weight, scales, prequant, bias], group size) of a projection, None if unsupported."""
    if isinstance(module, PackedBf16Linear):
        return PACKED_BF16, [module.packed, None, None, module.bias], 0
    if type(module) is nn.Linear and module.weight.dtype == dtype:
        return DENSE, [module.weight, None, None, module.bias], 0
    if getattr(module, "kernel", None) == "cpp_int4":
        bias = None if module.bias is None else module.bias.float()
        return PACKED_INT4, [module.packed_weight, module.scales, module.prequant, bias], \
            module.group_size
    if getattr(module, "kernel", None) == "cpu_int4pack":
        return TORCH_INT4, [module.packed_weight, module.scales_and_zeros, module.prequant,
                            module.bias], module.group_size
    return None


class DecodeForward:
    def __init__(self, model: nn.Module, cache: PagedKVCache, dtype: torch.dtype) -> None:
        self.model, self.cache = model, cache
        shape = model.config.model
        self.dims = (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim)
        self.eps = shape.rms_norm_eps
        self.scale = shape.attention_scale or shape.head_dim ** -0.5
        self.windows = [shape.window_of(i) or 0 for i in range(shape.num_hidden_layers)]
        if not any(self.windows):
            self.windows = []
        self.gelu = shape.hidden_act == "gelu_pytorch_tanh"
        self.weights: list[torch.Tensor | None] = []
        self.kinds: list[int] = []
        self.out_features: list[int] = []
        self.group_sizes: list[int] = []
        self.upcast_min_rows: int | None = None
        # Per layer: q and k head norms, a mixture of experts' gate_up and down stacks, the
        # attention's and the MLP's output norms (None where absent); empty when no layer has
        # any. routing: [top_k, renormalise, intermediate] of the experts, empty without them.
        self.layer_extras: list[torch.Tensor | None] = []
        self.routing: list[int] = []
        # Weights a row multiplies at most (every expert of a layer counted): sizes a step.
        self.weights_per_row = 0
        # The step in one parallel region of the C++ side where its projections allow (packed
        # INT4 or bf16 tiles, no LoRA rows); False: op by op (the same values, for tests).
        self.single_region = True
        # The C++ side computes the layers above and nothing else: a family must declare it.
        self.supported = (families.get(shape.architecture).fused_decode
                          and self._gather(model, dtype))

    def _gather(self, model: nn.Module, dtype: torch.dtype) -> bool:
        extras: list[torch.Tensor | None] = []
        for layer in model.transformer.layers:
            # Gemma's block: post_layernorm norms the attention's output, and the norm before
            # the MLP takes the residual add (the Llama block's post_layernorm).
            gemma = hasattr(layer, "post_feedforward_layernorm")
            add_norm = layer.pre_feedforward_layernorm if gemma else layer.post_layernorm
            self.weights += [layer.input_layernorm.weight, add_norm.weight]
            out_norms = ([layer.post_layernorm.weight, layer.post_feedforward_layernorm.weight]
                         if gemma else [None, None])
            attention, mlp = layer.attention, layer.mlp
            q_norm, k_norm = (getattr(attention, name, None) for name in ("q_layernorm",
                                                                           "k_layernorm"))
            if type(attention).project_qkv is not Attention.project_qkv and q_norm is None:
                return False  # a family's own qkv hook that is not QK-norm
            extras += [None, None] if q_norm is None else [q_norm.weight, k_norm.weight]
            if isinstance(mlp, SparseMoE):
                packed = getattr(mlp, "packed_experts", None)
                if packed is None or packed.activation_dtype != dtype or self.gelu:
                    return False  # the experts' kernel gates with SiLU
                projections = (attention.qkv, attention.dense, mlp.router, None)
                extras += [packed.gate_up, packed.down]
                self.routing = [mlp.top_k, int(mlp.renormalise), packed.intermediate]
                self.weights_per_row += packed.gate_up.numel() + packed.down.numel()
            else:
                projections = (attention.qkv, attention.dense, mlp.gate_up, mlp.proj)
                extras += [None, None]
            extras += out_norms
            for proj in projections:
                if proj is None:  # a mixture of experts' proj slot
                    self.weights += [None] * 4
                    self.kinds.append(DENSE)
                    self.out_features.append(0)
                    self.group_sizes.append(0)
                    continue
                slots = _projection_slots(proj, dtype)
                if slots is None:
                    return False
                kind, tensors, group = slots
                self.weights += tensors
                self.kinds.append(kind)
                self.out_features.append(proj.out_features)
                self.group_sizes.append(group)
                rows = getattr(proj, "upcast_min_rows", None)
                if rows is not None:
                    self.upcast_min_rows = min(rows, self.upcast_min_rows or rows)
        self.weights.append(model.transformer.ln_f.weight)
        if any(t is not None for t in extras):
            self.layer_extras = extras
        self.weights_per_row += sum(t.numel() for t in self.weights if t is not None)
        return True

    def covers(self, meta: AttentionMetadata, num_rows: int) -> bool:
        """True when every row of the step is the paged kernel's or, after them, the prefill
        kernel's over the cache (one run), and no projection would switch to torch's GEMM at
        this many rows."""
        runs = meta.prefill_runs
        prefill_rows = sum(r.row_end - r.row_begin for r in runs)
        return (self.supported and meta.kernel_rows + prefill_rows == num_rows
                and not meta.prefills and meta.decode_token_index is None
                and len(runs) <= 1 and not any(r.keys_as_computed for r in runs)
                and (self.upcast_min_rows is None or num_rows < self.upcast_min_rows))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, lora: LoRABatch | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of the step's rows (the KV cache is written)."""
        hidden = self.model.transformer.vocab_embedding(input_ids)
        multiplier = self.model.embedding_multiplier
        if multiplier is not None:  # as the Python model scales them, in their dtype
            hidden = hidden * torch.tensor(multiplier, dtype=hidden.dtype, device=hidden.device)
        rotary, local = self.model.rotary, self.model.rotary_local
        lora_slots, lora_runs = ([], []) if lora is None else lora.kernel_arguments(
            len(self.model.transformer.layers))
        paged = (meta.block_tables, meta.seq_lens, meta.query_start)
        if not meta.kernel_rows:  # every row is the prefill kernel's
            device = meta.slot_mapping.device
            paged = (torch.zeros(0, 1, dtype=torch.int32, device=device),
                     torch.zeros(0, dtype=torch.int32, device=device),
                     torch.zeros(1, dtype=torch.int32, device=device))
        run = meta.prefill_runs[0] if meta.prefill_runs else None
        prefill = (None, None, None) if run is None else (run.block_tables, run.seq_lens,
                                                          run.query_start)
        return torch.ops.llm_forge.decode_forward(
            hidden, positions, meta.slot_mapping, *paged, rotary.cos, rotary.sin, self.cache.k,
            self.cache.v, self.weights, self.kinds, self.out_features, self.group_sizes,
            *self.dims, self.cache.tokens_per_block, self.eps, self.scale, lora_slots, lora_runs,
            self.layer_extras, self.routing, self.single_region, self.cache.kernel_scales(),
            *prefill, *((None, None) if local is rotary else (local.cos, local.sin)),
            self.windows, self.gelu)
