"""The request bodies of `/v1/completions` and `/v1/chat/completions` (pydantic models).

Types and ranges are checked by pydantic (a failure becomes a 400 naming the field, see
`validation_error`); `check_request` refuses what we cannot honour instead of ignoring it. Fields
OpenAI clients send that do not change the output (`user`, `metadata`, ...) are accepted and
ignored. Sampling fields left out take the repository's defaults (greedy unless the repository
says otherwise), not OpenAI's temperature 1.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from builder.serving.openai.errors import OpenAIError, bad_request
from builder.serving.openai.structured import request_guide
from builder.serving.openai.tools import ToolPlan, tool_plan

FiniteFloat = dict(allow_inf_nan=False)
UINT64_LIMIT = 2 ** 64
MAX_CHOICES = 16  # `n`: choices per request (each one a request to the engine)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None  # the engine's output-length rule checks it, at the hop
    temperature: float | None = Field(None, ge=0.0, le=2.0, **FiniteFloat)
    top_p: float | None = Field(None, gt=0.0, le=1.0, **FiniteFloat)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=UINT64_LIMIT)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, **FiniteFloat)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, **FiniteFloat)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extensions vLLM accepts too; `min_tokens` == `max_tokens` is how benchmarks fix lengths.
    top_k: int | None = Field(None, ge=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False  # generate max_tokens whatever the end-of-sequence tokens say
    repetition_penalty: float | None = Field(None, gt=0.0, **FiniteFloat)
    # Structured output (`structured.py`); vLLM's guided_* / structured_outputs arrive as extras.
    response_format: dict[str, Any] | None = None
    # Tool calling (`tools.py`) on chat; refused by name on completions, never ignored.
    tools: list[Any] | None = None
    functions: list[Any] | None = None  # the deprecated form: refused by name

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` replaces the deprecated `max_tokens` when both are sent."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


def _lone_surrogate(value: Any, path: str) -> tuple[str, str] | None:
    """The first string in `value` holding a lone UTF-16 surrogate, as (its path, the char)."""
    if isinstance(value, str):
        found = next((c for c in value if "\ud800" <= c <= "\udfff"), None)
        return (path, found) if found is not None else None
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    for item_path, item in items:
        hit = _lone_surrogate(item, item_path)
        if hit is not None:
            return hit
    return None


def check_text(request: SamplingRequest) -> None:
    """JSON may escape a lone surrogate (`"\\ud800"`), which is no Unicode text: no tokenizer can
    encode it. Refused by the field that holds it, before anything reads the text."""
    hit = _lone_surrogate(request.model_dump(exclude_none=True), "")
    if hit is not None:
        path, char = hit
        raise bad_request(path.split(".")[0].split("[")[0],
                          f"{path}: contains a lone UTF-16 surrogate ({char!a}), which is not "
                          f"valid Unicode text")


def _check_shared(request: SamplingRequest) -> None:
    check_text(request)
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise bad_request("n", f"n must be in [1, {MAX_CHOICES}], got {request.n}")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options", "stream_options: only allowed when stream is true")
    if request.logit_bias:
        raise bad_request("logit_bias", "logit_bias: not supported by this server")
    if any(not s for s in request.stop_strings()):
        raise bad_request("stop", "stop: stop strings must not be empty")
    if (request.min_tokens is not None and request.max_tokens is not None
            and request.min_tokens > request.max_tokens):
        raise bad_request("min_tokens", f"min_tokens ({request.min_tokens}) must not exceed "
                                        f"max_tokens ({request.max_tokens})")
    if request.functions:
        raise bad_request("functions", "functions: the deprecated form is not supported; send "
                                       "tools on /v1/chat/completions")
    request_guide(request)  # a 400 naming the field for a malformed constraint


def check_completion(request: CompletionRequest) -> str:
    """Refuse what we cannot honour; return the one prompt string."""
    _check_shared(request)
    if request.tools:
        raise bad_request("tools", "tools: tool calling is served on /v1/chat/completions")
    if request.echo:
        raise bad_request("echo", "echo: not supported by this server")
    if request.suffix:
        raise bad_request("suffix", "suffix: not supported by this server")
    if request.best_of not in (None, 1):
        raise bad_request("best_of", f"best_of: must be 1, got {request.best_of}")
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            what = ("token-id prompts are not supported, send text" if any(
                not isinstance(p, str) for p in prompt) else
                f"one prompt per request is supported, got {len(prompt)}")
            raise bad_request("prompt", f"prompt: {what}")
        prompt = prompt[0]
    if not prompt:
        raise bad_request("prompt", "prompt: must not be empty")
    return prompt


def check_chat(request: ChatCompletionRequest) -> ToolPlan | None:
    """Refuse what we cannot honour; return the request's tool plan (None: plain text)."""
    _check_shared(request)
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs", "top_logprobs: needs logprobs true")
    plan = tool_plan(request.tools, request.tool_choice, request.parallel_tool_calls)
    if plan is not None and request_guide(request) is not None:
        raise bad_request("tool_choice", f"tool_choice: calls are written under their own "
                                         f"schema; drop {request_guide(request).field} or "
                                         f"send tool_choice \"none\"")
    return plan


def _location(loc: tuple) -> str:
    parts = [p for p in loc if p != "body"]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (("." if text else "") + str(part))
    return text


def validation_error(errors: list[dict]) -> OpenAIError:
    """The first pydantic error as a 400 naming the field, the rule and the value sent."""
    if not errors:
        return bad_request(None, "the request body is not valid")
    error = errors[0]
    if error.get("type") == "json_invalid":
        return bad_request(None, f"the request body is not valid JSON: {error.get('msg')}")
    field = _location(tuple(error.get("loc", ()))) or None
    message = f"{field}: {error.get('msg')}" if field else str(error.get("msg"))
    if error.get("type") != "missing" and "input" in error:
        message += f", got {error['input']!r}"
    return bad_request(field, message)

