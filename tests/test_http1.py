"""The webhook path's HTTP/1.1 client against scripted apps: framing, reuse, and refusals."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy import errors
from proxy.upstream import http1
from tests.helpers import MakeProxy, claimed, content_length


@dataclass
class ScriptedApp:
    """Answers each request read with the next scripted bytes. ``None`` hangs up (after the
    answer before it, if any); once the script is done, the connection is held open."""

    answers: list[bytes | None]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)  # one per connection
    server: asyncio.Server | None = None
    delay: float = 0.0  # before each answer
    on_close: Callable[[], None] | None = None  # when the client closes a connection

    @property
    def origin(self) -> http1.Origin:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return http1.Origin("127.0.0.1", port, f"127.0.0.1:{port}")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests.append(head + await reader.readexactly(content_length(head)))
                answer = self.answers.pop(0)
                if answer is None:
                    return
                await asyncio.sleep(self.delay)
                writer.write(answer)
                await writer.drain()
                if self.answers and self.answers[0] is None:
                    self.answers.pop(0)
                    return
            await reader.read()  # nothing more scripted: hold on until the client leaves
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            if self.on_close is not None:
                self.on_close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[list[bytes | None]], Awaitable[ScriptedApp]]]:
    servers: list[asyncio.Server] = []

    async def start(answers: list[bytes | None]) -> ScriptedApp:
        app = ScriptedApp(list(answers))
        app.server = await asyncio.start_server(app.serve, "127.0.0.1", 0)
        servers.append(app.server)
        return app

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def ok(body: bytes = b"ok", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def call(app: ScriptedApp, within: float = 5.0) -> http1.Answer:
    upstream = http1.Client(timeout=within, keepalive=5.0, connections=10)
    try:
        return await upstream.request(
            app.origin, "POST", "/hook?x=1", headers=[("Host", "app")], body=b'{"id": 1}'
        )
    finally:
        upstream.close()


async def test_sends_the_request_in_one_piece(scripted: Any) -> None:
    app = await scripted([ok()])
    await call(app)
    assert app.requests == [
        b'POST /hook?x=1 HTTP/1.1\r\nHost: app\r\nContent-Length: 9\r\n\r\n{"id": 1}'
    ]


@pytest.mark.parametrize(
    ("raw", "body"),
    [
        (ok(b"hello"), b"hello"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer-A: 1\r\n\r\n", b"hello world"),
        (b"HTTP/1.1 204 No Content\r\nContent-Length: 5\r\n\r\n", b""),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
         + ok(b"final"), b"final"),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end", b"until the end"),
        (b"HTTP/1.0 200 OK\r\n\r\nold", b"old"),
    ],
)  # fmt: skip
async def test_reads_each_kind_of_answer_whole(scripted: Any, raw: bytes, body: bytes) -> None:
    app = await scripted([raw, None])
    answer = await call(app)
    assert (answer.status, answer.body) == (200 if body != b"" else 204, body)


async def test_keeps_headers_repeated_and_in_order(scripted: Any) -> None:
    app = await scripted([ok(extra=b"Set-Cookie: a=1\r\nX-Thing:  v  \r\nSet-Cookie: b=2\r\n")])
    answer = await call(app)
    assert answer.headers.getall("Set-Cookie") == ["a=1", "b=2"]
    assert answer.headers["X-Thing"] == "v"
    assert answer.reason == "OK"


async def test_reuses_a_kept_alive_connection_and_not_a_closed_one(scripted: Any) -> None:
    app = await scripted([ok(), ok(extra=b"Connection: close\r\n"), ok()])
    upstream = http1.Client(timeout=5, keepalive=5, connections=10)
    try:
        for _ in range(3):
            answer = await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
            assert answer.status == 200
    finally:
        upstream.close()
    assert app.connections == 2


async def test_an_idle_connection_past_keepalive_is_not_reused(scripted: Any) -> None:
    app = await scripted([ok(), ok()])
    upstream = http1.Client(timeout=5, keepalive=0.05, connections=10)
    try:
        await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
        await asyncio.sleep(0.1)
        await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
    finally:
        upstream.close()
    assert app.connections == 2


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"HTTP/2 200 OK\r\n\r\n", "Expected dot"),
        (b"HTTP/1.1 20 OK\r\n\r\n", "Invalid status code"),
        (b"HTTP/1.1 200 OK\r\nBad Header: x\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\nA: 1\r\n folded\r\n\r\n", "Unexpected whitespace after header value"),
        (b"HTTP/1.1 200 OK\r\nA: x\x01y\r\n\r\n", "Invalid header value char"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
         "Transfer-Encoding can't be present with Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
         "Duplicate Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nhi",
         "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
         "unsupported transfer coding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
         "Invalid character in chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
         "Expected LF after chunk data"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "switched protocols"),
        (b"HTTP/1.1 200 OK\r\nContent-Length:\r\n\r\nabc", "Empty Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: ,\r\n\r\nabc", "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding:\r\nContent-Length: 3\r\n\r\nabc",
         "Empty Transfer-Encoding"),
        (b"HTTP/1.0 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
         "unsupported transfer coding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nBad Trailer\r\n\r\n",
         "Invalid header token (in the body)"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;x\x01\r\na\r\n0\r\n\r\n",
         "Invalid character in chunk extensions name"),
        # What llhttp lets through and this client adds a check for.
        (b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok", "bad status line: HTTP/2.0"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc", "unsupported transfer coding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
         + b"1;" + b"x" * (2 * http1.MAX_HEAD + http1.MAX_CHUNK_LINE), "over their limit"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"
         + b"T: 1\r\n" * (http1.MAX_TRAILERS + 1) + b"\r\n", "trailer fields"),
        (b"HTTP/1.1 103 Early Hints\r\n\r\n" * 11 + b"HTTP/1.1 200 OK\r\n\r\n",
         "over 10 interim"),
        (b"HTTP/1.1 200 OK\r\nA: " + b"x" * (http1.MAX_HEAD + 10), "over 65536 bytes"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\nok",
         "Content-Length overflow"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1" + b"0" * 19 + b"\r\n\r\nok",
         "Content-Length over 19 digits"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok", "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\n0123456789",
         "Invalid character in Content-Length"),
        # U+00A0 and U+2003 are whitespace to str.strip(), not to HTTP.
        (b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xa02\r\n\r\nok",
         "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\xe2\x80\x83\r\n\r\nok",
         "Invalid character in Content-Length"),
        # The Kelvin sign lower-cases to an ASCII k: this is not "chunked".
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chun\xe2\x84\xaaed\r\n\r\n0\r\n\r\n",
         "unsupported transfer coding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n 2\r\nok\r\n0\r\n\r\n",
         "Invalid character in chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n+2\r\nok\r\n0\r\n\r\n",
         "Invalid character in chunk size"),
        # llhttp takes control characters in a reason phrase; no one may write them back.
        (b"HTTP/1.1 200 O\x01K\r\nContent-Length: 2\r\n\r\nok", "a control character"),
        (b"HTTP/1.1 200 O\x7fK\r\nContent-Length: 2\r\n\r\nok", "a control character"),
    ],
)  # fmt: skip
async def test_a_malformed_answer_is_refused(scripted: Any, raw: bytes, problem: str) -> None:
    app = await scripted([raw, None])
    with pytest.raises(errors.UpstreamUnavailable, match="malformed answer") as info:
        await call(app)
    assert problem in info.value.message


@pytest.mark.parametrize(
    "raw",
    [
        None,  # hangs up without a byte
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        b"HTTP/1.1 200 OK\r\nContent-Le",
    ],
)
async def test_an_answer_cut_short_is_an_upstream_failure(scripted: Any, raw: bytes | None) -> None:
    app = await scripted([raw] if raw is None else [raw, None])
    with pytest.raises(errors.UpstreamUnavailable, match="closed the connection"):
        await call(app)


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789", 200),
        (b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n0123", 201),
        (b"HTTP/1.1 204 No Content\r\nContent-Le", 204),
        (b"HTTP/1.1 200 \r\nA: x\x01y\r\n\r\n", 200),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 200),
        (b"HTTP/1.1 200 O\x01K\r\nContent-Length: 2\r\n\r\nok", 200),
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 202 Accepted\r\nContent-Length: 5\r\n\r\n", 202),
        (b"HTTP/1.1 500 Oops\r\nContent-Length: 100\r\n\r\n0123456789", 500),
        # No final status line yet: the app may not have done the work.
        (None, None),
        (b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok", None),
        (b"HTTP/1.1 20", None),
        (b"HTTP/1.1 100 Continue\r\n\r\n", None),
        (b"HTTP/1.1 100 Continue\r\nA: x\x01y\r\n\r\n", None),
    ],
)  # fmt: skip
async def test_a_failure_after_the_final_status_line_carries_that_status(
    scripted: Any, raw: bytes | None, status: int | None
) -> None:
    """A 2xx means the app did the work: the pipeline keeps the claim although it answers 502."""
    app = await scripted([raw] if raw is None else [raw, None])
    with pytest.raises(errors.UpstreamUnavailable) as info:
        await call(app)
    assert info.value.upstream_status == status


async def test_obs_text_is_read_as_surrogate_escapes_that_give_back_its_bytes(
    scripted: Any,
) -> None:
    app = await scripted([b"HTTP/1.1 200 R\xe9ussi\r\nX-Name: caf\xe9 \xc3\xa9\r\n"
                          b"Content-Length: 2\r\n\r\nok"])  # fmt: skip
    answer = await call(app)
    assert answer.reason == "R\udce9ussi"
    assert answer.headers["X-Name"].encode("utf-8", "surrogateescape") == b"caf\xe9 \xc3\xa9"


async def test_no_answer_within_the_timeout_is_a_timeout(scripted: Any) -> None:
    app = await scripted([b"HTTP/1.1 200 OK\r\n"])  # and then nothing
    with pytest.raises(errors.UpstreamTimeout, match=r"within 0\.2s"):
        await call(app, within=0.2)


async def test_nothing_listening_is_an_upstream_failure() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    upstream = http1.Client(timeout=5, keepalive=5, connections=10)
    refused = "^upstream refused the connection: nothing listens there$"
    with pytest.raises(errors.UpstreamUnavailable, match=refused):
        await upstream.request(
            http1.Origin("127.0.0.1", port, "x"), "POST", "/", headers=[], body=b""
        )


async def test_a_chunked_answer_is_relayed_through_the_proxy_with_its_headers(
    scripted: Any, make_proxy: MakeProxy
) -> None:
    app = await scripted([
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\nX-App: yes\r\n"
        b"Content-Type: application/json\r\n\r\n"
        b"6\r\n{\"a\":1\r\n1\r\n}\r\n0\r\n\r\n",
        None,
    ])  # fmt: skip
    proxy = await make_proxy(upstream={"url": f"http://127.0.0.1:{app.origin.port}"})
    response = await proxy.post("/webhooks/corvel", data=json.dumps({"id": "evt_chunked"}))

    assert response.status == 201
    assert await response.json() == {"a": 1}
    assert response.headers["X-App"] == "yes"
    assert response.headers["Content-Length"] == "7"  # re-framed by the proxy's server
    request = app.requests[0]
    # Host first, as RFC 9112 3.2 asks; the provider's, since preserve_host is on by default.
    assert request.startswith(b"POST /webhooks/corvel HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-Forwarded-For: 127.0.0.1\r\n" in request


async def test_a_malformed_failure_is_a_502_and_the_retry_goes_through(
    scripted: Any, make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    app = await scripted([
        b"HTTP/1.1 503 Busy\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok", None,
        ok(b"done"), None,
    ])  # fmt: skip
    proxy = await make_proxy(upstream={"url": f"http://127.0.0.1:{app.origin.port}"})
    event = json.dumps({"id": "evt_malformed"})

    first = await proxy.post("/webhooks/corvel", data=event)
    assert first.status == 502
    assert (await first.json())["error"] == "upstream_unavailable"
    assert await claimed(pg_dsn, table) == []

    retry = await proxy.post("/webhooks/corvel", data=event)
    assert (retry.status, await retry.read()) == (200, b"done")
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_malformed"]


async def test_a_malformed_2xx_is_a_502_that_keeps_the_claim(
    scripted: Any, make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    """The app said it did the work: its retry is a duplicate, not a second delivery."""
    app = await scripted([
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok", None,
        ok(b"done"), None,
    ])  # fmt: skip
    proxy = await make_proxy(upstream={"url": f"http://127.0.0.1:{app.origin.port}"})
    event = json.dumps({"id": "evt_malformed"})

    first = await proxy.post("/webhooks/corvel", data=event)
    assert first.status == 502
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_malformed"]

    retry = await proxy.post("/webhooks/corvel", data=event)
    assert retry.headers["Dedup-Status"] == "duplicate"
    assert len(app.requests) == 1


async def test_at_most_connections_are_in_use_at_once(scripted: Any) -> None:
    app = await scripted([ok()] * 12)
    upstream = http1.Client(timeout=5, keepalive=5, connections=2)
    try:
        answers = await asyncio.gather(
            *(upstream.request(app.origin, "POST", "/", headers=[], body=b"") for _ in range(6))
        )
    finally:
        upstream.close()
    assert [a.status for a in answers] == [200] * 6
    assert app.connections == 2


async def test_idle_connections_are_closed_after_keepalive_without_traffic(
    scripted: Any,
) -> None:
    app = await scripted([ok(), ok()])
    upstream = http1.Client(timeout=5, keepalive=0.1, connections=10)
    closed = asyncio.Event()
    app.on_close = closed.set
    try:
        await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
        # No further request: the sweeper alone must close the idle connection.
        await asyncio.wait_for(closed.wait(), 5)
    finally:
        upstream.close()


async def test_a_request_ending_after_close_does_not_keep_its_connection(
    scripted: Any,
) -> None:
    app = await scripted([ok(), ok()])
    upstream = http1.Client(timeout=5, keepalive=5, connections=10)
    closed = asyncio.Event()
    app.on_close = closed.set
    app.delay = 0.2
    request = asyncio.create_task(upstream.request(app.origin, "POST", "/", headers=[], body=b""))
    await asyncio.sleep(0.05)
    upstream.close()
    assert (await request).status == 200
    await asyncio.wait_for(closed.wait(), 5)


def read_byte_by_byte(raw: bytes) -> http1.Answer:
    """The answer read as if each byte came in a packet of its own, so every split point is
    exercised, whatever TCP would do."""
    reader = http1._Reader("POST", http1.unlimited)
    for byte in raw:
        reader.feed(bytes([byte]))
    assert reader.answer is not None, "the answer was not complete after its last byte"
    return reader.answer


@pytest.mark.parametrize(
    "raw",
    [
        ok(b"hello", extra=b"X-A: 1\r\nX-Name: caf\xc3\xa9\r\n"),
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 D\xc3\xa9j\xc3\xa0 vu\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n5 ;a=b\r\nhello\r\n0\r\nT: 1\r\n\r\n",
    ],
)
async def test_an_answer_split_anywhere_is_read_as_if_whole(raw: bytes) -> None:
    answer = read_byte_by_byte(raw)
    assert (answer.status, answer.body) == (200, b"hello")


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 200 OK\n\n",
        b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\nok",
        b"HTTP/1.1 200 OK\rContent-Length: 2\r\n",
        b'{"ok": true}',  # HTTP/0.9: a body and no status line
        b"<html>ok</html>\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\nok\n",
        b"HTTP/1.1 2000 OK\r\n",  # the status line is whole and wrong: no need to wait for more
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nA: 1\n",
    ],
)
async def test_an_answer_that_is_not_crlf_http_1_is_refused_at_once(
    scripted: Any, raw: bytes
) -> None:
    app = await scripted([raw])  # and the connection held open
    upstream = http1.Client(timeout=30, keepalive=5, connections=10)
    try:
        # Well inside the client's timeout: refused on sight, not when the timeout ends.
        async with asyncio.timeout(5):
            with pytest.raises(errors.UpstreamUnavailable, match="malformed answer"):
                await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
    finally:
        upstream.close()


async def test_an_unsolicited_answer_is_never_taken_as_the_next_one(scripted: Any) -> None:
    app = await scripted([ok(), b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"])
    upstream = http1.Client(timeout=5, keepalive=5, connections=10)
    try:
        first = await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
        # Written while the connection is idle, and the next request follows before the loop
        # has read it: only the check made when the connection is taken can see it.
        app.writers[0].write(ok(b"unsolicited"))
        second = await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
    finally:
        upstream.close()
    assert (first.status, second.status, second.body) == (200, 500, b"")
    assert app.connections == 2


async def test_bytes_on_an_idle_connection_close_it_with_a_warning(
    scripted: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = await scripted([ok(), ok()])
    closed = asyncio.Event()
    app.on_close = closed.set
    upstream = http1.Client(timeout=5, keepalive=30, connections=10)
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.upstream.http1"):
            await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
            app.writers[0].write(ok(b"secret-unsolicited"))
            # No further request: the bytes alone must close it, long before keepalive.
            async with asyncio.timeout(5):
                await closed.wait()
    finally:
        upstream.close()
    (record,) = [r for r in caplog.records if r.name == "proxy.upstream.http1"]
    assert record.levelno == logging.WARNING
    assert "answering no request" in record.getMessage()
    assert "secret-unsolicited" not in record.getMessage()
    assert "HTTP/1.1" not in record.getMessage()


async def test_bytes_right_after_an_answer_close_the_connection_with_a_warning(
    scripted: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = await scripted([ok(b"first") + ok(b"second"), ok(b"third")])
    upstream = http1.Client(timeout=5, keepalive=30, connections=10)
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.upstream.http1"):
            bodies = [
                (await upstream.request(app.origin, "POST", "/", headers=[], body=b"")).body
                for _ in range(2)
            ]
    finally:
        upstream.close()
    assert bodies == [b"first", b"third"]
    assert app.connections == 2
    (record,) = [r for r in caplog.records if r.name == "proxy.upstream.http1"]
    assert "second" not in record.getMessage()


async def test_an_app_closing_an_idle_connection_is_not_a_warning(
    scripted: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = await scripted([ok(), None, ok()])
    upstream = http1.Client(timeout=5, keepalive=30, connections=10)
    try:
        with caplog.at_level(logging.WARNING, logger="proxy.upstream.http1"):
            for _ in range(2):
                answer = await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
                assert answer.status == 200
    finally:
        upstream.close()
    assert app.connections == 2
    assert [r for r in caplog.records if r.name == "proxy.upstream.http1"] == []


async def send_webhook(proxy: Any, event: str) -> bytes:
    """The proxy's answer as the bytes on the wire, which aiohttp's client would decode."""
    body = json.dumps({"id": event}).encode()
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(
            b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


async def test_utf8_beyond_ascii_in_header_values_and_reason_is_relayed_byte_exact(
    scripted: Any, make_proxy: MakeProxy
) -> None:
    app = await scripted([
        b"HTTP/1.1 200 D\xc3\xa9j\xc3\xa0 vu\r\nX-Name: caf\xc3\xa9 \xe2\x82\xac\xc2\x85\r\n"
        b"Content-Length: 2\r\n\r\nok",
    ])  # fmt: skip
    proxy = await make_proxy(upstream={"url": f"http://127.0.0.1:{app.origin.port}"})
    raw = await send_webhook(proxy, "evt_utf8")
    assert raw.startswith(b"HTTP/1.1 200 D\xc3\xa9j\xc3\xa0 vu\r\n")
    assert b"\r\nX-Name: caf\xc3\xa9 \xe2\x82\xac\xc2\x85\r\n" in raw
    assert raw.endswith(b"\r\n\r\nok")


async def test_a_head_answer_has_no_body_and_its_connection_is_not_reused(scripted: Any) -> None:
    app = await scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", ok()])
    upstream = http1.Client(timeout=5, keepalive=5, connections=10)
    try:
        head = await upstream.request(app.origin, "HEAD", "/", headers=[], body=b"")
        after = await upstream.request(app.origin, "POST", "/", headers=[], body=b"")
    finally:
        upstream.close()
    assert (head.status, head.headers["Content-Length"], head.body) == (200, "5", b"")
    assert after.body == b"ok"
    assert app.connections == 2


def test_trailing_whitespace_in_a_header_value_is_not_part_of_it() -> None:
    answer = read_byte_by_byte(ok(extra=b"X-A: \t v w \t\r\n"))
    assert answer.headers["X-A"] == "v w"
