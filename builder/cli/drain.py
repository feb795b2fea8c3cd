"""`forge drain`: ask a running `forge serve` to drain (the rendered Deployment's preStop hook).

It POSTs the health port's drain path, which starts the drain exactly as SIGTERM does. With
`--wait` it returns once forge serve has finished draining: its readiness says "drained", or
its health port stops answering (forge serve has exited), within `--timeout`.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import click

from builder.errors import EXIT_INTERNAL, fail
from builder.serving.addresses import LOOPBACK, bind_address, connect_host
from builder.serving.health import DEFAULT_HEALTH_PORT, DRAIN_PATH, READINESS_PATH

POLL_SECONDS = 0.5
REQUEST_SECONDS = 5.0


def post_drain(base_url: str, timeout: float = REQUEST_SECONDS) -> str:
    """POST the drain; its answer's reason. A RuntimeError with the cause if it is refused or
    nothing answers."""
    request = urllib.request.Request(f"{base_url}{DRAIN_PATH}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return _reason(reply.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base_url}{DRAIN_PATH} refused the drain: HTTP {exc.code} "
                           f"{_reason(exc.read())}") from None
    except (urllib.error.URLError, OSError) as exc:
        cause = getattr(exc, "reason", exc)
        raise RuntimeError(f"nothing answers on {base_url} ({cause}): is forge serve running "
                           f"with this --health-port?") from None


def drain_state(base_url: str, timeout: float = REQUEST_SECONDS) -> str | None:
    """The readiness status forge serve reports ("draining", "drained", ...), or None once its
    health port no longer answers."""
    try:
        with urllib.request.urlopen(f"{base_url}{READINESS_PATH}", timeout=timeout) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except (urllib.error.URLError, OSError):
        return None
    try:
        return str(json.loads(body).get("status", ""))
    except (ValueError, AttributeError):
        return ""


def wait_drained(base_url: str, timeout: float) -> bool:
    """True once forge serve has drained (or exited) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if drain_state(base_url, min(REQUEST_SECONDS, max(0.5, left))) in (None, "drained"):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)


def _reason(body: bytes) -> str:
    try:
        return str(json.loads(body).get("reason", ""))
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:200]


@click.command("drain")
@click.option("--health-port", type=click.IntRange(1, 65535), default=DEFAULT_HEALTH_PORT,
              show_default=True, help="forge serve's --health-port.")
@click.option("--host", default=LOOPBACK, show_default=True,
              help="Where forge serve's health port answers (the drain is taken from loopback "
                   "clients only).")
@click.option("--wait", is_flag=True,
              help="Return once forge serve has finished draining (requests in flight ended).")
@click.option("--timeout", type=click.FloatRange(0, 86400), default=300.0, show_default=True,
              help="With --wait: seconds to wait for the drain to finish (exit 1 after).")
def drain_command(health_port, host, wait, timeout) -> None:
    """Start the drain of a running forge serve, as SIGTERM does: readiness turns false at once,
    new requests are refused, requests in flight may finish within its --drain-timeout."""
    try:
        base_url = f"http://{connect_host(bind_address(host, '--host'))}:{health_port}"
    except ValueError as exc:
        fail(str(exc))
    started = time.monotonic()
    try:
        reason = post_drain(base_url)
    except RuntimeError as exc:
        fail(str(exc), code=EXIT_INTERNAL)
    click.echo(f"drain: {reason or 'started'} ({base_url})")
    if not wait:
        return
    if not wait_drained(base_url, timeout):
        fail(f"forge serve on {base_url} had not finished draining after {timeout:g} s",
             code=EXIT_INTERNAL)
    click.echo(f"drain: finished after {time.monotonic() - started:.1f} s")
