"""The model server's memory, computed from the engine: weights, KV cache, runtime and the peak
under load, with 25% headroom, as the rendered request and limit; `forge deploy` prints the
sum. The runtime and peak constants are checked against a served engine in
tests/e2e/test_serve_memory.py."""
from __future__ import annotations

import math

import yaml
from click.testing import CliRunner

from builder.cli import main
from builder.deploy.memory import (HEADROOM, LOAD_BYTES, MIB, RUNTIME_BYTES, activation_bytes,
                                   estimate_for_spec)
from builder.spec.hardware import parameter_count
from builder.spec.load import load_spec
from deploy_helpers import REPO, all_objects

CPU_SPEC = REPO / "examples" / "smollm2-135m.yaml"
# SmolLM2-135M: 30 layers, 3 KV heads of 64, bf16 (2 bytes): K and V per token and layer.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2


def test_the_estimate_adds_weights_kv_cache_runtime_and_peak():
    spec = load_spec(CPU_SPEC)
    estimate = estimate_for_spec(spec)
    from builder.pipeline import convert
    from builder.pipeline.checkpoint import resolve_checkpoint

    shape = convert.model_shape_from_hf(convert.read_hf_config(
        resolve_checkpoint(spec.checkpoint, log=lambda line: None)))
    assert estimate.weights == parameter_count(shape) * 2  # bf16
    block_bytes = KV_BYTES_PER_TOKEN * spec.kv_cache.tokens_per_block
    assert estimate.kv_cache == (2**30 // block_bytes) * block_bytes  # the 1 GiB pool, in blocks
    assert estimate.runtime == RUNTIME_BYTES
    assert estimate.peak == LOAD_BYTES + 2048 * (576 + 1536) * 16
    need = estimate.weights + estimate.kv_cache + estimate.runtime + estimate.peak
    assert estimate.need == need
    assert estimate.with_headroom >= need * (1 + HEADROOM)
    assert estimate.with_headroom - need * (1 + HEADROOM) < 64 * MIB
    assert estimate.quantity == f"{estimate.with_headroom // MIB}Mi"


def test_forge_deploy_renders_the_estimate_and_prints_the_sum(tmp_path):
    result = CliRunner().invoke(main, ["deploy", "--spec", str(CPU_SPEC), "--out",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    estimate = estimate_for_spec(load_spec(CPU_SPEC))
    deployment = next(o for o in all_objects(tmp_path) if o["kind"] == "Deployment"
                      and o["metadata"]["labels"]["app.kubernetes.io/component"]
                      == "model-server")
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    request, limit = resources["requests"]["memory"], resources["limits"]["memory"]
    assert request == limit == estimate.quantity
    assert int(limit.removesuffix("Mi")) * MIB >= math.ceil(estimate.need * 1.25)
    assert (f"memory: weights {estimate.weights / MIB:.0f} + KV cache "
            f"{estimate.kv_cache / MIB:.0f} + runtime {RUNTIME_BYTES / MIB:.0f} + peak under "
            f"load {estimate.peak / MIB:.0f} = {estimate.need / MIB:.0f} MiB; with 25% headroom "
            f"{estimate.quantity} (request = limit)") in result.output
    lines = result.output.splitlines()
    secret = next(i for i, line in enumerate(lines) if line.startswith("secret: "))
    assert "kubectl -n llm-forge create secret generic smollm2-135m-api-key " \
        "--from-literal=api-key=\"$KEY\"" in lines[secret]
    assert 'test -n "$KEY" &&' in lines[secret]
    assert lines[-1] == f"apply: kubectl apply -k {tmp_path}" and secret < len(lines) - 1


def test_a_spec_that_gives_enough_memory_keeps_it(tmp_path):
    data = yaml.safe_load(CPU_SPEC.read_text())
    data["deployment"]["resources"] = {"memory_request": "5Gi", "memory_limit": "6Gi"}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["deploy", "--spec", str(spec), "--out",
                                       str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    deployment = next(o for o in all_objects(tmp_path / "out") if o["kind"] == "Deployment")
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert (resources["requests"]["memory"], resources["limits"]["memory"]) == ("5Gi", "6Gi")
    assert "memory: request 5Gi, limit 6Gi (the spec's; the engine needs weights" \
        in result.output


def test_the_activations_grow_with_the_step_and_the_width():
    config = type("Config", (), {})()
    config.limits = type("Limits", (), {"max_num_tokens": 4096})()
    config.model = type("Shape", (), {"hidden_size": 4096, "intermediate_size": 14336})()
    assert activation_bytes(config) == 4096 * (4096 + 14336) * 16
