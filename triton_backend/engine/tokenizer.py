"""The engine's tokenizer (from `<engine>/tokenizer/`) and how prompts become ids."""
from __future__ import annotations

from pathlib import Path

from triton_backend.engine.config import EngineConfig


def load_tokenizer(engine_dir: str | Path, config: EngineConfig | None = None):
    from transformers import AutoTokenizer

    config = config or EngineConfig.load(engine_dir)
    return AutoTokenizer.from_pretrained(str(Path(engine_dir) / config.tokenizer.dir))


def encode_prompt(tokenizer, text: str, use_chat_template: bool) -> list[int]:
    """Token ids for `text`: as a user turn of the chat template when asked and available."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(text, add_special_tokens=True)
