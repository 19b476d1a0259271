"""Least privilege, with real PostgreSQL roles holding exactly the grants docs/deployment.md
names: the sweep and a replay work with them, and a missing grant is named at start-up, on
/readyz and (revoked while running) by a warning and a counter, never a silent re-claim."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy import admin, app_keys, database, errors
from proxy.database import sql
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    claimed,
    execute,
    fetch,
    free_port,
    run_cli,
    start_up,
    sweeper_of,
)
from tests.roles import ANSWERS, DOCUMENTED, limited_role

SWEPT = {"name": "short", "path": "/short", "event_id": "body:/id", "retention": "1d"}
REPLAYED = {"name": "twiml", "path": "/twiml", "event_id": "body:/id", "on_duplicate": "replay"}


@pytest.fixture
async def schema(pg_dsn: str, table: str) -> str:
    """The claim table, created by its owner as ``dedup-proxy migrate`` would."""
    await execute(pg_dsn, sql.for_table(table).schema)
    return table


def limited(dsn: str) -> dict[str, Any]:
    return {"database": {"dsn": dsn, "create_schema": False}}


async def test_the_documented_grants_are_enough_for_the_retention_sweep(
    make_proxy: MakeProxy, pg_dsn: str, schema: str
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED) as (_, dsn):
        proxy = await make_proxy(routes=[SWEPT], sweeper={"batch": 2}, **limited(dsn))
        for n in range(5):
            assert (await proxy.post("/short", data=f'{{"id": "e{n}"}}'.encode())).status == 200
        await execute(
            pg_dsn,
            f"UPDATE \"{schema}\" SET received_at = now() - interval '3 days' "
            "WHERE event_id <> 'e4'",
        )
        store = proxy.app[app_keys.STORE]
        sweeper = sweeper_of(proxy)

        removed = await sweeper.sweep()

        assert removed == {"short": 4}
        assert [row[1] for row in await claimed(pg_dsn, schema)] == ["e4"]
        await store.check()  # and /readyz is content with these grants


async def test_the_sweep_waits_for_a_forget_in_progress_and_passes_over_its_row(
    make_proxy: MakeProxy, pg_dsn: str, schema: str
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED) as (_, dsn):
        proxy = await make_proxy(routes=[SWEPT], **limited(dsn))
        for n in range(3):
            await proxy.post("/short", data=f'{{"id": "old{n}"}}'.encode())
        await execute(pg_dsn, f"UPDATE \"{schema}\" SET received_at = now() - interval '3 days'")
        forget = await asyncpg.connect(pg_dsn)
        try:
            transaction = forget.transaction()
            await transaction.start()
            await forget.execute(f"DELETE FROM \"{schema}\" WHERE event_id = 'old1'")
            sweep = asyncio.create_task(sweeper_of(proxy).sweep())
            await asyncio.sleep(0.2)  # the sweep is now waiting on old1's row lock
            await transaction.commit()
            removed = await asyncio.wait_for(sweep, timeout=10)
        finally:
            await forget.close()
    assert removed == {"short": 2}
    assert await claimed(pg_dsn, schema) == []


async def test_a_replay_route_without_update_on_the_answer_refuses_to_start(
    proxy_config: Any, pg_dsn: str, schema: str
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED) as (role, dsn):
        with pytest.raises(errors.StoreUnavailable) as refused:
            await start_up(proxy_config(routes=[REPLAYED], **limited(dsn)))
    assert refused.value.message == (
        f"table {schema}: role {role} lacks privileges: GRANT UPDATE (answer_status, "
        f'answer_headers, answer_body) ON "{schema}" TO {role} (on_duplicate: replay stores '
        "the app's answer)"
    )


async def test_a_route_without_delete_refuses_to_start_naming_the_grant(
    proxy_config: Any, pg_dsn: str, schema: str
) -> None:
    async with limited_role(pg_dsn, schema, "SELECT, INSERT") as (role, dsn):
        with pytest.raises(errors.StoreUnavailable) as refused:
            await start_up(proxy_config(routes=[SWEPT], **limited(dsn)))
    assert f'GRANT DELETE ON "{schema}" TO {role} (DELETE: the retention sweep' in (
        refused.value.message
    )


async def test_a_schema_without_usage_refuses_to_start_naming_the_grant(
    proxy_config: Any, pg_dsn: str, table: str
) -> None:
    await execute(pg_dsn, f'CREATE SCHEMA "{table}"; {sql.for_table(f"{table}.claims").schema}')
    try:
        async with limited_role(pg_dsn, f"{table}.claims", DOCUMENTED) as (role, dsn):
            settings = {"dsn": dsn, "table": f"{table}.claims", "create_schema": False}
            with pytest.raises(errors.NotPrepared) as refused:
                await start_up(proxy_config(routes=[SWEPT], database=settings))
    finally:
        await execute(pg_dsn, f'DROP SCHEMA "{table}" CASCADE')
    assert refused.value.message == (
        f"table {table}.claims: role {role} lacks USAGE on schema {table}, without which it "
        f"can reach no table there: GRANT USAGE ON SCHEMA {table} TO {role}"
    )


async def test_serve_refuses_to_start_in_one_line_without_a_traceback(
    tmp_path: Path, pg_dsn: str, schema: str, upstream: FakeUpstream
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED) as (role, dsn):
        path = tmp_path / "config.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "listen": f"127.0.0.1:{free_port()}",
                    "upstream": {"url": upstream.url},
                    "database": {"dsn": dsn, "table": schema, "create_schema": False},
                    "admin": {"listen": f"127.0.0.1:{free_port()}"},
                    "log": {"format": "text"},
                    "routes": [REPLAYED],
                }
            )
        )
        code, out, err = await run_cli("serve", "--config", str(path))  # fails if it started
    text = out + err
    assert code == 1, text
    assert "Traceback" not in text
    assert f'answer_headers, answer_body) ON "{schema}" TO {role} (on_duplicate' in text
    assert "s3cret-pw" not in text


async def test_the_grants_the_docs_name_for_replay_replay_the_answer(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, schema: str
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED, ANSWERS) as (_, dsn):
        proxy = await make_proxy(routes=[REPLAYED, SWEPT], **limited(dsn))
        first = await proxy.post("/twiml", data=b'{"id": "SM1"}')
        again = await proxy.post("/twiml", data=b'{"id": "SM1"}')
        removed = await sweeper_of(proxy).sweep()

    assert (first.status, again.status) == (200, 200)
    assert await again.read() == await first.read() == b"processed\x00bytes"
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.requests) == 1
    registry = proxy.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_replays_total", {"route": "twiml"}) == 1
    assert removed == {"twiml": 0, "short": 0}


async def test_an_answer_the_role_may_no_longer_store_is_a_warning_and_counted(
    make_proxy: MakeProxy,
    aiohttp_client: Any,
    upstream: FakeUpstream,
    pg_dsn: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED, ANSWERS) as (role, dsn):
        proxy = await make_proxy(routes=[REPLAYED], **limited(dsn))
        probe = await aiohttp_client(admin.create_admin_app(proxy.app))
        assert (await probe.get("/readyz")).status == 200
        await execute(pg_dsn, f'REVOKE {ANSWERS} ON "{schema}" FROM {role}')

        ready = await probe.get("/readyz")
        with caplog.at_level(logging.INFO):
            first = await proxy.post("/twiml", data=b'{"id": "SM2"}')
        again = await proxy.post("/twiml", data=b'{"id": "SM2"}')
        scraped = await (await probe.get("/metrics")).text()

    # The claims go on: not an outage, only the answers are not stored.
    assert (ready.status, await ready.json()) == (200, {"status": "ready"})
    assert first.status == 200
    # The claim was committed, without its answer: the duplicate is acknowledged, not
    # forwarded again, and not replayed.
    assert len(upstream.requests) == 1
    assert (again.status, again.headers["Dedup-Status"]) == (200, "duplicate")
    assert "Idempotent-Replayed" not in again.headers
    rows = await fetch(pg_dsn, f'SELECT event_id, answer_status FROM "{schema}"')
    assert [tuple(row) for row in rows] == [("SM2", None)]
    warnings = [r for r in caplog.records if r.name == "proxy.database.claim"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert "permission denied for table" in warnings[0].getMessage()
    assert database.GRANT_ANSWER_HINT in warnings[0].getMessage()
    lines = [r.fields for r in caplog.records if hasattr(r, "fields")]
    assert not any(line.get("reconciled") for line in lines)
    assert "answer_store_error" in lines[0]
    counted = {
        (s.name, s.labels.get("route")): s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
    }
    assert counted[("dedup_answer_store_failures_total", "twiml")] == 1
    missing = {
        s.labels["grant"]: s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "dedup_database_grant_missing"
    }
    assert missing == {"delete": 0, "update_answers": 1, "update_inbox": 0}


async def test_a_revoked_delete_keeps_readyz_up_and_is_logged_and_measured(
    make_proxy: MakeProxy,
    aiohttp_client: Any,
    upstream: FakeUpstream,
    pg_dsn: str,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """DELETE serves the sweep and forget, not a claim: a role without it any more keeps
    taking webhooks; the sweep fails, the log says which GRANT, the gauge says it until then."""

    def missing(scraped: str) -> dict[str, float]:
        return {
            s.labels["grant"]: s.value
            for family in text_string_to_metric_families(scraped)
            for s in family.samples
            if s.name == "dedup_database_grant_missing"
        }

    async with limited_role(pg_dsn, schema, DOCUMENTED) as (role, dsn):
        proxy = await make_proxy(routes=[SWEPT], **limited(dsn))
        probe = await aiohttp_client(admin.create_admin_app(proxy.app))
        assert (await probe.get("/readyz")).status == 200
        before = missing(await (await probe.get("/metrics")).text())
        await execute(pg_dsn, f'REVOKE DELETE ON "{schema}" FROM {role}')

        with caplog.at_level(logging.INFO):
            ready = await probe.get("/readyz")
            posted = await proxy.post("/short", data=b'{"id": "d1"}')
        revoked = missing(await (await probe.get("/metrics")).text())
        with pytest.raises(errors.PermissionDenied):
            await sweeper_of(proxy).sweep()
        await execute(pg_dsn, f'GRANT DELETE ON "{schema}" TO {role}')
        assert (await probe.get("/readyz")).status == 200
        again = missing(await (await probe.get("/metrics")).text())

    assert (ready.status, await ready.json()) == (200, {"status": "ready"})
    assert posted.status == 200
    assert before == again == {"delete": 0, "update_answers": 0, "update_inbox": 0}
    assert revoked == {"delete": 1, "update_answers": 0, "update_inbox": 0}
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == (
        f'table {schema}: role {role} lacks privileges: GRANT DELETE ON "{schema}" TO {role} '
        "(DELETE: the retention sweep and events forget); claims go on, and only what needs it "
        "fails until it is granted (dedup_database_grant_missing)"
    )
