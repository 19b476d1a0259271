"""Behind a real PgBouncer in transaction pooling mode, with its default settings: the proxy
starts, and every guarantee holds, including the bounds a claim sets inside its transaction.
With the settings docs/deployment.md recommends, read from that page: a PostgreSQL restart is
over for the proxy within seconds of the server being back, not after PgBouncer's 15 s."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy import config, database, embedded
from tests import pgbouncer
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    Serve,
    claimed,
    event,
    fetch,
    run_cli,
    sweeper_of,
    wait_for_lock_waiters,
    wait_until,
)


@pytest.fixture(scope="module")
def bouncer(pg_dsn: str) -> Iterator[str]:
    """The DSN of a PgBouncer in front of the session's PostgreSQL."""
    with pgbouncer.pgbouncer(pg_dsn) as dsn:
        yield dsn


async def test_duplicates_failures_and_the_sweeper_work_through_pgbouncer(
    make_proxy: MakeProxy, upstream: FakeUpstream, bouncer: str, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=500 if n == 1 else 200)
    proxy = await make_proxy(database={"dsn": bouncer})

    first = await proxy.post("/webhooks/corvel", data=event("a"))
    again = await proxy.post("/webhooks/corvel", data=event("a"))
    failed = await proxy.post("/webhooks/corvel", data=event("b"))
    retried = await proxy.post("/webhooks/corvel", data=event("b"))
    # A backslash and a quote in the ID: the claim's literals must not depend on session state.
    odd = await proxy.post("/webhooks/corvel", data=event("c\\'\\\\x"))

    assert [first.status, again.status, failed.status, retried.status, odd.status] == [
        200,
        200,
        500,
        200,
        200,
    ]
    assert again.headers["Dedup-Status"] == "duplicate"
    assert "Dedup-Status" not in retried.headers
    assert len(upstream.requests) == 4
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["a", "b", "c\\'\\\\x"]
    # The sweeper's lock is transaction-scoped: nothing of it outlives a batch behind PgBouncer.
    for _ in range(3):
        assert await sweeper_of(proxy).sweep() == {"corvel": 0, "github": 0}


async def test_the_inbox_keeps_locks_and_redelivers_through_pgbouncer(
    make_proxy: MakeProxy, upstream: FakeUpstream, bouncer: str, pg_dsn: str, table: str
) -> None:
    """A failure kept in its claim's row, a copy answered from it, the row taken FOR UPDATE SKIP
    LOCKED by two proxies and redelivered once: nothing of it needs session state."""
    upstream.respond = lambda n: web.Response(status=503 if n < 3 else 200)
    kept = {
        "name": "kept",
        "path": "/kept",
        "event_id": "body:/id",
        "redeliver": {"schedule": ["300ms"], "for": "1d"},
    }
    settings = {
        "routes": [kept],
        "redeliverer": {"poll": "100ms", "concurrency": 2},
        "database": {"dsn": bouncer},
    }
    proxies = [await make_proxy(**settings) for _ in range(2)]

    answers = [await proxies[n % 2].post("/kept", data=event(f"k{n}")) for n in range(3)]
    copy = await proxies[1].post("/kept", data=event("k0"))

    assert [a.headers["Dedup-Status"] for a in answers] == ["queued"] * 3
    assert copy.headers["Dedup-Status"] == "duplicate_queued"

    async def delivered() -> bool:
        rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}"')
        return [r["inbox_state"] for r in rows] == ["delivered"] * 3

    await wait_until(delivered, "the redeliveries through PgBouncer", 20)
    assert sorted(r.body for r in upstream.requests[3:]) == [event(f"k{n}") for n in range(3)]


async def test_a_replayed_signed_body_is_kept_once_through_pgbouncer(
    make_proxy: MakeProxy, upstream: FakeUpstream, bouncer: str, pg_dsn: str, table: str
) -> None:
    """The check that a signed body is kept already, and the read of the ID it is kept
    under, run in the claim's transaction: nothing of them needs session state."""
    upstream.respond = lambda n: web.Response(status=503)
    secret = "bouncer github secret"
    github = {
        "name": "github",
        "path": "/github",
        "preset": "github",
        "verify": {"secret": secret},
        "redeliver": {"schedule": ["1h"], "for": "1d"},
    }
    proxy = await make_proxy(routes=[github], database={"dsn": bouncer})
    body = b'{"action": "opened", "number": 1}'
    signature = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()

    signed = {"X-GitHub-Hook-ID": "1", "X-Hub-Signature-256": f"sha256={signature}"}
    answers = [
        await proxy.post("/github", data=body, headers={**signed, "X-GitHub-Delivery": f"g{n}"})
        for n in range(3)
    ]

    assert [a.status for a in answers] == [202, 503, 503]
    rows = await fetch(pg_dsn, f"SELECT inbox_state FROM \"{table}\" WHERE scope <> '~id-forms'")
    assert [r["inbox_state"] for r in rows] == ["pending"]


async def test_a_copy_on_another_proxy_waits_on_the_row_lock_through_pgbouncer(
    make_proxy: MakeProxy, upstream: FakeUpstream, bouncer: str, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    a = await make_proxy(database={"dsn": bouncer})
    b = await make_proxy(database={"dsn": bouncer})
    owner = asyncio.create_task(a.post("/webhooks/corvel", data=event("shared")))
    await upstream.arrived.wait()
    copy = asyncio.create_task(b.post("/webhooks/corvel", data=event("shared")))
    await wait_for_lock_waiters(pg_dsn, table, 1)

    upstream.gate.set()

    assert (await owner).status == 200
    duplicate = await copy
    assert (duplicate.status, duplicate.headers["Dedup-Status"]) == (200, "duplicate")
    assert len(upstream.requests) == 1


async def test_claim_wait_bounds_a_copy_on_another_proxy_through_pgbouncer(
    make_proxy: MakeProxy, upstream: FakeUpstream, bouncer: str, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    a = await make_proxy(database={"dsn": bouncer})
    b = await make_proxy(database={"dsn": bouncer}, claim_wait="1s")
    owner = asyncio.create_task(a.post("/webhooks/corvel", data=event("slow")))
    await upstream.arrived.wait()
    try:
        # Without the lock wait bound (lost if it were a session setting), this copy would
        # wait until the owner finishes, which it does not until the copy is answered.
        copy = await asyncio.wait_for(b.post("/webhooks/corvel", data=event("slow")), 20)
        assert copy.status == 503
        assert copy.headers["Retry-After"] == "5"
        assert (await copy.json())["error"] == "claim_wait_exceeded"
    finally:
        upstream.gate.set()
    assert (await owner).status == 200
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["slow"]


async def test_the_server_rolls_back_a_stalled_claim_through_pgbouncer(
    bouncer: str, table: str
) -> None:
    # A proxy that vanished without closing its socket leaves its claim idle in transaction;
    # the server ends it past upstream_timeout + connect_timeout (here 1 s).
    settings = config.DatabaseConfig(dsn=None, table=table, pool_size=1, connect_timeout=0.5)
    stalled = await database.Store.open(bouncer, settings, claim_wait=30, upstream_timeout=0.5)
    other = await database.Store.open(bouncer, settings, claim_wait=30, upstream_timeout=30)
    key = database.Key("s", "stalled", None, b"\0" * 32)
    try:
        await stalled.ensure_schema()
        async with stalled.claim(key) as held:
            assert held.acquired
            async with asyncio.timeout(20), other.claim(key) as taken:
                assert taken.acquired  # the stalled claim was rolled back, not waited out
    finally:
        await asyncio.gather(stalled.close(), other.close())


async def test_a_proxy_killed_mid_flight_releases_its_claim_through_pgbouncer(
    serve: Serve, make_proxy: MakeProxy, upstream: FakeUpstream, bouncer: str
) -> None:
    served = await serve(upstream={"timeout": "10s"}, database={"dsn": bouncer, "pool_size": 2})
    upstream.gate = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.create_task(
            session.post(f"{served.url}/webhooks/corvel", data=event("orphan"))
        )
        await upstream.arrived.wait()
        served.process.send_signal(signal.SIGKILL)
        await served.process.wait()
        with pytest.raises(aiohttp.ClientError):
            await in_flight
    upstream.gate.set()
    survivor = await make_proxy(database={"dsn": bouncer}, claim_wait="10s")

    retry = await survivor.post("/webhooks/corvel", data=event("orphan"))

    assert retry.status == 200
    assert "Dedup-Status" not in retry.headers  # processed: the dead proxy's claim is gone
    assert len(upstream.requests) == 2


@pytest.mark.slow
async def test_a_database_restart_behind_pgbouncer_fails_closed_then_recovers(
    make_proxy: MakeProxy, upstream: FakeUpstream, own_server: embedded.EmbeddedPostgres
) -> None:
    dsn = own_server.start()  # already running: returns its DSN
    with pgbouncer.pgbouncer(dsn) as through:
        proxy = await make_proxy(database={"dsn": through, "pool_size": 2})
        assert (await proxy.post("/webhooks/corvel", data=event("before"))).status == 200

        await asyncio.to_thread(own_server.stop)
        during = await proxy.post("/webhooks/corvel", data=event("during"))
        assert during.status == 503
        assert len(upstream.requests) == 1

        await asyncio.to_thread(own_server.start)

        async def recovered() -> bool:
            response = await proxy.post("/webhooks/corvel", data=event("during"))
            return response.status == 200

        await wait_until(recovered, "the proxy to claim again after the restart", within=30)
        assert len(upstream.requests) == 2


# A liveness bound, not a benchmark: PgBouncer's default server_login_retry alone is 15 s.
RECOVERED_WITHIN = 8.0


@pytest.mark.slow
async def test_with_the_documented_settings_a_restart_behind_pgbouncer_is_over_within_seconds(
    make_proxy: MakeProxy, upstream: FakeUpstream, own_server: embedded.EmbeddedPostgres
) -> None:
    """Webhooks sent ten a second through a fast stop and start of PostgreSQL: each is answered
    503 with Retry-After (never reaching the app) or claimed, none is claimed while the server
    is down, and claims resume within RECOVERED_WITHIN of the server accepting connections."""
    settings = pgbouncer.documented_settings()
    assert float(settings["server_login_retry"]) < RECOVERED_WITHIN  # the point of the block
    dsn = own_server.start()  # already running: returns its DSN
    with pgbouncer.pgbouncer(dsn, settings=settings) as through:
        proxy = await make_proxy(database={"dsn": through, "pool_size": 2})
        assert (await proxy.post("/webhooks/corvel", data=event("before"))).status == 200
        answers: dict[str, tuple[float, int, str | None]] = {}  # id: (when, status, Retry-After)

        async def deliver(event_id: str) -> None:
            response = await proxy.post("/webhooks/corvel", data=event(event_id))
            retry_after = response.headers.get("Retry-After")
            answers[event_id] = (time.monotonic(), response.status, retry_after)

        async def refused_while_down() -> bool:
            return any(status == 503 for _, status, _ in answers.values())

        async def claimed_again() -> bool:
            return any(status == 200 for _, status, _ in answers.values())

        await asyncio.to_thread(own_server.stop)
        async with asyncio.TaskGroup() as sends:
            sending = sends.create_task(_every(0.1, lambda n: sends.create_task(deliver(f"e{n}"))))
            await wait_until(refused_while_down, "a webhook refused while the server is down", 20)
            starting_at = time.monotonic()
            await asyncio.to_thread(own_server.start)
            back_at = time.monotonic()
            await wait_until(claimed_again, "a webhook claimed after the restart", 30)
            sending.cancel()

    claimed = {event_id: at for event_id, (at, status, _) in answers.items() if status == 200}
    refused = [(status, retry) for _, status, retry in answers.values() if status != 200]
    assert set(refused) == {(503, "5")}
    assert min(claimed.values()) >= starting_at  # nothing claimed while the server was down
    assert min(claimed.values()) - back_at < RECOVERED_WITHIN
    forwarded = sorted(r.body for r in upstream.requests)
    assert forwarded == sorted([event("before"), *(event(event_id) for event_id in claimed)])


async def _every(interval: float, start: Callable[[int], object]) -> None:
    """Call ``start(n)`` every ``interval`` seconds, n = 0, 1, …, until cancelled."""
    for n in itertools.count():
        start(n)
        await asyncio.sleep(interval)


async def test_operator_commands_work_through_pgbouncer(
    make_proxy: MakeProxy, tmp_path: Path, bouncer: str, table: str, upstream: FakeUpstream
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url},
                "database": {"dsn": bouncer, "table": table, "create_schema": False},
                "routes": [{"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}],
            }
        )
    )
    results: dict[str, Any] = {}
    for name, args in {
        "check": ["check"],
        "migrate": ["migrate"],
        "migrate again": ["migrate"],
    }.items():
        results[name] = await run_cli(*args, "--config", str(path))
    proxy = await make_proxy(database={"dsn": bouncer, "create_schema": False})
    for n in range(3):
        assert (await proxy.post("/webhooks/corvel", data=event(f"e{n}"))).status == 200
    for name, args in {
        "list": ["events", "list", "--route", "corvel"],
        "forget": ["events", "forget", "--route", "corvel", "e1"],
        "stats": ["stats"],
    }.items():
        results[name] = await run_cli(*args, "--config", str(path))

    assert {name: code for name, (code, _, _) in results.items()} == dict.fromkeys(results, 0)
    assert f"schema applied: table {table}" in results["migrate"][1]
    assert "3 claim(s) in scope corvel" in results["list"][1]
    assert "forgotten: corvel e1" in results["forget"][1]
    assert results["stats"][1].splitlines()[1].split()[:3] == ["corvel", "corvel", "2"]
