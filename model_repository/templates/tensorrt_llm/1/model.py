"""Triton entry point of llm-forge's `tensorrt_llm` model: a shim, the code is in triton_backend.

The `python_path` parameter of config.pbtxt (relative to the repository directory, or absolute)
names the directory holding the `triton_backend` package; it goes first on sys.path so the
repository runs the code it was emitted from (empty: use the installed package).
"""
import json
import os
import sys


def _import_path(args):
    parameters = json.loads(args["model_config"]).get("parameters", {})
    path = parameters.get("python_path", {}).get("string_value", "")
    if path:
        repository = os.path.dirname(args["model_repository"].rstrip("/"))
        path = os.path.normpath(os.path.join(repository, path))
        if path not in sys.path:
            sys.path.insert(0, path)


class TritonPythonModel:
    def initialize(self, args):
        _import_path(args)
        from triton_backend.models.tensorrt_llm import TensorrtLlmModel

        self._model = TensorrtLlmModel()
        self._model.initialize(args)

    def execute(self, requests):
        return self._model.execute(requests)

    def finalize(self):
        self._model.finalize()
