"""Our engine against transformers on the same checkpoints: greedy ids and prefill logits."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import tiny
from triton_backend.engine import Request
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate, prefill_logits

NEW_TOKENS = 40
# float32 on both sides; the packed/paged computation differs from transformers' only in the
# order of float operations, so logits agree to well under this.
LOGIT_ATOL = 1e-3


def _hf(engine_dir):
    return AutoModelForCausalLM.from_pretrained(str(engine_dir.parent / f"hf-{engine_dir.name[7:]}"),
                                                dtype=torch.float32)


@pytest.mark.parametrize("shape", list(tiny.SHAPES))
def test_greedy_ids_match_transformers(tiny_engines, shape):
    engine_dir = tiny_engines(shape)
    hf = _hf(engine_dir)
    engine = LLMEngine(engine_dir)
    prompts = [list(range(3, 40)), [5, 9, 13], list(range(100, 180, 3))]
    ours = generate(engine, [Request(p, NEW_TOKENS, ignore_eos=True) for p in prompts])
    for prompt, result in zip(prompts, ours):
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                               do_sample=False, max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert result.output_ids == expected
        assert len(set(expected)) > 5, "degenerate checkpoint: the comparison would prove little"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("shape", list(tiny.SHAPES))
def test_prefill_logits_match_transformers(tiny_engines, shape):
    engine_dir = tiny_engines(shape)
    ids = list(range(2, 90))
    ours = prefill_logits(engine_dir, ids)
    with torch.inference_mode():
        theirs = _hf(engine_dir)(torch.tensor([ids])).logits[0]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)


def test_chunked_prefill_logits_match_one_shot(tmp_path):
    """A prompt longer than max_num_tokens is prefilled in chunks over the paged cache."""
    engine_dir = tiny.build_engine(tmp_path, "llama_gqa", limits={"max_num_tokens": 24})
    ids = list(range(2, 90))
    chunked = prefill_logits(engine_dir, ids)
    with torch.inference_mode():
        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-llama_gqa"),
                                                      dtype=torch.float32)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(chunked, theirs, atol=LOGIT_ATOL, rtol=0)


def test_bfloat16_engine_matches_transformers_bfloat16(tmp_path):
    """Every greedy token of ours is transformers' bf16 argmax at that step, up to bf16's own
    resolution: transformers rounds logits to bf16 (0.0625 at 8), where two tokens often tie
    and the lower id wins, while our packed LM head keeps its fp32 sums. Which of two tied
    tokens comes out is not the engine's behaviour to pin, so the check is by logits."""
    engine_dir = tiny.build_engine(tmp_path, "qwen2_bias_tied", dtype="bfloat16")
    prompt = list(range(7, 30))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf-qwen2_bias_tied"),
                                              dtype=torch.bfloat16)
    ours = generate(LLMEngine(engine_dir), [Request(prompt, 32, ignore_eos=True)])[0].output_ids
    with torch.inference_mode():  # transformers' bf16 logits along our tokens
        logits = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
    best = logits.max(dim=-1).values
    resolution = 2.0 ** (torch.floor(torch.log2(best.abs())) - 7)  # one bf16 step at the top
    chosen = logits[torch.arange(len(ours)), torch.tensor(ours)]
    assert bool((chosen >= best - resolution).all()), (best - chosen).tolist()
    assert len(set(ours)) > 5
