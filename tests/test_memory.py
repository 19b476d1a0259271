"""The memory budget (max_buffered): what does not fit is shed at once, nothing is lost, and a
request's reservation is given back however it ends."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import app_keys
from tests.helpers import FakeUpstream, MakeProxy, claimed, connection, event, held, wait_until

KIB = 1024


def sized(event_id: str, size: int) -> bytes:
    """A JSON event of about ``size`` bytes."""
    return event(event_id, pad="x" * max(0, size - 60))


def shed(client: TestClient[Any, Any], reason: str) -> float:
    meters = client.app[app_keys.METRICS]
    value: float = meters.shed.labels(reason)._value.get()
    return value


async def test_a_body_that_does_not_fit_is_shed_at_once_and_nothing_is_lost(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    client = await make_proxy(max_buffered="1MiB", max_body="1MiB")
    first = asyncio.create_task(client.post("/webhooks/corvel", data=sized("big-1", 600 * KIB)))
    await upstream.arrived.wait()

    second = await client.post("/webhooks/corvel", data=sized("big-2", 600 * KIB))

    assert (second.status, second.headers["Retry-After"]) == (503, "5")
    assert (await second.json())["error"] == "overloaded"
    assert shed(client, "memory") == 1
    upstream.gate.set()
    assert (await first).status == 200
    # The provider's retry, once there is room, is processed.
    retry = await client.post("/webhooks/corvel", data=sized("big-2", 600 * KIB))
    assert retry.status == 200
    assert [json.loads(b)["id"] for b in upstream.bodies()] == ["big-1", "big-2"]
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["big-1", "big-2"]
    assert held(client) == 0


async def test_one_body_always_fits_when_nothing_else_is_held(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    client = await make_proxy(max_buffered="64KiB", max_body="1MiB")

    response = await client.post("/webhooks/corvel", data=sized("alone", 500 * KIB))

    assert response.status == 200
    assert held(client) == 0


async def test_a_chunked_body_is_reserved_as_it_arrives(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    client = await make_proxy(max_buffered="1MiB", max_body="1MiB")
    first = asyncio.create_task(client.post("/webhooks/corvel", data=sized("big", 900 * KIB)))
    await upstream.arrived.wait()

    async def chunks() -> Any:
        body = sized("chunked", 300 * KIB)
        for start in range(0, len(body), 64 * KIB):
            yield body[start : start + 64 * KIB]

    second = await client.post("/webhooks/corvel", data=chunks())

    assert second.status == 503
    upstream.gate.set()
    assert (await first).status == 200
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["big"]
    assert held(client) == 0


async def test_an_answer_that_does_not_fit_is_a_502_and_a_2xx_keeps_the_claim(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    gate = asyncio.Event()
    answers = {"holder": b"ok", "answer": b"y" * (600 * KIB)}  # over the 64 KiB allowance

    async def respond(request: web.Request) -> web.Response:
        event_id = json.loads(await request.read())["id"]
        if event_id == "holder":
            await gate.wait()
        return web.Response(body=answers[event_id])

    app = web.Application(client_max_size=8 * 1024 * KIB)
    app.router.add_post("/webhooks/corvel", respond)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        client = await make_proxy(
            max_buffered="1MiB", max_body="1MiB", upstream={"url": f"http://127.0.0.1:{port}"}
        )
        holder = asyncio.create_task(
            client.post("/webhooks/corvel", data=sized("holder", 600 * KIB))
        )
        await wait_until(lambda: _true(held(client) > 0), "the first body to be held")

        response = await client.post("/webhooks/corvel", data=sized("answer", 100))

        assert response.status == 502
        assert (await response.json())["error"] == "answer_too_large"
        gate.set()
        assert (await holder).status == 200
        # The app answered 2xx, so it did the work: the claim is kept, and the provider's
        # retry of the 502 is a duplicate rather than a second delivery.
        assert [row[1] for row in await claimed(pg_dsn, table)] == ["answer", "holder"]
        retry = await client.post("/webhooks/corvel", data=sized("answer", 100))
        assert retry.headers["Dedup-Status"] == "duplicate"
        assert shed(client, "memory") == 1
        assert held(client) == 0
    finally:
        await runner.cleanup()


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize(
    "ending",
    [
        "hung-up client",
        "body too slow",
        "upstream refused",
        "pool exhausted",
        "claim wait exceeded",
    ],
)
async def test_the_reservation_is_given_back_however_the_request_ends(
    make_proxy: MakeProxy, upstream: FakeUpstream, ending: str
) -> None:
    options: dict[str, Any] = {"client_timeout": "1s", "claim_wait": "1s"}
    if ending == "upstream refused":
        options["upstream"] = {"url": "http://127.0.0.1:1"}
    if ending == "pool exhausted":
        options["database"] = {"pool_size": 1, "pool_timeout": "200ms"}
    client = await make_proxy(**options)
    body = sized("e", 10 * KIB)

    if ending in ("hung-up client", "body too slow"):
        async with connection(client) as (reader, writer):
            writer.write(
                b"POST /webhooks/corvel HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                % len(body)
                + body[:100]
            )
            await wait_until(lambda: _true(held(client) > 0), "the body's reservation")
            if ending == "body too slow":
                status_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)
                assert b" 408 " in status_line
    elif ending in ("pool exhausted", "claim wait exceeded"):
        upstream.gate = asyncio.Event()
        holder = asyncio.create_task(client.post("/webhooks/corvel", data=body))
        await upstream.arrived.wait()
        other = sized("other" if ending == "pool exhausted" else "e", 10 * KIB)
        peer = await make_proxy(**options) if ending == "claim wait exceeded" else client
        before = held(peer)  # the holder's body, when it is the same proxy
        response = await peer.post("/webhooks/corvel", data=other)
        assert response.status == 503
        assert held(peer) == before
        upstream.gate.set()
        assert (await holder).status == 200
    else:
        response = await client.post("/webhooks/corvel", data=body)
        assert response.status == 502

    await wait_until(lambda: _true(held(client) == 0), "every reservation to be given back")
