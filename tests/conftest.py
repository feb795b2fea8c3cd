import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import tiny` from any test module
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory):
    """One float32 engine per tiny shape, built once per session: {shape: engine_dir}."""
    import tiny

    cache: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in cache:
            cache[shape] = tiny.build_engine(tmp_path_factory.mktemp(shape), shape)
        return cache[shape]

    return get


@pytest.fixture(scope="session")
def lora_build(tmp_path_factory):
    """(tiny checkpoint, {name: PEFT adapter dir}, fp32 engine with both adapters built in)."""
    import lora_helpers

    tmp = tmp_path_factory.mktemp("lora")
    hf_dir, adapters = lora_helpers.make_adapters(tmp)
    return hf_dir, adapters, lora_helpers.build_lora_engine(tmp, adapters)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels():
    """Compile the runtime's C++ kernels once, before any test (or engine process) needs them,
    so no server start waits for the compiler."""
    from triton_backend.engine.cpu.kernels import load_cpu_kernels

    return load_cpu_kernels()


CHAT_TEMPLATE = ("{% for m in messages %}<s>[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tiny test tokenizer (a module may define its own `tokenizer`)."""
    from transformers import PreTrainedTokenizerFast

    from tests.triton_helpers import build_tiny_tokenizer

    return PreTrainedTokenizerFast.from_pretrained(
        str(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.fixture
def chat_tokenizer(tokenizer):
    """The tiny tokenizer with CHAT_TEMPLATE, a template that does not read tools."""
    import copy

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = CHAT_TEMPLATE
    return templated
