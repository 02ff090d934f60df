"""Choosing a free local TCP port for a process about to bind it (the ring backend's ranks, a
test's server).

The kernel hands out ports from its ephemeral range to `bind(0)` and to every outgoing
connection, so a port found by `bind(0)` and released can be taken by any new connection on the
machine before its process binds it (EADDRINUSE). Below that range only an explicit bind can
take a port: the port is drawn there, and checked free.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 1024  # below: privileged
_SPAN = 16384  # how far below the ephemeral range to draw
_TRIES = 64


def ephemeral_range(path: Path = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", path: Path = _RANGE_FILE) -> int:
    """A port on `host` that no socket holds, drawn below the ephemeral range when there is
    room (else the kernel's choice)."""
    low, _ = ephemeral_range(path)
    first = max(_LOWEST, low - _SPAN)
    if low > first:
        for _ in range(_TRIES):
            port = random.randrange(first, low)
            if _bindable(port, host):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
