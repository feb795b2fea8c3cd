"""The device a tensorrt_llm instance runs its engine on, from Triton's instance arguments and the
gpu_device_ids parameter: a pure function, checked without Triton."""
import pytest

from triton_backend.models.instance_device import (check_instance_count, instance_device,
                                                   instance_index, parse_gpu_device_ids)


def args(kind: str, device_id: str = "0", name: str = "tensorrt_llm_0_0") -> dict:
    """What the Python backend hands `initialize` (as tritonserver 2.51 names an instance of a
    group without a name: <model>_<group index>_<instance index>)."""
    return {"model_instance_kind": kind, "model_instance_device_id": device_id,
            "model_instance_name": name, "model_name": "tensorrt_llm", "model_version": "1"}


def test_kind_gpu_runs_on_the_gpu_triton_gave_the_instance():
    assert instance_device(args("GPU", "3")) == "cuda:3"
    assert instance_device(args("GPU", "0"), gpu_device_ids="5") == "cuda:0"  # Triton's wins


def test_kind_cpu_leaves_the_engine_its_own_device():
    assert instance_device(args("CPU")) is None
    assert instance_device({}) is None  # an older stub that passes no kind


def test_kind_model_takes_gpu_device_ids():
    assert instance_device(args("MODEL")) == "cuda"  # unset: the current CUDA device
    assert instance_device(args("MODEL"), " 2 ") == "cuda:2"
    assert instance_device(args("MODEL", name="tensorrt_llm_0_1"), "2") == "cuda:2"  # one for all
    assert instance_device(args("MODEL", name="tensorrt_llm_0_0"), "4;6") == "cuda:4"
    assert instance_device(args("MODEL", name="tensorrt_llm_0_1"), "4;6") == "cuda:6"


@pytest.mark.parametrize("text, message", [
    ("0,1", "gpu_device_ids '0,1': the torch engine runs on one GPU per instance"),
    ("0;x", "gpu_device_ids '0;x': expected CUDA device ids (integers >= 0) separated by ';', "
            "got 'x'"),
    ("-1", "expected CUDA device ids"),
])
def test_bad_gpu_device_ids_name_the_parameter(text, message):
    with pytest.raises(ValueError) as err:
        instance_device(args("MODEL"), text)
    assert message in str(err.value)


def test_more_instances_than_device_ids_is_an_error_naming_the_instance():
    with pytest.raises(ValueError, match=r"gpu_device_ids '4;6' names 2 devices, one per "
                                         r"instance; instance tensorrt_llm_0_2 is number 3"):
        instance_device(args("MODEL", name="tensorrt_llm_0_2"), "4;6")
    with pytest.raises(ValueError, match="gpu_device_ids: 2 device ids for 3 instance"):
        check_instance_count([4, 6], 3)
    check_instance_count([4], 3)  # one id serves every instance


def test_parsing_and_instance_names():
    assert parse_gpu_device_ids("") == [] and parse_gpu_device_ids("0; 1 ;2") == [0, 1, 2]
    assert instance_index("tensorrt_llm_0_12") == 12
    with pytest.raises(ValueError, match="model instance name 'gpu': expected"):
        instance_index("gpu")
