"""What every manifest of one deployment shares, worked out once from the build spec.

Ports are the contract's: OpenAI API 8080 (behind the API key), forge serve's health port 8003,
Triton HTTP 8000 / gRPC 8001 (loopback unless exposed to the gateway), Triton metrics 8002.
"""
from __future__ import annotations

from dataclasses import dataclass

from builder.deploy.memory import MemoryEstimate
from builder.deploy.names import epp_name
from builder.spec.deployment import DEFAULT_MEMORY, DeploymentSpec
from builder.spec.hardware import PROFILES
from builder.serving.health import DEFAULT_HEALTH_PORT
from builder.spec.build_spec import BuildSpec

OPENAI_PORT = 8080
HEALTH_PORT = DEFAULT_HEALTH_PORT
TRITON_HTTP_PORT = 8000
TRITON_GRPC_PORT = 8001
METRICS_PORT = 8002
LOOPBACK = "127.0.0.1"
ALL_ADDRESSES = "0.0.0.0"
# The kubelet's SIGKILL comes terminationGracePeriodSeconds after the preStop starts; the drain
# needs its timeout plus the time to cancel what is left and for tritonserver to unload.
DRAIN_MARGIN_SECONDS = 15
# Startup budget: the engine loads and, on a first start of the CPU image, compiles its kernels.
STARTUP_SECONDS = 900

# NVIDIA's Triton container with TensorRT-LLM 1.2.1 (the trtllm target's pin; README, GPU
# deployment; scripts/gpu.sh smoke) and its MPI launcher for tp * pp > 1.
TRITON_TRTLLM_IMAGE = "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
LAUNCH_TRITON_SERVER = "/app/scripts/launch_triton_server.py"
GPU_RESOURCE = "nvidia.com/gpu"
# The label NVIDIA's GPU feature discovery puts on a node (SXM parts; PCIe nodes differ: set
# deployment.node_selector).
GPU_PRODUCTS = {"l4": "NVIDIA-L4", "a100-40gb": "NVIDIA-A100-SXM4-40GB",
                "a100-80gb": "NVIDIA-A100-SXM4-80GB", "h100-80gb": "NVIDIA-H100-80GB-HBM3"}
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# Any GPU node (`hardware: cuda`): the label NVIDIA's GPU operator puts on every node with a GPU.
GPU_PRESENT = {"nvidia.com/gpu.present": "true"}
# The endpoint picker chooses metric names by this pod label (gateway-api-inference-extension).
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "llm-forge"


@dataclass(frozen=True)
class DeployContext:
    """Names, labels and the shape of the pod, shared by every object `forge deploy` renders;
    `memory_estimate`: the engine's memory where it runs in the pod's (`memory.py`)."""

    spec: BuildSpec
    deployment: DeploymentSpec
    memory_estimate: MemoryEstimate | None = None

    @property
    def memory(self) -> tuple[str, str]:
        """(request, limit): the spec's, else the estimate with headroom, else DEFAULT_MEMORY."""
        r = self.deployment.resources
        if r.memory_request is not None and r.memory_limit is not None:
            return str(r.memory_request), str(r.memory_limit)
        if self.memory_estimate is not None:
            return self.memory_estimate.quantity, self.memory_estimate.quantity
        return DEFAULT_MEMORY, DEFAULT_MEMORY

    @property
    def name(self) -> str:
        if self.deployment.name is None:  # DeploymentSpec.check_against names it
            raise ValueError("deployment.name: unset; build the spec with spec_from_dict")
        return self.deployment.name

    @property
    def namespace(self) -> str:
        return self.deployment.namespace

    @property
    def selector(self) -> dict[str, str]:
        """The labels every selector uses: the Deployment's pods and nothing else."""
        return {"app.kubernetes.io/name": "llm-forge", "app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": "model-server"}

    @property
    def pod_labels(self) -> dict[str, str]:
        return {**self.selector, ENGINE_TYPE_LABEL: ENGINE_TYPE}

    def labels(self, component: str) -> dict[str, str]:
        """Labels of an object that is not a model-server pod (the endpoint picker, policies)."""
        return {"app.kubernetes.io/name": "llm-forge", "app.kubernetes.io/instance": self.name,
                "app.kubernetes.io/component": component}

    def metadata(self, suffix: str = "", component: str = "model-server") -> dict:
        return {"name": f"{self.name}{suffix}", "namespace": self.namespace,
                "labels": self.labels(component)}

    @property
    def epp_name(self) -> str:
        return epp_name(self.name)

    @property
    def multi_rank(self) -> bool:
        """tp * pp > 1: tritonserver runs one rank per GPU under MPI, without forge serve."""
        return self.spec.target == "trtllm" and self.spec.parallelism.world_size > 1

    @property
    def gpus(self) -> int:
        return self.spec.parallelism.world_size if PROFILES[self.spec.hardware].is_gpu else 0

    @property
    def triton_exposed(self) -> bool:
        return self.deployment.triton_ports == "gateway"

    @property
    def triton_host(self) -> str:
        return ALL_ADDRESSES if self.triton_exposed else LOOPBACK

    @property
    def image(self) -> str:
        return self.deployment.image or TRITON_TRTLLM_IMAGE

    @property
    def serving_port(self) -> int:
        """The port clients and the gateway send inference to: the OpenAI API, or Triton's
        HTTP port where forge serve does not run (tp * pp > 1)."""
        return TRITON_HTTP_PORT if self.multi_rank else OPENAI_PORT

    @property
    def grace_period_seconds(self) -> int:
        return int(self.deployment.drain_timeout) + DRAIN_MARGIN_SECONDS

    @property
    def node_selector(self) -> dict[str, str]:
        if self.deployment.node_selector is not None:
            return dict(self.deployment.node_selector)
        if self.gpus:
            product = GPU_PRODUCTS.get(self.spec.hardware)
            return {GPU_PRODUCT_LABEL: product} if product else dict(GPU_PRESENT)
        return {"kubernetes.io/arch": "amd64"}


def context_of(spec: BuildSpec, memory_estimate: MemoryEstimate | None = None
               ) -> DeployContext:
    """The context of a spec with a `deployment:` section; ValueError naming it otherwise."""
    if spec.deployment is None:
        raise ValueError("deployment: the spec has no deployment: section (see docs/deploy.md)")
    return DeployContext(spec, spec.deployment, memory_estimate)


def deploy_context(spec: BuildSpec) -> DeployContext:
    """`context_of` with the engine's memory estimated (`memory.estimate_for_spec`) and the
    spec's memory, if given, checked against it (ValueError naming the field)."""
    from builder.deploy.memory import check_given, estimate_for_spec

    ctx = context_of(spec)
    estimate = estimate_for_spec(spec)
    if estimate is not None:
        check_given(ctx.deployment.resources, estimate)
    return context_of(spec, estimate)
