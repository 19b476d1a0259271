"""Loopback ports for the tests: a free one, and whether something listens on one."""

from __future__ import annotations

import asyncio
import contextlib
import socket


def free_port() -> int:
    """A port nothing listens on (the kernel just handed it out and it was released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def accepts(port: int) -> bool:
    """Whether a connection to 127.0.0.1:port is accepted."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True
