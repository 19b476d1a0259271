"""A small keep-alive HTTP/1.1 client for the webhook path: a body already in memory goes out
in one write, and the app's whole answer comes back.

Why not aiohttp's client here: on the benchmark machine it costs 170 to 200 µs of CPU per call
against about 55 µs for a bare asyncio exchange, the largest single cost of a proxied webhook.
The webhook path needs a small part of HTTP (plain ``http://`` to the app, a known body
length, the answer read whole), so it gets a small client. Pass-through traffic (any method,
streamed both ways) and ``https://`` or credentialed upstreams keep aiohttp's client.

Reading the answer is strict: anything not understood (a malformed status line or header, an
obsolete folded header, both Content-Length and Transfer-Encoding, Content-Lengths that
disagree, a transfer coding other than chunked, a head or chunk line over its limit) is an
error, answered 502, never a guess. An answer that is not CRLF-delimited HTTP/1.x (HTTP/0.9,
bare LF) is refused as soon as that shows, not after the timeout. Header values and the reason
phrase must be UTF-8: the proxy's server writes them back as UTF-8, so that is the only obs-text
it can relay byte for byte, and other bytes are refused rather than altered. A connection goes
back to the idle list only after a complete answer that allows it; anything the app sends on an
idle connection closes it (an answer nobody asked for must never become the next request's), and
idle ones are dropped after ``keepalive`` seconds, before the app's own keep-alive timer could
close one under a request. Socket errors, timeouts and a connection closed before the answer is
complete are translated into ``errors`` here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from multidict import CIMultiDict

from proxy import errors

log = logging.getLogger(__name__)

# Told the size of each part of an answer's body before it is held; raises to refuse it.
Reserve = Callable[[int], None]


def unlimited(size: int) -> None:
    """A Reserve that refuses nothing."""


MAX_HEAD = 64 * 1024  # status line and headers (aiohttp's client allows 8 KiB per line)
MAX_CHUNK_LINE = 4096
MAX_TRAILERS = 100
MAX_INTERIM = 10

_STATUS = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9]{2})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
_FIELD = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*(.*?)[ \t]*")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,16}")
_LENGTH = re.compile(r"[0-9]{1,19}")  # fits in 63 bits, as llhttp's and Go's limits do
_HTTP1 = b"HTTP/1."
_BARE_EOL = re.compile(rb"\r(?=[^\n])|(?<!\r)\n")  # a CR still last may get its LF yet


class _Malformed(Exception):
    """The app's answer is not HTTP/1.1 this client accepts."""


class _Closed(Exception):
    """The connection ended before the answer was complete."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where the app listens: ``host`` and ``port`` to connect to, the Host header to send."""

    host: str
    port: int
    authority: str


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    reason: str
    headers: CIMultiDict[str]
    body: bytes


class _Connection(asyncio.Protocol):
    """One TCP connection to the app and the bytes it has sent that are not read yet."""

    def __init__(self, loop: asyncio.AbstractEventLoop, peer: str) -> None:
        self._loop = loop
        self._peer = peer
        self._fd = -1
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.ended = False  # the app closed its side, or the connection was lost
        self.idle = False  # in the client's idle list, with no request on it
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self._fd = transport.get_extra_info("socket").fileno()

    def data_received(self, data: bytes) -> None:
        if self.idle:
            self.unsolicited(len(data))
            return
        self.buffer += data
        self._wake()

    def unsolicited(self, size: int) -> None:
        """Close the connection over ``size`` bytes that answer no request, and say so once."""
        if not self.ended:
            log.warning(
                "upstream %s sent %d bytes answering no request; closed the connection",
                self._peer,
                size,
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

    async def _more(self) -> None:
        if self.ended:
            raise _Closed()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def head(self, limit: int) -> bytes:
        """The status line and header fields, up to the blank line that ends them (consumed,
        not returned), at most ``limit`` bytes.

        Refused as soon as it shows rather than when the timeout ends, since no blank line would
        ever follow: a first line that is not an HTTP/1.x status line (an HTTP/0.9 answer has
        none) and a bare CR or LF.
        """
        checked = 0
        while (eol := self.buffer.find(b"\r\n", max(0, checked - 1))) < 0:
            if not _HTTP1.startswith(self.buffer[: len(_HTTP1)]) or _BARE_EOL.search(
                self.buffer, max(0, checked - 1)
            ):
                raise _Malformed("bad status line: not HTTP/1.x ended by CRLF")
            if len(self.buffer) > limit:
                raise _Malformed(f"a line of the answer is over {limit} bytes")
            checked = len(self.buffer)
            await self._more()
        if not _STATUS.fullmatch(self.buffer, 0, eol):
            raise _Malformed(f"bad status line {bytes(self.buffer[: min(eol, 100)])!r}")
        return await self.line(b"\r\n\r\n", limit)

    async def line(self, separator: bytes, limit: int) -> bytes:
        """Bytes up to ``separator`` (consumed, not returned), at most ``limit`` of them; a bare
        CR or LF among them is refused as soon as it arrives."""
        checked = 0
        while True:
            end = self.buffer.find(separator, max(0, checked - len(separator) + 1))
            lines_end = len(self.buffer) if end < 0 else end + len(separator) - 2
            if _BARE_EOL.search(self.buffer, max(0, checked - 1), lines_end):
                raise _Malformed("a line of the answer not ended by CRLF")
            if end >= 0:
                if end > limit:
                    raise _Malformed(f"a line of the answer is over {limit} bytes")
                data = bytes(self.buffer[:end])
                del self.buffer[: end + len(separator)]
                return data
            if len(self.buffer) > limit:
                raise _Malformed(f"a line of the answer is over {limit} bytes")
            checked = len(self.buffer)
            await self._more()

    async def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._more()
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def rest(self, reserve: Reserve) -> bytes:
        """Everything until the app closes the connection, reserved as it arrives."""
        reserve(len(self.buffer))
        while not self.ended:
            held = len(self.buffer)
            await self._more()
            reserve(len(self.buffer) - held)
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    @property
    def reusable(self) -> bool:
        return (
            not self.ended
            and not self.buffer
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _head(block: bytes) -> tuple[int, int, str, list[tuple[str, str]]]:
    """(minor version, status, reason, headers) from a status line and header block."""
    lines = block.split(b"\r\n")
    status = _STATUS.fullmatch(lines[0])
    if status is None:
        raise _Malformed(f"bad status line {lines[0][:100]!r}")
    fields = []
    for line in lines[1:]:
        field = _FIELD.fullmatch(line)
        if field is None or _BAD_VALUE.search(field[2]):
            # The name only: a value may be a cookie or a token, and this goes to the log.
            raise _Malformed(f"bad header line {line.partition(b':')[0][:40]!r}:…")
        name = field[1].decode("ascii")
        fields.append((name, _relayable(field[2], f"bad header line: {name}'s value")))
    reason = _relayable(status[3] or b"", "bad status line: the reason phrase")
    return int(status[1]), int(status[2]), reason, fields


def _relayable(value: bytes, what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        # aiohttp's server writes str as UTF-8: it would drop these bytes surrogate-escaped, and
        # write each as two bytes decoded as latin-1.
        raise _Malformed(f"{what} has obs-text that is not UTF-8, not relayable as sent") from None


def _values(fields: list[tuple[str, str]], name: str) -> list[str] | None:
    """The comma-separated items of every ``name`` field, stripped; None if there is none.

    Presence decides framing, not content: an empty or blank item is kept (and refused by the
    caller where it matters), never read as "no such header".
    """
    found = [value for key, value in fields if key.lower() == name]
    if not found:
        return None
    # Only HTTP's whitespace and ASCII case: str.strip() takes U+00A0, "\u212a".lower() is "k".
    items = [item.strip(" \t") for value in found for item in value.split(",")]
    return [item.lower() if item.isascii() else item for item in items]


async def _chunked(connection: _Connection, reserve: Reserve) -> bytes:
    parts = []
    while True:
        line = await connection.line(b"\r\n", MAX_CHUNK_LINE)
        size, _, extensions = line.partition(b";")
        size = size.rstrip(b" \t")
        if not _CHUNK_SIZE.fullmatch(size) or _BAD_VALUE.search(extensions):
            raise _Malformed(f"bad chunk size line {line[:20]!r}")
        if int(size, 16) == 0:
            break
        reserve(int(size, 16))
        parts.append(await connection.exactly(int(size, 16)))
        if await connection.exactly(2) != b"\r\n":
            raise _Malformed("chunk not followed by CRLF")
    for _ in range(MAX_TRAILERS):
        trailer = await connection.line(b"\r\n", MAX_HEAD)
        if not trailer:
            return b"".join(parts)
        field = _FIELD.fullmatch(trailer)
        if field is None or _BAD_VALUE.search(field[2]):
            raise _Malformed(f"bad trailer line {trailer.partition(b':')[0][:40]!r}:…")
    raise _Malformed(f"over {MAX_TRAILERS} trailer fields")


async def _answer(
    connection: _Connection, method: str, reserve: Reserve = unlimited
) -> tuple[Answer, bool]:
    """The final answer (interim 1xx ones skipped) and whether the connection may be reused."""
    for _ in range(MAX_INTERIM + 1):
        minor, status, reason, fields = _head(await connection.head(MAX_HEAD))
        if status == 101:
            raise _Malformed("the app switched protocols")
        if status >= 200:
            break
        # 100 Continue, 103 Early Hints: the final answer follows on the same connection.
    else:
        raise _Malformed(f"over {MAX_INTERIM} interim (1xx) answers")
    keep = minor == 1 and "close" not in (_values(fields, "connection") or [])
    codings = _values(fields, "transfer-encoding")
    lengths = _values(fields, "content-length")
    if codings is not None and lengths is not None:
        raise _Malformed("both Transfer-Encoding and Content-Length")
    if codings is not None and (minor == 0 or codings != ["chunked"]):
        # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing.
        raise _Malformed(f"unsupported transfer coding {', '.join(codings)!r}")
    if lengths is not None and (len(set(lengths)) != 1 or not _LENGTH.fullmatch(lengths[0])):
        raise _Malformed("bad or conflicting Content-Length")
    try:
        if status in (204, 304) or method == "HEAD":
            body = b""
        elif codings is not None:
            body = await _chunked(connection, reserve)
        elif lengths is not None:
            reserve(int(lengths[0]))
            body = await connection.exactly(int(lengths[0]))
        else:
            body = await connection.rest(reserve)  # delimited by the app closing the connection
    except errors.AnswerOverBudget as exc:
        exc.upstream_status = status
        raise
        keep = False
    return Answer(status, reason, CIMultiDict(fields), body), keep


class Client:
    """Keep-alive connections to the app, per origin, reused most recently used first, at most
    ``connections`` of them in use at once."""

    def __init__(self, *, timeout: float, keepalive: float, connections: int) -> None:
        self._timeout = timeout
        self._keepalive = keepalive
        self._slots = asyncio.Semaphore(connections)
        self._idle: dict[Origin, list[_Connection]] = {}  # oldest first
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
        told the answer body's size before it is held (and may raise to refuse it)."""
        head = [f"{method} {target} HTTP/1.1\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers]
        head.append(f"Content-Length: {len(body)}\r\n\r\n")
        message = "".join(head).encode("utf-8", "surrogateescape")
        connection: _Connection | None = None
        keep = False
        try:
            async with asyncio.timeout(self._timeout), self._slots:
                connection = self._take(origin) or await self._open(origin)
                assert connection.transport is not None
                # Two writes rather than one concatenation: no second copy of a large body.
                connection.transport.writelines((message, body))
                answer, keep = await _answer(connection, method, reserve)
        except TimeoutError as exc:
            raise errors.UpstreamTimeout(
                f"upstream did not answer within {self._timeout:g}s"
            ) from exc
        except _Malformed as exc:
            raise errors.UpstreamUnavailable(f"upstream sent a malformed answer: {exc}") from None
        except _Closed:
            raise errors.UpstreamUnavailable(
                "upstream closed the connection before answering completely"
            ) from None
        except OSError as exc:
            raise errors.UpstreamUnavailable(f"upstream failed: {exc!r}") from exc
        finally:
            if connection is not None:
                if keep and connection.buffer:
                    connection.unsolicited(len(connection.buffer))
                if keep and connection.reusable and not self._closed:
                    self._keep(origin, connection)
                else:
                    connection.close()
        return answer

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = asyncio.get_running_loop().time()
        while idle:
            connection = idle.pop()
            if now - connection.idle_since < self._keepalive and connection.still_idle():
                connection.idle = False
                return connection
            connection.close()
        return None

    def _keep(self, origin: Origin, connection: _Connection) -> None:
        loop = asyncio.get_running_loop()
        connection.idle = True
        connection.idle_since = loop.time()
        self._idle.setdefault(origin, []).append(connection)
        if self._sweeper is None:
            self._sweeper = loop.call_later(self._keepalive, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle past ``keepalive`` (the oldest are first in each list)."""
        self._sweeper = None
        now = asyncio.get_running_loop().time()
        for idle in self._idle.values():
            while idle and (not idle[0].reusable or now - idle[0].idle_since >= self._keepalive):
                idle.pop(0).close()
        if any(self._idle.values()):
            oldest = min(idle[0].idle_since for idle in self._idle.values() if idle)
            self._sweeper = asyncio.get_running_loop().call_at(
                oldest + self._keepalive, self._sweep
            )

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
