"""``order``: one delivery of an object at the app at a time, in order, and stale versions
superseded; on a real PostgreSQL, with an app that applies versions last-writer-wins and
records whether two deliveries of one object were ever at it at once."""

from __future__ import annotations

import asyncio
import io
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from proxy import app_keys, config, errors, inbox_commands, logs, ordering, redeliverer
from proxy.database import inbox, sql
from tests.helpers import (
    MakeProxy,
    Serve,
    admin_client,
    execute,
    fetch,
    run_cli,
    scrape,
    start_up,
    sweeper_of,
    wait_until,
)
from tests.roles import DOCUMENTED, INBOX, limited_role

QUICK = {"poll": "100ms", "rate": 1000}


@dataclass
class LastWriterWins:
    """The app: applies each delivery's version to its object as it arrives (last writer
    wins, as most apps do), taking a while; records overlaps per object."""

    url: str = ""
    state: dict[str, int] = field(default_factory=dict)
    applied: list[tuple[str, int]] = field(default_factory=list)
    at_app: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    overlaps: int = 0
    # (object, version) answered 503 this many times first.
    fail: dict[tuple[str, int], int] = field(default_factory=dict)
    work: float = 0.02
    fail_status: int = 503  # 400: dead at once (an answer retrying cannot fix)
    # The event whose delivery hangs until its sender goes: the test server cancels a handler
    # whose client went (an app whose transaction aborts with its request).
    hang: str | None = None
    # Seconds the app takes on these events (by ID), instead of ``work``.
    slow: dict[str, float] = field(default_factory=dict)

    async def handle(self, request: web.Request) -> web.Response:
        event = json.loads(await request.read())
        obj, version = event["data"]["object"]["id"], event["created"]
        self.at_app[obj] += 1
        if self.at_app[obj] > 1:
            self.overlaps += 1
        try:
            if event["id"] == self.hang:
                await asyncio.Event().wait()
            await asyncio.sleep(self.slow.get(event["id"], self.work))
            if self.fail.get((obj, version), 0) > 0:
                self.fail[(obj, version)] -= 1
                return web.Response(status=self.fail_status)
            self.state[obj] = version
            self.applied.append((obj, version))
            return web.Response(text="ok")
        finally:
            self.at_app[obj] -= 1


@pytest.fixture
async def app(aiohttp_server: Any) -> LastWriterWins:
    lww = LastWriterWins()
    application = web.Application()
    application.router.add_post("/{tail:.*}", lww.handle)
    server = await aiohttp_server(application)
    lww.url = str(server.make_url("")).rstrip("/")
    return lww


def version(event_id: str, obj: str, created: int, kind: str = "customer.updated") -> bytes:
    return json.dumps(
        {"id": event_id, "type": kind, "created": created, "data": {"object": {"id": obj}}}
    ).encode()


def ordered(**extra: Any) -> dict[str, Any]:
    return {
        "name": "hooks",
        "path": "/hooks",
        "event_id": "body:/id",
        "event_type": "body:/type",
        "order": {"key": "body:/data/object/id", "version": "body:/created"},
        **extra,
    }


# --- configuration -----------------------------------------------------------------------


def parse(route: dict[str, Any]) -> config.Config:
    return config.parse(
        {
            "upstream": {"url": "http://127.0.0.1:1"},
            "database": {"dsn": "embedded"},
            "routes": [route],
        }
    )


def test_order_preset_takes_the_providers_object_and_version_fields() -> None:
    route = parse({"name": "s", "path": "/s", "preset": "stripe", "order": "preset"}).routes[0]
    assert route.order is not None
    assert (str(route.order.key), str(route.order.version)) == (
        "body:/data/object/id", "body:/created",
    )  # fmt: skip
    # A preset alone never orders a route.
    assert parse({"name": "s", "path": "/s", "preset": "stripe"}).routes[0].order is None


def test_order_problems_are_collected() -> None:
    with pytest.raises(errors.ConfigError) as caught:
        parse(
            {
                "name": "s", "path": "/s", "event_id": "body:/id",
                "order": {"key": "nowhere", "supersede": ["a"], "sort": 1},
            }
        )  # fmt: skip
    problems = "\n".join(caught.value.problems)
    assert "routes[0].order.sort: unknown key" in problems
    assert "routes[0].order.key: must be body:/pointer" in problems
    assert "routes[0].order.supersede: needs version" in problems
    with pytest.raises(errors.ConfigError) as caught:
        parse({"name": "s", "path": "/s", "event_id": "body:/id", "order": "preset"})
    assert "routes[0].order: 'preset' needs a route preset" in "\n".join(caught.value.problems)


def test_versions_read_as_exact_seconds() -> None:
    assert ordering.parse_version("1700000000") == "1700000000"
    assert ordering.parse_version("2024-01-02T03:04:05.5Z") == "1704164645.500000"
    assert ordering.parse_version("2024-01-02T04:04:05.5+01:00") == "1704164645.500000"
    for unparsed in ("soon", "2024-01-02T03:04:05", "NaN", "1e400"):
        assert ordering.parse_version(unparsed) is None


# --- one delivery of an object at the app at a time ------------------------------------


async def test_concurrent_versions_of_an_object_never_overlap_at_the_app(
    make_proxy: MakeProxy, app: LastWriterWins
) -> None:
    proxy = await make_proxy(routes=[ordered()], upstream={"url": app.url, "concurrency": 4})

    answers = await asyncio.gather(
        *(proxy.post("/hooks", data=version(f"evt_{n}", f"cus_{n % 2}", n)) for n in range(12))
    )

    assert [a.status for a in answers] == [200] * 12
    assert len(app.applied) == 12
    assert app.overlaps == 0


async def test_the_inbox_never_sends_a_newer_version_before_an_older_one_kept(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    app.fail[("cus_1", 1)] = 1
    route = ordered(redeliver={"schedule": ["300ms"], "for": "1d"})
    proxy = await make_proxy(routes=[route], upstream={"url": app.url}, redeliverer=QUICK)

    first = await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))
    second = await proxy.post("/hooks", data=version("evt_2", "cus_1", 2))

    assert (first.status, second.status) == (202, 202)
    assert (await second.json())["kept_for"] == "ordering"
    await wait_until(lambda: _applied(app, 2), "both delivered")
    assert app.applied == [("cus_1", 1), ("cus_1", 2)]
    assert app.state == {"cus_1": 2}
    assert app.overlaps == 0


async def test_a_failed_head_blocks_its_own_object_only(
    make_proxy: MakeProxy, app: LastWriterWins
) -> None:
    app.fail[("cus_1", 1)] = 1
    route = ordered(redeliver={"schedule": ["1h"], "for": "1d"})
    proxy = await make_proxy(routes=[route], upstream={"url": app.url}, redeliverer=QUICK)

    assert (await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))).status == 202
    behind = await proxy.post("/hooks", data=version("evt_2", "cus_1", 2))
    other = await proxy.post("/hooks", data=version("evt_3", "cus_2", 1))

    assert behind.status == 202  # kept behind its object's failed head, not sent ahead
    assert other.status == 200  # another object flows
    await asyncio.sleep(0.5)  # the redeliverer's polls pass: cus_1's head is not due for 1h
    assert app.applied == [("cus_2", 1)]


async def test_stale_versions_are_superseded_and_never_forwarded(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    route = ordered()
    route["order"] = {**route["order"], "supersede": ["customer.updated"]}
    proxy = await make_proxy(routes=[route], upstream={"url": app.url})

    v3 = await proxy.post("/hooks", data=version("evt_3", "cus_1", 3))
    v1 = await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))
    v2 = await proxy.post("/hooks", data=version("evt_2", "cus_1", 2))
    tie = await proxy.post("/hooks", data=version("evt_4", "cus_1", 3))
    other_type = await proxy.post("/hooks", data=version("evt_5", "cus_1", 2, "customer.seen"))

    assert (v3.status, v1.status, v2.status) == (200, 200, 200)
    assert v1.headers["Dedup-Status"] == v2.headers["Dedup-Status"] == "superseded"
    assert await v1.json() == {"status": "superseded", "event_id": "evt_1"}
    assert "Dedup-Status" not in tie.headers  # a tie is forwarded
    assert "Dedup-Status" not in other_type.headers  # not a type the route supersedes
    assert app.applied == [("cus_1", 3), ("cus_1", 3), ("cus_1", 2)]
    rows = await fetch(
        pg_dsn, f'SELECT event_id, inbox_state FROM "{table}" WHERE scope = $1', "hooks"
    )
    assert {r["event_id"]: r["inbox_state"] for r in rows}["evt_1"] == "superseded"
    again = await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))
    assert again.headers["Dedup-Status"] == "duplicate"


# --- serve processes: two replicas on one table -------------------------------------------


def _replica(app: LastWriterWins, route: dict[str, Any]) -> dict[str, Any]:
    return {
        "routes": [route],
        "workers": 2,
        "upstream": {"url": app.url, "timeout": "30s", "concurrency": 4},
        "database": {"pool_size": 6},
        "redeliverer": {"poll": "100ms"},
    }


async def _post(url: str, body: bytes) -> int:
    async with aiohttp.ClientSession() as session, session.post(url, data=body) as answer:
        return answer.status


def _never_backwards(app: LastWriterWins) -> bool:
    seen: dict[str, int] = {}
    for obj, applied in app.applied:
        if applied < seen.get(obj, applied):
            return False
        seen[obj] = applied
    return True


async def test_two_replicas_never_overlap_an_object_nor_apply_it_backwards(
    serve: Serve, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    app.work = 0.05
    route = ordered(claim_wait="10s")
    route["order"] = {**route["order"], "supersede": ["customer.updated"]}
    replicas = [await serve(**_replica(app, route)) for _ in range(2)]
    events = [(f"evt_{n}", f"cus_{n % 3}", n // 3 + 1) for n in range(18)]  # 6 versions each

    answers = await asyncio.gather(
        *(
            _post(f"{replicas[n % 2].url}/hooks", version(event_id, obj, v))
            for n, (event_id, obj, v) in enumerate(events)
        )
    )

    assert answers == [200] * 18
    assert app.overlaps == 0
    assert _never_backwards(app)
    assert app.state == {"cus_0": 6, "cus_1": 6, "cus_2": 6}
    rows = await fetch(
        pg_dsn, f"SELECT event_id, inbox_state FROM \"{table}\" WHERE scope = 'hooks'"
    )
    superseded = {r["event_id"] for r in rows if r["inbox_state"] == "superseded"}
    # Every event applied once or superseded.
    assert len(app.applied) + len(superseded) == 18
    assert len(rows) == 18


async def test_kill_9_of_a_replica_holding_an_object_frees_it_to_the_other(
    serve: Serve, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    route = ordered(claim_wait="10s", redeliver={"schedule": ["200ms"], "for": "1d"})
    route["order"] = {**route["order"], "supersede": ["customer.updated"]}
    holding, other = [await serve(**_replica(app, route)) for _ in range(2)]
    app.hang = "evt_1"
    v1 = asyncio.create_task(_post(f"{holding.url}/hooks", version("evt_1", "cus_1", 1)))
    await wait_until(lambda: _at_app(app, "cus_1"), "v1 at the app, its object held")
    v2 = asyncio.create_task(_post(f"{other.url}/hooks", version("evt_2", "cus_1", 2)))
    await asyncio.sleep(0.3)  # v2 waits on the object's row lock
    assert app.applied == []

    await holding.kill()  # SIGKILL: the claim's transaction, and the object's lock, die with it

    assert await v2 == 200  # the other replica delivers the object's next version
    with pytest.raises(aiohttp.ClientError):
        await v1
    # The provider had no answer for v1, and sends it again: older than v2, superseded.
    assert await _post(f"{other.url}/hooks", version("evt_1", "cus_1", 1)) == 200
    assert app.applied == [("cus_1", 2)]
    assert app.state == {"cus_1": 2}
    assert app.overlaps == 0
    rows = await fetch(
        pg_dsn, f"SELECT event_id, inbox_state FROM \"{table}\" WHERE scope = 'hooks'"
    )
    assert {r["event_id"]: r["inbox_state"] for r in rows} == {
        "evt_1": "superseded", "evt_2": None,
    }  # fmt: skip


async def _at_app(app: LastWriterWins, obj: str) -> bool:
    return app.at_app[obj] > 0


async def _applied(app: LastWriterWins, count: int) -> bool:
    return len(app.applied) >= count


async def test_a_kept_delivery_passed_in_the_keep_window_is_superseded_not_sent(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    # The window guarantees.md names: v1 waited past claim_wait and was kept, and v2, in
    # flight at the same time, took the object between v1's wait and its keep's COMMIT and was
    # accepted. The test holds the object as v2 did, then commits what v2's delivery leaves.
    route = ordered(claim_wait="200ms", redeliver={"schedule": ["300ms"], "for": "1d"})
    route["order"] = {**route["order"], "supersede": ["customer.updated"]}
    proxy = await make_proxy(routes=[route], upstream={"url": app.url}, redeliverer=QUICK)
    holder = await asyncpg.connect(pg_dsn)
    try:
        await holder.execute(
            f'BEGIN; INSERT INTO "{table}" (scope, event_id, event_type, inbox_changed) '
            "VALUES ('~order/hooks', 'cus_1', 'object', now()) ON CONFLICT (scope, event_id) "
            "DO UPDATE SET inbox_changed = now()"
        )
        v1 = await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))
        assert (v1.status, (await v1.json())["kept_for"]) == (202, "ordering")
        app.state["cus_1"] = 2  # v2 applied by the app
        await holder.execute(
            f"""UPDATE "{table}" SET inbox_request = '{{"v": 2}}' """
            "WHERE scope = '~order/hooks' AND event_id = 'cus_1'; COMMIT"
        )
    finally:
        await holder.close()

    async def settled() -> bool:
        rows = await fetch(
            pg_dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1', "evt_1"
        )
        return rows[0]["inbox_state"] != "pending"

    await wait_until(settled, "v1 settled by the redeliverer")
    rows = await fetch(
        pg_dsn,
        f'SELECT inbox_state, inbox_body IS NOT NULL AS body FROM "{table}" WHERE event_id = $1',
        "evt_1",
    )
    assert (rows[0]["inbox_state"], rows[0]["body"]) == ("superseded", True)
    assert app.applied == []  # v1 never overwrote v2
    assert app.state == {"cus_1": 2}


def _handed_off_route() -> dict[str, Any]:
    route = ordered(redeliver={"schedule": ["200ms"], "for": "1d"}, hand_off="300ms")
    route["order"] = {**route["order"], "supersede": ["customer.updated"]}
    return route


async def _states(dsn: str, table: str) -> dict[str, str]:
    rows = await fetch(
        dsn, f'SELECT event_id, inbox_state FROM "{table}" WHERE scope = $1', "hooks"
    )
    return {row["event_id"]: row["inbox_state"] for row in rows}


async def test_a_handed_off_version_the_app_accepts_supersedes_an_older_one_kept_behind_it(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    """The campaign's applied_backwards (seed 115614003): a hand-off's 2xx recorded no accepted
    version, so the older version kept behind it was sent after it and applied over it."""
    app.slow["evt_2"] = 1.5
    proxy = await make_proxy(
        routes=[_handed_off_route()], upstream={"url": app.url, "timeout": "10s"},
        redeliverer=QUICK,
    )  # fmt: skip
    v2 = await proxy.post("/hooks", data=version("evt_2", "cus_1", 2))
    assert (v2.status, (await v2.json())["kept_for"]) == (202, "deadline")  # handed off
    v1 = await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))
    assert (v1.status, (await v1.json())["kept_for"]) == (202, "ordering")

    async def settled() -> bool:
        return (await _states(pg_dsn, table)).get("evt_1") not in (None, "pending")

    await wait_until(settled, "v1 settled by the redeliverer")
    assert await _states(pg_dsn, table) == {"evt_2": "delivered", "evt_1": "superseded"}
    assert app.applied == [("cus_1", 2)]
    assert (app.state, app.overlaps) == ({"cus_1": 2}, 0)


async def test_a_kept_version_is_not_sent_while_a_handed_off_one_of_its_object_is_at_the_app(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    """The campaign's object_in_flight_twice: the keep at a hand-off commits, and with it lets go
    of the object's row, while the app still has the delivery. A kept row of the object that
    arrived before it (the race the campaign met, set here by its times) is due meanwhile: it
    waits for the attempt's end, then is superseded by the version the app accepted."""
    app.slow["evt_2"] = 1.5
    proxy = await make_proxy(
        routes=[_handed_off_route()], upstream={"url": app.url, "timeout": "10s"},
        redeliverer=QUICK,
    )  # fmt: skip
    v2 = await proxy.post("/hooks", data=version("evt_2", "cus_1", 2))
    assert (v2.status, (await v2.json())["kept_for"]) == (202, "deadline")
    v1 = await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))
    assert (v1.status, (await v1.json())["kept_for"]) == (202, "ordering")
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET received_at = (SELECT received_at - interval '1 second' "
        f"FROM \"{table}\" WHERE scope = 'hooks' AND event_id = 'evt_2'), inbox_due = now() "
        "WHERE scope = 'hooks' AND event_id = 'evt_1'",
    )

    async def settled() -> bool:
        return (await _states(pg_dsn, table)).get("evt_1") not in (None, "pending")

    await wait_until(settled, "v1 settled by the redeliverer")
    assert app.overlaps == 0  # never two of cus_1 at the app at once
    assert await _states(pg_dsn, table) == {"evt_2": "delivered", "evt_1": "superseded"}
    assert (app.applied, app.state) == ([("cus_1", 2)], {"cus_1": 2})


async def test_object_rows_are_swept_with_the_retention_but_held_or_with_kept_deliveries(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    app.fail[("cus_2", 1)] = 1
    route = ordered(retention="1d", redeliver={"schedule": ["1h"], "for": "1d"})
    proxy = await make_proxy(routes=[route], upstream={"url": app.url}, redeliverer=QUICK)
    for n in (1, 2, 3):
        await proxy.post("/hooks", data=version(f"evt_{n}", f"cus_{n}", 1))
    objects = f"SELECT event_id FROM \"{table}\" WHERE scope = '~order/hooks' ORDER BY 1"
    assert [r["event_id"] for r in await fetch(pg_dsn, objects)] == ["cus_1", "cus_2", "cus_3"]
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET inbox_changed = now() - interval '3 days' "
        "WHERE scope = '~order/hooks'",
    )
    holder = await asyncpg.connect(pg_dsn)  # a delivery of cus_3 at the app
    try:
        async with holder.transaction():
            await holder.execute(
                f"SELECT FROM \"{table}\" WHERE scope = '~order/hooks' AND event_id = 'cus_3' "
                "FOR UPDATE"
            )
            removed = await sweeper_of(proxy).sweep()
    finally:
        await holder.close()

    assert removed is not None
    assert removed["~order/hooks"] == 1
    # cus_2 keeps a pending delivery; cus_3 was held.
    assert [r["event_id"] for r in await fetch(pg_dsn, objects)] == ["cus_2", "cus_3"]
    assert (await sweeper_of(proxy).sweep() or {})["~order/hooks"] == 1  # cus_3, freed
    # A swept object is ordered again from its next delivery on.
    assert (await proxy.post("/hooks", data=version("evt_4", "cus_1", 2))).status == 200
    assert [r["event_id"] for r in await fetch(pg_dsn, objects)] == ["cus_1", "cus_2"]


async def test_a_bulk_redeliver_of_dead_versions_keeps_them_behind_a_failing_head(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    app.fail_status = 400
    app.fail.update({("cus_1", 1): 1, ("cus_1", 2): 1, ("cus_1", 3): 1})
    route = ordered(redeliver={"schedule": ["1h"], "for": "1d"})
    proxy = await make_proxy(routes=[route], upstream={"url": app.url}, redeliverer=QUICK)
    for n in (1, 2, 3):
        dead = await proxy.post("/hooks", data=version(f"evt_{n}", "cus_1", n))
        assert dead.headers["Dedup-Status"] == "dead_letter"
    app.fail_status, app.fail[("cus_1", 1)] = 503, 1  # v1 fails once more when redelivered
    store = proxy.app[app_keys.STORE]

    # Every dead row of the scope made due at once, as events redeliver --dead and the
    # console's bulk redeliver do.
    changed = await store.inbox.redeliver("hooks", None, None, 86400.0)

    assert len(changed) == 3

    async def v1_failed_again() -> bool:
        rows = await fetch(
            pg_dsn,
            f'SELECT jsonb_array_length(inbox_attempts) AS n FROM "{table}" WHERE event_id = $1',
            "evt_1",
        )
        return bool(rows[0]["n"] >= 2)

    await wait_until(v1_failed_again, "v1 redelivered and failed")
    await asyncio.sleep(0.5)  # the redeliverer's polls pass: v1 is due again in 1h
    assert app.applied == []  # v2 and v3, due, wait behind their object's failed head
    assert app.overlaps == 0


# --- operators ----------------------------------------------------------------------------


async def test_events_show_and_the_console_say_which_delivery_an_object_waits_behind(
    make_proxy: MakeProxy, app: LastWriterWins, aiohttp_client: Any, pg_dsn: str, table: str
) -> None:
    app.fail[("cus_1", 1)] = 1
    route = ordered(redeliver={"schedule": ["1h"], "for": "1d"})
    route["order"] = {**route["order"], "supersede": ["customer.updated"]}
    proxy = await make_proxy(routes=[route], upstream={"url": app.url}, redeliverer=QUICK)
    assert (await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))).status == 202
    assert (await proxy.post("/hooks", data=version("evt_2", "cus_1", 2))).status == 202
    assert (await proxy.post("/hooks", data=version("evt_3", "cus_2", 5))).status == 200
    assert (await proxy.post("/hooks", data=version("evt_4", "cus_2", 4))).status == 200

    store = proxy.app[app_keys.STORE]
    shown = await store.inbox.show("hooks", "evt_2")
    assert shown is not None
    text = inbox_commands.describe(shown)
    assert "kept for:    not sent: another delivery of its object" in text
    assert "object:      cus_1 (version 2, accepted -)" in text
    assert "behind:      evt_1, pending since " in text
    assert inbox_commands.shown_json(shown)["object"]["behind"] == "evt_1"
    head = await store.inbox.show("hooks", "evt_1")
    assert head is not None
    assert "behind:      none: first of its object" in inbox_commands.describe(head)

    admin = await admin_client(aiohttp_client, proxy)
    async with admin.get("/console/event?scope=hooks&id=evt_2") as response:
        event_page = await response.text()
    assert "Kept behind</dt><dd>evt_1, pending since" in event_page
    async with admin.get("/console/events?state=superseded") as response:
        assert response.status == 200
        listed = await response.text()
    assert "evt_4" in listed
    assert "evt_3" not in listed
    samples = await scrape(admin)
    assert samples[("dedup_requests_total", (("outcome", "superseded"), ("route", "hooks")))] == 1
    assert samples[("dedup_inbox_kept_total", (("reason", "ordering"), ("route", "hooks")))] == 1


async def test_events_blocked_lists_objects_held_behind_a_failing_head_until_it_is_delivered(
    make_proxy: MakeProxy,
    app: LastWriterWins,
    aiohttp_client: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    pg_dsn: str,
    table: str,
) -> None:
    monkeypatch.setattr(redeliverer, "LEVEL_INTERVAL", 0.05)
    # An object key the route takes (no control or format character) that a terminal or a log
    # viewer would still break into a forged line.
    hostile = "cus_\u2028evt_9\u00a0hooks"
    app.fail.update({("cus_1", 1): 1, (hostile, 1): 1, ("cus_4", 1): 1})
    route = ordered(redeliver={"schedule": ["1h"], "for": "1d"})
    proxy = await make_proxy(routes=[route], upstream={"url": app.url}, redeliverer=QUICK)
    sent = [("cus_1", 1), ("cus_1", 2), ("cus_1", 3), (hostile, 1), (hostile, 2), ("cus_2", 1),
            ("cus_4", 1)]  # fmt: skip
    for n, (obj, v) in enumerate(sent, 1):
        await proxy.post("/hooks", data=version(f"evt_{n}", obj, v))
    assert app.applied == [("cus_2", 1)]
    cfg = proxy.app[app_keys.CONFIG]

    async def blocked(older_than: float = 0.0) -> dict[str, Any]:
        out = io.StringIO()
        assert (
            await inbox_commands.blocked(cfg, "hooks", older_than, 50, as_json=True, out=out) == 0
        )
        return json.loads(out.getvalue())

    listed = await blocked()
    # cus_4's failed head holds nothing behind it: not blocked; cus_2 was delivered.
    assert {o["object"]: (o["head"], o["behind"]) for o in listed["objects"]} == {
        "cus_1": ("evt_1", 2), hostile: ("evt_4", 1),
    }  # fmt: skip
    head = listed["objects"][0]
    assert (head["attempts"], head["last_status"], head["at_app"]) == (1, 503, False)
    assert (await blocked(3600.0))["objects"] == []  # no head pending for an hour yet

    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({
        "upstream": {"url": app.url}, "database": {"dsn": pg_dsn, "table": table},
        "routes": [route],
    }))  # fmt: skip
    status, out, err = await run_cli("events", "blocked", "--route", "hooks", "--config", str(path))
    assert (status, err) == (0, "")
    assert out.isascii()
    lines = out.splitlines()
    assert lines[0].split() == ["scope", "object", "head", "event_type", "pending_since", "state",
                                "attempts", "last", "behind"]  # fmt: skip
    assert lines[1].split()[:3] == ["hooks", "cus_1", "evt_1"]
    assert lines[1].split()[-3:] == ["1", "503", "2"]
    assert lines[2].split()[:3] == ["hooks", logs.printable(hostile), "evt_4"]
    assert lines[-1] == "2 blocked object(s) in scope hooks"

    admin = await admin_client(aiohttp_client, proxy)
    async with admin.get("/console/") as response:
        overview = await response.text()
    assert "Route hooks: 2 blocked objects" in overview
    assert '<a href="event?scope=hooks&amp;id=evt_1">evt_1</a>' in overview

    async def gauges(objects: float) -> bool:
        samples = await scrape(admin)
        labels = (("route", "hooks"),)
        oldest = samples.get(("dedup_ordering_oldest_blocked_seconds", labels), 0.0)
        return samples.get(("dedup_ordering_blocked_objects", labels)) == objects and oldest > 0

    await wait_until(lambda: gauges(2), "the level reader's blocked objects")

    # The app takes cus_1's head now: its versions follow in order, and it is blocked no more.
    await proxy.app[app_keys.STORE].inbox.redeliver("hooks", ["evt_1"], None, 86400.0)
    await wait_until(lambda: _applied(app, 4), "cus_1's three versions delivered")
    assert app.applied[1:] == [("cus_1", 1), ("cus_1", 2), ("cus_1", 3)]
    assert [o["object"] for o in (await blocked())["objects"]] == [hostile]
    await wait_until(lambda: gauges(1), "cus_1 no longer counted")


# --- least privilege ------------------------------------------------------------------------


async def test_an_ordered_route_without_the_inbox_grant_refuses_to_start_naming_it(
    proxy_config: Any, pg_dsn: str, table: str
) -> None:
    await execute(pg_dsn, sql.for_table(table).schema)
    async with limited_role(pg_dsn, table, DOCUMENTED) as (role, dsn):
        cfg = proxy_config(routes=[ordered()], database={"dsn": dsn, "create_schema": False})
        with pytest.raises(errors.StoreUnavailable) as refused:
            await start_up(cfg)
    assert f'{inbox.GRANT_HINT} ON "{table}" TO {role}' in refused.value.message
    assert "order locks an object's row" in refused.value.message


async def test_with_exactly_the_documented_grants_an_ordered_route_holds_keeps_and_sweeps(
    make_proxy: MakeProxy, app: LastWriterWins, pg_dsn: str, table: str
) -> None:
    await execute(pg_dsn, sql.for_table(table).schema)
    app.fail[("cus_1", 1)] = 1
    route = ordered(retention="1d", redeliver={"schedule": ["300ms"], "for": "1d"})
    route["order"] = {**route["order"], "supersede": ["customer.updated"]}
    async with limited_role(pg_dsn, table, DOCUMENTED, INBOX, counts=True) as (_, dsn):
        proxy = await make_proxy(
            routes=[route],
            upstream={"url": app.url, "concurrency": 3},
            redeliverer=QUICK,
            database={"dsn": dsn, "create_schema": False, "pool_size": 6},
        )
        # The object's lock (INSERT ... ON CONFLICT DO UPDATE), a keep behind a failed head,
        # the take's FOR UPDATE of the object's row, the accepted version, a superseded event.
        first = await proxy.post("/hooks", data=version("evt_1", "cus_1", 1))
        behind = await proxy.post("/hooks", data=version("evt_2", "cus_1", 2))
        assert (first.status, behind.status) == (202, 202)
        await wait_until(lambda: _applied(app, 2), "both delivered, as the limited role")
        stale = await proxy.post("/hooks", data=version("evt_0", "cus_1", 0))
        assert stale.headers["Dedup-Status"] == "superseded"
        answers = await asyncio.gather(
            *(proxy.post("/hooks", data=version(f"e{n}", "cus_2", n)) for n in range(6))
        )
        assert {a.status for a in answers} <= {200, 202}  # 202: kept, the limit reached
        await wait_until(lambda: _settled(pg_dsn, table), "none pending, as the limited role")
        await execute(
            pg_dsn,
            f"UPDATE \"{table}\" SET inbox_changed = now() - interval '3 days' "
            "WHERE scope = '~order/hooks'",
        )
        removed = await sweeper_of(proxy).sweep()  # the object rows' DELETE ... SKIP LOCKED
    assert app.applied[:2] == [("cus_1", 1), ("cus_1", 2)]
    # Versions kept by the limit and passed by a newer one are superseded, not sent after it.
    assert app.state == {"cus_1": 2, "cus_2": 5}
    assert app.overlaps == 0
    assert removed is not None
    assert removed["~order/hooks"] == 2


async def _settled(pg_dsn: str, table: str) -> bool:
    pending = f"SELECT FROM \"{table}\" WHERE inbox_state = 'pending'"
    return not await fetch(pg_dsn, pending)
