"""Calibration and evaluation text: the shipped public-domain files or the user's own.

A dataset is `builtin` (builder/data/calibration.txt), `builtin:heldout` (builder/data/heldout.txt,
used only for evaluation, never for calibration), or a path: `.txt` (paragraphs separated by blank
lines) or `.jsonl` (one object per line with a `text` field).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from builder.quantize.options import CalibrationOptions

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUILTIN = {"builtin": DATA_DIR / "calibration.txt", "builtin:heldout": DATA_DIR / "heldout.txt"}


def dataset_path(dataset: str) -> Path:
    """The file behind a dataset name; a FileNotFoundError names it when absent."""
    path = BUILTIN.get(dataset, Path(dataset))
    if not path.is_file():
        raise FileNotFoundError(f"quantization.calibration.dataset: {dataset!r} is not a file")
    return path


def load_texts(dataset: str) -> list[str]:
    """The dataset's documents, in file order, with empty ones dropped."""
    path = dataset_path(dataset)
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(str(json.loads(line)["text"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: expected a JSON object with a 'text' field")
        return [t for t in texts if t.strip()]
    if path.suffix not in (".txt", ""):
        raise ValueError(f"{path}: calibration data must be .txt or .jsonl")
    paragraphs = path.read_text(encoding="utf-8").split("\n\n")
    return [" ".join(p.split()) for p in paragraphs if p.strip()]


def token_windows(tokenizer, texts: list[str], samples: int, seq_len: int,
                  purpose: str = "calibration",
                  setting: str = "quantization.calibration.seq_len") -> torch.Tensor:
    """Concatenate the documents (separated by EOS when the tokenizer has one) and cut the token
    stream into `samples` windows of `seq_len` tokens -> LongTensor [n, seq_len], n <= samples.

    Raises ValueError naming what the text is for (`purpose`), the minimum and the spec setting
    that sets it when the text does not fill even one window.
    """
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text, add_special_tokens=False) + separator)
        if len(stream) >= samples * seq_len:
            break
    count = min(samples, len(stream) // seq_len)
    if count == 0:
        raise ValueError(f"{purpose} text has {len(stream)} tokens, fewer than one window of "
                         f"{seq_len} tokens ({setting})")
    return torch.tensor(stream[:count * seq_len], dtype=torch.long).reshape(count, seq_len)


def windows(tokenizer, options: CalibrationOptions) -> torch.Tensor:
    """The windows a spec's `quantization.calibration` asks for (`token_windows` over its
    dataset)."""
    return token_windows(tokenizer, load_texts(options.dataset), options.samples,
                         options.seq_len)


def record(options: CalibrationOptions, samples: int, seconds: float) -> dict:
    """What an engine's config records of a calibration: its text, windows and time."""
    return {"dataset": options.dataset, "samples": samples, "seq_len": options.seq_len,
            "seconds": round(seconds, 1)}
