"""Tiny LoRA adapters trained with peft on the tiny checkpoints, and engines built with them.
Shared by the LoRA test modules (import it as `lora_helpers`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

import tiny

# name -> (target modules, r, lora_alpha, seed): A adapts every projection, B only some (so
# the fused QKV and gate/up hold zero blocks for the parts it leaves alone).
ADAPTERS = {
    "adapter-a": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  8, 16, 1),
    "adapter-b": (["q_proj", "v_proj", "down_proj"], 4, 8, 2),
}


def train_adapter(hf_dir: Path, out_dir: Path, target_modules: list[str], r: int, alpha: int,
                  seed: int, steps: int = 12) -> Path:
    """A PEFT LoRA adapter trained a few steps on random tokens (peft starts B at zero: the
    training is what makes the adapter change the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                            target_modules=target_modules, task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=3e-2)
    generator = torch.Generator().manual_seed(seed)
    vocab = base.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(3, vocab, (4, 24), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(str(out_dir))
    return out_dir


def make_adapters(tmp: Path, shape: str = "llama_gqa") -> tuple[Path, dict[str, Path]]:
    """The tiny checkpoint of `shape` and the ADAPTERS trained on it."""
    hf_dir = tiny.make_checkpoint(tmp / f"hf-{shape}", shape)
    adapters = {name: train_adapter(hf_dir, tmp / f"peft-{name}", *spec)
                for name, spec in ADAPTERS.items()}
    return hf_dir, adapters


def build_lora_engine(tmp: Path, adapters: dict[str, Path], dtype: str = "float32",
                      repository: bool = False, lora: dict | None = None, **spec) -> Path:
    """An engine of the llama_gqa tiny checkpoint with `adapters` built in (`lora`: more keys
    of the lora section, `spec`: other spec sections)."""
    section = {"adapters": {name: str(path) for name, path in adapters.items()}, **(lora or {})}
    return tiny.build_engine(tmp, "llama_gqa", dtype=dtype, repository=repository, lora=section,
                             **spec)


def merged_model(hf_dir: Path, adapter_dir: Path):
    """peft's reference: the base with the adapter merged into its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Argmax continuation by full forwards; unlike `generate(min_new_tokens=...)` it does not
    mask the EOS id, as our requests with `ignore_eos` do not."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def copy_adapter(source: Path, target: Path, config_changes: dict | None = None,
                 edit_weights=None) -> Path:
    """A copy of a PEFT adapter directory with its config changed and/or its weights edited
    (`edit_weights(state)` changes the dict in place)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    if config_changes:
        path = target / "adapter_config.json"
        config = json.loads(path.read_text())
        config.update(config_changes)
        path.write_text(json.dumps(config))
    if edit_weights is not None:
        path = target / "adapter_model.safetensors"
        state = load_file(str(path))
        edit_weights(state)
        save_file(state, str(path), metadata={"format": "pt"})
    return target


def ids_inputs(prompt: list[int], new_tokens: int, task_id: int | None = None,
               weights: np.ndarray | None = None, config: np.ndarray | None = None) -> dict:
    """`tensorrt_llm` inputs of one streamed request of exactly `new_tokens` tokens, on the
    adapter `task_id` (None: the base), optionally carrying the adapter's NVIDIA tensors."""
    inputs = {"input_ids": np.array([prompt], np.int32),
              "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[new_tokens]], np.int32),
              "min_tokens": np.array([[new_tokens]], np.int32),
              "streaming": np.array([[True]])}
    if task_id is not None:
        inputs["lora_task_id"] = np.array([[task_id]], np.uint64)
    if weights is not None:
        inputs["lora_weights"], inputs["lora_config"] = weights[None], config[None]
    return inputs
