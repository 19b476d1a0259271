"""The inbox's metrics (``redeliver``), as an operator reads them on the admin listener's
``/metrics``: what a kept failure counts, each redelivery's result, the cap, and the levels the
redeliverer reads from the database (the gauges deploy/prometheus/rules.yaml alerts on). In
process, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import admin, redeliverer
from tests.helpers import FakeUpstream, MakeProxy, execute, scrape, wait_until

QUICK = {"poll": "100ms", "rate": 1000}
LATER = ["1h"]  # no redelivery within a test unless its row is made due
BACK = 10.0  # seconds: the bound on waiting for the redeliverer
RESULTS = ("delivered", "failed", "dead")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def route(name: str = "hooks", path: str = "/hooks", **redeliver: Any) -> dict[str, Any]:
    return {
        "name": name,
        "path": path,
        "event_id": "body:/id",
        "redeliver": {"schedule": ["100ms"], "for": "1d", **redeliver},
    }


def answering(*statuses: int) -> Any:
    """The app's answers in turn, the last one repeated."""
    return lambda n: web.Response(status=statuses[min(n, len(statuses) - 1)], text=f"answer {n}")


@pytest.fixture
def fast_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The redeliverer reads the inbox's levels every 50 ms instead of every 15 s."""
    monkeypatch.setattr(redeliverer, "LEVEL_INTERVAL", 0.05)


class Scraper:
    """The proxy's ``/metrics``, through its admin app."""

    def __init__(self, client: TestClient[Any, Any]) -> None:
        self._client = client

    @classmethod
    async def of(cls, aiohttp_client: Any, proxy: TestClient[Any, Any]) -> Scraper:
        return cls(await aiohttp_client(admin.create_admin_app(proxy.app)))

    async def samples(self) -> Samples:
        return await scrape(self._client)

    async def value(self, name: str, **labels: str) -> float | None:
        """The sample's value; None when ``/metrics`` does not have it."""
        return (await self.samples()).get((name, tuple(sorted(labels.items()))))

    async def requests(self, outcome: str, route: str = "hooks") -> float | None:
        return await self.value("dedup_requests_total", route=route, outcome=outcome)

    async def redeliveries(self) -> dict[str, float]:
        """The route's redeliveries by result (absent: 0)."""
        samples = await self.samples()
        return {
            result: samples.get(
                ("dedup_redeliveries_total", (("result", result), ("route", "hooks"))), 0.0
            )
            for result in RESULTS
        }

    async def levels(self, route: str = "hooks") -> dict[str, float | None]:
        samples = await self.samples()
        names = {
            "pending": "dedup_inbox_pending",
            "bytes": "dedup_inbox_pending_bytes",
            "dead": "dedup_inbox_dead",
            "oldest": "dedup_inbox_oldest_pending_seconds",
            "overdue": "dedup_inbox_overdue_seconds",
            "oldest_dead": "dedup_inbox_oldest_dead_seconds",
        }
        return {key: samples.get((name, (("route", route),))) for key, name in names.items()}

    async def until(self, what: str, check: Any, within: float = BACK) -> None:
        """Scrape until ``check(self)`` (a coroutine) is true."""

        async def scraped() -> bool:
            return bool(await check(self))

        await wait_until(scraped, what, within)


async def test_a_kept_failure_counts_queued_and_each_redelivery_its_result(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_client: Any
) -> None:
    upstream.respond = answering(503, 503, 200)  # the first redelivery fails too
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)
    metrics = await Scraper.of(aiohttp_client, proxy)

    answer = await proxy.post("/hooks", data=b'{"id": "evt_1"}')

    assert (answer.status, answer.headers["Dedup-Status"]) == (202, "queued")
    assert await metrics.requests("queued") == 1
    assert await metrics.requests("upstream_error") == 0  # kept, not relayed

    async def delivered(m: Scraper) -> bool:
        return (await m.redeliveries())["delivered"] == 1

    await metrics.until("the redelivery the app takes", delivered)
    assert await metrics.redeliveries() == {"delivered": 1, "failed": 1, "dead": 0}
    assert len(upstream.requests) == 3
    assert await metrics.requests("queued") == 1  # a redelivery is not a request


async def test_an_answer_retrying_cannot_fix_counts_dead_first_time_or_at_a_redelivery(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_client: Any
) -> None:
    # evt_a: 422 at once; evt_b: 503 kept, then 422 at its redelivery.
    upstream.respond = answering(422, 503, 422)
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)
    metrics = await Scraper.of(aiohttp_client, proxy)

    first = await proxy.post("/hooks", data=b'{"id": "evt_a"}')
    second = await proxy.post("/hooks", data=b'{"id": "evt_b"}')

    assert first.headers["Dedup-Status"] == "dead_letter"
    assert second.headers["Dedup-Status"] == "queued"
    assert await metrics.requests("dead_letter") == 1
    assert await metrics.requests("queued") == 1

    async def dead(m: Scraper) -> bool:
        return (await m.redeliveries())["dead"] == 1

    await metrics.until("evt_b's redelivery answered 422", dead)
    assert await metrics.redeliveries() == {"delivered": 0, "failed": 0, "dead": 1}


async def test_past_for_the_last_failed_redelivery_counts_dead_the_others_failed(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_client: Any
) -> None:
    upstream.respond = answering(503)
    proxy = await make_proxy(routes=[route(**{"for": "1s"})], redeliverer=QUICK)
    metrics = await Scraper.of(aiohttp_client, proxy)

    assert (await proxy.post("/hooks", data=b'{"id": "evt_5"}')).status == 202

    async def dead(m: Scraper) -> bool:
        return (await m.redeliveries())["dead"] == 1

    await metrics.until("the redeliverer to give up", dead)
    counted = await metrics.redeliveries()
    # Every request the app got: the first delivery (queued), then one per redelivery.
    assert counted["failed"] == len(upstream.requests) - 2 >= 1
    assert counted["delivered"] == 0
    assert await metrics.requests("queued") == 1
    assert await metrics.requests("dead_letter") == 0  # dead later, not at the first try


async def test_at_the_cap_a_failure_is_relayed_and_counted_dead_rows_filling_it_too(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_client: Any, fast_levels: None
) -> None:
    upstream.respond = answering(422, 503)
    proxy = await make_proxy(routes=[route(schedule=LATER, max_pending=2)], redeliverer=QUICK)
    metrics = await Scraper.of(aiohttp_client, proxy)
    assert await metrics.value("dedup_inbox_full_total", route="hooks") == 0  # from the start

    answers = [await proxy.post("/hooks", data=f'{{"id": "c{n}"}}'.encode()) for n in range(3)]

    assert [a.status for a in answers] == [202, 202, 503]  # c0 dead, c1 pending, c2 relayed
    assert await metrics.value("dedup_inbox_full_total", route="hooks") == 1
    assert await metrics.requests("upstream_error") == 1
    assert await metrics.requests("dead_letter") == 1
    assert await metrics.requests("queued") == 1

    async def both_kept(m: Scraper) -> bool:
        levels = await m.levels()
        return (levels["pending"], levels["dead"]) == (1, 1)

    # What DedupInboxFull's runbook has the operator look at: one pending and one dead, at 2.
    await metrics.until("the levels of the full inbox", both_kept)


async def test_the_levels_are_each_routes_pending_count_bytes_dead_and_oldest_age(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    aiohttp_client: Any,
    pg_dsn: str,
    table: str,
    fast_levels: None,
) -> None:
    upstream.respond = answering(503, 503, 422, 503, 503)
    proxy = await make_proxy(
        routes=[route(schedule=LATER), route("tenants", "/t/{tenant}", schedule=LATER)],
        redeliverer=QUICK,
    )
    metrics = await Scraper.of(aiohttp_client, proxy)

    async def empty(m: Scraper) -> bool:
        return (
            await m.levels()
            == await m.levels("tenants")
            == {"pending": 0, "bytes": 0, "dead": 0, "oldest": 0, "overdue": 0, "oldest_dead": 0}
        )

    await metrics.until("the empty inboxes' levels", empty)
    bodies = [b'{"id": "p1"}', b'{"id": "p2", "padding": "' + b"x" * 1000 + b'"}']
    for body in bodies:
        assert (await proxy.post("/hooks", data=body)).headers["Dedup-Status"] == "queued"
    dead = await proxy.post("/hooks", data=b'{"id": "d1", "dead body": "not pending bytes"}')
    assert dead.headers["Dedup-Status"] == "dead_letter"
    tenant_bodies = [b'{"id": "t1"}', b'{"id": "t2!"}']
    for tenant, body in zip(("acme", "globex"), tenant_bodies, strict=True):
        assert (await proxy.post(f"/t/{tenant}", data=body)).headers["Dedup-Status"] == "queued"
    # p1 arrived an hour ago (as if the app had failed it since); d1 arrived three days ago and
    # has been dead for a day.
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET received_at = now() - interval '1 hour' WHERE event_id = 'p1'",
    )
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET received_at = now() - interval '3 days', "
        "inbox_changed = now() - interval '1 day' WHERE event_id = 'd1'",
    )

    async def read(m: Scraper) -> bool:
        levels = await m.levels()
        tenants_pending = (await m.levels("tenants"))["pending"]
        return (
            levels["pending"] == 2
            and (levels["oldest"] or 0) >= 3600
            and (levels["oldest_dead"] or 0) >= 86400
            and tenants_pending == 2
        )

    await metrics.until("the levels after the failures", read)
    hooks, tenants = await metrics.levels(), await metrics.levels("tenants")
    assert hooks["pending"] == 2
    assert hooks["bytes"] == sum(map(len, bodies))  # the bodies kept; the dead one's not counted
    assert hooks["dead"] == 1
    assert hooks["overdue"] == 0  # both due in an hour: none overdue (never negative)
    # What DedupDeadLettersUnhandled alerts on: since d1 died, not since it arrived.
    assert 86400 <= (hooks["oldest_dead"] or 0) < 2 * 86400
    assert (hooks["oldest"] or 0) < 2 * 3600  # pending rows only: not d1's three days
    # A route scoped by its path: its tenants' scopes added up, under the route's name.
    assert tenants["pending"] == 2
    assert tenants["bytes"] == sum(map(len, tenant_bodies))
    assert tenants["dead"] == 0
    assert tenants["oldest"] is not None
    assert 0 <= tenants["oldest"] < 3600  # its own rows' age, not hooks' p1
    assert tenants["overdue"] == 0
    assert tenants["oldest_dead"] == 0


async def test_a_due_delivery_no_lane_takes_is_overdue_until_a_failed_attempt_reschedules_it(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    aiohttp_client: Any,
    pg_dsn: str,
    table: str,
    fast_levels: None,
) -> None:
    upstream.respond = answering(503)
    proxy = await make_proxy(
        routes=[route(schedule=LATER)],
        redeliverer={**QUICK, "concurrency": 1},  # one lane
        upstream={"timeout": "60s"},  # the lane waits on the hanging app for the whole test
    )
    metrics = await Scraper.of(aiohttp_client, proxy)
    for event_id in ("a", "b"):
        assert (await proxy.post("/hooks", data=f'{{"id": "{event_id}"}}'.encode())).status == 202
    upstream.gate = asyncio.Event()  # the app hangs from now on
    # Both due: a (the oldest, so the lane takes it) a minute ago, b ten minutes ago.
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET received_at = now() - interval '2 hours', "
        "inbox_due = now() - interval '1 minute' WHERE event_id = 'a';"
        f"UPDATE \"{table}\" SET inbox_due = now() - interval '10 minutes' WHERE event_id = 'b'",
    )

    async def held() -> bool:
        return len(upstream.requests) == 3

    async def b_overdue(m: Scraper) -> bool:
        return ((await m.levels())["overdue"] or 0) >= 600

    try:
        await wait_until(held, "the lane's redelivery of a, held by the app")
        assert upstream.requests[2].body == b'{"id": "a"}'
        # b, due ten minutes ago, waits for the lane: what DedupRedeliveryStuck fires on.
        await metrics.until("b overdue by ten minutes", b_overdue)
        levels = await metrics.levels()
        assert levels["pending"] == 2
        assert (levels["oldest"] or 0) >= 7200  # from a's arrival, not its due time
    finally:
        upstream.gate.set()  # also when failing: the held redelivery ends now, not in 60 s

    async def rescheduled(m: Scraper) -> bool:
        return (await m.redeliveries())["failed"] == 2 and (await m.levels())["overdue"] == 0

    # Both attempts fail and schedule the next an hour on: still pending, overdue no more.
    await metrics.until("both attempts failed and rescheduled", rescheduled)
    assert (await metrics.levels())["pending"] == 2
    assert len(upstream.requests) == 4


async def test_the_redelivery_counters_are_on_metrics_at_zero_before_the_first_redelivery(
    make_proxy: MakeProxy, aiohttp_client: Any
) -> None:
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)
    metrics = await Scraper.of(aiohttp_client, proxy)

    # At 0 from the start: Prometheus's increase() cannot see a series' first sample, so a
    # counter born at 1 would hide a pod's first dead redelivery from DedupDeadLetters.
    for result in RESULTS:
        assert await metrics.value("dedup_redeliveries_total", route="hooks", result=result) == 0
