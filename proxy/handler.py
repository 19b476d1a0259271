"""aiohttp's per-connection request handler, with a send timeout (nginx's ``send_timeout``).

aiohttp has no write timeout: a client that sends a request and never reads the answer keeps
its connection, the answer's bytes and, on pass-through, an upstream connection, for as long as
it likes. The transport tells its protocol when its send buffer fills past the high-water mark
(``pause_writing``) and when it has drained again (``resume_writing``); a connection that stays
paused for ``send_timeout`` is aborted, as nginx counts its timeout between two successive
writes. A client that reads slowly but steadily drains the buffer now and then and is not cut.
Aborting, not closing: ``close()`` would wait for the very buffer that does not drain.

``stuck_since`` also tells the connection bound (``limits``) which connections are stuck
writing, so that they can make room for new ones. Relied on, private: ``Server._kwargs``, the
handler settings ``Server.__call__`` passes to every handler it makes.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

log = logging.getLogger(__name__)


class Handler(web.RequestHandler):
    """A ``RequestHandler`` whose connection is aborted after ``send_timeout`` seconds of an
    answer making no progress."""

    __slots__ = ("_cut_off_at", "_send_timeout", "_stream", "stuck_since")

    def __init__(self, manager: web.Server, *, send_timeout: float, **kwargs: object) -> None:
        super().__init__(manager, **kwargs)  # type: ignore[arg-type]
        self._send_timeout = send_timeout
        self._cut_off_at: asyncio.TimerHandle | None = None
        # aiohttp forgets its transport once it has asked it to close (which waits for the
        # send buffer to drain): kept here, to abort it.
        self._stream: asyncio.Transport | None = None
        self.stuck_since: float | None = None  # loop time since the send buffer is full

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._stream = transport  # type: ignore[assignment]
        super().connection_made(transport)

    def pause_writing(self) -> None:
        super().pause_writing()
        loop = asyncio.get_running_loop()
        self.stuck_since = loop.time()
        self._cut_off_at = loop.call_later(self._send_timeout, self._timed_out)

    def resume_writing(self) -> None:
        self._stop_timer()
        super().resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_timer()
        self._stream = None
        super().connection_lost(exc)

    def _stop_timer(self) -> None:
        self.stuck_since = None
        if self._cut_off_at is not None:
            self._cut_off_at.cancel()
            self._cut_off_at = None

    def _timed_out(self) -> None:
        self._cut_off_at = None
        peer = self._stream.get_extra_info("peername") if self._stream else None
        log.info(
            "closed a connection whose client read none of its answer for send_timeout %gs "
            "(peer %s)",
            self._send_timeout,
            peer[0] if peer else "unknown",
        )
        self.cut_off()

    def cut_off(self) -> None:
        """Abort the connection: its unsent bytes are dropped, its descriptor freed now."""
        self._stop_timer()
        if self._stream is not None:
            self._stream.abort()


def factory(server: web.Server, send_timeout: float) -> Handler:
    """A new connection's handler, made as ``server()`` makes one, with ``send_timeout``."""
    return Handler(
        server,
        loop=asyncio.get_running_loop(),
        send_timeout=send_timeout,
        **server._kwargs,
    )
