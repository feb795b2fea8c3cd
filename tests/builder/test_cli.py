"""`forge engine` / `forge generate` through the command line: outputs and exit codes."""
import json

from click.testing import CliRunner

import tiny
from builder.cli import main


def forge(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_json_and_exit_codes(tiny_engines):
    engine = tiny_engines("llama_gqa")
    ok = forge("generate", "--engine", engine, "--prompt-ids", "5,6,7", "--max-tokens", 6, "--json")
    assert ok.exit_code == 0, ok.output
    result = json.loads(ok.output.strip().splitlines()[-1])
    assert len(result["output_ids"]) <= 6 and result["input_ids"] == [5, 6, 7]
    assert isinstance(result["text"], str)
    bad = forge("generate", "--engine", engine, "--prompt-ids", "5", "--max-tokens", 0)
    assert bad.exit_code == 2 and "max_tokens must be >= 1, got 0" in bad.output
    bad = forge("generate", "--engine", engine, "--prompt", "hi", "--top-p", 2)
    assert bad.exit_code == 2 and "top_p must be <= 1.0, got 2.0" in bad.output
    both = forge("generate", "--engine", engine, "--prompt", "x", "--prompt-ids", "1")
    assert both.exit_code == 2 and "exactly one of --prompt or --prompt-ids" in both.output


def test_engine_refuses_bad_spec_with_exit_2(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: x\ncheckpoint: nowhere\nlimits: {max_batch_size: 0}\n")
    result = forge("engine", "--spec", spec)
    assert result.exit_code == 2 and "limits.max_batch_size must be an integer >= 1" in result.output
    result = forge("engine", "--checkpoint", tmp_path, "--target", "trtllm")
    assert result.exit_code == 2 and "hardware: target trtllm needs a GPU profile" in result.output
    result = forge("engine", "--checkpoint", tmp_path / "missing")
    assert result.exit_code == 2 and "checkpoint:" in result.output


def test_engine_builds_naive_target(tmp_path):
    checkpoint = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    out = tmp_path / "naive"
    result = forge("engine", "--checkpoint", checkpoint, "--target", "naive", "--output", out,
                   "--name", "tiny-naive", "--dtype", "float32", "--no-repository")
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["target"] == "naive" and (out / "hf" / "model.safetensors").is_file()
    assert (out / "tokenizer" / "tokenizer.json").is_file()


def test_a_variant_is_served_under_its_own_name(tmp_path, monkeypatch):
    """A flag that changes what the engine computes (here --dtype) makes a variant: its engine,
    repository and served model take the spec's name plus the flag's word, unless --name says
    otherwise; a variant the spec's own engine directory receives keeps the spec's name."""
    from builder.serving.openai.config import OpenAIServerConfig

    monkeypatch.chdir(tmp_path)  # engines/<name> lands here
    checkpoint = tiny.make_checkpoint(tmp_path / "hf", "llama_gqa")
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: tiny\ncheckpoint: {checkpoint}\ndtype: float32\nlimits: "
                    "{max_batch_size: 4, max_num_tokens: 64, max_input_len: 32, max_seq_len: 64}\n")

    def served(*flags):
        repository = tmp_path / "repos" / str(len(list(tmp_path.glob("repos/*"))))
        result = forge("engine", "--spec", spec, "--repository", repository, *flags)
        assert result.exit_code == 0, result.output
        return OpenAIServerConfig.from_repository(repository, "127.0.0.1:1").model_name

    assert served("--dtype", "bfloat16", "--output", tmp_path / "e" / "bf16") == "tiny-bf16"
    assert served("--dtype", "bfloat16", "--output", tmp_path / "e" / "mine",
                  "--name", "mine") == "mine"
    assert served("--output", tmp_path / "e" / "copy") == "tiny"  # the same engine elsewhere
    assert served("--dtype", "bfloat16", "--output", "engines/tiny") == "tiny"  # replaces it
