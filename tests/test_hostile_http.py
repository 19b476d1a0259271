"""Hostile HTTP/1.1 on a raw socket: request smuggling, malformed framing and headers, slow clients,
and ``Expect: 100-continue`` on a request the head alone refuses.

Each probe is written byte for byte to the running proxy (client libraries refuse to send most of
them). What aiohttp 3.14's C parser (llhttp, strict mode) does with each is pinned here: it answers
a malformed request itself with a plain-text ``HTTP/1.0 400`` and closes the connection, so bytes
hidden behind the malformed part are never parsed as a second request. Whatever the answer, the
user-visible guarantees are the same: nothing reaches the upstream, nothing is claimed, and the
proxy serves the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import http_parser
from aiohttp.test_utils import TestClient

from tests.helpers import (
    WITHIN,
    FakeUpstream,
    MakeProxy,
    claimed,
    connection,
    content_length,
    read_answer,
)

EVENT = b'{"id": "evt_x"}'
SMUGGLED_EVENT = b'{"id": "evt_smuggled"}'


def webhook(*headers: bytes, body: bytes = b"", path: bytes = b"/webhooks/corvel") -> bytes:
    """A POST with CRLF line endings and the given raw header lines."""
    lines = b"".join(header + b"\r\n" for header in headers)
    return b"POST " + path + b" HTTP/1.1\r\nHost: proxy.test\r\n" + lines + b"\r\n" + body


def chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


# A complete, valid webhook: if the proxy ever parsed it as a request of its own, the upstream
# would receive it and a claim for evt_smuggled would appear.
SMUGGLED = webhook(b"Content-Length: %d" % len(SMUGGLED_EVENT), body=SMUGGLED_EVENT)


def cl_te_smuggle(path: bytes = b"/webhooks/corvel") -> bytes:
    """CL.TE: by Content-Length the smuggled request is body, by chunked framing it follows."""
    body = b"0\r\n\r\n" + SMUGGLED
    return webhook(
        b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked", body=body, path=path
    )


def te_cl_smuggle() -> bytes:
    """TE.CL: by chunked framing the smuggled request is body, by Content-Length it follows."""
    size_line = b"%x\r\n" % len(SMUGGLED)
    return webhook(
        b"Transfer-Encoding: chunked",
        b"Content-Length: %d" % len(size_line),
        body=size_line + SMUGGLED + b"\r\n0\r\n\r\n",
    )


async def read_until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the proxy sends until it closes the connection (fails after WITHIN seconds)."""
    try:
        return await asyncio.wait_for(reader.read(), WITHIN)
    except ConnectionResetError:
        return b""
    except TimeoutError:
        pytest.fail(f"the proxy did not close the connection within {WITHIN:g}s")


async def assert_untouched_and_serving(
    client: TestClient[Any, Any], upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """Nothing was forwarded or claimed, and a well-formed webhook still goes through."""
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []

    after = b'{"id": "evt_after"}'
    response = await client.post(
        "/webhooks/corvel", data=after, timeout=aiohttp.ClientTimeout(total=WITHIN)
    )

    assert response.status == 200
    assert [(r.method, r.path_qs, r.body) for r in upstream.requests] == [
        ("POST", "/webhooks/corvel", after)
    ]
    assert await claimed(pg_dsn, table) == [("corvel", "evt_after", None)]


def test_requests_are_parsed_by_the_c_parser() -> None:
    # Every verdict below is llhttp's; the pure-Python fallback parser differs in places.
    assert http_parser.HttpRequestParser is http_parser.HttpRequestParserC


MALFORMED = [
    # Framing: two lengths, or a Transfer-Encoding llhttp does not accept for a request.
    pytest.param(
        webhook(
            b"Content-Length: %d" % len(chunked(EVENT)),
            b"Transfer-Encoding: chunked",
            body=chunked(EVENT),
        ),
        (400,),
        id="content-length-and-chunked",
    ),
    pytest.param(cl_te_smuggle(), (400,), id="cl-te-smuggle"),
    pytest.param(cl_te_smuggle(b"/passthrough"), (400,), id="cl-te-smuggle-passthrough"),
    pytest.param(te_cl_smuggle(), (400,), id="te-cl-smuggle"),
    pytest.param(
        webhook(b"Transfer-Encoding: chunked123", body=chunked(EVENT) + SMUGGLED),
        (400,),
        id="te-chunked123",
    ),
    pytest.param(
        webhook(b"Transfer-Encoding: xchunked", body=chunked(EVENT) + SMUGGLED),
        (400,),
        id="te-xchunked",
    ),
    pytest.param(
        webhook(b"Transfer-Encoding: chunked, identity", body=chunked(EVENT) + SMUGGLED),
        (400,),
        id="te-chunked-then-identity",
    ),
    pytest.param(
        webhook(
            b"Transfer-Encoding: chunked",
            b"Transfer-Encoding: chunked",
            body=chunked(EVENT) + SMUGGLED,
        ),
        (400,),
        id="te-twice",
    ),
    pytest.param(
        webhook(
            b"Content-Length: %d" % len(EVENT),
            b"Content-Length: %d" % len(EVENT + SMUGGLED),
            body=EVENT + SMUGGLED,
        ),
        (400,),
        id="content-length-twice-differing",
    ),
    pytest.param(webhook(b"Content-Length: 15, 15", body=EVENT), (400,), id="content-length-list"),
    pytest.param(webhook(b"Content-Length: +15", body=EVENT), (400,), id="content-length-sign"),
    # Header syntax.
    pytest.param(
        webhook(b"Host: other.test", b"Content-Length: 15", body=EVENT), (400,), id="host-twice"
    ),
    pytest.param(
        webhook(b"X-Note: a", b"  folded", b"Content-Length: 15", body=EVENT),
        (400,),
        id="obs-fold-space",
    ),
    pytest.param(
        webhook(b"X-Note: a", b"\tfolded", b"Content-Length: 15", body=EVENT),
        (400,),
        id="obs-fold-tab",
    ),
    pytest.param(
        webhook(b"Content-Length: 1", b" 5", body=EVENT), (400,), id="obs-fold-content-length"
    ),
    pytest.param(
        webhook(b"X-Long: " + b"a" * 9000, b"Content-Length: 15", body=EVENT),
        (400, 431),
        id="header-value-over-8190",
    ),
    pytest.param(
        webhook(b"X-" + b"a" * 9000 + b": x", b"Content-Length: 15", body=EVENT),
        (400, 431),
        id="header-name-over-8190",
    ),
    pytest.param(
        webhook(b"Content-Length: 15", body=EVENT, path=b"/webhooks/corvel?" + b"a" * 9000),
        (400, 414),
        id="request-line-over-8190",
    ),
    pytest.param(
        b"POST /webhooks/corvel HTTP/1.1\nHost: proxy.test\nContent-Length: 15\n\n" + EVENT,
        (400,),
        id="bare-lf-everywhere",
    ),
    pytest.param(
        webhook(b"X-Note: a\nContent-Length: 15", body=EVENT), (400,), id="bare-lf-in-headers"
    ),
    pytest.param(
        webhook(b"X-Note: a\rContent-Length: 15", body=EVENT), (400,), id="bare-cr-in-headers"
    ),
    pytest.param(
        webhook(b"X-Note: a\x00b", b"Content-Length: 15", body=EVENT), (400,), id="nul-in-value"
    ),
    pytest.param(webhook(b"Content-Length : 15", body=EVENT), (400,), id="space-before-colon"),
    pytest.param(
        webhook(b"Transfer-Encoding : chunked", b"Content-Length: 5", body=b"0\r\n\r\n" + SMUGGLED),
        (400,),
        id="space-before-colon-transfer-encoding",
    ),
    # Chunk syntax, arriving with the headers.
    pytest.param(
        webhook(b"Transfer-Encoding: chunked", body=b"zz\r\n" + EVENT + b"\r\n0\r\n\r\n"),
        (400,),
        id="chunk-size-not-hex",
    ),
    pytest.param(
        webhook(b"Transfer-Encoding: chunked", body=b"-f\r\n" + EVENT + b"\r\n0\r\n\r\n"),
        (400,),
        id="chunk-size-negative",
    ),
    pytest.param(
        webhook(b"Transfer-Encoding: chunked", body=b"1" * 20 + b"\r\n" + EVENT),
        (400,),
        id="chunk-size-overflow",
    ),
]


@pytest.mark.parametrize(("raw", "statuses"), MALFORMED)
async def test_malformed_request_is_refused_and_never_forwarded(
    raw: bytes,
    statuses: tuple[int, ...],
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
) -> None:
    client = await make_proxy()
    async with connection(client) as (reader, writer):
        writer.write(raw)
        await asyncio.wait_for(writer.drain(), WITHIN)

        answer = await read_answer(reader)
        rest = await read_until_closed(reader)

    # llhttp answers (400, plain text, HTTP/1.0) and closes: a smuggled request gets no answer.
    assert answer is not None, "closed without an answer"
    assert answer.status in statuses
    assert rest == b""
    await assert_untouched_and_serving(client, upstream, pg_dsn, table)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            webhook(b"Transfer-Encoding: CHUNKED", body=chunked(EVENT)), id="te-upper-case"
        ),
        pytest.param(
            webhook(b"Transfer-Encoding: identity, chunked", body=chunked(EVENT)),
            id="te-identity-then-chunked",
        ),
        pytest.param(
            b"POST /webhooks/corvel HTTP/1.0\r\nHost: proxy.test\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunked(EVENT),
            id="chunked-on-http-1.0",
        ),
        pytest.param(
            webhook(b"Transfer-Encoding: chunked", body=chunked(EVENT)[:-2] + b"X-Tail: t\r\n\r\n"),
            id="chunked-with-trailer",
        ),
    ],
)
async def test_framing_llhttp_accepts_is_reframed_for_the_upstream(
    raw: bytes, make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy()
    async with connection(client) as (reader, writer):
        writer.write(raw)
        await asyncio.wait_for(writer.drain(), WITHIN)
        answer = await read_answer(reader)

    assert answer is not None
    assert answer.status == 200
    # The upstream sees one request framed by the proxy: the decoded body and its length, no
    # Transfer-Encoding (which it could read differently) and no trailer fields.
    [received] = upstream.requests
    assert received.body == EVENT
    assert received.headers["content-length"] == [str(len(EVENT))]
    assert "transfer-encoding" not in received.headers
    assert "x-tail" not in received.headers
    assert await claimed(pg_dsn, table) == [("corvel", "evt_x", None)]


async def test_trailer_field_does_not_supply_the_event_id(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy()
    body = b"2\r\n{}\r\n0\r\nX-GitHub-Delivery: from-trailer\r\n\r\n"
    async with connection(client) as (reader, writer):
        writer.write(webhook(b"Transfer-Encoding: chunked", body=body, path=b"/webhooks/github"))
        answer = await read_answer(reader)

    assert answer is not None
    assert answer.status == 400
    assert json.loads(answer.body)["error"] == "event_id_invalid"
    await assert_untouched_and_serving(client, upstream, pg_dsn, table)


async def test_trailer_field_does_not_leak_into_the_next_request_on_the_connection(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """An ingress that reuses one connection for many providers must not let one request's
    trailer become a header of the next (here: another provider's event ID)."""
    client = await make_proxy()
    first = webhook(
        b"Transfer-Encoding: chunked",
        body=chunked(EVENT)[:-2] + b"X-GitHub-Delivery: injected\r\n\r\n",
    )
    second = webhook(b"Content-Length: 2", body=b"{}", path=b"/webhooks/github")
    async with connection(client) as (reader, writer):
        writer.write(first)
        first_answer = await read_answer(reader)
        writer.write(second)
        second_answer = await read_answer(reader)

    assert first_answer is not None
    assert first_answer.status == 200
    assert first_answer.headers.get("connection") == "close"
    # aiohttp's parser would carry the trailer into the next request, so the proxy closes the
    # connection after any chunked request: the second request is never read.
    assert second_answer is None
    assert [(r.path_qs, r.headers.get("x-github-delivery")) for r in upstream.requests] == [
        ("/webhooks/corvel", None)
    ]
    assert await claimed(pg_dsn, table) == [("corvel", "evt_x", None)]


@pytest.mark.parametrize(
    "first_headers",
    [
        # aiohttp answers these itself, before any handler runs.
        (b"Expect: something-else",),
        (b"Expect: 100-continue, x",),
    ],
)
async def test_a_trailer_does_not_leak_when_aiohttp_answers_the_chunked_request_itself(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    first_headers: tuple[bytes, ...],
) -> None:
    client = await make_proxy()
    first = webhook(
        *first_headers,
        b"Transfer-Encoding: chunked",
        body=chunked(EVENT)[:-2] + b"X-GitHub-Delivery: leaked-1\r\n\r\n",
    )
    second = webhook(b"Content-Length: 2", body=b"{}", path=b"/webhooks/github")
    async with connection(client) as (reader, writer):
        writer.write(first)
        first_answer = await read_answer(reader)
        writer.write(second)
        second_answer = await read_answer(reader)

    assert first_answer is not None
    assert first_answer.status == 417
    assert second_answer is None  # the connection was closed after the chunked request
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


async def test_malformed_chunk_after_the_handler_started_is_not_forwarded(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(client_timeout="1s")
    async with connection(client) as (reader, writer):
        writer.write(webhook(b"Expect: 100-continue", b"Transfer-Encoding: chunked"))
        interim = await read_answer(reader)  # the handler is running and reading the body
        assert interim is not None
        assert interim.status == 100
        writer.write(b"f\r\n" + EVENT + b"\r\nzz\r\n0\r\n\r\n" + SMUGGLED)

        answer = await read_answer(reader)

    # aiohttp queues its 400 for the parse error behind the running handler and never fails the
    # body the handler is reading, so the handler only gives up at client_timeout: 408.
    assert answer is not None
    assert answer.status in (400, 408)
    await assert_untouched_and_serving(client, upstream, pg_dsn, table)


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"", id="nothing"),
        pytest.param(b"POST /webhooks/co", id="part-of-request-line"),
        pytest.param(b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\nConte", id="headers"),
    ],
)
async def test_slow_headers_are_cut_off_at_client_timeout(
    sent: bytes, make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(client_timeout="1s")
    async with connection(client) as (reader, writer):
        writer.write(sent)
        await asyncio.wait_for(writer.drain(), WITHIN)

        # Fails the test unless the proxy closes the connection within WITHIN.
        data = await read_until_closed(reader)

    # aiohttp's keep-alive timer closes the connection without answering.
    assert data == b"" or data.startswith(b"HTTP/1.1 408 ")
    await assert_untouched_and_serving(client, upstream, pg_dsn, table)


async def test_trickled_headers_are_cut_off_at_client_timeout(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """A client that keeps sending a header byte at a time does not keep the connection open."""
    client = await make_proxy(client_timeout="1s")
    async with connection(client) as (reader, writer):
        writer.write(b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\nX-Slow: ")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                while not writer.is_closing():
                    writer.write(b"a")
                    await writer.drain()
                    await asyncio.sleep(0.1)  # pacing the slow client, not synchronisation

        trickler = asyncio.create_task(trickle())
        try:
            data = await read_until_closed(reader)
        finally:
            trickler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trickler

    assert data == b"" or data.startswith(b"HTTP/1.1 408 ")
    await assert_untouched_and_serving(client, upstream, pg_dsn, table)


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(webhook(b"Content-Length: 100", body=EVENT[:10]), id="content-length"),
        pytest.param(
            webhook(b"Transfer-Encoding: chunked", body=b"f\r\n" + EVENT + b"\r\n"),
            id="chunked-without-last-chunk",
        ),
    ],
)
async def test_slow_body_gets_408_at_client_timeout(
    sent: bytes, make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(client_timeout="1s")
    async with connection(client) as (reader, writer):
        writer.write(sent)
        await asyncio.wait_for(writer.drain(), WITHIN)

        answer = await read_answer(reader)  # bounded by WITHIN

    assert answer is not None, "closed without an answer"
    assert answer.status == 408
    assert answer.headers["dedup-status"] == "rejected"
    assert json.loads(answer.body)["error"] == "request_timeout"
    await assert_untouched_and_serving(client, upstream, pg_dsn, table)


def expecting(line: bytes, *headers: bytes, length: int = len(SMUGGLED)) -> bytes:
    """A request head that declares a body of ``length`` bytes and waits for 100 Continue to
    send it."""
    lines = b"".join(header + b"\r\n" for header in headers)
    return (
        line
        + b"\r\nHost: proxy.test\r\nExpect: 100-continue\r\n"
        + lines
        + b"Content-Length: %d\r\n\r\n" % length
    )


@pytest.mark.parametrize(
    ("head", "refused"),
    [
        pytest.param(
            expecting(b"POST /webhooks/corvel HTTP/1.1", length=2000),
            (413, "body_too_large"),
            id="declared-length-over-max_body",
        ),
        pytest.param(
            expecting(b"PUT /webhooks/corvel HTTP/1.1"),
            (405, "method_not_allowed"),
            id="method",
        ),
        pytest.param(
            expecting(b"POST /webhooks%2Fcorvel HTTP/1.1"), (400, "path_refused"), id="path"
        ),
        pytest.param(
            expecting(b"POST /webhooks/corvel HTTP/1.1", b"X-Name: caf\xe9"),
            (400, "header_refused"),
            id="header-not-utf8",
        ),
        pytest.param(expecting(b"POST /elsewhere HTTP/1.1"), (404, "not_found"), id="not-routed"),
    ],
)
async def test_expect_100_continue_gets_the_refusal_the_head_alone_earns_instead_of_100(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    head: bytes,
    refused: tuple[int, str],
) -> None:
    """The refusal comes first, and closes the connection: the client may then send its body
    or not (here it does, and its body is a whole webhook), so nothing after the refusal is
    read as a request."""
    client = await make_proxy(max_body="1KiB", passthrough="none")
    async with connection(client) as (reader, writer):
        writer.write(head)

        answer = await read_answer(reader)
        assert answer is not None
        assert answer.status == refused[0]
        assert json.loads(answer.body)["error"] == refused[1]
        assert answer.headers["connection"] == "close"
        writer.write(SMUGGLED.ljust(content_length(head)))
        assert await asyncio.wait_for(reader.read(), WITHIN) == b""

    await assert_untouched_and_serving(client, upstream, pg_dsn, table)


@pytest.mark.parametrize(
    "path", [b"/webhooks/corvel", b"/elsewhere"], ids=["webhook", "pass-through"]
)
async def test_expect_100_continue_that_goes_through_gets_100_then_its_answer(
    make_proxy: MakeProxy, upstream: FakeUpstream, path: bytes
) -> None:
    client = await make_proxy()
    async with connection(client) as (reader, writer):
        writer.write(expecting(b"POST %s HTTP/1.1" % path, length=len(EVENT)))

        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WITHIN)
        writer.write(EVENT)
        answer = await read_answer(reader)
        writer.write(expecting(b"POST %s HTTP/1.1" % path))  # and the connection kept alive
        again = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WITHIN)

    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert answer is not None
    assert answer.status == 200
    assert again == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert [(r.path_qs, r.body) for r in upstream.requests] == [(path.decode(), EVENT)]


async def test_an_unknown_expectation_is_417_without_the_clients_bytes(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy()
    async with connection(client) as (reader, writer):
        writer.write(
            webhook(b"Expect: <b>\xff</b>", b"Content-Length: %d" % len(EVENT), body=EVENT)
        )
        answer = await read_answer(reader)

    assert answer is not None
    assert answer.status == 417
    assert b"\xff" not in answer.body
    assert b"<b>" not in answer.body
    await assert_untouched_and_serving(client, upstream, pg_dsn, table)
