"""No Triton compiles while serving: the paged kernel's split count takes one of a few powers of
two (each warmed at start-up), the warm-up launches every variant an engine can meet, and a
variant first met after it is logged as a warning and counted in the engine's stats. The GPU
backend's step on this CPU (`LLM_FORGE_KERNELS=gpu`): the variants are noted at every launch
decision whether the kernel or its reference runs."""
import logging

import pytest

from triton_backend.engine import Request
from triton_backend.engine.gpu import warmup
from triton_backend.engine.gpu.graphs import CAPTURE_SIZES_ENV, capture_sizes
from triton_backend.engine.gpu.paged_attention import split_buckets, split_count
from triton_backend.engine.gpu.variants import VARIANTS
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate

MAX_SEQ_LEN = 512


@pytest.fixture(autouse=True)
def fresh_variants(monkeypatch):
    """A process of its own, as far as the record of variants goes."""
    monkeypatch.setenv("LLM_FORGE_KERNELS", "gpu")
    monkeypatch.setattr(VARIANTS, "_seen", set())
    monkeypatch.setattr(VARIANTS, "warm", False)
    monkeypatch.setattr(VARIANTS, "compiles_after_warmup", 0)


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """MHA (4 kv heads), 512 keys: two split counts (1, 2) on the CPU's 4 notional SMs."""
    import tiny

    return tiny.build_engine(tmp_path_factory.mktemp("long"), "llama_mha_rope_scaled",
                             limits={"max_seq_len": MAX_SEQ_LEN, "max_input_len": 400,
                                     "max_num_tokens": 512},
                             kv_cache={"num_blocks": 300})


@pytest.mark.parametrize("num_kv_heads", [1, 3, 8, 32])
@pytest.mark.parametrize("num_sms", [4, 58, 132])
@pytest.mark.parametrize("limit", [256, 2048, 32768])
def test_every_split_count_a_step_can_take_is_one_of_the_warmed_few(num_kv_heads, num_sms,
                                                                   limit):
    buckets = split_buckets(num_kv_heads, limit, num_sms)
    assert buckets == [1 << i for i in range(len(buckets))] and len(buckets) <= 5
    taken = {split_count(batch, num_kv_heads, seq_len, num_sms)
             for batch in (1, 2, 3, 5, 8, 16, 64, 256)
             for seq_len in [*range(1, limit, 97), limit]}
    assert taken <= set(buckets)
    assert max(taken) == buckets[-1]  # and the largest is met (a long sequence alone)


def test_split_counts_keep_their_rules():
    assert split_count(1, 8, 2048, 132) == 8      # 33 wanted, 2048 keys: 8 of 256
    assert split_count(1, 8, 700, 132) == 2       # 700 keys: 2 splits (not 2.7)
    assert split_count(4, 8, 8192, 132) == 8      # 9 wanted: rounded down, not up
    assert split_count(64, 8, 8192, 132) == 1     # a large batch fills the GPU itself


def test_the_engine_compiles_nothing_after_its_warm_up(long_engine, caplog):
    engine = LLMEngine(long_engine)
    shape = engine.config.model
    planned = len(warmup.planned_variant_names(
        shape.hidden_size, shape.intermediate_size, shape.num_attention_heads,
        shape.num_key_value_heads, shape.head_dim, 8, MAX_SEQ_LEN, 4))
    assert planned == 4 + 2 + 6 + 1  # fused; splits 1, 2; chunk tiles 2..64; one merge
    assert VARIANTS.num_variants == planned and VARIANTS.warm
    shared = list(range(3, 303))  # past 256 keys: two splits
    with caplog.at_level(logging.WARNING):
        generate(engine, [Request(shared, 6, ignore_eos=True),
                          Request([5, 6, 7], 30, ignore_eos=True)])
        generate(engine, [Request(shared[:296] + [40, 41, 42, 43], 4, ignore_eos=True)])
    stats = engine.get_stats()
    assert stats["prefix_cache_hit_tokens"] >= 288  # a chunk over a cached prefix ran
    assert stats["triton_kernel_variants"] == planned
    assert stats["triton_compiles_after_warmup"] == 0
    assert "after the start-up warm-up" not in caplog.text


def test_a_variant_met_after_the_warm_up_is_a_warning_and_a_count(long_engine, monkeypatch,
                                                                 caplog):
    monkeypatch.setattr(warmup, "planned_variants", lambda *args: [])  # a warm-up that misses
    engine = LLMEngine(long_engine, enable_cuda_graphs=False)
    assert VARIANTS.num_variants == 0 and VARIANTS.warm
    with caplog.at_level(logging.WARNING):
        generate(engine, [Request(list(range(3, 303)), 2, ignore_eos=True)])
    late = engine.get_stats()["triton_compiles_after_warmup"]
    assert late == VARIANTS.num_variants >= 5  # the fused ops, the split kernel and its merge
    assert caplog.text.count("after the start-up warm-up") == late


def test_capture_sizes_from_the_environment(monkeypatch):
    monkeypatch.setenv(CAPTURE_SIZES_ENV, "4,1,16,64")
    assert capture_sizes(64) == [1, 4, 16, 64]
    assert capture_sizes(8) == [1, 4, 8]  # max_batch_size is always captured
    monkeypatch.setenv(CAPTURE_SIZES_ENV, "1,x")
    with pytest.raises(ValueError, match="'1,x' is not a comma-separated list of batch sizes"):
        capture_sizes(8)
    monkeypatch.setenv(CAPTURE_SIZES_ENV, "0,4")
    with pytest.raises(ValueError, match="batch sizes start at 1"):
        capture_sizes(8)


def test_where_triton_compiles_its_hook_counts_the_late_compiles(monkeypatch, caplog):
    """On CUDA the count is Triton's own (a variant can compile twice: Triton also specializes
    on integer values); chained after a hook already there."""
    from types import SimpleNamespace

    from triton_backend.engine.gpu import triton_support

    calls = []
    runtime = SimpleNamespace(jit_post_compile_hook=lambda **kw: calls.append(kw["key"]))
    monkeypatch.setattr(triton_support, "triton", SimpleNamespace(
        knobs=SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(VARIANTS, "_hooked", False)
    monkeypatch.setattr(VARIANTS, "num_compiles", 0)
    VARIANTS.hook_compiles()
    VARIANTS.hook_compiles()  # once only
    hook = runtime.jit_post_compile_hook
    hook(key="a", repr="_rms_norm_kernel[...]")
    with VARIANTS.warming():
        hook(key="b", repr="_attention_kernel[...]")
    VARIANTS.mark_warm()
    with caplog.at_level(logging.WARNING):
        VARIANTS.note("silu_mul", "torch.bfloat16", 96)  # a new key: the hook decides, not it
        hook(key="c", repr="_attention_kernel[stride_bt=16]")
    assert calls == ["a", "b", "c"]
    assert VARIANTS.num_compiles == 3 and VARIANTS.compiles_after_warmup == 1
    assert "Triton compiles _attention_kernel[stride_bt=16] after the start-up warm-up" in (
        caplog.text)
