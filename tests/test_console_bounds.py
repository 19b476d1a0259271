"""What a console page may cost (``proxy.console``, ``Inbox.show``, ``Inbox.browse``), over a
real PostgreSQL: an event's page reads 64 KiB of a kept body of 20 MiB, a body filter over large
kept bodies reads none of them into the proxy, one console request at a time per worker (the
next answered 503 once it has waited), and only the configured routes' rows listed and shown.
Memory is measured with tracemalloc around one request (the client, the console and asyncpg
in this process): what the proxy read, not how long it took.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import tracemalloc
from collections.abc import Awaitable
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import app_keys, console, database
from proxy.database import inbox_sql, sql
from tests.helpers import FakeUpstream, MakeProxy, admin_client, execute, fetch, wait_until

KEPT = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "event_type": "body:/type",
    "redeliver": {"schedule": ["1h"], "for": "1d"},
}
MIB = 1024 * 1024


async def _start(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> tuple[TestClient[Any, Any], TestClient[Any, Any]]:
    proxy = await make_proxy(routes=[KEPT])
    upstream.respond = lambda n: web.Response(status=503)
    return proxy, await admin_client(aiohttp_client, proxy)


async def _kept(proxy: TestClient[Any, Any], *event_ids: str) -> None:
    for event_id in event_ids:
        body = json.dumps({"id": event_id, "type": "charge.failed"})
        async with proxy.post("/hooks", data=body) as answer:
            assert answer.status == 202, await answer.text()


async def _peak(request: Awaitable[tuple[int, str]]) -> tuple[int, str, int]:
    """The answer's status and text, and the most memory Python held while it was made."""
    tracemalloc.start()
    try:
        status, text = await request
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return status, text, peak


async def _get(admin: TestClient[Any, Any], path: str, **params: str) -> tuple[int, str]:
    async with admin.get(path, params=params) as response:
        return response.status, await response.text()


async def test_an_events_page_reads_64_kib_of_a_kept_body_of_20_mib(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await _start(make_proxy, aiohttp_client, upstream)
    await _kept(proxy, "evt_big", "evt_small")
    size = 20 * MIB
    await execute(
        pg_dsn,
        f'UPDATE "{table}" SET inbox_body = convert_to(\'{{"id": "evt_big", "pad": "\' '
        f"|| repeat('x', {size - 28}) || '\"}}', 'UTF8') WHERE event_id = 'evt_big'",
    )
    store: database.Store = proxy.app[app_keys.STORE]
    shown = await store.inbox.show("hooks", "evt_big", console.BODY_CAP)
    assert shown is not None
    assert shown.request is not None
    assert shown.body_bytes == size
    assert len(shown.request.body) == console.BODY_CAP  # what the server sent, not 20 MiB

    status, html, peak = await _peak(_get(admin, "/console/event", scope="hooks", id="evt_big"))
    assert status == 200
    assert f"{size} bytes, the first {console.BODY_CAP} bytes shown" in html
    assert len(html.encode()) < 2 * console.BODY_CAP
    assert peak < 4 * MIB, peak

    # A body that is all there and fits is still pretty-printed.
    status, html = await _get(admin, "/console/event", scope="hooks", id="evt_small")
    assert status == 200
    assert "&#34;id&#34;: &#34;evt_small&#34;," in html


def test_a_body_is_pretty_printed_only_when_it_was_read_whole() -> None:
    whole = b'{"a": [1, 2]}'
    assert console.pretty_body(whole, len(whole)) == ('{\n  "a": [\n    1,\n    2\n  ]\n}', False)
    # Its first bytes only (the rest not read): shown as they are, said to be cut.
    assert console.pretty_body(whole[:5], 10 * MIB) == ('{"a":', True)
    # Whole, but its indented text would pass the cap: as it is.
    flat = json.dumps(list(range(console.BODY_CAP // 4)), separators=(",", ":"))[: console.BODY_CAP]
    flat = flat[: flat.rfind(",")] + "]"
    assert console.pretty_body(flat.encode()) == (flat, False)


async def test_a_body_filter_reads_no_kept_body_into_the_proxy(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await _start(make_proxy, aiohttp_client, upstream)
    matching = [f"evt_{n:02}" for n in range(12)]
    others = ["evt_elsewhere", "evt_form", "evt_broken", "evt_latin1", "evt_deep"]
    await _kept(proxy, *matching, *others)
    pad = f"repeat('x', {2 * MIB})"
    bodies = {
        # 2 MiB each, the customer at the path.
        "evt_%": f'\'{{"data": {{"object": {{"customer": "cus_123"}}}}, "pad": "\' '
        f"|| {pad} || '\"}}'",
        # The bytes, at another path; not JSON; JSON cut short; not UTF-8; nested past the
        # server's stack depth: none is listed, and none fails the page.
        "evt_elsewhere": f'\'{{"customer": "cus_123", "pad": "\' || {pad} || \'"}}\'',
        "evt_form": "'payload=cus_123&data.object.customer=cus_123'",
        "evt_broken": '\'{"data": {"object": {"customer": "cus_123"\'',
        "evt_deep": "repeat('[', 200000) || '\"cus_123\"' || repeat(']', 200000)",
    }
    for pattern, value in bodies.items():
        await execute(
            pg_dsn,
            f"UPDATE \"{table}\" SET inbox_body = convert_to({value}, 'UTF8') "
            f"WHERE event_id LIKE '{pattern}'",
        )
    await execute(
        pg_dsn,
        f'UPDATE "{table}" SET inbox_body = \'\\x7b22636173655f223a2263'
        "75735f313233ff227d'::bytea WHERE event_id = 'evt_latin1'",
    )

    status, html, peak = await _peak(
        _get(admin, "/console/events", body="data.object.customer=cus_123")
    )
    assert status == 200, html
    listed = {event_id for event_id in [*matching, *others] if f">{event_id}</a>" in html}
    assert listed == set(matching)
    # 24 MiB of matching bodies, and 2 MiB more holding the bytes: none read here.
    assert peak < 4 * MIB, peak


async def test_one_console_request_at_a_time_the_next_is_answered_503_once_it_waited(
    make_proxy: MakeProxy,
    aiohttp_client: Any,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    proxy, admin = await _start(make_proxy, aiohttp_client, upstream)
    await _kept(proxy, "evt_1")
    monkeypatch.setattr(console, "BUSY_WAIT", 0.2)
    holder = await asyncpg.connect(pg_dsn)
    try:
        locked = holder.transaction()
        await locked.start()
        await holder.execute(f'LOCK TABLE "{table}" IN ACCESS EXCLUSIVE MODE')
        first = asyncio.create_task(_get(admin, "/console/events"))

        async def waiting() -> bool:
            rows = await fetch(
                pg_dsn,
                "SELECT count(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND application_name = 'dedup-proxy'",
            )
            return int(rows[0]["n"]) >= 1

        await wait_until(waiting, "the console's query waiting on the table")
        status, html = await _get(admin, "/console/lookup", id="evt_1")
        assert status == 503
        assert "The console is busy" in html
        async with admin.get("/console/console.css") as response:
            assert response.status == 200  # the stylesheet is no console request to wait for
        await locked.rollback()
        status, html = await first
        assert status == 200
        assert ">evt_1</a>" in html
    finally:
        await holder.close()
    # Free again: the next is served.
    status, html = await _get(admin, "/console/lookup", id="evt_1")
    assert status == 200


async def test_only_the_configured_routes_rows_are_listed_and_shown(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await _start(make_proxy, aiohttp_client, upstream)
    await _kept(proxy, "evt_ours")
    # Another deployment's kept row on the same table (a route "payments" not configured
    # here), one of its per-path ones, and a hold's reserved row.
    columns = (
        "event_type, received_at, inbox_state, inbox_request, inbox_body, inbox_attempts, "
        "inbox_failures, inbox_due, inbox_until, inbox_changed, inbox_size"
    )
    for scope, event_id in (("payments", "evt_theirs"), ("payments/acme", "evt_tenant")):
        await execute(
            pg_dsn,
            f"INSERT INTO \"{table}\" (scope, event_id, {columns}) SELECT '{scope}', "
            f"'{event_id}', {columns} FROM \"{table}\" WHERE event_id = 'evt_ours'",
        )
    await execute(
        pg_dsn,
        f'INSERT INTO "{table}" (scope, event_id, event_type, inbox_state, inbox_changed) '
        "VALUES ('~holds', 'hooks', 'hold', 'paused', now())",
    )

    status, listed = await _get(admin, "/console/events")
    assert status == 200
    assert ">evt_ours</a>" in listed
    for other in ("evt_theirs", "evt_tenant", "~holds", ">hooks</a>"):
        assert other not in listed
    for scope, event_id in (("payments", "evt_theirs"), ("payments/acme", "evt_tenant"),
                            ("~holds", "hooks")):  # fmt: skip
        status, html = await _get(admin, "/console/event", scope=scope, id=event_id)
        assert status == 404, (scope, html)
    status, html = await _get(admin, "/console/event", scope="hooks", id="evt_ours")
    assert status == 200


async def test_the_kept_deliveries_are_read_by_their_own_index(pg_dsn: str, table: str) -> None:
    queries = sql.for_table(table)
    for step in queries.schema_steps:
        await execute(pg_dsn, step)
    await execute(
        pg_dsn,
        f"INSERT INTO \"{table}\" (scope, event_id, received_at) SELECT 'hooks', 'evt_' || n, "
        "now() - make_interval(secs => n) FROM generate_series(1, 50000) AS n; "
        f"UPDATE \"{table}\" SET inbox_state = 'pending' WHERE event_id LIKE 'evt\\_1000_'; "
        f'ANALYZE "{table}"',
    )
    statements = inbox_sql.Statements(queries.quoted)
    for criteria in (
        inbox_sql.Criteria(scopes=("hooks",)),
        inbox_sql.Criteria(scopes=("hooks",), scope="hooks", states=("pending",)),
        inbox_sql.Criteria(scopes=("hooks",), states=console.ATTENTION),
    ):
        statement, args = statements.browse(criteria)
        plan = "\n".join(r[0] for r in await fetch(pg_dsn, f"EXPLAIN {statement}", *args))
        assert f"{table}_kept_idx" in plan, plan
        assert "Seq Scan" not in plan, plan
        if criteria.body_bytes is None:
            # The list's total, up to console.COUNT_MAX + 1 rows: by an index too (the kept
            # rows', or the inbox's for pending and dead: the planner's choice), not the table.
            statement, args = statements.count(criteria, console.COUNT_MAX)
            plan = "\n".join(r[0] for r in await fetch(pg_dsn, f"EXPLAIN {statement}", *args))
            assert f"{table}_kept_idx" in plan or f"{table}_inbox_idx" in plan, plan
            assert "Seq Scan" not in plan, plan


def test_a_body_filter_statement_names_no_state_the_walk_checks_them() -> None:
    """The list's default (pending and dead) with a body filter: its statement is the one a
    body filter alone has, walking the newest rows by the kept index, each batch's bodies
    checked (``BROWSE_SCAN`` at most a page), the states checked by ``Inbox.browse``
    (tests/test_console.py). With the states in it, PostgreSQL read every pending and dead
    row's body at each batch through the inbox's index, then sorted them: 104 ms a batch over
    90,000 of them (``bench.console``'s rows), against 0.3 ms by the kept index."""
    statements = inbox_sql.Statements('"t"')
    alone = inbox_sql.Criteria(scopes=("hooks",), body_bytes=b"cus_7")
    default = inbox_sql.Criteria(scopes=("hooks",), states=console.ATTENTION, body_bytes=b"cus_7")
    assert statements.browse(default) == statements.browse(alone)
    assert (
        "inbox_state = ANY" in statements.browse(dataclasses.replace(default, body_bytes=None))[0]
    )
