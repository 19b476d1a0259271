"""The claim store against a real PostgreSQL: connection settings, schema, outages, exhaustion;
the one translation of database errors."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Callable

import pytest

from proxy import app_keys, config, database, embedded, errors
from proxy.database import inbox_sql, sql
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    claimed,
    event,
    execute,
    fetch,
    logged_errors,
    start_up,
)


async def test_connections_bound_lock_waits_and_abandoned_transactions(
    pg_dsn: str, table: str
) -> None:
    settings = config.DatabaseConfig(dsn=None, table=table, pool_size=1)
    store = await database.Store.open(pg_dsn, settings, claim_wait=1.5, upstream_timeout=30.0)
    try:
        await store.ensure_schema()
        async with store.claim(database.Key("s", "e1", None, b"\x00" * 32)) as claim:
            assert claim.acquired
            rows = await fetch(
                pg_dsn,
                "SELECT state, application_name FROM pg_stat_activity "
                "WHERE application_name = 'dedup-proxy' AND state LIKE 'idle in transaction%' "
                "AND datname = current_database()",
            )
            assert len(rows) == 1  # the claim is held open while the upstream would be called
            setting = await claim._connection.fetch(
                "SELECT name, setting FROM pg_settings WHERE name IN "
                "('lock_timeout', 'idle_in_transaction_session_timeout', 'transaction_isolation')"
            )
        values = {row["name"]: row["setting"] for row in setting}
        assert values["lock_timeout"] == "1500"
        # Above the upstream timeout, so only a vanished proxy's claim is cut off.
        assert int(values["idle_in_transaction_session_timeout"]) > 30_000
        assert values["transaction_isolation"] == "read committed"
        # Not committed: released.
        assert await claimed(pg_dsn, table) == []
    finally:
        await store.close()


async def test_schema_creation_is_idempotent_and_safe_for_concurrent_replicas(
    pg_dsn: str, table: str
) -> None:
    settings = config.DatabaseConfig(dsn=None, table=table, pool_size=1)
    stores = await asyncio.gather(
        *(database.Store.open(pg_dsn, settings, claim_wait=1, upstream_timeout=1) for _ in range(4))
    )
    try:
        await asyncio.gather(*(store.ensure_schema() for store in stores))
        await stores[0].ensure_schema()
    finally:
        await asyncio.gather(*(store.close() for store in stores))
    columns = await fetch(
        pg_dsn,
        "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
        "WHERE table_name = $1 ORDER BY ordinal_position",
        table,
    )
    assert [(c["column_name"], c["data_type"], c["is_nullable"]) for c in columns] == [
        ("scope", "text", "NO"),
        ("event_id", "text", "NO"),
        ("event_type", "text", "YES"),
        ("received_at", "timestamp with time zone", "NO"),
        ("body_sha256", "bytea", "YES"),
        ("answer_status", "smallint", "YES"),
        ("answer_headers", "jsonb", "YES"),
        ("answer_body", "bytea", "YES"),
        ("inbox_state", "text", "YES"),
        ("inbox_request", "jsonb", "YES"),
        ("inbox_body", "bytea", "YES"),
        ("inbox_attempts", "jsonb", "YES"),
        ("inbox_failures", "integer", "YES"),
        ("inbox_due", "timestamp with time zone", "YES"),
        ("inbox_until", "timestamp with time zone", "YES"),
        ("inbox_changed", "timestamp with time zone", "YES"),
        ("inbox_size", "integer", "YES"),
    ]
    indexes = await fetch(pg_dsn, "SELECT indexdef FROM pg_indexes WHERE tablename = $1", table)
    definitions = sorted(row["indexdef"] for row in indexes)
    assert any("(scope, event_id)" in d and "UNIQUE" in d for d in definitions)
    assert any("(received_at)" in d for d in definitions)
    # The inbox's: only the rows it keeps (redeliver), so it costs the other claims nothing.
    assert any(
        "(inbox_state, inbox_due)" in d and "WHERE (inbox_state = ANY" in d for d in definitions
    )


async def test_missing_table_without_create_schema_fails_start_up(
    proxy_config: Callable[..., config.Config], table: str
) -> None:
    with pytest.raises(errors.StoreUnavailable, match=f"table {table}: does not exist"):
        await start_up(proxy_config(database={"create_schema": False}))


async def test_database_outage_fails_closed_then_recovers_without_restart(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    own_server: embedded.EmbeddedPostgres,
    table: str,
) -> None:
    dsn = own_server.start()  # already running: returns its DSN
    client = await make_proxy(database={"dsn": dsn, "pool_size": 2})
    assert (await client.post("/webhooks/corvel", data=event("before"))).status == 200

    await asyncio.to_thread(own_server.stop)
    during = await client.post("/webhooks/corvel", data=event("during"))

    assert during.status == 503
    assert during.headers["Retry-After"] == "5"
    assert (await during.json())["error"] == "store_unavailable"
    assert len(upstream.requests) == 1  # fail closed: nothing forwarded unclaimed

    await asyncio.to_thread(own_server.start)
    after = await client.post("/webhooks/corvel", data=event("during"))

    assert after.status == 200
    assert "Dedup-Status" not in after.headers
    assert len(upstream.requests) == 2
    assert [row[1] for row in await claimed(dsn, table)] == ["before", "during"]


async def test_pool_exhaustion_gives_503_after_pool_timeout(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No claim at the app can take the last connection (the limit at the app leaves none to
    claims beyond the pool): here something else holds it (a sweep, a slow read), and a
    webhook waits pool_timeout for it, then 503."""
    client = await make_proxy(database={"pool_size": 1, "pool_timeout": "300ms"})
    store = client.app[app_keys.STORE]
    await store.started.wait()
    async with store._connection():  # the pool's one connection, lent out
        second = await client.post("/webhooks/corvel", data=event("another-event"))

    assert second.status == 503
    body = await second.json()
    assert body["error"] == "store_unavailable"
    assert body["message"] == "No database connection is free; try again later."
    assert "no free database connection within 0.3s (pool_size 1)" in logged_errors(caplog)[0]
    assert upstream.requests == []
    assert (await client.post("/webhooks/corvel", data=event("after"))).status == 200
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["after"]


async def test_a_replica_starting_under_traffic_takes_no_table_lock(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    first = await make_proxy(claim_wait="1s")
    held = asyncio.create_task(first.post("/webhooks/corvel", data=event("in-flight")))
    await upstream.arrived.wait()
    try:
        # Running the DDL again (CREATE INDEX / ALTER TABLE, even IF NOT EXISTS) would queue
        # behind the open claim, time out at claim_wait and fail the start-up.
        second = await make_proxy(claim_wait="1s")
    finally:
        upstream.gate.set()
    assert (await held).status == 200
    response = await second.post("/webhooks/corvel", data=event("other"))
    assert response.status == 200
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["in-flight", "other"]


async def test_a_claim_cancelled_during_its_rollback_gives_its_connection_back(
    pg_dsn: str, table: str, proxy_config: Callable[..., config.Config]
) -> None:
    cfg = proxy_config(database={"pool_size": 1, "pool_timeout": "2s"})
    store = await database.Store.open(
        pg_dsn, cfg.database, claim_wait=cfg.claim_wait, upstream_timeout=cfg.upstream.timeout
    )
    try:
        await store.ensure_schema()
        key = database.Key("corvel", "evt_cancel", None, b"\0" * 32)
        holding = asyncio.Event()

        async def claim_then_wait() -> None:
            async with store.claim(key):
                holding.set()
                await asyncio.Event().wait()  # an upstream call that never ends

        task = asyncio.create_task(claim_then_wait())
        await holding.wait()
        task.cancel()  # leaves the claim: ROLLBACK is sent...
        await asyncio.sleep(0)
        task.cancel()  # ...and cancelled too, as a shutdown past its timeout does
        with pytest.raises(asyncio.CancelledError):
            await task

        # The only connection is free again, and the claim it held is gone with it.
        async with asyncio.timeout(5), store.claim(key) as again:
            assert again.acquired
    finally:
        await store.close()


def test_a_database_error_becomes_store_unavailable_after_the_clean_up() -> None:
    cleaned: list[str] = []
    with (
        pytest.raises(errors.StoreUnavailable) as raised,
        database.translated("claim failed", lambda: cleaned.append("closed")),
    ):
        raise TimeoutError
    assert raised.value.message == "claim failed: TimeoutError"
    assert isinstance(raised.value.__cause__, TimeoutError)
    assert cleaned == ["closed"]

    with (
        pytest.raises(errors.StoreUnavailable, match=r"^query failed: ConnectionRefusedError: "),
        database.translated("query failed"),
    ):
        raise ConnectionRefusedError(111, "Connect call failed")


@pytest.mark.parametrize("error", [errors.ClaimWaitExceeded(), ValueError("a bug")])
def test_errors_already_translated_or_not_the_databases_pass_through(error: Exception) -> None:
    cleaned: list[str] = []
    with (
        pytest.raises(type(error)) as raised,
        database.translated("x", lambda: cleaned.append("!")),
    ):
        raise error
    assert raised.value is error
    assert cleaned == []


async def test_a_claim_ends_by_one_named_step_only(pg_dsn: str, table: str) -> None:
    """Each step ends the claim's transaction; a second step, or the wrong one for the claim,
    is a programming error, raised before any statement is sent."""
    settings = config.DatabaseConfig(dsn=None, table=table, pool_size=1)
    store = await database.Store.open(pg_dsn, settings, claim_wait=1, upstream_timeout=5)
    key = database.Key("s", "once", None, b"\x01" * 32)
    try:
        await store.ensure_schema()
        async with store.claim(key) as claim:
            assert claim.acquired
            with pytest.raises(RuntimeError, match="no duplicate"):
                await claim.settle_duplicate()
            assert await claim.commit() == database.Commit()
            assert claim.state == "committed"
            with pytest.raises(RuntimeError, match="committed already"):
                await claim.commit()
        async with store.claim(key) as copy:
            assert not copy.acquired
            with pytest.raises(RuntimeError, match="cannot be committed"):
                await copy.commit()
            assert await copy.settle_duplicate(read_answer=True) == database.Duplicate(False, None)
            assert copy.state == "settled"
        other = database.Key("s", "once", None, b"\x02" * 32)
        async with store.claim(other) as copy:
            assert await copy.settle_duplicate() == database.Duplicate(True, None)
        async with store.claim(database.Key("s", "released", None, b"\x03" * 32)) as claim:
            await claim.release()
            assert claim.state == "released"
        # One connection, back in the pool after each: none was left in doubt.
        assert store.pool_stats()[:2] == (1, 1)
        assert [row[1] for row in await claimed(pg_dsn, table)] == ["once"]
    finally:
        await store.close()


# 100,000 GitHub claims as a route with verify stores them: three hooks, each delivery's GUID
# bound to a digest of its body (``<hook>:<GUID>~<32 hex digits>``), and one hook's GUID also
# under a second hook (GitHub sends one delivery to each hook subscribed).
GITHUB_ROWS = (
    'INSERT INTO "{table}" (scope, event_id, received_at) '
    "SELECT 'github', (n % 3 + 100)::text || ':' || md5(n::text)::uuid::text || '~' "
    "|| md5('body' || n), now() - make_interval(secs => n) FROM generate_series(1, 100000) AS n; "
    'INSERT INTO "{table}" (scope, event_id) '
    "SELECT 'github', '999:' || md5('7')::uuid::text || '~' || md5('other'); "
    'ANALYZE "{table}"'
)


async def test_a_github_guid_alone_names_its_claim_by_the_last_part_index(
    pg_dsn: str, table: str
) -> None:
    """An operator gives a GitHub delivery's GUID as GitHub shows it, without the hook ID: it
    names its claim (bound to the body) through the last part's index, not a scan of the
    scope's 100,000 rows; a GUID under two hooks names both, for the operator to pick from."""
    settings = config.DatabaseConfig(dsn=None, table=table, pool_size=1)
    store = await database.Store.open(pg_dsn, settings, claim_wait=1, upstream_timeout=1)
    try:
        await store.ensure_schema()
        await execute(pg_dsn, GITHUB_ROWS.format(table=table))
        guid = str(uuid.UUID(hashlib.md5(b"42").hexdigest()))
        twice = str(uuid.UUID(hashlib.md5(b"7").hexdigest()))
        stored = f"100:{guid}~{hashlib.md5(b'body42').hexdigest()}"
        found = await store.resolve("github", [guid, f"100:{guid}", twice, "nope"], last_part=True)
        plain = await store.resolve("github", [guid])
    finally:
        await store.close()
    assert found[guid] == found[f"100:{guid}"] == database.Resolved(stored)
    assert found[twice].stored == ""
    assert [c.partition("~")[0] for c in found[twice].candidates] == [
        f"101:{twice}",
        f"999:{twice}",
    ]
    assert found["nope"] == database.Resolved("")
    assert plain[guid] == database.Resolved("")  # a route whose ID is not composite

    queries = sql.for_table(table)
    statements = inbox_sql.Statements(queries.quoted)
    for statement, args in (
        (queries.resolve_last_part, ("github", guid)),
        (statements.lookup_last_part, (["github", "stripe"], guid)),
    ):
        plan = "\n".join(r[0] for r in await fetch(pg_dsn, f"EXPLAIN {statement}", *args))
        assert f"{table}_last_part_idx" in plan, plan
        assert "Seq Scan" not in plan, plan
