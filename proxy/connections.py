"""The per-worker bound on client connections, and the open-file limit it has to fit under.

Every client connection holds a file descriptor until it closes, also while it idles between
requests or while its headers are still arriving. Without a bound, enough such connections use
up the open-file limit and the kernel's accept() fails: a real webhook then cannot connect until
aiohttp's keep-alive timer (``client_timeout``) closes some.

At start-up the soft RLIMIT_NOFILE is raised to the hard limit, as Go's runtime does, and the
bound is ``max_connections`` or, when that does not fit, what the limit leaves once the
descriptors the proxy needs for itself are set aside. At the bound, a new connection makes room
by closing the one that has waited longest for a request (an idle keep-alive connection, or one
whose headers never finished: the one aiohttp's keep-alive timer would close first), or else
the one stuck longest writing an answer its client does not read (see ``Handler``: its claim is
committed already). A connection whose request is being read or handled is never closed. When
none can be closed, the new connection is answered with a fixed 503 and Retry-After before
aiohttp ever sees it.

aiohttp has no hook for this. What is relied on: ``runner.server`` is the protocol factory
``SockSite`` passes to ``loop.create_server``; ``Server.connections`` lists the open connections
in the order they were made; ``BaseSite`` subclasses register with their runner, which stops
them before draining; ``RequestHandler.force_close()`` is what aiohttp's keep-alive timer calls.
Private, three attributes of ``RequestHandler``: ``_request_count`` (request heads parsed so
far), ``_waiter`` (a future not yet done exactly while it waits for the next request, the test
aiohttp's keep-alive timer makes) and ``_next_keepalive_close_time`` (when that timer would close
the connection).

The send timeout (nginx's ``send_timeout``, ``Handler``). aiohttp has no write timeout: a client
that sends a request and never reads the answer keeps its connection, the answer's bytes and, on
pass-through, an upstream connection, for as long as it likes. The transport tells its protocol
when its send buffer fills past the high-water mark (``pause_writing``) and when it has drained
again (``resume_writing``); a connection that stays paused for ``send_timeout`` is aborted, as
nginx counts its timeout between two successive writes. A client that reads slowly but steadily
drains the buffer now and then and is not cut. Aborting, not closing: ``close()`` would wait for
the very buffer that does not drain.

At a drain aiohttp closes every connection that is not handling a request. One accepted a moment
before the listener closed usually has its request on the wire, not yet parsed, and a kept-alive
one under steady traffic has its next request on the wire: closed, either is reset though the
proxy had accepted it (a reload drains every worker under traffic, so it happened at every
reload). ``settle`` gives them up to ``SETTLE_WITHIN`` to send that request before aiohttp's drain
begins; the drain answers it with ``Connection: close`` (``app``), and the client's next
connection goes to the listener's other holders (a reload's new workers) or is refused.

``stuck_since`` also tells the connection bound (``ConnectionLimit``) which connections are stuck
writing, so that they can make room for new ones. Relied on, private: ``Server._kwargs``, the
handler settings ``Server.__call__`` passes to every handler it makes.

The head bound (``max_head``, ``Handler``). aiohttp limits each line of a request head (8,190
bytes) and their number (128), not their sum: a head of about 1 MiB is parsed, and stays in
memory (about 2 MiB of RSS) for as long as its request lasts, outside ``max_buffered``, while
its body trickles. Here a head is counted as its bytes arrive, while the connection waits for
one, and a whole head is measured once parsed; past ``max_head`` the request is answered
``431`` and its connection closed, through aiohttp's own path for a request its parser refused
(in order behind a pipelined request still in progress). Relied on, private: the handler's
``_messages`` queue and ``_waiter``, and ``web_protocol._ErrInfo``, what the parser's refusals
are queued as.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections.abc import Callable
from typing import cast

from aiohttp import http_exceptions, streams, web, web_protocol

from proxy import config
from proxy.upstream import forwarder

log = logging.getLogger(__name__)

# Listeners, standard streams and log files, the event loop's own descriptors, the admin
# listener's connections (admin.MAX_CONNECTIONS, and as many in its queue) and refused
# connections still being answered.
MARGIN = 64
# At a drain: how long a connection waiting for a request (just accepted, or kept alive) has to
# send it (on a busy connection, the next round trip) before aiohttp closes those still waiting.
SETTLE_WITHIN = 1.0
_SETTLE_POLL = 0.01
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Retry-After: 5\r\n"
    b"Content-Length: 0\r\n"
    b"Connection: close\r\n\r\n"
)
# A refused client gets this long to read the 503 and hang up. Closing a socket with its request
# still unread would send a reset, which may destroy the 503 before the client reads it.
_LINGER = 2.0
_MAX_LINGERING = 32  # past this many, refused connections are closed at once
_REPORT_EVERY = 10.0


def raise_open_files() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
        else:
            log.info("open-file limit raised from %d to %d (the hard limit)", soft, hard)
            return hard
    log.info("open-file limit: %s", "unlimited" if soft == resource.RLIM_INFINITY else soft)
    return soft


def connection_bound(cfg: config.Config, open_files: int) -> int:
    """``max_connections``, lowered if the open-file limit cannot hold that many."""
    reserve = (
        2 * cfg.database.pool_size
        + forwarder.UNCLAIMED_HEADROOM
        + forwarder.PASSTHROUGH_CONNECTIONS
        + MARGIN
    )
    if open_files == resource.RLIM_INFINITY or cfg.max_connections <= open_files - reserve:
        log.info("at most %d open client connections (max_connections)", cfg.max_connections)
        return cfg.max_connections
    bound = max(1, open_files - reserve)
    log.warning(
        "max_connections lowered from %d to %d: the open-file limit is %d, and %d descriptors "
        "are kept for the database pool, the upstream connections and the proxy's own files; "
        "raise the hard limit (ulimit -Hn, systemd's LimitNOFILE, the container's nofile) to "
        "allow more",
        cfg.max_connections,
        bound,
        open_files,
        reserve,
    )
    return bound


class ConnectionLimit:
    """A protocol factory in front of aiohttp's ``Server``: at most ``bound`` open connections.

    ``shed`` is called for each connection shed, closed to make room or refused; one warning
    line, naming the bound ``name``, reports them, at most every ``_REPORT_EVERY`` seconds while
    shedding goes on. At most ``max_lingering`` refused connections wait for their client to
    read the 503; past that, they are closed at once. Each admitted connection's handler ends
    answers that make no progress for ``send_timeout`` and heads over ``max_head`` bytes.
    """

    def __init__(
        self,
        server: web.Server,
        bound: int,
        shed: Callable[[], None],
        *,
        send_timeout: float,
        max_head: int,
        name: str = "max_connections",
        max_lingering: int = _MAX_LINGERING,
    ) -> None:
        self._server = server
        self._send_timeout = send_timeout
        self._max_head = max_head
        self._bound = bound
        self._shed = shed
        self._name = name
        self.max_lingering = max_lingering
        self._loop = asyncio.get_running_loop()
        self._closed = 0
        self._refused = 0
        self._report: asyncio.TimerHandle | None = None
        self.lingering = 0

    def __call__(self) -> asyncio.Protocol:
        return _Admission(self)

    def admit(self) -> web.RequestHandler | None:
        """aiohttp's handler for a new connection, once there is room for it; None: refuse it."""
        if len(self._server.connections) >= self._bound:
            # Handlers still finishing a request whose client hung up hold no descriptor.
            open_ = [h for h in self._server.connections if h.connected]
            if len(open_) >= self._bound:
                idle = [h for h in open_ if _waiting(h)]
                stuck = [h for h in open_ if isinstance(h, Handler) and h.stuck_since is not None]
                if idle:
                    min(idle, key=lambda h: h._next_keepalive_close_time).force_close()
                elif stuck:
                    # Its answer is not being read: the claim behind it is committed already.
                    min(stuck, key=lambda h: h.stuck_since or 0.0).cut_off()
                else:
                    self._count(refused=True)
                    return None
                self._count(refused=False)
        return factory(self._server, self._send_timeout, self._max_head)

    def _count(self, *, refused: bool) -> None:
        self._shed()
        if refused:
            self._refused += 1
        else:
            self._closed += 1
        if self._report is None:
            self._flush()

    def _flush(self) -> None:
        if not self._closed and not self._refused:
            self._report = None
            return
        log.warning(
            "%s (%d) reached: closed %d idle connection(s) and refused %d new one(s) since the "
            "previous such line",
            self._name,
            self._bound,
            self._closed,
            self._refused,
            extra={"fields": {"closed": self._closed, "refused": self._refused}},
        )
        self._closed = self._refused = 0
        self._report = self._loop.call_later(_REPORT_EVERY, self._flush)

    def close(self) -> None:
        if self._report is not None:
            self._report.cancel()
            self._report = None


async def settle(server: web.Server | None, within: float = SETTLE_WITHIN) -> None:
    """Once the listeners have closed: until no open connection waits for a request (each is
    handling one, or gone), or ``within`` seconds (a client with nothing more to send)."""
    if server is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while any(h.connected and _waiting(h) for h in server.connections):
        if loop.time() >= deadline:
            return
        await asyncio.sleep(_SETTLE_POLL)


def _waiting(handler: web.RequestHandler) -> bool:
    """Whether the connection waits for a request: it has not sent a whole request head yet
    (its handler may not have started), or it idles between requests."""
    waiter = handler._waiter
    return handler._request_count == 0 or (waiter is not None and not waiter.done())


class _Admission(asyncio.Protocol):
    """A new connection's protocol until it is made: then aiohttp's handler takes the transport
    over, or the connection is refused here."""

    def __init__(self, limit: ConnectionLimit) -> None:
        self._limit = limit
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        handler = self._limit.admit()
        if handler is not None:
            transport.set_protocol(handler)
            handler.connection_made(transport)
            return
        # uvloop's transports are not asyncio.Transport subclasses, hence no isinstance().
        stream = cast(asyncio.Transport, transport)
        stream.write(REFUSAL)
        if self._limit.lingering >= self._limit.max_lingering:
            stream.close()
            return
        self._limit.lingering += 1
        stream.write_eof()
        self._timer = asyncio.get_running_loop().call_later(_LINGER, stream.abort)

    def data_received(self, data: bytes) -> None:
        pass  # the refused request, discarded

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._limit.lingering -= 1


class BoundedSite(web.BaseSite):
    """A listener like ``web.SockSite`` on a bound socket, its connections admitted by a
    ``ConnectionLimit`` (the keyword arguments but ``backlog`` are passed on to it)."""

    __slots__ = (
        "_app_runner", "_bound", "_limit", "_limit_name", "_listener", "_max_head",
        "_max_lingering", "_name", "_send_timeout", "_shed", "_sock",
    )  # fmt: skip

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        *,
        bound: int,
        shed: Callable[[], None],
        backlog: int,
        send_timeout: float,
        max_head: int,
        name: str = "max_connections",
        max_lingering: int = _MAX_LINGERING,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._app_runner = runner  # BaseSite keeps its own reference private
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self._name = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._bound = bound
        self._shed = shed
        self._limit_name = name
        self._max_lingering = max_lingering
        self._send_timeout = send_timeout
        self._max_head = max_head
        self._limit: ConnectionLimit | None = None
        self._listener: asyncio.AbstractServer | None = None

    @property
    def name(self) -> str:
        return self._name

    def admission(self) -> asyncio.Protocol:
        """The protocol of a connection accepted elsewhere (``shared_port.Adopter``), admitted
        under this site's bound like its own."""
        assert self._limit is not None, "the site is not started"
        return self._limit()

    async def start(self) -> None:
        await super().start()
        server = self._app_runner.server
        assert server is not None  # BaseSite refuses a runner that is not set up
        self._limit = ConnectionLimit(
            server,
            self._bound,
            self._shed,
            send_timeout=self._send_timeout,
            max_head=self._max_head,
            name=self._limit_name,
            max_lingering=self._max_lingering,
        )
        self._listener = await asyncio.get_running_loop().create_server(
            self._limit, sock=self._sock, backlog=self._backlog
        )

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._limit is not None:
            self._limit.close()
        await super().stop()


class HeadTooLarge(http_exceptions.HttpProcessingError):
    """A request head over ``max_head`` bytes: answered 431, its connection closed."""

    code = 431


class Handler(web.RequestHandler):
    """A ``RequestHandler`` whose connection is aborted after ``send_timeout`` seconds of an
    answer making no progress, and whose request heads may hold at most ``max_head`` bytes."""

    __slots__ = (
        "_body", "_cut_off_at", "_head_bytes", "_max_head", "_send_timeout", "_stream",
        "stuck_since",
    )  # fmt: skip

    def __init__(
        self, manager: web.Server, *, send_timeout: float, max_head: int, **kwargs: object
    ) -> None:
        super().__init__(manager, **kwargs)  # type: ignore[arg-type]
        self._send_timeout = send_timeout
        self._max_head = max_head
        # Bytes received since the connection began to wait for a head (None: refused one),
        # and the body of the request parsed last, while its bytes may still be arriving.
        self._head_bytes: int | None = 0
        self._body: streams.StreamReader | None = None
        self._cut_off_at: asyncio.TimerHandle | None = None
        # aiohttp forgets its transport once it has asked it to close (which waits for the
        # send buffer to drain): kept here, to abort it.
        self._stream: asyncio.Transport | None = None
        self.stuck_since: float | None = None  # loop time since the send buffer is full

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._stream = transport  # type: ignore[assignment]
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is None:
            return  # what follows a refused head: its connection closes once it is answered
        if self._body is None or self._body.is_eof():
            # Bytes of a head: at most one read's worth of them is missed where a request and
            # the start of the next one arrive together.
            self._head_bytes += len(data)
        parsed = self._request_count
        super().data_received(data)
        parsed = self._request_count - parsed
        if parsed:
            self._head_bytes = 0
            messages = self._messages
            for index in range(len(messages) - parsed, len(messages)):
                message, body = messages[index]
                if isinstance(message, web_protocol._ErrInfo):
                    continue
                size = len(message.path) + sum(len(k) + len(v) + 4 for k, v in message.raw_headers)
                if size > self._max_head:
                    messages[index] = self._refusal(f"a request head of {size} bytes")
                    while len(messages) > index + 1:
                        messages.pop()  # pipelined behind it: the connection closes first
                    self._head_bytes = None
                    return
                self._body = body
        elif self._head_bytes > self._max_head:
            self._messages.append(self._refusal(f"more than {self._head_bytes} bytes of head"))
            self._head_bytes = None
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    def _refusal(self, what: str) -> tuple[web_protocol._ErrInfo, streams.StreamReader]:
        exc = HeadTooLarge(message=f"{what}, over max_head {self._max_head}")
        refusal = web_protocol._ErrInfo(status=431, exc=exc, message=exc.message)
        return refusal, streams.EMPTY_PAYLOAD

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


def factory(server: web.Server, send_timeout: float, max_head: int) -> Handler:
    """A new connection's handler, made as ``server()`` makes one, with ``send_timeout`` and
    ``max_head``."""
    return Handler(
        server,
        loop=asyncio.get_running_loop(),
        send_timeout=send_timeout,
        max_head=max_head,
        **server._kwargs,
    )
