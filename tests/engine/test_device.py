"""Where an engine runs: its hardware's kind of device unless told, and a clear refusal of a GPU
that is not there."""
import pytest
import torch

from triton_backend.engine.device import resolve_device


def test_a_cpu_engine_runs_on_the_cpu_unless_told():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu", "auto") == torch.device("cpu")
    assert resolve_device("h100-80gb", "cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
@pytest.mark.parametrize("hardware, requested", [("h100-80gb", None), ("l4", "auto"),
                                                 ("cpu", "cuda:1")])
def test_a_gpu_where_none_is_visible_is_refused_by_name(hardware, requested):
    with pytest.raises(ValueError, match=r"runs on a CUDA GPU and none is visible"):
        resolve_device(hardware, requested)


@pytest.mark.parametrize("requested", ["tpu", "cuda:x", "mps"])
def test_an_unknown_device_names_the_accepted_ones(requested):
    with pytest.raises(ValueError, match=r"device: expected auto, cpu, cuda or cuda:N, got"):
        resolve_device("cpu", requested)
