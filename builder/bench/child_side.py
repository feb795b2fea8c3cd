"""A peer side of `forge bench engine` that runs in a venv of its own: a child process (which
imports nothing of ours) driven over a pipe, one JSON line per run. Token times are taken in the
child, as `InProcessSide` takes ours around `LLMEngine.step()`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from builder.bench.engine_level import (AllTimings, EngineProtocol, OneTimings, all_timings,
                                        one_timings)
from builder.bench.servers import clean_env


def venv_python(venv: str | Path, option: str, installer: str, what: str) -> Path:
    """The venv's Python, or a FileNotFoundError that names the option and the installer."""
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"{option}: no {python} ({installer} installs {what})")
    return python


class ChildSide:
    side = ""  # the --sides name, in errors
    peer = ""  # what runs in the child, in errors and the log

    def __init__(self, python: Path, args: list[str], protocol: EngineProtocol,
                 env: dict[str, str] | None = None) -> None:
        self.protocol = protocol
        # -P: the child's folder stays off sys.path (our bench/profile.py would shadow the
        # standard library's `profile`, which torch imports)
        self.child = subprocess.Popen([str(python), "-P", *args], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True,
                                      env=clean_env() if env is None else env)
        self.info = self._read()  # {"ready": ...} once the peer is up, with what it says of itself

    def _read(self) -> dict:
        line = self.child.stdout.readline()
        if not line:
            raise ValueError(f"--sides {self.side}: {self.peer} exited with {self.child.wait()} "
                             "(its log is above)")
        return json.loads(line)

    def _run(self, prompts: list[list[int]], max_tokens: int) -> dict:
        self.child.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.child.stdin.flush()
        return self._read()

    def run_one(self, ids: list[int], text: str, max_tokens: int | None = None) -> OneTimings:
        answer = self._run([list(ids)], max_tokens or self.protocol.max_tokens)
        return one_timings(answer["start"], answer["times"][0])

    def run_all(self, ids_list: list[list[int]], texts: list[str]) -> AllTimings:
        answer = self._run([list(i) for i in ids_list], self.protocol.max_tokens)
        times = answer["times"]
        return all_timings(answer["start"], [t[0] for t in times], [t[-1] for t in times],
                           len(ids_list) * self.protocol.max_tokens)

    def close(self) -> None:
        if self.child.poll() is None:
            self.child.stdin.close()
            try:
                self.child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.child.kill()
        print(f"{self.peer} stopped", file=sys.stderr)
