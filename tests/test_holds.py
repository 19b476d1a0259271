"""Route holds (``events pause``/``resume``, the app's Retry-After) on a real PostgreSQL: the
store's rules, each worker's copy, the redeliverer holding on every process, the commands'
output, and the hold rows kept out of the sweep, the listings and the counts."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy import app_keys, database, errors, operations, route_holds
from proxy.database import HoldKind
from tests import roles
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    Serve,
    execute,
    fetch,
    free_port,
    run_cli,
    sweeper_of,
    wait_until,
)

QUICK = {"poll": "100ms", "rate": 1000}
ROUTE = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "redeliver": {"schedule": ["200ms"], "for": "1d"},
}
PLAIN = {"name": "plain", "path": "/plain", "event_id": "body:/id"}
# How long a held route is watched for a redelivery that must not come: many polls and many
# due times (both 100-200 ms). A negative cannot be polled for.
WATCH = 1.5


def failing(until: int) -> Any:
    """The first ``until`` requests answered 503, the others 200."""
    return lambda n: web.Response(status=503 if n < until else 200)


def write_config(path: Path, pg_dsn: str, table: str, upstream: FakeUpstream) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url, "timeout": "5s"},
                "database": {"dsn": pg_dsn, "table": table},
                "redeliverer": QUICK,
                "routes": [ROUTE, PLAIN],
            }
        )
    )
    return path


@pytest.fixture
def config_file(tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream) -> Path:
    return write_config(tmp_path / "config.yaml", pg_dsn, table, upstream)


async def events(config_file: Path, *args: str) -> tuple[int, str, str]:
    return await run_cli("events", *args, "--config", str(config_file))


async def states(dsn: str, table: str) -> dict[str, str | None]:
    rows = await fetch(dsn, f"SELECT event_id, inbox_state FROM \"{table}\" WHERE scope = 'hooks'")
    return {row["event_id"]: row["inbox_state"] for row in rows}


async def all_delivered(dsn: str, table: str, count: int) -> bool:
    found = await states(dsn, table)
    return len(found) == count and set(found.values()) == {"delivered"}


async def test_hold_at_least_never_shortens_a_hold_nor_turns_a_pause_into_another_kind(
    proxy_config: Any, pg_dsn: str
) -> None:
    cfg = proxy_config(routes=[ROUTE])
    async with operations.open_store(cfg) as store:
        await store.migrate()
        holds = store.holds
        first = await holds.hold_at_least("hooks", 60, by="proxy", note="Retry-After: 60")
        assert first.reason == HoldKind.RETRY_AFTER
        assert first.until is not None
        assert first.until - first.since == pytest.approx(60, abs=2)

        shorter = await holds.hold_at_least("hooks", 5, by="proxy", note="Retry-After: 5")
        assert shorter.until == pytest.approx(first.until, abs=0.5)
        longer = await holds.hold_at_least("hooks", 600, by="proxy", note="Retry-After: 600")
        assert longer.until is not None
        assert longer.until - first.until > 500
        assert longer.since == pytest.approx(first.since, abs=0.5)  # one hold, extended

        paused = await holds.hold("hooks", None, by="alice", note="maintenance")
        assert (paused.reason, paused.until, paused.by, paused.note) == (
            HoldKind.PAUSED, None, "alice", "maintenance",
        )  # fmt: skip
        still = await holds.hold_at_least("hooks", 6000, by="proxy", note="Retry-After: 6000")
        assert (still.reason, still.until, still.by) == (HoldKind.PAUSED, None, "alice")

        assert await holds.release("hooks", by="bob") == HoldKind.PAUSED
        assert await holds.active(["hooks"]) == {}
        assert await holds.release("hooks", by="bob") is None
        again = await holds.hold_at_least("hooks", 5, by="proxy", note="Retry-After: 5")
        assert again.reason == HoldKind.RETRY_AFTER
        assert again.since > paused.since  # a new hold, not the ended pause's
        assert set(await holds.active()) == {"hooks"}
        assert await holds.active(["other"]) == {}


async def test_a_pause_holds_the_redeliverer_and_resume_sends_each_event_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, config_file: Path
) -> None:
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[ROUTE, PLAIN], redeliverer=QUICK)
    copy = proxy.app[app_keys.HOLDS]
    code, out, err = await events(config_file, "pause", "--route", "hooks", "--reason", "deploy")
    assert (code, err) == (0, "")
    assert "paused" in out
    assert "deploy" in out
    await wait_until(lambda: _held(copy, "hooks"), "the worker to see the pause")

    for n in range(3):
        answer = await proxy.post("/hooks", data=json.dumps({"id": f"e{n}"}))
        assert answer.status == 202
        assert (await answer.json())["kept_for"] == "paused"  # kept, due now, not sent
    await asyncio.sleep(WATCH)
    assert upstream.requests == []  # the app gets nothing while the route is paused
    assert set((await states(pg_dsn, table)).values()) == {"pending"}
    # A route without redeliver cannot keep: its webhooks are refused, its provider retries.
    code, _, _ = await events(config_file, "pause", "--route", "plain")
    assert code == 0
    await wait_until(lambda: _held(copy, "plain"), "the worker to see the second pause")
    refused = await proxy.post("/plain", data=json.dumps({"id": "p1"}))
    assert refused.status == 503
    assert (await refused.json())["error"] == "route_paused"
    assert refused.headers["Retry-After"] == "60"
    assert upstream.requests == []

    code, out, err = await events(config_file, "resume", "--route", "hooks")
    assert (code, err) == (0, "")
    assert out.startswith("resumed: route hooks (scope hooks), paused until now")
    await wait_until(lambda: all_delivered(pg_dsn, table, 3), "every event delivered")
    bodies = sorted(json.loads(body)["id"] for body in upstream.bodies())
    assert bodies == ["e0", "e0", "e1", "e2"]  # the first failed once; then each sent once


async def _held(copy: Any, scope: str) -> bool:
    return copy.held(scope) is not None


async def test_a_pause_for_a_while_ends_on_its_own(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, config_file: Path
) -> None:
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[ROUTE], redeliverer=QUICK)
    code, _out, _ = await events(config_file, "pause", "--route", "hooks", "--for", "5s")
    assert code == 0
    await wait_until(lambda: _held(proxy.app[app_keys.HOLDS], "hooks"), "the pause seen")
    assert (await proxy.post("/hooks", data=b'{"id": "late"}')).status == 202

    await wait_until(lambda: all_delivered(pg_dsn, table, 1), "delivered after the pause")
    # Not before the pause's end: both times are the database's.
    (row,) = await fetch(
        pg_dsn,
        f"SELECT (e.inbox_attempts -> -1 ->> 'at')::timestamptz >= h.inbox_until AS after "
        f"FROM \"{table}\" e, \"{table}\" h WHERE e.event_id = 'late' AND h.scope = '~holds'",
    )
    assert row["after"]
    assert len(upstream.requests) == 2


async def test_the_apps_retry_after_holds_every_worker_at_once_and_is_stored(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[ROUTE], redeliverer=QUICK)
    copy = proxy.app[app_keys.HOLDS]
    hold = await copy.hold_for_retry_after("hooks", 3600)
    assert hold is not None
    assert hold.reason == "retry_after"
    assert copy.held("hooks") == hold  # at once, no poll needed
    assert copy.held("hooks/acme") == hold  # a per-path scope with its route's

    answer = await proxy.post("/hooks", data=b'{"id": "ra"}')
    assert answer.status == 202
    assert (await answer.json())["kept_for"] == "retry_after"  # the app asked to wait: kept
    await asyncio.sleep(WATCH)
    assert upstream.requests == []
    (row,) = await fetch(
        pg_dsn, f"SELECT inbox_state, inbox_request FROM \"{table}\" WHERE scope = '~holds'"
    )
    assert row["inbox_state"] == "retry_after"
    assert json.loads(row["inbox_request"])["by"] == "proxy"


async def test_the_commands_say_what_they_did_and_exit_by_it(
    config_file: Path, proxy_config: Any
) -> None:
    async with operations.open_store(proxy_config(routes=[ROUTE])) as store:
        await store.migrate()
    code, out, err = await events(config_file, "resume", "--route", "hooks")
    assert (code, out, err.strip()) == (1, "", "not held: route hooks (scope hooks)")

    code, out, err = await events(config_file, "pause", "--route", "plain", "--by", "alice")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("paused: scope plain paused by alice since ")
    assert lines[0].endswith(", until resumed")
    assert "no redeliver" in lines[1]
    assert "503 with Retry-After" in lines[1]

    code, out, err = await events(config_file, "pause", "--route", "nope")
    assert code == 2
    assert "unknown route 'nope'" in err
    code, out, err = await events(config_file, "pause", "--route", "hooks", "--for", "soon")
    assert code == 2

    code, out, err = await run_cli("stats", "--config", str(config_file))
    assert code == 0
    held = [line for line in out.splitlines() if line.startswith("held:")]
    assert len(held) == 1
    assert "scope plain paused by alice" in held[0]

    code, out, err = await events(config_file, "resume", "--route", "plain")
    assert code == 0
    code, out, err = await run_cli("stats", "--config", str(config_file))
    assert "held:" not in out


async def test_the_hold_rows_are_never_swept_listed_or_counted(
    make_proxy: MakeProxy, pg_dsn: str, table: str, config_file: Path
) -> None:
    proxy = await make_proxy(
        routes=[{**ROUTE, "retention": "1h", "redeliver": {"for": "1h"}}], redeliverer=QUICK
    )
    store: database.Store = proxy.app[app_keys.STORE]
    await store.holds.hold("hooks", None, by="alice")
    # Older than any retention, and in the inbox's states a sweep or a listing would look at.
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET received_at = now() - interval '400 days', "
        f"inbox_changed = now() - interval '400 days' WHERE scope = '~holds'",
    )

    await sweeper_of(proxy).sweep()

    assert len(await fetch(pg_dsn, f"SELECT FROM \"{table}\" WHERE scope = '~holds'")) == 1
    assert set(await store.holds.active()) == {"hooks"}
    code, out, _ = await events(config_file, "list", "--route", "hooks")
    assert (code, out.splitlines()[-1]) == (0, "0 claim(s) in scope hooks")
    code, out, _ = await events(config_file, "pending", "--route", "hooks")
    assert out.splitlines()[-1] == "0 pending delivery(ies) in scope hooks"
    code, out, _ = await run_cli("stats", "--config", str(config_file))
    assert out.splitlines()[1].split()[:3] == ["hooks", "hooks", "0"]


async def test_a_pause_from_one_process_holds_every_worker_of_every_other(
    serve: Serve, upstream: FakeUpstream, pg_dsn: str, table: str, tmp_path: Path
) -> None:
    settings = {"routes": [ROUTE], "workers": 2, "redeliverer": QUICK}
    first, second = await serve(**settings), await serve(**settings)
    config_file = write_config(tmp_path / "cli.yaml", pg_dsn, table, upstream)

    async def ready() -> bool:  # the supervisor listens before its workers made the table
        async with aiohttp.ClientSession() as session:
            for served in (first, second):
                async with session.get(f"{served.admin_url}/readyz") as answer:
                    if answer.status != 200:
                        return False
        return True

    await wait_until(ready, "both proxies ready", within=30)
    upstream.respond = failing(4)
    code, _, err = await events(config_file, "pause", "--route", "hooks", "--for", "1h")
    assert (code, err) == (0, "")

    async def seen() -> bool:
        samples = [await served.metrics() for served in (first, second)]
        return all(
            any(value == 1 for key, value in sample.items() if key.startswith("dedup_route_held{")
                and 'route="hooks"' in key and 'reason="paused"' in key)
            for sample in samples
        )  # fmt: skip

    # Each worker reads the holds every 100 ms; a kept event is due 200 ms after it is kept.
    await wait_until(seen, "both proxies to report the pause")
    await asyncio.sleep(0.3)  # three polls: every worker has read it (the gauge is any one's)
    async with aiohttp.ClientSession() as session:
        for n in range(4):
            url = (first if n % 2 else second).url
            async with session.post(f"{url}/hooks", data=json.dumps({"id": f"s{n}"})) as answer:
                assert answer.status == 202  # kept while paused, not sent
    await asyncio.sleep(WATCH)
    assert upstream.requests == []
    assert set((await states(pg_dsn, table)).values()) == {"pending"}

    code, _, _ = await events(config_file, "resume", "--route", "hooks")
    assert code == 0
    await wait_until(lambda: all_delivered(pg_dsn, table, 4), "every event delivered")
    bodies = sorted(json.loads(body)["id"] for body in upstream.bodies())
    assert bodies == sorted([f"s{n}" for n in range(4)] * 2)


async def test_a_retry_after_the_database_does_not_take_holds_this_worker_until_its_end(
    proxy_config: Any,
) -> None:
    cfg = proxy_config(routes=[ROUTE])
    down = f"postgresql://dedup@127.0.0.1:{free_port()}/dedup"  # nothing listens there
    store = database.Store.create(down, cfg.database, claim_wait=1, upstream_timeout=1)
    copy = route_holds.Holds(store, cfg.routes, poll=0.1)
    try:
        hold = await copy.hold_for_retry_after("hooks", 3600)
        assert hold is not None
        assert hold.reason == "retry_after"
        assert copy.held("hooks") == hold
        await copy.refresh()  # fails: the copy keeps it
        assert copy.held("hooks") == hold
        assert copy.unheld(["hooks", "other"]) == ["other"]
    finally:
        await store.close()


@pytest.mark.parametrize("inbox", [True, False], ids=["inbox-grant", "no-inbox-grant"])
async def test_the_documented_grants_pause_and_resume_and_the_apps_hold_names_its_grant(
    tmp_path: Path, proxy_config: Any, pg_dsn: str, table: str, upstream: FakeUpstream, inbox: bool
) -> None:
    async with operations.open_store(proxy_config(routes=[ROUTE])) as store:
        await store.migrate()
    grants = (roles.DOCUMENTED, *([roles.INBOX] if inbox else []))
    async with roles.limited_role(pg_dsn, table, *grants) as (_, dsn):
        config_file = write_config(tmp_path / "role.yaml", dsn, table, upstream)
        for _ in range(2):  # the second replaces the first's row
            code, _, err = await events(config_file, "pause", "--route", "hooks", "--for", "1h")
            assert (code, err) == (0, "")
        code, out, _ = await run_cli("stats", "--config", str(config_file))
        assert "held: scope hooks paused" in out

        role_config = proxy_config(routes=[ROUTE], database={"dsn": dsn})
        async with operations.open_store(role_config) as store:
            if inbox:
                held = await store.holds.hold_at_least("hooks", 60, by="proxy", note="503")
                assert held.reason == "paused"
            else:
                with pytest.raises(errors.PermissionDenied, match=r"GRANT UPDATE \(inbox_state"):
                    await store.holds.hold_at_least("hooks", 60, by="proxy", note="503")
        code, _, err = await events(config_file, "resume", "--route", "hooks")
        assert (code, err) == (0, "")


TENANTS = {**ROUTE, "path": "/hooks/{tenant}"}


async def test_one_tenants_retry_after_holds_that_tenant_only(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    def respond(n: int) -> web.Response:
        if upstream.requests[n].path_qs.startswith("/hooks/acme"):
            return web.Response(status=429, headers={"Retry-After": "3600"})
        return web.Response(status=503 if n == 1 else 200)  # globex's first fails once

    upstream.respond = respond
    proxy = await make_proxy(routes=[TENANTS], redeliverer=QUICK)
    copy = proxy.app[app_keys.HOLDS]
    acme = await proxy.post("/hooks/acme", data=b'{"id": "a1"}')
    assert (await acme.json())["kept_for"] == "retry_after"
    globex = await proxy.post("/hooks/globex", data=b'{"id": "g1"}')
    assert (globex.status, (await globex.json())["upstream_status"]) == (202, 503)  # sent
    assert (await proxy.post("/hooks/globex", data=b'{"id": "g2"}')).status == 200

    async def globex_delivered() -> bool:  # g1 redelivered on its schedule (200 ms)
        rows = await fetch(pg_dsn, f"SELECT inbox_state FROM \"{table}\" WHERE event_id = 'g1'")
        return rows[0]["inbox_state"] == "delivered"

    await wait_until(globex_delivered, "globex's redelivery while acme is held")
    later = await proxy.post("/hooks/acme", data=b'{"id": "a2"}')
    assert (await later.json())["kept_for"] == "retry_after"  # acme's own: held, not sent
    assert [r.path_qs for r in upstream.requests].count("/hooks/acme") == 1
    assert copy.held("hooks/globex") is None
    held = copy.held("hooks/acme")
    assert held is not None
    assert held.until is not None
    assert held.until - held.since == pytest.approx(3600, abs=5)
    (row,) = await fetch(pg_dsn, f"SELECT event_id FROM \"{table}\" WHERE scope = '~holds'")
    assert row["event_id"] == "hooks/acme"


async def test_a_retry_after_hold_is_capped_and_a_tenants_ended_rows_do_not_pile_up(
    proxy_config: Any, pg_dsn: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = proxy_config(routes=[TENANTS])
    async with operations.open_store(cfg) as store:
        await store.migrate()
        week = await store.holds.hold_at_least("hooks/acme", 7 * 86400, by="proxy", note="x")
        assert week.until is not None
        assert week.until - week.since == pytest.approx(database.MAX_RETRY_AFTER, abs=5)
        await execute(pg_dsn, f"UPDATE \"{table}\" SET inbox_until = now() WHERE scope = '~holds'")
        await store.holds.hold_at_least("hooks/globex", 60, by="proxy", note="x")
        rows = await fetch(pg_dsn, f"SELECT event_id FROM \"{table}\" WHERE scope = '~holds'")
        assert [r["event_id"] for r in rows] == ["hooks/globex"]  # acme's ended row is gone
        assert await store.holds.release("hooks", by="bob") == HoldKind.RETRY_AFTER
        assert await store.holds.active() == {}

        monkeypatch.setattr(route_holds, "MAX_PATH_HOLDS", 2)
        copy = route_holds.Holds(store, cfg.routes, poll=1.0)
        for tenant in ("a", "b", "c"):
            await copy.hold_for_retry_after(f"hooks/{tenant}", 60)
        assert copy.held_paths(["hooks"]) == ["hooks/a", "hooks/b"]
        assert set(await store.holds.active(["hooks"])) == {"hooks/a", "hooks/b"}


async def test_a_held_routes_503_says_what_holds_it_and_back_pressure_is_no_error(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """A route without redeliver answers 503 while held, with the cause as its code; the limit
    at the app with app_busy. None of them is a fault: no error-level line (before: every one
    at error, and route_paused whatever held the route)."""
    caplog.set_level(logging.INFO, logger="proxy.pipeline")
    proxy = await make_proxy(
        routes=[PLAIN], upstream={"concurrency": 1}, database={"pool_timeout": "300ms"}
    )
    store, copy = proxy.app[app_keys.STORE], proxy.app[app_keys.HOLDS]

    async def refused(event_id: str) -> tuple[str, str]:
        answer = await proxy.post("/plain", data=json.dumps({"id": event_id}))
        assert answer.status == 503
        said = await answer.json()
        return said["error"], said["message"]

    await store.holds.hold_at_least("plain", 60, by="the app", note="429 Retry-After: 60")
    await wait_until(lambda: _held(copy, "plain"), "the worker to see the app's hold")
    by_the_app = await refused("r1")
    await store.holds.hold("plain", None, by="ops", note="deploy")
    await wait_until(lambda: _paused(copy, "plain"), "the worker to see the pause")
    paused = await refused("p1")
    await store.holds.release("plain", by="ops")
    await wait_until(lambda: _free(copy, "plain"), "the worker to see the route free")
    upstream.gate = asyncio.Event()
    first = asyncio.ensure_future(proxy.post("/plain", data=b'{"id": "a"}'))
    await wait_until(lambda: _requests(upstream, 1), "the first at the app")
    busy = await refused("b1")
    upstream.gate.set()
    assert (await first).status == 200

    assert by_the_app == (
        "app_retry_after",
        "The app asked for a pause (Retry-After); try again later.",
    )
    assert paused == ("route_paused", "The route is paused; try again later.")
    assert busy[0] == "app_busy"
    lines = {r.fields["event_id"]: r for r in caplog.records if hasattr(r, "fields")
             and r.fields.get("outcome") == "unavailable"}  # fmt: skip
    assert {event: r.fields["code"] for event, r in lines.items()} == {
        "r1": "app_retry_after", "p1": "route_paused", "b1": "app_busy"
    }  # fmt: skip
    assert {event: r.levelname for event, r in lines.items()} == {
        "r1": "INFO", "p1": "INFO", "b1": "WARNING"
    }  # fmt: skip


async def _paused(copy: Any, scope: str) -> bool:
    hold = copy.held(scope)
    return hold is not None and hold.reason == HoldKind.PAUSED


async def _free(copy: Any, scope: str) -> bool:
    return copy.held(scope) is None


async def _requests(upstream: FakeUpstream, n: int) -> bool:
    return len(upstream.requests) >= n


async def test_resume_promises_redeliveries_only_on_a_route_that_keeps(
    make_proxy: MakeProxy, config_file: Path
) -> None:
    await make_proxy(routes=[ROUTE, PLAIN], redeliverer=QUICK)  # the holds' rows are made
    for name in ("plain", "hooks"):
        code, _, _ = await events(config_file, "pause", "--route", name)
        assert code == 0

    _, plain, _ = await events(config_file, "resume", "--route", "plain")
    _, hooks, _ = await events(config_file, "resume", "--route", "hooks")

    # Before: "redelivers its pending deliveries again" on plain too, which keeps none.
    assert plain == (
        "resumed: route plain (scope plain), paused until now; every running proxy forwards "
        "its webhooks again within 100ms (it keeps none to redeliver)\n"
    )
    assert "redelivers its pending deliveries again within 100ms" in hooks
