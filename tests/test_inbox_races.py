"""The inbox's statements against each other on a real PostgreSQL, one transaction held open
where the race needs it: the sweep never removes a row an operator is making pending, and a
bulk redeliver passes over a row a lane holds instead of failing, and a lane passes over a row
another lane holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import asyncpg
import pytest

from proxy.database import inbox, inbox_sql, sql

DEAD_LONG_AGO = (
    "INSERT INTO {t} (scope, event_id, received_at, inbox_state, inbox_body, inbox_request, "
    "inbox_attempts, inbox_failures, inbox_changed, inbox_due) VALUES "
    "('hooks', $1, now() - interval '40 days', $2, 'BODY', "
    '\'{{"route":"hooks","upstream":"http://127.0.0.1:9","method":"POST",'
    '"target":"/hooks","headers":[]}}\', \'[]\', 3, '
    "now() - interval '31 days', now() - interval '1 minute')"
)


@pytest.fixture
async def two(
    pg_dsn: str, table: str
) -> AsyncIterator[tuple[asyncpg.Connection, asyncpg.Connection]]:
    a, b = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    await a.execute(sql.for_table(table).schema)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_the_dead_sweep_spares_a_row_an_operator_makes_pending_meanwhile(
    two: tuple[asyncpg.Connection, asyncpg.Connection], table: str
) -> None:
    operator, sweeper = two
    queries = sql.for_table(table)
    statements = inbox_sql.Statements(queries.quoted)
    await operator.execute(DEAD_LONG_AGO.format(t=queries.quoted), "e1", "dead")
    async with operator.transaction():  # events redeliver, not committed yet
        changed = await operator.fetch(statements.redeliver, "hooks", ["e1"], 86400.0)
        assert [row["event_id"] for row in changed] == ["e1"]
        sweep = asyncio.create_task(
            sweeper.execute(statements.sweep_dead, "hooks", 30 * 86400.0, 100)
        )
        await asyncio.sleep(0.3)
        assert not sweep.done()  # waiting for the operator's row

    assert await sweep == "DELETE 0"
    state = await operator.fetchval(f"SELECT inbox_state FROM {queries.quoted}")
    assert state == "pending"


async def test_a_bulk_redeliver_passes_over_a_row_being_redelivered(
    two: tuple[asyncpg.Connection, asyncpg.Connection], table: str
) -> None:
    lane, operator = two
    queries = sql.for_table(table)
    for event_id in ("p1", "p2", "p3"):
        await lane.execute(DEAD_LONG_AGO.format(t=queries.quoted), event_id, "pending")
    lanes, operators = _inbox(lane, queries), _inbox(operator, queries)
    async with lanes.take(["hooks"]) as taken:  # a lane holds p1 while the app works on it
        assert taken is not None
        assert taken.event_id == "p1"
        changed = await asyncio.wait_for(
            operators.redeliver("hooks", None, None, 86400.0, state=inbox.InboxState.PENDING), 5
        )

    assert sorted(changed) == [("hooks", "p2"), ("hooks", "p3")]


@pytest.mark.parametrize("distributed", [False, True], ids=["one-statement", "citus-by-key"])
async def test_a_second_lane_takes_the_next_due_row_while_the_first_is_held(
    two: tuple[asyncpg.Connection, asyncpg.Connection], table: str, pg_dsn: str, distributed: bool
) -> None:
    """Each way ``take`` locks (one statement a page; on Citus, one key at a time), oldest
    first."""
    first, second = two
    third = await asyncpg.connect(pg_dsn)
    queries = sql.for_table(table)
    for event_id in ("p1", "p2"):
        await first.execute(DEAD_LONG_AGO.format(t=queries.quoted), event_id, "pending")
    try:
        async with (
            _inbox(first, queries, distributed).take(["hooks"]) as held,
            _inbox(second, queries, distributed).take(["hooks"]) as next_one,
            _inbox(third, queries, distributed).take(["hooks"]) as none_left,
        ):
            assert held is not None
            assert next_one is not None
            assert (held.event_id, next_one.event_id) == ("p1", "p2")
            assert none_left is None  # both due rows are held
    finally:
        await third.close()


@pytest.mark.parametrize("distributed", [False, True], ids=["one-statement", "citus-by-key"])
async def test_past_a_page_of_held_rows_a_lane_takes_the_next_page(
    two: tuple[asyncpg.Connection, asyncpg.Connection],
    table: str,
    monkeypatch: pytest.MonkeyPatch,
    distributed: bool,
) -> None:
    """The rows being redelivered are the oldest due ones until they end: with more of them
    held than a take reads at once (here 1), the next page is read rather than none taken."""
    monkeypatch.setattr(inbox, "CANDIDATES", 1)
    first, second = two
    queries = sql.for_table(table)
    for event_id in ("p1", "p2"):
        await first.execute(DEAD_LONG_AGO.format(t=queries.quoted), event_id, "pending")
    async with (
        _inbox(first, queries, distributed).take(["hooks"]) as held,
        _inbox(second, queries, distributed).take(["hooks"]) as next_one,
    ):
        assert held is not None
        assert next_one is not None
        assert (held.event_id, next_one.event_id) == ("p1", "p2")


def _inbox(
    connection: asyncpg.Connection, queries: sql.Queries, distributed: bool = False
) -> inbox.Inbox:
    """The store's inbox over one connection (each take its own transaction on it), as on a
    table Citus distributes or not (the SQL is plain PostgreSQL's either way)."""

    @contextlib.asynccontextmanager
    async def acquire() -> AsyncIterator[asyncpg.Connection]:
        yield connection

    store_inbox = inbox.Inbox(queries.quoted, acquire, sql.begin(1, 60), 5)
    store_inbox.set_distributed(distributed, sql.begin(1, 60))
    return store_inbox
