"""The naive baseline: `transformers` `generate`, one request at a time, behind the same verbs as
the llm-forge Executor. It is what many deployments start from (an HF pipeline behind a web
server) and what `forge bench --compare` measures our engine against, through the same Triton.
"""
from triton_backend.naive.executor import NaiveExecutor

__all__ = ["NaiveExecutor"]
