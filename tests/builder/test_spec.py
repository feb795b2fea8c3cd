"""The build spec and the engine config reject bad input with messages naming the key."""
import json
from pathlib import Path

import pytest

from builder.spec.build_spec import SpecError, parse_bytes
from builder.spec.load import load_spec, spec_from_dict
from triton_backend.engine.config import EngineConfig

BASE = {"name": "m", "checkpoint": "some/dir"}


@pytest.mark.parametrize("patch, message", [
    ({"bogus": 1}, "bogus: unknown key"),
    ({"limits": {"max_batch_sizes": 4}}, "limits.max_batch_sizes: unknown key"),
    ({"limits": {"max_batch_size": 0}}, "limits.max_batch_size must be an integer >= 1, got 0"),
    ({"limits": {"max_input_len": 512, "max_seq_len": 512}}, "limits.max_input_len (512) must be <"),
    ({"kv_cache": {"tokens_per_block": -1}}, "kv_cache.tokens_per_block must be an integer >= 1"),
    ({"kv_cache": {"num_blocks": 4, "memory_bytes": "1GiB"}}, "give num_blocks or memory_bytes"),
    ({"kv_cache": {"memory_bytes": "lots"}}, "kv_cache.memory_bytes: expected bytes"),
    ({"target": "trtllm"}, "hardware: target trtllm needs a GPU profile"),
    ({"target": "tpu"}, "target: must be one of"),
    ({"dtype": "int3"}, "dtype: must be one of"),
    ({"hardware": "h100"}, "hardware: must be one of"),
    ({"name": "bad name!"}, "name: letters, digits"),
    ({"checkpoint": None}, "checkpoint: required"),
    ({"quantization": {"weights": "int2"}}, "quantization.weights: must be one of"),
    ({"quantization": {"kv_cache": "fp4"}}, "quantization.kv_cache: must be one of"),
    ({"quantization": {"mystery": 1}}, "quantization.mystery: unknown key"),
    ({"quantization": {"weights": "int4_awq", "group_size": 0}},
     "quantization.group_size: must be an integer >= 1, got 0"),
    ({"quantization": {"calibration": {"samples": -1}}},
     "quantization.calibration.samples: must be an integer >= 1"),
    ({"quantization": {"quality": {"bogus": 1}}}, "quantization.quality.bogus"),
    ({"repository": {"instances": 2}}, "repository: unknown key(s) instances"),
    ({"kv_cache": {"enable_prefix_caching": "yes"}},
     "kv_cache.enable_prefix_caching must be true or false"),
    ({"speculative": {"mode": "medusa"}}, "speculative.mode must be one of"),
    ({"speculative": {"mode": "ngram", "num_draft_tokens": 0}},
     "speculative.num_draft_tokens must be an integer >= 1"),
    ({"speculative": {"mode": "ngram", "num_draft_tokens": 16}},
     "speculative.num_draft_tokens must be <= 15"),
    ({"speculative": {"mode": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}},
     "speculative.prompt_lookup_min (4) must be <="),
    ({"speculative": {"mode": "draft_model"}}, "speculative.draft_engine is required"),
    ({"speculative": {"mode": "ngram", "draft_engine": "x"}}, "speculative.draft_engine is required"),
    ({"speculative": {"mode": "ngram", "lookahead": 3}}, "speculative.lookahead: unknown key"),
    ({"target": "trtllm", "hardware": "h100-80gb", "speculative": {"mode": "ngram"}},
     "speculative.mode: 'ngram' runs on the torch target"),
    ({"target": "trtllm", "hardware": "h100-80gb",
      "quantization": {"weights": "int4_rtn", "zero_point": True}},
     "quantization.zero_point: the trtllm target's INT4 (W4A16_AWQ) is symmetric"),
    ({"target": "trtllm", "hardware": "h100-80gb", "quantization": {"lm_head": "int8"}},
     "quantization.lm_head: 'int8' runs on the torch target's CPU kernels; use none for trtllm"),
    ({"serving": {"max_waiting_requests": -1}},
     "serving.max_waiting_requests must be an integer >= 0 (0: unbounded), got -1"),
    ({"serving": {"max_waiting_prompt_tokens": "lots"}},
     "serving.max_waiting_prompt_tokens must be an integer >= 0 (0: unbounded), got 'lots'"),
    ({"serving": {"priority_aging_rate": 0}},
     "serving.priority_aging_rate must be a number of priority levels per second in "
     "(0, 1000000], got 0"),
    ({"serving": {"max_queue": 3}}, "serving.max_queue: unknown key"),
])
def test_bad_specs_name_the_key(patch, message):
    with pytest.raises(SpecError) as err:
        spec_from_dict({**BASE, **patch})
    assert message in str(err.value)


def test_yaml_spec_with_overrides(tmp_path):
    path = tmp_path / "b.yaml"
    path.write_text("name: a\ncheckpoint: x\nkv_cache:\n  memory_bytes: 512MiB\n")
    spec = load_spec(path, {"dtype": "float32", "output": None})
    assert spec.dtype == "float32" and spec.kv_cache.memory_bytes == 512 * 2**20
    assert str(spec.output_dir) == "engines/a"
    assert parse_bytes("k", "1.5 GB") == 1_500_000_000


def test_relative_adapter_paths_are_relative_to_the_spec_not_the_cwd(tmp_path, monkeypatch):
    """examples/smollm2-135m-lora.yaml names ../adapters/pirate; `make lora-demo` builds it from
    the checkout's root, where that path leads out of the checkout."""
    (tmp_path / "examples").mkdir()
    path = tmp_path / "examples" / "l.yaml"
    path.write_text("name: a\ncheckpoint: x\nlora:\n  adapters: {p: ../adapters/p, q: /abs/q}\n")
    monkeypatch.chdir(tmp_path)
    spec = load_spec(path, {})
    assert spec.lora.adapters == {"p": str(tmp_path / "adapters" / "p"), "q": "/abs/q"}
    assert spec.lora.adapter_dirs() == {"p": tmp_path / "adapters" / "p", "q": Path("/abs/q")}


def test_engine_refuses_unknown_format_version(tiny_engines, tmp_path):
    config = json.loads((tiny_engines("llama_gqa") / "config.json").read_text())
    config["format_version"] = 99
    with pytest.raises(ValueError, match="format_version 99 is not supported"):
        EngineConfig.from_dict(config)


def test_prefix_caching_is_on_and_speculation_off_by_default():
    spec = spec_from_dict(BASE)
    assert spec.kv_cache.enable_prefix_caching is True and spec.speculative.mode == "none"
    spec = spec_from_dict({**BASE, "kv_cache": {"enable_prefix_caching": False},
                           "speculative": {"mode": "ngram", "num_draft_tokens": 5}})
    assert not spec.kv_cache.enable_prefix_caching and spec.speculative.num_draft_tokens == 5


def test_a_spec_with_a_draft_engine_builds(tiny_engines, tmp_path):
    """forge engine with `speculative: {mode: draft_model}`: the draft is checked and stored
    relative to the new engine (a build once failed here on a name the staging step lacked)."""
    import tiny
    from triton_backend.engine.speculative.draft_model import resolve_draft_engine

    draft = tiny_engines("llama_gqa")
    engine_dir = tiny.build_engine(tmp_path, speculative={
        "mode": "draft_model", "draft_engine": str(draft), "num_draft_tokens": 3})
    config = EngineConfig.load(engine_dir)
    assert config.speculative.mode == "draft_model"
    assert resolve_draft_engine(engine_dir, config.speculative.draft_engine) == draft


def test_a_draft_engine_must_share_the_targets_tokenizer(tiny_engines, tmp_path):
    import shutil

    import tiny
    from builder.pipeline.speculative import check_draft_engine
    from triton_backend.engine.speculative.draft_model import resolve_draft_engine

    target = tiny_engines("llama_gqa")
    config = EngineConfig.load(target)
    config.speculative.mode, config.speculative.draft_engine = "draft_model", str(target)
    new_engine = tmp_path / "engines" / "new"
    message = check_draft_engine(config, target, new_engine)
    assert "draft engine tiny-llama-gqa" in message
    stored = config.speculative.draft_engine  # relative: the pair moves together
    assert not stored.startswith("/") and resolve_draft_engine(new_engine, stored) == target
    other = tmp_path / "other-tokenizer"
    shutil.copytree(target, other)
    shutil.rmtree(other / "tokenizer")
    tiny.make_tokenizer(other / "tokenizer", vocab_size=300)
    config.speculative.draft_engine = str(other)
    with pytest.raises(ValueError, match="speculative.draft_engine: .* another tokenizer"):
        check_draft_engine(config, target, tmp_path / "engines" / "new")
    config.speculative.draft_engine = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="speculative.draft_engine: .*no engine config"):
        check_draft_engine(config, target, tmp_path / "engines" / "new")


def test_serving_defaults_size_the_prompt_token_bound_from_the_engine():
    from triton_backend.engine.config import Limits

    serving = spec_from_dict(BASE).serving
    assert serving.max_waiting_requests == 64 and serving.priority_aging_rate == 1.0
    limits = Limits(max_batch_size=8, max_num_tokens=256, max_input_len=2048, max_seq_len=4096)
    assert serving.waiting_prompt_tokens(limits) == 2048  # at least one longest prompt
    limits = Limits(max_batch_size=8, max_num_tokens=2048, max_input_len=2048, max_seq_len=4096)
    assert serving.waiting_prompt_tokens(limits) == 16384  # eight full prefill steps
    explicit = spec_from_dict({**BASE, "serving": {"max_waiting_prompt_tokens": 0}}).serving
    assert explicit.waiting_prompt_tokens(limits) == 0  # unbounded


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_example_spec_is_valid(path):
    spec = load_spec(path, {})
    assert spec.name == path.stem
