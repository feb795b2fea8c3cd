"""The quality gate's task check: does the engine still answer what the unquantized model answers?

Perplexity on held-out text can move little while greedy chat answers turn to nonsense (an INT4
build of the demo model answered "What is the capital of France?" with "La femme au paysage, la
femme au paysage, ..." and passed the perplexity gate). So the gate also asks a fixed set of short
chat questions with known answers (facts, arithmetic, following a format), scores each greedy
reply by whether an accepted answer appears in it, and compares the engine's score with the
reference's on the same items: retention = items both get right / items the reference gets right.
Greedy agreement of the first tokens is reported beside it.

Retention averages: an engine may keep 29 of 31 answers and still lose the one a user asks first.
Items marked `must_keep` (the README's own demo question) fail the gate on their own when the
reference answers them right and the engine does not. Every item whose verdict changed (lost or
gained) is listed by `changed_answers`, so the build's report names the questions, not a ratio.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from builder.pipeline.progress import Eta
from triton_backend.models.text_request import chat_prompt_ids


@dataclass(frozen=True)
class TaskItem:
    question: str
    answers: tuple[str, ...]  # any of them, as a whole word or number
    exact_case: bool = False  # else case-insensitive
    must_keep: bool = False   # lost (right at the reference, wrong here): the gate fails


def _items(rows: Sequence[tuple[str, str]]) -> tuple[TaskItem, ...]:
    return tuple(TaskItem(q, tuple(a.split("|"))) for q, a in rows)


# The question the README asks first (`forge generate`, curl, the OpenAI client): an engine that
# gets it wrong is not one to show a user.
DEMO_QUESTION = TaskItem("What is the capital of France?", ("Paris",), must_keep=True)
FACTS = (DEMO_QUESTION,) + _items((
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of the United Kingdom?", "London"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("What is the largest planet in our solar system?", "Jupiter"),
    ("Which planet is closest to the Sun?", "Mercury"),
    ("What gas do plants absorb from the air for photosynthesis?", "carbon dioxide|CO2"),
    ("What is the chemical symbol for water?", "H2O"),
    ("What is the chemical symbol for gold?", "Au"),
    ("What is the freezing point of water in degrees Celsius?", "0|zero"),
    ("What is the boiling point of water in degrees Celsius?", "100"),
    ("How many days are there in a week?", "7|seven"),
    ("How many continents are there on Earth?", "7|seven"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What color is the sky on a clear day?", "blue"),
    ("What color are ripe bananas?", "yellow"),
    ("Who wrote the play Romeo and Juliet?", "Shakespeare"),
    ("Who painted the Mona Lisa?", "Leonardo|da Vinci"),
    ("What is the tallest mountain in the world?", "Everest"),
    ("What is the longest river in Africa?", "Nile"),
    ("In which country are the pyramids of Giza?", "Egypt"),
    ("What animal is known as the king of the jungle?", "lion"),
    ("What is the largest mammal in the world?", "blue whale|whale"),
    ("What language is spoken in Brazil?", "Portuguese"),
    ("What is the currency of Japan?", "yen"),
))
ARITHMETIC = _items((
    ("What is 2 + 3?", "5|five"),
    ("What is 7 + 8?", "15|fifteen"),
    ("What is 10 - 4?", "6|six"),
    ("What is 6 times 7?", "42|forty-two"),
    ("What is 9 times 9?", "81|eighty-one"),
    ("What is 100 divided by 4?", "25|twenty-five"),
    ("What is 12 + 30?", "42|forty-two"),
    ("What is half of 50?", "25|twenty-five"),
    ("How many minutes are there in an hour?", "60|sixty"),
    ("How many hours are there in a day?", "24|twenty-four"),
))
FORMAT = _items((
    ("Answer with one word: what is the opposite of hot?", "cold"),
    ("Answer with one word: what is the opposite of up?", "down"),
    ("Reply with only the word yes.", "yes"),
    ("Reply with only the word no.", "no"),
    ("Say the word hello and nothing else.", "hello"),
    ("Write the number seven as a digit.", "7"),
    ("Complete the sequence: 1, 2, 3, 4, ...", "5|five"),
))
FORMAT += (TaskItem("Write the word cat in capital letters.", ("CAT",), exact_case=True),)
TASK_ITEMS: tuple[TaskItem, ...] = FACTS + ARITHMETIC + FORMAT
# The quick gate's items: every fourth item (facts, arithmetic and format alike) and every
# must-keep one.
QUICK_TASK_ITEMS: tuple[TaskItem, ...] = tuple(
    item for i, item in enumerate(TASK_ITEMS) if i % 4 == 0 or item.must_keep)


def answered(reply: str, item: TaskItem) -> bool:
    """An accepted answer appears in the reply as a whole word."""
    flags = 0 if item.exact_case else re.IGNORECASE
    return any(re.search(rf"(?<![\w]){re.escape(answer)}(?![\w])", reply, flags)
               for answer in item.answers)


def _reply(tokenizer, token_ids: list[int], eos_ids: frozenset[int]) -> str:
    end = next((i for i, t in enumerate(token_ids) if t in eos_ids), len(token_ids))
    return tokenizer.decode(token_ids[:end], skip_special_tokens=True)


def changed_answers(items: list[dict]) -> list[dict]:
    """The scored items (as `run_task_check` records them) whose verdict differs between the
    reference and the engine: `change` is "lost" (right at the reference only) or "gained"."""
    return [{"question": x["question"], "change": "lost" if x["reference_correct"] else "gained",
             "must_keep": x["must_keep"], "reference_reply": x["reference_reply"],
             "engine_reply": x["engine_reply"]}
            for x in items if x["reference_correct"] != x["engine_correct"]]


def run_task_check(reference, engine, tokenizer, eos_ids: frozenset[int], num_tokens: int,
                   agreement_tokens: int, progress: Callable[[str], None],
                   task_items: Sequence[TaskItem] = TASK_ITEMS) -> dict | None:
    """Both sides' greedy replies (`.greedy(ids, n)`) to every item, scored. Retention is None
    when the reference answers none of them (nothing to retain: the check says so instead of
    gating). Needs a chat template; returns None without one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    items, agree = [], 0
    eta = Eta("task item", len(task_items), progress)
    for item in task_items:
        prompt = chat_prompt_ids(tokenizer, item.question)
        ours = engine.greedy(prompt, num_tokens)
        theirs = reference.greedy(prompt, num_tokens)
        agree += ours[:agreement_tokens] == theirs[:agreement_tokens]
        engine_reply, reference_reply = (_reply(tokenizer, ours, eos_ids),
                                         _reply(tokenizer, theirs, eos_ids))
        items.append({"question": item.question, "answers": list(item.answers),
                      "engine_reply": engine_reply, "reference_reply": reference_reply,
                      "engine_correct": answered(engine_reply, item),
                      "reference_correct": answered(reference_reply, item),
                      "must_keep": item.must_keep})
        eta.tick()
    reference_right = [x for x in items if x["reference_correct"]]
    retained = sum(x["engine_correct"] for x in reference_right)
    return {"task_engine_score": sum(x["engine_correct"] for x in items) / len(items),
            "task_reference_score": len(reference_right) / len(items),
            "task_retention": retained / len(reference_right) if reference_right else None,
            "task_first_tokens_agreement": agree / len(items), "task_items": items,
            "task_changed_answers": changed_answers(items)}
