"""What the server itself counted during a level: its `/metrics` before and after, subtracted.

llm-forge servers publish every executor counter (read by `builder.client.metrics_reader`); the
difference over a level gives the prefix cache's hit rate and speculative decoding's acceptance
for exactly the level's requests (warm-up requests ran before the first scrape). Servers without
those counters (NVIDIA's backend, the naive baseline) simply report nothing.
"""
from __future__ import annotations

from builder.client.metrics_reader import scrape as scrape_engine_stats


def scrape(metrics_url: str, timeout: float = 10.0) -> dict[str, float]:
    """The executor counters on `metrics_url` (`http://host:port/metrics`), summed over models."""
    return scrape_engine_stats(metrics_url, timeout).totals()


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def level_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Counters accumulated during the level, and the rates they give."""
    def grown(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    queried, hits = grown("prefix_cache_queried_tokens"), grown("prefix_cache_hit_tokens")
    drafts, accepted = grown("spec_num_draft_tokens"), grown("spec_num_accepted_tokens")
    verify_steps = grown("spec_num_verify_steps")
    return {
        "prefix_cache_queried_tokens": queried, "prefix_cache_hit_tokens": hits,
        "prefix_cache_hit_rate": _ratio(hits, queried),
        "spec_num_draft_tokens": drafts, "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": _ratio(accepted, drafts),
        "spec_mean_accepted_length": _ratio(accepted + verify_steps, verify_steps),
        "spec_num_paused_steps": grown("spec_num_paused_steps"),
        "num_steps": grown("num_steps"), "num_preemptions": grown("num_preemptions"),
    }


def metrics_url(value: str) -> str:
    """`host:port` or a URL -> the full `/metrics` URL."""
    url = value if "://" in value else f"http://{value}"
    return url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
