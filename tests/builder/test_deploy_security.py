"""What the rendered manifests promise, read back from them: selectors that select the
Deployment's pods, probes on forge serve's endpoints, a drain shorter than the grace period,
limits, non-root, and no port that serves inference without the API key to a client outside
the allowed namespaces."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from builder.cli import main
from builder.cli.serve import serve_command
from builder.serving.health import LIVENESS_PATH, READINESS_PATH, STARTUP_PATH
from deploy_helpers import REPO, all_objects, one, options

SPECS = {"cpu": REPO / "examples" / "smollm2-135m.yaml",
         "gpu": REPO / "examples" / "smollm2-135m-trtllm-tp2.yaml"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
NAMESPACE_LABEL = "kubernetes.io/metadata.name"


@pytest.fixture(scope="module", params=sorted(SPECS))
def case(request, tmp_path_factory):
    """(profile, spec data, rendered objects)."""
    out = tmp_path_factory.mktemp(request.param)
    result = CliRunner().invoke(main, ["deploy", "--spec", str(SPECS[request.param]),
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    return request.param, yaml.safe_load(SPECS[request.param].read_text()), all_objects(out)


PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
LOOPBACK_GET = re.compile(r"urllib\.request\.urlopen\('http://127\.0\.0\.1:(\d+)(/[^']*)'")


def probe_target(probe: dict) -> dict:
    """{path, port} an HTTP probe asks: an httpGet, or an exec probe's GET on loopback."""
    if "httpGet" in probe:
        return probe["httpGet"]
    command = probe["exec"]["command"]
    assert command[:2] == ["python3", "-c"], command
    port, path = LOOPBACK_GET.search(command[2]).groups()
    return {"path": path, "port": int(port)}


def model_deployment(objects: list[dict]) -> dict:
    return next(o for o in objects if o["kind"] == "Deployment"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == "model-server")


def server(objects: list[dict]) -> dict:
    return model_deployment(objects)["spec"]["template"]["spec"]["containers"][0]


def test_every_selector_selects_the_deployments_pods(case):
    _, _, objects = case
    deployment = model_deployment(objects)
    selector = deployment["spec"]["selector"]["matchLabels"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    model_policy = next(o for o in objects if o["kind"] == "NetworkPolicy"
                        and o["metadata"]["name"] == deployment["metadata"]["name"])
    for selecting in (one(objects, "Service", deployment["metadata"]["name"])["spec"]["selector"],
                      one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                      one(objects, "InferencePool")["spec"]["selector"]["matchLabels"],
                      model_policy["spec"]["podSelector"]["matchLabels"]):
        assert selecting == selector
    autoscaler = next(o for o in objects if o["kind"] in ("HorizontalPodAutoscaler",
                                                          "ScaledObject"))
    ref = autoscaler["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
    monitor = one(objects, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    service = one(objects, "Service", deployment["metadata"]["name"])
    assert monitor.items() <= service["metadata"]["labels"].items()
    picker = one(objects, "InferencePool")["spec"]["endpointPickerRef"]
    epp_service = one(objects, "Service", picker["name"])
    assert picker["port"]["number"] in [p["port"] for p in epp_service["spec"]["ports"]]
    epp = one(objects, "Deployment", picker["name"])
    assert epp_service["spec"]["selector"].items() <= \
        epp["spec"]["template"]["metadata"]["labels"].items()


def test_forge_serve_knows_every_rendered_flag(case):
    """Against whatever forge serve and forge drain accept in this tree."""
    profile, _, objects = case
    container = server(objects)
    if profile == "gpu":
        pytest.skip("tp * pp > 1 runs NVIDIA's launcher, not forge serve")
    assert container["command"] == ["forge"] and container["args"][0] == "serve"
    known = {opt for param in serve_command.params for opt in param.opts}
    assert set(options(container["args"])) - known == set()
    drain = container["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:2] == ["forge", "drain"]
    assert "drain" in main.commands, "forge drain is missing"
    drain_known = {opt for param in main.commands["drain"].params for opt in param.opts}
    assert set(options(drain[2:])) - drain_known == set()


def test_probes_drain_grace_limits_and_non_root(case):
    profile, data, objects = case
    pod = model_deployment(objects)["spec"]["template"]["spec"]
    container = server(objects)
    probes = {kind: probe_target(container[kind]) for kind in PROBES}
    drain_timeout = data["deployment"]["drain_timeout"]
    if profile == "cpu":
        args = options(container["args"])
        assert {k: (v["path"], v["port"]) for k, v in probes.items()} == {
            "startupProbe": (STARTUP_PATH, int(args["--health-port"])),
            "readinessProbe": (READINESS_PATH, int(args["--health-port"])),
            "livenessProbe": (LIVENESS_PATH, int(args["--health-port"]))}
        assert float(args["--drain-timeout"]) == drain_timeout
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert options(pre_stop[2:]) == {"--health-port": args["--health-port"], "--wait": None}
    else:
        assert {v["path"] for v in probes.values()} == {"/v2/health/ready", "/v2/health/live"}
        assert {v["port"] for v in probes.values()} == {8000}
        assert f"--exit_timeout {drain_timeout}" in container["args"][0]
    assert pod["terminationGracePeriodSeconds"] > drain_timeout
    for kind in ("cpu", "memory"):
        assert container["resources"]["limits"][kind]
        assert container["resources"]["requests"][kind]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= mounts


def test_the_gpu_profile_runs_nvidias_image_under_mpi(case):
    profile, data, objects = case
    if profile != "gpu":
        pytest.skip("GPU profile only")
    pod = model_deployment(objects)["spec"]["template"]["spec"]
    container = server(objects)
    assert container["image"] == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    assert "launch_triton_server.py --world_size 2 " in container["args"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in pod["tolerations"]
    assert pod["volumes"][-1]["persistentVolumeClaim"]["claimName"] == \
        data["deployment"]["volume_claim"]


def bound_ports(profile: str, container: dict) -> dict[int, str]:
    """Port -> the address it binds to, from the rendered command line."""
    if profile == "gpu":  # launch_triton_server.py gives tritonserver no address: all of them
        script = container["args"][0]
        return {int(script.split(f"--{flag} ")[1].split()[0]): "0.0.0.0"
                for flag in ("http_port", "grpc_port", "metrics_port")}
    args = options(container["args"])
    return {int(args["--openai-port"]): args["--host"],
            int(args["--health-port"]): args["--host"],
            int(args["--http-port"]): args["--triton-host"],
            int(args["--grpc-port"]): args["--triton-host"],
            int(args["--metrics-port"]): args["--metrics-host"]}


def admitted(policy: dict, port: int) -> list[dict] | None:
    """The peers the policy admits to `port`; None: anyone (a rule with no `from`)."""
    peers: list[dict] = []
    for rule in policy["spec"].get("ingress", []):
        if rule.get("ports") and port not in [p["port"] for p in rule["ports"]]:
            continue
        if not rule.get("from"):
            return None
        peers += rule["from"]
    return peers


def test_no_inference_without_the_key_from_outside_the_allowed_set(case):
    profile, data, objects = case
    container = server(objects)
    deployment = model_deployment(objects)
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy"
                  and o["spec"]["podSelector"]["matchLabels"]
                  == deployment["spec"]["selector"]["matchLabels"])
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # what no rule admits is refused
    d = data["deployment"]
    gateway = d.get("gateway_namespace", "gateway")
    allowed = {gateway, *d.get("client_namespaces", [])}
    ports = bound_ports(profile, container)
    env = {e["name"]: e for e in container["env"]}
    inference = {8080: "openai", 8000: "triton-http", 8001: "triton-grpc"}
    for port, host in ports.items():
        if port not in inference or host in LOOPBACK:
            continue
        peers = admitted(policy, port)
        assert peers is not None, f"port {port} ({host}) is open to every pod"
        namespaces = {p["namespaceSelector"]["matchLabels"][NAMESPACE_LABEL] for p in peers}
        assert all(set(p) == {"namespaceSelector"} for p in peers)
        if inference[port] == "openai":
            assert "secretKeyRef" in env["LLM_FORGE_API_KEY"]["valueFrom"]
            assert "--api-key" not in container["args"]  # never in the pod spec in clear
            assert namespaces <= allowed
        else:  # Triton's own ports take no key: the gateway namespace only
            assert namespaces == {gateway}
    # Triton bound to loopback is neither a container port nor in the Service.
    exposed = {p["containerPort"] for p in container["ports"]}
    assert {p for p, h in ports.items() if h in LOOPBACK}.isdisjoint(exposed)
    service = one(objects, "Service", deployment["metadata"]["name"])
    assert {p["port"] for p in service["spec"]["ports"]} <= exposed


def _network_port(container: dict, probe: dict) -> int | None:
    """The port a network probe (httpGet, tcpSocket, grpc) reaches, named ports resolved; None
    for an exec probe, which the kubelet runs inside the container."""
    for kind in ("httpGet", "tcpSocket", "grpc"):
        if kind in probe:
            port = probe[kind]["port"]
            if isinstance(port, str):
                port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
            return port
    assert "exec" in probe, probe
    return None


def test_the_kubelet_reaches_every_probe_of_every_deployment(case):
    """The kubelet probes from the node, which no NetworkPolicy rule names portably: a network
    probe's port must be open to every source in each policy that selects the pod; an exec
    probe runs inside the container and asks its loopback."""
    profile, _, objects = case
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    probed = 0
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selecting = [p for p in policies
                     if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
        assert selecting, deployment["metadata"]["name"]
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for kind in (k for k in PROBES if k in container):
                probed += 1
                port = _network_port(container, container[kind])
                if port is None:
                    assert probe_target(container[kind])["port"] in \
                        bound_ports(profile, container)
                    continue
                for policy in selecting:
                    assert admitted(policy, port) is None, (
                        f"{profile}: {deployment['metadata']['name']}'s {kind} asks port {port}, "
                        f"which NetworkPolicy {policy['metadata']['name']} admits only from "
                        f"{admitted(policy, port)}")
    assert probed >= 5


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/v2/health/ready" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_an_exec_probe_passes_on_200_and_fails_otherwise(case):
    profile, _, objects = case
    container = server(objects)
    execs = [container[k] for k in PROBES if "exec" in container[k]]
    if not execs:
        pytest.skip(f"{profile}: no exec probes")
    stand_in = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    try:
        for probe in execs:
            target = probe_target(probe)
            script = probe["exec"]["command"][2].replace(
                f":{target['port']}/", f":{stand_in.server_address[1]}/")
            code = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                  timeout=30).returncode
            assert (code == 0) == (target["path"] == "/v2/health/ready"), (target, code)
    finally:
        stand_in.shutdown()
        stand_in.server_close()


def test_metrics_reach_monitoring_gateway_and_the_picker_only(case):
    _, data, objects = case
    deployment = model_deployment(objects)
    policy = one(objects, "NetworkPolicy", deployment["metadata"]["name"])
    peers = admitted(policy, 8002)
    namespaces = {p["namespaceSelector"]["matchLabels"][NAMESPACE_LABEL]
                  for p in peers if "namespaceSelector" in p}
    d = data["deployment"]
    assert namespaces == {d.get("monitoring_namespace", "monitoring"),
                          d.get("gateway_namespace", "gateway")}
    epp = next(o for o in objects if o["kind"] == "Deployment" and o is not deployment)
    pod_peers = [p["podSelector"]["matchLabels"] for p in peers if "podSelector" in p]
    assert pod_peers == [epp["spec"]["template"]["metadata"]["labels"]]


def test_hpa_metrics_are_the_adapter_rules(tmp_path: Path):
    out = tmp_path / "gpu"
    CliRunner().invoke(main, ["deploy", "--spec", str(SPECS["gpu"]), "--out", str(out)])
    hpa = one(all_objects(out), "HorizontalPodAutoscaler")
    served = {r["name"]["as"] for r in yaml.safe_load(
        (out / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"]}
    assert {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == served
