"""Loopback networking helpers shared by the stack, the launchers and the tests."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on right now (the kernel picks it; racy by nature, so bind soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
