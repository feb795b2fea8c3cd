"""The launcher against a trivial Python model: finds tritonserver, runs the stub with this very
interpreter, serves on free loopback ports, stops cleanly; `forge repository` / `forge query`."""
import sys
import textwrap

import numpy as np
import pytest

from builder.serve import find_tritonserver, free_port
from tests.triton_helpers import running_tritonserver

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
ECHO_MODEL = '''
import sys
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0]
            out = np.array([sys.executable.encode() + b"|" + text], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
'''


@pytest.fixture(scope="module")
def echo_repository(tmp_path_factory):
    repo = tmp_path_factory.mktemp("echo-repo")
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(textwrap.dedent(ECHO_MODEL))
    return repo


def test_find_tritonserver_finds_a_binary():
    assert find_tritonserver().binary.is_file()


@pytest.mark.slow
def test_server_runs_python_models_with_this_interpreter_and_stops(echo_repository):
    import tritonclient.http as httpclient

    port = free_port()
    with running_tritonserver(echo_repository, http_port=port, ready_timeout=120) as server:
        assert server.http_url == f"127.0.0.1:{port}"
        client = httpclient.InferenceServerClient(server.http_url)
        tensor = httpclient.InferInput("IN", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"hi"], dtype=object))
        out = client.infer("echo", [tensor]).as_numpy("OUT")[0]
        stub_python, _, text = out.partition(b"|")
        assert text == b"hi"
        assert stub_python.decode().startswith(sys.prefix)  # the venv's own interpreter
    assert not server.is_alive() and not server.is_ready()


def test_start_refuses_a_missing_repository(tmp_path):
    from builder.serve import start_tritonserver

    with pytest.raises(FileNotFoundError, match="no such directory"):
        start_tritonserver(tmp_path / "nope")


def test_forge_repository_reports_bad_options_naming_the_field(tmp_path):
    from click.testing import CliRunner

    from builder.cli_serve import repository_command

    result = CliRunner().invoke(repository_command, ["--engine", str(tmp_path), "--output",
                                                     str(tmp_path / "r"), "--set", "decoupled=2"])
    assert result.exit_code == 2 and "repository.decoupled" in result.output


def test_forge_repository_starts_from_the_specs_sections_and_applies_set(tmp_path):
    from click.testing import CliRunner

    from builder.cli_serve import repository_command
    from tests.triton_helpers import build_tiny_engine

    engine = build_tiny_engine(tmp_path, spec_sections={
        "serving": {"max_waiting_requests": 5}, "repository": {"stats_period_ms": 40}})
    result = CliRunner().invoke(repository_command, [
        "--engine", str(engine), "--output", str(tmp_path / "r"),
        "--set", "priority_aging_rate=2.5", "--set", "decoupled=true"])
    assert result.exit_code == 0, result.output
    config = (tmp_path / "r" / "tensorrt_llm" / "config.pbtxt").read_text()
    for key, value in [("max_waiting_requests", "5"), ("stats_period_ms", "40"),
                       ("priority_aging_rate", "2.5")]:
        assert f'key: "{key}" value: {{ string_value: "{value}" }}' in config, key


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_forge_query_reports_an_unreachable_server(protocol):
    from click.testing import CliRunner

    from builder.cli_serve import query_command

    url = f"127.0.0.1:{free_port()}"
    result = CliRunner().invoke(query_command, ["hi", "--url", url, "--protocol", protocol])
    assert result.exit_code == 1 and f"error: {url}" in result.output
