"""The prefill attention kernel (cpu/csrc/prefill_attention.cpp) against torch: causal GQA over
the paged cache read in place, for a prompt's first chunk, chunks deep in a prompt and after a
prefix-cache hit, across block and key-block boundaries, over bf16, fp32 and one-byte caches."""
import math

import pytest
import torch
import torch.nn.functional as F

from triton_backend.engine.cpu.kernels import load_cpu_kernels

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="the C++ kernels did not build")

# (query heads, kv heads, head_dim, tokens_per_block, [(new rows, keys) per chunk]): SmolLM2's
# heads on a first chunk; a chunk deep in a prompt (head_dim 128); a prefix-cache hit (256 keys
# cached in whole blocks); MHA over blocks of one token with two chunks in one call; group 7 over
# blocks of 3 (block edges inside every key block) beside a single row; widths whose features end
# in scalar tails (40, 12).
CASES = {
    "first-chunk": (9, 3, 64, 16, [(300, 300)]),
    "deep-d128": (8, 2, 128, 16, [(130, 900)]),
    "prefix-hit": (9, 3, 64, 16, [(96, 352)]),
    "mha-tpb1-two-chunks": (4, 4, 64, 1, [(70, 70), (65, 200)]),
    "group7-tpb3": (7, 1, 64, 3, [(100, 163), (1, 5), (17, 17)]),
    "d40": (12, 4, 40, 8, [(90, 90)]),
    "d12": (6, 2, 12, 5, [(33, 97)]),
}


def _int32(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32)


def _case(dtype, heads, kv_heads, head_dim, tpb, chunks, seed=11):
    """A shuffled block pool with one block table per chunk, the chunks' queries packed."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-keys // tpb) for _, keys in chunks]
    pool = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    tables, at = [], 0
    for n in blocks:
        tables.append(pool[at:at + n])
        at += n
    slots = (sum(blocks) + 2) * tpb
    k = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(slots, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(rows for rows, _ in chunks), heads, head_dim, generator=g).to(dtype)
    return q, k, v, tables


def _attend(q, k, v, tables, chunks, tpb, scale, k_scale=1.0, v_scale=1.0, window=0):
    width = max(len(t) for t in tables)
    starts = [0]
    for rows, _ in chunks:
        starts.append(starts[-1] + rows)
    out = torch.full_like(q, float("nan"))
    torch.ops.llm_forge.prefill_attention(
        out, q, k, v, _int32([t + [0] * (width - len(t)) for t in tables]),
        _int32([keys for _, keys in chunks]), _int32(starts), tpb, scale, k_scale, v_scale, window)
    return out


def _reference(q, k, v, tables, chunks, tpb, scale, dtype=torch.float32, window=0):
    """torch's SDPA over each chunk's gathered keys (causal, offset by the keys before it; with
    `window`, a row sees key k when row - window < k <= row, transformers' sliding window)."""
    out, row = [], 0
    for table, (rows, keys) in zip(tables, chunks):
        pos = torch.arange(keys)
        slots = torch.tensor(table)[pos // tpb] * tpb + pos % tpb
        ks, vs = (x[slots].to(dtype).transpose(0, 1)[None] for x in (k, v))
        qs = q[row:row + rows].to(dtype).transpose(0, 1)[None]
        row_pos = torch.arange(rows)[:, None] + keys - rows
        mask = pos[None, :] <= row_pos
        if window:
            mask &= pos[None, :] > row_pos - window
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1))
        row += rows
    return torch.cat(out)


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_prefill_attention_is_torchs_within_summation_order(name):
    heads, kv_heads, head_dim, tpb, chunks = CASES[name]
    q, k, v, tables = _case(torch.float32, heads, kv_heads, head_dim, tpb, chunks)
    scale = 1 / math.sqrt(head_dim)
    out = _attend(q, k, v, tables, chunks, tpb, scale)
    torch.testing.assert_close(out, _reference(q, k, v, tables, chunks, tpb, scale),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_prefill_attention_is_as_accurate_as_torchs_bf16_flash_attention(name):
    """Probabilities meet the values in bf16 (as torch's flash attention rounds them) and the
    outputs are bf16: against the fp32 result on the same inputs, no larger errors than torch's
    own bf16 attention has."""
    heads, kv_heads, head_dim, tpb, chunks = CASES[name]
    q, k, v, tables = _case(torch.bfloat16, heads, kv_heads, head_dim, tpb, chunks)
    scale = 1 / math.sqrt(head_dim)
    exact = _reference(q, k, v, tables, chunks, tpb, scale)
    ours = (_attend(q, k, v, tables, chunks, tpb, scale).float() - exact).abs()
    theirs = (_reference(q, k, v, tables, chunks, tpb, scale, torch.bfloat16).float()
              - exact).abs()
    assert ours.mean() <= 1.25 * theirs.mean()
    assert ours.max() <= 2 * theirs.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gives_the_same_values_however_its_prompt_is_chunked_and_batched(dtype):
    """Key blocks start at key 0 for every row and a block past a row changes nothing of it:
    a row's values are the same in one chunk or two, alone or beside another sequence, with one
    thread or several (other work items)."""
    heads, kv_heads, head_dim, tpb = 9, 3, 64, 16
    q, k, v, tables = _case(dtype, heads, kv_heads, head_dim, tpb, [(500, 500), (77, 300)])
    whole = _attend(q[:500], k, v, tables[:1], [(500, 500)], tpb, 0.125)
    head = _attend(q[:200], k, v, tables[:1], [(200, 200)], tpb, 0.125)
    tail = _attend(torch.cat([q[200:500], q[500:]]), k, v, tables, [(300, 500), (77, 300)], tpb,
                   0.125)
    assert torch.equal(torch.cat([head, tail[:300]]), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _attend(q[:500], k, v, tables[:1], [(500, 500)], tpb, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole)


# A local layer's window (heads, kv heads, head_dim, tokens_per_block, window, chunks): Gemma 3's
# heads with a window of 512 over a 1,024-token first chunk, and a chunk deep in a prompt;
# windows that are no multiple of the key block (and of one key), chunks shorter than the
# window beside ones past it, a window over the whole prompt.
WINDOW_CASES = {
    "gemma3-first-chunk": (4, 1, 256, 16, 512, [(1024, 1024)]),
    "gemma3-deep-chunk": (4, 1, 256, 16, 512, [(300, 1400)]),
    "odd-window-two-chunks": (9, 3, 64, 16, 77, [(200, 200), (50, 330)]),
    "window-1-tpb3": (7, 1, 64, 3, 1, [(40, 40), (9, 100)]),
    "window-past-prompt": (8, 2, 40, 8, 600, [(130, 300)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_a_window_attends_each_rows_last_keys_as_torch_does(name, dtype):
    """Keys before a row's window are masked (not merely down-weighted): against torch's SDPA
    with the sliding-window mask, within summation order in fp32, as accurate as torch's own
    bf16 attention in bf16; and not the unwindowed result."""
    heads, kv_heads, head_dim, tpb, window, chunks = WINDOW_CASES[name]
    q, k, v, tables = _case(dtype, heads, kv_heads, head_dim, tpb, chunks)
    scale = 1 / math.sqrt(head_dim)
    out = _attend(q, k, v, tables, chunks, tpb, scale, window=window)
    exact = _reference(q, k, v, tables, chunks, tpb, scale, window=window)
    if dtype == torch.float32:
        torch.testing.assert_close(out, exact, atol=2e-6, rtol=1e-5)
    else:
        ours = (out.float() - exact).abs()
        theirs = (_reference(q, k, v, tables, chunks, tpb, scale, torch.bfloat16,
                             window=window).float() - exact).abs()
        assert ours.mean() <= 1.25 * theirs.mean()
        assert ours.max() <= 2 * theirs.max()
    if max(keys for _, keys in chunks) > window:
        unwindowed = _reference(q, k, v, tables, chunks, tpb, scale)
        assert not torch.allclose(out.float(), unwindowed, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_windowed_row_gives_the_same_values_however_its_prompt_is_chunked(dtype):
    """Items start at the key block of their first row's window, so different rows of one item
    skip different blocks: a row's values are still the same in one chunk or two, alone or
    beside another sequence, with one thread or several."""
    heads, kv_heads, head_dim, tpb, window = 4, 1, 256, 16, 300
    q, k, v, tables = _case(dtype, heads, kv_heads, head_dim, tpb, [(700, 700), (77, 500)])
    scale = 0.0625
    whole = _attend(q[:700], k, v, tables[:1], [(700, 700)], tpb, scale, window=window)
    head = _attend(q[:333], k, v, tables[:1], [(333, 333)], tpb, scale, window=window)
    tail = _attend(torch.cat([q[333:700], q[700:]]), k, v, tables, [(367, 700), (77, 500)], tpb,
                   scale, window=window)
    assert torch.equal(torch.cat([head, tail[:367]]), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _attend(q[:700], k, v, tables[:1], [(700, 700)], tpb, scale, window=window)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole)


def test_a_negative_window_is_refused():
    q, k, v, tables = _case(torch.float32, 4, 2, 16, 4, [(10, 30)])
    with pytest.raises(RuntimeError, match="window must be 0"):
        _attend(q, k, v, tables, [(10, 30)], 4, 0.25, window=-1)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_byte_cache_is_attended_as_its_widened_values(dtype, kv_dtype):
    """Stored = value / scale in one byte: keys widened exactly, the key scale folded into the
    scores, the value scale applied to the output."""
    from triton_backend.engine.quant.kv_cache import (KV_DTYPES, KV_STORAGE_DTYPES, dequantize_kv,
                                                      quantize_kv)

    heads, kv_heads, head_dim, tpb, chunks = 8, 2, 64, 16, [(100, 260), (70, 70)]
    q, k, v, tables = _case(torch.float32, heads, kv_heads, head_dim, tpb, chunks)
    k_scale, v_scale = 0.03, 0.02
    stored = [quantize_kv(x, s, kv_dtype).view(KV_STORAGE_DTYPES[kv_dtype])
              for x, s in ((k, k_scale), (v, v_scale))]
    widened = [dequantize_kv(x.view(KV_DTYPES[kv_dtype]), s, torch.float32)
               for x, s in zip(stored, (k_scale, v_scale))]
    out = _attend(q.to(dtype), *stored, tables, chunks, tpb, 0.125, k_scale, v_scale)
    ref = _reference(q.to(dtype), *widened, tables, chunks, tpb, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * float(widened[1].abs().max())
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=1e-5 if tol < 1e-3 else 0)
    unscaled = _attend(q.to(dtype), *stored, tables, chunks, tpb, 0.125)
    assert not torch.allclose(unscaled.float(), out.float(), atol=0.1)


def test_keys_outside_the_cache_or_the_block_table_are_refused_with_the_field_named():
    q, k, v, tables = _case(torch.float32, 4, 2, 16, 4, [(10, 30)])
    with pytest.raises(RuntimeError, match="block_tables entry 2 is 99, outside the cache's"):
        _attend(q, k, v, [tables[0][:2] + [99] + tables[0][3:]], [(10, 30)], 4, 0.25)
    with pytest.raises(RuntimeError, match="seq_lens 40 is over its block table's 32 keys"):
        _attend(q, k, v, tables, [(10, 40)], 4, 0.25)
    with pytest.raises(RuntimeError, match="query rows must be at least 0 and at most"):
        _attend(q, k, v, tables, [(10, 8)], 4, 0.25)
    with pytest.raises(RuntimeError, match="out must be a contiguous tensor of q's shape"):
        torch.ops.llm_forge.prefill_attention(
            torch.empty(9, 4, 16), q, k, v, _int32(tables), _int32([30]), _int32([0, 10]), 4, 0.25)


def _record_prefill_chunks(runner) -> set[int]:
    """How many keys came before each chunk the runner sends to the prefill kernel (in the
    one-call path or op by op), gathered as it prepares each step."""
    keys_before: set[int] = set()
    prepare = runner.ops.inputs.prepare

    def recording(chunks):
        prepared = prepare(chunks)
        for run in prepared[2].prefill_runs:
            rows = (run.query_start[1:] - run.query_start[:-1]).tolist()
            keys_before.update(n - r for n, r in zip(run.seq_lens.tolist(), rows))
        return prepared

    runner.ops.inputs.prepare = recording
    return keys_before


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_long_prompts_give_the_torch_paths_tokens(tmp_path, monkeypatch, kv_dtype):
    """An fp32 engine whose prompts are prefilled in chunks of up to 80 rows: first chunks, a
    chunk deep in a prompt and one after a prefix-cache hit take the prefill kernel, and give
    the torch reference's greedy tokens and log probs (a one-byte cache: first chunks attend
    their keys as computed, the rest as stored, on both paths)."""
    import tiny
    from triton_backend.engine import Request, model_runner
    from triton_backend.engine.llm_engine import LLMEngine
    from triton_backend.engine.offline import generate
    from triton_backend.engine.ops import TorchOps

    engine_dir = tiny.build_engine(tmp_path, "llama_gqa", limits={
        "max_num_tokens": 80, "max_input_len": 240, "max_seq_len": 256})
    if kv_dtype:
        engine_dir = tiny.one_byte_kv_engine(engine_dir, tmp_path, kv_dtype)
    shared = [7 + (5 * i) % 300 for i in range(96)]  # 12 whole blocks
    prompts = [shared + [11, 12, 13] * 30, [3 + (7 * i) % 350 for i in range(200)],
               shared + [21, 22] * 40]

    def run(engine):  # one at a time: each chunk as long as max_num_tokens allows
        results = [generate(engine, [Request(p, 8, ignore_eos=True)])[0] for p in prompts]
        return [(r.output_ids, r.log_probs) for r in results]

    engine = LLMEngine(engine_dir, enable_prefix_caching=True)
    keys_before = _record_prefill_chunks(engine.runner)
    ours = run(engine)
    assert {0, 80, 96} <= keys_before  # first chunks, deep ones, after the hit
    monkeypatch.setattr(model_runner, "select_ops", lambda device: TorchOps())
    reference = run(LLMEngine(engine_dir, enable_prefix_caching=True))
    for (ids, log_probs), (ref_ids, ref_log_probs) in zip(ours, reference):
        assert ids == ref_ids
        torch.testing.assert_close(torch.tensor(log_probs), torch.tensor(ref_log_probs),
                                   atol=1e-4, rtol=0)
