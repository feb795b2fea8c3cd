"""The addresses `forge serve` binds its ports to, and the ones it connects to them by.

Triton's HTTP, gRPC and metrics ports and forge serve's own ports (OpenAI, health) each bind to
an address given on the command line. Loopback is the default everywhere: Triton's ports take no
key, so opening them (`--triton-host 0.0.0.0`) is a choice the deployment makes with a
NetworkPolicy in front. A wildcard bind is reached through loopback from this machine.
"""
from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def bind_address(value: str, option: str) -> str:
    """`value` if it is an IP address to bind to; a ValueError naming `option` otherwise."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{option} {value!r}: expected an IP address such as 127.0.0.1 "
                         f"(this machine only) or 0.0.0.0 (every interface)") from None
    return value


def connect_host(bound: str) -> str:
    """The host part of a URL that reaches a port bound to `bound` from this machine."""
    ip = ipaddress.ip_address(bound)
    if ip.is_unspecified:
        return LOOPBACK if ip.version == 4 else "[::1]"
    return f"[{bound}]" if ip.version == 6 else bound


def check_port_free(host: str, port: int, option: str) -> None:
    """A ValueError naming `option` when `port` cannot be bound on `host` now (port 0, a free
    one picked later, always passes)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"{option} {port}: cannot bind {host}:{port} ({exc.strerror}); "
                             f"another server holds it? (0 picks a free port)") from None
