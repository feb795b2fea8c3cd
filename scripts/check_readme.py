"""Run the README's commands as written, in order, on a fresh clone; report each exit code.

A fenced block runs when an HTML comment right above it says how (the comment does not render):

    <!-- readme-check: run [timeout=S] [output=ignore] [skip="CMD"] -->   each `$ ` line, in order
    <!-- readme-check: server ready="TEXT" [timeout=S] -->                 started in the background
    <!-- readme-check: python [timeout=S] -->                              the block as a script

A `server` block's command runs until TEXT appears in its output and stays up for the blocks after
it; the next `server` block, or the end, stops it with Ctrl-C (SIGINT: `forge serve` drains) and
waits for it. A `run` block's output lines are checked against what the command printed: each
piece between `...` must appear in it (`output=ignore` where the block shows a sample, such as
timings). `skip="CMD"` leaves out the commands that start with CMD unless --with CMD is given
(`make test` is CI's own command, `.ci/run`, and takes most of an hour on 2 cores).

--clone (the default) works in a fresh `git clone` of this checkout's HEAD (commit first);
--venv DIR links DIR as the clone's `.venv` instead of letting `make` create one (refused if
DIR was set up from another pyproject.toml / setup.sh: setup.sh would reinstall into it).
Exit 0 when every command ran and exited 0 with its output matching, 1 otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!--\s*readme-check:\s*(\w+)(.*?)-->")
OPTION = re.compile(r'(\w+)=("([^"]*)"|\S+)')
DEFAULT_TIMEOUT = 600.0
STOP_TIMEOUT = 120.0


@dataclass
class Command:
    text: str
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    line: int                    # of the marker, 1-based
    kind: str                    # run | server | python
    options: dict[str, str]
    language: str
    body: str
    commands: list[Command]

    @property
    def timeout(self) -> float:
        return float(self.options.get("timeout", DEFAULT_TIMEOUT))


def parse(readme: str) -> list[Block]:
    """The marked blocks of `readme`, in order."""
    lines = readme.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        match = MARKER.search(line)
        if not match:
            continue
        options = {m.group(1): m.group(3) if m.group(3) is not None else m.group(2)
                   for m in OPTION.finditer(match.group(2))}
        start = i + 1
        while start < len(lines) and not lines[start].strip():
            start += 1
        if start >= len(lines) or not lines[start].startswith("```"):
            raise ValueError(f"README line {i + 1}: a readme-check marker must precede a fence")
        end = start + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        body = lines[start + 1:end]
        blocks.append(Block(i + 1, match.group(1), options, lines[start][3:].strip(),
                            "\n".join(body), console_commands(body)))
    return blocks


def console_commands(body: list[str]) -> list[Command]:
    """`$ ` lines (with their `\\` continuations) and the output lines shown after each."""
    commands: list[Command] = []
    continuing = False
    for line in body:
        if line.startswith("$ ") or continuing:
            text = line[2:] if not continuing else line
            if continuing:
                commands[-1].text += "\n" + text
            else:
                commands.append(Command(text))
            continuing = line.rstrip().endswith("\\")
        elif commands:
            commands[-1].expected.append(line)
    return commands


def missing_output(expected: list[str], output: str) -> list[str]:
    """The expected pieces (split at `...`) that `output` lacks; comments after `#` are prose."""
    flat = " ".join(output.split())
    missing = []
    for line in expected:
        for piece in line.split("..."):
            piece = " ".join(piece.split())
            if piece and piece not in flat:
                missing.append(piece)
    return missing


def without_comment(command: str) -> str:
    """The command without a trailing `# ...` comment (the README explains commands inline)."""
    return re.sub(r"\s+#[^'\"]*$", "", command)


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
    line: int
    command: str
    status: str
    exit_code: int | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "skipped")


class Results(list):
    """The results so far, each printed as it comes (a long run shows where it is)."""

    def append(self, result: Result) -> None:
        code = "-" if result.exit_code is None else result.exit_code
        print(f"[check]   -> exit {code}, {result.seconds:.1f} s: {result.status[:200]}", flush=True)
        super().append(result)


def run_blocks(blocks: list[Block], cwd: Path, env: dict[str, str], python: str,
               with_: set[str]) -> list[Result]:
    results = Results()
    server: Server | None = None
    try:
        for block in blocks:
            if block.kind == "server":
                if server is not None:  # one server at a time: they share the default ports
                    results.append(_stopped(server, block.line))
                server, result = _start_server(block, cwd, env)
                results.append(result)
                if server.process.poll() is not None:  # it never came up: nothing to stop
                    server = None
            elif block.kind == "python":
                results.append(_run(f"{python} -", block, cwd, env, stdin=block.body))
            elif block.kind == "run":
                skip = block.options.get("skip")
                for command in block.commands:
                    text = without_comment(command.text)
                    if skip and text.startswith(skip) and skip not in with_:
                        results.append(Result(block.line, text, f"skipped (--with '{skip}' runs it)"))
                        continue
                    expected = [] if block.options.get("output") == "ignore" else command.expected
                    results.append(_run(text, block, cwd, env, expected=expected))
            else:
                raise ValueError(f"README line {block.line}: unknown readme-check kind {block.kind!r}")
    finally:
        if server is not None:
            results.append(_stopped(server, blocks[-1].line))
    return results


def _run(command: str, block: Block, cwd: Path, env: dict[str, str], stdin: str | None = None,
         expected: list[str] | None = None) -> Result:
    print(f"[check] README line {block.line}: {command.splitlines()[0]}", flush=True)
    start = time.monotonic()
    shown = "python block" if stdin is not None else command
    try:
        done = subprocess.run(command, shell=True, cwd=cwd, env=env, input=stdin, text=True,
                              capture_output=True, timeout=block.timeout)
    except subprocess.TimeoutExpired:
        return Result(block.line, shown, f"timed out after {block.timeout:.0f} s", None,
                      time.monotonic() - start)
    seconds = time.monotonic() - start
    output = done.stdout + done.stderr
    _keep_log(block.line, output)
    if done.returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-3:])
        return Result(block.line, shown, f"FAILED: {tail}", done.returncode, seconds)
    missing = missing_output(expected or [], output)
    status = "ok" if not missing else f"output differs: no {missing[0]!r} in {output.strip()[:300]!r}"
    return Result(block.line, shown, status, 0, seconds)


LOGS: list[Path] = []  # the directory the full outputs go to, set by main


def _keep_log(line: int, output: str) -> None:
    """A command's whole output, beside the report's last lines of it."""
    if LOGS:
        path = LOGS[0] / f"line-{line:04d}-{len(list(LOGS[0].iterdir())):02d}.log"
        path.write_text(output)


def _start_server(block: Block, cwd: Path, env: dict[str, str]) -> tuple[Server, Result]:
    command = without_comment(block.commands[0].text)
    print(f"[check] README line {block.line}: {command} (background)", flush=True)
    start = time.monotonic()
    server = Server(command, cwd, env)
    ready = block.options["ready"]
    timeout = float(block.options.get("timeout", 900))
    if not server.wait_for(ready, timeout):
        code = server.stop()
        tail = " | ".join("".join(server.output).strip().splitlines()[-3:])
        return server, Result(block.line, command, f"FAILED: never printed {ready!r}: {tail}", code,
                              time.monotonic() - start)
    missing = missing_output(block.commands[0].expected, "".join(server.output))
    status = "ok" if not missing else f"output differs: no {missing[0]!r}"
    return server, Result(block.line, f"{command} (until {ready!r})", status, None,
                          time.monotonic() - start)


def _stopped(server: Server, line: int) -> Result:
    start = time.monotonic()
    code = server.stop()
    server.wait_for("\0", 5.0)  # collects what it printed while stopping
    _keep_log(line, "".join(server.output))
    # forge serve exits 0 after Ctrl-C and its drain; make reports an interrupted recipe as 2.
    status = "ok" if code in (0, 2, -signal.SIGINT) else f"FAILED: exit {code} on Ctrl-C"
    return Result(line, "Ctrl-C to the server", status, code, time.monotonic() - start)


def setup_stamp(checkout: Path) -> str:
    """What scripts/setup.sh records in .venv/.llm-forge-setup for this checkout."""
    digest = hashlib.sha256()
    for name in ("pyproject.toml", "scripts/setup.sh"):
        digest.update((checkout / name).read_bytes())
    return digest.hexdigest()


def fresh_clone(where: Path) -> Path:
    """This checkout's HEAD as a new clone would have it: tracked files only."""
    clone = where / "llm-forge"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)],
                   check=True)
    return clone


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", default="README.md")
    parser.add_argument("--here", action="store_true", help="run in this checkout, not a clone")
    parser.add_argument("--venv", type=Path, help="an existing venv to use as the clone's .venv")
    parser.add_argument("--with", dest="with_", action="append", default=[],
                        help="run a command a skip= marker leaves out (e.g. 'make test')")
    parser.add_argument("--list", action="store_true", help="print the blocks and exit")
    args = parser.parse_args()
    blocks = parse((ROOT / args.readme).read_text())
    if args.list:
        for block in blocks:
            print(block.line, block.kind, block.options,
                  [c.text for c in block.commands] or block.body.splitlines()[:1])
        return 0
    LOGS.append(Path(tempfile.mkdtemp(prefix="readme-check-logs-")))
    print(f"[check] every command's output: {LOGS[0]}", flush=True)
    with tempfile.TemporaryDirectory(prefix="readme-check-") as tmp:
        cwd = ROOT if args.here else fresh_clone(Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(cwd))
        if args.venv is not None:
            venv = args.venv.resolve()
            stamp = venv / ".llm-forge-setup"
            if not stamp.is_file() or stamp.read_text().strip() != setup_stamp(cwd):
                print(f"error: {venv} was not set up from this pyproject.toml and setup.sh "
                      f"(make would reinstall into it)", file=sys.stderr)
                return 2
            if not args.here:
                (cwd / ".venv").symlink_to(venv)
        python = str(cwd / ".venv" / "bin" / "python")
        start = time.monotonic()
        results = run_blocks(blocks, cwd, env, python, set(args.with_))
    print(f"\n{'line':>5}  {'exit':>4}  {'seconds':>7}  status   command")
    for r in results:
        code = "-" if r.exit_code is None else str(r.exit_code)
        first = shlex.split(r.command.splitlines()[0], posix=False)[:12]
        print(f"{r.line:>5}  {code:>4}  {r.seconds:>7.1f}  {r.status[:120]}   {' '.join(first)}")
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)} of {len(results)} ok in "
          f"{time.monotonic() - start:.0f} s; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
