"""Run by the llama.cpp venv's Python for `forge bench engine --sides llamacpp` (see
llamacpp_side.py): argv = gguf file, n_ctx, threads. Answers {"ready": ...} once the model is
loaded, then reads one JSON line per run ({"prompts": [[ids]], "max_tokens": n}) and runs the
prompts one after another (the binding holds one sequence), greedy, exactly n tokens each (its
`generate` does not stop at an end id), and answers {"start": t0, "times": [[arrival time of
each token] per prompt], "perf": [llama.cpp's own counters per prompt]} on stdout."""
import json
import os
import sys
import time


def perf_counters(llama_cpp, ctx) -> dict:
    """llama.cpp's own timings of the last prompt (prompt eval, then one-token evals): they
    leave out the binding's sampling and Python between the evals."""
    data = llama_cpp.llama_perf_context(ctx)
    return {"prompt_ms": data.t_p_eval_ms, "prompt_tokens": data.n_p_eval,
            "eval_ms": data.t_eval_ms, "eval_tokens": data.n_eval}


def generate(llama_cpp, llm, ids: list, n: int) -> tuple:
    llm.reset()  # no prefix reuse: the next eval drops every cached position
    llama_cpp.llama_perf_context_reset(llm.ctx)
    times = []
    tokens = llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    for _ in tokens:
        times.append(time.perf_counter())
        if len(times) == n:
            break
    tokens.close()
    return times, perf_counters(llama_cpp, llm.ctx)


def main() -> None:
    # Answers go to the pipe that was stdout; whatever llama.cpp prints (from C too) goes to
    # stderr, set up before it is loaded.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import llama_cpp

    gguf, n_ctx, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # Flash attention on: what llama.cpp's own default ("auto") picks on a CPU; the binding
    # would otherwise turn it off.
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, seed=0, verbose=False)
    out.write(json.dumps({
        "ready": True, "llama_cpp_python": llama_cpp.__version__, "n_vocab": llm.n_vocab(),
        "threads": threads, "n_ctx": n_ctx,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        times, perf = [], []
        for ids in job["prompts"]:
            prompt_times, counters = generate(llama_cpp, llm, ids, job["max_tokens"])
            times.append(prompt_times)
            perf.append(counters)
        out.write(json.dumps({"start": start, "times": times, "perf": perf}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
