"""gpu-check's random checkpoints read real text: SmolLM2's tokenizer (the demo package's, from
its GGUF, or a saved copy as a GPU host gets it), so the FP8 build's calibration windows and the
gate's held-out windows are words, not one unknown token repeated."""
import json

import pytest
from transformers import AutoTokenizer

from builder.gpu_check import models
from builder.quantize.calibration import load_texts


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return models.save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_the_checkpoints_tokenizer_turns_the_gates_text_into_words(tokenizer_dir, tmp_path):
    shape = models.CPU_SHAPES[0]
    checkpoint = models.make_checkpoint(shape, tmp_path / "ckpt", tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    assert len(tokenizer) == shape.vocab_size == 49152
    for dataset in ("builtin", "builtin:heldout"):  # calibration, then the gate
        text = " ".join(load_texts(dataset))[:4000]
        ids = tokenizer(text).input_ids
        assert tokenizer.unk_token_id not in ids
        assert len(set(ids)) > len(ids) / 4  # many distinct tokens, not one repeated
        assert tokenizer.decode(ids) == text
    config = json.loads((checkpoint / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert tokenizer.chat_template  # the served check asks the OpenAI chat endpoint


def test_a_saved_tokenizer_is_taken_as_a_gpu_host_gets_it(tokenizer_dir, tmp_path):
    copy = models.save_tokenizer(tmp_path / "carried", tokenizer_dir)
    assert AutoTokenizer.from_pretrained(str(copy))("Paris").input_ids == (
        AutoTokenizer.from_pretrained(str(tokenizer_dir))("Paris").input_ids)


def test_without_the_package_or_a_copy_it_says_both_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "TOKENIZER_PACKAGE", "llm-not-installed")
    with pytest.raises(ValueError, match=r"package 'llm-not-installed' is not installed.*"
                                         r"or pass --tokenizer DIR"):
        models.save_tokenizer(tmp_path / "none")
