"""The Gateway API Inference Extension: an InferencePool over our pods and the endpoint
picker's (EPP) configuration, pointing it at our metric names.

Pinned to gateway-api-inference-extension v1.5.0 (the last release with the EPP in that
repository; image registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0). There the metric
flags (`--total-queued-requests-metric`, ...) are refused; the names come from the
`core-metrics-extractor` plugin's `engineConfigs` in the EndpointPickerConfig, chosen per pod by
the `inference.networking.k8s.io/engine-type` label (ours: `llm-forge`, also the default
engine). The names are Triton TensorRT-LLM's (the EPP's built-in `triton-tensorrt-llm` engine)
plus vLLM's LoRA info gauge, which our LoRA engines export: so the LoRA-affinity scorer routes a
request for an adapter to a replica that has it loaded.

The pool targets the OpenAI port (the EPP's default OpenAI parser reads the model and the
prompt for LoRA and prefix-cache affinity). Pods without forge serve (tp * pp > 1) serve the
Triton protocol only: the pool targets Triton's HTTP port, the EPP parses nothing
(`passthrough-parser`) and routes by queue and KV use alone.
"""
from __future__ import annotations

from builder.deploy.context import ENGINE_TYPE, ENGINE_TYPE_LABEL, DeployContext
from builder.deploy.network import EPP_GRPC_PORT
from triton_backend.models.metrics import EPP_METRIC_SPECS

EPP_RELEASE = "v1.5.0"
EPP_IMAGE = f"registry.k8s.io/gateway-api-inference-extension/epp:{EPP_RELEASE}"
EPP_CONFIG_FILE = "epp-config.yaml"
POOL_GROUP = "inference.networking.k8s.io"



def inference_pool(ctx: DeployContext) -> dict:
    """inference.networking.k8s.io/v1 InferencePool selecting the Deployment's pods."""
    return {"apiVersion": f"{POOL_GROUP}/v1", "kind": "InferencePool",
            "metadata": ctx.metadata(),
            "spec": {"selector": {"matchLabels": ctx.selector},
                     "targetPorts": [{"number": ctx.serving_port}],
                     "appProtocol": "http",
                     # FailOpen: if the picker is down the gateway still forwards (to an
                     # endpoint of its choosing); routing gets worse, serving goes on.
                     "endpointPickerRef": {"group": "", "kind": "Service", "name": ctx.epp_name,
                                           "port": {"number": EPP_GRPC_PORT},
                                           "failureMode": "FailOpen"}}}


def serves_lora(ctx: DeployContext) -> bool:
    """Our LoRA engines export the LoRA info gauge; NVIDIA's C++ backend (multi-rank) does not."""
    return ctx.spec.lora is not None and not ctx.multi_rank


def engine_config(ctx: DeployContext) -> dict:
    """The `core-metrics-extractor` entry for our pods: the specs of the names our metrics
    module exports (`EPP_METRIC_SPECS`). An empty spec turns a metric off (the EPP would log a
    missing family otherwise)."""
    specs = dict(EPP_METRIC_SPECS)
    if not serves_lora(ctx):
        specs["loraSpec"] = ""
    return {"name": ENGINE_TYPE, **specs, "cacheInfoSpec": ""}


def epp_config(ctx: DeployContext) -> dict:
    """The EndpointPickerConfig (inference.networking.x-k8s.io/v1alpha1): scrape our metrics,
    score by queue, KV use, prefix cache and LoRA affinity, pick the best."""
    scorers = [("queue-scorer", 2), ("kv-cache-utilization-scorer", 2)]
    if not ctx.multi_rank:
        scorers.append(("prefix-cache-scorer", 3))  # needs the prompt: the OpenAI parser
    if serves_lora(ctx):
        scorers.append(("lora-affinity-scorer", 1))
    plugins: list[dict] = [
        {"type": "metrics-data-source",
         "parameters": {"scheme": "http", "path": "/metrics", "insecureSkipVerify": False}},
        {"type": "core-metrics-extractor",
         "parameters": {"engineLabelKey": ENGINE_TYPE_LABEL, "defaultEngine": ENGINE_TYPE,
                        "engineConfigs": [engine_config(ctx)]}},
        *({"type": name} for name, _ in scorers),
        {"type": "max-score-picker"},
    ]
    config: dict = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig",
        "plugins": plugins,
        "dataLayer": {"sources": [{"pluginRef": "metrics-data-source",
                                   "extractors": [{"pluginRef": "core-metrics-extractor"}]}]},
        "schedulingProfiles": [{"name": "default", "plugins": [
            *({"pluginRef": name, "weight": weight} for name, weight in scorers),
            {"pluginRef": "max-score-picker"}]}],
    }
    if ctx.multi_rank:
        plugins.append({"type": "passthrough-parser"})
        config["parser"] = {"pluginRef": "passthrough-parser"}
    return config
