"""The two generation flows, independent of HTTP: a request body becomes a `Generation` (the
prompt, the ensemble's inputs, the response envelope), whose chunks stream from Triton and become
either one response object or a sequence of stream chunks.

Admission: at most `max_concurrent_requests` requests to Triton run at once (a request with
`n` choices counts `n`); one more is refused with a 429 before anything reaches Triton, so a
burst cannot queue without bound behind the executor.

`n` choices are `n` requests to Triton, choice i with `seed + i` when the request has a seed (so
a single request with that seed reproduces choice i), all with the same prompt. Choice 0 goes
first and the others once its first token is out: by then the prompt's blocks are in the
engine's prefix cache and the others reuse them instead of computing the prompt again.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from builder.serving.openai import mapping
from builder.serving.openai.chat import ChatRenderer
from builder.serving.openai.config import OpenAIServerConfig
from builder.serving.openai.errors import OpenAIError, bad_request, busy, model_not_found
from builder.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                             SamplingRequest, check_chat, check_completion)
from builder.serving.openai.responses import (ResponseBuilder, chat_logprobs, completion_logprobs,
                                              usage)
from builder.serving.openai.structured import Guide, rename_guide_error, request_guide
from builder.serving.openai.tools import ToolPlan, parse_auto, tool_calls
from builder.serving.openai.triton import Chunk, TritonBackend

SEED_LIMIT = 2 ** 64


@dataclass
class Generation:
    """One accepted request: what to send to Triton and how to answer."""

    request: SamplingRequest
    values: dict[str, object]
    prompt_field: str  # the OpenAI field `text_input` errors are about
    log_probs: bool
    builder: ResponseBuilder
    guide: Guide | None = None
    top_logprobs: int = 0  # alternatives per token (chat top_logprobs, completions logprobs)
    tools: ToolPlan | None = None

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def n(self) -> int:
        return self.request.n or 1

    def choice_values(self, index: int) -> dict[str, object]:
        """Choice `index`'s inputs: the request's, with `seed + index` when it has a seed."""
        seed = self.values.get("seed")
        if index == 0 or seed is None:
            return self.values
        return {**self.values, "seed": (seed + index) % SEED_LIMIT}


@dataclass
class ChoiceText:
    """What one choice has gathered so far."""

    texts: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    top: list = field(default_factory=list)
    last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)
        self.ids.extend(chunk.token_ids)
        self.log_probs.extend(chunk.log_probs)
        self.top.extend(chunk.top)
        self.last = chunk

    @property
    def text(self) -> str:
        return "".join(self.texts)


def usage_of(choices: list[ChoiceText]) -> dict:
    """The prompt once, the completion tokens of every choice."""
    ended = [c.last for c in choices if c.last is not None]
    return usage(ended[0].num_input_tokens, sum(c.num_output_tokens for c in ended))


class OpenAIService:
    def __init__(self, config: OpenAIServerConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, config.add_special_tokens)
        self.backend: TritonBackend | None = None  # set once the event loop runs
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.in_flight = 0

    # -- requests -> generations --------------------------------------------------------------
    def _check_model(self, request: SamplingRequest) -> int | None:
        """The request's LoRA task id (None: the base model); an unknown name is a 404."""
        try:
            return self.config.lora_task_id(request.model)
        except KeyError:
            raise model_not_found(request.model, self.config.served_names) from None

    def _builder(self, kind: str, model: str) -> ResponseBuilder:
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return ResponseBuilder(kind, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)

    def completion(self, request: CompletionRequest) -> Generation:
        prompt = check_completion(request)  # first: a field's text may not even be text
        task_id = self._check_model(request)
        max_tokens = (mapping.COMPLETIONS_DEFAULT_MAX_TOKENS if request.max_tokens is None
                      else request.max_tokens)
        log_probs = request.logprobs is not None
        guide = request_guide(request)
        values = mapping.ensemble_values(request, prompt, max_tokens, log_probs, guide, task_id)
        self._top(values, request.logprobs or 0, "logprobs")
        return Generation(request, values, "prompt", log_probs,
                          self._builder("completion", request.model), guide, request.logprobs or 0)

    def chat(self, request: ChatCompletionRequest) -> Generation:
        tools = check_chat(request)
        task_id = self._check_model(request)
        guide = tools.guide if tools else request_guide(request)
        prompt = self.renderer.render(request.messages, tools.tools if tools else None)
        max_tokens = request.requested_max_tokens
        max_tokens = self._remaining_context(prompt) if max_tokens is None else max_tokens
        values = mapping.ensemble_values(request, prompt, max_tokens, request.logprobs, guide,
                                         task_id)
        top = request.top_logprobs or 0
        self._top(values, top, "top_logprobs")
        return Generation(request, values, "messages", request.logprobs,
                          self._builder("chat", request.model), guide, top, tools)

    def _top(self, values: dict, top: int, field: str) -> None:
        """Alternatives come from the tensorrt_llm model's own outputs: the direct path only."""
        if not top:
            return
        if self.config.triton_model != "tensorrt_llm":
            raise bad_request(field, f"{field}: alternatives are returned on the direct path only "
                                     f"(--openai-triton-model tensorrt_llm); this server sends "
                                     f"requests to {self.config.triton_model}")
        values["top_log_probs"] = top

    def _remaining_context(self, prompt: str) -> int:
        """Chat without max_tokens may use the whole context the prompt leaves (as OpenAI)."""
        limits = self.config.limits
        num_prompt = self.renderer.count_tokens(prompt, self.config.add_special_tokens)
        if num_prompt > limits.max_input_len:
            raise bad_request("messages", f"messages has {num_prompt} tokens with the chat "
                                          f"template, over the engine's max_input_len "
                                          f"{limits.max_input_len}")
        return max(1, limits.max_seq_len - num_prompt)

    # -- generations -> chunks -> responses -----------------------------------------------------
    async def chunks(self, generation: Generation) -> AsyncIterator[tuple[int, Chunk]]:
        """(choice index, chunk) from Triton for one generation; raises `OpenAIError` (429 when
        full). Closing it early cancels every choice's request in Triton."""
        n = generation.n
        if self.in_flight + n > self.config.max_concurrent_requests:
            raise busy(f"the server is busy: {self.in_flight} requests in flight, the limit is "
                       f"{self.config.max_concurrent_requests}; retry later")
        self.in_flight += n
        try:
            if n == 1:
                async for chunk in self._choice(generation, 0):
                    yield 0, chunk
            else:
                async for item in self._choices(generation):
                    yield item
        except OpenAIError as exc:
            if exc.param in ("guided_decoding_guide", "guided_decoding_guide_type"):
                raise bad_request(generation.guide.field if generation.guide else exc.param,
                                  rename_guide_error(exc.message, generation.guide)) from None
            raise
        finally:
            self.in_flight -= n

    def _choice(self, generation: Generation, index: int) -> AsyncIterator[Chunk]:
        request_id = generation.builder.id if generation.n == 1 else \
            f"{generation.builder.id}-{index}"
        return self.backend.generate(generation.choice_values(index), request_id,
                                     generation.prompt_field, generation.log_probs)

    async def _choices(self, generation: Generation) -> AsyncIterator[tuple[int, Chunk]]:
        """Every choice's chunks as they come; choice 0 first, the others from its first
        token on. The first error ends them all."""
        queue: asyncio.Queue = asyncio.Queue()
        first = asyncio.Event()
        done = object()

        async def pump(index: int) -> None:
            end: object = done
            try:
                async for chunk in self._choice(generation, index):
                    first.set()
                    queue.put_nowait((index, chunk, None))
            except Exception as exc:  # OpenAIError or a failure: the consumer raises it
                end = exc
            finally:
                first.set()
            queue.put_nowait((index, None, end))

        tasks = [asyncio.ensure_future(pump(0))]

        async def start_rest() -> None:
            await first.wait()
            tasks.extend(asyncio.ensure_future(pump(i)) for i in range(1, generation.n))

        starter = asyncio.ensure_future(start_rest())
        remaining = generation.n
        try:
            while remaining:
                index, chunk, end = await queue.get()
                if chunk is not None:
                    yield index, chunk
                    continue
                remaining -= 1
                if end is not done:
                    raise end
        finally:
            starter.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(starter, *tasks, return_exceptions=True)

    def token_text(self, token_id: int) -> str:
        """The text a token adds to the answer: a special token (the end token) adds none
        when the repository skips special tokens, so its log-prob entry has an empty `token`
        (the entry stays: `usage` counts the token, and its log prob is the model's confidence
        in stopping). The entries' texts then join into the answer exactly."""
        if self.config.skip_special_tokens and token_id in self._special_ids:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs(self, generation: Generation, chunk_ids: list[int], chunk_log_probs: list[float],
                 text_offset: int, top: list | None = None) -> dict | None:
        if not generation.log_probs:
            return None
        if generation.builder.kind == "chat":
            return chat_logprobs(chunk_ids, chunk_log_probs, self.token_text, top)
        return completion_logprobs(chunk_ids, chunk_log_probs, self.token_text, text_offset, top)

    async def respond(self, generation: Generation,
                      chunks: AsyncIterator[tuple[int, Chunk]]) -> dict:
        """Gather every chunk into the non-streamed response."""
        choices = [ChoiceText() for _ in range(generation.n)]
        async for index, chunk in chunks:
            choices[index].add(chunk)
        return generation.builder.full([self.choice(generation, i, c)
                                        for i, c in enumerate(choices)], usage_of(choices))

    def choice(self, generation: Generation, index: int, gathered: ChoiceText) -> dict:
        """One finished choice: its text, or its tool calls when tools were asked for and the
        answer is a whole call."""
        reason = mapping.finish_reason(gathered.last.finish_reason)
        content, calls = answer(generation.tools, gathered.text, reason)
        logprobs = self.logprobs(generation, gathered.ids, gathered.log_probs, 0, gathered.top)
        return generation.builder.choice(index, content, "tool_calls" if calls else reason,
                                         logprobs, calls)


def answer(plan: ToolPlan | None, text: str, reason: str) -> tuple[str | None, list | None]:
    """(content, tool calls) of a finished choice: its calls when tools were asked for and the
    reply is whole calls (guided: always, unless cut at max_tokens; auto: when it is calls)."""
    if plan is None or reason != "stop":
        return text, None
    if plan.auto:
        return parse_auto(plan, text)
    calls = tool_calls(plan, text)
    return (None, calls) if calls else (text, None)
