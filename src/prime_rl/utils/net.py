"""Small networking helpers shared by the launcher, the trainer and tests."""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The lowest port the OS hands out as a client's source port (Linux's setting; 32768 elsewhere)."""
    try:
        return int(PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller binds it soon after), below the ephemeral range: a client
    polling a port nobody listens on yet can be given that very port as its own source port and connect to
    itself (TCP self-connect), and the server then cannot bind it."""
    low = ephemeral_low()
    draw = random.Random()
    for _ in range(100):
        port = draw.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is full: any free port
        s.bind((host, 0))
        return s.getsockname()[1]


def probe_client(timeout: float = 5.0):
    """An `httpx.Client` for repeated probes of a loopback service (health polls). One client for all of them:
    each module-level `httpx.get` builds a TLS context, loading the CA bundle (~40 ms of CPU), even for plain
    http. No keep-alive: every probe opens its own connection, as a new client would."""
    import httpx

    return httpx.Client(timeout=timeout, limits=httpx.Limits(max_keepalive_connections=0))
