"""What the OpenAI endpoint needs to know: where Triton is, which model to call, the served
model's name, tokenizer and limits. `from_repository` reads it all from an emitted repository
(the preprocessing model's parameters name the engine and its tokenizer)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from builder.repository.target import repository_parameters
from triton_backend.engine.config import EngineConfig, Limits

# tensorrt_llm: token ids, tokenized and detokenized by the endpoint (direct.py); the fewest
# Python-backend calls per streamed token. ensemble / tensorrt_llm_bls: text.
TRITON_MODELS = ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class OpenAIServerConfig:
    """`port` 0 picks a free port. `max_concurrent_requests` bounds the requests in flight
    (more get 429); `request_timeout_s` bounds one request's whole generation."""

    triton_grpc_url: str
    model_name: str
    tokenizer_dir: Path
    limits: Limits
    triton_model: str = "tensorrt_llm"
    host: str = LOOPBACK
    port: int = 0
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    max_concurrent_requests: int = 256
    request_timeout_s: float = 3600.0
    api_key: str | None = None  # clients of /v1/* must send it as a bearer token
    # The engine's LoRA adapters as (model name, lora_task_id): each is a model of its own in
    # /v1/models (parent: model_name), chosen by the request's `model`, as vLLM serves them.
    adapters: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.triton_model not in TRITON_MODELS:
            raise ValueError(f"triton_model must be one of {list(TRITON_MODELS)}, "
                             f"got {self.triton_model!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 <= self.port <= 65535:
            raise ValueError(f"openai port must be an integer in 0..65535, got {self.port!r}")
        if isinstance(self.max_concurrent_requests, bool) or \
                not isinstance(self.max_concurrent_requests, int) or \
                self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be an integer >= 1, "
                             f"got {self.max_concurrent_requests!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it out to serve without one)")
        if not self.model_name:
            raise ValueError("model_name must not be empty")
        names = [name for name, _ in self.adapters]
        if self.model_name in names or len(set(names)) != len(names):
            raise ValueError(f"adapters: names must be unique and differ from the model's "
                             f"{self.model_name!r}, got {names}")
        if not Path(self.tokenizer_dir).is_dir():
            raise ValueError(f"tokenizer_dir {self.tokenizer_dir}: no such directory")

    @property
    def served_names(self) -> list[str]:
        return [self.model_name] + [name for name, _ in self.adapters]

    def lora_task_id(self, model: str) -> int | None:
        """The task id of adapter `model`; None for the base model. KeyError: not served."""
        if model == self.model_name:
            return None
        return dict(self.adapters)[model]

    @classmethod
    def from_repository(cls, repository_dir: str | Path, triton_grpc_url: str,
                        **options) -> "OpenAIServerConfig":
        """Engine, tokenizer, limits and name of the repository's engine."""
        repository_dir = Path(repository_dir)
        params = repository_parameters(repository_dir, "preprocessing")

        def path(key: str) -> Path:  # relative to the repository, as the models resolve them
            return Path(os.path.normpath(repository_dir / params[key]))

        config = EngineConfig.load(path("engine_dir"))
        add_special_tokens = params.get("add_special_tokens", "true").lower() in ("true", "1")
        post = repository_parameters(repository_dir, "postprocessing")
        skip_special_tokens = post.get("skip_special_tokens", "true").lower() in ("true", "1")
        adapters = tuple((a.name, a.task_id) for a in config.lora.adapters) if config.lora else ()
        options.setdefault("adapters", adapters)
        return cls(triton_grpc_url=triton_grpc_url, model_name=config.name,
                   tokenizer_dir=path("tokenizer_dir"), limits=config.limits,
                   add_special_tokens=add_special_tokens,
                   skip_special_tokens=skip_special_tokens, **options)
