"""The one reader of a server's executor counters on `/metrics`.

llm-forge's `tensorrt_llm` model publishes every counter of its executor's `get_stats()` as
`llm_forge_executor_stats{model=...,stat=...}`; `forge serve`, the supervisor, the benchmark and
the soak script all read them through `scrape` / `parse`. Servers without those counters
(NVIDIA's backend, the naive baseline) give empty stats.
"""
from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass, field

_SAMPLE = re.compile(r'^llm_forge_executor_stats\{([^}]*)\} (\S+)$', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class EngineStats:
    """The executor counters of one scrape, by model then by stat name."""

    by_model: dict[str, dict[str, float]] = field(default_factory=dict)

    def of(self, model: str) -> dict[str, float]:
        """One model's counters (empty when it publishes none)."""
        return self.by_model.get(model, {})

    def totals(self) -> dict[str, float]:
        """Every counter summed over the models that publish it."""
        summed: dict[str, float] = {}
        for stats in self.by_model.values():
            for name, value in stats.items():
                summed[name] = summed.get(name, 0.0) + value
        return summed


def parse(text: str) -> EngineStats:
    """The `llm_forge_executor_stats` samples of a Prometheus text page."""
    by_model: dict[str, dict[str, float]] = {}
    for labels, value in _SAMPLE.findall(text):
        label = dict(_LABEL.findall(labels))
        if "stat" in label:
            by_model.setdefault(label.get("model", ""), {})[label["stat"]] = float(value)
    return EngineStats(by_model)


def scrape(metrics_url: str, timeout: float = 10.0) -> EngineStats:
    """The counters on `metrics_url` (`http://host:port/metrics`); raises URLError / OSError."""
    with urllib.request.urlopen(metrics_url, timeout=timeout) as reply:
        return parse(reply.read().decode())
