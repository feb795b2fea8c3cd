"""The runtime and peak that `builder/deploy/memory.py` adds to an engine's weights and KV cache
hold for a served engine: `forge serve` with its OpenAI API on a tiny engine, idle then under
streams, its processes' PSS summed (`forge bench memory`'s sampler) stays within the
estimate's need for that engine (the rendered limit adds 25% on top)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from builder.bench.serve_memory import Sampler
from builder.deploy.memory import MIB, estimate
from builder.repository.emit import RepositoryOptions, emit_repository
from builder.serving.serve import free_port
from tests.triton_helpers import ForgeServe, build_tiny_engine
from triton_backend.engine.config import EngineConfig

pytestmark = pytest.mark.slow


def test_a_served_engine_stays_within_the_estimated_need(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_FORGE_KERNELS", "torch")
    engine_dir = build_tiny_engine(tmp_path, max_seq_len=1024, max_input_len=256)
    options = RepositoryOptions(stats_period_ms=20)
    repository = emit_repository(engine_dir, tmp_path / "repo", options)
    need = estimate(EngineConfig.load(engine_dir), options)
    port = free_port()
    serve = ForgeServe(repository, "--openai-port", str(port))
    try:
        serve.wait_serving()
        sampler = Sampler(serve.process.pid)
        sampler.start()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=3, timeout=120)
        stop = time.monotonic() + 20
        finished = []

        def load():
            while time.monotonic() < stop:
                for _ in client.completions.create(model="tiny", prompt="The quick brown fox "
                                                   * 40, max_tokens=200, stream=True):
                    pass
                finished.append(1)

        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(load) for _ in range(8)]:
                future.result()
        sampler.stopping.set()
        sampler.join()
    finally:
        serve.close()
    assert finished  # requests ran
    assert sampler.peak_pss <= need.need, (
        f"peak PSS {sampler.peak_pss / MIB:.0f} MiB over the estimate: {need.describe()}; "
        f"by process {sampler.by_process}")
    print(f"\ntiny engine served: peak PSS {sampler.peak_pss / MIB:.0f} MiB, estimated need "
          f"{need.need / MIB:.0f} MiB ({need.parts()})")
