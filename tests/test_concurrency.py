"""Copies of one event in flight at once: in one process (single-flight) and across replicas
(PostgreSQL's row lock), including hand-over when the first copy fails."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import app_keys
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    claimed,
    event,
    fetch,
    wait_for_lock_waiters,
    wait_until,
)


def post(client: TestClient[Any, Any], event_id: str) -> asyncio.Task[Any]:
    return asyncio.create_task(client.post("/webhooks/corvel", data=event(event_id)))


async def wait_for_local_copies(client: TestClient[Any, Any], event_id: str, count: int) -> None:
    flights = client.app[app_keys.FLIGHTS]

    async def arrived() -> bool:
        return flights.waiting(("corvel", event_id)) >= count

    await wait_until(arrived, f"{count} copies of {event_id} in the proxy")


class CountingClaims:
    """Counts the claims a proxy's (real) claim store makes."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self.claims = 0
        store = client.app[app_keys.STORE]
        claim = store.claim

        def counted(key: Any, wait: float | None = None) -> Any:
            self.claims += 1
            return claim(key, wait)

        store.claim = counted


async def test_copies_on_two_replicas_meet_at_the_row_lock(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    replica_a, replica_b = await make_proxy(), await make_proxy()
    store_b = CountingClaims(replica_b)
    first = post(replica_a, "evt_storm")
    await upstream.arrived.wait()
    copies = [post(replica_b, "evt_storm") for _ in range(5)]
    # Replica B sends one copy to PostgreSQL, which parks it on A's uncommitted row; the
    # other four wait inside B without a database connection.
    await wait_for_local_copies(replica_b, "evt_storm", 5)
    await wait_for_lock_waiters(pg_dsn, table, 1)
    assert not any(task.done() for task in copies)

    upstream.gate.set()
    responses = await asyncio.gather(first, *copies)

    assert [r.status for r in responses] == [200] * 6
    assert [r.headers.get("Dedup-Status") for r in responses[1:]] == ["duplicate"] * 5
    # Once B's copy found the event committed in PostgreSQL, the four queued behind it were
    # answered without a round trip of their own.
    assert store_b.claims == 1
    assert len(upstream.requests) == 1
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_storm"]


async def test_a_copy_that_waited_on_another_replica_still_compares_bodies(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    replica_a, replica_b = await make_proxy(), await make_proxy()
    first = asyncio.create_task(
        replica_a.post("/webhooks/corvel", data=b'{"id": "evt_w", "amount": 1}')
    )
    await upstream.arrived.wait()
    other = asyncio.create_task(
        replica_b.post("/webhooks/corvel", data=b'{"id": "evt_w", "amount": 999}')
    )
    await wait_for_lock_waiters(pg_dsn, table, 1)
    upstream.gate.set()
    responses = await asyncio.gather(first, other)

    assert [r.headers.get("Dedup-Status") for r in responses] == [None, "duplicate"]
    # The comparison runs after the waiting copy's ROLLBACK, so it sees the owner's row.
    registry = replica_b.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_payload_mismatches_total", {"route": "corvel"}) == 1
    assert len(upstream.requests) == 1


async def test_a_storm_of_copies_in_one_process_uses_one_connection(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    storm = 500
    upstream.gate = asyncio.Event()
    client = await make_proxy(database={"pool_size": 2, "pool_timeout": "500ms"})
    # A session of its own: the test client's pool stops at 100 connections.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        url = client.make_url("/webhooks/corvel")
        tasks = [
            asyncio.create_task(session.post(url, data=event("evt_500"))) for _ in range(storm)
        ]
        await upstream.arrived.wait()
        await wait_for_local_copies(client, "evt_500", storm)
        busy = await fetch(
            pg_dsn,
            "SELECT count(*) AS n FROM pg_stat_activity "
            "WHERE application_name = 'dedup-proxy' AND state <> 'idle' "
            "AND datname = current_database()",
        )

        upstream.gate.set()
        responses = await asyncio.gather(*tasks)
        for response in responses:
            response.release()

    # Only the owner holds a connection while the copies wait (the pool has 2: none of the
    # copies waited past pool_timeout for one).
    assert busy[0]["n"] == 1
    assert [r.status for r in responses] == [200] * storm
    assert sum(r.headers.get("Dedup-Status") == "duplicate" for r in responses) == storm - 1
    assert len(upstream.requests) == 1
    assert await claimed(pg_dsn, table) == [("corvel", "evt_500", "charge.succeeded")]


async def test_unsynchronised_burst_of_copies_reaches_the_upstream_once(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    replicas = [await make_proxy(database={"pool_size": 2}) for _ in range(2)]
    responses = await asyncio.gather(*(post(replicas[n % 2], "evt_burst") for n in range(40)))
    assert [r.status for r in responses] == [200] * 40
    assert len(upstream.requests) == 1


async def test_failing_first_copy_hands_over_to_a_copy_on_another_replica(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    upstream.respond = lambda n: (
        web.Response(status=503, text="down") if n == 0 else web.Response(text="second won")
    )
    replica_a, replica_b = await make_proxy(), await make_proxy()
    first = post(replica_a, "evt_handover")
    await upstream.arrived.wait()
    second = post(replica_b, "evt_handover")
    await wait_for_lock_waiters(pg_dsn, table, 1)

    upstream.gate.set()
    first_response, second_response = await asyncio.gather(first, second)

    assert first_response.status == 503
    assert second_response.status == 200
    assert await second_response.text() == "second won"
    assert "Dedup-Status" not in second_response.headers
    assert len(upstream.requests) == 2
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_handover"]


async def test_failing_first_copy_hands_over_to_a_copy_in_the_same_process(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    upstream.respond = lambda n: (
        web.Response(status=500, text="boom") if n == 0 else web.Response(text="retried")
    )
    client = await make_proxy()
    first = post(client, "evt_local")
    await upstream.arrived.wait()
    second = post(client, "evt_local")
    await wait_for_local_copies(client, "evt_local", 2)

    upstream.gate.set()
    first_response, second_response = await asyncio.gather(first, second)

    assert (first_response.status, second_response.status) == (500, 200)
    assert await second_response.text() == "retried"
    assert len(upstream.requests) == 2
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_local"]


async def test_copy_waiting_past_claim_wait_gets_503_in_either_place(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    replica_a = await make_proxy(claim_wait="300ms")
    replica_b = await make_proxy(claim_wait="300ms")
    first = post(replica_a, "evt_slow")
    await upstream.arrived.wait()

    same_process = await replica_a.post("/webhooks/corvel", data=event("evt_slow"))
    other_replica = await replica_b.post("/webhooks/corvel", data=event("evt_slow"))

    for copy in (same_process, other_replica):
        assert copy.status == 503
        assert copy.headers["Retry-After"] == "5"
        assert copy.headers["Dedup-Status"] == "unavailable"
        assert (await copy.json())["error"] == "claim_wait_exceeded"
    upstream.gate.set()
    assert (await first).status == 200
    assert len(upstream.requests) == 1
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_slow"]
