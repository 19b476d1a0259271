"""A limit at the app held by every replica together (``upstream.concurrency: {limit: N,
shared: true}``, ``database.slots``): places that are rows locked in the transaction of each
delivery at the app. Off (the number's form) nothing changes; on, replicas on one claim table
never have more than N at the app, and a replica killed holding places frees them with its
connections. Real PostgreSQL; the burst and the kill across real ``serve`` processes."""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from typing import Any

import aiohttp
import pytest
import yaml

from proxy import app_keys, app_limit, database, errors
from proxy.database import inbox, slots, sql
from tests.helpers import (
    CORVEL,
    FakeUpstream,
    MakeProxy,
    Serve,
    Served,
    SlowApp,
    execute,
    fetch,
    github_headers,
    github_route,
    slow_app,
    start_up,
    wait_until,
)
from tests.roles import DOCUMENTED, INBOX, limited_role

KEPT = {"name": "hooks", "path": "/hooks", "event_id": "body:/id",
        "redeliver": {"schedule": ["200ms"], "for": "1d"}}  # fmt: skip
PLAIN = {"name": "plain", "path": "/plain", "event_id": "body:/id"}
QUICK = {"poll": "100ms"}
SHARED = {"concurrency": {"limit": 2, "shared": True}}
PLACES = ["0000000000", "0000000001", "0000000002"]  # the places' IDs, slots.WIDTH digits


def test_the_mapping_form_shares_the_limit_and_the_number_stays_per_replica(
    proxy_config: Any,
) -> None:
    shared = proxy_config(upstream={"concurrency": {"limit": 4, "shared": True}}).upstream
    assert (shared.concurrency, shared.shared) == (4, True)
    per_replica = proxy_config(upstream={"concurrency": 4}).upstream
    assert (per_replica.concurrency, per_replica.shared) == (4, False)
    unshared = proxy_config(upstream={"concurrency": {"limit": 4, "shared": False}}).upstream
    assert (unshared.concurrency, unshared.shared) == (4, False)
    # Shared, the limit is not this replica's to fit into its pool: each worker's room is what
    # its pool allows (up to the limit), the shared places the bound.
    big = proxy_config(workers=2, upstream={"concurrency": {"limit": 100, "shared": True}})
    assert big.upstream.concurrency == 100
    assert app_limit.share(100, 2, 4, keeps=True, shared=True) == 3
    assert app_limit.share(2, 2, 4, keeps=False, shared=True) == 2


def test_a_mapping_without_a_limit_or_with_an_unknown_key_is_refused(proxy_config: Any) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        proxy_config(upstream={"concurrency": {"shared": True, "limt": 3}})
    assert "upstream.concurrency.limit: is required" in str(refused.value)
    assert "upstream.concurrency.limt: unknown key" in str(refused.value)


async def _slot_rows(dsn: str, table: str) -> list[str]:
    rows = await fetch(
        dsn, f"SELECT event_id FROM \"{table}\" WHERE scope = '~slots/app' ORDER BY event_id"
    )
    return [row["event_id"] for row in rows]


async def test_off_no_slot_rows_are_made_and_no_place_is_taken(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy = await make_proxy(routes=[PLAIN], upstream={"concurrency": 2})
    assert (await proxy.post("/plain", data=b'{"id": "off"}')).status == 200
    assert proxy.app[app_keys.STORE].slots is None
    assert await _slot_rows(pg_dsn, table) == []


async def test_a_row_of_the_places_scope_with_an_id_of_another_width_is_never_a_place(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """IDs of another width (a build before the places' IDs had ten digits wrote "0", "1", …)
    fall outside "from 0000000000 to below N": the limit stays N."""
    await _made(pg_dsn, table)
    await execute(
        pg_dsn, f"INSERT INTO \"{table}\" (scope, event_id, event_type) "
        "SELECT '~slots/app', g::text, 'slot' FROM generate_series(0, 9) AS g",
    )  # fmt: skip
    upstream.gate = asyncio.Event()
    one, two = [
        await make_proxy(
            routes=[PLAIN], upstream={"concurrency": {"limit": 1, "shared": True}},
            database={"pool_timeout": "300ms"},
        )
        for _ in range(2)
    ]  # fmt: skip
    first = asyncio.ensure_future(one.post("/plain", data=b'{"id": "a"}'))
    await wait_until(lambda: _at_app(upstream, 1), "the first at the app")
    second = await two.post("/plain", data=b'{"id": "b"}')  # the other replica: its room free
    assert second.status == 503  # not sent on row "0"
    assert len(upstream.requests) == 1
    assert await one.app[app_keys.STORE].places_held() == 1
    upstream.gate.set()
    assert (await first).status == 200


async def test_the_places_are_made_at_start_and_a_smaller_limit_takes_only_its_own(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    await make_proxy(routes=[PLAIN], upstream={"concurrency": {"limit": 3, "shared": True}})
    assert await _slot_rows(pg_dsn, table) == PLACES[:3]
    # A rolling restart to a limit of 1: the old rows stay, only place 0 is ever taken.
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(
        routes=[PLAIN], upstream={"concurrency": {"limit": 1, "shared": True}},
        database={"pool_timeout": "300ms"},
    )  # fmt: skip
    assert await _slot_rows(pg_dsn, table) == PLACES[:3]
    first = asyncio.ensure_future(proxy.post("/plain", data=b'{"id": "a"}'))
    await wait_until(lambda: _at_app(upstream, 1), "the first at the app")
    second = await proxy.post("/plain", data=b'{"id": "b"}')
    assert second.status == 503
    assert (await second.json())["error"] == "app_busy"
    assert len(upstream.requests) == 1
    upstream.gate.set()
    assert (await first).status == 200
    assert (await proxy.post("/plain", data=b'{"id": "b"}')).status == 200


async def _at_app(upstream: FakeUpstream, n: int) -> bool:
    return len(upstream.requests) >= n


async def test_two_proxies_on_one_table_never_have_more_than_the_shared_limit_at_the_app(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """Each proxy's own room would let 3 in (pool 4, less 1): the shared 2 holds for both; a
    request waits for a place, the claim held, and goes when one frees."""
    upstream.gate = asyncio.Event()
    one = await make_proxy(routes=[PLAIN], upstream=SHARED)
    two = await make_proxy(routes=[PLAIN], upstream=SHARED)
    sent = [
        asyncio.ensure_future(proxy.post("/plain", data=json.dumps({"id": f"e{n}"}).encode()))
        for n, proxy in enumerate([one, two, one, two])
    ]
    await wait_until(lambda: _at_app(upstream, 2), "two at the app")
    await asyncio.sleep(0.3)  # the two others look for a place again and again meanwhile
    assert len(upstream.requests) == 2
    upstream.gate.set()
    assert [(await answer).status for answer in sent] == [200] * 4
    assert len(upstream.requests) == 4
    waited = sum(
        proxy.app[app_keys.METRICS].registry.get_sample_value("dedup_app_place_waits_total") or 0
        for proxy in (one, two)
    )
    assert waited == 2


async def test_over_the_shared_limit_a_redeliver_route_keeps_and_the_lanes_send_in_its_places(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    one = await make_proxy(routes=[KEPT], upstream=SHARED, redeliverer=QUICK)
    two = await make_proxy(routes=[KEPT], upstream=SHARED, redeliverer=QUICK)
    sent = [
        asyncio.ensure_future(proxy.post("/hooks", data=json.dumps({"id": f"k{n}"}).encode()))
        for n, proxy in enumerate([one, two])
    ]
    await wait_until(lambda: _at_app(upstream, 2), "two at the app")
    kept = await two.post("/hooks", data=b'{"id": "over"}')
    assert kept.status == 202
    assert (await kept.json())["kept_for"] == "limit"
    await asyncio.sleep(0.5)  # the lanes find it due, and no place for it
    assert len(upstream.requests) == 2
    upstream.gate.set()
    assert [(await answer).status for answer in sent] == [200, 200]
    await wait_until(lambda: _at_app(upstream, 3), "the kept one redelivered")
    assert sorted(r.body for r in upstream.requests)[-1] == b'{"id": "over"}'


async def test_a_hand_off_keeps_its_place_until_the_app_answers(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """The hand-off's keep commits the claim, and the place it held with it: a second place,
    held on its own connection, carries the attempt's until the app answers. (Another proxy's
    requests: this one's own room still counts the attempt.)"""
    upstream.gate = asyncio.Event()
    handed = {**KEPT, "hand_off": "300ms"}
    settings = {"upstream": {"concurrency": {"limit": 2, "shared": True}}, "redeliverer": QUICK}
    one = await make_proxy(routes=[handed], **settings)
    two = await make_proxy(routes=[handed], **settings)
    first = await one.post("/hooks", data=b'{"id": "slow"}')
    assert (await first.json())["kept_for"] == "deadline"  # answered; the app still works
    second = asyncio.ensure_future(two.post("/hooks", data=b'{"id": "next"}'))
    await wait_until(lambda: _at_app(upstream, 2), "the second at the app")
    # Two at the app, the first's place carried: a third is kept, not sent.
    third = await two.post("/hooks", data=b'{"id": "third"}')
    assert (await third.json())["kept_for"] in ("limit", "deadline")
    await asyncio.sleep(0.5)
    assert len(upstream.requests) == 2
    upstream.gate.set()
    await second
    await wait_until(lambda: _at_app(upstream, 3), "the third redelivered")


async def test_the_places_held_are_read_into_their_gauge(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(routes=[KEPT], upstream=SHARED, redeliverer=QUICK)
    sent = asyncio.ensure_future(proxy.post("/hooks", data=b'{"id": "held"}'))
    await wait_until(lambda: _at_app(upstream, 1), "one at the app")
    store = proxy.app[app_keys.STORE]
    assert await store.places_held() == 1
    upstream.gate.set()
    await sent
    assert await store.places_held() == 0


async def test_three_replicas_never_have_more_than_the_shared_limit_at_the_app(
    serve: Serve, aiohttp_server: Any, pg_dsn: str, table: str
) -> None:
    """3 replicas (each would let 5 in alone), a shared limit of 4, an app taking half a
    second, 48 deliveries at about 30 a second spread over them: every one accepted, each taken
    once, never more than 4 at the app."""
    app, url = await slow_app(aiohttp_server, delay=0.5)
    settings = {
        "upstream": {"url": url, "timeout": "30s",
                     "concurrency": {"limit": 4, "shared": True}},
        "database": {"pool_size": 6},
        "routes": [github_route(redeliver={"schedule": ["1s"], "for": "1d"})],
        "redeliverer": QUICK,
    }  # fmt: skip
    replicas = [await serve(**settings) for _ in range(3)]
    total = 48
    bodies = [json.dumps({"n": n}).encode() for n in range(total)]

    async def deliver(session: aiohttp.ClientSession, n: int) -> int:
        await asyncio.sleep(n / 30)
        headers = github_headers(bodies[n], f"d-{n}")
        async with session.post(f"{replicas[n % 3].url}/webhooks/github", data=bodies[n],
                                headers=headers) as answer:  # fmt: skip
            return answer.status

    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(deliver(session, n) for n in range(total)))

    answered = Counter(statuses)
    assert set(answered) <= {200, 202}, answered
    await wait_until(lambda: _all_taken(app, total), "every event at the app", within=90)
    assert sorted(app.took) == sorted(bodies)  # each exactly once
    assert app.peak <= 4, app.peak
    print(f"shared limit 4 over 3 replicas: peak {app.peak}, answered {dict(answered)}")


async def _all_taken(app: SlowApp, n: int) -> bool:
    return len(app.took) >= n


async def test_a_replica_killed_holding_every_place_frees_them(
    serve: Serve, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()  # the app holds every request until the test's end
    settings = {
        "upstream": {"concurrency": {"limit": 2, "shared": True}},
        "database": {"pool_timeout": "20s"},
        "routes": [CORVEL],
    }
    holder, other = await serve(**settings), await serve(**settings)
    async with aiohttp.ClientSession() as session:
        held = [
            asyncio.ensure_future(session.post(f"{holder.url}/webhooks/corvel",
                                               data=json.dumps({"id": f"h{n}"}).encode()))
            for n in range(2)
        ]  # fmt: skip
        await wait_until(lambda: _at_app(upstream, 2), "the holder's two at the app")
        waiting = asyncio.ensure_future(
            session.post(f"{other.url}/webhooks/corvel", data=b'{"id": "after"}')
        )
        await asyncio.sleep(0.5)
        assert len(upstream.requests) == 2  # no place for it while the holder lives
        await holder.kill()  # SIGKILL: its connections close, its transactions roll back
        await wait_until(lambda: _at_app(upstream, 3), "the other's event at the app", within=10)
        assert upstream.requests[2].body == b'{"id": "after"}'
        upstream.gate.set()
        assert (await waiting).status == 200
        for answer in held:
            answer.cancel()
    rows = await fetch(pg_dsn, f"SELECT event_id FROM \"{table}\" WHERE scope = 'corvel'")
    assert [row["event_id"] for row in rows] == ["after"]  # the holder's were rolled back


async def _post(url: str, event: str) -> int:
    """One webhook on a connection of its own (none kept alive into a worker's drain)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        body = json.dumps({"id": event}).encode()
        async with session.post(f"{url}/webhooks/corvel", data=body) as answer:
            return answer.status


async def _reload(served: Served, limit: int, count: int) -> None:
    """Set the shared limit in ``served``'s file, SIGHUP its supervisor, and wait for its
    ``count``-th "reloaded" line (the new workers listen; the old ones drain)."""
    settings = yaml.safe_load(served.config_file.read_text())
    settings["upstream"]["concurrency"] = {"limit": limit, "shared": True}
    served.config_file.write_text(yaml.safe_dump(settings))
    served.process.send_signal(signal.SIGHUP)

    async def reloaded() -> bool:
        return sum(1 for x in served.lines() if x["msg"].startswith("reloaded")) >= count

    await wait_until(reloaded, f"reload {count}", within=60)


async def test_a_shared_limit_raised_then_lowered_by_sighup_holds_the_larger_while_old_drain(
    serve: Serve, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """``workers: 2``, a shared limit of 2, the app holding every request. Raised to 4 by
    SIGHUP while the old workers hold 2 and one waits: the new workers make places 2 and 3 and
    take them (4 at the app), a fifth waits; then lowered to 1 with 4 held: the new workers
    wait for place 0 until the old ones' attempts end, and from then on 1 is at the app."""
    upstream.gate = asyncio.Event()
    served = await serve(
        workers=2, upstream={"concurrency": {"limit": 2, "shared": True}},
        database={"pool_timeout": "30s"}, shutdown_timeout="30s",
    )  # fmt: skip
    first = [asyncio.ensure_future(_post(served.url, f"old-{n}")) for n in range(3)]
    await wait_until(lambda: _at_app(upstream, 2), "the old workers' two at the app")
    await _reload(served, 4, 1)
    assert await _slot_rows(pg_dsn, table) == [slots.place_id(n) for n in range(4)]
    second = [asyncio.ensure_future(_post(served.url, f"new-{n}")) for n in range(3)]
    await wait_until(lambda: _at_app(upstream, 4), "the new workers' places 2 and 3 taken")
    await asyncio.sleep(1)
    assert len(upstream.requests) == 4  # never more than the larger limit: 2 wait
    upstream.gate.set()
    assert await asyncio.gather(*first, *second) == [200] * 6

    # Lowered to 1 while the workers of limit 4 hold 4 places.
    upstream.gate, before = asyncio.Event(), len(upstream.requests)
    held = [asyncio.ensure_future(_post(served.url, f"four-{n}")) for n in range(4)]
    await wait_until(lambda: _at_app(upstream, before + 4), "four at the app")
    await _reload(served, 1, 2)
    lowered = [asyncio.ensure_future(_post(served.url, f"one-{n}")) for n in range(2)]
    await asyncio.sleep(1)
    assert len(upstream.requests) == before + 4  # no more than 4, the new ones wait
    gate, upstream.gate = upstream.gate, asyncio.Event()
    gate.set()  # the old workers' four end; the new workers take place 0, one at a time
    assert await asyncio.gather(*held) == [200] * 4
    await wait_until(lambda: _at_app(upstream, before + 5), "one of the new at the app")
    await asyncio.sleep(1)
    assert len(upstream.requests) == before + 5  # the new limit: one at the app
    upstream.gate.set()
    assert await asyncio.gather(*lowered) == [200] * 2


def test_the_backoff_is_short_and_bounded() -> None:
    assert all(0 < slots.backoff(tries) <= slots.BACKOFF_MAX for tries in range(20))
    assert slots.backoff() <= slots.BACKOFF_MAX


async def _made(dsn: str, table: str) -> None:
    await execute(dsn, sql.for_table(table).schema)


async def test_a_shared_limit_without_the_inbox_grant_refuses_to_start_naming_it(
    proxy_config: Any, pg_dsn: str, table: str
) -> None:
    """FOR UPDATE needs UPDATE on a column: the inbox's grant is the one asked for."""
    await _made(pg_dsn, table)
    async with limited_role(pg_dsn, table, DOCUMENTED) as (role, dsn):
        cfg = proxy_config(
            routes=[PLAIN], upstream=SHARED, database={"dsn": dsn, "create_schema": False}
        )
        with pytest.raises(errors.StoreUnavailable) as refused:
            await start_up(cfg)
    assert f'{inbox.GRANT_HINT} ON "{table}" TO {role}' in refused.value.message


async def test_on_a_table_citus_distributes_a_shared_limit_refuses_to_start_naming_why(
    proxy_config: Any, pg_dsn: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Citus spreads the places over its shards by event_id and locks no rows across shards:
    every take would fail, so the start is refused, saying to set the limit per replica. (No
    Citus in CI: its catalog's answer is given.)"""

    async def distributed(_: database.Store) -> database.Distribution:
        return database.Distribution("event_id", 32)

    monkeypatch.setattr(database.Store, "distribution", distributed)
    cfg = proxy_config(routes=[PLAIN], upstream=SHARED)
    with pytest.raises(errors.StoreUnavailable) as refused:
        await start_up(cfg)
    assert refused.value.message == slots.NOT_ON_CITUS
    assert await _slot_rows(pg_dsn, table) == []  # no place made, none to take
    per_replica = proxy_config(routes=[PLAIN], upstream={"concurrency": 2})
    await start_up(per_replica)  # the per-replica limit starts there


async def test_with_the_documented_grants_a_shared_limit_takes_its_places(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    await _made(pg_dsn, table)
    async with limited_role(pg_dsn, table, DOCUMENTED, INBOX, counts=True) as (_, dsn):
        proxy = await make_proxy(
            routes=[PLAIN], upstream=SHARED, database={"dsn": dsn, "create_schema": False}
        )
        assert (await proxy.post("/plain", data=b'{"id": "granted"}')).status == 200
        assert await proxy.app[app_keys.STORE].places_held() == 0
    assert await _slot_rows(pg_dsn, table) == PLACES[:2]
