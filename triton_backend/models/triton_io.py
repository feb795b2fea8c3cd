"""Small helpers between Triton's Python-backend objects and plain numpy dicts."""
from __future__ import annotations

import sys

import triton_python_backend_utils as pb_utils

from triton_backend.models.serving_control import STOP_REQUEST_INPUTS

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def read_inputs(request, names) -> dict:
    """{name: numpy array} of the inputs present in `request` (absent optional ones left out)."""
    inputs = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def make_response(outputs: dict) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])


def error_response(message: str) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


def send_error(sender, message: str) -> None:
    sender.send(error_response(message), flags=FINAL)


def stop_request(model: str, request_id: str) -> None:
    """Cancel the running request `request_id` of the decoupled `model` (tensorrt_llm), as NVIDIA's
    clients do: a `stop: true` request under the same id. Returns when the model has answered."""
    import numpy as np

    tensors = {name: np.asarray([[value]], dtype=np.bool_ if name == "stop" else np.int32)
               for name, value in STOP_REQUEST_INPUTS.items()}
    stop = pb_utils.InferenceRequest(
        model_name=model, request_id=request_id,
        inputs=[pb_utils.Tensor(name, value) for name, value in tensors.items()],
        requested_output_names=[])
    for _ in stop.exec(decoupled=True):
        pass


def limit_compute_threads() -> None:
    """Models that only move text and ids keep torch (if something imported it) to one thread,
    so no idle OpenMP team of theirs competes with the engine process for the cores."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
