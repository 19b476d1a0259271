"""Both upstream transports under the same tests: the own client over plain HTTP, and aiohttp's
client over TLS (a real TLS server, certificates from trustme, verification on).

Each test runs once per transport (uvicorn's tests parametrize over its two HTTP protocol
implementations the same way): through the whole proxy against a recording app, and through
``Forwarder``'s transport against raw scripted apps for the keep-alive policy and the retry on
a reused connection the app closed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import trustme
from aiohttp import web
from multidict import CIMultiDict

from proxy import errors
from proxy.upstream import forwarder, http1, transports
from tests.helpers import FakeUpstream, MakeProxy, RawServer, claimed, content_length, event

# Every test once per transport (conftest's ``kind``, which the recording app follows), with the
# proxy trusting the test CA.
pytestmark = pytest.mark.usefixtures("kind", "trust_the_test_ca")


# Through the whole proxy.


async def test_a_webhook_and_its_answer_cross_byte_exact(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy = await make_proxy()
    body = b'{"id": "evt_exact", "note": "caf\xc3\xa9"}'
    response = await proxy.post(
        "/webhooks/corvel?attempt=1",
        data=body,
        headers={"Connection": "X-Hop", "X-Hop": "1", "X-Custom": "a", "Webhook-Id": "w"},
    )

    assert response.status == 200
    assert await response.read() == b"processed\x00bytes"
    assert response.headers["X-Upstream"] == "yes"
    [received] = upstream.requests
    assert (received.method, received.path_qs, received.body) == (
        "POST",
        "/webhooks/corvel?attempt=1",
        body,
    )
    assert received.headers["x-custom"] == ["a"]
    assert "x-hop" not in received.headers
    assert received.headers["x-forwarded-for"] == ["127.0.0.1"]
    assert received.headers["host"] == [f"{proxy.host}:{proxy.port}"]  # preserve_host
    assert await claimed(pg_dsn, table) == [("corvel", "evt_exact", None)]


async def test_a_failed_answer_is_relayed_and_the_retry_goes_through(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=500 if n == 0 else 200, text=f"answer {n}")
    proxy = await make_proxy()

    first = await proxy.post("/webhooks/corvel", data=event("evt_fail"))
    assert (first.status, await first.text()) == (500, "answer 0")
    assert await claimed(pg_dsn, table) == []

    retry = await proxy.post("/webhooks/corvel", data=event("evt_fail"))
    assert (retry.status, await retry.text()) == (200, "answer 1")
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_fail"]


async def test_a_chunked_answer_is_relayed_with_a_length(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    def chunked(n: int) -> web.Response:
        response = web.Response(status=201, body=b"x" * 100_000, headers={"X-App": "yes"})
        response.enable_chunked_encoding()
        return response

    upstream.respond = chunked
    proxy = await make_proxy()
    response = await proxy.post("/webhooks/corvel", data=event("evt_chunked"))

    assert response.status == 201
    assert await response.read() == b"x" * 100_000
    assert response.headers["Content-Length"] == "100000"
    assert response.headers["X-App"] == "yes"


async def test_an_app_that_does_not_answer_in_time_is_a_504(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(upstream={"url": upstream.url, "timeout": "300ms"})
    try:
        response = await proxy.post("/webhooks/corvel", data=event("evt_slow"))
    finally:
        upstream.gate.set()
    assert response.status == 504
    assert await claimed(pg_dsn, table) == []


async def test_nothing_listening_is_a_502(
    make_proxy: MakeProxy, kind: str, pg_dsn: str, table: str
) -> None:
    scheme = "https" if kind == "aiohttp-tls" else "http"
    proxy = await make_proxy(upstream={"url": f"{scheme}://127.0.0.1:1"})
    response = await proxy.post("/webhooks/corvel", data=event("evt_down"))
    assert response.status == 502
    assert await claimed(pg_dsn, table) == []


async def test_pass_through_reaches_the_same_app(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    proxy = await make_proxy()
    response = await proxy.get("/health?full=1")
    assert (response.status, await response.read()) == (200, b"processed\x00bytes")
    assert [(r.method, r.path_qs) for r in upstream.requests] == [("GET", "/health?full=1")]


async def test_an_untrusted_certificate_is_refused(
    make_proxy: MakeProxy, aiohttp_server: Any, pg_dsn: str, table: str
) -> None:
    """Verification stays on: a certificate from a CA the proxy does not trust is a 502 (the
    route's upstream is this https server, whichever kind the default upstream is)."""

    async def reached(request: web.Request) -> web.Response:
        return web.Response(text="reached")

    other = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(other)
    app = web.Application()
    app.router.add_post("/webhooks/corvel", reached)
    server = await aiohttp_server(app, ssl=other)
    proxy = await make_proxy(upstream={"url": str(server.make_url("")).rstrip("/")})

    response = await proxy.post("/webhooks/corvel", data=event("evt_untrusted"))

    assert response.status == 502
    assert await claimed(pg_dsn, table) == []


# Through the transport, against raw scripted apps.


@dataclass(frozen=True)
class Cut:
    """Part of an answer, then the connection closed."""

    data: bytes


# What the app does with the request numbered (connection, request on that connection): the
# answer's bytes, Cut(bytes), or None to close the connection without a byte.
Plan = Callable[[int, int], "bytes | Cut | None"]


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


@dataclass
class RawApp:
    plan: Plan
    idle_timeout: float = 60.0  # the app's own keep-alive timer
    requests: list[tuple[int, int]] = field(default_factory=list)
    connections: int = 0
    hold_until: int = 0  # no answer before this many connections are open
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        if self.connections >= self.hold_until:
            self.opened.set()
        try:
            for on_connection in range(1000):
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_timeout)
                except TimeoutError:
                    return  # the app's timer closes the idle connection
                except asyncio.IncompleteReadError as exc:
                    if not exc.partial:
                        self.closed_by_client.set()
                    return
                await reader.readexactly(content_length(head))
                self.requests.append((number, on_connection))
                await self.opened.wait()
                answer = self.plan(number, on_connection)
                if answer is None:
                    return
                writer.write(answer.data if isinstance(answer, Cut) else answer)
                await writer.drain()
                if isinstance(answer, Cut):
                    return
        except ConnectionError:
            pass
        finally:
            writer.close()


@pytest.fixture
def raw_app(raw_server: RawServer) -> Callable[..., Awaitable[RawApp]]:
    async def start(plan: Plan, **options: Any) -> RawApp:
        app = RawApp(plan, **options)
        app.url = await raw_server(app.serve)
        return app

    return start


@pytest.fixture
async def make_forwarder(
    client_tls: ssl.SSLContext,
) -> AsyncIterator[Callable[..., forwarder.Forwarder]]:
    made: list[forwarder.Forwarder] = []

    def make(keepalive: float = 30.0) -> forwarder.Forwarder:
        made.append(
            forwarder.Forwarder(
                5.0, preserve_host=True, connections=10, keepalive=keepalive, ssl=client_tls
            )
        )
        return made[-1]

    yield make
    for proxy in made:
        await proxy.close()


async def send(
    proxy: forwarder.Forwarder, app: RawApp, reserve: http1.Reserve = http1.unlimited
) -> http1.Answer:
    request = transports.Request("POST", "/hook", CIMultiDict({"Host": "app"}), b'{"id": 1}')
    return await proxy.transport_for_url(app.url).handle_async_request(request, reserve)


async def test_a_reused_connection_closed_before_a_byte_is_sent_once_more(
    raw_app: Any, make_forwarder: Any
) -> None:
    answers = {(0, 0): ok(b"first"), (0, 1): None, (1, 0): ok(b"second")}
    app = await raw_app(lambda c, n: answers[c, n])
    proxy = make_forwarder()

    first = await send(proxy, app)
    assert (first.body, first.resend_count) == (b"first", 0)
    # The app closes the connection as the request arrives on it, as when its keep-alive timer
    # fires at that moment: the request goes again, on a new connection.
    again = await send(proxy, app)
    assert (again.body, again.resend_count) == (b"second", 1)  # a trace's resend_count
    assert app.requests == [(0, 0), (0, 1), (1, 0)]


async def test_the_request_is_sent_once_more_on_a_new_connection_not_another_idle_one(
    raw_app: Any, make_forwarder: Any
) -> None:
    # Connections 0 and 1 answer once and are closed by the app under their next request, as
    # when the app's timer closes every idle connection at once; connection 2 is new.
    app = await raw_app(lambda c, n: ok(b"%d" % c) if n == 0 else None, hold_until=2)
    proxy = make_forwarder()
    await asyncio.gather(send(proxy, app), send(proxy, app))  # two connections, both idle

    assert (await send(proxy, app)).body == b"2"
    # One idle connection tried (closed under the request), then a new one: not the other idle.
    assert sorted(app.requests) in (
        [(0, 0), (0, 1), (1, 0), (2, 0)],
        [(0, 0), (1, 0), (1, 1), (2, 0)],
    )


async def test_the_request_is_sent_once_more_at_most(raw_app: Any, make_forwarder: Any) -> None:
    app = await raw_app(lambda c, n: ok() if (c, n) == (0, 0) else None)
    proxy = make_forwarder()

    await send(proxy, app)
    with pytest.raises(errors.UpstreamUnavailable):
        await send(proxy, app)
    assert app.requests == [(0, 0), (0, 1), (1, 0)]


async def test_a_new_connection_closed_before_a_byte_is_not_retried(
    raw_app: Any, make_forwarder: Any
) -> None:
    app = await raw_app(lambda c, n: None)
    with pytest.raises(errors.UpstreamUnavailable):
        await send(make_forwarder(), app)
    assert app.requests == [(0, 0)]


@pytest.mark.parametrize("part", [b"H", b"HTTP/1.1 200 OK\r\nContent-Le"])
async def test_a_reused_connection_closed_after_part_of_the_answer_is_not_retried(
    raw_app: Any, make_forwarder: Any, part: bytes
) -> None:
    app = await raw_app(lambda c, n: ok() if (c, n) == (0, 0) else Cut(part))
    proxy = make_forwarder()

    await send(proxy, app)
    with pytest.raises(errors.UpstreamUnavailable):
        await send(proxy, app)
    assert app.requests == [(0, 0), (0, 1)]


@pytest.mark.parametrize(
    ("answer", "status"),
    [
        (Cut(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789"), 200),
        (Cut(b"HTTP/1.1 202 Accepted\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n01"), 202),
        (Cut(b"HTTP/1.1 200 OK\r\nContent-Le"), 200),
        (Cut(b"HTTP/1.1 200 OK\r\nX-A: a\x7fb\r\nContent-Length: 2\r\n\r\nok"), 200),
        (Cut(b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\n0123456789"), 500),
        (Cut(b"HTTP/1.1 100 Continue\r\n\r\n"), None),
        (None, None),
    ],
    ids=["length", "chunked", "mid-head", "control", "failure", "interim", "no-byte"],
)
async def test_a_failure_after_the_status_line_carries_that_status(
    raw_app: Any, make_forwarder: Any, answer: Cut | None, status: int | None
) -> None:
    """A 2xx means the app did the work: the pipeline keeps the claim although it answers 502,
    and the request is never sent again."""
    app = await raw_app(lambda c, n: answer)
    with pytest.raises(errors.UpstreamUnavailable) as info:
        await send(make_forwarder(), app)
    assert info.value.upstream_status == status
    assert app.requests == [(0, 0)]


async def test_obs_text_is_read_as_surrogate_escapes_of_its_bytes(
    raw_app: Any, make_forwarder: Any
) -> None:
    raw = b"HTTP/1.1 200 R\xe9ussi\r\nX-Name: caf\xe9\r\nContent-Length: 2\r\n\r\nok"
    app = await raw_app(lambda c, n: raw)
    answer = await send(make_forwarder(), app)
    assert answer.reason.encode("utf-8", "surrogateescape") == b"R\xe9ussi"
    assert answer.headers["X-Name"].encode("utf-8", "surrogateescape") == b"caf\xe9"


async def test_keep_alive_timeout_1_from_the_app_means_no_reuse(
    raw_app: Any, make_forwarder: Any
) -> None:
    app = await raw_app(lambda c, n: ok(extra=b"Keep-Alive: timeout=1\r\n"))
    proxy = make_forwarder(keepalive=30.0)
    for _ in range(3):
        await send(proxy, app)
    assert app.requests == [(0, 0), (1, 0), (2, 0)]


async def test_a_longer_keep_alive_timeout_from_the_app_keeps_reuse(
    raw_app: Any, make_forwarder: Any
) -> None:
    app = await raw_app(lambda c, n: ok(extra=b"Keep-Alive: timeout=5, max=100\r\n"))
    proxy = make_forwarder(keepalive=1.5)
    for _ in range(3):
        await send(proxy, app)
    assert app.requests == [(0, 0), (0, 1), (0, 2)]


async def test_pass_through_honours_the_apps_keep_alive_timeout_too(
    raw_app: Any, make_proxy: MakeProxy
) -> None:
    app = await raw_app(lambda c, n: ok(extra=b"Keep-Alive: timeout=1\r\n"))
    proxy = await make_proxy(upstream={"url": app.url, "keepalive": "30s"})
    for _ in range(3):
        response = await proxy.get("/not-a-webhook")
        assert (response.status, await response.read()) == (200, b"ok")
    assert app.requests == [(0, 0), (1, 0), (2, 0)]


async def test_an_idle_connection_is_closed_before_the_apps_own_timer(
    raw_app: Any, make_forwarder: Any
) -> None:
    app = await raw_app(lambda c, n: ok(), idle_timeout=30.0)
    proxy = make_forwarder(keepalive=0.2)

    await send(proxy, app)
    # Bounded wait, not a timing assertion: the proxy must close it long before the app would.
    await asyncio.wait_for(app.closed_by_client.wait(), 10)
    await send(proxy, app)
    assert app.requests == [(0, 0), (1, 0)]


@pytest.mark.parametrize(
    "raw",
    [
        ok(b"y" * 70_000),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (10_000, b"y" * 10_000) for _ in range(7))
        + b"0\r\n\r\n",
    ],
)
async def test_the_budget_is_told_the_answer_size_before_it_is_held(
    raw_app: Any, make_forwarder: Any, raw: bytes
) -> None:
    app = await raw_app(lambda c, n: raw)
    proxy = make_forwarder()
    told: list[int] = []
    answer = await send(proxy, app, told.append)
    assert sum(told) == len(answer.body) == 70_000

    def refuse(size: int) -> None:
        raise errors.AnswerOverBudget()

    with pytest.raises(errors.AnswerOverBudget) as info:
        await send(proxy, app, refuse)
    assert info.value.upstream_status == 200


async def test_each_upstream_url_gets_its_transport_once() -> None:
    urls = ["http://app:3000", "https://app", "http://user:pw@app"]
    proxy = forwarder.Forwarder(
        5.0, preserve_host=True, connections=10, keepalive=1.5, upstreams=urls
    )
    try:
        own, tls, credentials = (proxy.transport_for_url(url) for url in urls)
        assert isinstance(own, transports.OwnTransport)
        assert isinstance(tls, transports.AiohttpTransport)
        assert isinstance(credentials, transports.AiohttpTransport)
        assert proxy.transport_for_url("http://app:3000") is own
    finally:
        await proxy.close()


@pytest.mark.parametrize(
    ("configured", "header", "limit"),
    [
        (1.5, None, 1.5),
        (1.5, "timeout=5", 1.5),
        (4.0, "timeout=2", 1.5),
        (4.0, "timeout=3, max=100", 2.5),
        (4.0, "max=100,Timeout = 3", 2.5),
        (4.0, "timeout=1", 0.0),
        (4.0, "timeout=0", 0.0),
        (4.0, "timeout=abc", 4.0),
        (4.0, "timeout=-5", 4.0),
    ],
)
def test_the_idle_limit_follows_the_apps_keep_alive_header(
    configured: float, header: str | None, limit: float
) -> None:
    assert http1.idle_limit(configured, header) == limit
