"""The gRPC streaming client's parts that need no server (its streams are exercised by every e2e
test that talks gRPC: `forge query`, the bench's gRPC client, the drain tests)."""
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from builder.client import stream_grpc, text_inputs
from builder.client.grpc_stream import GrpcStream, infer_inputs
from builder.serving.serve import free_port


def test_a_server_that_does_not_answer_is_a_connection_error_naming_it():
    url = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"{url}: server not reachable"):
        GrpcStream(url, check_live=True)
    with pytest.raises(ConnectionError, match=f"{url}: server not reachable"):
        next(stream_grpc(url, "ensemble", text_inputs(text_input="hi", max_tokens=1)))


@pytest.mark.parametrize("module", [grpcclient, httpclient])
def test_infer_inputs_keep_names_shapes_and_triton_types(module):
    arrays = text_inputs(text_input="hi", max_tokens=3, stream=True, temperature=0.5, seed=7)
    arrays["input_ids"] = np.array([[1, 2, 3]], np.int32)
    tensors = infer_inputs(arrays, module)
    assert all(isinstance(t, module.InferInput) for t in tensors)
    assert [(t.name(), t.shape(), t.datatype()) for t in tensors] == [
        ("text_input", [1, 1], "BYTES"), ("max_tokens", [1, 1], "INT32"),
        ("stream", [1, 1], "BOOL"), ("temperature", [1, 1], "FP32"), ("seed", [1, 1], "UINT64"),
        ("input_ids", [1, 3], "INT32")]
