"""The build spec's `deployment:` section: how `forge deploy` runs the model on Kubernetes.

Validated field by field like the rest of the spec; every error names the key under
`deployment.` (e.g. `deployment.replicas: must be an integer >= 1, got -1`). What depends on the
rest of the spec (the GPU of the hardware profile, tp * pp, the target) is checked by
`check_against`, called from `BuildSpec.__post_init__`.

Defaults and why:
- `model_source: image`: the engine and the Triton repository are baked into the image, so an
  image tag names exactly one engine; a rollout is a new tag, a rollback the old one, and no
  storage class with ReadOnlyMany is needed. `volume` (a PVC) is for engines too large to pull
  on every node.
- `autoscaling.kind: keda`: the Prometheus query lives in the rendered ScaledObject, so the
  manifests are complete; `hpa` also needs a rule in the cluster's Prometheus adapter (rendered
  beside the manifests, installed by whoever runs the adapter).
- `triton_ports: loopback`: Triton's HTTP/gRPC ports take no API key; only the OpenAI port
  (which does) leaves the pod unless the spec says `gateway`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from builder.deploy.names import check_derived_names
from triton_backend.engine.numbers import is_int, is_number

MODEL_SOURCES = ("image", "volume")
# The CPU image's layout (Containerfile): its working directory, where `forge engine` wrote the
# engine and `model_repository/<name>`, and the uid that owns them and serves.
IMAGE_WORKDIR = "/opt/llm-forge/src"
IMAGE_UID = 10001
VOLUME_REPOSITORY = "/models/model_repository"  # with model_source volume (the claim at /models)
DEFAULT_MEMORY = "4Gi"  # where the engine's memory is not computed (a GPU, trtllm)
AUTOSCALERS = ("keda", "hpa", "none")
TRITON_EXPOSURES = ("loopback", "gateway")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?")
_SUFFIX = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def parse_quantity(key: str, value: Any) -> float:
    """A Kubernetes quantity (`2`, `500m`, `4Gi`) as a number; ValueError naming `key`."""
    match = _QUANTITY.fullmatch(str(value)) if is_number(value) or isinstance(value, str) else None
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{key}: expected a positive Kubernetes quantity like 2, 500m or 4Gi, "
                         f"got {value!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def check_dns_label(key: str, value: Any) -> None:
    if not isinstance(value, str) or not _DNS_LABEL.fullmatch(value):
        raise ValueError(f"{key}: a DNS label (lowercase letters, digits, '-', at most 63), "
                         f"got {value!r}")


def check_keys(key: str, klass: type, raw: Any) -> dict:
    """`raw` when it is a mapping of `klass`'s fields only; ValueError naming the key."""
    if not isinstance(raw, dict):
        raise ValueError(f"{key}: must be a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(klass)}
    for sub in raw:
        if sub not in known:
            raise ValueError(f"{key}.{sub}: unknown key (known: {sorted(known)})")
    return raw


@dataclass
class ResourcesSpec:
    """Per-pod CPU and memory (Kubernetes quantities), and the pod's /dev/shm.

    CPU request == limit by default: a Guaranteed pod gets whole CPUs, and the engine sizes its
    threads from the CFS quota. Memory left out is computed from the engine where it runs in the
    pod's memory (`builder/deploy/memory.py`: weights, KV cache, runtime, peak, 25% headroom),
    else `DEFAULT_MEMORY`; given, both or neither, and `forge deploy` refuses a limit under the
    computed one. /dev/shm carries Triton's Python-backend tensors (and MPI's between ranks); it
    is memory, counted in the memory limit.
    """

    cpu_request: str = "2"
    cpu_limit: str = "2"
    memory_request: str | None = None
    memory_limit: str | None = None
    shm_size: str = "1Gi"

    def __post_init__(self) -> None:
        if (self.memory_request is None) != (self.memory_limit is None):
            given = "memory_request" if self.memory_limit is None else "memory_limit"
            raise ValueError(f"deployment.resources.{given}: give memory_request and "
                             f"memory_limit both, or neither (computed from the engine)")
        for kind in ("cpu", "memory") if self.memory_limit is not None else ("cpu",):
            request = parse_quantity(f"deployment.resources.{kind}_request",
                                     getattr(self, f"{kind}_request"))
            limit = parse_quantity(f"deployment.resources.{kind}_limit",
                                   getattr(self, f"{kind}_limit"))
            if request > limit:
                raise ValueError(f"deployment.resources.{kind}_request "
                                 f"({getattr(self, f'{kind}_request')}) must be <= "
                                 f"{kind}_limit ({getattr(self, f'{kind}_limit')})")
        parse_quantity("deployment.resources.shm_size", self.shm_size)


@dataclass
class AutoscalingSpec:
    """Scaling on LLM load: waiting requests per replica and KV-cache fraction, never CPU.

    A replica is added when the mean waiting requests per replica exceed `queue_depth_target`
    or the mean KV-cache fraction exceeds `kv_cache_fraction_target`.
    """

    kind: str = "keda"
    min_replicas: int = 1
    max_replicas: int = 4
    queue_depth_target: float = 4.0
    kv_cache_fraction_target: float = 0.8
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"

    def __post_init__(self) -> None:
        if self.kind not in AUTOSCALERS:
            raise ValueError(f"deployment.autoscaling.kind: must be one of {list(AUTOSCALERS)}, "
                             f"got {self.kind!r}")
        for key in ("min_replicas", "max_replicas"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise ValueError(f"deployment.autoscaling.{key}: must be an integer >= 1, "
                                 f"got {value!r}")
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"deployment.autoscaling.min_replicas ({self.min_replicas}) must be "
                             f"<= max_replicas ({self.max_replicas})")
        if not is_number(self.queue_depth_target) or self.queue_depth_target <= 0:
            raise ValueError(f"deployment.autoscaling.queue_depth_target: must be a number > 0 "
                             f"(waiting requests per replica), got {self.queue_depth_target!r}")
        fraction = self.kv_cache_fraction_target
        if not is_number(fraction) or not 0 < fraction <= 1:
            raise ValueError(f"deployment.autoscaling.kv_cache_fraction_target: must be in "
                             f"(0, 1], got {fraction!r}")
        if not re.fullmatch(r"https?://\S+", str(self.prometheus_url)):
            raise ValueError(f"deployment.autoscaling.prometheus_url: an http(s) URL, "
                             f"got {self.prometheus_url!r}")


@dataclass
class DeploymentSpec:
    """Everything `forge deploy` needs beyond the engine: names, image, resources, policy.

    `name` defaults to the spec's name (lowercased), `api_key_secret` to `<name>-api-key` (key
    `api-key`), `triton_ports` to `loopback` (`gateway` when tp * pp > 1: NVIDIA's MPI launcher
    binds Triton to every address), `image` to NVIDIA's Triton TRT-LLM image only where that
    image serves as is (see `check_against`).
    """

    name: str | None = None
    namespace: str = "llm-forge"
    replicas: int = 2
    image: str | None = None
    model_source: str = "image"
    volume_claim: str | None = None
    repository_path: str | None = None  # default: where the model source puts it
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    node_selector: dict[str, str] | None = None
    api_key_secret: str | None = None
    drain_timeout: float = 30.0
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    gateway_namespace: str = "gateway"
    monitoring_namespace: str = "monitoring"
    client_namespaces: list[str] = field(default_factory=list)
    triton_ports: str | None = None
    run_as_user: int = IMAGE_UID

    def __post_init__(self) -> None:
        if isinstance(self.resources, dict):
            self.resources = ResourcesSpec(
                **check_keys("deployment.resources", ResourcesSpec, self.resources))
        if isinstance(self.autoscaling, dict):
            self.autoscaling = AutoscalingSpec(
                **check_keys("deployment.autoscaling", AutoscalingSpec, self.autoscaling))
        for key in ("namespace", "gateway_namespace", "monitoring_namespace"):
            check_dns_label(f"deployment.{key}", getattr(self, key))
        if self.name is not None:
            check_derived_names("deployment.name", self.name, self.namespace)
        if not isinstance(self.client_namespaces, list):
            raise ValueError("deployment.client_namespaces: must be a list of namespaces")
        for i, namespace in enumerate(self.client_namespaces):
            check_dns_label(f"deployment.client_namespaces[{i}]", namespace)
        if not is_int(self.replicas) or self.replicas < 1:
            raise ValueError(f"deployment.replicas: must be an integer >= 1, got {self.replicas!r}")
        self._check_source()
        if not is_number(self.drain_timeout) or not 0 <= self.drain_timeout <= 3600:
            raise ValueError(f"deployment.drain_timeout: seconds in [0, 3600], "
                             f"got {self.drain_timeout!r}")
        if self.triton_ports is not None and self.triton_ports not in TRITON_EXPOSURES:
            raise ValueError(f"deployment.triton_ports: must be one of {list(TRITON_EXPOSURES)}, "
                             f"got {self.triton_ports!r}")
        if self.node_selector is not None and not (
                isinstance(self.node_selector, dict)
                and all(isinstance(k, str) and isinstance(v, str)
                        for k, v in self.node_selector.items())):
            raise ValueError("deployment.node_selector: a mapping of label: value strings")
        if not is_int(self.run_as_user) or self.run_as_user < 1:
            raise ValueError(f"deployment.run_as_user: a non-root uid (an integer >= 1), "
                             f"got {self.run_as_user!r}")
        if self.api_key_secret is not None:
            check_dns_label("deployment.api_key_secret", self.api_key_secret)

    def _check_source(self) -> None:
        if self.model_source not in MODEL_SOURCES:
            raise ValueError(f"deployment.model_source: must be one of {list(MODEL_SOURCES)}, "
                             f"got {self.model_source!r}")
        if self.model_source == "volume":
            if not self.volume_claim:
                raise ValueError("deployment.volume_claim: required with model_source volume "
                                 "(the PersistentVolumeClaim holding the engine and repository)")
            check_dns_label("deployment.volume_claim", self.volume_claim)
            if self.repository_path is not None and not str(
                    self.repository_path).startswith("/models/"):
                raise ValueError(f"deployment.repository_path: the claim is mounted at /models; "
                                 f"the repository must be under it, got {self.repository_path!r}")
        elif self.volume_claim is not None:
            raise ValueError("deployment.volume_claim: only with model_source volume "
                             "(model_source image bakes the engine into the image)")
        if self.repository_path is not None and not str(self.repository_path).startswith("/"):
            raise ValueError(f"deployment.repository_path: an absolute path in the container, "
                             f"got {self.repository_path!r}")
        if self.image is not None and (not isinstance(self.image, str) or not self.image.strip()
                                       or any(c.isspace() for c in self.image)):
            raise ValueError(f"deployment.image: an image reference, got {self.image!r}")

    def check_against(self, spec_name: str, target: str, world_size: int) -> None:
        """What the rest of the spec decides: which image can serve, how Triton binds."""
        if self.name is None:
            self.name = spec_name.lower().replace("_", "-").replace(".", "-")
            check_derived_names("deployment.name (from name)", self.name, self.namespace)
        if self.api_key_secret is None:
            self.api_key_secret = f"{self.name}-api-key"
        if self.repository_path is None:  # the image's own (Containerfile), or the claim's
            self.repository_path = (f"{IMAGE_WORKDIR}/model_repository/{spec_name}"
                                    if self.model_source == "image" else VOLUME_REPOSITORY)
        multi_rank = target == "trtllm" and world_size > 1
        if self.triton_ports is None:
            self.triton_ports = "gateway" if multi_rank else "loopback"
        elif multi_rank and self.triton_ports == "loopback":
            raise ValueError(
                f"deployment.triton_ports: tp * pp = {world_size} runs tritonserver under MPI "
                f"(launch_triton_server.py), which binds Triton's ports to every address; use "
                f"gateway (the NetworkPolicy admits the gateway namespace only)")
        if self.image is None and not (multi_rank and self.model_source == "volume"):
            raise ValueError(
                "deployment.image: required: the llm-forge image (Containerfile, "
                "Containerfile.gpu) runs forge serve; NVIDIA's Triton image serves as is only "
                "with tp * pp > 1 and model_source volume")
