"""Run the commands of the README (and of docs pages) as written, in order, on a fresh clone;
report each exit code.

The page marks what runs and how (scripts/readme_blocks.py: `run`, `server`, `python`, `stop`,
and the `needs=`, `skip=`, `session` options). A `server` block's command runs until its ready
text appears and stays up for the blocks after it; a `stop` marker (where the page tells the
reader to press Ctrl-C), or the end of the page, stops it with Ctrl-C (SIGINT: `forge serve`
drains) and waits for it. A server block that starts while another still runs fails: a reader
following the page in order would find the ports taken.

--clone (the default) works in a fresh `git clone` of this checkout's HEAD (commit first);
--venv DIR links DIR as the clone's `.venv` instead of letting `make` create one (refused if
DIR was set up from another pyproject.toml / setup.sh: setup.sh would reinstall into it).
--readme PAGE (repeatable; default README.md) picks the pages, run one after the other in one
clone: docs/deploy.md and docs/quantization.md mark the commands that run without a cluster,
a registry or a GPU. `make test` is CI's own command, `.ci/run`, and takes most of an hour on
2 cores: its marker skips it unless --with 'make test'.
Exit 0 when every command ran and exited 0 with its output matching, 1 otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from readme_blocks import Block, missing_output, parse, python_promises, without_comment

ROOT = Path(__file__).resolve().parent.parent
STOP_TIMEOUT = 120.0


class Server:
    """A background command whose output is collected by a thread."""

    def __init__(self, command: str, cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(command, shell=True, cwd=cwd, env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                return False
            self.output.append(line)
            if text in line:
                return True
        return False

    def stop(self) -> int:
        """Ctrl-C to its process group, as a user would stop it; SIGKILL if it does not end."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


@dataclass
class Result:
    where: str                   # page and line
    command: str
    status: str
    exit_code: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "skipped") or self.status.startswith("skipped ")


class Results(list):
    """The results so far, each printed as it comes (a long run shows where it is)."""

    def append(self, result: Result) -> None:
        code = "-" if result.exit_code is None else result.exit_code
        print(f"[check]   -> exit {code}, {result.seconds:.1f} s: {result.status[:200]}", flush=True)
        super().append(result)


class Runner:
    """Runs one page's blocks in order in `cwd`; at most one server at a time."""

    def __init__(self, cwd: Path, env: dict[str, str], python: str, with_: set[str]) -> None:
        self.cwd, self.env, self.python, self.with_ = cwd, env, python, with_
        self.results = Results()
        self.server: Server | None = None
        self.server_block: Block | None = None

    def run_page(self, blocks: list[Block]) -> Results:
        try:
            for block in blocks:
                needs = block.options.get("needs")
                if needs and needs not in self.with_:
                    self.results.append(Result(block.where, f"{block.kind} block",
                                               f"skipped (needs {needs}: --with {needs} runs it)"))
                elif block.kind == "stop":
                    self._stop(block)
                elif block.kind == "server":
                    self._start(block)
                elif block.kind == "python":
                    self.results.append(self._run(f"{self.python} -", block, stdin=block.body,
                                                  expected=python_promises(block.body)))
                else:
                    self._run_block(block)
        finally:
            if self.server is not None:
                self._stop(blocks[-1])
        return self.results

    def _run_block(self, block: Block) -> None:
        if "session" in block.options:  # one shell, as the reader's one terminal
            script = "set -e\n" + "\n".join(without_comment(c.text) for c in block.commands)
            expected = [] if block.options.get("output") == "ignore" else \
                [line for c in block.commands for line in c.expected]
            self.results.append(self._run("bash -s", block, stdin=script, expected=expected,
                                          shown=f"{len(block.commands)} commands in one shell"))
            return
        skip = block.options.get("skip")
        for command in block.commands:
            text = without_comment(command.text)
            if skip and text.startswith(skip) and skip not in self.with_:
                self.results.append(Result(block.where, text,
                                           f"skipped (--with '{skip}' runs it)"))
                continue
            expected = [] if block.options.get("output") == "ignore" else command.expected
            self.results.append(self._run(text, block, expected=expected))

    def _run(self, command: str, block: Block, stdin: str | None = None,
             expected: list[str] | None = None, shown: str | None = None) -> Result:
        shown = shown or ("python block" if stdin is not None else command)
        print(f"[check] {block.where}: {shown.splitlines()[0]}", flush=True)
        start = time.monotonic()
        try:
            done = subprocess.run(command, shell=True, cwd=self.cwd, env=self.env, input=stdin,
                                  text=True, capture_output=True, timeout=block.timeout)
        except subprocess.TimeoutExpired:
            return Result(block.where, shown, f"timed out after {block.timeout:.0f} s", None,
                          time.monotonic() - start)
        seconds = time.monotonic() - start
        output = done.stdout + done.stderr
        _keep_log(block, output)
        expected_code = int(block.options.get("exit", 0))  # e.g. 3: a build the gate refuses
        if done.returncode != expected_code:
            tail = " | ".join(output.strip().splitlines()[-3:])
            wanted = f" (expected exit {expected_code})" if expected_code else ""
            return Result(block.where, shown, f"FAILED{wanted}: {tail}", done.returncode,
                          seconds)
        missing = missing_output(expected or [], output)
        status = "ok" if not missing else \
            f"output differs: no {missing[0]!r} in {output.strip()[:300]!r}"
        return Result(block.where, shown, status, done.returncode, seconds)

    def _start(self, block: Block) -> None:
        if self.server is not None:  # the reader would find the ports taken
            assert self.server_block is not None
            self.results.append(Result(block.where, "server block", (
                f"FAILED: the server of {self.server_block.where} still runs; the page must "
                f"say to stop it first (readme-check: stop)")))
            self._stop(block)
        command = without_comment(block.commands[0].text)
        print(f"[check] {block.where}: {command} (background)", flush=True)
        start = time.monotonic()
        server = Server(command, self.cwd, self.env)
        ready = block.options["ready"]
        if not server.wait_for(ready, float(block.options.get("timeout", 900))):
            code = server.stop()
            tail = " | ".join("".join(server.output).strip().splitlines()[-3:])
            self.results.append(Result(block.where, command, f"FAILED: never printed {ready!r}: "
                                       f"{tail}", code, time.monotonic() - start))
            return
        missing = missing_output(block.commands[0].expected, "".join(server.output))
        status = "ok" if not missing else f"output differs: no {missing[0]!r}"
        self.server, self.server_block = server, block
        self.results.append(Result(block.where, f"{command} (until {ready!r})", status, None,
                                   time.monotonic() - start))

    def _stop(self, block: Block) -> None:
        if self.server is None:
            return
        server, self.server, self.server_block = self.server, None, None
        start = time.monotonic()
        code = server.stop()
        server.wait_for("\0", 5.0)  # collects what it printed while stopping
        _keep_log(block, "".join(server.output))
        # forge serve exits 0 after Ctrl-C and its drain; make reports an interrupted recipe as 2.
        status = "ok" if code in (0, 2, -signal.SIGINT) else f"FAILED: exit {code} on Ctrl-C"
        self.results.append(Result(block.where, "Ctrl-C to the server", status, code,
                                   time.monotonic() - start))


LOGS: list[Path] = []  # the directory the full outputs go to, set by main


def _keep_log(block: Block, output: str) -> None:
    """A command's whole output, beside the report's last lines of it."""
    if LOGS:
        page = block.page.replace("/", "-").removesuffix(".md")
        path = LOGS[0] / f"{page}-{block.line:04d}-{len(list(LOGS[0].iterdir())):02d}.log"
        path.write_text(output)


def setup_stamp(checkout: Path) -> str:
    """What scripts/setup.sh records in .venv/.llm-forge-setup for this checkout (its inputs and
    what it is asked for: the default extras and torch pin, as `make setup` runs it)."""
    script = (checkout / "scripts" / "setup.sh").read_text()
    defaults = [re.search(r'"\$\{' + name + r':-([^}]*)\}"', script) for name in
                ("SETUP_EXTRAS", "SETUP_TORCH_PIN")]
    digest = hashlib.sha256((checkout / "pyproject.toml").read_bytes() + script.encode())
    if all(defaults):  # setup.sh stamps "$EXTRAS $TORCH_PIN" too
        digest.update(f"{defaults[0].group(1)} {defaults[1].group(1)}\n".encode())
    return digest.hexdigest()


def fresh_clone(where: Path) -> Path:
    """This checkout's HEAD as a new clone would have it: tracked files only."""
    clone = where / "llm-forge"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                   check=True)
    return clone


def link_venv(venv: Path, cwd: Path, here: bool) -> bool:
    """Use an existing venv as the clone's `.venv`; False when it was set up from other files."""
    stamp = venv / ".llm-forge-setup"
    if not stamp.is_file() or stamp.read_text().strip() != setup_stamp(cwd):
        print(f"error: {venv} was not set up from this pyproject.toml and setup.sh "
              f"(make would reinstall into it)", file=sys.stderr)
        return False
    if not here:
        (cwd / ".venv").symlink_to(venv)
    return True


def report(results: list[Result], seconds: float) -> int:
    print(f"\n{'where':>24}  {'exit':>4}  {'seconds':>7}  status   command")
    for r in results:
        code = "-" if r.exit_code is None else str(r.exit_code)
        first = r.command.splitlines()[0].split()[:12]
        print(f"{r.where:>24}  {code:>4}  {r.seconds:>7.1f}  {r.status[:120]}   {' '.join(first)}")
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} ok in {seconds:.0f} s; "
          f"{len(failed)} failed")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="append", dest="pages",
                        help="a page to run (repeatable; default README.md)")
    parser.add_argument("--here", action="store_true", help="run in this checkout, not a clone")
    parser.add_argument("--venv", type=Path, help="an existing venv to use as the clone's .venv")
    parser.add_argument("--with", dest="with_", action="append", default=[],
                        help="run what a skip= or needs= marker leaves out (e.g. 'make test')")
    parser.add_argument("--list", action="store_true", help="print the blocks and exit")
    args = parser.parse_args()
    pages = {name: parse((ROOT / name).read_text(), name) for name in args.pages or ["README.md"]}
    if args.list:
        for block in (b for blocks in pages.values() for b in blocks):
            print(block.where, block.kind, block.options,
                  [c.text for c in block.commands] or block.body.splitlines()[:1])
        return 0
    LOGS.append(Path(tempfile.mkdtemp(prefix="readme-check-logs-")))
    print(f"[check] every command's output: {LOGS[0]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="readme-check-") as tmp:
        cwd = ROOT if args.here else fresh_clone(Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(cwd))
        if args.venv is not None and not link_venv(args.venv.resolve(), cwd, args.here):
            return 2
        python = str(cwd / ".venv" / "bin" / "python")
        start = time.monotonic()
        results: list[Result] = []
        for blocks in pages.values():
            results += Runner(cwd, env, python, set(args.with_)).run_page(blocks)
    return report(results, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
