"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status
the official client maps to its exception classes (400 BadRequestError, 404 NotFoundError, 429
RateLimitError, 503 InternalServerError after its retries: a 503 says Retry-After).

Triton's per-request errors name the ensemble's input (`text_input has 100 tokens, over the
engine's max_input_len 64`); `from_triton` renames that input to the OpenAI field the client
sent, so a message always names what the caller can change.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Ensemble inputs (and the tensorrt_llm names that appear in their messages) -> OpenAI fields.
# "text_input" is the prompt: `prompt` for completions, `messages` for chat.
TRITON_FIELDS = {
    "request_output_len (max_tokens)": "max_tokens", "max_tokens": "max_tokens",
    "runtime_top_p (top_p)": "top_p", "runtime_top_k (top_k)": "top_k", "top_p": "top_p",
    "top_k": "top_k", "temperature": "temperature", "stop_words": "stop", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
    # renamed again to the field the guide came from (`structured.rename_guide_error`)
    "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
}
# Triton's full queue, and the tensorrt_llm model's admission limits ("server busy: ...").
BUSY_MARKERS = ("Exceeds maximum queue size", "max_queue_size", "server busy")
DRAINING_MARKER = "draining"  # the tensorrt_llm model's drain errors (serving_control.py)
RETRY_AFTER_SECONDS = 1  # on a 503: the next replica, or this one back from a restart
NOT_READY_MARKERS = ("unknown model", "is not ready", "is not found", "shutting down",
                     "Server not ready")
ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")  # Triton's prefix on a step's error


@dataclass
class OpenAIError(Exception):
    """An error answered to the client; `param` names the request field at fault."""

    status: int
    message: str
    param: str | None = None
    type: str = "invalid_request_error"
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(param: str | None, message: str) -> OpenAIError:
    """400 for a field the client must change; the message starts with the field's name."""
    return OpenAIError(400, message, param)


def unauthorized(given: bool) -> OpenAIError:
    """401 as OpenAI answers a missing or wrong key (the key itself is never echoed)."""
    message = ("Incorrect API key provided" if given else
               "You didn't provide an API key: send it as 'Authorization: Bearer KEY'")
    return OpenAIError(401, message, type="invalid_request_error", code="invalid_api_key")


def model_not_found(name: str, served: str | list[str]) -> OpenAIError:
    served = ", ".join(repr(s) for s in served) if isinstance(served, list) else repr(served)
    return OpenAIError(404, f"model: the model {name!r} does not exist; this server serves "
                            f"{served}", "model", code="model_not_found")


def busy(message: str) -> OpenAIError:
    return OpenAIError(429, message, type="rate_limit_error", code="rate_limit_exceeded")


def not_ready(message: str) -> OpenAIError:
    return OpenAIError(503, message, type="server_error", code="service_unavailable")


def draining(message: str) -> OpenAIError:
    """The server is shutting down: a request refused, or cut at the drain timeout. Retryable:
    another replica serves it (this one has left the Service). Non-streamed, a 503 with
    Retry-After, which the official client retries; in a stream, the error event says so."""
    return OpenAIError(503, message, type="server_error", code="service_unavailable")


def internal(message: str) -> OpenAIError:
    return OpenAIError(500, message, type="server_error", code="internal_error")


def from_triton(message: str, prompt_field: str) -> OpenAIError:
    """Classify an error response of the ensemble and name the OpenAI field it is about."""
    message = ENSEMBLE_PREFIX.sub("", message)
    if DRAINING_MARKER in message:
        return draining(message)
    if any(marker in message for marker in BUSY_MARKERS):
        return busy(f"the server is busy: {message.removeprefix('server busy: ')}; retry later")
    if any(marker in message for marker in NOT_READY_MARKERS):
        return not_ready(f"the model is not ready: {message}")
    if message.startswith("text_input"):
        return bad_request(prompt_field, prompt_field + message[len("text_input"):])
    if message.startswith("apply_chat_template"):
        return bad_request(prompt_field, message)
    for triton_name, field in TRITON_FIELDS.items():
        if message.startswith(triton_name + " ") or message.startswith(triton_name + ":"):
            return bad_request(field, field + message[len(triton_name):])
    return internal(f"inference failed: {message}")
