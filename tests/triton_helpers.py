"""Start and stop a real tritonserver on free loopback ports, for tests and benchmarks.

Thin on purpose: the launcher is `builder.serving.serve.start_tritonserver`; this module only adds the
pytest-friendly pieces (a context manager and a readiness probe used after error matrices).

    from tests.triton_helpers import running_tritonserver
    with running_tritonserver(repo_dir) as server:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from builder.serving.serve import TritonServer, free_port, start_tritonserver

__all__ = ["ForgeServe", "TritonServer", "children", "cmdline", "engine_pid", "free_port",
           "running_tritonserver", "start_tritonserver"]


@contextlib.contextmanager
def running_tritonserver(repository_dir: str | Path, ready_timeout: float = 240.0,
                         **kwargs) -> Iterator[TritonServer]:
    """A ready server for the block's duration; stopped on exit, also when the block raises.

    On failure inside the block the server log tail is attached to the exception as a note.
    """
    server = start_tritonserver(repository_dir, ready_timeout=ready_timeout, **kwargs)
    try:
        yield server
    except BaseException as exc:
        if hasattr(exc, "add_note"):
            exc.add_note("tritonserver log tail:\n" + server.log_tail(3000))
        raise
    finally:
        server.stop()


def engine_pid(metrics_url: str) -> int | None:
    """The engine process the tensorrt_llm model talks to now, from its `engine_pid` stat on
    `/metrics` (published once it is ready); None while nothing answers."""
    import re
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    match = re.search(r'llm_forge_executor_stats\{[^}]*stat="engine_pid"[^}]*\} ([0-9.e+]+)', text)
    return int(float(match.group(1))) if match else None


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class ForgeServe:
    """`forge serve` as a subprocess on free loopback ports (HTTP, gRPC, metrics, health), its
    output in a file; `close()` kills it and the tritonserver it started."""

    def __init__(self, repository: Path, *args: str):
        self.ports = {name: free_port() for name in ("http", "grpc", "metrics", "health")}
        self.output = Path(os.environ.get("TMPDIR", "/tmp")) / (
            f"forge-serve-{os.getpid()}-{self.ports['health']}.out")
        self.sink = open(self.output, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "builder.cli", "serve", "--repository", str(repository),
             *(f"--{name}-port={port}" for name, port in self.ports.items()), *args],
            stdout=self.sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    http_port = property(lambda self: self.ports["http"])
    grpc_port = property(lambda self: self.ports["grpc"])
    metrics_port = property(lambda self: self.ports["metrics"])
    health = property(lambda self: self.ports["health"])
    http_url = property(lambda self: f"127.0.0.1:{self.ports['http']}")
    grpc_url = property(lambda self: f"127.0.0.1:{self.ports['grpc']}")

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def wait_serving(self, timeout: float = 240) -> None:
        """Until the supervisor probes the models (every model loaded), bounded by `timeout`."""
        started = time.monotonic()
        while "supervisor: probing" not in self.text():
            assert self.process.poll() is None, self.text()
            assert time.monotonic() - started < timeout, self.text()
            time.sleep(0.2)

    def close(self) -> None:
        servers = children(self.process.pid)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        for pid in servers:  # a forge serve killed here leaves its tritonserver behind
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.sink.close()
        self.output.unlink(missing_ok=True)


# A tiny engine + repository for end-to-end tests: random weights, a real byte-level BPE tokenizer
# (trained here, offline) whose vocabulary includes multi-byte characters split over tokens.
TINY_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Héllo wörld, ça va? Ünïcödé!",
               "日本語のテキストと中文文本", "emoji 🙂🚀 and more emoji 🎉", "0123456789 + - * / = ( )"]


def build_tiny_tokenizer(target: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TINY_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(target))
    return target


def build_tiny_engine(workdir: Path, name: str = "tiny", max_batch_size: int = 16,
                      kv_cache_num_blocks: int = 256, max_seq_len: int = 160, seed: int = 0,
                      max_input_len: int = 64, speculative: dict | None = None,
                      spec_sections: dict | None = None) -> Path:
    """Random-weight Llama checkpoint -> engine dir (float32, CPU). Returns the engine dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from builder.pipeline.engine_builder import build_engine
    from builder.spec.load import spec_from_dict

    hf_dir = build_tiny_tokenizer(workdir / f"{name}-hf")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    eos = [tokenizer.convert_tokens_to_ids("</s>"), tokenizer.convert_tokens_to_ids("<|end|>")]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(512, max_seq_len), bos_token_id=0, eos_token_id=eos,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(hf_dir))
    spec = spec_from_dict({
        "name": name, "checkpoint": str(hf_dir), "dtype": "float32",
        "output": str(workdir / "engines" / name),
        "limits": {"max_batch_size": max_batch_size, "max_num_tokens": 256,
                   "max_input_len": max_input_len, "max_seq_len": max_seq_len},
        "kv_cache": {"tokens_per_block": 16, "num_blocks": kv_cache_num_blocks},
        "speculative": speculative or {}, **(spec_sections or {})})
    return build_engine(spec, emit_repository=False)
