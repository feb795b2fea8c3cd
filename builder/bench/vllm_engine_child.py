"""Run by the vLLM venv's Python for `forge bench engine --sides vllm` (see vllm_engine_side.py):
argv = checkpoint, max_model_len. Reads one JSON line per run ({"prompts": [[ids]], "max_tokens":
n}), steps vLLM's engine until all are done (end ids ignored, min_tokens = max_tokens, greedy),
and answers {"start": t0, "times": [[arrival time of each token] per prompt]} on stdout."""
import json
import os
import sys
import time


def main() -> None:
    # Answers go to the pipe that was stdout; everything vLLM and its engine-core process print
    # (to stdout or from C) goes to stderr, before vLLM is imported.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import EngineArgs, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine

    checkpoint, max_model_len = sys.argv[1], int(sys.argv[2])
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=checkpoint, dtype="bfloat16", max_model_len=max_model_len,
        enable_prefix_caching=False, disable_log_stats=True))
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    serial = 0
    for line in sys.stdin:
        job = json.loads(line)
        n = job["max_tokens"]
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        rids = []
        for ids in job["prompts"]:
            serial += 1
            rids.append(str(serial))
            engine.add_request(rids[-1], {"prompt_token_ids": ids}, params)
        times: dict[str, list[float]] = {rid: [] for rid in rids}
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:  # cumulative: the tokens so far, not those new this step
                seen = times[output.request_id]
                seen.extend([now] * (len(output.outputs[0].token_ids) - len(seen)))
        out.write(json.dumps({"start": start, "times": [times[r] for r in rids]}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
