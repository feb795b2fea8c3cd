"""`preprocessing` for NVIDIA's C++ `tensorrt_llm` backend: our preprocessing plus an end id.

The C++ backend stops only on the one `end_id` it is given, so this model always supplies one:
the request's `END_ID`, else the checkpoint's first EOS id. The checkpoint's other EOS ids (Llama 3
has several) are appended to the request's stop words, so generation still ends at any of them.
"""
from __future__ import annotations

from triton_backend.engine.config import EngineConfig
from triton_backend.models.end_ids import END_ID_INPUTS, add_end_ids
from triton_backend.models.model_params import ModelParams
from triton_backend.models.preprocessing import INPUT_NAMES, PreprocessingModel, preprocess
from triton_backend.models.request_converter import RequestError
from triton_backend.models.triton_io import error_response, make_response, read_inputs


class TrtllmPreprocessingModel(PreprocessingModel):
    def initialize(self, args):
        super().initialize(args)
        tokenizer_info = EngineConfig.load(ModelParams(args).path("engine_dir")).tokenizer
        self.eos_token_ids = list(tokenizer_info.eos_token_ids)
        pad = tokenizer_info.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_token_ids or [0])[0]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = read_inputs(request, INPUT_NAMES + END_ID_INPUTS)
                outputs = preprocess(inputs, self.tokenizer, self.limits, self.add_special_tokens)
                responses.append(make_response(add_end_ids(outputs, inputs, self.eos_token_ids,
                                                           self.pad_id)))
            except RequestError as exc:
                responses.append(error_response(str(exc)))
        return responses
