"""Speculative decoding: drafting (`ngram`, `draft_model`), the engine-side policy
(`speculator`) and verification against the target's logits (`verifier`)."""
from __future__ import annotations

from pathlib import Path

from triton_backend.engine.config import EngineConfig
from triton_backend.engine.progress import Progress
from triton_backend.engine.speculative.speculator import Speculator


def make_speculator(engine_dir: Path, config: EngineConfig, device: str,
                    progress: Progress | None = None) -> Speculator:
    """`progress`: the engine's progress count, which a draft model advances per layer."""
    spec = config.speculative
    if spec.mode == "ngram":
        from triton_backend.engine.speculative.ngram import NgramProposer

        return Speculator(spec, NgramProposer(spec.num_draft_tokens, spec.prompt_lookup_min,
                                              spec.prompt_lookup_max))
    if spec.mode == "draft_model":
        from triton_backend.engine.speculative.draft_model import DraftModelProposer

        return Speculator(spec, DraftModelProposer(engine_dir, config, device, progress))
    raise ValueError(f"speculative.mode {spec.mode!r} has no proposer")
