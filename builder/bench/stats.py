"""Aggregate request records of one concurrency level into the numbers the report shows."""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from builder.bench.records import RequestRecord


def percentiles(values: Iterable[float | None], qs: tuple[int, ...]) -> dict[str, float | None]:
    """{"p50": ..., ...} over the non-None values (linear interpolation); None when empty."""
    data = np.array([v for v in values if v is not None], dtype=float)
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"p{q}"] = float(np.percentile(data, q)) if data.size else None
    out["mean"] = float(data.mean()) if data.size else None
    return out


def summarize(records: list[RequestRecord], wall_s: float, concurrency: int) -> dict[str, Any]:
    """Per-level summary. Throughputs divide by the level's wall time (first send to last final
    response), so idle gaps inside the level count against the server, as a user would see them."""
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    wall = max(wall_s, 1e-9)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(1 for r in records if r.error is not None and not r.cancelled),
        "cancelled": sum(1 for r in records if r.cancelled),
        "wall_s": wall_s,
        "input_tokens": sum(r.num_input_tokens or 0 for r in ok),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall,
        "requests_per_s": len(ok) / wall,
        "ttft_s": percentiles((r.ttft for r in ok), (50, 90, 99)),
        "itl_s": percentiles((r.itl for r in ok), (50, 99)),
        "e2e_s": percentiles((r.e2e for r in ok), (50, 99)),
        "first_errors": sorted({r.error for r in records if r.error})[:5],
    }
