"""Server-sent events of one streamed generation: OpenAI chunks, `data: [DONE]` at the end.

Chat streams open with the assistant role, then the content deltas; the chunk of the last
Triton response carries the finish reason; every response that carries tokens is a chunk, its
text empty while the bytes of a character are not all there yet (vLLM's stream does the same,
so a client counts tokens and inter-token times alike on both); with
`stream_options.include_usage` every chunk has `usage: null` and a last chunk without choices
carries the counts. With `n` choices each chunk
names its choice's `index` (each chat choice opens with its role) and chunks of different
choices interleave as they come. With tools, a choice's text is held until it ends (with `auto`
only while it may be a call: empty, or starting with `{`, `[` or `<`; a reply that starts as
text streams from there on): then one chunk carries its whole `tool_calls` (or, for an answer
that is not calls, the text) and the finish reason. An error after the first event (headers are sent by then) becomes an `error`
event, which the official client raises.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from builder.serving.openai import mapping
from builder.serving.openai.errors import OpenAIError, internal
from builder.serving.openai.service import ChoiceText, Generation, OpenAIService, answer, usage_of
from builder.serving.openai.triton import Chunk

DONE = "data: [DONE]\n\n"


def event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _with_first(first: tuple[int, Chunk],
                      rest: AsyncIterator[tuple[int, Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    yield first
    async for item in rest:
        yield item


def _tool_events(service: OpenAIService, generation: Generation, index: int,
                 gathered: ChoiceText, reason: str, include_usage: bool) -> list[str]:
    """A tool-calling choice at its end: its content, if any, its calls and its finish
    reason."""
    builder = generation.builder
    content, calls = answer(generation.tools, gathered.text, reason)
    logprobs = service.logprobs(generation, gathered.ids, gathered.log_probs, 0, gathered.top)
    if calls is None:
        return [event(builder.chunk(content, reason, logprobs, include_usage, index=index))]
    events = [event(builder.chunk(content, None, None, include_usage, index=index))] \
        if content else []
    deltas = [{"index": i, **call} for i, call in enumerate(calls)]
    return events + [event(builder.chunk(None, None, logprobs, include_usage, index=index,
                                         tool_calls=deltas)),
                     event(builder.chunk(None, "tool_calls", None, include_usage, index=index))]


def _held(generation: Generation, gathered: ChoiceText, released: bool) -> bool:
    """Whether a tool-calling choice's text waits for its end: always under a guide; with
    `auto` while the reply may still be a call (it is empty, or starts like one)."""
    if generation.tools is None or released:
        return False
    if not generation.tools.auto:
        return True
    head = gathered.text.lstrip()
    return not head or head[0] in "{[<"


async def sse_events(service: OpenAIService, generation: Generation, first: tuple[int, Chunk],
                     rest: AsyncIterator[tuple[int, Chunk]]) -> AsyncIterator[str]:
    """Every event of the stream. Closing it early (client gone) closes `rest`, which cancels
    the request in Triton."""
    builder, include_usage = generation.builder, generation.request.include_usage
    choices = [ChoiceText() for _ in range(generation.n)]
    offsets = [0] * generation.n
    released = [False] * generation.n  # an `auto` reply that turned out to be text
    if builder.kind == "chat":
        for index in range(generation.n):
            yield event(builder.chunk("", None, None, include_usage, role="assistant",
                                      index=index))
    try:
        async for index, chunk in _with_first(first, rest):
            gathered = choices[index]
            gathered.add(chunk)
            reason = mapping.finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            if _held(generation, gathered, released[index]):
                if reason:
                    for text in _tool_events(service, generation, index, gathered, reason,
                                             include_usage):
                        yield text
                continue
            if generation.tools is not None and not released[index]:
                released[index] = True  # what was held goes out as this chunk
                chunk = Chunk(gathered.text, chunk.finish_reason, chunk.num_input_tokens,
                              chunk.num_output_tokens, gathered.log_probs, gathered.ids,
                              gathered.top)
            if not (chunk.text or reason or chunk.token_ids):
                continue  # no token and no end (the ensemble path does not send ids)
            logprobs = service.logprobs(generation, chunk.token_ids, chunk.log_probs,
                                        offsets[index], chunk.top)
            offsets[index] += len(chunk.text)
            text = chunk.text if (chunk.text or builder.kind != "chat") else None
            yield event(builder.chunk(text, reason, logprobs, include_usage, index=index))
    except OpenAIError as exc:
        yield event(exc.body())
        yield DONE
        return
    except Exception as exc:  # never leave a stream without its end
        yield event(internal(f"stream failed: {type(exc).__name__}: {exc}").body())
        yield DONE
        return
    finally:
        await rest.aclose()
    if include_usage:
        yield event(builder.usage_chunk(usage_of(choices)))
    yield DONE
