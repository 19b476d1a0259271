"""Faults around one proxy: upstream misbehaviour and database settings that must not matter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from proxy import embedded
from tests.helpers import FakeUpstream, MakeProxy, claimed, event, execute, wait_for_lock_waiters


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[str]:
    """The DSN of a PostgreSQL of this test's own, whose settings it may change."""
    server = embedded.EmbeddedPostgres(tmp_path / "data")
    dsn = server.start()
    try:
        yield dsn
    finally:
        server.stop()


async def test_upstream_410_is_answered_502_and_releases_the_claim(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: (
        web.Response(status=410, text="gone") if n == 0 else web.Response(text="ok")
    )
    client = await make_proxy()

    first = await client.post("/webhooks/corvel", data=event("evt_410"))
    retry = await client.post("/webhooks/corvel", data=event("evt_410"))

    # Standard Webhooks senders disable an endpoint that answers 410.
    assert first.status == 502
    assert (await first.json())["error"] == "upstream_unavailable"
    assert retry.status == 200
    assert len(upstream.requests) == 2
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_410"]


async def test_repeatable_read_as_the_server_default_changes_nothing(
    make_proxy: MakeProxy, upstream: FakeUpstream, own_server: str, table: str
) -> None:
    await execute(
        own_server, "ALTER DATABASE postgres SET default_transaction_isolation = 'repeatable read'"
    )
    upstream.gate = asyncio.Event()
    replica_a = await make_proxy(database={"dsn": own_server})
    replica_b = await make_proxy(database={"dsn": own_server})
    first = asyncio.create_task(replica_a.post("/webhooks/corvel", data=event("evt_rr")))
    await upstream.arrived.wait()
    copy = asyncio.create_task(replica_b.post("/webhooks/corvel", data=event("evt_rr")))
    await wait_for_lock_waiters(own_server, table, 1)

    upstream.gate.set()
    responses = await asyncio.gather(first, copy)

    # Under REPEATABLE READ the waiting INSERT would fail with a serialization error (a 503)
    # after the owner's COMMIT; the proxy pins READ COMMITTED, so the copy is a duplicate.
    assert [r.status for r in responses] == [200, 200]
    assert responses[1].headers["Dedup-Status"] == "duplicate"
    assert len(upstream.requests) == 1


async def start_closing_app() -> tuple[asyncio.Server, list[int]]:
    """An app that answers the first request on each connection and closes the connection
    when a second one arrives: as an app does whose keep-alive timer fires at that moment."""
    served: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for number in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if number == 1:
                    return  # closed under the request
                served.append(number)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0), served


@pytest.mark.parametrize("keepalive", ["200ms", "15s"])
async def test_idle_upstream_connections_are_dropped_before_the_app_drops_them(
    make_proxy: MakeProxy, keepalive: str
) -> None:
    server, served = await start_closing_app()
    port = server.sockets[0].getsockname()[1]
    try:
        client = await make_proxy(
            upstream={"url": f"http://127.0.0.1:{port}", "keepalive": keepalive}
        )
        first = await client.post("/webhooks/corvel", data=event("evt_ka_1"))
        # Idle time is the scenario itself: longer than upstream.keepalive in the first case.
        await asyncio.sleep(0.5)
        second = await client.post("/webhooks/corvel", data=event("evt_ka_2"))
    finally:
        server.close()
        await server.wait_closed()

    assert first.status == 200
    # With the short keep-alive the proxy opened a fresh connection; with a long one it
    # reused the connection the app closed under the request, and sent it once more on a
    # fresh one (nothing of the answer had arrived): either way the webhook gets through.
    assert second.status == 200
    assert len(served) == 2
