"""Flow control (``app_limit``): the app gets at most ``upstream.concurrency`` requests at once;
on a route with ``redeliver`` what is over the limit is kept (202) and sent when there is room,
on any other route it waits its turn, then 503. Real PostgreSQL; the burst across real
``serve`` processes."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy import app_keys, app_limit, config, console_gate, delivery, errors, inbox_commands
from proxy.database import inbox
from proxy.upstream import http1
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    Serve,
    SlowApp,
    admin_client,
    fetch,
    github_headers,
    github_route,
    slow_app,
    wait_until,
)

KEPT = {"name": "hooks", "path": "/hooks", "event_id": "body:/id",
        "redeliver": {"schedule": ["200ms"], "for": "1d"}}  # fmt: skip
PLAIN = {"name": "plain", "path": "/plain", "event_id": "body:/id"}
QUICK = {"poll": "100ms"}


async def test_over_the_limit_a_redeliver_route_keeps_the_delivery_and_sends_it_when_there_is_room(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(
        routes=[KEPT], upstream={"concurrency": 1}, redeliverer=QUICK, log={"level": "info"}
    )
    first = asyncio.ensure_future(proxy.post("/hooks", data=b'{"id": "evt_1"}'))
    await wait_until(lambda: _count(upstream, 1), "the first delivery at the app")

    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        second = await proxy.post("/hooks", data=b'{"id": "evt_2"}')
    # Kept by flow control, as configured: info, not a warning per delivery of a burst.
    lines = [(r.levelname, r.fields["outcome"], r.fields.get("kept_for"))
             for r in caplog.records if hasattr(r, "fields")]  # fmt: skip
    assert lines == [("INFO", "queued", "limit")]

    assert second.status == 202  # kept at once, not waited on, not refused
    assert second.headers["Dedup-Status"] == "queued"
    assert await second.json() == {"status": "queued", "event_id": "evt_2", "kept_for": "limit"}
    assert len(upstream.requests) == 1  # the app was not sent it: it had no room
    copy = await proxy.post("/hooks", data=b'{"id": "evt_2"}')
    assert (copy.status, copy.headers["Dedup-Status"]) == (202, "duplicate_queued")
    # The kept row says why it was kept, and `events show` says it in words.
    kept = (await fetch(pg_dsn, f'SELECT inbox_request, inbox_body FROM "{table}" '
                        "WHERE event_id = $1", "evt_2"))[0]  # fmt: skip
    request = inbox.StoredRequest.decoded(kept["inbox_request"], kept["inbox_body"])
    assert request.kept_for == "limit"
    shown = inbox_commands.describe(
        inbox.Shown("hooks", "evt_2", None, datetime.now(UTC), "pending", request,
                    len(request.body), [], None, None, None)
    )  # fmt: skip
    assert "kept for:    not sent: the limit at the app was reached (upstream.concurrency)\n" in (
        shown
    )
    tried = inbox_commands.describe(
        inbox.Shown("hooks", "evt_2", None, datetime.now(UTC), "pending", request,
                    len(request.body), [{"at": "2026-12-04T10:00:00+00:00", "status": 503}],
                    None, None, None)
    )  # fmt: skip
    assert "(upstream.concurrency) (when it was kept; tried since: the attempts below)\n" in tried
    upstream.gate.set()
    assert (await first).status == 200
    await wait_until(lambda: _count(upstream, 2), "the kept delivery sent when there was room")
    await wait_until(lambda: _state(pg_dsn, table, "evt_2", "delivered"), "delivered")
    assert [r.body for r in upstream.requests] == [b'{"id": "evt_1"}', b'{"id": "evt_2"}']
    row = (await fetch(pg_dsn, f'SELECT inbox_attempts FROM "{table}" WHERE event_id = $1',
                       "evt_2"))[0]  # fmt: skip
    attempts = json.loads(row["inbox_attempts"])
    assert [(a["status"], a["error"]) for a in attempts] == [(200, None)]  # one, not two


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


async def test_a_flood_on_a_route_without_verify_does_not_queue_ahead_of_a_signed_delivery(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    """The place the app frees goes to the signed delivery waiting, not to the unsigned
    requests queued before it: a flood anyone can send holds what it has, no more."""
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(
        routes=[PLAIN, github_route()], upstream={"concurrency": 1},
        database={"pool_timeout": "30s"},
    )  # fmt: skip
    room = proxy.app[app_keys.ROOM]
    first = asyncio.ensure_future(proxy.post("/plain", data=b'{"id": "a"}'))
    await wait_until(lambda: _count(upstream, 1), "the first delivery at the app")
    flood = [
        asyncio.ensure_future(proxy.post("/plain", data=b'{"id": "f%d"}' % n)) for n in range(4)
    ]
    await wait_until(lambda: _waiting(room, 4), "the flood waiting")
    body = json.dumps({"zen": "signed"}).encode()
    signed = asyncio.ensure_future(
        proxy.post("/webhooks/github", data=body, headers=github_headers(body, "d-1"))
    )
    await wait_until(lambda: _waiting(room, 5), "the signed delivery waiting")
    upstream.gate.set()

    answers = [await first, await signed, *[await f for f in flood]]

    assert [a.status for a in answers] == [200] * 6
    assert upstream.started == ["/plain", "/webhooks/github"] + ["/plain"] * 4


async def _waiting(room: app_limit.Room, count: int) -> bool:
    return room.waiting == count


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


HANDED = {**KEPT, "hand_off": "300ms"}


async def test_an_app_slower_than_the_hand_off_the_provider_is_answered_and_the_app_sees_it_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy(routes=[HANDED], redeliverer=QUICK)
    first = asyncio.ensure_future(proxy.post("/hooks", data=b'{"id": "slow"}'))
    await wait_until(lambda: _count(upstream, 1), "the first delivery at the app")
    copy_here = asyncio.ensure_future(proxy.post("/hooks", data=b'{"id": "slow"}'))

    answer = await asyncio.wait_for(first, 10)  # answered while the app still works on it

    assert answer.status == 202
    assert await answer.json() == {"status": "queued", "event_id": "slow", "kept_for": "deadline"}
    assert answer.headers["Connection"] == "close"
    assert len(upstream.requests) == 1
    # A copy queued in this process, and one arriving now: duplicates of a kept event.
    for copy in (await copy_here, await proxy.post("/hooks", data=b'{"id": "slow"}')):
        assert (copy.status, copy.headers["Dedup-Status"]) == (202, "duplicate_queued")
    row = await _row(pg_dsn, table, "slow")
    assert row["inbox_state"] == "pending"
    assert row["due_in"] > 9  # its lease: upstream.timeout (5 s) + 5 s from the hand-off
    kept = (await fetch(pg_dsn, f'SELECT inbox_request FROM "{table}" WHERE event_id = $1',
                        "slow"))[0]  # fmt: skip
    assert json.loads(kept["inbox_request"])["kept_for"] == "handed_off"  # for events show
    upstream.gate.set()
    await wait_until(lambda: _state(pg_dsn, table, "slow", "delivered"), "the answer recorded")
    await asyncio.sleep(0.5)  # a lane would have sent it by now, had it been due
    assert len(upstream.requests) == 1
    attempts = json.loads((await _row(pg_dsn, table, "slow"))["inbox_attempts"])
    assert [(a["status"], a["error"]) for a in attempts] == [(200, None)]  # one, not two


async def test_an_app_that_fails_after_the_hand_off_leaves_the_delivery_pending_on_schedule(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    upstream.respond = lambda n: web.Response(status=503 if n == 0 else 200)
    proxy = await make_proxy(routes=[HANDED], redeliverer=QUICK)
    first = asyncio.ensure_future(proxy.post("/hooks", data=b'{"id": "fails"}'))
    assert (await asyncio.wait_for(first, 10)).status == 202
    upstream.gate.set()

    await wait_until(lambda: _state(pg_dsn, table, "fails", "delivered"), "the redelivery")

    assert len(upstream.requests) == 2
    attempts = json.loads((await _row(pg_dsn, table, "fails"))["inbox_attempts"])
    assert [a["status"] for a in attempts] == [503, 200]


async def test_kill_9_during_a_hand_off_loses_nothing_and_sends_again_only_after_its_lease(
    serve: Serve, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    settings = {"upstream": {"timeout": "2s"}, "routes": [HANDED], "redeliverer": QUICK}
    served = await serve(**settings)
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{served.url}/hooks", data=b'{"id": "k9"}') as answer,
    ):
        assert answer.status == 202
    await served.kill()  # SIGKILL while the app still works on it
    handed = await _row(pg_dsn, table, "k9")
    assert handed["inbox_state"] == "pending"
    upstream.gate.set()  # the app finishes the first attempt; no one records it
    upstream.gate = None

    await serve(**settings)
    await wait_until(lambda: _state(pg_dsn, table, "k9", "delivered"), "the lease to end", 30)

    assert len(upstream.requests) == 2  # the first attempt, and one after the lease
    delivered = await _row(pg_dsn, table, "k9")
    attempts = json.loads(delivered["inbox_attempts"])
    assert [a["status"] for a in attempts] == [200]  # the first attempt's was never recorded
    # Due no sooner than upstream.timeout (2 s) + 5 s after the hand-off.
    sent_again = datetime.fromisoformat(attempts[0]["at"])
    assert (sent_again - delivered["received_at"]).total_seconds() >= 7


OPERATOR = ("alice", "correct-horse-battery-staple")


async def test_redeliver_now_sends_no_second_copy_while_a_handed_off_delivery_is_at_the_app(
    make_proxy: MakeProxy,
    aiohttp_client: Any,
    proxy_config: Any,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
) -> None:
    upstream.gate = asyncio.Event()
    console = {"actions": True, "credentials": [":".join(OPERATOR)]}
    proxy = await make_proxy(routes=[HANDED], redeliverer=QUICK, admin={"console": console})
    admin = await admin_client(aiohttp_client, proxy)
    answer = await asyncio.wait_for(proxy.post("/hooks", data=b'{"id": "busy"}'), 10)
    assert (await answer.json())["kept_for"] == "deadline"  # handed off: the app still has it

    out = io.StringIO()
    code = await inbox_commands.redeliver(proxy_config(routes=[HANDED]), "hooks", ["busy"], out=out)
    assert code == 1
    assert out.getvalue().startswith("at the app now, not made due (handed off, ")
    assert out.getvalue().endswith(": hooks busy\n0 delivery(ies) due now; the redeliverer takes "
                                   "them within its poll interval\n")  # fmt: skip
    name, password = OPERATOR
    token = console_gate.csrf_token(config.console.Credential(name=name, password=password))
    basic = base64.b64encode(f"{name}:{password}".encode()).decode()
    headers = {"Authorization": f"Basic {basic}",
               "Origin": f"http://{admin.host}:{admin.port}"}  # fmt: skip
    one = {"scope": "hooks", "id": "busy", "csrf": token}
    async with admin.post("/console/redeliver", data=one, headers=headers,
                          allow_redirects=False) as response:  # fmt: skip
        assert response.status == 303
        assert "done=at_app" in response.headers["Location"]
    bulk = {"route": "hooks", "expected": "1", "csrf": token}
    async with admin.post("/console/bulk", data=bulk, headers=headers) as response:
        assert response.status == 200
        assert "0 delivery(ies) made due now, of 1" in await response.text()

    await asyncio.sleep(1.0)  # ten polls: a lane would have sent it, had it been made due
    copies = len(upstream.requests)
    upstream.gate.set()
    await wait_until(lambda: _state(pg_dsn, table, "busy", "delivered"), "the answer recorded")
    assert copies == 1
    assert len(upstream.requests) == 1
    attempts = json.loads((await _row(pg_dsn, table, "busy"))["inbox_attempts"])
    assert [a["status"] for a in attempts] == [200]


async def _row(dsn: str, table: str, event_id: str) -> Any:
    rows = await fetch(
        dsn,
        "SELECT inbox_state, inbox_attempts, received_at, "
        "extract(epoch FROM inbox_due - now()) AS due_in "
        f'FROM "{table}" WHERE event_id = $1',
        event_id,
    )
    return rows[0]


async def test_an_apps_503_with_retry_after_keeps_the_delivery_due_no_earlier(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: (
        web.Response(status=503, headers={"Retry-After": "4"}) if n == 0 else web.Response()
    )
    proxy = await make_proxy(routes=[KEPT], redeliverer=QUICK)

    answer = await proxy.post("/hooks", data=b'{"id": "busy"}')

    assert answer.status == 202
    assert await answer.json() == {
        "status": "queued", "event_id": "busy", "upstream_status": 503, "kept_for": "retry_after"
    }  # fmt: skip
    assert (await _row(pg_dsn, table, "busy"))["due_in"] > 3  # not the schedule's 200 ms
    await wait_until(lambda: _state(pg_dsn, table, "busy", "delivered"), "the redelivery", 15)
    attempts = json.loads((await _row(pg_dsn, table, "busy"))["inbox_attempts"])
    assert [a["status"] for a in attempts] == [503, 200]
    waited = datetime.fromisoformat(attempts[1]["at"]) - datetime.fromisoformat(attempts[0]["at"])
    assert waited.total_seconds() >= 4


@pytest.mark.parametrize(
    ("status", "value", "seconds"),
    [
        (503, "4", 4.0),
        (429, "120", 120.0),
        (503, "Wed, 21 Oct 2015 07:28:10 GMT", 10.0),  # an HTTP-date, 10 s after "now"
        (503, "999999", 3600.0),  # capped
        (503, "soon", None),
        (503, "-1", None),
        (500, "4", None),  # only 429 and 503 say when to come back
    ],
)
def test_retry_after_is_read_from_a_429_or_503_as_seconds_or_a_date(
    status: int, value: str, seconds: float | None
) -> None:
    answer = http1.Answer(status, "", CIMultiDict({"Retry-After": value}), b"")
    now = datetime(2015, 10, 21, 7, 28, 0, tzinfo=UTC).timestamp()
    assert delivery.Result(answer).retry_after(now) == seconds


class FailingApp(SlowApp):
    """A SlowApp that answers 503 to one delivery in ``fail_every`` at its first call (its
    redelivery succeeds): each delivery's 2xx calls, and how busy its places were."""

    def __init__(self, delay: float, fail_every: int) -> None:
        super().__init__(delay)
        self.fail_every = fail_every
        self.seen: set[str] = set()
        self.taken: Counter[str] = Counter()
        self.busy = 0.0  # seconds of calls at the app, summed

    async def handle(self, request: web.Request) -> web.Response:
        delivery = request.headers["X-GitHub-Delivery"]
        first = delivery not in self.seen
        self.seen.add(delivery)
        started = asyncio.get_running_loop().time()
        try:
            if first and self.fail_every and len(self.seen) % self.fail_every == 0:
                await request.read()
                await asyncio.sleep(self.delay)
                return web.Response(status=503)
            answer = await super().handle(request)
            self.taken[delivery] += 1
            return answer
        finally:
            self.busy += asyncio.get_running_loop().time() - started


async def _kind(answer: aiohttp.ClientResponse) -> str:
    """app: the app answered (200; or 202 once the app failed it); kept: kept unsent (202 with
    ``kept_for``); refused: anything else."""
    if answer.status == 200:
        return "app"
    if answer.status == 202:
        found = await answer.json()
        return "kept" if "upstream_status" not in found else "app"
    return "refused"


async def _sustained(
    url: str, senders: int, seconds: float, prefix: str
) -> list[tuple[str, str, float]]:
    """``senders`` senders, each sending GitHub deliveries with fresh IDs one after another for
    ``seconds`` (one at least): each delivery, what answered it, and when (from the start)."""
    answers: list[tuple[str, str, float]] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def sender(s: int) -> None:
            n = 0
            while n == 0 or loop.time() - started < seconds:
                delivery = f"{prefix}-{s}-{n}"
                body = json.dumps({"sender": s, "n": n}).encode()
                headers = github_headers(body, delivery)
                async with session.post(f"{url}/webhooks/github", data=body,
                                        headers=headers) as answer:  # fmt: skip
                    answers.append((delivery, await _kind(answer), loop.time() - started))
                n += 1

        await asyncio.gather(*(sender(s) for s in range(senders)))
    return answers


SUSTAINED = {"schedule": ["500ms"], "for": "1d"}


async def test_below_the_apps_capacity_with_one_failure_in_50_the_app_itself_answers(
    serve: Serve, aiohttp_server: Any, pg_dsn: str, table: str
) -> None:
    """2 workers, the default limit (8 places each), an app of 20 ms failing one delivery in
    50, 8 senders for 8 s: the kept failures' redeliveries take only the places the senders
    leave, so the webhooks stay answered by the app (they were kept, 202, once the first
    failure was due: the lanes waiting made the room full to newcomers)."""
    app = FailingApp(0.02, fail_every=50)
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", app.handle)
    server = await aiohttp_server(application)
    served = await serve(
        upstream={"url": str(server.make_url("")).rstrip("/"), "timeout": "30s"},
        workers=2, routes=[github_route(redeliver=SUSTAINED)], redeliverer=QUICK,
    )  # fmt: skip

    answers = await _sustained(served.url, senders=8, seconds=8.0, prefix="below")

    kinds = Counter(kind for _, kind, _ in answers)
    assert kinds["refused"] == 0, kinds
    assert kinds["app"] >= 0.9 * (kinds["app"] + kinds["kept"]), kinds
    assert sum(1 for n in app.taken.values() if n) >= 50  # some failed, then were redelivered
    await wait_until(lambda: _none_pending(pg_dsn, table), "the inbox drained", within=60)
    await wait_until(lambda: _all_taken_of(app, answers), "every event at the app", within=30)
    assert max(app.taken.values()) == 1  # each event taken once


async def _all_taken_of(app: FailingApp, answers: list[tuple[str, str, float]]) -> bool:
    return all(app.taken[delivery] for delivery, _, _ in answers)


@pytest.mark.slow
async def test_saturated_the_app_stays_busy_none_is_refused_and_then_it_is_synchronous_again(
    serve: Serve, aiohttp_server: Any, pg_dsn: str, table: str
) -> None:
    """``upstream.concurrency: 8`` over 2 workers, an app of 20 ms (400 a second): a burst
    leaves a backlog kept, then 16 senders for 15 s wait their turn at the app rather than
    being kept, so the app's places stay busy; nothing is refused (the inbox is far under its
    cap); each event is taken once; and a trickle after the load is answered by the app within
    10 s, the backlog drained in the places it leaves.

    The app's busy share is a throughput figure on a machine shared with other tests: the
    bench (bench/sustained.py, bench/RESULTS.md) measures 80 % and more; this asserts 60 %, a
    margin for a loaded machine, where the code before the change measured about a quarter."""
    app = FailingApp(0.02, fail_every=0)
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", app.handle)
    server = await aiohttp_server(application)
    served = await serve(
        upstream={"url": str(server.make_url("")).rstrip("/"), "timeout": "30s",
                  "concurrency": 8},
        database={"pool_size": 10},
        workers=2, routes=[github_route(redeliver=SUSTAINED)], redeliverer=QUICK,
    )  # fmt: skip

    # A burst first, for a backlog to drain: 300 at once, over what 8 places take in KEEP_WAIT.
    burst = await _sustained(served.url, senders=300, seconds=0.0, prefix="burst")
    assert Counter(kind for _, kind, _ in burst)["kept"] > 0
    seconds = 15.0
    before = app.busy
    answers = await _sustained(served.url, senders=16, seconds=seconds, prefix="load")
    busy = (app.busy - before) / (8 * seconds)
    kinds = Counter(kind for _, kind, _ in answers)
    trickle = []
    loop = asyncio.get_running_loop()
    ended = loop.time()
    async with aiohttp.ClientSession() as session:
        for n in range(120):  # 10 a second for 12 s
            await asyncio.sleep(max(0.0, ended + n / 10 - loop.time()))
            body = json.dumps({"after": n}).encode()
            headers = github_headers(body, f"after-{n}")
            async with session.post(f"{served.url}/webhooks/github", data=body,
                                    headers=headers) as answer:  # fmt: skip
                trickle.append((f"after-{n}", await _kind(answer), loop.time() - ended))

    assert kinds["refused"] == 0, kinds
    assert busy >= 0.6, (busy, kinds)
    late = [kind for _, kind, at in trickle if at >= 10.0]
    assert late, trickle
    assert set(late) == {"app"}, trickle
    assert app.peak <= 8
    await wait_until(lambda: _none_pending(pg_dsn, table), "the inbox drained", within=120)
    everything = burst + answers + trickle
    await wait_until(lambda: _all_taken_of(app, everything), "every event at the app", within=30)
    assert max(app.taken.values()) == 1
