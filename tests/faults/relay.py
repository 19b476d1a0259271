"""A TCP fault relay: listens on 127.0.0.1 and forwards each connection to a target (a TCP
address or a unix socket), with network faults switchable at run time.

Modes:

- ``pass``: bytes flow both ways.
- ``blackhole``: a partition. Every socket stays open but no byte moves in either direction;
  new connections are accepted and then held, without reaching the target, until the mode
  changes. No FIN, no RST: each side only sees silence (reading is paused, so data waits in
  the kernel buffers, as it would in TCP retransmission queues).
- ``reset``: every current connection is aborted (RST to the client, connection dropped at the
  target), and so is each new one while the mode lasts.
- ``refuse``: the listener is closed (new connections are refused) and every current
  connection is closed.

Buffers are bounded: a side is read only while its peer's write buffer is under its high-water
mark. Everything runs on the caller's event loop; ``close()`` aborts every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from typing import Literal

Mode = Literal["pass", "blackhole", "reset", "refuse"]
MODES: tuple[Mode, ...] = ("pass", "blackhole", "reset", "refuse")
Target = tuple[str, int] | str | os.PathLike[str]

_WRITE_HIGH_WATER = 64 * 1024


def _rst(transport: asyncio.Transport) -> None:
    """Abort so that the peer sees a reset, not an orderly close."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _Side(asyncio.Protocol):
    """One socket of a relayed connection: what it reads is written to its peer."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        # The peer's outgoing buffer is over its high-water mark: stop reading this side.
        self.held_back = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        # Nothing is read until the link decides this side may flow.
        transport.pause_reading()
        if self is self.link.client:
            self.link.relay._admit(self.link)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.transport.is_closing():
            peer.transport.write(data)

    def eof_received(self) -> bool:
        self.link.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.link.close()

    def pause_writing(self) -> None:
        if self.peer is not None:
            self.peer.held_back = True
            self.link.update()

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer.held_back = False
            self.link.update()

    def set_reading(self, reading: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if reading:
            transport.resume_reading()
        else:
            transport.pause_reading()


class _Link:
    """One accepted connection and, once connected, its connection to the target."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.client = _Side(self)
        self.server: _Side | None = None
        self.closed = False
        self.connecting: asyncio.Task[None] | None = None

    def sides(self) -> list[_Side]:
        return [self.client] if self.server is None else [self.client, self.server]

    def update(self) -> None:
        flowing = self.relay.mode == "pass" and self.server is not None and not self.closed
        for side in self.sides():
            side.set_reading(flowing and not side.held_back)

    def close(self) -> None:
        """Orderly close of both sides (buffered bytes are flushed first)."""
        self._finish()
        for side in self.sides():
            if side.transport is not None:
                side.transport.close()

    def abort(self) -> None:
        """Reset both sides."""
        self._finish()
        for side in self.sides():
            if side.transport is not None:
                _rst(side.transport)

    def _finish(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.relay._links.discard(self)
        if self.connecting is not None and not self.connecting.done():
            self.connecting.cancel()


class Relay:
    """A fault relay from ``127.0.0.1:<port>`` to ``target``; start it, then switch modes."""

    def __init__(
        self,
        target: Target,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.accepted = 0
        self._mode: Mode = "pass"
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def connections(self) -> int:
        """Connections currently open through the relay (held ones included)."""
        return len(self._links)

    async def start(self) -> int:
        """Listen; return the port (chosen by the system on first start if 0)."""
        await self._listen()
        return self.port

    async def set_mode(self, mode: Mode) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown relay mode {mode!r}")
        if self._closed:
            raise RuntimeError("the relay is closed")
        self._mode = mode
        if mode == "pass":
            self._flowing.set()
        else:
            self._flowing.clear()
        if mode == "refuse":
            for link in list(self._links):
                link.close()
            await self._unlisten()
        else:
            if mode == "reset":
                for link in list(self._links):
                    link.abort()
            await self._listen()
        for link in list(self._links):
            link.update()

    async def close(self) -> None:
        """Stop listening and abort every connection."""
        self._closed = True
        self._flowing.clear()
        for link in list(self._links):
            link.abort()
        await self._unlisten()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _listen(self) -> None:
        if self._server is not None:
            return
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._accept, self.host, self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _unlisten(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    def _accept(self) -> _Side:
        self.accepted += 1
        return _Link(self).client

    def _admit(self, link: _Link) -> None:
        if self._mode == "reset" or self._closed:
            link.abort()
            return
        if self._mode == "refuse":
            link.close()
            return
        self._links.add(link)
        task = asyncio.get_running_loop().create_task(self._connect(link))
        link.connecting = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, link: _Link) -> None:
        # A partition holds new connections too: nothing reaches the target until it heals.
        await self._flowing.wait()
        loop = asyncio.get_running_loop()
        server = _Side(link)
        try:
            async with asyncio.timeout(self.connect_timeout):
                if isinstance(self.target, tuple):
                    host, port = self.target
                    await loop.create_connection(lambda: server, host, port)
                else:
                    await loop.create_unix_connection(lambda: server, os.fspath(self.target))
        except (OSError, TimeoutError):
            link.abort()  # the target is not there: the client sees a reset
            return
        except asyncio.CancelledError:
            # The client left (its link closed, this task cancelled) just as the connection was
            # made: nobody else knows of that transport, so it would stay open until collected.
            if server.transport is not None:
                server.transport.abort()
            raise
        if link.closed:
            if server.transport is not None:
                server.transport.abort()
            return
        link.server = server
        server.peer, link.client.peer = link.client, server
        link.connecting = None
        link.update()
