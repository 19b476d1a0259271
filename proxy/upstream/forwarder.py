"""The upstream client: what the app behind the proxy receives, and how its answer comes back.

The request goes out as it came in (method, path, query, end-to-end headers and the raw body
bytes) minus the hop-by-hop headers and a client's ``Dedup-*`` (the proxy's own), with
``X-Forwarded-*`` added; the answer comes back the same way. Webhooks go through the transport
chosen for their upstream URL (``transports``); pass-through requests stream both ways through
aiohttp's client. A request header value whose bytes are not UTF-8 is refused before anything
(``refuse_not_utf8``): aiohttp's client cannot send those bytes, and every request must reach
the app as the proxy read it, whichever client carries it.

The answer's status line and headers reach the provider as the app sent them, obs-text too
(RFC 9110 5.5: opaque; nginx, Envoy and Go's ReverseProxy pass it through). Both clients decode
it as surrogate escapes, and aiohttp's server writer would drop those (its C serialiser; the
Python one raises), so a response made from the app's answer writes its own head when it holds
anything but ASCII. Relied on, private: ``StreamResponse._write_headers`` is where aiohttp
writes the head, and ``StreamWriter._headers_buf``/``_headers_written`` hold it until the first
body write, as ``StreamWriter.write_headers`` leaves them; ``StreamResponse._prepare_headers`` is
where aiohttp adds its own ``Server`` field, which an answer the app sent without one does not
get. The proxy's own answers, every one not ``RELAYED``, say ``Server: dedup-proxy``
(``name_the_server``, on the proxy's and the admin listener's applications).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import ssl as ssl_module
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
from aiohttp import hdrs, http_writer, web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy import errors
from proxy.upstream import http1, proxy_headers, transports

log = logging.getLogger(__name__)

# Upstream connections for webhooks beyond the pool's (whose size bounds the claimed ones in
# flight): webhooks forwarded unclaimed (missing_id: forward).
UNCLAIMED_HEADROOM = 100
# Pass-through has connections of its own, so clients that never read a pass-through answer
# cannot take the ones webhooks need; past them, a request waits at most PASSTHROUGH_WAIT.
PASSTHROUGH_CONNECTIONS = 100
PASSTHROUGH_WAIT = 5.0
# A pass-through body's first bytes are read before it takes one of those connections (nginx's
# proxy_request_buffering, in part): an upload that trickles holds no connection, and no app
# worker, until it has sent this much (or all of itself).
PASSTHROUGH_BUFFER = 64 * 1024

# RFC 9110 §7.6.1 (and §11.7 for the Proxy-* pair): they describe one connection, not the message.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate",
        "Proxy-Authorization", "TE", "Trailer", "Transfer-Encoding", "Upgrade",
    )
)  # fmt: skip
# The proxy's own headers to the app (``Dedup-Receipt``): a client's are dropped from every
# request to the app, so that what the app reads under this prefix is the proxy's alone.
OWN_PREFIX = "dedup-"
# aiohttp adds these to every request unless told not to; the upstream must see the provider's.
_AUTO_HEADERS = (hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE)
_CHUNK = 64 * 1024
# A byte that is not UTF-8, as aiohttp's request parser hands it over: a surrogate escape.
_NOT_UTF8 = re.compile(f"[{chr(0xDC80)}-{chr(0xDCFF)}]")
# Awaited before a pass-through body is read: tells a client waiting with
# ``Expect: 100-continue`` to send it (``request_body.go_ahead``).
GoAhead = Callable[[], Awaitable[None]]


class Trace(Protocol):
    """What a pass-through request's trace is told (``proxy.tracing``'s request traces): the
    CLIENT span starts with the headers it is carried in, and ends with the app's status or a
    failure."""

    def forwarding(
        self, method: str, base_url: str, target: str, headers: CIMultiDict[str]
    ) -> Any: ...

    def answered(self, span: Any, status: int, resend_count: int = 0) -> None: ...

    def failed(self, span: Any, kind: str, message: str) -> None: ...


def _session_options() -> dict[str, Any]:
    return {
        "auto_decompress": False,
        "cookie_jar": aiohttp.DummyCookieJar(),
        "skip_auto_headers": _AUTO_HEADERS,
    }


@functools.lru_cache(maxsize=8)
def _dropped(
    *, keep_length: bool, request: bool = False, preserve_host: bool = True
) -> frozenset[str]:
    """The (lower-case) names a request to the app or an answer relayed never carries: the
    hop-by-hop ones; Content-Length unless kept (a body of known size gets its own); on a
    request, Expect (the proxy answers any "100-continue" itself, ``request_body.go_ahead``:
    the app must not be asked again) and Host unless preserved. (An untrusted peer's
    forwarding headers are ``proxy_headers.set_forwarded``'s.)"""
    names = set(HOP_BY_HOP)
    if not keep_length:
        names.add("content-length")
    if request:
        names.add("expect")
        if not preserve_host:
            names.add("host")
    return frozenset(names)


def _end_to_end(
    headers: CIMultiDictProxy[str] | CIMultiDict[str], dropped: frozenset[str], *, request: bool
) -> CIMultiDict[str]:
    """``headers`` but the ``dropped`` names and those the Connection header names, in one
    pass; on a ``request``, a field name with ``_`` is dropped too: CGI, WSGI and Rack read
    X_Event_Id and X-Event-Id as one HTTP_X_EVENT_ID, so the app could get a value the proxy
    never keyed on or verified (nginx and Envoy drop these); and so is one of the proxy's own
    (``OWN_PREFIX``): a client's ``Dedup-Receipt`` would have the app write the receipt of an
    event still to come, which would then be settled as processed, never applied."""
    if hdrs.CONNECTION in headers:
        dropped = dropped.union(
            token.strip().lower()
            for value in headers.getall(hdrs.CONNECTION)
            for token in value.split(",")
        )
    kept: CIMultiDict[str] = CIMultiDict()
    add = kept.add
    for name, value in headers.items():
        if request and ("_" in name or name[:6].lower() == OWN_PREFIX):
            continue
        if name.lower() not in dropped:
            add(name, value)
    return kept


def refuse_not_utf8(headers: CIMultiDictProxy[str]) -> None:
    """HeaderRefused for a request header value whose bytes are not UTF-8 (obs-text such as
    ISO-8859-1's ``\\xe9``, or a stray ``\\xff``). aiohttp's parser hands those bytes over as
    surrogate escapes, which the own client writes back as sent but aiohttp's client (``https://``
    upstreams, credentials in the URL, pass-through) drops: the app would get ``Bearer t`` for
    the ``Bearer t\\xff`` the proxy scoped, verified or claimed apart. Refused for every
    transport alike; UTF-8 (obs-text too, byte for byte) goes through as sent on both."""
    for name, value in headers.items():
        if not value.isascii() and _NOT_UTF8.search(value):
            raise errors.HeaderRefused(f"header {name!r} holds bytes that are not UTF-8")


def request_headers(
    incoming: CIMultiDictProxy[str] | CIMultiDict[str],
    *,
    peer: str | None,
    scheme: str,
    preserve_host: bool,
    keep_length: bool,
    trusted: bool = False,
) -> CIMultiDict[str]:
    """Headers for the upstream request. Content-Length is kept only for a streamed body; a
    field name with ``_`` is dropped, and so is any ``Dedup-*`` (``OWN_PREFIX``); X-Forwarded-*
    are kept only from a ``trusted`` peer (see ``forwarded``)."""
    dropped = _dropped(keep_length=keep_length, request=True, preserve_host=preserve_host)
    headers = _end_to_end(incoming, dropped, request=True)
    host = incoming.get(hdrs.HOST)
    proxy_headers.set_forwarded(headers, peer=peer, scheme=scheme, host=host, trusted=trusted)
    return headers


def without_own(headers: CIMultiDict[str]) -> CIMultiDict[str]:
    """``headers`` (a kept delivery's, as a redelivery sends them again) without any
    ``Dedup-*``: a row kept by a release that did not drop a client's has one."""
    return CIMultiDict((k, v) for k, v in headers.items() if k[:6].lower() != OWN_PREFIX)


def response_headers(
    upstream: CIMultiDictProxy[str] | CIMultiDict[str], *, keep_length: bool
) -> CIMultiDict[str]:
    return _end_to_end(upstream, _dropped(keep_length=keep_length), request=False)


def _head(status_line: str, headers: CIMultiDict[str]) -> bytes:
    """The head as aiohttp's writer makes it, but surrogate escapes written as the bytes they
    stand for; a control character other than HTAB refused, as it refuses one (CR, LF and NUL
    would let an app's value inject a header or end the head)."""
    lines = [status_line, *[f"{name}: {value}" for name, value in headers.items()]]
    if http1.CONTROL.search("\t".join(lines)):
        raise ValueError("Forbidden control character detected in headers")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


class _AsSent(web.StreamResponse):
    """Writes its head itself when aiohttp's writer could not write it exactly; adds no
    ``Server`` field to an answer the app sent without one (aiohttp would add its own)."""

    async def _prepare_headers(self) -> None:
        named = hdrs.SERVER in self._headers
        await super()._prepare_headers()
        if not named:
            del self._headers[hdrs.SERVER]

    async def _write_headers(self) -> None:
        request, writer, headers = self._req, self._payload_writer, self._headers
        # aiohttp's own (C) serialiser where it is exact: a head all in ASCII, the usual one.
        if (
            request is None
            or not isinstance(writer, http_writer.StreamWriter)
            or (
                self.reason.isascii()
                and all(k.isascii() and v.isascii() for k, v in headers.items())
            )
        ):
            await super()._write_headers()
            return
        version = request.version
        status_line = f"HTTP/{version.major}.{version.minor} {self.status} {self.reason}"
        writer._headers_buf = _head(status_line, headers)
        writer._headers_written = False
        if self._send_headers_immediately:
            writer.send_headers()


class RelayedResponse(_AsSent, web.Response):
    """The app's answer, read whole, as the provider gets it."""


class RelayedStreamResponse(_AsSent):
    """The app's answer to a pass-through request, streamed."""


# The app's answers, as opposed to the proxy's own.
RELAYED = (RelayedResponse, RelayedStreamResponse)


# The Server field of the proxy's own answers: the product, no versions (nginx's server_tokens
# off, Envoy's server_name); the app's answers carry the app's own, or none.
SERVER_NAME = "dedup-proxy"


async def name_the_server(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Name the proxy in the ``Server`` field of its own answers (an ``on_response_prepare``
    hook), instead of aiohttp's Python and aiohttp versions."""
    if not isinstance(response, RELAYED):
        response.headers[hdrs.SERVER] = SERVER_NAME


class _PausingBody:
    """A pass-through body: its first ``PASSTHROUGH_BUFFER`` bytes read before the app is
    asked (``fill``), then streamed to the app as they arrive, each read bounded by ``pause``
    (client_body_timeout): a trickling upload must not hold a pass-through connection."""

    def __init__(self, content: aiohttp.StreamReader, pause: float) -> None:
        self._content = content
        self._pause = pause
        self._buffered: list[bytes] = []
        self.stalled: errors.RequestTimeout | None = None

    async def fill(self, reserve: Callable[[int], None]) -> None:
        """Read up to ``PASSTHROUGH_BUFFER`` bytes (or the whole body), ``reserve``-ing each
        read's bytes first (``Overloaded``: they do not fit ``max_buffered``)."""
        size = 0
        while size < PASSTHROUGH_BUFFER:
            chunk = await self._read()
            if not chunk:
                return
            reserve(len(chunk))
            self._buffered.append(chunk)
            size += len(chunk)

    def chunks(self) -> AsyncIterator[bytes]:
        buffered, self._buffered = self._buffered, []
        return _Chunks(buffered, self._read)

    async def _read(self) -> bytes:
        try:
            async with asyncio.timeout(self._pause):
                return await self._content.readany()
        except TimeoutError:
            self.stalled = errors.RequestTimeout(
                f"body paused for over client_body_timeout {self._pause:g}s"
            )
            raise self.stalled from None


class _Chunks:
    """``_PausingBody.chunks``: the buffered chunks, then each read until the body ends."""

    def __init__(self, buffered: list[bytes], read: Callable[[], Awaitable[bytes]]) -> None:
        self._buffered = iter(buffered)
        self._read = read

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = next(self._buffered, b"") or await self._read()
        if not chunk:
            raise StopAsyncIteration
        return chunk


def relayed(answer: http1.Answer) -> RelayedResponse:
    """The app's answer, its headers filtered by ``Forwarder.forward``, as the provider gets it."""
    return RelayedResponse(
        status=answer.status, reason=answer.reason, headers=answer.headers, body=answer.body
    )


async def reach(url: str, within: float, ssl: ssl_module.SSLContext | None = None) -> str:
    """Whether the app at ``url`` takes a connection within ``within`` seconds (and, for
    https://, completes the TLS handshake with ``ssl``, by default the system's trusted CAs):
    "" if it does, else why not, in words (``check --upstream``)."""
    parts = urlsplit(url)
    secure = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if secure else 80)
    tls = (ssl or ssl_module.create_default_context()) if secure else None
    try:
        async with asyncio.timeout(within):
            _, writer = await asyncio.open_connection(host, port, ssl=tls)
    except TimeoutError:
        return f"no connection within {within:g}s"
    except OSError as exc:  # ssl.SSLError among them: a certificate not trusted
        return http1.failure(exc)
    writer.close()
    return ""


class Forwarder:
    """The transports to the upstream(s), one per base URL, shared by every request.

    ``ssl`` is the context for ``https://`` upstreams (default: the system's trusted CAs);
    ``upstreams`` are the base URLs whose transport is chosen at start-up (any other on first
    use).
    """

    def __init__(
        self,
        timeout: float,
        *,
        preserve_host: bool,
        connections: int,
        keepalive: float,
        ssl: ssl_module.SSLContext | None = None,
        upstreams: Iterable[str] = (),
        trusted_proxies: proxy_headers.TrustedProxies | None = None,
    ) -> None:
        self._trusted = trusted_proxies or proxy_headers.TrustedProxies()
        self._timeout = timeout
        self._keepalive = keepalive
        self._client = http1.Client(timeout=timeout, keepalive=keepalive, connections=connections)
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeout, sock_read=timeout
        )
        self._preserve_host = preserve_host
        tls = True if ssl is None else ssl
        # An idle connection is dropped before the app's own keep-alive timer can close it
        # under a request (see http1.idle_limit, which the transports apply on top).
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=PASSTHROUGH_CONNECTIONS, keepalive_timeout=keepalive, ssl=tls
            ),
            **_session_options(),
        )
        self._passthrough = asyncio.Semaphore(PASSTHROUGH_CONNECTIONS)
        # Webhooks over aiohttp's client have a pool of their own, traced to tell a reused
        # connection from a new one (the tracing costs every request some CPU).
        self._webhook_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=keepalive, ssl=tls),
            trace_configs=[transports.reuse_tracing()],
            **_session_options(),
        )
        # For a webhook sent once more after a reused connection failed: never a pooled one.
        self._fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections, force_close=True, ssl=tls),
            **_session_options(),
        )
        self._transports: dict[str, transports.AsyncBaseTransport] = {}
        for base_url in upstreams:
            self.transport_for_url(base_url)

    def transport_for_url(self, base_url: str) -> transports.AsyncBaseTransport:
        """The transport for ``base_url``, chosen once (httpx's ``_transport_for_url``)."""
        transport = self._transports.get(base_url)
        if transport is None:
            origin = transports.origin_of(base_url)
            if origin is not None:
                prefix = urlsplit(base_url).path
                transport = transports.OwnTransport(self._client, origin, prefix)
            else:
                transport = transports.AiohttpTransport(
                    (self._webhook_session, self._fresh_session), base_url,
                    timeout=self._timeout, keepalive=self._keepalive,
                )  # fmt: skip
            self._transports[base_url] = transport
        return transport

    async def close(self) -> None:
        self._client.close()
        await self._webhook_session.close()
        await self._session.close()
        await self._fresh_session.close()

    def _headers(
        self, request: web.Request, request_id: str, *, keep_length: bool
    ) -> CIMultiDict[str]:
        headers = request_headers(
            request.headers,
            peer=request.remote,
            scheme=request.scheme,
            preserve_host=self._preserve_host,
            keep_length=keep_length,
            trusted=self._trusted.trusts(request.remote),
        )
        headers.setdefault(hdrs.X_REQUEST_ID, request_id)
        return headers

    async def forward(
        self,
        request: web.Request,
        base_url: str,
        target: str,
        body: bytes,
        request_id: str,
        *,
        reserve: http1.Reserve,
    ) -> http1.Answer:
        """Send the webhook to ``target`` (the path and query the proxy routed on) with its
        already-read body; read the whole answer, its size told to ``reserve`` first, and
        filter its headers for relaying."""
        return await self.send(base_url, self.outgoing(request, target, body, request_id), reserve)

    def outgoing(
        self, request: web.Request, target: str, body: bytes, request_id: str
    ) -> transports.Request:
        """The request the app is sent for this webhook (what a redelivery sends again)."""
        headers = self._headers(request, request_id, keep_length=False)
        return transports.Request(request.method, target, headers, body)

    async def send(
        self, base_url: str, outgoing: transports.Request, reserve: http1.Reserve
    ) -> http1.Answer:
        """Send ``outgoing`` to the app at ``base_url``; its whole answer, filtered for
        relaying. The transport may take headers out of ``outgoing`` (Host)."""
        answer = await self.transport_for_url(base_url).handle_async_request(outgoing, reserve)
        answer.headers = response_headers(answer.headers, keep_length=False)
        return answer

    async def relay(
        self,
        request: web.Request,
        base_url: str,
        target: str,
        request_id: str,
        *,
        trace: Trace,
        pause: float,
        reserve: Callable[[int], None],
        go_ahead: GoAhead,
    ) -> web.StreamResponse:
        """Pass a request through to ``target`` (the path and query the proxy routed on),
        streaming both ways (no claim, no size cap), on one of the PASSTHROUGH_CONNECTIONS
        (Overloaded, 503, when none is free within PASSTHROUGH_WAIT), once its body's first
        PASSTHROUGH_BUFFER bytes have arrived (held ``reserve``-d). A body whose bytes pause
        longer than ``pause`` (client_body_timeout) is answered 408, its upstream request cut;
        ``go_ahead`` is awaited once a body is to be read, before the app is sent anything."""
        body = None
        if request.body_exists:
            # Before anything is read or sent: nothing else can be written to the client yet.
            await go_ahead()
            body = _PausingBody(request.content, pause)
            await body.fill(reserve)
        slots = self._passthrough
        if slots.locked():
            try:
                async with asyncio.timeout(PASSTHROUGH_WAIT):
                    await slots.acquire()
            except TimeoutError:
                raise errors.Overloaded(
                    f"no pass-through connection free within {PASSTHROUGH_WAIT:g}s "
                    f"({PASSTHROUGH_CONNECTIONS} in use)"
                ) from None
        else:
            await slots.acquire()  # free: returns at once, no timer needed
        try:
            return await self._relay(request, base_url, target, request_id, trace=trace, body=body)
        finally:
            slots.release()

    async def _relay(
        self,
        request: web.Request,
        base_url: str,
        target: str,
        request_id: str,
        *,
        trace: Trace,
        body: _PausingBody | None,
    ) -> web.StreamResponse:
        headers = self._headers(request, request_id, keep_length=True)
        span = trace.forwarding(request.method, base_url, target, headers)
        try:
            try:
                with transports.translated(self._timeout):
                    upstream = await self._session.request(
                        request.method,
                        transports.url_for(base_url, target),
                        headers=headers,
                        data=body.chunks() if body is not None else None,
                        allow_redirects=False,
                        timeout=self._stream_timeout,
                    )
            except errors.UpstreamUnavailable as unavailable:
                # aiohttp's client reports a body that stopped as a broken connection.
                if body is not None and body.stalled is not None:
                    raise body.stalled from unavailable
                raise
        except errors.RequestError as failed:
            trace.failed(span, failed.code, failed.message)
            raise
        trace.answered(span, upstream.status)
        async with upstream:
            transports.relayable(upstream)
            transports.honour_keep_alive(upstream, self._keepalive)
            response = RelayedStreamResponse(
                status=upstream.status,
                reason=upstream.reason,
                headers=response_headers(upstream.headers, keep_length=True),
            )
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_chunked(_CHUNK):
                    await response.write(chunk)
                await response.write_eof()
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                # The status line is gone already: cutting the connection is the only honest
                # signal left that the body is incomplete.
                log.warning("pass-through body broke off: %r", exc)
                response.force_close()
            return response
