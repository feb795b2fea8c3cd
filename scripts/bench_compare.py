"""`make bench`: our engine vs the naive baseline on the demo model, one command.

Builds what is missing (the spec's engine and its Triton repository under model_repository/),
serves it on free loopback ports, and runs `forge bench --baseline naive`, which builds the
naive engine of the same checkpoint (`<engine>-naive`, reused later), serves it on other ports,
measures both on the same requests (alternating) and writes the report into --out. Both servers
are stopped at the end, also on Ctrl-C. --rebuild forces fresh engines.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing


def _log(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def ensure_engine(spec_path: Path, rebuild: bool) -> tuple[Path, Path]:
    """(engine dir, repository dir) of the spec, building whatever is missing."""
    from builder.engine_builder import build_engine
    from builder.repository import RepositoryOptions, emit_repository
    from builder.spec import load_spec

    spec = load_spec(spec_path)
    engine = (ROOT / spec.output_dir).resolve()
    repository = ROOT / "model_repository" / spec.name
    if rebuild or not (engine / "config.json").is_file():
        _log(f"building {engine} from {spec_path.name}")
        build_engine(dataclasses.replace(spec, output=str(engine)), repository_dir=repository)
    if rebuild or not (repository / "ensemble" / "config.pbtxt").is_file():
        _log(f"emitting {repository}")
        emit_repository(engine, repository, RepositoryOptions(**spec.repository))
    if rebuild:
        shutil.rmtree(engine.parent / f"{engine.name}-naive", ignore_errors=True)
    return engine, repository


def forge_command() -> list[str]:
    forge = Path(sys.executable).parent / "forge"
    return [str(forge)] if forge.is_file() else [sys.executable, "-m", "builder.cli"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "examples" / "smollm2-135m.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "latest")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--scale", default="0.5", help="token-length scale of the workload")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", default="2x", help="per level: N, or Kx = K x concurrency")
    parser.add_argument("--warmup", default="2")
    parser.add_argument("--rebuild", action="store_true")
    args = parser.parse_args()

    from builder.serving.serve import start_tritonserver

    started = time.perf_counter()
    engine, repository = ensure_engine(args.spec.resolve(), args.rebuild)
    _log(f"serving {repository}")
    server = start_tritonserver(repository, ready_timeout=600)
    try:
        _log(f"llm-forge ready on grpc {server.grpc_url}")
        if args.out.exists():
            shutil.rmtree(args.out)
        bench = ["bench", "--url", server.grpc_url, "--engine", str(engine), "--baseline", "naive",
                 "--labels", "llm-forge,naive", "--workload", args.workload, "--scale", args.scale,
                 "--concurrency", args.concurrency, "--requests", args.requests,
                 "--warmup", args.warmup, "--out", str(args.out)]
        _log("running: forge " + " ".join(bench))
        code = subprocess.call(forge_command() + bench, cwd=ROOT)
    finally:
        server.stop()
    _log(f"finished in {time.perf_counter() - started:.0f}s; report in {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
