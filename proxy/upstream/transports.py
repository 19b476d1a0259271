"""How a webhook reaches the app: one interface, two transports, chosen once per upstream URL.

``AsyncBaseTransport.handle_async_request`` takes a request whose body is in memory and returns
the app's whole answer, an ``http1.Answer`` whichever transport read it (httpx's
``_transports/base.py`` has the same shape). ``OwnTransport`` speaks plain ``http://`` through
the proxy's own client (``http1.py``); ``AiohttpTransport`` takes the rest (``https://``,
credentials in the URL) through aiohttp's. Both keep one keep-alive policy (``http1.idle_limit``:
the configured ``upstream.keepalive``, shortened by the app's ``Keep-Alive: timeout=N``) and
both send a request once more when a reused connection is closed before a byte of the answer
arrives. aiohttp's client errors and timeouts are translated into ``errors`` here and nowhere
else (the own client translates its own); one after the app's status line carries that status,
as the own client's do (a 2xx means the app did the work).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yarl
from aiohttp import hdrs
from multidict import CIMultiDict

from proxy import errors
from proxy.upstream import http1

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024
# aiohttp sends these again itself after a reused connection fails (RFC 9112 9.3.1).
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


@dataclass(frozen=True, slots=True)
class Request:
    """A request for the app: ``target`` is the path and query the proxy routed on, ``headers``
    already filtered (a transport may take Host out of them)."""

    method: str
    target: str
    headers: CIMultiDict[str]
    body: bytes


class AsyncBaseTransport(abc.ABC):
    """Sends one request and reads the app's whole answer, its body's size told to ``reserve``
    before it is held; raises ``errors.UpstreamUnavailable`` or ``errors.UpstreamTimeout``."""

    @abc.abstractmethod
    async def handle_async_request(
        self, request: Request, reserve: http1.Reserve
    ) -> http1.Answer: ...


def origin_of(base_url: str) -> http1.Origin | None:
    """Where the own client connects for ``base_url``; None when aiohttp's client must
    (``https://``, or credentials in the URL)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or parts.username is not None or parts.hostname is None:
        return None
    port = parts.port or 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return http1.Origin(parts.hostname, port, host if port == 80 else f"{host}:{port}")


class OwnTransport(AsyncBaseTransport):
    """Plain ``http://`` through the proxy's own client, shared by every origin."""

    def __init__(self, pool: http1.Client, origin: http1.Origin, prefix: str) -> None:
        self._pool = pool
        self._origin = origin
        self._prefix = prefix

    async def handle_async_request(self, request: Request, reserve: http1.Reserve) -> http1.Answer:
        headers = request.headers
        # Host first (RFC 9112 3.2), the provider's when preserve_host kept it.
        host = headers.popall(hdrs.HOST, [self._origin.authority])[0]
        return await self._pool.request(
            self._origin, request.method, self._prefix + request.target,
            headers=[(hdrs.HOST, host), *headers.items()], body=request.body, reserve=reserve,
        )  # fmt: skip


@contextlib.contextmanager
def translated(timeout: float, status: int | None = None) -> Iterator[None]:
    """aiohttp's client errors and timeouts, as the proxy's own; ``status`` is the app's status
    line, once it has arrived."""
    try:
        yield
    except TimeoutError as exc:
        raise errors.UpstreamTimeout(
            f"upstream did not answer within {timeout:g}s", upstream_status=status
        ) from exc
    except (aiohttp.ClientError, OSError) as broken:
        cause = broken.os_error if isinstance(broken, aiohttp.ClientConnectorError) else broken
        raise errors.UpstreamUnavailable(
            http1.failure(cause),
            upstream_status=status if status is not None else _broken_head_status(broken),
        ) from broken


def _broken_head_status(exc: Exception) -> int | None:
    """The status line of a head the app broke off: aiohttp's disconnection carries what its
    parser had made of the head (a plain message when there was none)."""
    if not isinstance(exc, aiohttp.ServerDisconnectedError):
        return None
    # Read untyped: aiohttp types it a NamedTuple or a str, and its C parser makes another class
    # of that name, which the compiled build (setup.py) would refuse as neither.
    message: object = getattr(exc, "message", None)
    code = getattr(message, "code", None)  # a plain message has none
    return code if isinstance(code, int) else None


def relayable(upstream: aiohttp.ClientResponse) -> None:
    """Refuse an answer aiohttp's client read but the proxy must not write back: a control
    character (but HTAB) in its reason or a header value, which aiohttp's lenient parser lets
    through. obs-text is relayed: decoded as surrogate escapes, it is written back as sent."""
    for text in (upstream.reason or "", *upstream.headers.values()):
        if http1.CONTROL.search(text):
            raise errors.UpstreamUnavailable(
                "upstream sent a malformed answer: a control character in its reason phrase "
                "or a header value",
                upstream_status=upstream.status,
            )


def url_for(base_url: str, target: str) -> yarl.URL:
    """The upstream URL, with ``target`` exactly as given: yarl would otherwise remove dot
    segments, and the app would be sent a path the proxy did not route on."""
    return yarl.URL(base_url + target, encoded=True)


async def _on_reuse(session: Any, context: SimpleNamespace, params: Any) -> None:
    if context.trace_request_ctx is not None:
        context.trace_request_ctx.reused = True


def reuse_tracing() -> aiohttp.TraceConfig:
    """A trace that marks a request's ``trace_request_ctx`` when it goes out on a reused
    connection: aiohttp tells whether a connection was reused only through its tracing."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    trace.freeze()
    return trace


def honour_keep_alive(upstream: aiohttp.ClientResponse, keepalive: float) -> None:
    """Close the answer's connection rather than pool it when the app has said (``Keep-Alive:
    timeout=N``) that it closes idle ones sooner than ``keepalive``: aiohttp's pool has one idle
    timeout for every connection.

    A body already read whole has put the connection back in the pool already (nothing ran
    since, so nothing took it): it is closed there, and the pool drops it when next asked.
    """
    if http1.idle_limit(keepalive, upstream.headers.get(hdrs.KEEP_ALIVE)) >= keepalive:
        return
    connection = upstream.connection
    protocol = connection.protocol if connection is not None else upstream._protocol
    if protocol is not None:
        protocol.force_close()
        if connection is None:
            protocol.close()


class AiohttpTransport(AsyncBaseTransport):
    """``https://`` or a URL with credentials, through aiohttp's client: ``sessions`` are the
    pooled one, which must carry ``reuse_tracing()``, and one that never reuses a connection
    (``force_close``), for a request sent once more."""

    def __init__(
        self,
        sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
        base_url: str,
        *,
        timeout: float,
        keepalive: float,
    ) -> None:
        self._session, self._fresh_session = sessions
        self._base_url = base_url
        self._timeout = timeout
        self._keepalive = keepalive
        self._client_timeout = aiohttp.ClientTimeout(total=timeout)

    async def handle_async_request(self, request: Request, reserve: http1.Reserve) -> http1.Answer:
        with translated(self._timeout):
            started = time.monotonic()
            attempt = SimpleNamespace(reused=False)
            try:
                return await self._send(self._session, request, reserve, attempt)
            except aiohttp.ServerDisconnectedError as exc:
                # The same retry as the own client's (see http1.Client.request). aiohttp
                # does not say how much of the answer arrived: a disconnection before the
                # parser saw a byte carries a plain message, one after it the partial message
                # parsed so far. Idempotent methods aiohttp has retried itself.
                if (
                    not attempt.reused
                    or not isinstance(exc.message, str)
                    or request.method in _IDEMPOTENT
                ):
                    raise
                log.info(
                    "upstream %s closed a reused connection before answering; "
                    "sending the request again on a new one",
                    self._base_url,
                )
            # Both attempts within the one timeout; aiohttp's pool could hand over another
            # idle connection the app has closed, hence the session that never reuses one.
            left = self._timeout - (time.monotonic() - started)
            if left <= 0:
                raise TimeoutError()
            fresh = SimpleNamespace(reused=False)
            within = aiohttp.ClientTimeout(total=left)
            answer = await self._send(self._fresh_session, request, reserve, fresh, within)
            answer.resend_count = 1
            return answer

    async def _send(
        self,
        session: aiohttp.ClientSession,
        request: Request,
        reserve: http1.Reserve,
        attempt: SimpleNamespace,
        within: aiohttp.ClientTimeout | None = None,
    ) -> http1.Answer:
        async with session.request(
            request.method,
            url_for(self._base_url, request.target),
            headers=request.headers,
            data=request.body,
            allow_redirects=False,
            timeout=within or self._client_timeout,
            trace_request_ctx=attempt,
        ) as upstream:
            relayable(upstream)
            honour_keep_alive(upstream, self._keepalive)
            # Translated here, with the status: after the head, a failure is never a reason to
            # send the request again, and a 2xx's keeps the claim.
            with translated(self._timeout, upstream.status):
                try:
                    if upstream.content_length is not None:
                        reserve(upstream.content_length)
                        body = await upstream.read()
                    else:
                        parts = []
                        async for part in upstream.content.iter_chunked(_CHUNK):
                            reserve(len(part))
                            parts.append(part)
                        body = b"".join(parts)
                except errors.AnswerOverBudget as exc:
                    raise exc.after(upstream.status) from None
            return http1.Answer(
                upstream.status, upstream.reason or "", CIMultiDict(upstream.headers), body
            )
