"""The contract every registered model family keeps, on a small random checkpoint of its own
(`tiny.family_shapes()`: the family's `example` fields, fp32): prefill logits and greedy
continuations against transformers, batched with a prefix hit; a prompt prefilled in chunks;
an int8 KV cache; n-gram speculation greedy-identical; LoRA on the attention (every family
serves it); and every path with `meta` as torch's default device. Registering a family adds it
here: nothing in this file lists families."""
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

import lora_helpers
import tiny
from test_speculative import speculative_engine
from triton_backend.engine import Request
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate, prefill_logits

LOGIT_ATOL = 1e-3
PREFIX = [(7 * i) % 300 + 3 for i in range(40)]  # five full blocks of 8: shared by two prompts
PROMPTS = [PREFIX + [11, 12, 13], list(range(100, 190, 3)), PREFIX + [21, 22], [5, 9, 13, 17]]
NEW_TOKENS = 24
LONG = list(range(2, 90))  # past every example's sliding window (24) and a chunk of 32 rows
FAMILIES = tiny.family_shapes()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(shape):
        if shape not in cache:
            tmp = tmp_path_factory.mktemp(shape.replace(":", "-"))
            engine = tiny.build_engine(tmp, shape)
            hf_dir = tmp / f"hf-{shape.replace(':', '-')}"
            cache[shape] = engine, hf_dir, AutoModelForCausalLM.from_pretrained(
                str(hf_dir), dtype=torch.float32).eval()
        return cache[shape]
    return get


def _run(engine_dir, requests, **engine_options):
    """Outputs by request; the first request runs a step alone, so the others join a batch
    that decodes and the third hits the first's cached prefix."""
    engine = LLMEngine(engine_dir, **engine_options)
    ids = [engine.add_request(requests[0])]
    engine.step()
    ids += [engine.add_request(r) for r in requests[1:]]
    outputs = {i: [] for i in ids}
    while engine.has_work():
        for response in engine.step():
            assert response.error is None, response.error
            outputs[response.request_id].extend(response.output_token_ids)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return [outputs[i] for i in ids], engine.get_stats()


def _greedy(hf, prompt):
    """transformers' argmax continuation, the end id not masked (as `ignore_eos` does not)."""
    return lora_helpers.hf_greedy(hf, prompt, NEW_TOKENS)


def _requests():
    return [Request(p, NEW_TOKENS, ignore_eos=True) for p in PROMPTS]


@pytest.mark.parametrize("shape", FAMILIES)
def test_prefill_logits_match_transformers(built, shape):
    engine, _, hf = built(shape)
    with torch.inference_mode():
        theirs = hf(torch.tensor([LONG])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, LONG), theirs, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("shape", FAMILIES)
def test_batched_greedy_with_a_prefix_hit_matches_transformers(built, shape):
    engine, _, hf = built(shape)
    outputs, stats = _run(engine, _requests())
    assert stats["prefix_cache_hit_tokens"] >= 40
    for prompt, ours in zip(PROMPTS, outputs):
        expected = _greedy(hf, prompt)
        assert ours == expected
        assert len(set(expected)) > 5, "degenerate checkpoint: the comparison would prove little"


@pytest.mark.parametrize("shape", FAMILIES)
def test_a_prompt_longer_than_a_chunk_matches_transformers(built, shape, tmp_path):
    engine, _, hf = built(shape)
    chunked = tmp_path / "engine-chunked"
    shutil.copytree(engine, chunked)
    config = json.loads((chunked / "config.json").read_text())
    config["limits"]["max_num_tokens"] = 32  # the 88-token prompt in three steps
    (chunked / "config.json").write_text(json.dumps(config))
    with torch.inference_mode():
        theirs = hf(torch.tensor([LONG])).logits[0]
    torch.testing.assert_close(prefill_logits(chunked, LONG), theirs, atol=LOGIT_ATOL, rtol=0)
    ours = generate(LLMEngine(chunked), [Request(LONG, NEW_TOKENS, ignore_eos=True)])[0]
    assert ours.output_ids == _greedy(hf, LONG)


@pytest.mark.parametrize("shape", FAMILIES)
def test_int8_kv_cache_keeps_the_argmax(built, shape, tmp_path):
    """One byte per cached element: the logits move by the cache's rounding, the argmax of
    nearly every position does not (the random checkpoints' top-2 gaps are ~0.5)."""
    engine, _, hf = built(shape)
    int8 = tiny.one_byte_kv_engine(engine, tmp_path, "int8")
    with torch.inference_mode():
        theirs = hf(torch.tensor([LONG])).logits[0]
    ours = prefill_logits(int8, LONG)
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    assert (ours - theirs).abs().max().item() > 0  # the cache did round


@pytest.mark.parametrize("shape", FAMILIES)
def test_ngram_speculation_is_greedy_identical(built, shape, tmp_path):
    engine, _, _ = built(shape)
    spec = speculative_engine(engine, tmp_path, mode="ngram", num_draft_tokens=3,
                              prompt_lookup_min=1)
    repeating = [Request([5, 6, 7, 8] * 6, NEW_TOKENS, ignore_eos=True), *_requests()]
    with_drafts, stats = _run(spec, repeating)
    without, _ = _run(spec, repeating, enable_speculative_decoding=False)
    assert with_drafts == without
    assert stats["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("shape", FAMILIES)
def test_lora_on_the_attention_follows_peft(built, shape, tmp_path):
    _, hf_dir, _ = built(shape)
    adapter = lora_helpers.train_adapter(hf_dir, tmp_path / "peft", ["q_proj", "v_proj"], r=4,
                                         alpha=8, seed=1, steps=6)
    engine = tiny.build_engine(tmp_path, shape, lora={"adapters": {"attn": str(adapter)}})
    task_id = json.loads((engine / "config.json").read_text())["lora"]["adapters"][0]["task_id"]
    merged = lora_helpers.merged_model(hf_dir, adapter)
    prompt = PROMPTS[1]
    ours = generate(LLMEngine(engine), [Request(prompt, 12, ignore_eos=True,
                                                lora_task_id=task_id)])[0].output_ids
    assert ours == lora_helpers.hf_greedy(merged, prompt, 12)
    base = generate(LLMEngine(engine), [Request(prompt, 12, ignore_eos=True)])[0].output_ids
    assert base != ours, "the adapter changed nothing: the comparison would prove little"


@pytest.mark.parametrize("shape", FAMILIES)
def test_every_path_names_its_device(built, shape, tmp_path):
    """With `meta` as torch's default device the engine gives the same tokens (a tensor made
    without a device would land on meta and fail)."""
    engine, _, _ = built(shape)
    spec = speculative_engine(engine, tmp_path, mode="ngram", num_draft_tokens=3,
                              prompt_lookup_min=1)
    for engine_dir in (engine, tiny.one_byte_kv_engine(engine, tmp_path, "int8"), spec):
        expected, _ = _run(engine_dir, _requests())
        with torch.device("meta"):
            got, _ = _run(engine_dir, _requests())
        assert got == expected, engine_dir.name
