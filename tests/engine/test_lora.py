"""Multi-LoRA on the engine: two adapters trained with peft, built into one fp32 engine, served
side by side with the base model."""
import json

import pytest
import torch

import lora_helpers
from triton_backend.engine import Request
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate

NEW_TOKENS = 24
PROMPTS = [list(range(3, 40)), [5, 9, 13], list(range(100, 180, 3))]


@pytest.fixture(scope="module")
def references(lora_build):
    """Greedy continuations of PROMPTS by transformers: the base, and peft's merged models."""
    from transformers import AutoModelForCausalLM

    hf_dir, adapters, _ = lora_build
    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    out = {None: [lora_helpers.hf_greedy(base, p, NEW_TOKENS) for p in PROMPTS]}
    for name, path in adapters.items():
        merged = lora_helpers.merged_model(hf_dir, path)
        out[name] = [lora_helpers.hf_greedy(merged, p, NEW_TOKENS) for p in PROMPTS]
    return out


def _task_ids(engine_dir):
    config = json.loads((engine_dir / "config.json").read_text())
    return {a["name"]: a["task_id"] for a in config["lora"]["adapters"]}


def _request(prompt, task_id=None, **kwargs):
    return Request(prompt, NEW_TOKENS, ignore_eos=True, lora_task_id=task_id, **kwargs)


def test_engine_directory_holds_the_adapters(lora_build):
    _, _, engine_dir = lora_build
    config = json.loads((engine_dir / "config.json").read_text())["lora"]
    assert [(a["name"], a["task_id"], a["rank"]) for a in config["adapters"]] == [
        ("adapter-a", 1, 8), ("adapter-b", 2, 4)]
    assert config["max_rank"] == 64 and config["max_loras"] == 8
    manifest = json.loads((engine_dir / "manifest.json").read_text())["lora_adapters"]
    assert set(manifest["adapter-a"]["source_files"]) == {"adapter_config.json",
                                                          "adapter_model.safetensors"}
    assert manifest["adapter-b"]["sha256"] == config["adapters"][1]["sha256"]


def test_build_key_covers_the_adapter_files(lora_build, tmp_path):
    from builder.pipeline.build_key import BuildKey

    hf_dir, adapters, _ = lora_build
    adapter = lora_helpers.copy_adapter(adapters["adapter-b"], tmp_path / "b")
    spec = {"name": "x", "checkpoint": str(hf_dir), "lora": {"adapters": {"b": str(adapter)}}}
    before = BuildKey.compute(spec, tmp_path / "engine")
    assert set(before.parts["lora"]) == {"b/adapter_config.json", "b/adapter_model.safetensors"}
    (adapter / "adapter_model.safetensors").write_bytes(b"changed")
    after = BuildKey.compute(spec, tmp_path / "engine")
    assert after.key != before.key
    no_lora = BuildKey.compute({"name": "x", "checkpoint": str(hf_dir)}, tmp_path / "engine")
    assert "lora" not in no_lora.parts  # engines without adapters keep the keys they had


def test_adapters_change_the_output(references):
    """Otherwise the comparisons below would prove nothing."""
    assert references["adapter-a"] != references[None]
    assert references["adapter-b"] != references[None]
    assert references["adapter-a"] != references["adapter-b"]


@pytest.mark.parametrize("name", [None, "adapter-a", "adapter-b"])
def test_greedy_equals_peft_merged_model(lora_build, references, name):
    _, _, engine_dir = lora_build
    engine = LLMEngine(engine_dir)
    task_id = None if name is None else _task_ids(engine_dir)[name]
    results = generate(engine, [_request(p, task_id) for p in PROMPTS])
    assert [r.output_ids for r in results] == references[name]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sixteen_mixed_requests_equal_their_solo_outputs(lora_build):
    _, _, engine_dir = lora_build
    ids = _task_ids(engine_dir)
    choices = [None, ids["adapter-a"], ids["adapter-b"]]
    prompts = [[3 + i, 7 + 2 * i] + list(range(20 + i, 30 + 3 * i)) for i in range(16)]
    tasks = [choices[i % 3] for i in range(16)]
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    solo = [generate(engine, [_request(p, t)])[0].output_ids for p, t in zip(prompts, tasks)]
    together = generate(engine, [_request(p, t) for p, t in zip(prompts, tasks)])
    assert [r.output_ids for r in together] == solo
    assert engine.stats["max_num_seqs_in_step"] == 16
    # the same prompt under each adapter gives three different answers
    same = generate(engine, [_request(prompts[0], t) for t in choices])
    assert len({tuple(r.output_ids) for r in same}) == 3


def test_guided_requests_with_adapters_follow_their_guide_and_their_adapter(lora_build):
    """Guided decoding (the logits mask) and adapters (the projections) in one request and one
    batch: each guided output is valid for its schema and equals its solo run; the adapter
    still decides among the valid outputs (A and the base answer differently)."""
    from test_guided import SCHEMAS, _check_valid, _guide

    _, _, engine_dir = lora_build
    ids = _task_ids(engine_dir)
    tasks = [ids["adapter-a"], None, ids["adapter-b"], ids["adapter-a"], None, None]
    requests = [Request([5 + i, 9, 13, 21 + i], 80, lora_task_id=t,
                        guided_decoding=_guide("json_schema", SCHEMAS[3]) if i < 4 else None)
                for i, t in enumerate(tasks)]
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    together = generate(engine, requests)
    for request, result in zip(requests, together):
        if request.guided_decoding is not None:
            _check_valid(engine_dir, request, result)
        assert generate(engine, [request])[0].output_ids == result.output_ids
    same = [Request([5, 9, 13, 21], 80, lora_task_id=t,
                    guided_decoding=_guide("json_schema", SCHEMAS[3]))
            for t in (ids["adapter-a"], None)]
    a, base = generate(engine, same)
    assert a.output_ids != base.output_ids


def test_prefix_cache_never_shares_blocks_across_adapters(lora_build):
    _, _, engine_dir = lora_build
    ids = _task_ids(engine_dir)
    prompt = list(range(3, 60))  # 57 tokens: 7 full blocks of 8
    fresh = {name: generate(LLMEngine(engine_dir), [_request(prompt, ids.get(name))])[0]
             for name in (None, "adapter-a", "adapter-b")}
    engine = LLMEngine(engine_dir)
    assert engine.block_manager.enable_prefix_caching

    def run(name):
        seq_id = engine.add_request(_request(prompt, ids.get(name)))
        while engine.has_work():
            for response in engine.step():
                if response.request_id == seq_id and response.is_final:
                    return response

    first_a = run("adapter-a")
    then_b, then_base = run("adapter-b"), run(None)
    again_a = run("adapter-a")
    assert then_b.num_reused_blocks == 0 and then_base.num_reused_blocks == 0
    assert again_a.num_reused_blocks == 7  # the cache works: the same adapter reuses its blocks
    for name, response in (("adapter-a", first_a), ("adapter-b", then_b), (None, then_base),
                           ("adapter-a", again_a)):
        assert response.output_token_ids == fresh[name].output_ids


def test_adapters_sent_as_nvidia_tensors(lora_build, references):
    """lora_weights + lora_config load an adapter under a new task id; later requests name the
    id alone; an unknown id is an error naming it."""
    from triton_backend.engine.lora.nvidia import nvidia_tensors

    hf_dir, adapters, engine_dir = lora_build
    weights, config = nvidia_tensors(peft_pairs(adapters["adapter-b"]))
    engine = LLMEngine(engine_dir)
    first = generate(engine, [_request(PROMPTS[0], 77, lora_weights=weights.astype("float16"),
                                       lora_config=config)])[0]
    later = generate(engine, [_request(p, 77) for p in PROMPTS])
    # fp16 transport rounds the weights: greedy tokens of the tiny model still agree
    assert first.output_ids == references["adapter-b"][0]
    assert [r.output_ids for r in later] == references["adapter-b"]
    with pytest.raises(ValueError, match="lora_task_id 78: no LoRA adapter is cached"):
        engine.add_request(_request(PROMPTS[0], 78))


def peft_pairs(adapter_dir):
    """(layer, module, A, B scaled) of a PEFT adapter, as NVIDIA's converter lays them out."""
    from builder.pipeline.lora import read_peft_adapter
    from triton_backend.engine.config import EngineConfig

    shape = EngineConfig.load(adapter_dir.parent / "engine-llama_gqa").model
    return read_peft_adapter("x", adapter_dir, shape, 64).pairs
