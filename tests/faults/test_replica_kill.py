"""Replicas as separate processes on one database: a replica killed mid-request, and copies of
one event spread over three replicas."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

from tests.faults import campaign
from tests.helpers import claimed, fetch, wait_for_lock_waiters


async def _claims_in_flight(dsn: str) -> list[int]:
    """PIDs of proxy sessions holding an open claim (idle in transaction while the app works)."""
    rows = await fetch(
        dsn,
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'dedup-proxy' "
        "AND state LIKE 'idle in transaction%'",
    )
    return [row["pid"] for row in rows]


async def test_kill_9_mid_request_releases_the_claim_to_a_copy_on_another_replica(
    tmp_path: Path, pg_dsn: str, table: str
) -> None:
    settings = campaign.Settings(table=table, upstream_timeout=10, claim_wait=5, pool_size=2)
    rng = random.Random(1)
    event = "evt_killed_mid_request"
    async with (
        campaign.cluster(tmp_path, settings, 2, rng, dsn=pg_dsn) as c,
        campaign.Provider(c.replicas, rng, settings) as provider,
    ):
        doomed, survivor = c.replicas
        held = c.app.gates[event] = asyncio.Event()  # the app holds the first copy
        try:
            first = asyncio.create_task(provider.deliver(event, doomed, "first"))
            await campaign.poll(lambda: len(c.app.arrived) == 1, "the first copy at the app", 10)
            (holder,) = await _claims_in_flight(pg_dsn)

            # The provider's redelivery reaches the other replica and waits on the row lock.
            del c.app.gates[event]
            redelivery = asyncio.create_task(provider.deliver(event, survivor, "redelivery"))
            await wait_for_lock_waiters(pg_dsn, table, 1)

            killed_at = time.monotonic()
            await doomed.kill()
            released = await campaign.poll(
                lambda: _gone(pg_dsn, holder), "the killed replica's session to end", 10
            )
            second = await redelivery
            dead = await first
        finally:
            held.set()
        await campaign.poll(lambda: c.app.in_flight == 0, "the held app call to end", 10)

    (forwarded,) = [t for e, d, t in c.app.arrived if d == second.delivery_id]
    print(
        f"kill -9 -> session gone in {released:.3f}s, "
        f"redelivery forwarded {forwarded - killed_at:.3f}s after the kill"
    )
    assert dead.outcome == "indeterminate"  # the provider lost its connection to the dead replica
    assert second.status == 200
    assert not second.duplicate  # forwarded, not swallowed: the dead claim was rolled back
    assert forwarded - killed_at < 10
    # The held first call still ends (its answer goes nowhere): a documented window of double
    # delivery, since that app may have acted before its proxy died.
    assert [call.delivery_id for call in c.app.calls] == [second.delivery_id, dead.delivery_id]
    assert [row[1] for row in await claimed(pg_dsn, table)] == [event]
    outcomes = [line["outcome"] for line in survivor.logs if line.get("event_id") == event]
    assert outcomes == ["processed"]


async def _gone(dsn: str, pid: int) -> bool:
    rows = await fetch(dsn, "SELECT 1 FROM pg_stat_activity WHERE pid = $1", pid)
    return not rows


async def test_copies_spread_over_three_replicas_reach_the_app_once_each(
    tmp_path: Path, pg_dsn: str, table: str
) -> None:
    settings = campaign.Settings(
        table=table, upstream_timeout=10, claim_wait=10, pool_size=10, pool_timeout=10
    )
    rng = random.Random(2)
    events = [f"evt_spread_{n:03d}" for n in range(300)]
    copies = {event: rng.randint(1, 5) for event in events}
    async with (
        campaign.cluster(tmp_path, settings, 3, rng, dsn=pg_dsn) as c,
        campaign.Provider(c.replicas, rng, settings) as provider,
    ):
        c.app.latency = 0.03
        lanes = asyncio.Semaphore(8)  # events in flight at once; each one's copies all together

        async def send(event: str) -> None:
            async with lanes:
                await asyncio.gather(
                    *(
                        provider.deliver(event, rng.choice(c.replicas), "spread")
                        for _ in range(copies[event])
                    )
                )

        await asyncio.gather(*(send(event) for event in events))

    statuses = Counter(d.status for d in provider.deliveries)
    assert statuses == {200: sum(copies.values())}
    assert Counter(call.event_id for call in c.app.calls) == dict.fromkeys(events, 1)
    duplicates = Counter(d.event_id for d in provider.deliveries if d.duplicate)
    assert duplicates == {e: n - 1 for e, n in copies.items() if n > 1}
    assert len({d.replica for d in provider.deliveries}) == 3
    assert [row[1] for row in await claimed(pg_dsn, table)] == sorted(events)
