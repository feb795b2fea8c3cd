"""Every tensor the engine makes names its device: with torch's default device set to `meta`,
an engine on the CPU runs every path (chunked prefill, prefix-cache hits, decode, n-gram and
draft-model speculation, a LoRA batch, guided JSON, penalties / top-k / top-p / seeds, log probs
and top log probs, int8 and fp8 KV caches) and gives the tokens it gives without that default.

A tensor made without a device would land on `meta` and fail the step it meets (an op mixing
meta and CPU tensors, or a `.item()` on meta): on a CUDA GPU the same tensor would have landed
on the CPU, the bug this test finds without a GPU. Both op backends run: the C++ kernels and the
torch reference, and the GPU backend's step (static buffers replayed eagerly, device sampling)
with its kernels' torch references."""
import json
import shutil

import pytest
import torch

import tiny
from test_speculative import speculative_engine
from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.guided import GuidedDecodingParams
from triton_backend.engine.llm_engine import LLMEngine

PREFIX = [(11 * i) % 300 + 3 for i in range(40)]  # five full blocks of 8


def _requests(lora_ids: tuple[int | None, ...] = (None,)) -> list[Request]:
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5,
                             repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2)
    out = [
        Request(PREFIX + [7, 8, 9], 12, return_log_probs=True, top_log_probs=5),
        Request(list(range(3, 103)), 10, sampled, streaming=True, return_log_probs=True),
        Request([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], 16, SamplingParams(min_tokens=4),
                bad_token_sequences=[[9, 10], [11]], stop_token_sequences=[[380]]),
        Request([30, 31, 32], 24, guided_decoding=GuidedDecodingParams("json", "")),
    ]
    for i, task_id in enumerate(lora_ids):
        out.append(Request([40 + i, 41, 42, 43], 8, lora_task_id=task_id, ignore_eos=True))
    return out


def _run(engine_dir, requests, late: list[Request]) -> dict:
    """Outputs by request index; `late` requests arrive after the first step (prefix hits on
    the first request's blocks, joining a batch that decodes)."""
    engine = LLMEngine(engine_dir)
    ids = [engine.add_request(r) for r in requests]
    engine.step()
    ids += [engine.add_request(r) for r in late]
    outputs: dict[int, list] = {i: [] for i in ids}
    while engine.has_work():
        for response in engine.step():
            assert response.error is None, response.error
            outputs[response.request_id].append((response.output_token_ids, response.log_probs,
                                                 response.top_ids))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return {"outputs": [outputs[i] for i in ids], "stats": engine.get_stats()}


def _engines(tiny_engines, lora_build, tmp_path) -> dict:
    base = tiny_engines("llama_gqa")
    chunked = tmp_path / "engine-chunked"  # a budget of 32 rows: the 100-token prompt in 4 steps
    shutil.copytree(base, chunked)
    config = json.loads((chunked / "config.json").read_text())
    config["limits"]["max_num_tokens"] = 32
    (chunked / "config.json").write_text(json.dumps(config))
    return {
        "base": (base, ()),
        "chunked": (chunked, ()),
        "rope_scaled": (tiny_engines("llama_mha_rope_scaled"), ()),
        "qwen3_qk_norm": (tiny_engines("qwen3_qk_norm"), ()),
        "ngram": (speculative_engine(base, tmp_path, mode="ngram", num_draft_tokens=3,
                                     prompt_lookup_min=1), ()),
        "draft": (speculative_engine(base, tmp_path, "draft", mode="draft_model",
                                     num_draft_tokens=2, draft_engine=str(base)), ()),
        "lora": (lora_build[2], (1, 2, None)),
        "int8_kv": (tiny.one_byte_kv_engine(base, tmp_path, "int8"), ()),
        "fp8_kv": (tiny.one_byte_kv_engine(base, tmp_path, "fp8"), ()),
    }


@pytest.fixture(params=["cpp", "torch", "gpu"])
def op_backend(request, monkeypatch):
    if request.param == "gpu":  # the GPU backend's step, its kernels' references on the CPU
        monkeypatch.setenv("LLM_FORGE_KERNELS", "gpu")
    if request.param == "torch":
        from triton_backend.engine import model_runner
        from triton_backend.engine.ops import TorchOps

        # The torch reference's sampler too: no C++ greedy pick (TorchOps.greedy_pick is None).
        monkeypatch.setattr(model_runner, "select_ops", lambda device: TorchOps())
    return request.param


def test_every_path_runs_with_meta_as_the_default_device(tiny_engines, lora_build, tmp_path,
                                                         op_backend):
    engines = _engines(tiny_engines, lora_build, tmp_path)
    for name, (engine_dir, lora_ids) in engines.items():
        requests = _requests(lora_ids)
        late = [Request(PREFIX + [50, 51], 6, return_log_probs=True, top_log_probs=3),
                Request(PREFIX[:24] + [60], 5)]
        expected = _run(engine_dir, requests, late)
        with torch.device("meta"):
            got = _run(engine_dir, requests, late)
        assert got["outputs"] == expected["outputs"], name
        stats = got["stats"]
        assert stats["prefix_cache_hit_tokens"] >= 24, name
        if name in ("ngram", "draft"):
            assert stats["spec_num_draft_tokens"] > 0, name
