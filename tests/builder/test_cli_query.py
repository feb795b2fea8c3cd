"""`forge query` against a port where nothing answers: the same words over gRPC and HTTP."""
import socket

import pytest
from click.testing import CliRunner

from builder.cli import main


@pytest.fixture
def dead_port():
    """A loopback port that is bound but not listening: a connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize("protocol", [["--protocol", "grpc"], ["--protocol", "http"],
                                      ["--protocol", "http", "--stream"]],
                         ids=["grpc", "http", "http-stream"])
def test_a_dead_port_is_not_reachable_in_every_protocol(dead_port, protocol):
    url = f"127.0.0.1:{dead_port}"
    result = CliRunner().invoke(main, ["query", "hi", "--url", url, *protocol])
    assert result.exit_code == 1, result.output
    assert f"error: {url}: server not reachable (" in result.output
    assert "start one (`make serve`) or name its port with --url" in result.output
    assert "URLError" not in result.output and "ConnectionError" not in result.output
