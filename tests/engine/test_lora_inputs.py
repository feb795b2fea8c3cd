"""LoRA bad inputs at build time (exit 2 naming the adapter and the module) and at request time
(an error naming the task id, the engine keeps serving); the adapter cache and the scheduler's
adapter limit on their own."""
import json

import pytest
import torch
from click.testing import CliRunner

import lora_helpers
import tiny
from builder.cli import main
from builder.spec.build_spec import SpecError
from builder.spec.load import spec_from_dict
from triton_backend.engine import Request
from triton_backend.engine.block_manager import BlockManager
from triton_backend.engine.llm_engine import LLMEngine
from triton_backend.engine.offline import generate
from triton_backend.engine.scheduler import Scheduler
from triton_backend.engine.sequence import Sequence

QKV_A = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"


def _nan(state):
    state["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"][0, 0] = float("nan")


def _cli_build(tmp, hf_dir, adapter_dir, **lora):
    spec = {"name": "bad", "checkpoint": str(hf_dir), "dtype": "float32",
            "output": str(tmp / "engine"),
            "limits": {"max_batch_size": 4, "max_num_tokens": 64, "max_input_len": 32,
                       "max_seq_len": 64},
            "lora": {"adapters": {"bad-adapter": str(adapter_dir)}, **lora}}
    path = tmp / "spec.yaml"
    path.write_text(json.dumps(spec))
    return CliRunner().invoke(main, ["engine", "--spec", str(path), "--no-repository"])


@pytest.mark.parametrize("case,edit,lora,message", [
    ("rank", {}, {"max_rank": 4},
     "lora.adapters.bad-adapter: rank r=8 is over lora.max_rank=4"),
    ("missing", {"drop": QKV_A}, {},
     "lora.adapters.bad-adapter: module model.layers.1.self_attn.v_proj: lora_A/lora_B weights "
     "are missing"),
    ("nan", {"weights": _nan}, {},
     "lora.adapters.bad-adapter: module model.layers.0.mlp.down_proj: lora_B has non-finite"),
    ("unsupported", {"config": {"target_modules": ["q_proj", "lm_head"]}}, {},
     "lora.adapters.bad-adapter: module lm_head: LoRA on it is not supported"),
])
def test_bad_adapter_is_exit_2_naming_adapter_and_module(lora_build, tmp_path, case, edit, lora,
                                                          message):
    hf_dir, adapters, _ = lora_build
    drop = edit.get("drop")
    bad = lora_helpers.copy_adapter(
        adapters["adapter-a"], tmp_path / "bad", edit.get("config"),
        (lambda state: state.pop(drop)) if drop else edit.get("weights"))
    result = _cli_build(tmp_path, hf_dir, bad, **lora)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "engine").exists()


def test_adapter_for_another_base_is_refused(lora_build, tmp_path):
    """An adapter trained on a model with one KV head: its k_proj/v_proj have other shapes."""
    hf_dir, _, _ = lora_build
    other = tiny.make_checkpoint(tmp_path / "hf-mistral", "mistral")
    adapter = lora_helpers.train_adapter(other, tmp_path / "other", ["q_proj", "k_proj"], 4, 8,
                                         seed=3, steps=1)
    result = _cli_build(tmp_path, hf_dir, adapter)
    assert result.exit_code == 2, result.output
    assert ("lora.adapters.bad-adapter: module model.layers.0.self_attn.k_proj: lora_B is "
            "(16, 4), the base model's projection has 32 outputs (an adapter for another base "
            "model?)") in result.output


@pytest.mark.parametrize("section,message", [
    ({"adapters": {"a": "x"}, "max_rank": 0}, "lora.max_rank must be an integer >= 1, got 0"),
    ({"adapters": {"a": "x"}, "max_loras": 4, "max_cpu_loras": 2},
     "lora.max_cpu_loras (2) must be >= lora.max_loras (4)"),
    ({"adapters": {"bad name": "x"}}, "lora.adapters: name 'bad name'"),
    ({"adapters": {"a": "x"}, "ranks": 3}, "lora.ranks: unknown key"),
])
def test_lora_spec_errors_name_the_field(section, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_from_dict({"name": "x", "checkpoint": "y", "lora": section})


def test_request_errors_name_the_task_id_and_the_engine_keeps_serving(lora_build):
    from triton_backend.engine.lora.nvidia import nvidia_tensors

    _, adapters, engine_dir = lora_build
    engine = LLMEngine(engine_dir)
    prompt = [5, 6, 7, 8]
    with pytest.raises(ValueError, match="lora_task_id 999: no LoRA adapter is cached under this id"):
        engine.add_request(Request(prompt, 4, lora_task_id=999))
    with pytest.raises(ValueError, match="lora_task_id 1 names the built-in adapter 'adapter-a'"):
        engine.add_request(Request(prompt, 4, lora_task_id=1, lora_weights=[[0.0]],
                                   lora_config=[[1, 0, 1]]))
    weights, config = nvidia_tensors([(0, "q_proj", torch.zeros(8, 64), torch.zeros(64, 8))])
    engine.lora.limits.max_rank = 4  # a rank-8 pair is over it
    with pytest.raises(ValueError, match=r"lora_task_id 5: .*adapter size 8 is over lora.max_rank=4"):
        engine.add_request(Request(prompt, 4, lora_task_id=5, lora_weights=weights,
                                   lora_config=config))
    engine.lora.limits.max_rank = 64
    nan = weights.copy()
    nan[0, 3] = float("nan")
    with pytest.raises(ValueError, match="lora_task_id 6: .*lora_A has non-finite values"):
        engine.add_request(Request(prompt, 4, lora_task_id=6, lora_weights=nan,
                                   lora_config=config))
    with pytest.raises(ValueError, match="lora_weights and lora_config come together"):
        engine.add_request(Request(prompt, 4, lora_task_id=6, lora_weights=weights))
    # still serving, and nothing was left held or cached by the refused requests
    assert generate(engine, [Request(prompt, 4, ignore_eos=True, lora_task_id=2)])[0].output_ids
    assert engine.lora.holds == {} and set(engine.lora.host) == {2}


def test_adapter_cache_is_lru_with_held_adapters_pinned(lora_build):
    from triton_backend.engine.lora.nvidia import nvidia_tensors

    _, adapters, engine_dir = lora_build
    engine = LLMEngine(engine_dir)
    cache = engine.lora
    cache.limits.max_cpu_loras, cache.limits.max_loras = 3, 2
    pair = [(0, "q_proj", torch.randn(2, 64) * 0.01, torch.randn(64, 2) * 0.01)]
    weights, config = nvidia_tensors(pair)
    for task_id in (10, 11, 12):
        cache.acquire(task_id, weights, config)
        cache.release(task_id)
    cache.acquire(10)  # used: 11 is now the least recent
    cache.acquire(1)   # a built-in one comes from the engine directory; 11 is evicted
    assert list(cache.host) == [12, 10, 1] and cache.stats["lora_num_host_evictions"] == 1
    with pytest.raises(ValueError, match="lora_task_id 11: no LoRA adapter is cached"):
        cache.acquire(11)
    cache.activate({10, 1})
    cache.activate({12, 1})  # 10 is out: max_loras=2 resident
    assert list(cache.resident) == [1, 12] and cache.stats["lora_num_evictions"] == 1
    cache.acquire(12)
    cache.limits.max_cpu_loras = 3
    with pytest.raises(ValueError, match="every one of the lora.max_cpu_loras=3 cached adapters "
                                         "is in use"):
        cache.acquire(13, weights, config)


def test_scheduler_runs_at_most_max_loras_adapters_per_step():
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, max_num_tokens=256, max_batch_size=8, max_loras=2)
    seqs = []
    for i, task_id in enumerate([1, 2, 3, None, 1]):
        seq = Sequence.from_request(i, Request([1, 2, 3], 4), frozenset())
        seq.lora_task_id = task_id
        scheduler.add(seq)
        seqs.append(seq)
    output = scheduler.schedule()
    # adapter 3 waits (two adapters run); admission is in order, so the rest wait behind it
    assert [c.seq_id for c in output.chunks] == [0, 1]
    assert [c.lora_task_id for c in output.chunks] == [1, 2]


def test_block_hashes_are_salted_by_adapter():
    bm = BlockManager(16, 4, enable_prefix_caching=True, cache_salt="engine")

    def seq(seq_id, salt):
        s = Sequence.from_request(seq_id, Request(list(range(10)), 4), frozenset())
        s.lora_salt = salt
        return s

    first = seq(0, "adapter-a-sha")
    bm.allocate(first, 10)
    assert bm.find_cached_prefix(seq(1, "adapter-a-sha")) == first.block_table[:2]
    assert bm.find_cached_prefix(seq(2, "adapter-b-sha")) == []
    assert bm.find_cached_prefix(seq(3, "")) == []


def test_lora_metrics_per_adapter_and_state(lora_build):
    from tests.e2e.test_observability import FakeFamily, FakePbUtils
    from triton_backend.models.metrics import LORA_INFO_METRIC, LORA_REQUEST_METRIC, ExecutorMetrics

    _, _, engine_dir = lora_build
    engine = LLMEngine(engine_dir, kv_cache_num_blocks=8)  # room for one sequence: the others wait
    for task_id in (1, 2, 2):
        engine.add_request(Request(list(range(3, 40)), 20, lora_task_id=task_id))
    engine.step()
    stats = engine.get_stats()
    assert stats["lora_running"] == {"adapter-a": 1}
    assert stats["lora_waiting"] == {"adapter-b": 2}
    assert stats["lora_num_resident"] == 1 and stats["lora_num_loads"] == 1
    metrics = ExecutorMetrics(FakePbUtils, "tensorrt_llm", "1")
    metrics.publish(stats)

    def gauge(adapter, state):
        labels = {"model": "tensorrt_llm", "version": "1", "lora_adapter": adapter,
                  "request_type": state}
        return FakeFamily.created[(LORA_REQUEST_METRIC, tuple(sorted(labels.items())))].values

    assert gauge("adapter-a", "running") == [1.0] and gauge("adapter-b", "waiting") == [2.0]
    # the endpoint picker's info gauge, in vLLM's shape (lora.max_loras is 8 by default)
    info = {"model": "tensorrt_llm", "version": "1", "max_lora": "8",
            "running_lora_adapters": "adapter-a", "waiting_lora_adapters": "adapter-b"}
    assert (LORA_INFO_METRIC, tuple(sorted(info.items()))) in FakeFamily.created
    metrics.publish(dict(stats, lora_running={}, lora_waiting={}))
    assert gauge("adapter-a", "running") == [0.0]  # listed at 0 once its requests are done
    stat = ("llm_forge_executor_stats", tuple(sorted(
        {"model": "tensorrt_llm", "version": "1", "stat": "lora_num_loads"}.items())))
    assert FakeFamily.created[stat].values == [1.0]


def test_request_converter_reads_nvidia_lora_inputs_and_names_bad_ones():
    import numpy as np

    from triton_backend.engine.config import Limits
    from triton_backend.models.request_converter import RequestError, parse_request

    limits = Limits(max_batch_size=4, max_num_tokens=64, max_input_len=32, max_seq_len=64)
    base = {"input_ids": np.array([[5, 6, 7]], np.int32),
            "request_output_len": np.array([[4]], np.int32)}
    weights, config = np.zeros((1, 2, 8), np.float16), np.array([[[1, 0, 1], [3, 1, 1]]], np.int32)
    parsed = parse_request(dict(base, lora_task_id=np.array([[7]], np.uint64),
                                lora_weights=weights, lora_config=config), limits, 100).request
    assert parsed.lora_task_id == 7 and parsed.lora_weights.dtype == np.float32
    assert parsed.lora_config.tolist() == config.tolist()
    assert parse_request(base, limits, 100).request.lora_task_id is None
    for extra, message in [
        ({"lora_weights": weights, "lora_config": config}, "need a lora_task_id"),
        ({"lora_task_id": np.array([[7]], np.uint64), "lora_weights": weights},
         "lora_task_id 7: lora_weights and lora_config come together"),
        ({"lora_task_id": np.array([[2.5]], np.float32)}, "lora_task_id must be an integer"),
        ({"lora_task_id": np.array([[7]], np.uint64), "lora_weights": weights,
          "lora_config": config[..., :2]}, r"lora_config must be an \[N, 3\] integer array")]:
        with pytest.raises(RequestError, match=message):
            parse_request(dict(base, **extra), limits, 100)
