"""EngineOptions: every field survives the one serialisation to the engine process."""
import dataclasses
import json

from triton_backend.engine.admission import AdmissionLimits
from triton_backend.engine.process.handle import EngineLaunch
from triton_backend.engine.engine_options import EngineOptions

# One non-default value per field; a field missing here fails the test below.
NON_DEFAULT = {"kv_cache_num_blocks": 48, "kv_cache_memory_bytes": 1 << 20,
               "enable_prefix_caching": False, "enable_speculative_decoding": False,
               "admission": AdmissionLimits(7, 900), "priority_aging_rate": 2.5,
               "device": "cpu", "kv_cache_free_gpu_mem_fraction": 0.85,
               "enable_cuda_graphs": False}


def _options_from_argv(argv: list[str]) -> EngineOptions:
    from triton_backend.engine.process.main import _parse_args

    args = _parse_args(argv[argv.index("--engine-dir"):])
    return EngineOptions.from_json(args.options)


def test_every_field_has_a_non_default_value_in_this_test():
    names = {field.name for field in dataclasses.fields(EngineOptions)}
    assert names == set(NON_DEFAULT)
    defaults = EngineOptions()
    assert all(getattr(defaults, name) != value for name, value in NON_DEFAULT.items())


def test_every_field_survives_the_launch_command():
    options = EngineOptions(**NON_DEFAULT)
    command = EngineLaunch("/engines/x", options, num_threads=1).command(fd=5)
    assert _options_from_argv(command) == options
    for field in dataclasses.fields(EngineOptions):
        assert getattr(_options_from_argv(command), field.name) == NON_DEFAULT[field.name]


def test_defaults_survive_and_become_executor_keywords():
    command = EngineLaunch("/engines/x").command(fd=5)
    assert _options_from_argv(command) == EngineOptions()
    assert set(EngineOptions().executor_kwargs()) == set(NON_DEFAULT)


def _params(values: dict):
    from triton_backend.models.model_params import ModelParams

    parameters = {key: {"string_value": value} for key, value in values.items()}
    return ModelParams({"model_config": json.dumps({"parameters": parameters}),
                        "model_repository": "/repo/tensorrt_llm"})


def test_the_repository_parameters_become_every_option_once():
    """What the emitted `tensorrt_llm` config.pbtxt says, as the one EngineOptions value the
    executor (and through it the engine process) is built with."""
    from triton_backend.models.executor_factory import engine_options

    params = _params({"kv_cache_num_blocks": "48", "kv_cache_memory_bytes": str(1 << 20),
                      "enable_kv_cache_reuse": "false", "enable_speculative_decoding": "false",
                      "max_waiting_requests": "7", "max_waiting_prompt_tokens": "900",
                      "priority_aging_rate": "2.5", "kv_cache_free_gpu_mem_fraction": "0.85",
                      "cuda_graph_mode": "false"})
    assert engine_options(params, device="cpu") == EngineOptions(**NON_DEFAULT)
    defaults = _params({"kv_cache_num_blocks": "", "enable_kv_cache_reuse": "true"})
    assert engine_options(defaults) == EngineOptions(admission=AdmissionLimits(0, 0))


def test_process_executor_hands_its_options_to_the_engine_launch_whole(tiny_engines,
                                                                       monkeypatch):
    from triton_backend.engine.process import executor as process_executor

    launches = []

    def capture(launch):
        launches.append(launch)
        raise process_executor.EngineProcessError("not started in this test")

    monkeypatch.setattr(process_executor.EngineHandle, "start", staticmethod(capture))
    options = EngineOptions(**NON_DEFAULT)
    try:
        process_executor.ProcessExecutor(tiny_engines("llama_gqa"), options)
    except process_executor.EngineProcessError:
        pass
    assert launches[0].options is options
