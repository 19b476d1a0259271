"""A small keep-alive HTTP/1.1 client for the webhook path: a body already in memory goes out in
one write, and the app's whole answer comes back, parsed by llhttp (through ``httptools``).

Why not aiohttp's client here: it costs markedly more CPU per call (bench/forward_cpu.py
measures both), the largest single cost of a proxied webhook. The webhook path needs a small
part of HTTP (plain ``http://`` to the app, a known body length, the answer read whole), so it
gets a small client; ``transports`` puts it and aiohttp's client behind one interface.

Reading the answer is strict: llhttp in strict mode refuses a malformed status line or header,
an obsolete folded header, both Content-Length and Transfer-Encoding, repeated Content-Lengths,
a bad chunk and a bare CR or LF, each as soon as it arrives; this module adds what llhttp lets
through (a transfer coding other than chunked, Transfer-Encoding on HTTP/1.0, a version other
than 1.x, a switch of protocols, a head over ``MAX_HEAD``). Anything refused is answered 502,
never guessed at. obs-text (RFC 9110 5.5: bytes over 0x7F, opaque to a recipient) in a header
value or the reason phrase is kept: decoded as UTF-8 with surrogate escapes, as aiohttp's client
and server decode it, it is written back as the bytes the app sent (``forwarder``). A failure
after the final status line carries that status: a 2xx means the app did the work. A connection goes
back to the idle list only after a complete answer that allows it; anything the app sends on an
idle connection closes it (an answer nobody asked for must never become the next request's). An
idle connection is reused for ``keepalive`` seconds, less when the app's ``Keep-Alive`` header
says it closes sooner (``idle_limit``); a request on a reused connection that the app closes
before a byte of the answer is sent once more (``Client.request`` says why). Socket errors,
timeouts and a connection closed before the answer is complete are translated into ``errors``
here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import httptools
from multidict import CIMultiDict

from proxy import errors

log = logging.getLogger(__name__)

# Told the size of each part of an answer's body before it is held; raises to refuse it.
Reserve = Callable[[int], None]


def unlimited(size: int) -> None:
    """A Reserve that refuses nothing."""


MAX_HEAD = 64 * 1024  # status line and headers (aiohttp's client allows 8 KiB per line)
MAX_CHUNK_LINE = 4096  # framing bytes allowed per chunk, beside MAX_HEAD for the trailers
MAX_TRAILERS = 100
MAX_INTERIM = 10
# An idle connection is reused only until this long before the app's advertised keep-alive
# timeout ends: the app's timer starts when it has written the answer, a little before ours.
KEEPALIVE_MARGIN = 0.5

_LENGTH = re.compile(rb"[0-9]{1,19}")  # fits in 63 bits, as Go's limit does
_TIMEOUT = re.compile(r"[0-9]{1,9}")
# What a reason phrase or field value must not hold (RFC 9110 5.5, RFC 9112 4): the control
# characters but HTAB. aiohttp's server writer refuses the same; llhttp lets them into a reason.
CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def idle_limit(configured: float, keep_alive: str | None) -> float:
    """How long a connection may stay idle and still be reused: ``configured``, or less when
    the app's ``Keep-Alive: timeout=N`` says it closes idle connections sooner; 0 for never.

    N is whole seconds (RFC 2068 19.7.1.1); N <= 1 leaves no safe window at all.
    """
    for item in (keep_alive or "").split(","):
        name, _, value = item.partition("=")
        if name.strip(" \t").lower() == "timeout" and _TIMEOUT.fullmatch(value.strip(" \t")):
            advertised = int(value.strip(" \t"))
            return 0.0 if advertised <= 1 else min(configured, advertised - KEEPALIVE_MARGIN)
    return configured


class _Failed(Exception):
    """The answer failed; ``status`` is its final status line's, when that had arrived."""

    status: int | None = None


class _Malformed(_Failed):
    """The app's answer is not HTTP/1.1 this client accepts."""


class _Closed(_Failed):
    """The connection ended before the answer was complete, after ``received`` bytes of it."""

    def __init__(self, received: int) -> None:
        super().__init__(received)
        self.received = received


class _Unsolicited(Exception):
    """Bytes followed the final answer: they answer no request."""


class _Stop(Exception):
    """The answer is complete where llhttp cannot tell (a HEAD answer's end)."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the app listens: ``host`` and ``port`` to connect to, the Host header to send."""

    host: str
    port: int
    authority: str


@dataclass(slots=True)
class Answer:
    """The app's answer, read whole, as every transport returns it and the pipeline relays it;
    obs-text in ``reason`` and header values as surrogate escapes. ``headers`` are the app's
    until the forwarder filters them for relaying."""

    status: int
    reason: str
    headers: CIMultiDict[str]
    body: bytes
    # 1 when it came on a new connection after a reused one closed unanswered (sent again).
    resend_count: int = 0

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def _text(value: bytes | bytearray) -> str:
    """``value`` as text that gives back its bytes: obs-text that is not UTF-8 (latin-1, as
    Tomcat and Jetty write) as surrogate escapes."""
    return value.decode("utf-8", "surrogateescape")


def _items(fields: Iterable[tuple[str, str]], name: str) -> list[str] | None:
    """The comma-separated items of every ``name`` field, stripped; None if there is none.

    Presence decides framing, not content: an empty item is kept (and refused by the caller
    where it matters), never read as "no such header".
    """
    found = [value for key, value in fields if key.lower() == name]
    if not found:
        return None
    # Only HTTP's whitespace and ASCII case: str.strip() takes U+00A0, "\u212a".lower() is "k".
    items = [item.strip(" \t") for value in found for item in value.split(",")]
    return [item.lower() if item.isascii() else item for item in items]


def _framing(
    fields: list[tuple[str, str]], version: str
) -> tuple[list[str] | None, list[str] | None]:
    """A final answer's Transfer-Encoding and Content-Length items, refusing framing that is
    ambiguous or that llhttp would read otherwise than the app meant."""
    codings = _items(fields, "transfer-encoding")
    lengths = _items(fields, "content-length")
    if codings is not None and lengths is not None:
        raise _Malformed("both Transfer-Encoding and Content-Length")
    if codings is not None and (version == "1.0" or codings != ["chunked"]):
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing; llhttp
        # would read another final coding as "until the connection closes".
        raise _Malformed(f"unsupported transfer coding {', '.join(codings)!r}")
    if lengths is not None and not _LENGTH.fullmatch(lengths[0].encode("utf-8", "surrogateescape")):
        raise _Malformed("Content-Length over 19 digits")
    return codings, lengths


class _Reader:
    """llhttp's callbacks for one exchange: the final answer, interim (1xx) ones skipped.

    ``feed`` raises ``_Malformed``, ``_Unsolicited`` once the answer is complete, or what
    ``reserve`` raises; ``eof`` completes an answer delimited by the end of the connection.
    """

    def __init__(self, method: str, reserve: Reserve) -> None:
        self._parser = httptools.HttpResponseParser(self)
        # RFC 9112 7.1.1 allows whitespace before a chunk extension ("5 ;x=y"); strict llhttp
        # refuses it, and this client accepted it before llhttp.
        self._parser.set_dangerous_leniencies(lenient_spaces_after_chunk_size=True)
        self._method = method
        self._reserve = reserve
        self._error: BaseException | None = None
        self.received = 0  # bytes of the answer so far
        self._head_bytes = 0  # before the final head ends: MAX_HEAD per head
        self._body_bytes = 0
        self._chunks = 0
        self._trailers = 0
        self._interim = 0
        self._head_done = False
        self._per_part = False  # each body part reserved as it comes (no Content-Length)
        self._status_line = False  # the current message's status line has been parsed
        self._reason = bytearray()  # llhttp hands it over in pieces
        self._reason_text = ""
        self._fields: list[tuple[str, str]] = []
        self._parts: list[bytes] = []
        self.until_eof = False  # the body ends when the app closes the connection
        self.keep = False  # the connection may carry another request after this answer
        self.answer: Answer | None = None

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if not self._head_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._error is not None:
                raise self._error from None
            where = "body" if self._head_done else "head"
            raise _Malformed(f"{exc} (in the {where})") from None
        if not self._head_done and self._head_bytes > MAX_HEAD * (self._interim + 1):
            raise _Malformed(f"the head of the answer is over {MAX_HEAD} bytes")
        # Heads, chunk lines and trailers: llhttp holds none of them whole (httptools holds one
        # header or trailer field), but an endless one would keep the exchange going.
        framing = self.received - self._body_bytes
        if framing > MAX_HEAD * (self._interim + 2) + self._chunks * MAX_CHUNK_LINE:
            raise _Malformed("the chunk framing or trailers of the answer are over their limit")

    def _fail(self, exc: BaseException) -> None:
        """Stop llhttp with ``exc``, re-raised by ``feed``."""
        self._error = exc
        raise exc

    def on_message_begin(self) -> None:
        if self.answer is not None:
            self._fail(_Unsolicited())
        self._status_line = False
        self._reason.clear()
        self._fields = []

    def on_status(self, reason: bytes) -> None:
        # llhttp calls this (also for an empty reason) only after three digits and a space.
        self._status_line = True
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._status_line = True
        # llhttp strips the whitespace before a value, not after it (and refuses controls in it).
        text = _text(value.rstrip(b" \t"))
        if self._head_done:
            self._trailers += 1  # dropped: a trailer never becomes a header of the answer
            if self._trailers > MAX_TRAILERS:
                self._fail(_Malformed(f"over {MAX_TRAILERS} trailer fields"))
            return
        self._fields.append((name.decode("ascii"), text))

    def on_headers_complete(self) -> None:
        self._status_line = True
        try:
            self._check_head()
        except (_Malformed, errors.AnswerOverBudget) as exc:
            self._fail(exc)

    def _check_head(self) -> None:
        status = self._parser.get_status_code()
        version = self._parser.get_http_version()
        reason = _text(self._reason)
        if CONTROL.search(reason):
            raise _Malformed("bad status line: a control character in the reason phrase")
        if version not in ("1.0", "1.1"):
            raise _Malformed(f"bad status line: HTTP/{version}")
        if status == 101:
            raise _Malformed("the app switched protocols")
        if status < 200:
            # 100 Continue, 103 Early Hints: the final answer follows on the same connection.
            self._interim += 1
            if self._interim > MAX_INTERIM:
                raise _Malformed(f"over {MAX_INTERIM} interim (1xx) answers")
            return
        fields = self._fields
        codings, lengths = _framing(fields, version)
        self._head_done = True
        self._reason_text = reason
        self.keep = version == "1.1" and "close" not in (_items(fields, "connection") or [])
        if self._method == "HEAD":
            # llhttp cannot be told that a HEAD answer has no body: stop here, and close.
            self.keep = False
            self._complete(status)
            self._fail(_Stop())
        if status in (204, 304):
            return
        if lengths is not None:
            self._reserve(int(lengths[0]))
            return
        self._per_part = True
        if codings is None:
            self.until_eof = True
            self.keep = False

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_body(self, part: bytes) -> None:
        self._body_bytes += len(part)
        if self._per_part:
            try:
                self._reserve(len(part))
            except errors.AnswerOverBudget as exc:
                self._fail(exc)
        self._parts.append(part)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if status >= 200:
            self._complete(status)

    def _complete(self, status: int) -> None:
        body = b"".join(self._parts)
        self.answer = Answer(status, self._reason_text, CIMultiDict(self._fields), body)

    def eof(self) -> None:
        """The app closed the connection: the end of the answer if its body runs to it."""
        if self.answer is None and self.until_eof:
            self._complete(self._parser.get_status_code())
        if self.answer is None:
            raise _Closed(self.received)

    @property
    def status(self) -> int | None:
        """The final answer's status once its status line is read (a 1xx is not final)."""
        if not self._status_line:
            return None
        status = self._parser.get_status_code()
        return status if status >= 200 else None


class _Connection(asyncio.Protocol):
    """One TCP connection to the app; the answer is parsed as its bytes arrive."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peer: str) -> None:
        self._loop = loop
        self._peer = peer
        self._fd = -1
        self.transport: asyncio.Transport | None = None
        self.reader: _Reader | None = None  # while a request is on it
        self.failure: BaseException | None = None  # what the reader raised
        self.ended = False  # the app closed its side, or the connection was lost
        self.idle = False  # in the client's idle list, with no request on it
        self.expires = 0.0  # loop time when an idle connection stops being reusable
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self._fd = transport.get_extra_info("socket").fileno()

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        if self.failure is not None:
            return  # the connection is closed when its request ends
        if reader is None:
            self.unsolicited(len(data))
            return
        try:
            reader.feed(data)
        except Exception as exc:  # handed to the request waiting on it
            self.failure = exc
        if reader.answer is not None or self.failure is not None:
            self._wake()

    def unsolicited(self, size: int | None) -> None:
        """Close the connection over bytes that answer no request, and say so once."""
        if not self.ended:
            log.warning(
                "upstream %s sent %s answering no request; closed the connection",
                self._peer,
                "bytes" if size is None else f"{size} bytes",
            )
        self.ended = True
        self.close()

    def still_idle(self) -> bool:
        """Whether this idle connection can carry a request: the app has sent nothing on it,
        not even bytes the loop has yet to deliver, which are read here from the socket."""
        if not self.reusable:
            return False
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            self.ended = True
            return False
        if data:
            self.unsolicited(len(data))
        else:
            self.ended = True  # the app closed it
        return False

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def exchange(self, message: bytes, body: bytes, reader: _Reader) -> Answer:
        """Send the request and wait for ``reader`` to have the whole answer."""
        assert self.transport is not None
        self.reader = reader
        # Two writes rather than one concatenation: no second copy of a large body.
        self.transport.writelines((message, body))
        try:
            while True:
                if reader.answer is not None:
                    if isinstance(self.failure, _Unsolicited):  # in the answer's last read
                        self.unsolicited(None)
                    return reader.answer
                if self.failure is not None:
                    raise self.failure
                if self.ended:
                    reader.eof()
                    continue
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        finally:
            self.reader = None

    @property
    def reusable(self) -> bool:
        return (
            not self.ended
            and self.failure is None
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def failure(exc: BaseException) -> str:
    """Why the app could not be reached, in words: the log line's error and the last column of
    ``events pending`` (never a Python repr, which that column would cut mid-way)."""
    if isinstance(exc, ConnectionRefusedError):
        return "upstream refused the connection: nothing listens there"
    if isinstance(exc, ConnectionResetError):
        return "upstream reset the connection"
    if isinstance(exc, socket.gaierror):
        return f"upstream host not found: {exc.strerror or exc}"
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"upstream failed: {text or type(exc).__name__}"


class Client:
    """Keep-alive connections to the app, per origin, reused most recently used first, at most
    ``connections`` of them in use at once."""

    def __init__(self, *, timeout: float, keepalive: float, connections: int) -> None:
        self._timeout = timeout
        self._keepalive = keepalive
        self._slots = asyncio.Semaphore(connections)
        self._idle: dict[Origin, list[_Connection]] = {}  # least recently used first
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    async def request(
        self,
        origin: Origin,
        method: str,
        target: str,
        *,
        headers: list[tuple[str, str]],
        body: bytes,
        reserve: Reserve = unlimited,
    ) -> Answer:
        """Send one request and read the whole answer, all within the timeout; ``reserve`` is
        told the answer body's size before it is held (and may raise to refuse it).

        A request on a reused connection that the app closes before a byte of its answer is
        sent once more, on a new connection. That is the race every keep-alive client meets: the
        app's idle timer closed the connection as the request went out. The app could also have
        acted and then closed without answering; but a webhook carries its event ID, which is an
        idempotency key (the one case Go's Transport retries a POST for, with Idempotency-Key),
        and answering 502 instead would have the provider send the same request again anyway.
        """
        head = [f"{method} {target} HTTP/1.1\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers]
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        message = "".join(head).encode("utf-8", "surrogateescape")
        reader: _Reader | None = None
        try:
            async with asyncio.timeout(self._timeout), self._slots:
                reused = self._take(origin)
                if reused is not None:
                    try:
                        reader = _Reader(method, reserve)
                        return await self._exchange(origin, reused, (message, body), reader)
                    except _Closed as exc:
                        if exc.received:
                            raise
                        log.info(
                            "upstream %s:%d closed a reused connection before answering; "
                            "sending the request again on a new one",
                            origin.host,
                            origin.port,
                        )
                connection = await self._open(origin)
                reader = _Reader(method, reserve)
                answer = await self._exchange(origin, connection, (message, body), reader)
                answer.resend_count = 0 if reused is None else 1
                return answer
        except TimeoutError as timed_out:
            raise errors.UpstreamTimeout(
                f"upstream did not answer within {self._timeout:g}s",
                upstream_status=None if reader is None else reader.status,
            ) from timed_out
        except _Malformed as malformed:
            raise errors.UpstreamUnavailable(
                f"upstream sent a malformed answer: {malformed}", upstream_status=malformed.status
            ) from None
        except _Closed as exc:
            raise errors.UpstreamUnavailable(
                "upstream closed the connection before answering completely",
                upstream_status=exc.status,
            ) from None
        except OSError as os_failure:
            raise errors.UpstreamUnavailable(failure(os_failure)) from os_failure

    async def _exchange(
        self,
        origin: Origin,
        connection: _Connection,
        outgoing: tuple[bytes, bytes],
        reader: _Reader,
    ) -> Answer:
        keep, limit = False, 0.0
        try:
            answer = await connection.exchange(*outgoing, reader)
            limit = idle_limit(self._keepalive, answer.headers.get("Keep-Alive"))
            keep = reader.keep and limit > 0
        except errors.AnswerOverBudget as exc:
            raise exc.after(reader.status) from None
        except _Failed as failed:
            failed.status = reader.status
            raise
        finally:
            if keep and connection.reusable and not self._closed:
                self._keep(origin, connection, limit)
            else:
                connection.close()
        return answer

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if now < connection.expires and connection.still_idle():
                connection.idle = False
                return connection
            connection.close()
        return None

    def _keep(self, origin: Origin, connection: _Connection, limit: float) -> None:
        loop = asyncio.get_running_loop()
        connection.idle = True
        connection.expires = loop.time() + limit
        self._idle.setdefault(origin, []).append(connection)
        if self._sweeper is None or self._sweeper.when() > connection.expires:
            if self._sweeper is not None:
                self._sweeper.cancel()
            self._sweeper = loop.call_at(connection.expires, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle past their limit; come back for the next one due."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for origin, idle in self._idle.items():
            kept = [c for c in idle if c.reusable and now < c.expires]
            for connection in idle:
                if connection not in kept:
                    connection.close()
            self._idle[origin] = kept
        due = [c.expires for idle in self._idle.values() for c in idle]
        if due:
            self._sweeper = asyncio.get_running_loop().call_at(min(due), self._sweep)

    async def _open(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(
            lambda: _Connection(loop, f"{origin.host}:{origin.port}"), origin.host, origin.port
        )
        return connection

    def close(self) -> None:
        """Close the idle connections; the ones in use close when their request ends."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
