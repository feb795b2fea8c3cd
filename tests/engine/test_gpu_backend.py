"""The GPU backend's step run on this CPU (`LLM_FORGE_KERNELS=gpu`: the static buffers and
padded batches of the captured decode graphs replayed eagerly, sampling on the device, the paged
kernel's torch reference): greedy ids equal transformers', with graphs and without, in batches
with prefix-cache hits; padded rows write only the block nobody owns; seeded draws do not depend
on the batch."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.gpu.graphs import capture_sizes
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate

NEW_TOKENS = 24


@pytest.fixture(autouse=True)
def gpu_backend(monkeypatch):
    monkeypatch.setenv("LLM_FORGE_KERNELS", "gpu")


def _expected(engine_dir, prompt):
    hf = AutoModelForCausalLM.from_pretrained(
        str(engine_dir.parent / f"hf-{engine_dir.name[7:]}"), dtype=torch.float32)
    return hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                       do_sample=False, max_new_tokens=NEW_TOKENS,
                       min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("shape", ["llama_gqa", "qwen2_bias_tied", "llama_mha_rope_scaled"])
def test_greedy_ids_match_transformers_with_a_prefix_hit(tiny_engines, shape, graphs):
    engine_dir = tiny_engines(shape)
    engine = LLMEngine(engine_dir, enable_cuda_graphs=graphs)
    assert engine.runner.ops.name == "gpu"
    shared = list(range(3, 35))  # four full blocks of 8
    prompts = [shared + [40, 41], [5, 9, 13], list(range(100, 180, 3)), shared + [50]]
    first = generate(engine, [Request(p, NEW_TOKENS, ignore_eos=True) for p in prompts[:3]])
    second = generate(engine, [Request(prompts[3], NEW_TOKENS, ignore_eos=True)])
    assert engine.get_stats()["prefix_cache_hit_tokens"] >= 32
    for prompt, result in zip(prompts, first + second):
        assert result.output_ids == _expected(engine_dir, prompt)
    assert (engine.runner.ops.graphs is not None) == graphs
    stats = engine.get_stats()
    assert stats["gpu_backend"] == 1 and stats["cpp_kernels"] == 0
    if graphs:
        assert stats["cuda_graph_replays"] == engine.runner.ops.graphs.num_replays >= NEW_TOKENS - 1
    else:
        assert stats["cuda_graph_replays"] == stats["cuda_graphs"] == 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_padded_rows_write_only_the_block_nobody_owns(tiny_engines):
    engine = LLMEngine(tiny_engines("llama_gqa"), kv_cache_num_blocks=40)
    runner = engine.runner
    tpb = runner.config.kv_cache.tokens_per_block
    assert engine.block_manager.num_blocks == 40
    assert runner.kv_cache.k.shape[1] == 41 * tpb  # one more block: the padded rows'
    ids = [engine.add_request(Request(list(range(3 + i, 20 + i)), 6, ignore_eos=True))
           for i in range(3)]
    engine.step()  # the three prefills
    before = runner.kv_cache.k.clone()
    replays = runner.ops.graphs.num_replays
    engine.step()  # three decodes: the graph of 4, one padded row
    assert runner.ops.graphs.num_replays == replays + 1
    changed = (runner.kv_cache.k != before).flatten(2).any(dim=2)  # [layers, slots]
    written = {int(s) for s in changed.any(dim=0).nonzero()}
    owned = [engine.sequences[i].block_table[17 // tpb] * tpb + 17 % tpb for i in ids]
    assert written == set(owned) | {40 * tpb}
    # The step's inputs: one contiguous run of ids, positions, slots for its 4 rows (the copy
    # from pinned memory is one contiguous block, not a slice of a wider buffer).
    graphs = runner.ops.graphs
    inputs = graphs._longs(4)
    assert all(row.is_contiguous() for row in inputs)
    assert inputs.data_ptr() == graphs.device_inputs.longs.data_ptr()
    assert inputs[1].tolist() == [17, 17, 17, 0] and inputs[2].tolist() == owned + [40 * tpb]
    assert inputs[0, 3] == 0 and torch.equal(inputs.flatten(), graphs.host_longs[:12])


def test_seeded_draws_do_not_depend_on_the_batch(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    seeded = Request([7, 8, 9, 10], 12, SamplingParams(temperature=0.9, top_p=0.95, seed=11),
                     ignore_eos=True)
    alone = generate(LLMEngine(engine_dir), [seeded])[0].output_ids
    others = [Request([20 + i, 21, 22], 12, SamplingParams(temperature=1.0, seed=i),
                      ignore_eos=True) for i in range(5)]
    together = generate(LLMEngine(engine_dir), others[:2] + [seeded] + others[2:])[2].output_ids
    assert together == alone
    assert len(set(alone)) > 3


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert capture_sizes(256)[-3:] == [224, 240, 256]
