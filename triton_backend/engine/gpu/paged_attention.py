"""Paged attention for packed query chunks, reading the KV cache in place: a Triton kernel for
CUDA GPUs, and the pure-torch reference it is tested against (which the GPU backend also runs
off CUDA).

The contract (the same metadata the CPU kernel takes): sequence `b` owns the packed query rows
`query_start[b]:query_start[b + 1]`, the last rows of its `seq_lens[b]` keys, which live in the
cache at `block_tables[b][p // tokens_per_block] * tokens_per_block + p % tokens_per_block`; a
row at position `p` attends every key at a position `<= p` (causal, the cached prefix included),
or with a `window` (a local layer) only the last `window` of them, positions `> p - window`.
GQA: query head `h` reads kv head `h // (Hq / Hkv)`. A one-byte cache (int8, FP8) is widened with
its layer's key and value scale. A sequence with `seq_lens[b] == 0` (a padded row of a captured
decode graph) gets zeros.

The kernel: one program per (sequence, tile of query rows, kv head [, split of the keys]); the
query rows of a tile and the query heads of its kv head form the M side of the tile products, so
a decode of a GQA model still fills tensor-core tiles. Scores and the online softmax are fp32.
With `num_splits` > 1 (flash decoding: few sequences, long contexts) each split writes its
partial result and a second kernel merges them in order.
"""
from __future__ import annotations

import torch

from triton_backend.engine.gpu.triton_support import interpreted, tl, triton

MIN_DOT = 16  # tl.dot's smallest tile side


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              query_start: torch.Tensor, tokens_per_block: int, scale: float,
                              k_scale: float = 1.0, v_scale: float = 1.0, window: int = 0
                              ) -> torch.Tensor:
    """q [T, Hq, D]; caches [slots, Hkv, D] -> [T, Hq, D] (float32 softmax, q's dtype out);
    `window` 0: no window. Reads the metadata on the host: for tests and devices without the
    kernel."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[1]
    starts, lens = query_start.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        if seq_len == 0 or q_end == q_start:
            continue
        positions = torch.arange(seq_len, device=q.device)
        slots = (block_tables[b].long()[positions // tokens_per_block] * tokens_per_block
                 + positions % tokens_per_block)
        keys = _widen(k_cache[slots], k_scale).repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = _widen(v_cache[slots], v_scale).repeat_interleave(group, dim=1)
        rows = q[q_start:q_end].float()
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * scale
        q_positions = torch.arange(seq_len - (q_end - q_start), seq_len, device=q.device)
        causal = positions[None, :] <= q_positions[:, None]
        if window:
            causal &= positions[None, :] > q_positions[:, None] - window
        scores = scores.masked_fill(~causal[None], float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def _widen(stored: torch.Tensor, scale: float) -> torch.Tensor:
    if stored.element_size() == 1:
        return stored.float() * scale
    return stored.float()


def launch_constants(q_dtype: torch.dtype, one_byte_cache: bool, num_heads: int,
                     num_kv_heads: int, head_dim: int, tokens_per_block: int, max_query_len: int,
                     num_splits: int) -> dict:
    """The kernel's compile-time constants for a launch: one Triton variant per distinct set
    (`variants.py` counts them; the warm-up compiles each before serving)."""
    group = num_heads // num_kv_heads
    block_q = max(1, min(_pow2(max_query_len), max(1, 64 // _pow2(group))))
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(MIN_DOT, _pow2(head_dim)),
                BLOCK_Q=block_q, BLOCK_M=max(MIN_DOT, _pow2(block_q * group)),
                BLOCK_N=max(MIN_DOT, min(64, _pow2(tokens_per_block) * 4)),
                TOKENS_PER_BLOCK=tokens_per_block, NUM_SPLITS=num_splits,
                ONE_BYTE=one_byte_cache, IEEE=q_dtype == torch.float32 or interpreted())


def variant_key(constants: dict, q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple:
    return (str(q_dtype), str(cache_dtype), *sorted(constants.items()))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor,
                    tokens_per_block: int, scale: float, max_query_len: int,
                    k_scale: float = 1.0, v_scale: float = 1.0, num_splits: int = 1,
                    out: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """The Triton kernel (see the module's contract). `max_query_len`: the longest chunk, a
    bound the caller knows without reading the device (1 for decodes; a captured graph fixes
    it); `window` 0: no window (a local layer's keys start at its window: those before it are
    never read). Launches only: no host synchronisation, so it can be captured in a CUDA
    graph."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    common = launch_constants(q.dtype, k_cache.element_size() == 1, num_heads, num_kv_heads,
                              head_dim, tokens_per_block, max_query_len, num_splits)
    num_q_tiles = -(-max_query_len // common["BLOCK_Q"])
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    grid = (batch, num_q_tiles * num_splits, num_kv_heads)
    if num_splits == 1:
        partial_out = partial_ml = out  # unused by the kernel when it writes `out` itself
        stride_p = (0, 0, 0, 0, 0)
    else:
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_dim,
                                  dtype=torch.float32, device=q.device)
        partial_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32,
                                 device=q.device)
        stride_p = partial_out.stride()[:3] + partial_ml.stride()[:2]
    _attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start, partial_out, partial_ml,
        scale, k_scale, v_scale, window,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0), seq_lens.stride(0), out.stride(0), out.stride(1), *stride_p,
        **common)
    if num_splits > 1:
        _merge_kernel[(num_tokens, num_heads)](
            partial_out, partial_ml, out, *stride_p, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=common["BLOCK_D"],
            BLOCK_S=max(2, _pow2(num_splits)))
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


if triton is not None:
    # Triton compiles an integer argument anew when it becomes 1 or a multiple of 16. The block
    # table's width changes from step to step, and a captured step's tables and key counts are
    # columns of one buffer (strides 1 + width) where an eager step's are their own: neither may
    # take part (a compile while serving). The other strides are fixed by the model and cache;
    # a window (0, or a local layer's span) is a plain integer for the same reason.
    @triton.jit(do_not_specialize=["window", "stride_bt", "stride_sl"])
    def _attention_kernel(Q, K, V, Out, BlockTables, SeqLens, QueryStart, PartialOut, PartialML,
                          scale, k_scale, v_scale, window,
                          stride_qt, stride_qh, stride_ks, stride_kh, stride_bt, stride_sl,
                          stride_ot,
                          stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          TOKENS_PER_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          ONE_BYTE: tl.constexpr, IEEE: tl.constexpr):
        seq = tl.program_id(0)
        q_tile = tl.program_id(1) // NUM_SPLITS
        split = tl.program_id(1) % NUM_SPLITS
        kv_head = tl.program_id(2)
        q_start = tl.load(QueryStart + seq)
        q_len = tl.load(QueryStart + seq + 1) - q_start
        seq_len = tl.load(SeqLens + seq * stride_sl)
        context = seq_len - q_len

        rows = tl.arange(0, BLOCK_M)
        q_local = q_tile * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_in = (rows < BLOCK_Q * GROUP) & (q_local < q_len)  # rows this program writes
        row_ok = row_in & (seq_len > 0)  # ... and attends (a padded row: zeros)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        token = q_start + q_local
        q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        q_pos = context + q_local

        # Keys this tile of rows can see (from its first row's window on), cut into tiles
        # shared out among the splits.
        kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
        kv_begin = tl.where(window > 0, tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0), 0)
        first_tile = kv_begin // BLOCK_N
        num_tiles = tl.where(q_tile * BLOCK_Q < q_len, tl.cdiv(kv_end, BLOCK_N) - first_tile, 0)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        first = first_tile + split * per_split
        last = tl.minimum(first + per_split, first_tile + num_tiles)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for tile in range(first, last):
            keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_ok = keys < kv_end
            block = tl.load(BlockTables + seq * stride_bt + keys // TOKENS_PER_BLOCK,
                            mask=key_ok, other=0)
            slot = block.to(tl.int64) * TOKENS_PER_BLOCK + keys % TOKENS_PER_BLOCK
            kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
            if ONE_BYTE:
                k = (k.to(tl.float32) * k_scale).to(q.dtype)
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
            if IEEE:  # fp32 engines, and 16-bit ones under the interpreter: fp32 products
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None]) & row_ok[:, None]
            visible &= (window == 0) | (keys[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        io_mask = row_in[:, None] & dim_ok[None, :]
        if NUM_SPLITS == 1:
            result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     result.to(Out.dtype.element_ty), mask=io_mask)
        else:
            base = token * stride_pt + head * stride_ph + split * stride_ps
            tl.store(PartialOut + base[:, None] + dims[None, :], acc, mask=io_mask)
            ml = (token * stride_mt + head * stride_mh + split * 2).to(tl.int64)
            tl.store(PartialML + ml, m_i, mask=row_in)
            tl.store(PartialML + ml + 1, l_i, mask=row_in)

    @triton.jit
    def _merge_kernel(PartialOut, PartialML, Out, stride_pt, stride_ph, stride_ps, stride_mt,
                      stride_mh, stride_ot, stride_oh, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        token = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        split_ok = splits < NUM_SPLITS
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        ml = token * stride_mt + head * stride_mh + splits * 2
        m = tl.load(PartialML + ml, mask=split_ok, other=float("-inf"))
        l_s = tl.load(PartialML + ml + 1, mask=split_ok, other=0.0)
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        weight = tl.where(split_ok & (m > float("-inf")), tl.exp(m - m_safe), 0.0)
        base = token * stride_pt + head * stride_ph + splits * stride_ps
        acc = tl.load(PartialOut + base[:, None] + dims[None, :],
                      mask=split_ok[:, None] & dim_ok[None, :], other=0.0)
        total = tl.sum(weight * l_s, 0)
        result = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(Out + token * stride_ot + head * stride_oh + dims, result.to(Out.dtype.element_ty),
                 mask=dim_ok)


MAX_SPLITS = 16
MIN_KEYS_PER_SPLIT = 256


def split_count(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits of the keys for a decode batch: enough programs to fill the GPU's SMs twice when the
    batch is small, each split at least 256 keys long, at most 16; rounded down to a power of
    two, so a step of any length meets one of a few kernel variants, all compiled at start-up
    (`split_buckets`), instead of a new one at each 256-key boundary."""
    programs = max(1, batch * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    splits = max(1, min(MAX_SPLITS, wanted, max_seq_len // MIN_KEYS_PER_SPLIT or 1))
    return 1 << (splits.bit_length() - 1)


def split_buckets(num_kv_heads: int, max_seq_len: int, num_sms: int) -> list[int]:
    """Every split count an engine of `max_seq_len` can meet (a batch of one is the most)."""
    most = split_count(1, num_kv_heads, max_seq_len, num_sms)
    return [1 << i for i in range(most.bit_length())]
