"""A 2xx the app really gave: relayed as sent, obs-text and all, or, where it cannot be relayed,
answered 502 with the claim kept (the provider's retry is a duplicate, not a second delivery).
A request header reaches the app as the proxy read it (scoped, verified, claimed) on both
transports: UTF-8 as sent, any other byte over 0x7F refused with a 400 before the app or a claim.

Against a scripted raw app that writes exact bytes, once per transport: the own client over
plain HTTP and aiohttp's client over TLS (certificates from trustme); the proxy's answer is read
as the bytes on the wire.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.helpers import MakeProxy, RawServer, claimed, content_length

# What Tomcat and Jetty write: ISO-8859-1 bytes (obs-text, RFC 9110 5.5), not UTF-8.
DISPOSITION = b'Content-Disposition: attachment; filename="r\xe9sum\xe9.pdf"'
LATIN1 = b"HTTP/1.1 200 R\xe9ussi\r\n" + DISPOSITION + b"\r\nContent-Length: 2\r\n\r\nok"


pytestmark = pytest.mark.usefixtures("trust_the_test_ca")  # raw_app runs once per ``kind``


@dataclass
class RawApp:
    """Reads each request whole, writes ``answer`` and closes the connection."""

    answer: bytes
    requests: list[bytes] = field(default_factory=list)
    url: str = ""
    stall: bool = False  # after the answer, keep the connection open until the proxy closes it

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.requests.append(head + await reader.readexactly(content_length(head)))
            writer.write(self.answer)
            await writer.drain()
            if self.stall:
                await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
def raw_app(raw_server: RawServer) -> Callable[..., Awaitable[RawApp]]:
    async def start(answer: bytes, *, stall: bool = False) -> RawApp:
        app = RawApp(answer, stall=stall)
        app.url = await raw_server(app.serve)
        return app

    return start


async def exchange(proxy: Any, request: bytes) -> bytes:
    """The proxy's answer to ``request`` as the bytes on the wire."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


async def deliver(proxy: Any, event_id: str) -> bytes:
    body = json.dumps({"id": event_id}).encode()
    return await exchange(
        proxy,
        b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
    )


def is_duplicate(answer: bytes) -> bool:
    return (
        answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nDedup-Status: duplicate\r\n" in answer
    )


async def test_obs_text_in_a_header_value_and_the_reason_reaches_the_provider_as_sent(
    raw_app: Any, make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    app = await raw_app(LATIN1)
    proxy = await make_proxy(upstream={"url": app.url})

    first = await deliver(proxy, "evt_latin1")
    retry = await deliver(proxy, "evt_latin1")

    assert first.startswith(b"HTTP/1.1 200 R\xe9ussi\r\n")
    assert b"\r\n" + DISPOSITION + b"\r\n" in first
    assert first.endswith(b"\r\n\r\nok")
    assert await claimed(pg_dsn, table) == [("corvel", "evt_latin1", None)]
    assert is_duplicate(retry)
    assert len(app.requests) == 1


async def test_on_a_replay_route_it_is_relayed_and_its_duplicate_acknowledged(
    raw_app: Any, make_proxy: MakeProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """A value that is not UTF-8 cannot be stored as text: relayed, committed, not replayed."""
    app = await raw_app(LATIN1)
    route = {"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}
    proxy = await make_proxy(
        upstream={"url": app.url}, routes=[{**route, "on_duplicate": "replay"}]
    )

    with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
        first = await deliver(proxy, "evt_replay")
    retry = await deliver(proxy, "evt_replay")

    assert first.startswith(b"HTTP/1.1 200 R\xe9ussi\r\n")
    assert b"\r\n" + DISPOSITION + b"\r\n" in first
    (line,) = [r for r in caplog.records if hasattr(r, "fields")]
    assert line.fields["replay_skipped"] == "an answer header that is not UTF-8 text"
    assert is_duplicate(retry)
    assert b"Idempotent-Replayed" not in retry
    assert len(app.requests) == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789",
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n0123456789",
        b"HTTP/1.1 200 OK\r\nX-Bad: a\x01b\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 O\x7fK\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["cut-off-length", "cut-off-chunked", "control-in-value", "control-in-reason"],
)
async def test_a_2xx_that_cannot_be_relayed_is_a_502_that_keeps_the_claim(
    raw_app: Any, make_proxy: MakeProxy, pg_dsn: str, table: str, answer: bytes
) -> None:
    app = await raw_app(answer)
    proxy = await make_proxy(upstream={"url": app.url})

    first = await deliver(proxy, "evt_cut")
    retry = await deliver(proxy, "evt_cut")

    assert first.startswith(b"HTTP/1.1 502 ")
    assert await claimed(pg_dsn, table) == [("corvel", "evt_cut", None)]
    assert is_duplicate(retry)
    assert len(app.requests) == 1


async def test_a_2xx_whose_body_stalls_past_the_timeout_is_a_504_that_keeps_the_claim(
    raw_app: Any, make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    app = await raw_app(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789", stall=True)
    proxy = await make_proxy(upstream={"url": app.url, "timeout": "1s"})

    first = await deliver(proxy, "evt_stalled")
    retry = await deliver(proxy, "evt_stalled")

    assert first.startswith(b"HTTP/1.1 504 ")
    assert await claimed(pg_dsn, table) == [("corvel", "evt_stalled", None)]
    assert is_duplicate(retry)
    assert len(app.requests) == 1


async def test_a_failure_cut_off_mid_body_still_releases_the_claim(
    raw_app: Any, make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    app = await raw_app(b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\n0123456789")
    proxy = await make_proxy(upstream={"url": app.url})

    first = await deliver(proxy, "evt_failed")
    retry = await deliver(proxy, "evt_failed")

    assert first.startswith(b"HTTP/1.1 502 ")
    assert retry.startswith(b"HTTP/1.1 502 ")
    assert await claimed(pg_dsn, table) == []
    assert len(app.requests) == 2


async def test_pass_through_relays_obs_text_as_sent(raw_app: Any, make_proxy: MakeProxy) -> None:
    app = await raw_app(LATIN1)
    proxy = await make_proxy(upstream={"url": app.url})

    answer = await exchange(
        proxy, b"GET /not-a-webhook HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
    )

    assert answer.startswith(b"HTTP/1.1 200 R\xe9ussi\r\n")
    assert b"\r\n" + DISPOSITION + b"\r\n" in answer
    assert answer.endswith(b"\r\n\r\nok")
    assert len(app.requests) == 1


async def test_pass_through_refuses_a_control_character_with_a_502(
    raw_app: Any, make_proxy: MakeProxy
) -> None:
    app = await raw_app(b"HTTP/1.1 200 OK\r\nX-Bad: a\x01b\r\nContent-Length: 2\r\n\r\nok")
    proxy = await make_proxy(upstream={"url": app.url})

    answer = await exchange(
        proxy, b"GET /not-a-webhook HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
    )

    assert answer.startswith(b"HTTP/1.1 502 ")
    assert b"a\x01b" not in answer


PAYMENTS = {
    "name": "payments",
    "path": "/payments",
    "semantics": "idempotency-key",
    "scope_from": "header:Authorization",
}
CREATED = b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


def payment(credential: bytes) -> bytes:
    """One client's request on the idempotency-key route, key k1, as raw bytes."""
    body = b'{"amount": 100}'
    return (
        b"POST /payments HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer %s\r\n"
        b"Idempotency-Key: k1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
        % (credential, len(body), body)
    )


async def test_a_request_header_that_is_not_utf8_is_refused_before_the_app_or_a_claim(
    raw_app: Any, make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    """\\xff added to a credential would be a client scope of its own, and aiohttp's client
    (https://) sends the credential without it: one client's key processed twice."""
    app = await raw_app(CREATED)
    proxy = await make_proxy(upstream={"url": app.url}, routes=[PAYMENTS])

    first = await exchange(proxy, payment(b"alice"))
    altered = await exchange(proxy, payment(b"alice\xff"))

    assert first.startswith(b"HTTP/1.1 201 ")
    assert altered.startswith(b"HTTP/1.1 400 ")
    assert b'"error": "header_refused"' in altered
    assert len(app.requests) == 1
    assert [event_id for _, event_id, _ in await claimed(pg_dsn, table)] == ["k1"]


async def test_utf8_in_a_request_header_reaches_the_app_as_sent_and_scopes_as_sent(
    raw_app: Any, make_proxy: MakeProxy
) -> None:
    app = await raw_app(CREATED)
    proxy = await make_proxy(upstream={"url": app.url}, routes=[PAYMENTS])

    first = await exchange(proxy, payment(b"\xc3\xa9lise"))
    retry = await exchange(proxy, payment(b"\xc3\xa9lise"))
    other = await exchange(proxy, payment(b"elise"))

    assert first.startswith(b"HTTP/1.1 201 ")
    assert retry.startswith(b"HTTP/1.1 201 ")
    assert b"\r\nIdempotent-Replayed: true\r\n" in retry
    assert other.startswith(b"HTTP/1.1 201 ")
    assert b"Idempotent-Replayed" not in other
    assert len(app.requests) == 2
    assert b"\r\nAuthorization: Bearer \xc3\xa9lise\r\n" in app.requests[0]
    assert b"\r\nAuthorization: Bearer elise\r\n" in app.requests[1]


async def test_pass_through_refuses_a_request_header_that_is_not_utf8(
    raw_app: Any, make_proxy: MakeProxy
) -> None:
    app = await raw_app(LATIN1)
    proxy = await make_proxy(upstream={"url": app.url})

    answer = await exchange(
        proxy,
        b"GET /not-a-webhook HTTP/1.1\r\nHost: p\r\nX-Name: caf\xe9\r\nConnection: close\r\n\r\n",
    )

    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b'"error": "header_refused"' in answer
    assert app.requests == []
