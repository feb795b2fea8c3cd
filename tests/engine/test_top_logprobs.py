"""top_log_probs: the alternatives of each generated token come from the model's raw
distribution (before penalties, temperature and masks) and match a transformers forward pass
over the same tokens (fp32 tiny engines, 1e-4); with speculation they are the same."""
import pytest
import torch

from test_speculative import speculative_engine
from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.guided import GuidedDecodingParams
from triton_backend.engine.llm_engine import LLMEngine


def _engine_results(engine_dir, requests):
    """(output ids, own log probs, top ids, top log probs) per request, streamed pieces joined."""
    engine = LLMEngine(engine_dir)
    ids = [engine.add_request(r) for r in requests]
    out = {i: ([], [], [], []) for i in ids}
    while engine.has_work():
        for response in engine.step():
            ids_, own, top_ids, top_lps = out[response.request_id]
            ids_.extend(response.output_token_ids)
            own.extend(response.log_probs)
            top_ids.extend(response.top_ids)
            top_lps.extend(response.top_log_probs)
    return [out[i] for i in ids], engine


def _reference(engine_dir, prompt, output):
    import transformers

    checkpoint = engine_dir.parent / f"hf-{engine_dir.name.removeprefix('engine-')}"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint),
                                                              dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) - 1 + len(output)], dim=-1)


REQUESTS = [
    Request([5, 9, 14, 3, 77], 12, return_log_probs=True, top_log_probs=5),
    Request([8, 8, 21, 40], 10, SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3),
            streaming=True, return_log_probs=True, top_log_probs=20),
    Request([30, 31, 32], 9, return_log_probs=True, top_log_probs=3,
            guided_decoding=GuidedDecodingParams("regex", "[a-f ]{4,12}")),
    Request([12, 13], 6),  # asks for none: gets none, beside the others
]


def test_alternatives_match_transformers(tiny_engines):
    engine_dir = tiny_engines("llama_gqa")
    results, _ = _engine_results(engine_dir, REQUESTS)
    for request, (output, own, top_ids, top_lps) in zip(REQUESTS, results):
        k = request.top_log_probs
        if not k:
            assert top_ids == [] and top_lps == []
            continue
        assert len(top_ids) == len(top_lps) == len(output) and all(len(t) == k for t in top_ids)
        reference = _reference(engine_dir, request.input_token_ids, output)
        expected_values, expected_ids = reference.topk(k, dim=-1)
        assert torch.allclose(torch.tensor(top_lps), expected_values, atol=1e-4)
        # ids agree wherever the values are not near-ties
        for got, want, values in zip(top_ids, expected_ids.tolist(), expected_values.tolist()):
            for j in range(k):
                if all(abs(values[j] - values[m]) > 1e-4 for m in range(k) if m != j):
                    assert got[j] == want[j]
        # a token's own log prob is the raw one, as its alternatives show it
        raw_own = reference[torch.arange(len(output)), torch.tensor(output)]
        assert torch.allclose(torch.tensor(own), raw_own, atol=1e-4)
    # the guided request took tokens outside the model's favourites: its alternatives are raw
    output, _, top_ids, _ = results[2]
    assert any(token not in ids for token, ids in zip(output, top_ids))


def test_alternatives_are_the_same_with_speculation(tiny_engines, tmp_path):
    engine_dir = tiny_engines("llama_gqa")
    spec_dir = speculative_engine(engine_dir, tmp_path, "ngram", mode="ngram",
                                  num_draft_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    requests = [Request(([4, 5, 6, 7] * 6)[:20], 16, return_log_probs=True, top_log_probs=4),
                Request(([9, 2] * 8), 12, return_log_probs=True, top_log_probs=2,
                        streaming=True)]
    plain, _ = _engine_results(engine_dir, requests)
    spec, engine = _engine_results(spec_dir, requests)
    assert engine.get_stats()["spec_num_accepted_tokens"] > 0
    for a, b in zip(plain, spec):
        assert a[0] == b[0] and a[2] == b[2]
        assert torch.allclose(torch.tensor(a[3]), torch.tensor(b[3]), atol=1e-4)


@pytest.mark.parametrize("value", [21, -1, 2.5])
def test_top_log_probs_out_of_range_is_refused(tiny_engines, value):
    engine = LLMEngine(tiny_engines("llama_gqa"))
    with pytest.raises(ValueError, match=rf"top_log_probs must be an integer in \[0, 20\], "
                                         rf"got {value}"):
        engine.validate(Request([3, 4], 4, top_log_probs=value))


def test_cumulative_log_prob_follows_return_log_probs(tiny_engines):
    # NVIDIA's outputs: with return_log_probs both log-prob outputs are real, without it both
    # are zero (a cumulative figure beside per-token zeros would contradict itself).
    engine = LLMEngine(tiny_engines("llama_gqa"))
    asked = engine.add_request(Request([5, 9, 14], 6, return_log_probs=True))
    silent = engine.add_request(Request([5, 9, 14], 6, streaming=True))
    finals, per_token = {}, {asked: [], silent: []}
    while engine.has_work():
        for response in engine.step():
            per_token[response.request_id].extend(response.log_probs)
            if response.is_final:
                finals[response.request_id] = response.cum_log_prob
    assert len(per_token[asked]) == 6 and finals[asked] < 0
    assert finals[asked] == pytest.approx(sum(per_token[asked]))
    assert per_token[silent] == [] and finals[silent] == 0.0
