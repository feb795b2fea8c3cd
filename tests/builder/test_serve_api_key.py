"""An empty API key never switches authentication off: `forge serve` refuses it from the flag and
from `LLM_FORGE_API_KEY` (exit 2, naming which) before it starts anything, and the rendered
Deployment, whose key comes from its Secret, cannot start with an empty one."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from builder.cli import main
from builder.cli.serve import serve_command
from deploy_helpers import REPO, all_objects, options

API_KEY_ENV = "LLM_FORGE_API_KEY"


@pytest.fixture
def no_server(monkeypatch):
    """Any start of tritonserver fails the test: the key must be refused before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("tritonserver started with an empty API key")

    monkeypatch.setattr("builder.serving.serve.start_tritonserver", refuse)
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def _serve(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(serve_command, args, env=env)


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_key_in_the_environment_exits_2_naming_it(tmp_path, no_server, value):
    result = _serve(["--repository", str(tmp_path), "--host", "0.0.0.0", "--health-port", "0",
                     "--openai-port", "0"], env={API_KEY_ENV: value})
    assert result.exit_code == 2, result.output
    assert f"error: {API_KEY_ENV}" in result.output
    assert "tritonserver started" not in result.output


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_key_flag_exits_2_naming_it(tmp_path, no_server, value):
    result = _serve(["--repository", str(tmp_path), "--health-port", "0", "--api-key", value])
    assert result.exit_code == 2, result.output
    assert "error: --api-key: must not be empty" in result.output


def test_the_rendered_deployment_cannot_start_with_an_empty_secret(tmp_path, no_server):
    """The pod's own command line, its key from a Secret made with `--from-literal=api-key=`
    of an unset variable: forge serve exits 2 (the pod never serves), naming the variable."""
    out = tmp_path / "manifests"
    rendered = CliRunner().invoke(main, ["deploy", "--spec", str(REPO / "examples" /
                                                                 "smollm2-135m.yaml"),
                                         "--out", str(out)])
    assert rendered.exit_code == 0, rendered.output
    deployment = next(o for o in all_objects(out) if o["kind"] == "Deployment"
                      and o["metadata"]["labels"]["app.kubernetes.io/component"]
                      == "model-server")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    envvar = next(p for p in serve_command.params if p.name == "api_key").envvar
    secret = env[envvar]["valueFrom"]["secretKeyRef"]
    assert secret.get("optional", False) is False  # a missing Secret or key: the pod waits
    args = container["args"]
    assert args[0] == "serve" and options(args)["--host"] == "0.0.0.0"
    at = args.index("--repository") + 1
    args = [*args[1:at], str(tmp_path), *args[at + 1:]]  # the image's path does not exist here
    result = _serve(args, env={envvar: ""})
    assert result.exit_code == 2, result.output
    assert f"error: {API_KEY_ENV} is set but empty" in result.output
