"""Build-time checks of a draft engine for speculative decoding (`speculative.mode: draft_model`).

The target proposes nothing itself: it runs the draft engine beside it at serving time, so the
draft must be a torch engine whose tokenizer is the target's (the same ids mean the same text)
and whose vocabulary fits the target's logits. The path is stored relative to the engine
directory when the two share a parent, so the pair can be moved together.
"""
from __future__ import annotations

import os
from pathlib import Path

from triton_backend.engine.config import EngineConfig


def check_draft_engine(config: EngineConfig, staged_dir: Path, engine_dir: Path) -> str:
    """Validate `config.speculative.draft_engine` against the target whose tokenizer is staged in
    `staged_dir` (to become `engine_dir`); rewrite it as the runtime will resolve it."""
    draft_dir = Path(config.speculative.draft_engine).resolve()
    try:
        draft = EngineConfig.load(draft_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"speculative.draft_engine: {exc}") from None
    if draft.target != "torch":
        raise ValueError(f"speculative.draft_engine: {draft_dir} is a {draft.target!r} engine; "
                         f"the draft must be a torch engine")
    if draft.model.vocab_size > config.model.vocab_size:
        raise ValueError(f"speculative.draft_engine: the draft's vocab_size "
                         f"{draft.model.vocab_size} exceeds the target's {config.model.vocab_size}")
    if _vocab(draft_dir / draft.tokenizer.dir) != _vocab(staged_dir / config.tokenizer.dir):
        raise ValueError(f"speculative.draft_engine: {draft_dir} has another tokenizer than the "
                         f"target; a draft must share the target's tokenizer")
    common = Path(os.path.commonpath([draft_dir, engine_dir.resolve()]))
    config.speculative.draft_engine = (str(draft_dir) if common == Path(common.anchor)
                                       else os.path.relpath(draft_dir, engine_dir.resolve()))
    return (f"draft engine {draft.name} ({draft.model.num_hidden_layers} layers), "
            f"{config.speculative.num_draft_tokens} draft tokens per step")


def _vocab(tokenizer_dir: Path) -> dict:
    """Token -> id, with the special tokens, as the tokenizer files define them."""
    from transformers import AutoTokenizer

    if not tokenizer_dir.is_dir():
        raise ValueError(f"speculative.draft_engine: no tokenizer at {tokenizer_dir}")
    return AutoTokenizer.from_pretrained(str(tokenizer_dir)).get_vocab()
