"""The retention sweeper, on a real PostgreSQL: what it removes, and what it never blocks."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from proxy import errors
from proxy.database import sql
from tests.helpers import FakeUpstream, MakeProxy, claimed, execute, fetch, sweeper_of


async def age(pg_dsn: str, table: str, event_id: str, days: float) -> None:
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET received_at = now() - interval '{days} days' "
        f"WHERE event_id = '{event_id}'",
    )


ROUTES = [
    {"name": "short", "path": "/short", "event_id": "body:/id", "retention": "1d"},
    {"name": "long", "path": "/long", "event_id": "body:/id", "retention": "7d"},
]


async def test_sweep_removes_only_expired_claims_of_each_scope(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy = await make_proxy(routes=ROUTES, sweeper={"batch": 2})
    for path in ("/short", "/long"):
        for n in range(5):
            assert (await proxy.post(path, data=f'{{"id": "e{n}"}}'.encode())).status == 200
    for n in range(4):  # 3 days old: expired for "short", kept for "long"
        for scope in ("short", "long"):
            await execute(
                pg_dsn,
                f"UPDATE \"{table}\" SET received_at = now() - interval '3 days' "
                f"WHERE scope = '{scope}' AND event_id = 'e{n}'",
            )

    removed = await sweeper_of(proxy).sweep()

    assert removed == {"short": 4, "long": 0}
    remaining = [(scope, event_id) for scope, event_id, _ in await claimed(pg_dsn, table)]
    assert remaining == [("long", f"e{n}") for n in range(5)] + [("short", "e4")]
    # A forgotten-by-retention event is processed again when it comes back.
    again = await proxy.post("/short", data=b'{"id": "e0"}')
    assert "Dedup-Status" not in again.headers
    assert len(upstream.requests) == 11


async def test_one_replica_sweeps_at_a_time(make_proxy: MakeProxy, pg_dsn: str) -> None:
    proxy = await make_proxy(routes=ROUTES)
    sweeping = await asyncpg.connect(pg_dsn)  # another replica, in the middle of a batch
    try:
        async with sweeping.transaction():
            await sweeping.execute("SELECT pg_advisory_xact_lock($1)", sql.SWEEP_LOCK_KEY)
            assert await sweeper_of(proxy).sweep() is None
    finally:
        await sweeping.close()
    assert await sweeper_of(proxy).sweep() == {"short": 0, "long": 0}


async def test_a_row_held_past_the_lock_wait_fails_the_round_and_the_next_one_sweeps_it(
    make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    """No FOR UPDATE SKIP LOCKED (it needs UPDATE): a row another transaction holds is waited
    on, for ROW_LOCK_WAIT at most; a transaction left open on a claim stalls the sweep (the
    DedupRetentionSweepStale alert), never a claim."""
    proxy = await make_proxy(routes=ROUTES)
    for n in range(3):
        await proxy.post("/short", data=f'{{"id": "old{n}"}}'.encode())
        await age(pg_dsn, table, f"old{n}", 3)
    holder = await asyncpg.connect(pg_dsn)
    try:
        transaction = holder.transaction()
        await transaction.start()
        await holder.execute(f"SELECT 1 FROM \"{table}\" WHERE event_id = 'old1' FOR UPDATE")
        with pytest.raises(errors.StoreUnavailable, match="lock timeout"):
            await asyncio.wait_for(sweeper_of(proxy).sweep(), timeout=10)
        # A claim is not held up meanwhile.
        assert (await proxy.post("/short", data=b'{"id": "new"}')).status == 200
        await transaction.rollback()
    finally:
        await holder.close()
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["new", "old0", "old1", "old2"]
    assert await sweeper_of(proxy).sweep() == {"short": 3, "long": 0}
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["new"]


@pytest.mark.slow
async def test_claims_keep_flowing_while_a_million_rows_are_swept(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    rows = 1_000_000
    proxy = await make_proxy(routes=ROUTES)
    await proxy.post("/short", data=b'{"id": "warm-up"}')
    started = time.perf_counter()
    await execute(
        pg_dsn,
        f'INSERT INTO "{table}" (scope, event_id, received_at) '
        f"SELECT 'short', 'old-' || n, now() - interval '2 days' "
        f'FROM generate_series(1, {rows}) AS n; ANALYZE "{table}"',
    )
    filled = time.perf_counter() - started

    sweep = asyncio.create_task(sweeper_of(proxy).sweep())
    latencies = []
    sent = 0
    while not sweep.done() and sent < 2000:
        began = time.perf_counter()
        response = await proxy.post("/long", data=f'{{"id": "live-{sent}"}}'.encode())
        latencies.append(time.perf_counter() - began)
        assert response.status == 200
        sent += 1
    removed = await sweep
    swept = time.perf_counter() - started - filled

    assert removed == {"short": rows, "long": 0}
    assert sent > 0  # claims went through while the sweep ran
    left = await fetch(pg_dsn, f'SELECT count(*) AS n FROM "{table}"')
    assert left[0]["n"] == sent + 1
    latencies.sort()
    print(
        f"\nretention: filled {rows} rows in {filled:.1f}s, swept them in {swept:.1f}s "
        f"(batches of 1000) while {sent} claims went through: claim p50 "
        f"{latencies[len(latencies) // 2] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms"
    )


async def test_the_sweep_covers_the_per_path_scopes_of_a_templated_route(
    make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    routes = [
        {"name": "t", "path": "/hooks/{tenant}", "event_id": "body:/id", "retention": "1d"},
        {"name": "tx", "path": "/tx", "event_id": "body:/id", "retention": "7d"},
    ]
    proxy = await make_proxy(routes=routes)
    for path, event_id in (
        ("/hooks/a", "old"),
        ("/hooks/b", "old2"),
        ("/hooks/a", "new"),
        ("/tx", "old3"),
    ):
        assert (await proxy.post(path, data=f'{{"id": "{event_id}"}}'.encode())).status == 200
    for event_id in ("old", "old2", "old3"):
        await age(pg_dsn, table, event_id, 3)

    removed = await sweeper_of(proxy).sweep()

    assert removed == {"t": 2, "tx": 0}  # "tx" is another scope, not one of "t"'s
    assert [row[:2] for row in await claimed(pg_dsn, table)] == [("t/a", "new"), ("tx", "old3")]
