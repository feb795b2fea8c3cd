"""Adapters on other engines: bf16 (the C++ kernels and packed projections), INT4 weights
(bf16 adapters on top of the quantized base), and speculative decoding with adapters."""
import json
import shutil

import pytest
import torch

import lora_helpers
from triton_backend.engine import Request
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate

PROMPT = list(range(3, 60))


def prefill_logits(engine_dir, ids, task_id):
    """Logits [len(ids), V] of one prefill with adapter `task_id` (None: the base model)."""
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    engine.add_request(Request(ids, 1, lora_task_id=task_id))
    engine.step(return_logits=True)
    return engine.last_logits.float()


def reference_logits(hf_dir, adapter_dir, ids):
    from transformers import AutoModelForCausalLM

    model = (lora_helpers.merged_model(hf_dir, adapter_dir) if adapter_dir else
             AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32))
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def bf16_engine(lora_build, tmp_path_factory):
    _, adapters, _ = lora_build
    tmp = tmp_path_factory.mktemp("lora-bf16")
    return lora_helpers.build_lora_engine(tmp, adapters, dtype="bfloat16")


def test_bf16_engine_stores_bf16_adapters_and_follows_peft(lora_build, bf16_engine):
    from safetensors.torch import load_file

    hf_dir, adapters, _ = lora_build
    state = load_file(str(bf16_engine / "lora" / "adapter-a.safetensors"))
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    ours = prefill_logits(bf16_engine, PROMPT, 1)
    theirs = reference_logits(hf_dir, adapters["adapter-a"], PROMPT)
    base = reference_logits(hf_dir, None, PROMPT)
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    agree_base = (ours.argmax(-1) == base.argmax(-1)).float().mean().item()
    assert agree >= 0.9 and agree > agree_base + 0.2, (agree, agree_base)


@pytest.mark.parametrize("engine", ["fp32", "bf16"])
def test_the_decode_fast_path_adds_the_adapters_as_the_python_model(lora_build, bf16_engine,
                                                                      engine):
    """Steps with adapters take the one-call C++ decode path: a mixed batch (a run of four rows
    of adapter A, which takes the packed kernel on a bf16 engine whose plan packs, one of B, a
    base row) gives the Python model's tokens, and its decode steps ran there (short prefills
    too)."""
    engine_dir = lora_build[2] if engine == "fp32" else bf16_engine
    task_ids = [1, None, 1, 2, 1, 1]
    requests = lambda: [Request(PROMPT[:10 + 3 * i], 14, ignore_eos=True,  # noqa: E731
                                lora_task_id=t) for i, t in enumerate(task_ids)]
    llm = LLMEngine(engine_dir, enable_prefix_caching=False)
    fast = llm.runner.ops.decode_forward
    assert fast is not None and fast.supported
    calls = []
    forward = fast.__call__
    llm.runner.ops.decode_forward = lambda *args: calls.append(args[3]) or forward(*args)
    llm.runner.ops.decode_forward.covers = fast.covers
    with_fast = [r.output_ids for r in generate(llm, requests())]
    llm.runner.ops.decode_forward = None
    assert [r.output_ids for r in generate(llm, requests())] == with_fast
    with_adapters = [lora for lora in calls if lora is not None]
    assert len(with_adapters) >= 10
    decodes = [sorted(run.end - run.start for run in lora.runs) for lora in with_adapters]
    assert decodes.count([1, 4]) >= 10  # A's four rows, B's one (the base row has no run)


def test_int4_engine_serves_bf16_adapters_on_quantized_weights(lora_build, bf16_engine, tmp_path):
    pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is the quant extra")
    from builder.quantize import CalibrationOptions, QuantizeOptions, quantize_engine

    hf_dir, adapters, _ = lora_build
    engine_dir = tmp_path / "int4"
    shutil.copytree(bf16_engine, engine_dir)
    quantize_engine(engine_dir, hf_dir, QuantizeOptions(
        weights="int4_rtn", group_size=32, calibration=CalibrationOptions(samples=4, seq_len=32)))
    assert json.loads((engine_dir / "config.json").read_text())["quantization"]["weights"] \
        == "int4_rtn"
    # What the adapter adds on the INT4 base points where peft's merged model moves the fp32 one.
    ours = prefill_logits(engine_dir, PROMPT, 1) - prefill_logits(engine_dir, PROMPT, None)
    theirs = (reference_logits(hf_dir, adapters["adapter-a"], PROMPT)
              - reference_logits(hf_dir, None, PROMPT))
    cosine = torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0)
    assert cosine > 0.9, cosine
    ids = {name: task for name, task in (("a", 1), ("b", 2), ("base", None))}
    requests = [Request(PROMPT[:20 + i], 12, ignore_eos=True, lora_task_id=ids[k])
                for i, k in enumerate(["a", "b", "base", "a"])]
    engine = LLMEngine(engine_dir, enable_prefix_caching=False)
    solo = [generate(engine, [r])[0].output_ids for r in requests]
    assert [r.output_ids for r in generate(engine, requests)] == solo


def test_speculative_decoding_with_adapters_keeps_greedy_output(lora_build, tmp_path):
    """ngram drafts are verified by the target with the request's adapter on every row: the
    output is the adapter's own greedy output."""
    _, adapters, reference_engine = lora_build
    engine_dir = lora_helpers.build_lora_engine(
        tmp_path, adapters, speculative={"mode": "ngram", "num_draft_tokens": 3,
                                         "disable_by_batch_size": 8})
    prompt = [7, 8, 9, 10, 11] * 6  # repetitive: prompt lookup finds drafts
    requests = [Request(prompt, 24, ignore_eos=True, lora_task_id=t) for t in (1, 2, None)]
    expected = [r.output_ids for r in generate(LLMEngine(reference_engine), requests)]
    engine = LLMEngine(engine_dir)
    assert engine.speculator is not None
    assert [r.output_ids for r in generate(engine, requests)] == expected
    assert engine.stats["spec_num_draft_tokens"] > 0


def _flag_values(command: str) -> dict[str, list[str]]:
    """--flag -> its values (LoRA flags take several)."""
    import shlex

    parts = shlex.split(command)
    assert parts[0] == "trtllm-build"
    flags: dict[str, list[str]] = {}
    for part in parts[1:]:
        if part.startswith("--"):
            assert part not in flags, part
            flags[part] = []
            current = part
        else:
            flags[current].append(part)
    return flags


def test_trtllm_target_lora_flags_and_nvidia_layout(lora_build, tmp_path):
    """Dry run: the LoRA plugin flags against the pinned flag table; a build (stopped after the
    checkpoint here) writes the PEFT dirs --lora_dir reads and NVIDIA's request tensors, which
    this runtime reads back as the same adapter."""
    from pathlib import Path

    import numpy as np
    from rich.console import Console

    from builder.pipeline.engine_builder import build_engine, trtllm_command
    from builder.spec.load import spec_from_dict

    hf_dir, adapters, torch_engine = lora_build
    table = json.loads((Path(__file__).parents[1] / "data" / "trtllm_build_flags.json").read_text())
    spec = spec_from_dict({
        "name": "t", "checkpoint": str(hf_dir), "target": "trtllm", "hardware": "l4",
        "dtype": "bfloat16", "output": str(tmp_path / "engine"),
        "limits": {"max_batch_size": 8, "max_num_tokens": 128, "max_input_len": 64,
                   "max_seq_len": 128},
        "lora": {"adapters": {n: str(p) for n, p in adapters.items()}, "max_rank": 16}})
    flags = _flag_values(trtllm_command(spec))
    for name, values in flags.items():
        allowed = table["flags"][name]
        assert len(values) == 1 or allowed.get("nargs") == "+", name
        for value in values:
            assert "choices" not in allowed or value in allowed["choices"], (name, value)
    assert flags["--lora_plugin"] == ["bfloat16"] and flags["--max_lora_rank"] == ["16"]
    assert flags["--lora_dir"] == ["lora/adapter-a", "lora/adapter-b"]
    assert flags["--lora_target_modules"] == ["attn_q", "attn_k", "attn_v", "attn_dense",
                                              "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]
    engine = build_engine(spec, console=Console(quiet=True), emit_repository=False)
    script = (engine / "build.sh").read_text()
    assert "--lora_dir lora/adapter-a lora/adapter-b" in script
    b = engine / "lora" / "adapter-b"
    assert {p.name for p in b.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                             "model.lora_weights.npy", "model.lora_config.npy"}
    weights, config = np.load(b / "model.lora_weights.npy"), np.load(b / "model.lora_config.npy")
    assert weights.dtype == np.float16 and weights.shape[0] == 1 and config.shape[2] == 3
    assert sorted({int(m) for m in config[0, :, 0]}) == [1, 3, 6]  # attn_q, attn_v, mlp_4h_to_h
    # sent to this runtime, they are adapter-b
    requests = [Request(PROMPT, 12, ignore_eos=True, lora_task_id=5, lora_weights=weights,
                        lora_config=config)]
    expected = generate(LLMEngine(torch_engine), [Request(PROMPT, 12, ignore_eos=True,
                                                          lora_task_id=2)])
    assert generate(LLMEngine(torch_engine), requests)[0].output_ids == expected[0].output_ids
