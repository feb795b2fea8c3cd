"""`forge deploy` renders manifests that the published schemas accept, from the CPU example and
a GPU profile (h100-80gb, trtllm, tp 2); spec errors exit 2 naming the field."""
from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from click.testing import CliRunner

from builder.cli import main
from deploy_helpers import (CUSTOM_KINDS, IN_CI, KUBERNETES_VERSION, REPO, all_objects,
                            crd_model_errors, inference_pool_errors, load_dir, name_errors,
                            npm_models_installed, one, shared_inference_pool_schemas)

CPU_SPEC = REPO / "examples" / "smollm2-135m.yaml"
GPU_SPEC = REPO / "examples" / "smollm2-135m-trtllm-tp2.yaml"


def render(spec: Path, out: Path) -> Path:
    result = CliRunner().invoke(main, ["deploy", "--spec", str(spec), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def rendered(request, tmp_path_factory) -> Path:
    spec = CPU_SPEC if request.param == "cpu" else GPU_SPEC
    return render(spec, tmp_path_factory.mktemp(request.param))


def test_writes_every_object_and_a_kustomization(rendered):
    kinds = sorted(o["kind"] for o in all_objects(rendered))
    autoscaler = "ScaledObject" if "scaledobject.yaml" in load_dir(rendered) \
        else "HorizontalPodAutoscaler"
    assert kinds == sorted([
        "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "NetworkPolicy",
        "ServiceMonitor", "InferencePool", autoscaler, "ServiceAccount", "Role", "RoleBinding",
        "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment", "Service"])


def test_core_objects_match_the_kubernetes_schemas(rendered):
    core = [o for o in all_objects(rendered) if o["kind"] not in CUSTOM_KINDS]
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    # The check has teeth: a misspelt field and a wrong type are refused.
    broken = copy.deepcopy([o for o in core if o["kind"] == "Deployment"][0])
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy([o for o in core if o["kind"] == "PodDisruptionBudget"][0])
    broken["spec"]["maxUnavailable"] = [1]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_custom_resources_match_their_published_schemas(rendered):
    if not npm_models_installed():
        message = "tests/crd_models/node_modules missing: run scripts/setup.sh (needs node, npm)"
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)
    objects = [o for o in all_objects(rendered) if o["kind"] in ("ServiceMonitor", "ScaledObject")]
    assert objects
    assert set(crd_model_errors(objects).values()) == {None}
    broken = copy.deepcopy(one(objects, "ServiceMonitor"))
    broken["spec"]["endpoints"][0]["port"] = 8002  # the schema wants the port's name
    assert crd_model_errors([broken])[f"ServiceMonitor/{broken['metadata']['name']}"]


def test_inference_pool_has_the_v1_fields(rendered):
    pool = one(all_objects(rendered), "InferencePool")
    assert inference_pool_errors(pool) == []
    broken = copy.deepcopy(pool)
    broken["spec"]["targetPorts"] = [{"number": 8080}, {"number": 8080}]
    broken["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    assert len(inference_pool_errors(broken)) == 2


def test_inference_pool_against_a_shared_crd_when_present(rendered):
    schemas = shared_inference_pool_schemas()
    if not schemas:
        pytest.skip("no InferencePool CRD under ../shared/crds/")
    import jsonschema

    pool = one(all_objects(rendered), "InferencePool")
    for _path, schema in schemas:
        jsonschema.validate(pool, schema)


def test_kubectl_kustomize_builds_the_directory(rendered):
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # a machine's own tool, not installed by the project's setup
        pytest.skip("kubectl not on PATH")
    built = subprocess.run([kubectl, "kustomize", str(rendered)], capture_output=True, text=True,
                           timeout=120, check=True).stdout
    objects = [d for d in yaml.safe_load_all(built) if d]
    assert len(objects) == len(all_objects(rendered))
    namespaced = [o for o in objects if not o["kind"].startswith("Cluster")]
    assert {o["metadata"]["namespace"] for o in namespaced} == {"llm-forge"}


def test_the_epp_config_names_our_metrics(rendered):
    objects = all_objects(rendered)
    config = yaml.safe_load(next(iter(one(objects, "ConfigMap")["data"].values())))
    assert config["kind"] == "EndpointPickerConfig"
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    engine = extractor["parameters"]["engineConfigs"][0]
    assert extractor["parameters"]["defaultEngine"] == engine["name"]
    assert engine["queuedRequestsSpec"] == "nv_trt_llm_request_metrics{request_type=waiting}"
    assert engine["runningRequestsSpec"] == "nv_trt_llm_request_metrics{request_type=scheduled}"
    assert engine["kvUsageSpec"] == \
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"
    pods = [o for o in objects if o["kind"] == "Deployment"]
    model = next(d for d in pods if "epp" not in d["metadata"]["name"])
    labels = model["spec"]["template"]["metadata"]["labels"]
    assert labels[extractor["parameters"]["engineLabelKey"]] == engine["name"]
    epp = next(d for d in pods if "epp" in d["metadata"]["name"])
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--model-server-metrics-port") + 1] == "8002"
    assert args[args.index("--pool-name") + 1] == one(objects, "InferencePool")["metadata"]["name"]


def test_lora_engines_route_by_adapter(tmp_path):
    from builder.deploy.context import context_of
    from builder.deploy.gateway import epp_config
    from builder.spec.load import load_spec
    from triton_backend.models.metrics import LORA_INFO_METRIC

    spec = load_spec(CPU_SPEC)
    spec.lora = object()  # only its presence matters to the EPP config
    config = epp_config(context_of(spec))
    extractor = next(p for p in config["plugins"] if p["type"] == "core-metrics-extractor")
    assert extractor["parameters"]["engineConfigs"][0]["loraSpec"] == LORA_INFO_METRIC
    assert {"pluginRef": "lora-affinity-scorer", "weight": 1} in \
        config["schedulingProfiles"][0]["plugins"]


@pytest.mark.parametrize("patch, message", [
    ({"replicas": -1}, "deployment.replicas: must be an integer >= 1, got -1"),
    ({"replica": 2}, "deployment.replica: unknown key"),
    ({"autoscaling": {"max_replica": 3}}, "deployment.autoscaling.max_replica: unknown key"),
    ({"autoscaling": {"kind": "vpa"}}, "deployment.autoscaling.kind: must be one of"),
    ({"autoscaling": {"min_replicas": 5, "max_replicas": 2}},
     "deployment.autoscaling.min_replicas (5) must be <= max_replicas (2)"),
    ({"resources": {"cpu_request": "4", "cpu_limit": "2"}},
     "deployment.resources.cpu_request (4) must be <= cpu_limit (2)"),
    ({"resources": {"memory_request": "4Gi", "memory_limit": "lots"}},
     "deployment.resources.memory_limit: expected"),
    ({"resources": {"memory_limit": "8Gi"}}, "deployment.resources.memory_limit: give "
     "memory_request and memory_limit both, or neither (computed from the engine)"),
    ({"resources": {"memory_request": "3Gi", "memory_limit": "3Gi"}},
     "deployment.resources.memory_limit: 3Gi is under 4096 MiB, the engine's need with 25% "
     "headroom (weights 257 + KV cache 1024 + runtime 1664 + peak under load 322 = 3266 MiB)"),
    ({"resources": {"memory_request": "3Gi", "memory_limit": "5Gi"}},
     "deployment.resources.memory_request: 3Gi is under 3266 MiB, the engine's need (weights"),
    ({"model_source": "volume"}, "deployment.volume_claim: required"),
    ({"triton_ports": "world"}, "deployment.triton_ports: must be one of"),
    ({"image": None}, "deployment.image: required"),
    ({"drain_timeout": -5}, "deployment.drain_timeout: seconds in [0, 3600]"),
])
def test_spec_errors_exit_2_naming_the_field(tmp_path, patch, message):
    data = yaml.safe_load(CPU_SPEC.read_text())
    data["deployment"].update(patch)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["deploy", "--spec", str(spec), "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "deployment.yaml").exists()


def _deploy(tmp_path: Path, data: dict):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    return CliRunner().invoke(main, ["deploy", "--spec", str(spec), "--out",
                                     str(tmp_path / "out")])


def test_every_rendered_name_passes_its_kubernetes_rule_at_the_longest_name(tmp_path, rendered):
    assert name_errors(all_objects(rendered)) == []
    data = yaml.safe_load((CPU_SPEC if "cpu" in rendered.name else GPU_SPEC).read_text())
    data["deployment"].update(name="m" * 59, namespace="n" * 63)  # the longest accepted
    result = _deploy(tmp_path, data)
    assert result.exit_code == 0, result.output
    assert name_errors(all_objects(tmp_path / "out")) == []


@pytest.mark.parametrize("patch, message", [
    ({"name": "m" * 60}, "deployment.name: '" + "m" * 60 + "' gives the endpoint picker's "
     "Service '" + "m" * 60 + "-epp', which has 64 characters; a DNS-1035 label has at most 63"),
    ({"name": "9model"}, "deployment.name: '9model' is not a DNS-1035 label (lowercase letters, "
     "digits and '-', a letter first"),
    ({"name": "m" * 64}, "deployment.name: '" + "m" * 64 + "' has 64 characters"),
    ({"name": "Model"}, "deployment.name: 'Model' is not a DNS-1035 label"),
])
def test_a_name_kubernetes_would_refuse_exits_2_naming_the_field(tmp_path, patch, message):
    data = yaml.safe_load(CPU_SPEC.read_text())
    data["deployment"].update(patch)
    result = _deploy(tmp_path, data)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()


def test_a_name_taken_from_the_spec_is_checked_too(tmp_path):
    data = yaml.safe_load(CPU_SPEC.read_text())
    data["deployment"].pop("name", None)
    data["name"] = "7b-chat"
    result = _deploy(tmp_path, data)
    assert result.exit_code == 2, result.output
    assert "deployment.name (from name): '7b-chat' is not a DNS-1035 label" in result.output


def test_a_spec_without_a_deployment_section_exits_2(tmp_path):
    data = yaml.safe_load(CPU_SPEC.read_text())
    del data["deployment"]
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["deploy", "--spec", str(spec), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "deployment: the spec has no deployment" in result.output


def test_multi_rank_keeps_triton_off_loopback_only_by_saying_so(tmp_path):
    data = yaml.safe_load(GPU_SPEC.read_text())
    data["deployment"]["triton_ports"] = "loopback"
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["deploy", "--spec", str(spec), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "deployment.triton_ports: tp * pp = 2" in result.output


def test_the_deployment_section_leaves_the_build_key_alone(tmp_path):
    from builder.pipeline.build_key import FileHasher, components, digest

    (tmp_path / "config.json").write_text("{}")
    data = {**yaml.safe_load(CPU_SPEC.read_text()), "checkpoint": str(tmp_path)}
    without = {k: v for k, v in data.items() if k != "deployment"}
    assert digest(components(data, FileHasher())) == digest(components(without, FileHasher()))
