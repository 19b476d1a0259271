"""The inbox through an outage of the app, with three ``serve`` processes on one claim table:
GitHub's deliveries (GitHub never retries) are kept while the app answers 503 or does not
listen, and drained once it recovers, each event to the app once; a replica killed with
SIGKILL mid-redelivery loses nothing. The app records every request: the replica that sent it
(each replica has a port of its own at the app), and whether another request for the same
event was in flight at that moment. Each test prints its figures (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import Serve, Served, fetch, free_port, wait_until

SECRET = "outage test secret"
HOOK_ID = "4242"
PATH = "/webhooks/github"
REDELIVERER = {"poll": "200ms", "rate": 50}
DRAIN_WITHIN = 60.0  # after recovery: when the test gives up waiting, not a timing assertion
# A call the killed replica's app answered 200 this shortly before the kill may not have been
# committed: its redelivery is the documented window too.
COMMIT_GRACE = 1.0

StartApp = Callable[["App"], Awaitable[None]]


def github_route(schedule: list[str]) -> dict[str, Any]:
    return {
        "name": "github",
        "path": PATH,
        "preset": "github",
        "verify": {"secret": SECRET},
        "redeliver": {"schedule": schedule, "for": "1h"},
    }


def guid(n: int) -> str:
    return f"6f1c0000-0000-4000-8000-{n:012d}"


def github_delivery(n: int) -> tuple[bytes, dict[str, str]]:
    """Event ``n`` as GitHub sends it (a copy is the same bytes and headers)."""
    body = json.dumps({"action": "opened", "number": n, "repository": "acme/app"}).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return body, {
        "X-GitHub-Delivery": guid(n),
        "X-GitHub-Hook-ID": HOOK_ID,
        "X-GitHub-Event": "pull_request",
        "X-Hub-Signature-256": f"sha256={signature}",
        "Content-Type": "application/json",
    }


# --- the app ------------------------------------------------------------------------------


@dataclass
class Call:
    """One request at the app."""

    event: str  # X-GitHub-Delivery
    request_id: str  # the proxy's X-Request-ID: a redelivery carries its first delivery's
    replica: int  # the index of the port it arrived on
    arrived: float
    overlapped: bool  # another request for this event was in flight at the app then
    ended: float | None = None
    status: int | None = None  # None: never answered (its connection closed first)


@dataclass
class App:
    """503 before ``recovers_at`` (monotonic), then 200 after working ``hold`` seconds."""

    ports: list[int]
    hold: float = 0.0
    recovers_at: float = math.inf
    calls: list[Call] = field(default_factory=list)
    in_flight: Counter[str] = field(default_factory=Counter)
    most: Counter[str] = field(default_factory=Counter)  # the most in flight at once, per event

    def url(self, replica: int) -> str:
        return f"http://127.0.0.1:{self.ports[replica]}"

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        port = request.transport.get_extra_info("sockname")[1]
        event = request.headers.get("X-GitHub-Delivery", "")
        self.in_flight[event] += 1
        self.most[event] = max(self.most[event], self.in_flight[event])
        call = Call(
            event,
            request.headers.get("X-Request-ID", ""),
            self.ports.index(port),
            time.monotonic(),
            self.in_flight[event] > 1,
        )
        self.calls.append(call)
        try:
            if call.arrived < self.recovers_at:
                call.status = 503
            else:
                if self.hold:
                    await asyncio.sleep(self.hold)  # the app's work
                call.status = 200
            return web.Response(status=call.status, text="ok" if call.status == 200 else "down")
        finally:
            call.ended = time.monotonic()
            self.in_flight[event] -= 1

    def answered(self, status: int) -> Counter[str]:
        return Counter(call.event for call in self.calls if call.status == status)

    def by_status(self) -> dict[str, int]:
        counted = Counter(str(call.status) if call.status else "unanswered" for call in self.calls)
        return dict(sorted(counted.items()))


@pytest.fixture
async def start_app() -> AsyncIterator[StartApp]:
    """Start an ``App`` on its ports; stopped at the test's end. A request's handler is
    cancelled when its connection closes: a killed replica's request is then no longer in
    flight at the app."""
    runners: list[web.AppRunner] = []

    async def start(app: App) -> None:
        application = web.Application()
        application.router.add_route("*", "/{tail:.*}", app.handle)
        runner = web.AppRunner(application, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        runners.append(runner)
        for port in app.ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()

    yield start
    for runner in runners:
        await runner.cleanup()


# --- the sender and the table -------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """Send event ``n`` ``at`` seconds after the start, to ``replica``."""

    at: float
    n: int
    replica: int
    copy: bool


@dataclass(frozen=True)
class Sent:
    plan: Plan
    status: int | None  # None: no answer (see error)
    dedup_status: str | None
    error: str | None = None


def plan(events: int, spread: float, copy_every: int = 0, copy_after: float = 0.3) -> list[Plan]:
    """``events`` spread over ``spread`` seconds, round-robin over three replicas; every
    ``copy_every``-th sent again ``copy_after`` later to the next replica."""
    step = spread / events
    firsts = [Plan(n * step, n, n % 3, False) for n in range(events)]
    copies = [
        Plan(p.at + copy_after, p.n, (p.replica + 1) % 3, True)
        for p in firsts
        if copy_every and p.n % copy_every == 0
    ]
    return firsts + copies


async def send_all(replicas: list[Served], plans: list[Plan], start: float) -> list[Sent]:
    """Each planned request once, as GitHub sends them: no retry, whatever the answer."""
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(p: Plan) -> Sent:
            await asyncio.sleep(max(0.0, start + p.at - time.monotonic()))  # the schedule
            body, headers = github_delivery(p.n)
            url = replicas[p.replica].url + PATH
            try:
                async with session.post(url, data=body, headers=headers) as answer:
                    await answer.read()
                    return Sent(p, answer.status, answer.headers.get("Dedup-Status"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                return Sent(p, None, None, repr(exc))

        return list(await asyncio.gather(*(one(p) for p in plans)))


@dataclass(frozen=True)
class Row:
    state: str | None
    attempts: int  # recorded in inbox_attempts (0: delivered at the first try)


async def rows(dsn: str, table: str) -> dict[str, Row]:
    """The claim table, keyed by delivery GUID (the claim's ID is ``hook:guid~digest``)."""
    found = await fetch(
        dsn,
        "SELECT event_id, inbox_state, coalesce(jsonb_array_length(inbox_attempts), 0) AS n "
        f"FROM \"{table}\" WHERE scope = 'github'",
    )
    return {
        row["event_id"].partition("~")[0].partition(":")[2]: Row(row["inbox_state"], row["n"])
        for row in found
    }


async def replicas_on(serve: Serve, app: App, schedule: list[str], **extra: Any) -> list[Served]:
    """Three replicas, one after another (the first creates the table), each to its own port."""
    started = []
    for replica in range(3):
        started.append(
            await serve(
                upstream={"url": app.url(replica)},
                routes=[github_route(schedule)],
                redeliverer={**REDELIVERER, **extra},
                database={"pool_size": 10},
            )
        )
    return started


def answers(sent: list[Sent]) -> dict[str, int]:
    counted = Counter(
        f"{'copy' if s.plan.copy else 'first'} {s.status} {s.dedup_status or s.error}" for s in sent
    )
    return dict(sorted(counted.items()))


async def drained(dsn: str, table: str, events: int) -> dict[str, Row]:
    """Wait for every event's row to be delivered (they are committed just after the app's
    200); the rows."""
    found: dict[str, Row] = {}

    async def done() -> bool:
        nonlocal found
        found = await rows(dsn, table)
        return len(found) == events and all(r.state in (None, "delivered") for r in found.values())

    await wait_until(done, f"{events} rows delivered", within=10)
    return found


# --- the tests ----------------------------------------------------------------------------

OUTAGE = 20.0
EVENTS = 200
LANES = 4  # the redeliverer's concurrency per replica, in the kill -9 test


@pytest.mark.slow
@pytest.mark.parametrize("outage", ["answers 503", "does not listen"], ids=["503", "closed"])
async def test_through_an_outage_every_event_is_kept_and_reaches_the_app_once_after_it(
    serve: Serve, start_app: StartApp, pg_dsn: str, table: str, outage: str
) -> None:
    app = App([free_port() for _ in range(3)])
    listening = outage == "answers 503"
    if listening:
        await start_app(app)
    replicas = await replicas_on(serve, app, ["1s", "2s", "5s"])
    plans = plan(EVENTS, spread=10.0, copy_every=5)
    t0 = time.monotonic()
    app.recovers_at = t0 + OUTAGE

    sent = await send_all(replicas, plans, t0)
    if not listening:
        await asyncio.sleep(max(0.0, app.recovers_at - time.monotonic()))  # the outage itself
        await start_app(app)

    async def all_answered_200() -> bool:
        return len(app.answered(200)) == EVENTS

    within = app.recovers_at + DRAIN_WITHIN - time.monotonic()
    await wait_until(all_answered_200, f"{EVENTS} events answered 200 by the app", within)
    found = await drained(pg_dsn, table, EVENTS)

    delivered = app.answered(200)
    last_delivery = max(c.ended or 0.0 for c in app.calls if c.status == 200)
    copies = sum(p.copy for p in plans)
    print(
        f"\ninbox outage, app {outage} for {OUTAGE:g}s, 3 replicas, schedule 1s/2s/5s, "
        f"redeliverer poll 200ms rate 50/s concurrency 2: events={EVENTS} copies={copies}"
        f"\n  sender: {answers(sent)}"
        f"\n  app requests: {len(app.calls)} {app.by_status()}; "
        f"by replica {dict(sorted(Counter(c.replica for c in app.calls).items()))}"
        f"\n  attempts recorded per event: max {max(r.attempts for r in found.values())}, "
        f"total {sum(r.attempts for r in found.values())}"
        f"\n  recovery -> last delivery: {last_delivery - app.recovers_at:.2f}s; "
        f"max in flight per event: {max(app.most.values())}"
    )
    assert answers(sent) == {
        "first 202 queued": EVENTS,
        "copy 202 duplicate_queued": copies,
    }
    assert delivered == dict.fromkeys(map(guid, range(EVENTS)), 1)
    for event in delivered:
        calls = [c for c in app.calls if c.event == event]
        assert calls[-1].status == 200, f"{event} was sent again after the app's 200"
        # One X-Request-ID: only the first delivery and its redeliveries reached the app.
        assert len({c.request_id for c in calls}) == 1, f"a copy of {event} was forwarded"
    assert [c for c in app.calls if c.overlapped] == []
    assert max(app.most.values()) == 1
    assert sorted(found) == sorted(delivered)
    assert {row.state for row in found.values()} == {"delivered"}  # none at the first try
    if listening:
        # Every request the app answered is an attempt in the row's history, and only those.
        made = Counter(c.event for c in app.calls)
        assert {event: row.attempts for event, row in found.items()} == dict(made)
    else:
        assert all(row.attempts >= 2 for row in found.values())  # refused, then delivered


@pytest.mark.slow
async def test_a_replica_killed_mid_redelivery_loses_nothing_and_only_what_it_held_comes_twice(
    serve: Serve, start_app: StartApp, pg_dsn: str, table: str
) -> None:
    events = 36  # three rounds of the 12 lanes, each held 3 s
    app = App([free_port() for _ in range(3)], hold=3.0)
    await start_app(app)
    replicas = await replicas_on(serve, app, ["1s"], concurrency=LANES)
    t0 = time.monotonic()
    app.recovers_at = t0 + 4.0
    sent = await send_all(replicas, plan(events, spread=1.5), t0)
    assert answers(sent) == {"first 202 queued": events}

    async def doomed_holds_every_lane() -> bool:
        held = [c for c in app.calls if c.replica == 0 and c.ended is None and c.status is None]
        return len(held) == LANES

    await wait_until(doomed_holds_every_lane, "replica 0 to hold redeliveries at the app", 30)
    killed_at = time.monotonic()
    await replicas[0].kill()
    restarted = await serve(again=replicas[0])  # the same ports and file: it rejoins
    restarted_at = time.monotonic()

    async def all_answered_200() -> bool:
        return len(app.answered(200)) == events

    within = app.recovers_at + DRAIN_WITHIN - time.monotonic()
    await wait_until(all_answered_200, f"{events} events answered 200 by the app", within)
    found = await drained(pg_dsn, table, events)

    def cut_by_the_kill(call: Call) -> bool:
        """The killed replica had it in flight when it died: the app may have acted on it."""
        if call.replica != 0 or call.arrived >= killed_at:
            return False
        answered_late = call.status == 200 and (call.ended or 0) >= killed_at - COMMIT_GRACE
        return call.status is None or answered_late

    cut = [c for c in app.calls if cut_by_the_kill(c)]
    worked = [c for c in app.calls if c.status != 503]  # the calls after the recovery
    delivering = [c.replica for c in app.calls if c.status == 200]
    twice = {e: n for e, n in Counter(c.event for c in worked).items() if n > 1}
    redelivered_after = [
        min(
            (c.arrived for c in worked if c.event == d.event and c.arrived > killed_at),
            default=math.inf,
        )
        - killed_at
        for d in cut
    ]
    print(
        f"\ninbox kill -9 mid-redelivery, 3 replicas (concurrency {LANES}), app 503 for 4s then "
        f"holds each request 3s: events={events}"
        f"\n  app requests: {len(app.calls)} {app.by_status()}; cut by the kill: {len(cut)} "
        f"({sum(c.status is None for c in cut)} unanswered); events at the app twice after "
        f"recovery: {len(twice)}"
        f"\n  kill -> the cut events' next arrival: "
        f"{', '.join(f'{s:.2f}s' for s in sorted(redelivered_after))}"
        f"\n  delivered by replica: {dict(sorted(Counter(delivering).items()))}, of which the "
        f"restarted replica 0 (up {restarted_at - killed_at:.2f}s after the kill) logged "
        f"{sum(line.get('result') == 'delivered' for line in restarted.lines())}"
        f"\n  recovery -> last delivery: "
        f"{max(c.ended or 0.0 for c in worked) - app.recovers_at:.2f}s; "
        f"max in flight per event: {max(app.most.values())}"
    )
    assert cut, "the kill cut no redelivery short"
    assert set(app.answered(200)) == set(map(guid, range(events)))  # nothing lost
    for event in map(guid, range(events)):
        calls = [c for c in worked if c.event == event]
        assert calls[-1].status == 200, f"{event}: its last call was not delivered"
        unexplained = [c for c in calls[:-1] if not cut_by_the_kill(c)]
        assert unexplained == [], f"{event} came to the app again without the kill explaining it"
        assert len({c.request_id for c in calls}) == 1
    assert [c for c in app.calls if c.overlapped] == []
    assert sorted(found) == sorted(map(guid, range(events)))
    assert {row.state for row in found.values()} == {"delivered"}
