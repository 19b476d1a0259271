"""Clients that send a request and never read the answer cannot hold anything.

A connection whose answer makes no progress for ``send_timeout`` is cut off; one stuck writing
can be closed to make room under ``max_connections``; an answer stays counted in
``max_buffered`` until it is written; and pass-through has a connection pool of its own, so
non-reading pass-through clients never starve the webhook path. Clients are raw sockets with a
tiny receive buffer that never read, and ``dedup-proxy serve`` is a real process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from tests.helpers import (
    MIB,
    FakeUpstream,
    MakeProxy,
    Serve,
    claimed,
    held,
    wait_until,
    webhook_request,
)

WITHIN = 15.0  # bound on every wait for the proxy
LARGE = b"x" * (16 * MIB)  # one buffer, shared by every answer that sends it


async def large_answers(aiohttp_server: Any, fake: FakeUpstream) -> FakeUpstream:
    """``fake`` served over plain HTTP, answering LARGE to every request."""
    fake.respond = lambda n: web.Response(body=LARGE)
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", fake.handle)
    server = await aiohttp_server(application)
    fake.url = str(server.make_url("")).rstrip("/")
    return fake


async def test_an_answer_that_is_not_read_is_cut_off_at_send_timeout(
    serve: Serve, aiohttp_server: Any, non_readers: Any, pg_dsn: str, table: str
) -> None:
    app = await large_answers(aiohttp_server, FakeUpstream())
    served = await serve(upstream={"url": app.url}, send_timeout="1s")

    await non_readers(served.port, webhook_request("evt_unread"))

    def cut_off() -> bool:
        return any(line.get("client_gone") for line in served.lines())

    await wait_until(lambda: asyncio.sleep(0, result=cut_off()), "the writer cut off", WITHIN)
    (line,) = [x for x in served.lines() if x.get("event_id") == "evt_unread"]
    # The app did the work and the claim was committed before the answer was written.
    assert (line["outcome"], line["status"]) == ("processed", 200)
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_unread"]


async def test_connections_stuck_writing_make_room_for_a_webhook(
    serve: Serve, aiohttp_server: Any, non_readers: Any, pg_dsn: str, table: str
) -> None:
    app = await large_answers(aiohttp_server, FakeUpstream())
    served = await serve(
        upstream={"url": app.url}, send_timeout="5m", max_connections=4, max_buffered="256MiB"
    )
    for n in range(4):
        await non_readers(served.port, webhook_request(f"evt_stuck_{n}"))

    async def all_committed() -> bool:
        return len(await claimed(pg_dsn, table)) == 4

    await wait_until(all_committed, "the four answers to be committed and written", WITHIN)

    async def genuine_answered() -> bool:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    f"{served.url}/webhooks/corvel",
                    data=b'{"id": "evt_genuine"}',
                    timeout=aiohttp.ClientTimeout(total=WITHIN),
                ) as response,
            ):
                await response.read()
                return response.status == 200
        except aiohttp.ClientError:
            return False

    # Each try that is refused (503) is a provider's retry; one must get through.
    await wait_until(genuine_answered, "a genuine webhook to be answered", WITHIN)


async def test_an_unread_answer_stays_counted_in_max_buffered_until_written(
    make_proxy: MakeProxy, aiohttp_server: Any, non_readers: Any
) -> None:
    app = await large_answers(aiohttp_server, FakeUpstream())
    client = await make_proxy(upstream={"url": app.url}, max_buffered="24MiB")

    await non_readers(client.server.port, webhook_request("evt_unread"))

    async def counted() -> bool:
        return len(app.requests) == 1 and held(client) >= len(LARGE) // 2

    await wait_until(counted, "the unread answer to be held and counted", WITHIN)
    # Another such answer does not fit beside it: shed, rather than held uncounted.
    second = await client.post("/webhooks/corvel", data=b'{"id": "evt_second"}')
    assert second.status == 502
    assert (await second.json())["error"] == "answer_too_large"


async def test_a_pass_through_answer_that_is_not_read_frees_its_upstream_connection(
    serve: Serve, aiohttp_server: Any, non_readers: Any
) -> None:
    app = await large_answers(aiohttp_server, FakeUpstream())
    served = await serve(upstream={"url": app.url}, send_timeout="1s")

    await non_readers(served.port, b"GET /big HTTP/1.1\r\nHost: proxy.test\r\n\r\n")

    def broke_off() -> bool:
        return any("pass-through body broke off" in line["msg"] for line in served.lines())

    await wait_until(lambda: asyncio.sleep(0, result=broke_off()), "pass-through cut off", WITHIN)
    (line,) = [x for x in served.lines() if x.get("outcome") == "passthrough"]
    assert line["path"] == "/big"


async def test_a_replayed_answer_that_is_not_read_stays_counted_too(
    make_proxy: MakeProxy, aiohttp_server: Any, non_readers: Any
) -> None:
    app = await large_answers(aiohttp_server, FakeUpstream())
    app.respond = lambda n: web.Response(body=LARGE[:MIB])
    route = {
        "name": "corvel",
        "path": "/webhooks/corvel",
        "event_id": "body:/id",
        "on_duplicate": "replay",
        "replay_max_body": "1MiB",
    }
    client = await make_proxy(upstream={"url": app.url}, max_buffered="1536KiB", routes=[route])
    first = await client.post("/webhooks/corvel", data=b'{"id": "evt_r"}')
    assert (first.status, len(await first.read())) == (200, MIB)

    await non_readers(client.server.port, webhook_request("evt_r") * 4)

    async def counted() -> bool:
        return held(client) >= MIB // 2

    await wait_until(counted, "the unread replay to be held and counted", WITHIN)
    copy = await client.post("/webhooks/corvel", data=b'{"id": "evt_r"}')
    assert (copy.status, copy.headers["Retry-After"]) == (503, "5")
    assert len(app.requests) == 1
