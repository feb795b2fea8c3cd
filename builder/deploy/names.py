"""Kubernetes' rules for names, and every name `forge deploy` derives from `deployment.name`.

The API server refuses an object whose name breaks its kind's rule, so `kubectl apply` would
fail half-way through the directory; the spec is checked against these rules when it loads
(`DeploymentSpec`), naming the field, instead. The rules (apimachinery's validation):

- a Service's name is a DNS-1035 label: at most 63 characters, lowercase letters, digits and
  '-', a letter first and a letter or digit last (it becomes a DNS name in the cluster);
- a namespace's is a DNS-1123 label: the same, but it may start with a digit;
- most other objects' (Deployment, ConfigMap, Secret, RBAC, policies, custom resources) are
  DNS-1123 subdomains: at most 253 characters of dot-separated DNS-1123 labels;
- a label value has at most 63 characters (the name is the `app.kubernetes.io/instance` label).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"


@dataclass(frozen=True)
class NameRule:
    """One of Kubernetes' name rules: a pattern, a length bound and how to say it."""

    kind: str
    pattern: re.Pattern
    max_length: int
    described: str

    def problem(self, value: object) -> str | None:
        """What is wrong with `value` under this rule, or None."""
        if not isinstance(value, str) or not value:
            return f"must be a non-empty string ({self.described})"
        if len(value) > self.max_length:
            return (f"has {len(value)} characters; a {self.kind} has at most "
                    f"{self.max_length} ({self.described})")
        if not self.pattern.fullmatch(value):
            return f"is not a {self.kind} ({self.described})"
        return None


DNS_1035_LABEL = NameRule(
    "DNS-1035 label", re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?"), 63,
    "lowercase letters, digits and '-', a letter first, a letter or digit last, at most 63")
DNS_1123_SUBDOMAIN = NameRule(
    "DNS-1123 subdomain", re.compile(rf"{_LABEL}(\.{_LABEL})*"), 253,
    "dot-separated DNS-1123 labels, at most 253 characters")
LABEL_VALUE = NameRule(
    "label value", re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"), 63,
    "letters, digits, '-', '_' and '.', alphanumeric first and last, at most 63")

EPP_SUFFIX = "-epp"


def epp_name(name: str) -> str:
    """The endpoint picker's objects (Deployment, Service, ServiceAccount, ConfigMap, RBAC)."""
    return f"{name}{EPP_SUFFIX}"


def metrics_auth_name(namespace: str, name: str) -> str:
    """The endpoint picker's ClusterRole and binding: cluster-scoped, so the namespace is in it."""
    return f"{namespace}-{epp_name(name)}-metrics-auth"


def derived_names(name: str, namespace: str) -> list[tuple[str, str, NameRule]]:
    """(what, value, rule) of every name and label value rendered from `name`; the strictest
    rule of the objects that share a name stands for them all."""
    return [
        ("the model server's Service", name, DNS_1035_LABEL),
        ("the endpoint picker's Service", epp_name(name), DNS_1035_LABEL),
        ("the label app.kubernetes.io/instance", name, LABEL_VALUE),
        ("the endpoint picker's ClusterRole", metrics_auth_name(namespace, name),
         DNS_1123_SUBDOMAIN),
        ("KEDA's HorizontalPodAutoscaler", f"keda-hpa-{name}", DNS_1123_SUBDOMAIN),
    ]


def check_derived_names(key: str, name: str, namespace: str) -> None:
    """ValueError naming `key` when a name rendered from `name` breaks its rule."""
    for what, value, rule in derived_names(name, namespace):
        problem = rule.problem(value)
        if problem is None:
            continue
        if value == name:
            raise ValueError(f"{key}: {name!r} {problem}; it names {what}")
        raise ValueError(f"{key}: {name!r} gives {what} {value!r}, which {problem}")
