"""Benchmark workloads: seeded, reproducible lists of prompts with their output lengths.

A workload is a list of `WorkItem`s; the load generator sends them in order (item `i` of a level
is the same request on every server, so comparisons are like with like). Each concurrency level
and the warm-up draw prompts of their own (`Workload.items_for`): sent again at a later level, a
prompt would be served from the prefix cache and flatter that level (a chat run measured a hit
rate of 43% at its first level and 92% at its last).
Token counts are fitted and checked with the engine's tokenizer when one is given; without one
(e.g. against a fake model) lengths are approximate, in words.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from builder.bench import corpus
from triton_backend.engine.numbers import is_int

# ~1,900 tokens in the voicebot case; `--scale` shrinks it (and the other lengths) for CPU.
VOICEBOT_SYSTEM_TOKENS = 1900
_WORDS_PER_TOKEN = 0.75  # English prose, used only when no tokenizer is available


@dataclass(frozen=True)
class WorkItem:
    """One request of a workload. `num_input_tokens` is measured with the tokenizer (None without)."""

    prompt: str
    max_tokens: int
    stream: bool
    num_input_tokens: int | None = None


@dataclass
class Workload:
    name: str
    seed: int
    scale: float
    items: list[WorkItem]
    # Draws the items of another round the way `items` were drawn; None for a JSONL file, whose
    # requests are what the user wrote.
    redraw: Callable[[str], list[WorkItem]] | None = field(default=None, repr=False,
                                                           compare=False)

    def items_for(self, round_name: str | None) -> list[WorkItem]:
        """The items of one round: `items` for the first level (None); for the warm-up and each
        later level, prompts of their own, same shapes, so no round finds another's prompts in
        the server's prefix cache. What a workload shares on purpose stays shared (voicebot's
        system prompt: the prefix cache is what it measures). A JSONL workload sends its own
        requests at every level."""
        if round_name is None or self.redraw is None:
            return self.items
        return self.redraw(round_name)

    def describe(self) -> dict[str, Any]:
        """Summary for the report: sizes and token ranges (input tokens when measured)."""
        inputs = [i.num_input_tokens for i in self.items if i.num_input_tokens is not None]
        outputs = [i.max_tokens for i in self.items]
        return {"name": self.name, "seed": self.seed, "scale": self.scale,
                "num_items": len(self.items), "stream": self.items[0].stream if self.items else None,
                "input_tokens": _range(inputs), "max_tokens": _range(outputs),
                "prompts_per_level": "distinct" if self.redraw else "the same at every level"}


def _range(values: list[int]) -> dict | None:
    if not values:
        return None
    return {"min": min(values), "max": max(values), "mean": round(sum(values) / len(values), 1)}


class PromptFitter:
    """Cuts text to an exact number of tokens with a HF tokenizer (or approximately in words)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int | None:
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def fit(self, text: str, num_tokens: int) -> str:
        """A prefix of `text` with `num_tokens` tokens (one or two fewer if decoding merges)."""
        if self.tokenizer is None:
            return " ".join(text.split()[:max(1, round(num_tokens * _WORDS_PER_TOKEN))])
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < num_tokens:
            raise ValueError(f"corpus text too short for {num_tokens} tokens ({len(ids)})")
        cut = num_tokens
        for _ in range(8):  # decode/encode round trips can merge tokens at the cut; converge down
            candidate = self.tokenizer.decode(ids[:cut], skip_special_tokens=True)
            if self.count(candidate) <= num_tokens:
                return candidate
            cut -= 1
        return candidate

    def words_for(self, num_tokens: int) -> int:
        # Enough words to cover num_tokens with margin for any tokenizer.
        return int(num_tokens * 1.5) + 16


def _scaled(value: int, scale: float, floor: int = 1) -> int:
    return max(floor, round(value * scale))


def query_rewrite(rng: random.Random, fitter: PromptFitter, scale: float, index: int) -> WorkItem:
    """10-20 input tokens, 10-20 output tokens, not streamed: search-query rewriting."""
    query = rng.choice(corpus.SHORT_QUERIES)
    prompt = fitter.fit(f"Rewrite the search query: {query}. "
                        + corpus.passage(rng, 20), rng.randint(10, 20))
    return WorkItem(prompt, rng.randint(10, 20), stream=False,
                    num_input_tokens=fitter.count(prompt))


def voicebot(rng: random.Random, fitter: PromptFitter, scale: float, index: int) -> WorkItem:
    """A long system prompt shared by every request + a short user turn, ~200 tokens, streamed."""
    system_tokens = _scaled(VOICEBOT_SYSTEM_TOKENS, scale, floor=16)
    # The shared prefix is drawn from its own fixed seed so every item carries the same one.
    system_rng = random.Random(1900)
    system = fitter.fit("You are a helpful voice assistant for a small coastal town. Background: "
                        + corpus.passage(system_rng, fitter.words_for(system_tokens)),
                        system_tokens)
    user = f"\nCaller: {rng.choice(corpus.SHORT_QUERIES)}?\nAssistant:"
    prompt = system + user
    return WorkItem(prompt, _scaled(rng.randint(180, 220), scale, floor=8), stream=True,
                    num_input_tokens=fitter.count(prompt))


def chat(rng: random.Random, fitter: PromptFitter, scale: float, index: int) -> WorkItem:
    """Mixed prompt lengths (64-1,024 tokens) and output lengths (16-256), streamed."""
    num_input = _scaled(rng.randint(64, 1024), scale, floor=8)
    text = "Read the passage and continue it.\n\n" + corpus.passage(rng, fitter.words_for(num_input))
    prompt = fitter.fit(text, num_input)
    return WorkItem(prompt, _scaled(rng.randint(16, 256), scale, floor=4), stream=True,
                    num_input_tokens=fitter.count(prompt))


_REWRITE_ASKS = (
    "Rewrite the following text in British spelling, keeping everything else exactly the "
    "same.\n\nText:\n{text}\n\nRewritten text:\n",
    "Article:\n{text}\n\nQuote the article's first three sentences word for word.\nQuote:\n",
    "Summarise the following text, reusing its own words.\n\nText:\n{text}\n\nSummary:\n",
)


def rewrite(rng: random.Random, fitter: PromptFitter, scale: float, index: int) -> WorkItem:
    """Answers that copy long spans of the prompt: rewrite, quote, summarise (a ~160-token
    passage), or rename a variable in a function; ~96 output tokens, streamed. Where
    prompt-lookup speculation pays."""
    if index % 4 == 3:
        code, name = rng.choice(corpus.CODE_SNIPPETS)
        prompt = (f"Here is a Python function:\n```python\n{code}```\nRename `{name}` to "
                  f"`{name}_value` and output the full updated function.\n```python\n")
    else:
        text = fitter.fit(corpus.passage(rng, fitter.words_for(160)), _scaled(160, scale, 16))
        prompt = _REWRITE_ASKS[index % 4].format(text=text)
    return WorkItem(prompt, _scaled(96, scale, floor=16), stream=True,
                    num_input_tokens=fitter.count(prompt))


BUILTIN: dict[str, Callable[[random.Random, PromptFitter, float, int], WorkItem]] = {
    "query-rewrite": query_rewrite,
    "voicebot": voicebot,
    "chat": chat,
    "rewrite": rewrite,
}


def load_jsonl(path: Path, fitter: PromptFitter, stream: bool) -> list[WorkItem]:
    """A user workload: one `{"prompt": str, "max_tokens": int[, "stream": bool]}` per line."""
    items = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
        prompt, max_tokens = row.get("prompt"), row.get("max_tokens")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{lineno}: prompt must be a non-empty string")
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"{path}:{lineno}: max_tokens must be an integer >= 1, got {max_tokens!r}")
        items.append(WorkItem(prompt, max_tokens, bool(row.get("stream", stream)),
                              num_input_tokens=fitter.count(prompt)))
    if not items:
        raise ValueError(f"{path}: no requests in the file")
    return items


def build_workload(name: str, num_items: int, seed: int = 0, scale: float = 1.0,
                   tokenizer: Any | None = None, stream: bool | None = None) -> Workload:
    """A built-in workload (`num_items` requests) or a JSONL file; `stream` overrides the default.

    Item `i` depends only on (name, seed, scale, i) and the round (`Workload.items_for`), so
    asking for more items never changes the first ones.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    fitter = PromptFitter(tokenizer)

    def streamed(items: list[WorkItem]) -> list[WorkItem]:
        if stream is None:
            return items
        return [WorkItem(**{**asdict(i), "stream": stream}) for i in items]

    if name in BUILTIN:
        make = BUILTIN[name]

        def draw(round_name: str | None) -> list[WorkItem]:
            key = f"{name}:{seed}" if round_name is None else f"{name}:{seed}:{round_name}"
            return streamed([make(random.Random(f"{key}:{i}"), fitter, scale, i)
                             for i in range(num_items)])

        return Workload(name, seed, scale, draw(None), redraw=draw)
    if Path(name).is_file():
        items = load_jsonl(Path(name), fitter, stream=True if stream is None else stream)
        return Workload(name, seed, scale, streamed(items))
    raise ValueError(f"workload must be one of {sorted(BUILTIN)} or a JSONL file, got {name!r}")


def load_tokenizer(path: str | Path) -> Any:
    """The engine's tokenizer: an engine directory (its `tokenizer/`) or a tokenizer directory."""
    from transformers import AutoTokenizer

    path = Path(path)
    if (path / "tokenizer").is_dir():
        path = path / "tokenizer"
    if not path.is_dir():
        raise ValueError(f"tokenizer: {path} is not a directory")
    return AutoTokenizer.from_pretrained(str(path))
