"""Flow control (``app_limit``): the app gets at most ``upstream.concurrency`` requests at once;
on a route with ``redeliver`` what is over the limit is kept (202) and sent when there is room,
on any other route it waits its turn, then 503. Real PostgreSQL; the burst across real
``serve`` processes."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy import errors
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    Serve,
    fetch,
    github_headers,
    github_route,
    wait_until,
)

KEPT = {"name": "hooks", "path": "/hooks", "event_id": "body:/id",
        "redeliver": {"schedule": ["200ms"], "for": "1d"}}  # fmt: skip
PLAIN = {"name": "plain", "path": "/plain", "event_id": "body:/id"}
QUICK = {"poll": "100ms"}


class SlowApp:
    """An app that takes ``delay`` per webhook: records each body it took and the most
    requests it had at once."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.now = 0
        self.peak = 0
        self.took: list[bytes] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.now -= 1
        self.took.append(body)
        return web.Response(text="ok")


async def slow_app(aiohttp_server: Any, delay: float) -> tuple[SlowApp, str]:
    app = SlowApp(delay)
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", app.handle)
    server = await aiohttp_server(application)
    return app, str(server.make_url("")).rstrip("/")


async def test_over_the_limit_a_redeliver_route_keeps_the_delivery_and_sends_it_when_there_is_room(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(
        routes=[KEPT], upstream={"concurrency": 1}, redeliverer=QUICK, log={"level": "info"}
    )
    first = asyncio.ensure_future(proxy.post("/hooks", data=b'{"id": "evt_1"}'))
    await wait_until(lambda: _count(upstream, 1), "the first delivery at the app")

    second = await proxy.post("/hooks", data=b'{"id": "evt_2"}')

    assert second.status == 202  # kept at once, not waited on, not refused
    assert second.headers["Dedup-Status"] == "queued"
    assert await second.json() == {"status": "queued", "event_id": "evt_2", "kept_for": "limit"}
    assert len(upstream.requests) == 1  # the app was not sent it: it had no room
    copy = await proxy.post("/hooks", data=b'{"id": "evt_2"}')
    assert (copy.status, copy.headers["Dedup-Status"]) == (202, "duplicate_queued")
    upstream.gate.set()
    assert (await first).status == 200
    await wait_until(lambda: _count(upstream, 2), "the kept delivery sent when there was room")
    await wait_until(lambda: _state(pg_dsn, table, "evt_2", "delivered"), "delivered")
    assert [r.body for r in upstream.requests] == [b'{"id": "evt_1"}', b'{"id": "evt_2"}']
    row = (await fetch(pg_dsn, f'SELECT inbox_attempts FROM "{table}" WHERE event_id = $1',
                       "evt_2"))[0]  # fmt: skip
    attempts = json.loads(row["inbox_attempts"])
    assert [(a["status"], a["error"]) for a in attempts] == [
        (None, "not sent: the limit at the app was reached (upstream.concurrency)"),
        (200, None),
    ]


async def test_over_the_limit_another_route_waits_its_turn_then_is_refused_503(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(
        routes=[PLAIN], upstream={"concurrency": 1}, database={"pool_timeout": "300ms"}
    )
    first = asyncio.ensure_future(proxy.post("/plain", data=b'{"id": "a"}'))
    await wait_until(lambda: _count(upstream, 1), "the first delivery at the app")

    refused = await proxy.post("/plain", data=b'{"id": "b"}')

    assert refused.status == 503
    assert refused.headers["Retry-After"] == "5"
    assert (await refused.json())["error"] == errors.AppBusy.code
    # Waiting its turn: sent once the first is answered, within the wait.
    waiting = asyncio.ensure_future(proxy.post("/plain", data=b'{"id": "c"}'))
    await asyncio.sleep(0.1)
    assert len(upstream.requests) == 1
    upstream.gate.set()
    assert (await first).status == 200
    assert (await waiting).status == 200
    assert [r.body for r in upstream.requests] == [b'{"id": "a"}', b'{"id": "c"}']


def test_the_limit_is_per_replica_shared_out_among_workers_and_fits_the_pool(
    proxy_config: Any,
) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        proxy_config(routes=[KEPT], upstream={"concurrency": 1}, workers=2)
    assert "upstream.concurrency: is per replica, shared out among its 2 workers" in str(
        refused.value
    )
    with pytest.raises(errors.ConfigError) as refused:
        proxy_config(routes=[KEPT], upstream={"concurrency": 8}, database={"pool_size": 4})
    assert (
        "upstream.concurrency: 8 shared out among 1 worker(s) is 8 each, more than "
        "database.pool_size 4 allows at the app, less 1 kept for short transactions (3): "
        "raise pool_size to 9 or lower concurrency"
    ) in str(refused.value)
    assert proxy_config(routes=[KEPT], upstream={"concurrency": 3}).upstream.concurrency == 3


async def test_a_burst_ten_times_what_the_app_takes_from_a_sender_that_never_retries(
    serve: Serve, aiohttp_server: Any, pg_dsn: str, table: str, tmp_path: Any
) -> None:
    """2 replicas of 2 workers, 4 at the app per replica: 80 GitHub deliveries sent at once,
    each once. Every one is accepted (200 or 202), the app has at most 8 at once, and takes
    each exactly once."""
    app, url = await slow_app(aiohttp_server, delay=0.3)
    settings = {
        "upstream": {"url": url, "timeout": "30s", "concurrency": 4},
        "workers": 2,
        "routes": [github_route(redeliver={"schedule": ["1s"], "for": "1d"})],
        "redeliverer": QUICK,
    }
    replicas = [await serve(**settings), await serve(**settings)]
    bodies = [json.dumps({"n": n}).encode() for n in range(80)]

    async def deliver(session: aiohttp.ClientSession, n: int) -> int:
        replica = replicas[n % 2]
        headers = github_headers(bodies[n], f"d-{n}")
        async with session.post(f"{replica.url}/webhooks/github", data=bodies[n],
                                headers=headers) as answer:  # fmt: skip
            return answer.status

    async with aiohttp.ClientSession() as session:
        statuses = await asyncio.gather(*(deliver(session, n) for n in range(80)))

    answered = Counter(statuses)
    assert set(answered) <= {200, 202}, answered  # nothing refused
    assert answered[202] > 0  # the burst was over the limit
    await wait_until(lambda: _all_taken(app, 80), "every event at the app", within=60)
    await wait_until(lambda: _none_pending(pg_dsn, table), "the inbox drained", within=30)
    assert sorted(app.took) == sorted(bodies)  # each exactly once
    assert app.peak <= 8
    samples = [await replica.metrics() for replica in replicas]
    kept = sum(s['dedup_inbox_kept_total{reason="limit",route="github"}'] for s in samples)
    assert kept == answered[202]
    assert [s["dedup_app_limit"] for s in samples] == [4, 4]


async def _count(upstream: FakeUpstream, n: int) -> bool:
    return len(upstream.requests) >= n


async def _all_taken(app: SlowApp, n: int) -> bool:
    return len(app.took) >= n


async def _state(dsn: str, table: str, event_id: str, state: str) -> bool:
    rows = await fetch(dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1', event_id)
    return bool(rows) and rows[0]["inbox_state"] == state


async def _none_pending(dsn: str, table: str) -> bool:
    rows = await fetch(dsn, f"SELECT count(*) AS n FROM \"{table}\" WHERE inbox_state = 'pending'")
    return rows[0]["n"] == 0
