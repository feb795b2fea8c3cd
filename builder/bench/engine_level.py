"""Engine-level speed protocol: the same prompts through every side, timed the same way.

Protocol (`EngineProtocol`): N prompts of L token ids (seeded, and chosen so that their text
re-tokenizes to exactly the same L ids, so text and id entry points see identical work), M new
tokens each with end ids ignored (`min_tokens == max_tokens`). Concurrency 1 is one request alone
(TTFT, then the decode rate of its remaining tokens); concurrency N is all N at once (output
tokens per second over the whole run, prefill included, and the time until every request has its
first token).

A side answers `run_one(ids, text)` and `run_all(ids_list, texts)` with `Timings`. This module
holds the in-process engine side and the `transformers` static-batch side; `engine_level_triton`
the sides through a `tritonserver`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from triton_backend.engine import Request, SamplingParams
from triton_backend.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class EngineProtocol:
    num_prompts: int = 16
    prompt_len: int = 128
    max_tokens: int = 128
    seed: int = 0


@dataclass
class OneTimings:
    """Concurrency 1: seconds to the first token, then tokens/s of the remaining ones."""

    ttft_s: float
    decode_tok_s: float


def measure_one(side, ids_list: list[list[int]], texts: list[str], first: int,
                ttft_samples: int) -> OneTimings:
    """Concurrency 1 on `side`: the TTFT is the median over `ttft_samples` single requests
    (prompts first, first + 1, ...: one prefill is too short a sample on a noisy machine); the
    decode rate comes from the full-length request on prompt `first`."""
    ttfts = []
    for i in range(ttft_samples):
        j = (first + i) % len(ids_list)
        ttfts.append(side.run_one(ids_list[j], texts[j], max_tokens=1).ttft_s)
    full = side.run_one(ids_list[first], texts[first])
    ttfts.append(full.ttft_s)
    return OneTimings(statistics.median(ttfts), full.decode_tok_s)


@dataclass
class AllTimings:
    """Concurrency N: all prompts at once."""

    prefill_s: float   # until every request has its first token
    total_s: float     # until every request has its last token
    tok_s: float       # generated tokens / total_s


def one_timings(start: float, token_times: list[float]) -> OneTimings:
    """From the submit time and the arrival time of every generated token."""
    ttft = token_times[0] - start
    if len(token_times) < 2:
        return OneTimings(ttft, 0.0)
    decode = (len(token_times) - 1) / (token_times[-1] - token_times[0])
    return OneTimings(ttft, decode)


def all_timings(start: float, first_times: list[float], last_times: list[float],
                num_tokens: int) -> AllTimings:
    total = max(last_times) - start
    return AllTimings(max(first_times) - start, total, num_tokens / total)


def make_prompts(tokenizer, protocol: EngineProtocol) -> tuple[list[list[int]], list[str]]:
    """`num_prompts` texts that encode (with the tokenizer's special tokens, as the
    preprocessing model does) to exactly `prompt_len` ids, and those ids."""
    generator = torch.Generator().manual_seed(protocol.seed)
    low = max(tokenizer.all_special_ids or [0]) + 1
    ids_list, texts = [], []
    attempts = 0
    while len(texts) < protocol.num_prompts:
        attempts += 1
        if attempts > 50 * protocol.num_prompts:
            raise RuntimeError("could not make prompts that re-tokenize to a fixed length")
        ids = torch.randint(low, len(tokenizer), (protocol.prompt_len + 8,),
                            generator=generator).tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        encoded = tokenizer.encode(text, add_special_tokens=True)
        # Trim the text until it encodes to the wanted length (tokenization is not additive).
        while len(encoded) > protocol.prompt_len:
            text = text[:-1]
            encoded = tokenizer.encode(text, add_special_tokens=True)
        if len(encoded) == protocol.prompt_len:
            ids_list.append(encoded)
            texts.append(text)
    return ids_list, texts


def paired_ratios(runs: dict[str, list[dict]], side: str, base: str, key: str) -> list[float]:
    """`side` over `base` repeat by repeat, for `key` ("c1.decode_tok_s", "cN.tok_s", ...):
    one repeat runs every side back to back, so a host that slows down between repeats moves
    both halves of a pair alike, which the medians of each side taken apart do not cancel."""
    level, metric = key.split(".")
    if len(runs[side]) != len(runs[base]):
        raise ValueError(f"{side} has {len(runs[side])} repeats, {base} {len(runs[base])}")
    return [a[level][metric] / b[level][metric] for a, b in zip(runs[side], runs[base])]


class InProcessSide:
    """Our engine stepped on this process's main thread (what the engine itself can do)."""

    def __init__(self, engine_dir: str | Path, protocol: EngineProtocol) -> None:
        # The prompts repeat across repeats: a prefix cache would turn every prefill after the
        # first into a lookup (and the TTFT and c=N figures with it).
        self.engine = LLMEngine(engine_dir, enable_prefix_caching=False)
        self.protocol = protocol

    def _request(self, ids: list[int], max_tokens: int | None = None) -> Request:
        n = max_tokens or self.protocol.max_tokens
        return Request(list(ids), n, SamplingParams(min_tokens=n), streaming=True)

    def run_one(self, ids: list[int], text: str, max_tokens: int | None = None) -> OneTimings:
        start = time.perf_counter()
        self.engine.add_request(self._request(ids, max_tokens))
        times = []
        while self.engine.has_work():
            for response in self.engine.step():
                now = time.perf_counter()
                times.extend([now] * len(response.output_token_ids))
        return one_timings(start, times)

    def run_all(self, ids_list: list[list[int]], texts: list[str]) -> AllTimings:
        start = time.perf_counter()
        rids = [self.engine.add_request(self._request(ids)) for ids in ids_list]
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        while self.engine.has_work():
            responses = self.engine.step()
            now = time.perf_counter()
            for response in responses:
                if response.output_token_ids:
                    first.setdefault(response.request_id, now)
                    last[response.request_id] = now
        assert sorted(first) == sorted(rids)
        return all_timings(start, list(first.values()), list(last.values()),
                           len(ids_list) * self.protocol.max_tokens)

    def close(self) -> None:
        pass


class ProcessSide:
    """The same engine in its own process (`ProcessExecutor`, what the `tensorrt_llm` model
    serves from), driven from this process with no Triton in between: with the in-process and
    Triton sides it splits a serving gap into the process boundary and the Triton round trip."""

    def __init__(self, engine_dir: str | Path, protocol: EngineProtocol) -> None:
        from triton_backend.engine.engine_options import EngineOptions
        from triton_backend.engine.process.executor import ProcessExecutor

        self.executor = ProcessExecutor(Path(engine_dir),
                                        EngineOptions(enable_prefix_caching=False))
        self.protocol = protocol

    def _enqueue(self, ids: list[int], max_tokens: int | None = None) -> int:
        n = max_tokens or self.protocol.max_tokens
        return self.executor.enqueue_request(
            Request(list(ids), n, SamplingParams(min_tokens=n), streaming=True))

    def _responses(self):
        deadline = time.monotonic() + 1800.0
        while time.monotonic() < deadline:
            for response in self.executor.await_responses(timeout=1.0):
                if response.has_error:
                    raise RuntimeError(f"engine process: {response.error}")
                yield time.perf_counter(), response
        raise TimeoutError("engine process: no final response within 1800 s")

    def run_one(self, ids: list[int], text: str, max_tokens: int | None = None) -> OneTimings:
        start = time.perf_counter()
        rid = self._enqueue(ids, max_tokens)
        times: list[float] = []
        for now, response in self._responses():
            if response.request_id == rid:
                times.extend([now] * len(response.output_token_ids))
                if response.is_final:
                    break
        return one_timings(start, times)

    def run_all(self, ids_list: list[list[int]], texts: list[str]) -> AllTimings:
        start = time.perf_counter()
        pending = {self._enqueue(ids) for ids in ids_list}
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        for now, response in self._responses():
            if response.output_token_ids:
                first.setdefault(response.request_id, now)
                last[response.request_id] = now
            if response.is_final:
                pending.discard(response.request_id)
                if not pending:
                    break
        return all_timings(start, list(first.values()), list(last.values()),
                           len(ids_list) * self.protocol.max_tokens)

    def stop(self) -> None:
        self.executor.shutdown()


class _TokenClock:
    """A `transformers` streamer that notes when each generated token (of the batch) appears."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersSide:
    """`transformers` `generate` on the same checkpoint, the prompts as one static batch."""

    def __init__(self, hf_dir: str | Path, dtype: torch.dtype, protocol: EngineProtocol) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()
        self._config = GenerationConfig
        self.protocol = protocol

    def _generate(self, batch: list[list[int]], max_tokens: int | None = None
                  ) -> tuple[float, list[float]]:
        n = max_tokens or self.protocol.max_tokens
        config = self._config(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                              eos_token_id=None, pad_token_id=0)
        clock = _TokenClock()
        input_ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                      generation_config=config, streamer=clock)
        assert out.shape[1] - input_ids.shape[1] == n
        return start, clock.times

    def run_one(self, ids: list[int], text: str, max_tokens: int | None = None) -> OneTimings:
        start, times = self._generate([ids], max_tokens)
        return one_timings(start, times)

    def run_all(self, ids_list: list[list[int]], texts: list[str]) -> AllTimings:
        start, times = self._generate(ids_list)  # one time per step, for the whole batch
        return all_timings(start, [times[0]], [times[-1]],
                           len(ids_list) * self.protocol.max_tokens)

    def close(self) -> None:
        pass


def as_dict(timings) -> dict:
    return asdict(timings)
