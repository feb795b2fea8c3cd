"""`forge deploy`: Kubernetes manifests from a build spec's `deployment:` section.

One module per concern: `context` (names, labels, ports, the GPU, worked out once from the
spec), `server` (the model-server container: command, probes, drain), `workload` (the
Deployment), `network` (Service, PodDisruptionBudget, NetworkPolicy), `autoscaling` (HPA or
KEDA), `monitoring` (ServiceMonitor), `gateway` (InferencePool and its endpoint picker),
`render` (all of it into files plus a kustomization.yaml).
"""
