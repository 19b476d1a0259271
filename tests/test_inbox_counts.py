"""The kept rows' counts beside the claim table (``sql._kept_counts``), which redeliver's cap
reads instead of counting the kept rows at each keep: on a real PostgreSQL, after every kind of
change a kept row goes through, concurrent ones included, they equal the rows' own count and
bytes exactly; a table migrated with kept rows gets them right; the sweeper's fold keeps them."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import asyncpg
from aiohttp import web

from proxy import app_keys, database
from proxy.database import sql
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    execute,
    fetch,
    start_up,
    sweeper_of,
    wait_until,
)

QUICK = {"poll": "100ms", "rate": 1000}
KEPT = {"name": "hooks", "path": "/hooks", "event_id": "body:/id",
        "redeliver": {"schedule": ["1h"], "for": "1d"}}  # fmt: skip
HOOKS = {"name": "hooks", "path": "/hooks", "event_id": "body:/id",
         "redeliver": {"schedule": ["1h"], "for": "1d", "dead_retention": "1d"}}  # fmt: skip
# A templated route: its rows' scopes are per path ("open/a"), its cap the route's.
OPEN = {"name": "open", "path": "/open/{tenant}", "event_id": "body:/id",
        "redeliver": {"schedule": ["1h"], "for": "1d"}}  # fmt: skip
HANDED = {"name": "handed", "path": "/handed", "event_id": "body:/id", "hand_off": "300ms",
          "redeliver": {"schedule": ["1h"], "for": "1d"}}  # fmt: skip


async def release_0_2_0_table(dsn: str, table: str) -> None:
    """The claim table as 0.2.0 made it: the inbox's columns but inbox_size, no counts."""
    types = {name: kind for name, kind in sql.INBOX_TYPES.items() if name != "inbox_size"}
    columns = ", ".join(f"{name} {kind}" for name, kind in types.items())
    await execute(
        dsn,
        f'CREATE TABLE "{table}" (scope text NOT NULL, event_id text NOT NULL, event_type text, '
        "received_at timestamptz NOT NULL DEFAULT now(), body_sha256 bytea, "
        f"answer_status smallint, answer_headers jsonb, answer_body bytea, {columns}, "
        f'PRIMARY KEY (scope, event_id)); CREATE INDEX "{table}_received_at_idx" '
        f'ON "{table}" (received_at); CREATE INDEX "{table}_inbox_idx" ON "{table}" '
        "(inbox_state, inbox_due) WHERE inbox_state IN ('pending', 'dead')",
    )


async def counts(dsn: str, table: str) -> dict[str, tuple[int, int]]:
    """Per scope, the kept rows and bytes the counts hold (their buckets summed; scopes
    summing to nothing left out)."""
    found = await fetch(
        dsn,
        f'SELECT scope, sum(rows)::bigint AS rows, sum(bytes)::bigint AS bytes FROM "{table}_kept" '
        "GROUP BY scope",
    )
    return {r["scope"]: (r["rows"], r["bytes"]) for r in found if (r["rows"], r["bytes"]) != (0, 0)}


async def counted_rows(dsn: str, table: str) -> dict[str, tuple[int, int]]:
    """Per scope, the kept rows and bytes counted from the rows, as ``Statements.keep`` does."""
    found = await fetch(
        dsn,
        f'SELECT scope, count(*) AS rows, sum({sql.stored()})::bigint AS bytes FROM "{table}" '
        "WHERE inbox_state IN ('pending', 'dead') AND left(scope, 1) <> '~' GROUP BY scope",
    )
    return {r["scope"]: (r["rows"], r["bytes"]) for r in found}


async def exact(dsn: str, table: str) -> dict[str, tuple[int, int]]:
    expected = await counted_rows(dsn, table)
    assert await counts(dsn, table) == expected
    return expected


async def _attempts(dsn: str, table: str, event_id: str, n: int) -> bool:
    rows = await fetch(dsn, f'SELECT inbox_attempts FROM "{table}" WHERE event_id = $1', event_id)
    return bool(rows) and len(json.loads(rows[0]["inbox_attempts"] or "[]")) >= n


async def _state(dsn: str, table: str, event_id: str, state: str) -> bool:
    rows = await fetch(dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1', event_id)
    return bool(rows) and rows[0]["inbox_state"] == state


async def test_the_counts_equal_the_kept_rows_after_every_kind_of_change(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    status = {"now": 503}
    upstream.respond = lambda n: web.Response(status=status["now"], text="x" * 50)
    proxy = await make_proxy(routes=[HOOKS, OPEN, HANDED], redeliverer=QUICK)
    store = proxy.app[app_keys.STORE]
    assert store.inbox.counted  # the keeps below read the counts

    for n in range(5):  # kept pending
        assert (await proxy.post("/hooks", data=f'{{"id": "e{n}"}}'.encode())).status == 202
    for tenant in ("a", "b"):
        assert (await proxy.post(f"/open/{tenant}", data=b'{"id": "o"}')).status == 202
    status["now"] = 422  # dead at once
    for n in range(2):
        assert (await proxy.post("/hooks", data=f'{{"id": "d{n}"}}'.encode())).status == 202
    kept = await exact(pg_dsn, table)
    assert {scope: rows for scope, (rows, _) in kept.items()} == {
        "hooks": 7, "open/a": 1, "open/b": 1,
    }  # fmt: skip

    # Failed redeliveries: each row grows by its attempt.
    status["now"] = 503
    before = (await counts(pg_dsn, table))["hooks"]
    await store.inbox.redeliver("hooks", ["e0", "e1"], None, 3600.0)
    for grown_id in ("e0", "e1"):
        await wait_until(functools.partial(_attempts, pg_dsn, table, grown_id, 2), "a failure")
    rows, size = (await exact(pg_dsn, table))["hooks"]
    assert rows == before[0]
    assert size > before[1]

    status["now"] = 200  # a delivery
    await store.inbox.redeliver("hooks", ["e0"], None, 3600.0)
    await wait_until(lambda: _state(pg_dsn, table, "e0", "delivered"), "delivered")
    await exact(pg_dsn, table)

    assert await store.inbox.discard("hooks", ["e2"]) == {"e2"}
    await exact(pg_dsn, table)

    # The dead rows' sweep, past dead_retention.
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET inbox_changed = now() - interval '2 days' WHERE event_id = 'd0'",
    )
    await sweeper_of(proxy).sweep()
    assert not await fetch(pg_dsn, f"SELECT FROM \"{table}\" WHERE event_id = 'd0'")
    await exact(pg_dsn, table)

    # A dead row redelivered: pending again, then delivered.
    await store.inbox.redeliver("hooks", ["d1"], None, 3600.0)
    await wait_until(lambda: _state(pg_dsn, table, "d1", "delivered"), "delivered")
    await exact(pg_dsn, table)

    # Superseded (an ordered route's older version), and forgotten by an operator.
    await fetch(pg_dsn, store.inbox.statements.superseded, "hooks", "e3")
    await exact(pg_dsn, table)
    assert await store.forget("hooks", ["e4"], 1.0) == {"e4"}
    await exact(pg_dsn, table)

    # A hand-off: kept while its attempt is at the app, which then fails it.
    status["now"] = 503
    upstream.gate = asyncio.Event()
    answer = await asyncio.wait_for(proxy.post("/handed", data=b'{"id": "h0"}'), 10)
    assert answer.status == 202
    assert "handed" in await exact(pg_dsn, table)
    upstream.gate.set()
    await wait_until(lambda: _attempts(pg_dsn, table, "h0", 1), "the hand-off's attempt recorded")
    await exact(pg_dsn, table)
    assert set(await counts(pg_dsn, table)) == {"hooks", "open/a", "open/b", "handed"}

    await execute(pg_dsn, f'TRUNCATE "{table}"')
    assert await counts(pg_dsn, table) == {}


async def test_concurrent_keeps_and_changes_from_many_connections_count_exactly(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    proxy = await make_proxy(routes=[HOOKS, OPEN], database={"pool_size": 16})
    assert proxy.app[app_keys.STORE].inbox.counted
    first = [proxy.post("/hooks", data=f'{{"id": "a{n}"}}'.encode()) for n in range(40)]
    assert {a.status for a in await asyncio.gather(*first)} == {202}

    async def churn(worker: int) -> None:
        """Other backends changing kept rows meanwhile, several rows in each transaction (in
        key order, as no two of them deadlock on the rows themselves): a failure's growth, and
        a delivery."""
        connection = await asyncpg.connect(pg_dsn)
        try:
            for turn in range(5):
                delivered = worker * 5 + turn
                grown = {(n * (worker + 3) + turn) % 40 for n in range(4)} - {delivered}
                async with connection.transaction():
                    for n in sorted(grown | {delivered}):
                        await connection.execute(
                            f'UPDATE "{table}" SET inbox_size = inbox_size + $2 WHERE scope = '
                            "'hooks' AND event_id = $1 AND inbox_state = 'pending'"
                            if n in grown
                            else f"UPDATE \"{table}\" SET inbox_state = 'delivered', "
                            "inbox_size = NULL WHERE scope = 'hooks' AND event_id = $1 AND $2 > 0",
                            f"a{n}",
                            worker + 1,
                        )
        finally:
            await connection.close()

    keeps = [
        proxy.post(f"/open/t{n % 5}", data=f'{{"id": "b{n}"}}'.encode()) for n in range(40)
    ] + [proxy.post("/hooks", data=f'{{"id": "c{n}"}}'.encode()) for n in range(40)]
    kept = asyncio.gather(*keeps)
    await asyncio.gather(kept, *(churn(worker) for worker in range(8)))
    assert {a.status for a in kept.result()} == {202}  # no deadlock, no lock wait past the bounds
    expected = await exact(pg_dsn, table)
    assert expected["hooks"][0] == 40 + 40 - 8 * 5
    assert sum(expected[f"open/t{n}"][0] for n in range(5)) == 40


async def test_the_cap_reads_the_counts_and_a_distributed_table_counts_the_rows(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    hooks = {**HOOKS, "redeliver": {"schedule": ["1h"], "for": "1d", "max_pending": 3}}
    proxy = await make_proxy(routes=[hooks])
    store = proxy.app[app_keys.STORE]
    assert (await proxy.post("/hooks", data=b'{"id": "k0"}')).status == 202
    # Counts that say the cap is full (one bucket of a backend gone): the keep believes them.
    await execute(pg_dsn, f"INSERT INTO \"{table}_kept\" VALUES ('hooks', 0, 2, 0)")
    assert (await proxy.post("/hooks", data=b'{"id": "k1"}')).status == 503
    # On Citus (no triggers there) the keep counts the rows themselves: one kept of three.
    store.set_distributed(True)
    assert not store.inbox.counted
    assert (await proxy.post("/hooks", data=b'{"id": "k2"}')).status == 202


async def test_a_table_migrated_with_kept_rows_gets_their_counts(
    proxy_config: Any, pg_dsn: str, table: str
) -> None:
    await release_0_2_0_table(pg_dsn, table)
    await execute(
        pg_dsn,
        f'INSERT INTO "{table}" (scope, event_id, inbox_state, inbox_request, inbox_body, '
        "inbox_attempts) VALUES "
        "('hooks', 'p1', 'pending', '{\"h\": 1}', 'body one', '[]'), "
        "('hooks', 'p2', 'dead', '{\"h\": 22}', 'body two!', '[{\"n\": 1}]'), "
        "('hooks/acme', 'p3', 'pending', '{}', 'b', '[]'), "
        "('hooks', 'p4', 'delivered', NULL, NULL, '[]'), "
        "('~holds', 'hooks', 'pending', '{}', NULL, NULL), "
        "('other', 'p5', 'pending', NULL, 'xyz', NULL)",
    )
    await start_up(proxy_config(routes=[KEPT]))  # create_schema: migrates at start-up

    assert await exact(pg_dsn, table) == {
        "hooks": (2, len('{"h": 1}') + 8 + 2 + len('{"h": 22}') + 9 + len('[{"n": 1}]')),
        "hooks/acme": (1, 2 + 1 + 2),
        "other": (1, 3),
    }
    # Applied again (a later migrate): the triggers are there, the counts left as they are.
    await execute(pg_dsn, f"UPDATE \"{table}\" SET inbox_state = 'dead' WHERE event_id = 'p1'")
    await execute(pg_dsn, sql.for_table(table).schema)
    await exact(pg_dsn, table)
    # Counted again from the rows (deployment.md, "Upgrades"), after counts gone wrong.
    await execute(pg_dsn, f'UPDATE "{table}_kept" SET rows = rows + 5')
    recount = sql.for_table(table).schema_steps[-1]
    await execute(pg_dsn, f'BEGIN; DROP TRIGGER dedup_kept_insert ON "{table}"; {recount}; COMMIT')
    await exact(pg_dsn, table)


async def test_folding_the_buckets_of_backends_gone_keeps_the_sums(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    proxy = await make_proxy(routes=[HOOKS, OPEN])
    store: database.Store = proxy.app[app_keys.STORE]
    for n in range(3):
        assert (await proxy.post("/hooks", data=f'{{"id": "f{n}"}}'.encode())).status == 202
        assert (await proxy.post(f"/open/t{n}", data=b'{"id": "g"}')).status == 202
    # Changes made by backends that are gone by now: their buckets are left behind.
    for n in range(3):
        await execute(
            pg_dsn,
            f"UPDATE \"{table}\" SET inbox_state = 'dead', inbox_size = inbox_size + 7 "
            f"WHERE event_id = 'f{n}'; UPDATE \"{table}\" SET inbox_state = 'discarded' "
            f"WHERE scope = 'open/t{n}'",
        )
    before = await exact(pg_dsn, table)

    async def gone() -> bool:
        found = await fetch(
            pg_dsn,
            f'SELECT count(*) AS n FROM "{table}_kept" WHERE bucket <> 0 AND NOT EXISTS '
            "(SELECT FROM pg_stat_activity WHERE pid = bucket)",
        )
        return bool(found[0]["n"] >= 3 * 2)

    await wait_until(gone, "the backends' end")
    assert await store.fold_kept_counts(2) == 2  # bounded: a batch at a time
    assert await exact(pg_dsn, table) == before
    for _ in range(10):
        if not await store.fold_kept_counts(100):
            break

    left = await fetch(pg_dsn, f'SELECT scope, bucket, rows, bytes FROM "{table}_kept"')
    assert await exact(pg_dsn, table) == before
    live = {r["pid"] for r in await fetch(pg_dsn, "SELECT pid FROM pg_stat_activity")}
    assert all(r["bucket"] == 0 or r["bucket"] in live for r in left)
    # Zero rows are not kept: the per-path scopes all discarded count nothing, and have no row
    # but a live backend's.
    assert not [r for r in left if r["bucket"] == 0 and (r["rows"], r["bytes"]) == (0, 0)]


async def test_a_table_named_too_long_for_the_counts_names_has_none_and_counts_its_rows(
    pg_dsn: str,
) -> None:
    """PostgreSQL cuts a name at 63 bytes: the counts' would be the claim table's own."""
    table = "t" * 60
    try:
        await execute(pg_dsn, sql.for_table(table).schema)
        triggers = await fetch(
            pg_dsn, f"SELECT tgname FROM pg_trigger WHERE tgrelid = to_regclass('{table}')"
        )
        assert triggers == []
        missing = await fetch(pg_dsn, sql.for_table(table).schema_missing)
        assert (missing[0]["inbox"], missing[0]["kept_counts"]) == (True, False)
    finally:
        await execute(pg_dsn, f'DROP TABLE IF EXISTS "{table}"')


async def test_a_replica_running_when_migrate_adds_the_counts_reads_them_from_its_next_sweep(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    steps = sql.for_table(table).schema_steps
    for step in steps[:-1]:  # the table as the release before the counts made it
        await execute(pg_dsn, step)
    proxy = await make_proxy(routes=[HOOKS])
    store = proxy.app[app_keys.STORE]
    assert (await proxy.post("/hooks", data=b'{"id": "m0"}')).status == 202
    assert not store.inbox.counted

    await execute(pg_dsn, steps[-1])  # dedup-proxy migrate
    await sweeper_of(proxy).sweep()

    assert store.inbox.counted
    assert (await proxy.post("/hooks", data=b'{"id": "m1"}')).status == 202
    assert (await exact(pg_dsn, table))["hooks"][0] == 2


async def test_the_counts_made_while_a_transaction_keeps_rows_count_them_once_it_commits(
    pg_dsn: str, table: str
) -> None:
    """The seed waits for the writes in flight (the table's lock): a row kept by a transaction
    still open when the count begins is counted once, by the seed, not missed."""
    steps = sql.for_table(table).schema_steps
    for step in steps[:-1]:
        await execute(pg_dsn, step)
    await execute(
        pg_dsn,
        f'INSERT INTO "{table}" (scope, event_id, inbox_state, inbox_size) VALUES '
        "('hooks', 'w0', 'pending', 10), ('hooks', 'w1', NULL, NULL), ('hooks', 'w2', NULL, NULL)",
    )
    writer = await asyncpg.connect(pg_dsn)
    migrator = await asyncpg.connect(pg_dsn)
    try:
        transaction = writer.transaction()
        await transaction.start()
        await writer.execute(
            f"UPDATE \"{table}\" SET inbox_state = 'pending', inbox_size = 20 WHERE event_id = 'w1'"
        )
        migrate = asyncio.ensure_future(migrator.execute(steps[-1]))
        pid = migrator.get_server_pid()

        async def waiting() -> bool:
            found = await fetch(
                pg_dsn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid
            )
            return bool(found) and found[0]["wait_event_type"] == "Lock"

        await wait_until(waiting, "the migrate waiting for the writer")
        await writer.execute(
            f"UPDATE \"{table}\" SET inbox_state = 'dead', inbox_size = 40 WHERE event_id = 'w2'"
        )
        await transaction.commit()
        await asyncio.wait_for(migrate, 10)
    finally:
        await writer.close()
        await migrator.close()
    assert await exact(pg_dsn, table) == {"hooks": (3, 70)}
