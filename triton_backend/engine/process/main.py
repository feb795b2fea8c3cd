"""The engine process: an executor whose loop runs on the main thread of a process of its own.

torch's CPU kernels are fast only when their ops come from the thread that owns the process's
OpenMP team; stepped from any other thread (a Triton stub's, a server's worker) a prefill runs
2-4x slower. So the Triton model does not host the engine: it starts this process
(`ProcessExecutor`) and talks to it over a socket. Here the main thread runs the loop and does
nothing else; two small threads move messages (they never run torch ops):

- the reader turns messages from the client into executor verbs (enqueue, cancel, shutdown) and
  shuts the executor down when the client goes away (end of file: the client process died);
- the sender forwards every response as soon as the loop publishes it, with the counters and
  the loop's progress count (`engine/progress.py`); with nothing new to send it still sends a
  heartbeat every `HEARTBEAT_SECONDS`. The client's watchdog reads the count: a stopped process
  sends nothing, a deadlocked or endlessly looping main thread a count that stands still.

Messages are pickled tuples, `(kind, ...)`:
client -> engine: ("enqueue", request_id, Request), ("cancel", request_id), ("shutdown",)
engine -> client: ("ready", info), ("error", message) at start-up, ("responses", [Response],
stats, progress) (progress: the count, None for an executor without one: the naive baseline),
and ("closed",) once every final response has been sent.

    python -m triton_backend.engine.process.main --engine-dir DIR --fd N [--num-threads N] \
        [--options JSON]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from triton_backend.engine.cpu_budget import available_cores
from triton_backend.engine.engine_options import EngineOptions
from triton_backend.engine.request import FinishReason, Response

log = logging.getLogger("llm_forge.engine_process")
SEND_POLL_SECONDS = 0.05  # how often idle counters are refreshed for the client's metrics
HEARTBEAT_SECONDS = 0.25  # the longest the client goes without a message from a live engine


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="engine_process")
    parser.add_argument("--engine-dir", required=True)
    parser.add_argument("--fd", type=int, required=True, help="socket to the client")
    parser.add_argument("--num-threads", type=int, default=0, help="0: every core allowed")
    parser.add_argument("--options", default=EngineOptions().to_json(),
                        help="the EngineOptions, as EngineOptions.to_json writes them")
    return parser.parse_args(argv)


def _build_executor(args: argparse.Namespace, options: EngineOptions):
    from triton_backend.engine.config import EngineConfig

    config = EngineConfig.load(args.engine_dir)
    if config.target == "naive":
        from triton_backend.naive.executor import NaiveExecutor

        return NaiveExecutor(args.engine_dir, start_loop=False)
    from triton_backend.engine.executor import Executor

    return Executor(args.engine_dir, start_loop=False, **options.executor_kwargs())


class _Channel:
    """The socket to the client; sends from two threads, so they take turns."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: tuple) -> bool:
        with self._lock:
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError):  # the client is gone; the reader will notice
                return False


def _read_requests(channel: _Channel, executor) -> None:
    try:
        while True:
            message = channel.conn.recv()
            kind = message[0]
            if kind == "enqueue":
                _, request_id, request = message
                try:
                    executor.enqueue_request(request, request_id=request_id)
                except (ValueError, RuntimeError) as exc:  # checked by the client; still final
                    channel.send(("responses", [Response(request_id, [], True, FinishReason.ERROR,
                                                         error=str(exc))], executor.get_stats(),
                                  _progress_of(executor)))
            elif kind == "cancel":
                executor.cancel_request(message[1])
            elif kind == "shutdown":
                break
    except (EOFError, OSError):
        log.warning("engine client went away; shutting the engine down")
    executor.shutdown(timeout=0)


def _progress_of(executor) -> int | None:
    progress = getattr(executor, "progress", None)
    return None if progress is None else progress.count


def _send_responses(channel: _Channel, executor) -> None:
    last_stats, last_sent = None, 0.0
    while True:
        responses = executor.await_responses(timeout=SEND_POLL_SECONDS)
        stats = executor.get_stats()
        now = time.monotonic()
        if responses or stats != last_stats or now - last_sent >= HEARTBEAT_SECONDS:
            if not channel.send(("responses", responses, stats, _progress_of(executor))):
                return
            last_stats, last_sent = stats, now
        if not responses and not executor.is_alive():
            return  # the loop has ended and its last responses are out


def _set_num_threads(requested: int) -> int:
    import torch

    threads = requested if requested > 0 else available_cores()
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def serve(args: argparse.Namespace) -> int:
    channel = _Channel(Connection(args.fd))
    try:
        num_threads = _set_num_threads(args.num_threads)
        options = EngineOptions.from_json(args.options)
        executor = _build_executor(args, options)
    except BaseException as exc:  # report why, so the client can raise it where it was asked
        channel.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return 1
    stats = executor.get_stats()
    channel.send(("ready", {"pid": os.getpid(), "num_threads": num_threads,
                            "kv_cache_num_blocks": stats.get("num_total_blocks"),
                            "tokens_per_block": stats.get("tokens_per_block"),
                            "options": options, "stats": stats}))
    threading.Thread(target=_read_requests, args=(channel, executor), name="engine-reader",
                     daemon=True).start()
    sender = threading.Thread(target=_send_responses, args=(channel, executor),
                              name="engine-sender")
    sender.start()
    executor.run_loop()  # the main thread: where torch is fast
    sender.join(timeout=30)
    channel.send(("closed",))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s engine[%(process)d] %(levelname)s %(message)s")
    return serve(_parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
