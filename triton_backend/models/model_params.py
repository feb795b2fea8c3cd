"""Reading the `parameters` of a model's config.pbtxt (as the Python backend hands them over)."""
from __future__ import annotations

import json
import os
from pathlib import Path


class ModelParams:
    """String parameters of one model; paths resolve relative to the repository directory."""

    def __init__(self, args: dict):
        self.config = json.loads(args["model_config"])
        self.model_dir = Path(args["model_repository"].rstrip("/"))
        raw = self.config.get("parameters", {})
        self._values = {key: value.get("string_value", "") for key, value in raw.items()}

    @property
    def decoupled(self) -> bool:
        return bool(self.config.get("model_transaction_policy", {}).get("decoupled", False))

    def text(self, key: str, default: str = "") -> str:
        return self._values.get(key, default)

    def path(self, key: str) -> Path:
        value = self._values.get(key, "")
        if not value:
            raise ValueError(f"{self.model_dir.name}/config.pbtxt: parameter {key} is empty")
        return Path(os.path.normpath(self.model_dir.parent / value))

    def integer(self, key: str, default: int | None = None) -> int | None:
        value = self._values.get(key, "")
        return default if value == "" else int(value)

    def number(self, key: str, default: float | None) -> float | None:
        value = self._values.get(key, "")
        return default if value == "" else float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._values.get(key, "").strip().lower()
        if value == "":
            return default
        if value not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{self.model_dir.name}/config.pbtxt: parameter {key} must be "
                             f"true or false, got {value!r}")
        return value in ("true", "1", "yes")
