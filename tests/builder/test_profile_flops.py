"""`forge bench profile`'s FLOP count of a prefill, by hand on tiny engines: a dense Llama with
its own LM head, a tied one (the head is the embedding, counted once, for the last row), and a
mixture of experts with a dense layer (top_k of its experts a row, the router always)."""
from types import SimpleNamespace

import pytest
import torch

from builder.bench.profile import linear_flops
from triton_backend.engine.config import EngineConfig
from triton_backend.engine.weights import load_model


def _engine(engine_dir):
    config = EngineConfig.load(engine_dir)
    return SimpleNamespace(config=config,
                           runner=SimpleNamespace(model=load_model(engine_dir, config,
                                                                    torch.device("cpu"))))


@pytest.mark.parametrize("shape", ["llama_gqa", "qwen2_bias_tied", "family:qwen3_moe"])
def test_a_prefill_counts_each_rows_weights_once(tiny_engines, shape):
    engine = _engine(tiny_engines(shape))
    m = engine.config.model
    attention = m.hidden_size * (m.q_size + 2 * m.kv_size) + m.q_size * m.hidden_size
    dense = 3 * m.hidden_size * m.intermediate_size
    routed = (m.hidden_size * (m.num_experts or 0)  # the router
              + (m.num_experts_per_tok or 0) * 3 * m.hidden_size * (m.moe_intermediate_size or 0))
    per_row = sum(attention + (routed if m.is_moe_layer(layer) else dense)
                  for layer in range(m.num_hidden_layers))
    if m.num_experts:
        assert 0 < len(m.dense_layers) < m.num_hidden_layers  # both kinds counted
    head = m.vocab_size * m.hidden_size
    tokens = 10
    gemm, attn = linear_flops(engine, tokens)
    assert gemm == pytest.approx(2.0 * per_row * tokens + 2.0 * head)
    assert attn == 2.0 * 2 * m.num_hidden_layers * m.q_size * tokens * (tokens + 1) / 2
