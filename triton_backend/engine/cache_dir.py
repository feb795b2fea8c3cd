"""Where llm-forge keeps what it makes once per machine: converted checkpoints, built kernels."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`LLM_FORGE_CACHE`, else `~/.cache/llm-forge`."""
    return Path(os.environ.get("LLM_FORGE_CACHE", Path.home() / ".cache" / "llm-forge"))
