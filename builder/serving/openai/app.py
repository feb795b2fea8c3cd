"""The FastAPI application: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, `/health`.

Every error, whatever raised it, leaves as OpenAI's JSON error shape. A request whose HTTP client
disconnects is cancelled in Triton: streamed ones when the stream stops being read, others (and
streams still waiting for their first token) through a watcher of the ASGI disconnect message.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from builder.serving.openai.config import OpenAIServerConfig
from builder.serving.openai.direct import TextCodec
from builder.serving.openai.errors import (RETRY_AFTER_SECONDS, OpenAIError, internal,
                                           model_not_found, not_ready, unauthorized)
from builder.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                             validation_error)
from builder.serving.openai.service import Generation, OpenAIService
from builder.serving.openai.streaming import sse_events
from builder.serving.openai.triton import TritonBackend

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


def error_response(error: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _answer(service: OpenAIService, generation: Generation, request: Request):
    chunks = service.chunks(generation)
    try:
        if not generation.stream:
            return JSONResponse(await until_disconnect(request,
                                                       service.respond(generation, chunks)))
        # The first chunk is awaited before answering, so refusals keep their HTTP status.
        first = await until_disconnect(request, chunks.__anext__())
    except ClientGone:
        await chunks.aclose()
        return JSONResponse({}, status_code=499)  # nobody reads it; for the access log
    except BaseException:
        await chunks.aclose()
        raise
    return StreamingResponse(sse_events(service, generation, first, chunks),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """Every /v1/* request must carry `Authorization: Bearer <api_key>` (compared in constant
    time); /health stays open for load balancers, as in vLLM."""
    expected = api_key.encode()

    @app.middleware("http")
    async def _check_key(request: Request, call_next):
        if request.url.path.startswith("/v1"):
            header = request.headers.get("authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                     expected):
                return error_response(unauthorized(bool(header)))
        return await call_next(request)


def _install_error_handlers(app: FastAPI) -> None:
    """Whatever fails, the client gets OpenAI's error shape (and the server keeps serving)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return error_response(OpenAIError(exc.status_code, f"{request.method} "
                                          f"{request.url.path}: {exc.detail}"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(internal(f"{type(exc).__name__}: {exc}"))


def create_app(config: OpenAIServerConfig) -> FastAPI:
    from transformers import AutoTokenizer

    service = OpenAIService(config, AutoTokenizer.from_pretrained(str(config.tokenizer_dir)))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        codec = TextCodec(service.tokenizer, config.limits, config.add_special_tokens,
                          config.skip_special_tokens)
        service.backend = TritonBackend(config.triton_grpc_url, config.triton_model,
                                        config.request_timeout_s, codec)
        try:
            yield
        finally:
            await service.backend.close()

    # With a key, the API description is off: /docs and /openapi.json would answer anyone.
    described = config.api_key is None
    app = FastAPI(title="llm-forge OpenAI-compatible API", lifespan=lifespan,
                  docs_url="/docs" if described else None,
                  redoc_url="/redoc" if described else None,
                  openapi_url="/openapi.json" if described else None)
    app.state.service = service
    _install_error_handlers(app)
    if config.api_key is not None:
        _require_api_key(app, config.api_key)
    created = int(time.time())
    cards = {config.model_name: {"id": config.model_name, "object": "model", "created": created,
                                 "owned_by": "llm-forge", "root": config.model_name,
                                 "parent": None}}
    for name, _ in config.adapters:  # LoRA adapters, as vLLM lists them
        cards[name] = {"id": name, "object": "model", "created": created,
                       "owned_by": "llm-forge", "root": name, "parent": config.model_name}

    @app.get("/health")
    async def health():
        if not await service.backend.is_ready():
            return error_response(not_ready(f"Triton model {config.triton_model!r} at "
                                            f"{config.triton_grpc_url} is not ready"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": list(cards.values())}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        if model_id not in cards:
            raise model_not_found(model_id, config.served_names)
        return cards[model_id]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(service, service.completion(body), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _answer(service, service.chat(body), request)

    return app
