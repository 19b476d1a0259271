"""The inbox (``redeliver``) with least privilege, on real PostgreSQL roles: the grant it needs
is named at start-up, and with it a failed delivery is kept, locked and redelivered."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from proxy import app_keys, config, errors
from proxy.database import inbox, sql
from tests.helpers import FakeUpstream, MakeProxy, execute, fetch, start_up, wait_until
from tests.roles import DOCUMENTED, INBOX, limited_role

KEPT = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "redeliver": {"schedule": ["200ms"], "for": "1d"},
}


@pytest.fixture
async def schema(pg_dsn: str, table: str) -> str:
    await execute(pg_dsn, sql.for_table(table).schema)
    return table


def test_the_documented_grant_names_every_inbox_column() -> None:
    assert inbox.GRANT_HINT.removeprefix("GRANT ") == INBOX


async def test_without_the_inbox_grant_the_proxy_refuses_to_start_naming_it(
    proxy_config: object, pg_dsn: str, schema: str
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED) as (role, dsn):
        cfg = proxy_config(  # type: ignore[operator]
            routes=[KEPT], database={"dsn": dsn, "create_schema": False}
        )
        with pytest.raises(errors.StoreUnavailable) as refused:
            await start_up(cfg)
    assert f'{inbox.GRANT_HINT} ON "{schema}" TO {role}' in refused.value.message
    assert "FOR UPDATE needs it" in refused.value.message


async def test_a_role_with_0_2_0s_inbox_grant_is_told_to_grant_inbox_size_too(
    proxy_config: object, pg_dsn: str, schema: str
) -> None:
    granted = INBOX.replace(", inbox_size", "")  # 0.2.0's documented grant
    assert granted != INBOX
    async with limited_role(pg_dsn, schema, DOCUMENTED, granted) as (role, dsn):
        cfg = proxy_config(  # type: ignore[operator]
            routes=[KEPT], database={"dsn": dsn, "create_schema": False}
        )
        with pytest.raises(errors.StoreUnavailable) as refused:
            await start_up(cfg)
    assert f'{inbox.GRANT_HINT} ON "{schema}" TO {role}' in refused.value.message
    assert "inbox_size" in inbox.GRANT_HINT


async def test_with_the_documented_grants_a_failure_is_kept_and_redelivered(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, schema: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503 if n == 0 else 200)
    async with limited_role(pg_dsn, schema, DOCUMENTED, INBOX, counts=True) as (_, dsn):
        proxy = await make_proxy(
            routes=[KEPT],
            redeliverer={"poll": "100ms"},
            database={"dsn": dsn, "create_schema": False},
        )
        first = await proxy.post("/hooks", data=b'{"id": "p1"}')
        assert (first.status, first.headers["Dedup-Status"]) == (202, "queued")

        async def delivered() -> bool:
            rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{schema}"')
            return [r["inbox_state"] for r in rows] == ["delivered"]

        await wait_until(delivered, "the redelivery, as the limited role")
        assert len(upstream.requests) == 2
        rows = await fetch(pg_dsn, f'SELECT inbox_attempts FROM "{schema}"')
        assert [a["status"] for a in json.loads(rows[0]["inbox_attempts"])] == [503, 200]


async def test_without_select_on_the_kept_rows_counts_the_proxy_refuses_to_start_naming_it(
    proxy_config: object, pg_dsn: str, schema: str
) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED, INBOX) as (role, dsn):
        cfg = proxy_config(  # type: ignore[operator]
            routes=[KEPT], database={"dsn": dsn, "create_schema": False}
        )
        with pytest.raises(errors.StoreUnavailable) as refused:
            await start_up(cfg)
    assert refused.value.message == (
        f'table {schema}: role {role} lacks privileges: GRANT SELECT ON "{schema}_kept" TO '
        f"{role} (redeliver's cap reads the kept rows' counts there instead of counting the "
        "rows at each keep)"
    )


async def test_the_counts_are_kept_by_a_role_that_may_only_read_them(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, schema: str
) -> None:
    """The triggers write the counts as their owner: the proxy's role needs no grant to write
    them, and a proxy of the release before them, running while a migrate adds them, none."""
    upstream.respond = lambda n: web.Response(status=503 if n < 2 else 200)
    async with limited_role(pg_dsn, schema, DOCUMENTED, INBOX, counts=True) as (_, dsn):
        proxy = await make_proxy(
            routes=[KEPT], redeliverer={"poll": "100ms"},
            database={"dsn": dsn, "create_schema": False},
        )  # fmt: skip
        assert proxy.app[app_keys.STORE].inbox.counted
        for n in range(2):
            assert (await proxy.post("/hooks", data=f'{{"id": "r{n}"}}'.encode())).status == 202
        kept = f'SELECT sum(rows) AS n FROM "{schema}_kept"'
        assert (await fetch(pg_dsn, kept))[0]["n"] == 2

        async def delivered() -> bool:
            return (await fetch(pg_dsn, kept))[0]["n"] == 0

        await wait_until(delivered, "both delivered, and uncounted, as the limited role")


async def test_a_route_without_redeliver_needs_no_inbox_grant(
    proxy_config: object, pg_dsn: str, schema: str
) -> None:
    plain = {key: value for key, value in KEPT.items() if key != "redeliver"}
    async with limited_role(pg_dsn, schema, DOCUMENTED) as (_, dsn):
        cfg: config.Config = proxy_config(  # type: ignore[operator]
            routes=[plain], database={"dsn": dsn, "create_schema": False}
        )
        await start_up(cfg)


async def test_a_grant_revoked_while_running_relays_the_failure_and_counts_it(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, schema: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503, text="down")
    async with limited_role(pg_dsn, schema, DOCUMENTED, INBOX, counts=True) as (role, dsn):
        proxy = await make_proxy(
            routes=[KEPT],
            redeliverer={"poll": "100ms"},
            database={"dsn": dsn, "create_schema": False},
        )
        await execute(pg_dsn, f'REVOKE {INBOX} ON "{schema}" FROM {role}')

        answer = await proxy.post("/hooks", data=b'{"id": "r1"}')

        assert (answer.status, await answer.text()) == (503, "down")  # relayed, as without
        assert await fetch(pg_dsn, f'SELECT event_id FROM "{schema}"') == []  # released
        registry = proxy.app[app_keys.METRICS].registry
        labels = {"route": "hooks"}
        assert registry.get_sample_value("dedup_inbox_keep_failures_total", labels) == 1
        assert registry.get_sample_value("dedup_inbox_full_total", labels) == 0
