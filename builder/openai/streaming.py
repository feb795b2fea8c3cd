"""Server-sent events of one streamed generation: OpenAI chunks, `data: [DONE]` at the end.

Chat streams open with the assistant role, then the content deltas; the chunk of the last
Triton response carries the finish reason; with `stream_options.include_usage` every chunk has
`usage: null` and a last chunk without choices carries the counts. An error after the first
event (headers are sent by then) becomes an `error` event, which the official client raises.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from builder.openai import mapping
from builder.openai.errors import OpenAIError, internal
from builder.openai.responses import usage
from builder.openai.service import Generation, OpenAIService
from builder.openai.triton import Chunk

DONE = "data: [DONE]\n\n"


def event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _with_first(first: Chunk, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    yield first
    async for chunk in rest:
        yield chunk


async def sse_events(service: OpenAIService, generation: Generation, first: Chunk,
                     rest: AsyncIterator[Chunk]) -> AsyncIterator[str]:
    """Every event of the stream. Closing it early (client gone) closes `rest`, which cancels
    the request in Triton."""
    builder, include_usage = generation.builder, generation.request.include_usage
    if builder.kind == "chat":
        yield event(builder.chunk("", None, None, include_usage, role="assistant"))
    offset, last = 0, first
    try:
        async for chunk in _with_first(first, rest):
            last = chunk
            reason = mapping.finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            if not (chunk.text or reason or (generation.log_probs and chunk.token_ids)):
                continue  # nothing new (e.g. bytes of a character not complete yet)
            logprobs = service.logprobs(generation, chunk.token_ids, chunk.log_probs, offset,
                                        chunk.top)
            offset += len(chunk.text)
            text = chunk.text if (chunk.text or builder.kind != "chat") else None
            yield event(builder.chunk(text, reason, logprobs, include_usage))
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
        yield event(builder.usage_chunk(usage(last.num_input_tokens, last.num_output_tokens)))
    yield DONE
