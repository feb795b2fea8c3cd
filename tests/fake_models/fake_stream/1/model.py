"""A fake LLM for testing `forge bench`: it streams `max_tokens` tokens at known delays.

The first token leaves `first_token_delay_s` after the request arrives, every next one
`inter_token_delay_s` after the previous one, so a correct load generator must measure
TTFT ~= first_token_delay_s and ITL ~= inter_token_delay_s. Each request runs in its own thread
(requests overlap, as in a batching server). Non-streaming requests get one response after the
whole sequence. The final response is empty and carries only the FINAL flag.
"""
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _response(text, num_tokens):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([[text.encode()]], dtype=np.object_)),
        pb_utils.Tensor("num_output_tokens", np.array([[num_tokens]], dtype=np.int32)),
    ])


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"])["parameters"]
        self.first_delay = float(params["first_token_delay_s"]["string_value"])
        self.token_delay = float(params["inter_token_delay_s"]["string_value"])
        self.threads = []

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.threads = [t for t in self.threads if t.is_alive()]
        return None

    def _serve(self, request):
        sender = request.get_response_sender()
        max_tokens = int(_scalar(request, "max_tokens", 1))
        stream = bool(_scalar(request, "stream", False))
        # Deadlines from the arrival time, so a slow thread start does not shift later tokens.
        arrival = time.monotonic()
        words = []
        for i in range(max_tokens):
            delay = self.first_delay + i * self.token_delay - (time.monotonic() - arrival)
            if delay > 0:
                time.sleep(delay)
            words.append(f"w{i} ")
            if stream:
                sender.send(_response(words[-1], i + 1))
        if not stream:
            sender.send(_response("".join(words), max_tokens))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join(timeout=5)
