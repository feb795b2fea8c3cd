"""The launcher against a trivial Python model: finds tritonserver, runs the stub with this very
interpreter, serves on free loopback ports, stops cleanly; `forge repository` / `forge query`."""
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from builder.serving.serve import find_tritonserver, free_port
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


def test_the_allocator_is_jemalloc_then_tcmalloc_then_glibcs(tmp_path):
    from builder.serving.allocator import find_allocator, with_allocator

    jemalloc_dir, tcmalloc_dir, empty = (tmp_path / "a", tmp_path / "b", tmp_path / "c")
    for directory, name in ((jemalloc_dir, "libjemalloc.so.2"),
                            (tcmalloc_dir, "libtcmalloc_minimal.so.4")):
        directory.mkdir()
        (directory / name).write_bytes(b"")
    empty.mkdir()
    both = [tcmalloc_dir, jemalloc_dir]
    assert find_allocator("auto", both) == ("jemalloc", jemalloc_dir / "libjemalloc.so.2")
    assert find_allocator("tcmalloc", both) == ("tcmalloc",
                                                tcmalloc_dir / "libtcmalloc_minimal.so.4")
    assert find_allocator("auto", [empty]) == ("system", None)
    assert find_allocator("system", both) == ("system", None)
    with pytest.raises(FileNotFoundError) as err:
        find_allocator("jemalloc", [empty])
    assert str(err.value) == (f"--malloc jemalloc: libjemalloc.so.2 or libjemalloc.so not found "
                              f"in {empty} (Debian/Ubuntu: apt-get install libjemalloc2)")
    with pytest.raises(ValueError, match="--malloc 'mimalloc': expected one of auto, jemalloc, "
                                         "tcmalloc, system"):
        find_allocator("mimalloc", both)
    # preloaded first, anything the caller preloads stays after it
    env, name = with_allocator({"LD_PRELOAD": "/opt/libfoo.so"}, "auto", both)
    assert name == "jemalloc"
    assert env["LD_PRELOAD"] == f"{jemalloc_dir / 'libjemalloc.so.2'}:/opt/libfoo.so"
    # an allocator the caller already preloads is the one used
    env, name = with_allocator({"LD_PRELOAD": "/x/libtcmalloc.so.4"}, "jemalloc", [empty])
    assert (name, env["LD_PRELOAD"]) == ("tcmalloc", "/x/libtcmalloc.so.4")
    assert with_allocator({"PATH": "/bin"}, "system", both) == ({"PATH": "/bin"}, "system")


@pytest.mark.slow
def test_the_server_runs_with_the_preloaded_allocator(echo_repository, tmp_path, monkeypatch):
    import subprocess

    # a stand-in library (an allocator is not installed everywhere): what is checked is that
    # tritonserver is started with it loaded and reports it
    source = tmp_path / "stand_in.c"
    source.write_text("int llm_forge_stand_in(void) { return 0; }\n")
    library = tmp_path / "libtcmalloc_minimal.so.4"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    monkeypatch.setenv("LD_PRELOAD", str(library))
    with running_tritonserver(echo_repository, ready_timeout=120) as server:
        assert server.allocator == "tcmalloc"
        maps = (Path("/proc") / str(server.process.pid) / "maps").read_text()
        assert str(library) in maps


def test_start_refuses_a_missing_repository(tmp_path):
    from builder.serving.serve import start_tritonserver

    with pytest.raises(FileNotFoundError, match="no such directory"):
        start_tritonserver(tmp_path / "nope")


def test_forge_repository_reports_bad_options_naming_the_field(tmp_path):
    from click.testing import CliRunner

    from builder.cli.repository import repository_command

    result = CliRunner().invoke(repository_command, ["--engine", str(tmp_path), "--output",
                                                     str(tmp_path / "r"), "--set", "decoupled=2"])
    assert result.exit_code == 2 and "repository.decoupled" in result.output


def test_forge_repository_starts_from_the_specs_sections_and_applies_set(tmp_path):
    from click.testing import CliRunner

    from builder.cli.repository import repository_command
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

    from builder.cli.query import query_command

    url = f"127.0.0.1:{free_port()}"
    result = CliRunner().invoke(query_command, ["hi", "--url", url, "--protocol", protocol])
    assert result.exit_code == 1 and f"error: {url}" in result.output


def test_a_stop_at_the_exit_timeout_is_reported_with_what_was_in_flight(tmp_path):
    from builder.serving.serve import TritonServer

    log = tmp_path / "tritonserver.log"
    server = TritonServer(None, 1, 2, 3, log_path=log, workdir=tmp_path)
    log.write_text('server.cc:307] "Timeout 30: Found 0 model versions that have in-flight '
                   'inferences"\n')
    assert server.stuck_at_exit() == ""
    log.write_text('"Model \'ensemble\' (version 1) has 1 in-flight inferences"\n' * 3
                   + 'E1124 server.cc:353] "failed to stop server: Internal - Exit timeout '
                     'expired. Exiting immediately."\n')
    assert server.stuck_at_exit() == "Model 'ensemble' (version 1) has 1 in-flight inferences"
