"""The upstream client: what the app behind the proxy receives, and how its answer comes back.

The request goes out as it came in (method, path, query, end-to-end headers and the raw body
bytes) minus the hop-by-hop headers, with ``X-Forwarded-*`` added; the answer comes back the same
way. aiohttp's client errors and timeouts are translated into ``errors`` here and nowhere else.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import yarl
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from proxy import client, errors

log = logging.getLogger(__name__)

# Upstream connections beyond the pool's (whose size bounds webhooks in flight): pass-through.
PASSTHROUGH_HEADROOM = 100

# RFC 9110 §7.6.1 (and §11.7 for the Proxy-* pair): they describe one connection, not the message.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate",
        "Proxy-Authorization", "TE", "Trailer", "Transfer-Encoding", "Upgrade",
    )
)  # fmt: skip
# aiohttp adds these to every request unless told not to; the upstream must see the provider's.
_AUTO_HEADERS = (hdrs.USER_AGENT, hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.CONTENT_TYPE)
_CHUNK = 64 * 1024


def _end_to_end(headers: CIMultiDictProxy[str] | CIMultiDict[str]) -> CIMultiDict[str]:
    dropped = HOP_BY_HOP
    if hdrs.CONNECTION in headers:
        dropped = dropped.union(
            token.strip().lower()
            for value in headers.getall(hdrs.CONNECTION)
            for token in value.split(",")
        )
    return CIMultiDict(
        (name, value) for name, value in headers.items() if name.lower() not in dropped
    )


def request_headers(
    incoming: CIMultiDictProxy[str] | CIMultiDict[str],
    *,
    peer: str | None,
    scheme: str,
    preserve_host: bool,
    keep_length: bool,
) -> CIMultiDict[str]:
    """Headers for the upstream request. Content-Length is kept only for a streamed body; a
    field name with ``_`` is dropped."""
    headers = _end_to_end(incoming)
    for name in [name for name in headers if "_" in name]:
        # CGI, WSGI and Rack read X_Event_Id and X-Event-Id as one HTTP_X_EVENT_ID: the app
        # could get a value the proxy never keyed on or verified (nginx and Envoy drop these).
        headers.popall(name, None)
    # The proxy has answered any "100-continue" itself; the upstream must not be asked again.
    headers.popall(hdrs.EXPECT, None)
    if not keep_length:
        headers.popall(hdrs.CONTENT_LENGTH, None)
    host = incoming.get(hdrs.HOST)
    if not preserve_host:
        headers.popall(hdrs.HOST, None)
    if peer:
        prior = ", ".join(headers.popall(hdrs.X_FORWARDED_FOR, []))
        headers[hdrs.X_FORWARDED_FOR] = f"{prior}, {peer}" if prior else peer
    # An ingress in front of the sidecar may have set these already: its values are the truth.
    headers.setdefault(hdrs.X_FORWARDED_PROTO, scheme)
    if host:
        headers.setdefault(hdrs.X_FORWARDED_HOST, host)
    return headers


def _relayable(reason: str | None, headers: CIMultiDictProxy[str]) -> None:
    """Refuse an answer aiohttp's client read but its server could not write back exactly.

    aiohttp's client decodes obs-text bytes that are not UTF-8 as surrogate escapes, and its
    server's writer drops those: such a reason or header value would be relayed altered.
    """
    for text in (reason or "", *headers.values()):
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise errors.UpstreamUnavailable(
                    "upstream sent a malformed answer: a reason or header value is obs-text "
                    "that is not UTF-8"
                ) from None


def response_headers(
    upstream: CIMultiDictProxy[str] | CIMultiDict[str], *, keep_length: bool
) -> CIMultiDict[str]:
    headers = _end_to_end(upstream)
    if not keep_length:
        headers.popall(hdrs.CONTENT_LENGTH, None)
    return headers


@dataclass(frozen=True, slots=True)
class UpstreamResponse:
    """The upstream's answer, read whole, headers already filtered for relaying."""

    status: int
    reason: str | None
    headers: CIMultiDict[str]
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def to_web(self) -> web.Response:
        return web.Response(
            status=self.status, reason=self.reason, headers=self.headers, body=self.body
        )


def _url(base_url: str, target: str) -> yarl.URL:
    """The upstream URL, with ``target`` exactly as given: yarl would otherwise remove dot
    segments, and the app would be sent a path the proxy did not route on."""
    return yarl.URL(base_url + target, encoded=True)


def origin_of(base_url: str) -> client.Origin | None:
    """Where the webhook path's own client connects for ``base_url``; None when aiohttp's client
    must (``https://``, or credentials in the URL)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or parts.username is not None or parts.hostname is None:
        return None
    port = parts.port or 80
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return client.Origin(parts.hostname, port, host if port == 80 else f"{host}:{port}")


class Forwarder:
    """The clients to the upstream(s), shared by every request."""

    def __init__(
        self, timeout: float, *, preserve_host: bool, connections: int, keepalive: float
    ) -> None:
        self._timeout = timeout
        self._client = client.Client(timeout=timeout, keepalive=keepalive, connections=connections)
        self._origins: dict[str, tuple[client.Origin | None, str]] = {}
        self._total_timeout = aiohttp.ClientTimeout(total=timeout)
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=timeout, sock_read=timeout
        )
        self._preserve_host = preserve_host
        self._session = aiohttp.ClientSession(
            # An idle connection is dropped before the app's own keep-alive timer (5 s in
            # Node.js and uvicorn) can close it under a request: a POST on a connection the
            # app is closing fails with 502, and aiohttp retries only idempotent methods.
            connector=aiohttp.TCPConnector(limit=connections, keepalive_timeout=keepalive),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=_AUTO_HEADERS,
        )

    async def close(self) -> None:
        self._client.close()
        await self._session.close()

    def _headers(
        self, request: web.Request, request_id: str, *, keep_length: bool
    ) -> CIMultiDict[str]:
        headers = request_headers(
            request.headers,
            peer=request.remote,
            scheme=request.scheme,
            preserve_host=self._preserve_host,
            keep_length=keep_length,
        )
        headers.setdefault(hdrs.X_REQUEST_ID, request_id)
        return headers

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        """aiohttp's client errors and timeouts, as the proxy's own."""
        try:
            yield
        except TimeoutError as exc:
            raise errors.UpstreamTimeout(
                f"upstream did not answer within {self._timeout:g}s"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise errors.UpstreamUnavailable(f"upstream failed: {exc!r}") from exc

    async def forward(
        self,
        request: web.Request,
        base_url: str,
        target: str,
        body: bytes,
        request_id: str,
        *,
        reserve: client.Reserve,
    ) -> UpstreamResponse:
        """Send the webhook to ``target`` (the path and query the proxy routed on) with its
        already-read body; read the whole answer, its size told to ``reserve`` first."""
        found = self._origins.get(base_url)
        if found is None:
            found = self._origins[base_url] = (origin_of(base_url), urlsplit(base_url).path)
        origin, prefix = found
        if origin is not None:
            headers = self._headers(request, request_id, keep_length=False)
            # Host first (RFC 9112 3.2), the provider's when preserve_host kept it.
            host = headers.popall(hdrs.HOST, [origin.authority])[0]
            answer = await self._client.request(
                origin, request.method, prefix + target,
                headers=[(hdrs.HOST, host), *headers.items()], body=body, reserve=reserve,
            )  # fmt: skip
            return UpstreamResponse(
                status=answer.status,
                reason=answer.reason,
                headers=response_headers(answer.headers, keep_length=False),
                body=answer.body,
            )
        with self._translated():
            async with self._session.request(
                request.method,
                _url(base_url, target),
                headers=self._headers(request, request_id, keep_length=False),
                data=body,
                allow_redirects=False,
                timeout=self._total_timeout,
            ) as upstream:
                _relayable(upstream.reason, upstream.headers)
                try:
                    if upstream.content_length is not None:
                        reserve(upstream.content_length)
                        payload = await upstream.read()
                    else:
                        parts = []
                        async for part in upstream.content.iter_chunked(_CHUNK):
                            reserve(len(part))
                            parts.append(part)
                        payload = b"".join(parts)
                except errors.AnswerOverBudget as exc:
                    exc.upstream_status = upstream.status
                    raise
                return UpstreamResponse(
                    status=upstream.status,
                    reason=upstream.reason,
                    headers=response_headers(upstream.headers, keep_length=False),
                    body=payload,
                )

    async def relay(
        self, request: web.Request, base_url: str, target: str, request_id: str
    ) -> web.StreamResponse:
        """Pass a request through to ``target`` (the path and query the proxy routed on),
        streaming both ways (no claim, no size cap)."""
        with self._translated():
            upstream = await self._session.request(
                request.method,
                _url(base_url, target),
                headers=self._headers(request, request_id, keep_length=True),
                data=request.content if request.body_exists else None,
                allow_redirects=False,
                timeout=self._stream_timeout,
            )
        async with upstream:
            _relayable(upstream.reason, upstream.headers)
            response = web.StreamResponse(
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
