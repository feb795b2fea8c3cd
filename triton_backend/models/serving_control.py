"""Requests `forge serve` sends the `tensorrt_llm` model to supervise it, and what it answers.

Both are `stop` requests (NVIDIA's cancellation convention), so they never reach the engine:

- the health probe (`PROBE_REQUEST_ID`): an empty final response while the model can serve,
  the `ENGINE_RESTARTING` error while its engine process is restarted in place (after a crash or
  a freeze: alive, not ready; no reload is needed), the `ENGINE_DOWN` error once its engine is
  down for good;
- the drain (`drain_request_id(token)`, with the per-launch secret the launcher puts in the
  server's environment, `CONTROL_TOKEN_ENV`, so no client can drain the server by sending a
  known id; without the secret there is no drain request): from then on new requests are
  refused with `DRAIN_REFUSED`;
  requests in flight may finish until the drain timeout (`DRAIN_SECONDS_ENV`, which the launcher
  sets from `forge serve --drain-timeout`), then are cancelled in the engine and end with the
  `DRAIN_CUT` error, which says to send them again (not a `cancelled` finish a client cannot
  tell from its own cancel). The tokens the engine made before the cut go out first. The BLS
  gets the error as a final response carrying `error_message` (an error response sent to a BLS
  request's stream after it has streamed never reaches the BLS in Triton 2.51's Python
  backend), and sends it on to its client as an error. The ensemble's step alone still ends
  with its final response, finish reason `cancelled`: Triton 2.51's ensemble never completes a
  request one of whose steps sends an error after streaming (measured: the ensemble and
  postprocessing then never unload, and tritonserver waits out its exit timeout), so forge
  serve's OpenAI API reads `cancelled` during the drain as the drain error.
"""
from __future__ import annotations

import hmac
import os

PROBE_REQUEST_ID = "forge-serve-health-probe"
DRAIN_REQUEST_ID = "forge-serve-drain"
DRAIN_SECONDS_ENV = "LLM_FORGE_DRAIN_SECONDS"
CONTROL_TOKEN_ENV = "LLM_FORGE_CONTROL_TOKEN"
DEFAULT_DRAIN_SECONDS = 30.0

ENGINE_DOWN = "tensorrt_llm: the engine is down ({reason})"
ENGINE_RESTARTING = "tensorrt_llm: the engine is restarting ({reason})"
DRAIN_REFUSED = "the server is shutting down: new requests are refused (draining)"
# A request still running at the drain timeout: retryable, as a refused one is (another replica
# serves it; this one left the Service when the drain began).
DRAIN_CUT = ("the server is draining: the drain timeout ({seconds:g} s) expired before this "
             "request finished; send it again")

# A `stop` request's inputs, one value each (NVIDIA's clients send the same): the required
# inputs with placeholder values and `stop: true`. The BLS sends it in-process to cancel a
# request by id (`triton_io.stop_request`), `forge serve` over HTTP to probe and drain.
STOP_REQUEST_INPUTS = {"input_ids": 0, "input_lengths": 1, "request_output_len": 1, "stop": True}


def drain_seconds() -> float:
    """The drain timeout the server was started with (the default when unset or unreadable)."""
    try:
        value = float(os.environ.get(DRAIN_SECONDS_ENV, DEFAULT_DRAIN_SECONDS))
    except ValueError:
        return DEFAULT_DRAIN_SECONDS
    return value if value >= 0 else DEFAULT_DRAIN_SECONDS


def drain_request_id(token: str) -> str:
    """The id of the drain request for a server launched with secret `token`."""
    return f"{DRAIN_REQUEST_ID}-{token}"


def is_drain_request(request_id: str) -> bool:
    """True for the drain request of this server's launcher (never when it set no secret)."""
    token = os.environ.get(CONTROL_TOKEN_ENV, "")
    return bool(token) and hmac.compare_digest(request_id.encode(),
                                               drain_request_id(token).encode())
