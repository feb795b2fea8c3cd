"""The GPU KV pool's reserve: a step's activations, a full chunk's logits, the sampler's
temporaries and the captured graphs' outputs, from the largest captured batch, max_num_tokens
and the vocabulary; set aside before the pool takes its fraction, logged, and named when the
pool cannot hold one sequence. The arithmetic by hand on a tiny engine's config (its
`torch.cuda` memory query stands in for a GPU's)."""
import dataclasses
import logging

import pytest
import torch

from triton_backend.engine import kv_pool
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.gpu.graphs import capture_sizes
from triton_backend.engine.kv_pool import (GPU_RUNTIME_RESERVE_BYTES, SAMPLER_BYTES_PER_LOGIT,
                                           free_memory_blocks, step_reserve)



@pytest.fixture(scope="module")
def config(tiny_engines):
    return EngineConfig.load(tiny_engines("llama_gqa"))


def test_the_reserve_counts_each_holder(config):
    shape, limits = config.model, config.limits
    assert (shape.hidden_size, shape.intermediate_size, shape.q_size, shape.kv_size) == (
        64, 128, 64, 32)
    assert (limits.max_num_tokens, limits.max_batch_size, shape.vocab_size) == (256, 16, 384)
    assert not config.speculative.enabled  # its 4 draft tokens sample nothing
    per_row = 2 * (4 * 64 + 3 * (64 + 2 * 32) + 3 * 128) * 2  # bf16: 2 bytes
    sizes = capture_sizes(16)
    assert sizes == [1, 2, 4, 8, 16]
    reserve = step_reserve(config, torch.bfloat16, sizes)
    assert reserve.activations == 256 * per_row
    assert reserve.prefill_logits == 256 * 384 * (2 + 4)
    assert reserve.sampler == 16 * 384 * SAMPLER_BYTES_PER_LOGIT
    # Every graph keeps its float32 logits and greedy picks; the largest one's activations and
    # bf16 logits live in their shared pool.
    assert reserve.graphs == (31 * (384 * 4 + 16)) + 16 * (per_row + 384 * 2)
    assert reserve.runtime == GPU_RUNTIME_RESERVE_BYTES
    assert reserve.total == (reserve.activations + reserve.prefill_logits + reserve.sampler
                             + reserve.graphs + GPU_RUNTIME_RESERVE_BYTES)
    assert step_reserve(config, torch.bfloat16).graphs == 0  # no graphs: nothing kept
    assert step_reserve(config, torch.float32, sizes).activations == 2 * reserve.activations
    ngram = dataclasses.replace(config, speculative=dataclasses.replace(
        config.speculative, mode="ngram"))
    assert step_reserve(ngram, torch.bfloat16).sampler == 16 * 5 * 384 * SAMPLER_BYTES_PER_LOGIT


def test_the_pool_takes_its_fraction_of_what_the_reserve_leaves(config, monkeypatch, caplog):
    free = 3 * 2**30
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 4 * 2**30))
    sizes = capture_sizes(16)
    reserve = step_reserve(config, torch.bfloat16, sizes)
    block_bytes = kv_pool.kv_bytes_per_token(config, torch.bfloat16) * 8
    with caplog.at_level(logging.INFO, logger="triton_backend.engine.kv_pool"):
        blocks = free_memory_blocks(config, torch.bfloat16, torch.device("cuda"), 0.5, sizes)
    assert blocks == int((free - reserve.total) * 0.5) // block_bytes
    assert f"{reserve.describe()} kept for a step" in caplog.text


def test_a_pool_too_small_names_the_fraction_and_the_reserve(config, monkeypatch):
    reserve = step_reserve(config, torch.bfloat16, [1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device: (reserve.total + 1000, 2**30))
    with pytest.raises(ValueError) as error:
        free_memory_blocks(config, torch.bfloat16, torch.device("cuda"), 0.9, [1])
    message = str(error.value)
    assert message.startswith("kv_cache_free_gpu_mem_fraction 0.9: ")
    assert f"{reserve.describe()} are kept for a step" in message
    assert "fewer than limits.max_seq_len (256)" in message


CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("engine, device, given, expected", [
    ({}, CPU, {}, (16 * 256 // 8, "limits.max_batch_size x max_seq_len", None)),
    ({"num_blocks": 40}, CPU, {}, (40, "kv_cache.num_blocks", None)),
    ({"num_blocks": 40}, CPU, {"kv_cache_num_blocks": 7}, (7, "kv_cache_num_blocks", None)),
    ({"memory_bytes": 10 * 4096}, CPU, {}, (10, "kv_cache.memory_bytes", None)),
    ({"num_blocks": 40}, CPU, {"kv_cache_memory_bytes": 3 * 4096},
     (3, "kv_cache_memory_bytes", None)),
    # On a GPU a fraction sizes the pool unless a count or a budget is given with the engine.
    ({"num_blocks": 40, "free_gpu_mem_fraction": 0.8}, CUDA, {},
     (None, "kv_cache.free_gpu_mem_fraction", 0.8)),
    ({"free_gpu_mem_fraction": 0.8}, CUDA, {"kv_cache_free_gpu_mem_fraction": 0.5},
     (None, "kv_cache_free_gpu_mem_fraction", 0.5)),
    ({"free_gpu_mem_fraction": 0.8}, CUDA, {"kv_cache_num_blocks": 9},
     (9, "kv_cache_num_blocks", None)),
    ({"num_blocks": 40, "free_gpu_mem_fraction": 0.8}, CPU,
     {"kv_cache_free_gpu_mem_fraction": 0.5}, (40, "kv_cache.num_blocks", None)),  # no GPU
])
def test_one_precedence_decides_the_pool(config, engine, device, given, expected):
    unset = {"num_blocks": None, "memory_bytes": None, "free_gpu_mem_fraction": None}
    kv = dataclasses.replace(config.kv_cache, **{**unset, **engine})
    bytes_per_block = kv_pool.kv_bytes_per_token(config, torch.float32) * kv.tokens_per_block
    assert bytes_per_block == 4096  # the budgets above are whole blocks of this engine
    plan = kv_pool.plan_pool(dataclasses.replace(config, kv_cache=kv), torch.float32, device,
                             **given)
    assert (plan.num_blocks, plan.source, plan.fraction) == expected


def test_the_pool_is_logged_once_with_the_knob_that_sized_it(config, caplog):
    plan = kv_pool.plan_pool(config, torch.float32, CPU, kv_cache_num_blocks=12)
    with caplog.at_level(logging.INFO, logger="triton_backend.engine.kv_pool"):
        assert plan.resolve(config, torch.float32, CPU) == 12
    assert caplog.messages == ["KV pool: 12 blocks, 96 tokens, 0.00 GiB (from kv_cache_num_blocks)"]
