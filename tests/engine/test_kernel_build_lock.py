"""The kernels' cache is built once per source and machine, even by processes that start at once.

Each process runs the real loader (`load_cpu_kernels`: build key, cache directory, lock, the
cached-or-compiled verdict) with `_compile` swapped for a fake build that writes the library file
when none is there and logs a line each time it does: two compile lines would mean two builds.
"""
import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LOADER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from triton_backend.engine.cpu import kernels

    def fake_compile(build_dir, key):
        if not any(build_dir.glob("*.so")):  # what ninja decides: nothing built yet
            with open(sys.argv[1], "a") as log:
                log.write("compile\\n")
            time.sleep(1.0)  # a build takes a while: the other process reaches the lock meanwhile
            (build_dir / f"llm_forge_cpu_{key}.so").write_bytes(b"")

    kernels._compile = fake_compile
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.01)
    print("ok" if kernels.load_cpu_kernels(lambda line: print(line, flush=True)) else "failed",
          flush=True)
""")


def _start(tmp_path: Path, go: Path) -> subprocess.Popen:
    env = {**os.environ, "LLM_FORGE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO),
           "LLM_FORGE_KERNELS": "auto"}
    return subprocess.Popen([sys.executable, "-c", LOADER, str(tmp_path / "compiles.log"), str(go)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_starting_at_once_compile_once(tmp_path):
    go = tmp_path / "go"
    processes = [_start(tmp_path, go) for _ in range(2)]
    go.touch()  # both are past their imports or about to be: they reach the loader together
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    assert (tmp_path / "compiles.log").read_text().splitlines() == ["compile"]
    lines = [out.splitlines() for out, _ in outputs]
    assert all(out[-1] == "ok" for out in lines), outputs
    verdicts = sorted(next(line for line in out if line.startswith("CPU kernels: compiled")
                           or line.startswith("CPU kernels: loaded")) for out in lines)
    assert verdicts[0].startswith("CPU kernels: compiled for this CPU")
    assert verdicts[1].startswith("CPU kernels: loaded from the cache")


def test_a_process_finding_the_build_locked_says_it_waits_then_loads_the_build(tmp_path):
    from triton_backend.engine.cpu.kernels import build_key

    build_dir = tmp_path / "cache" / "kernels" / build_key()
    build_dir.mkdir(parents=True)
    go = tmp_path / "go"
    go.touch()
    with open(build_dir / ".llm-forge-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process's build in progress
        process = _start(tmp_path, go)
        assert process.stdout is not None
        first = process.stdout.readline()  # blocks until the loader reports the held lock
        assert "another process is building them" in first and "waiting" in first
        (build_dir / f"llm_forge_cpu_{build_key()}.so").write_bytes(b"")  # that build's result
        fcntl.flock(lock, fcntl.LOCK_UN)
    rest, errors = process.communicate(timeout=300)
    assert process.returncode == 0, errors
    assert "CPU kernels: loaded from the cache" in rest and "waiting for another process" in rest
    assert not (tmp_path / "compiles.log").exists()


READ_ONLY_LOADER = textwrap.dedent("""
    from triton_backend.engine.cpu import kernels

    def no_build(build_dir, key):
        raise AssertionError("a read-only cache must not be built in")

    kernels._compile = no_build
    kernels._writable = lambda path: False  # as under a read-only root filesystem
    print("ok" if kernels.load_cpu_kernels(lambda line: print(line, flush=True)) else "failed",
          flush=True)
""")


def test_a_read_only_cache_loads_its_library_without_the_lock_or_ninja(tmp_path):
    """An image carries the kernels compiled and runs with a read-only root filesystem: the
    library is loaded as it is (here a real shared object with no ops in it)."""
    from triton_backend.engine.cpu.kernels import build_key

    build_dir = tmp_path / "cache" / "kernels" / build_key()
    build_dir.mkdir(parents=True)
    source = tmp_path / "empty.c"
    source.write_text("int llm_forge_marker = 1;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(build_dir / f"llm_forge_cpu_"
                                                          f"{build_key()}.so"), str(source)],
                   check=True)
    env = {**os.environ, "LLM_FORGE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO),
           "LLM_FORGE_KERNELS": "auto"}
    done = subprocess.run([sys.executable, "-c", READ_ONLY_LOADER], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "ok", done.stdout
    assert "CPU kernels: loaded from a read-only cache" in done.stdout
    assert not (build_dir / ".llm-forge-build.lock").exists()
