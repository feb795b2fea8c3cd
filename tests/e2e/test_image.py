"""The CPU image, built and asked for a completion through its own `forge serve`.

`scripts/build_image.sh` builds it (a debootstrap base, then the Containerfile); the container
runs its default entrypoint and command — what a pod runs — with no network but its own
loopback, and a client inside it (`podman exec`) waits for readiness on the health port and
sends one completion to the OpenAI API with the API key, and one without it.
"""
import json
import os
import resource
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("IMAGE", "localhost/llm-forge:cpu")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("LLM_FORGE_IMAGE_TEST") != "1",
        reason="set LLM_FORGE_IMAGE_TEST=1 to build and run the CPU image: as root, with podman "
               "and debootstrap, it takes a debootstrap, a torch install and a kernel compile "
               "(tens of minutes on 2 cores), which CI's 90-minute budget does not carry"),
]

# Runs inside the container: readiness, then a completion with the key and one without, and
# the user forge serve (process 1, the entrypoint) runs as.
CLIENT = r"""
import json, sys, time, urllib.error, urllib.request
key = sys.argv[1]
deadline = time.monotonic() + 600
while True:
    try:
        with urllib.request.urlopen("http://127.0.0.1:8003/health/ready", timeout=5) as r:
            if r.status == 200:
                break
    except (OSError, urllib.error.URLError):
        pass
    if time.monotonic() > deadline:
        sys.exit("not ready within 600 s")
    time.sleep(1)
body = json.dumps({"model": "smollm2-135m", "prompt": "The capital of France is",
                   "max_tokens": 16, "temperature": 0}).encode()
def post(headers):
    request = urllib.request.Request("http://127.0.0.1:8080/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None
status, answer = post({"Authorization": f"Bearer {key}"})
unauthorized, _ = post({})
server_uid = [line.split()[1] for line in open("/proc/1/status") if line.startswith("Uid:")][0]
print(json.dumps({"status": status, "answer": answer, "without_key": unauthorized,
                  "server_uid": int(server_uid)}))
"""


def _podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          check=check)


def _limits() -> list[str]:
    """This process's own open-file limit and a bounded process count for the container:
    podman's defaults ask for more than a host without CAP_SYS_RESOURCE may grant, and runc
    then refuses to start ("error setting rlimit type 7: operation not permitted")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ["--ulimit", f"nofile={soft}:{hard}", "--ulimit", "nproc=4096:4096"]


@pytest.fixture(scope="module")
def image():
    if shutil.which("podman") is None or shutil.which("debootstrap") is None:
        pytest.fail("the image test needs podman and debootstrap (apt-get install podman debootstrap)")
    started = time.monotonic()
    build = subprocess.run(["bash", "scripts/build_image.sh"], cwd=ROOT, capture_output=True,
                           text=True, timeout=5400, env={**os.environ, "IMAGE": IMAGE})
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    size = int(_podman("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout)
    print(f"\nimage {IMAGE}: built in {time.monotonic() - started:.0f} s, {size / 1e6:.0f} MB")
    return IMAGE


def test_the_image_answers_a_completion_through_its_forge_serve(image):
    key = secrets.token_hex(16)
    name = f"llm-forge-smoke-{secrets.token_hex(4)}"
    _podman("run", "--detach", "--name", name, "--network", "none", *_limits(),
            "--env", f"LLM_FORGE_API_KEY={key}", image)
    try:
        result = _podman("exec", name, "python3", "-c", CLIENT, key, timeout=900, check=False)
        logs = _podman("logs", name, check=False)
        assert result.returncode == 0, result.stderr + logs.stdout[-4000:] + logs.stderr[-4000:]
        reply = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        _podman("rm", "--force", "--time", "30", name, check=False)
    assert reply["server_uid"] != 0  # forge serve (the container's first process) is not root
    assert reply["status"] == 200 and reply["without_key"] == 401
    text = reply["answer"]["choices"][0]["text"]
    print(f"completion: {text!r}")
    assert reply["answer"]["usage"]["completion_tokens"] > 0 and text.strip()
    assert "paris" in text.lower()  # SmolLM2-135M-Instruct, greedy, knows this one
