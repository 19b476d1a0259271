"""The statements, on a real PostgreSQL: the claim's literals whatever the session's settings,
the schema check of a schema-qualified table."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from proxy import database
from proxy.database import sql


@pytest.fixture
async def connection(pg_dsn: str) -> AsyncIterator[asyncpg.Connection[asyncpg.Record]]:
    connection = await asyncpg.connect(pg_dsn)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.mark.parametrize("conforming", ["on", "off"])
async def test_the_claim_stores_quotes_and_backslashes_whatever_the_session_reads_them_as(
    connection: asyncpg.Connection[asyncpg.Record], table: str, conforming: str
) -> None:
    queries = sql.for_table(table)
    await database.apply_schema(connection, queries)
    # A server connection PgBouncer hands over may carry another client's session settings.
    await connection.execute(f"SET standard_conforming_strings = {conforming}")
    begin = sql.begin(1, 1)
    event_id, event_type = "a'b\\c\\\\'", "t\\'"

    claimed = await connection.execute(queries.claim(begin, "s", event_id, event_type, b"\1" * 32))
    await connection.execute("COMMIT")
    statuses = []
    for body in (b"\1", b"\2"):  # a copy with the same body, then one with another
        statuses.append(
            await connection.execute(queries.claim(begin, "s", event_id, None, body * 32))
        )
        statuses.append(await connection.execute(queries.duplicate("s", event_id, body * 32)))

    assert claimed == "INSERT 0 1"
    assert statuses == ["INSERT 0 0", "SELECT 0", "INSERT 0 0", "SELECT 1"]
    rows = await connection.fetch(f"SELECT event_id, event_type, body_sha256 FROM {table}")
    assert [tuple(row) for row in rows] == [(event_id, event_type, b"\1" * 32)]


async def test_a_schema_qualified_table_is_created_and_then_found_complete(
    connection: asyncpg.Connection[asyncpg.Record],
) -> None:
    schema = f"s_{uuid.uuid4().hex[:12]}"
    queries = sql.for_table(f"{schema}.claims")
    await connection.execute(f"CREATE SCHEMA {schema}")
    try:
        before = await database.missing_schema(connection, queries)
        await database.apply_schema(connection, queries)
        after = await database.missing_schema(connection, queries)
        await connection.execute(f"DROP INDEX {schema}.claims_received_at_idx")
        without_index = await database.missing_schema(connection, queries)
    finally:
        await connection.execute(f"DROP SCHEMA {schema} CASCADE")
    assert (before, after) == ("does not exist", "")
    assert without_index == "lacks index on received_at"


async def test_a_claim_on_a_distributed_table_reads_the_same_whatever_the_session_reads(
    connection: asyncpg.Connection[asyncpg.Record], table: str
) -> None:
    """On Citus the claim's values travel to a worker as literals for the coordinator's
    standard_conforming_strings: the claim's BEGIN sets it on, and its statement bound
    (``sql.begin(distributed=True)``); on one PostgreSQL the claim must read the same."""
    queries = sql.for_table(table)
    await database.apply_schema(connection, queries)
    await connection.execute("SET standard_conforming_strings = off")
    begin = sql.begin(1, 1, distributed=True)
    event_id = "a'b\\c"

    assert "SET LOCAL standard_conforming_strings = on" in begin
    assert "SET LOCAL statement_timeout = '1250ms'" in begin
    assert await connection.execute(queries.claim(begin, "s", event_id, None, b"\1" * 32)) == (
        "INSERT 0 1"
    )
    assert await connection.fetchval("SHOW standard_conforming_strings") == "on"
    await connection.execute("COMMIT")
    assert await connection.fetchval("SHOW standard_conforming_strings") == "off"
    rows = await connection.fetch(f'SELECT event_id FROM "{table}"')
    assert [row["event_id"] for row in rows] == [event_id]
