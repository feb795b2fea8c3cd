"""LoRA for the trtllm target: the `trtllm-build` flags and NVIDIA's adapter layouts.

`trtllm-build` builds the LoRA plugin in (`--lora_plugin`, `--max_lora_rank`,
`--lora_target_modules`) and reads the PEFT directories given with `--lora_dir`
(`--lora_ckpt_source hf`). NVIDIA's C++ backend caches adapters by `lora_task_id`, loaded by a
first request carrying `lora_weights` + `lora_config`: the build writes those two tensors per
adapter (`lora/<name>/model.lora_weights.npy` [1, N, W] float16 and `model.lora_config.npy`
[1, N, 3] int32, the layout of TensorRT-LLM's `hf_lora_convert.py`) for clients to send.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from builder.pipeline.lora import PEFT_CONFIG, PEFT_WEIGHTS, LoraSpec
from triton_backend.engine.config import LORA_ADAPTERS_DIR, LoraAdapterInfo, LoraConfig, ModelShape

HF_TO_TRTLLM = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                "o_proj": "attn_dense", "gate_proj": "mlp_h_to_4h", "up_proj": "mlp_gate",
                "down_proj": "mlp_4h_to_h"}


@dataclass(frozen=True)
class TrtllmLora:
    """The LoRA flags of a trtllm-build command (directories relative to the engine dir)."""

    plugin_dtype: str
    lora_dirs: tuple[str, ...]
    max_rank: int
    target_modules: tuple[str, ...]

    def arguments(self) -> list[str]:
        return ["--lora_plugin", self.plugin_dtype, "--lora_dir", *self.lora_dirs,
                "--lora_ckpt_source", "hf", "--max_lora_rank", str(self.max_rank),
                "--lora_target_modules", *self.target_modules]


def target_modules(spec: LoraSpec) -> tuple[str, ...]:
    """TensorRT-LLM names of every projection any adapter adapts, from the adapter configs
    (no weights read)."""
    found = set()
    for name, path in spec.adapter_dirs().items():
        try:
            config = json.loads((path / PEFT_CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"lora.adapters.{name}: cannot read {path / PEFT_CONFIG}: "
                             f"{exc}") from None
        targets = config.get("target_modules") or []
        if isinstance(targets, str):  # a regex: every projection whose name it matches
            import re

            targets = [m for m in HF_TO_TRTLLM if re.search(targets, f".{m}")]
        for module in targets:
            short = module.split(".")[-1]
            if short not in HF_TO_TRTLLM:
                raise ValueError(f"lora.adapters.{name}: module {module}: LoRA on it is not "
                                 f"supported (supported: {sorted(HF_TO_TRTLLM)})")
            found.add(HF_TO_TRTLLM[short])
    order = list(HF_TO_TRTLLM.values())
    return tuple(sorted(found, key=order.index))


def trtllm_lora(spec, dtype: str) -> TrtllmLora | None:
    if spec.lora is None:
        return None
    return TrtllmLora(dtype, tuple(f"{LORA_ADAPTERS_DIR}/{n}" for n in spec.lora.adapters),
                      spec.lora.max_rank, target_modules(spec.lora))


def write_trtllm_adapters(spec: LoraSpec, shape: ModelShape, engine_dir: Path,
                          log=lambda message: None) -> LoraConfig:
    """Check each adapter against the base, copy its PEFT files to `lora/<name>/` (what
    `--lora_dir` reads) beside NVIDIA's request tensors; returns the engine's `lora` section."""
    import numpy as np

    from builder.pipeline.checkpoint import sha256_file
    from builder.pipeline.lora import read_peft_adapter
    from triton_backend.engine.lora.nvidia import nvidia_tensors

    infos = []
    for task_id, (name, path) in enumerate(spec.adapter_dirs().items(), start=1):
        adapter = read_peft_adapter(name, path, shape, spec.max_rank)
        out = engine_dir / LORA_ADAPTERS_DIR / name
        out.mkdir(parents=True, exist_ok=True)
        for file_name in (PEFT_CONFIG, PEFT_WEIGHTS):
            shutil.copy2(path / file_name, out / file_name)
        weights, config = nvidia_tensors(adapter.pairs)
        np.save(out / "model.lora_weights.npy", weights.astype(np.float16)[None])
        np.save(out / "model.lora_config.npy", config.astype(np.int32)[None])
        infos.append(LoraAdapterInfo(
            name=name, task_id=task_id, file=f"{LORA_ADAPTERS_DIR}/{name}", rank=adapter.rank,
            sha256=sha256_file(out / "model.lora_weights.npy"),
            target_modules=adapter.target_modules, source=str(path)))
        log(f"adapter {name}: rank {adapter.rank}, {', '.join(adapter.target_modules)}; "
            f"NVIDIA lora_weights {tuple(weights.shape)}, lora_config {tuple(config.shape)}")
    return LoraConfig(spec.max_rank, spec.max_loras, spec.max_cpu_loras, infos)
