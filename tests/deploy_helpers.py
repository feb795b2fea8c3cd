"""Helpers of the `forge deploy` tests: render, load, and check against published schemas.

- Core objects: `kubernetes-validate` (PyPI), its bundled Kubernetes 1.37 OpenAPI schemas.
- ServiceMonitor, ScaledObject: the npm packages `@kubernetes-models/prometheus-operator` and
  `@kubernetes-models/keda` (generated from the upstream CRDs; pinned in
  tests/crd_models/package-lock.json, installed by scripts/setup.sh).
- InferencePool: no registry package carries its schema, so `inference_pool_errors` checks the
  v1 fields as the Go types of gateway-api-inference-extension v1.5.0 declare them
  (api/v1/inferencepool_types.go, api/v1/shared_types.go: kubebuilder markers); and
  `shared_crd_errors` validates against that CRD's openAPIV3Schema when a CRD YAML sits in
  `../shared/crds/` beside the repository.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
CRD_MODELS = REPO / "tests" / "crd_models"
SHARED_CRDS = REPO.parent / "shared" / "crds"
KUBERNETES_VERSION = "1.37.0"
CUSTOM_KINDS = {"ServiceMonitor", "ScaledObject", "InferencePool"}
IN_CI = os.environ.get("CI", "").lower() == "true"


def load_dir(out: Path) -> dict[str, list[dict]]:
    """file name -> objects, for the files kustomization.yaml lists."""
    kustomization = yaml.safe_load((out / "kustomization.yaml").read_text())
    return {name: [d for d in yaml.safe_load_all((out / name).read_text()) if d]
            for name in kustomization["resources"]}


def all_objects(out: Path) -> list[dict]:
    return [obj for docs in load_dir(out).values() for obj in docs]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
    return found[0]


def options(args: list[str]) -> dict[str, str | None]:
    """`--flag value` / `--flag=value` / bare `--flag` -> {flag: value}."""
    parsed: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            if eq:
                parsed[key] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                parsed[key] = args[i + 1]
                i += 1
            else:
                parsed[key] = None
        i += 1
    return parsed


def npm_models_installed() -> bool:
    return (CRD_MODELS / "node_modules" / "@kubernetes-models").is_dir() \
        and shutil.which("node") is not None


def crd_model_errors(objects: list[dict]) -> dict[str, str | None]:
    """kind/name -> the published schema's error (None: valid), via tests/crd_models."""
    result = subprocess.run(["node", "validate.mjs"], cwd=CRD_MODELS, input=json.dumps(objects),
                            capture_output=True, text=True, timeout=120, check=True)
    return {f"{r['kind']}/{r['name']}": r["error"] for r in json.loads(result.stdout)}


_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_GROUP = re.compile(r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_KIND = re.compile(r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$")


def _port_errors(where: str, port: object) -> list[str]:
    if not isinstance(port, dict) or set(port) != {"number"}:
        return [f"{where}: exactly {{number}}"]
    number = port["number"]
    ok = isinstance(number, int) and not isinstance(number, bool) and 1 <= number <= 65535
    return [] if ok else [f"{where}.number: an integer in [1, 65535]"]


def inference_pool_errors(pool: dict) -> list[str]:
    """The v1 InferencePool's fields and constraints (gateway-api-inference-extension v1.5.0)."""
    errors = []
    if pool.get("apiVersion") != "inference.networking.k8s.io/v1":
        errors.append("apiVersion: inference.networking.k8s.io/v1")
    spec = pool.get("spec") or {}
    unknown = set(spec) - {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    errors += [f"spec.{key}: unknown field" for key in sorted(unknown)]
    selector = spec.get("selector")
    labels = selector.get("matchLabels") if isinstance(selector, dict) else None
    if not isinstance(selector, dict) or set(selector) != {"matchLabels"} \
            or not isinstance(labels, dict) or not 1 <= len(labels) <= 64:
        errors.append("spec.selector: required, matchLabels only, 1 to 64 labels")
    else:
        for key, value in labels.items():
            if len(key) > 253 or not _LABEL_KEY.match(key):
                errors.append(f"spec.selector.matchLabels: bad key {key!r}")
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                errors.append(f"spec.selector.matchLabels.{key}: bad value {value!r}")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8:
        errors.append("spec.targetPorts: 1 to 8 ports required")
    else:
        for i, port in enumerate(ports):
            errors += _port_errors(f"spec.targetPorts[{i}]", port)
        numbers = [p.get("number") for p in ports if isinstance(p, dict)]
        if len(set(numbers)) != len(numbers):
            errors.append("spec.targetPorts: port number must be unique")
    if spec.get("appProtocol", "http") not in ("http", "kubernetes.io/h2c"):
        errors.append("spec.appProtocol: http or kubernetes.io/h2c")
    errors += _picker_ref_errors(spec.get("endpointPickerRef"))
    return errors


def _picker_ref_errors(ref: object) -> list[str]:
    if not isinstance(ref, dict):
        return ["spec.endpointPickerRef: required"]
    errors = [f"spec.endpointPickerRef.{key}: unknown field"
              for key in sorted(set(ref) - {"group", "kind", "name", "port", "failureMode"})]
    name = ref.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 253:
        errors.append("spec.endpointPickerRef.name: required, 1 to 253 characters")
    group, kind = ref.get("group", ""), ref.get("kind", "Service")
    if not isinstance(group, str) or len(group) > 253 or not _GROUP.match(group):
        errors.append("spec.endpointPickerRef.group: a DNS subdomain or empty")
    if not isinstance(kind, str) or len(kind) > 63 or not _KIND.match(kind):
        errors.append("spec.endpointPickerRef.kind: a Kind")
    if "port" in ref:
        errors += _port_errors("spec.endpointPickerRef.port", ref["port"])
    elif kind == "Service":
        errors.append("spec.endpointPickerRef.port: required for a Service")
    if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
        errors.append("spec.endpointPickerRef.failureMode: FailOpen or FailClose")
    return errors


def shared_inference_pool_schemas() -> list[tuple[Path, dict]]:
    """(CRD file, v1 openAPIV3Schema) of every InferencePool CRD under ../shared/crds/."""
    found = []
    for path in sorted(SHARED_CRDS.glob("*.y*ml")) if SHARED_CRDS.is_dir() else []:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition" \
                    or doc["spec"]["names"]["kind"] != "InferencePool":
                continue
            for version in doc["spec"]["versions"]:
                if version["name"] == "v1":
                    found.append((path, version["schema"]["openAPIV3Schema"]))
    return found


# Kubernetes' name rules (apimachinery's validation), written out here apart from the code under
# test: Services DNS-1035 labels, namespaces DNS-1123 labels, other objects DNS-1123 subdomains.
_DNS_1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NAME_RULES = {
    "Service": (re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?"), 63),
    "Namespace": (re.compile(_DNS_1123_LABEL), 63),
}
_SUBDOMAIN = (re.compile(rf"{_DNS_1123_LABEL}(\.{_DNS_1123_LABEL})*"), 253)


def name_errors(objects: list[dict]) -> list[str]:
    """Every object name, namespace and label value that the API server would refuse."""
    errors = []

    def check(what: str, value: object, rule: tuple[re.Pattern, int]) -> None:
        pattern, limit = rule
        if not isinstance(value, str) or len(value) > limit or not pattern.fullmatch(value):
            errors.append(f"{what}: {value!r}")

    for obj in objects:
        meta, kind = obj["metadata"], obj["kind"]
        check(f"{kind} name", meta["name"], _NAME_RULES.get(kind, _SUBDOMAIN))
        if "namespace" in meta:
            check(f"{kind} {meta['name']} namespace", meta["namespace"], _NAME_RULES["Namespace"])
        for key, value in meta.get("labels", {}).items():
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                errors.append(f"{kind} {meta['name']} label {key}: {value!r}")
    return errors
