"""The database's bad days, short of a failover (tests/test_failover.py): a primary that takes
no writes, connections that keep failing, a start while the database does not answer, hosts
that refuse or drop packets, and COMMITs that fail in two different ways."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import asyncpg
import pytest
import yaml

from proxy import app_keys, embedded, errors
from proxy.database import pool
from tests.faults.relay import Relay
from tests.helpers import (
    CORVEL,
    FakeUpstream,
    MakeProxy,
    Serve,
    admin_client,
    claimed,
    event,
    execute,
    free_port,
    github_route,
    run_cli,
    scrape,
    serve_settings,
    start_serve,
    wait_until,
)

RELAY_IN_LOOP = True  # the fault relay needs asyncio's transports (conftest)


async def read_only(dsn: str, on: bool) -> None:
    """Make the whole server refuse writes (as a demoted primary, or a full disk's guard, does),
    every session included, or take writes again."""
    await alter_system(dsn, f"SET default_transaction_read_only = {'on' if on else 'off'}")


async def alter_system(dsn: str, change: str) -> None:
    """``ALTER SYSTEM <change>`` and a reload (each a statement of its own: ALTER SYSTEM may
    not run in a transaction block)."""
    await execute(dsn, f"ALTER SYSTEM {change}")
    await execute(dsn, "SELECT pg_reload_conf()")
    await asyncio.sleep(0.2)  # the reload reaches every backend at its next statement


async def test_readiness_fails_on_a_read_only_primary_and_its_connections_are_dropped(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    own_server: embedded.EmbeddedPostgres,
    aiohttp_client: Any,
    table: str,
) -> None:
    dsn = own_server.start()
    proxy = await make_proxy(database={"dsn": dsn, "pool_size": 2})
    admin = await admin_client(aiohttp_client, proxy)
    assert (await admin.get("/readyz")).status == 200
    opened = proxy.app[app_keys.STORE].pool_stats().opened

    await read_only(dsn, True)
    ready = await admin.get("/readyz")
    webhook = await proxy.post("/webhooks/corvel", data=event("on-read-only"))

    assert ready.status == 503
    assert await ready.json() == {
        "status": "unavailable",
        "reason": "the database is read-only: default_transaction_read_only is on",
    }
    assert webhook.status == 503
    assert webhook.headers["Retry-After"] == "5"
    assert upstream.requests == []  # refused before the app: nothing forwarded unclaimed
    # The connections that met the read-only server are not lent again.
    assert proxy.app[app_keys.STORE].pool_stats().open < 2

    await read_only(dsn, False)
    # Whatever back-off the failures started, and a margin: uvloop's timers count whole
    # milliseconds, so a sleep can end a little before time.monotonic() reaches its end.
    await asyncio.sleep(pool.BACKOFF_MAX + 0.01)
    assert (await admin.get("/readyz")).status == 200
    after = await proxy.post("/webhooks/corvel", data=event("on-read-only"))
    assert after.status == 200
    assert [row[1] for row in await claimed(dsn, table)] == ["on-read-only"]
    assert proxy.app[app_keys.STORE].pool_stats().opened > opened


async def test_a_replica_started_on_a_read_only_primary_opens_the_upgrade_window_unrecorded(
    make_proxy: MakeProxy, own_server: embedded.EmbeddedPostgres, table: str
) -> None:
    """The upgrade window's start is recorded by the first replica on a bound route: one that
    starts while the server takes no writes (a failover) still starts, and, the route holding
    claims made before (0.1.0's), claims both forms from its own start."""
    dsn = own_server.start()
    await make_proxy(database={"dsn": dsn}, routes=[CORVEL])  # the table
    await execute(dsn, f"""INSERT INTO "{table}" (scope, event_id) VALUES ('github', '1:old')""")
    await read_only(dsn, True)

    proxy = await make_proxy(database={"dsn": dsn}, routes=[github_route()])

    store = proxy.app[app_keys.STORE]
    assert store.started.is_set()
    assert list(store.windows) == ["github"]


async def test_a_database_refusing_writes_is_not_met_with_a_new_session_per_webhook(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    own_server: embedded.EmbeddedPostgres,
    aiohttp_client: Any,
) -> None:
    dsn = own_server.start()
    proxy = await make_proxy(database={"dsn": dsn, "pool_size": 2})
    admin = await admin_client(aiohttp_client, proxy)
    store = proxy.app[app_keys.STORE]
    before = store.pool_stats()
    await read_only(dsn, True)

    answers = [await proxy.post("/webhooks/corvel", data=event(f"ro-{n}")) for n in range(60)]

    assert {answer.status for answer in answers} == {503}
    assert all(answer.headers["Retry-After"] == "5" for answer in answers)
    counts = store.pool_stats()
    # Without the back-off each webhook logged in again: 60 new sessions.
    assert counts.opened - before.opened < 20, counts
    assert counts.backed_off > 30, counts
    samples = await scrape(admin)
    backed_off = samples[("dedup_database_connects_total", (("result", "backed_off"),))]
    assert backed_off == counts.backed_off
    await read_only(dsn, False)


async def test_the_gauge_and_check_say_whether_commits_wait_for_a_standby(
    make_proxy: MakeProxy,
    own_server: embedded.EmbeddedPostgres,
    aiohttp_client: Any,
    tmp_path: Path,
    table: str,
) -> None:
    dsn = own_server.start()
    proxy = await make_proxy(database={"dsn": dsn, "pool_size": 2})
    admin = await admin_client(aiohttp_client, proxy)
    replicated = ("dedup_database_commits_replicated", ())
    assert (await scrape(admin))[replicated] == 0

    # No standby connects, so no COMMIT may be made now: it would wait for one.
    await alter_system(dsn, "SET synchronous_standby_names = 'ANY 1 (s1, s2)'")
    try:
        assert (await admin.get("/readyz")).status == 200
        assert (await scrape(admin))[replicated] == 1
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(serve_settings("http://127.0.0.1:9", dsn, table)))
        code, out, err = await run_cli("check", "--database", "--config", str(path))
    finally:
        await alter_system(dsn, "RESET synchronous_standby_names")
    assert (code, err) == (0, ""), out
    assert (
        "ok   commits wait for a standby: yes (synchronous_commit on, "
        "synchronous_standby_names 'ANY 1 (s1, s2)')"
    ) in out.splitlines()


async def test_serve_started_during_an_outage_listens_then_serves_once_the_database_answers(
    serve: Serve, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    target = pg_target(pg_dsn)
    relay = Relay(target)
    await relay.start()
    await relay.set_mode("refuse")
    try:
        dsn = via(pg_dsn, relay.port)
        served = await serve(database={"dsn": dsn, "connect_timeout": "1s"})
        async with aiohttp_session() as session:
            health = await session.get(f"{served.admin_url}/healthz")
            ready = await session.get(f"{served.admin_url}/readyz")
            webhook = await session.post(f"{served.url}/webhooks/corvel", data=event("early"))
            assert health.status == 200
            assert ready.status == 503
            body = await ready.json()
            assert body["status"] == "starting"
            assert body["reason"] == (
                "starting: cannot connect to PostgreSQL: connection refused: nothing listens on "
                "that port"
            )
            assert webhook.status == 503
            assert webhook.headers["Retry-After"] == "5"

            await relay.set_mode("pass")

            async def ready_now() -> bool:
                return (await session.get(f"{served.admin_url}/readyz")).status == 200

            await wait_until(ready_now, "readiness once the database answers", within=30)
            later = await session.post(f"{served.url}/webhooks/corvel", data=event("early"))
            assert later.status == 200
        assert served.process.returncode is None
        assert [r.body for r in upstream.requests] == [event("early")]
        assert [row[1] for row in await claimed(pg_dsn, table)] == ["early"]
        messages = [line["msg"] for line in served.lines()]
        assert any(
            m.startswith("the database does not answer (cannot connect to PostgreSQL: ")
            and m.endswith(
                "listening anyway, and trying again for up to 5m (database.start_timeout)"
            )
            for m in messages
        ), messages

        # Logged when the start has returned: after its last statement (readiness's facts),
        # which may come a moment after readiness itself.
        async def answered_logged() -> bool:
            lines = served.lines()
            return any(x["msg"].startswith("the database answered after ") for x in lines)

        await wait_until(answered_logged, "the start's success logged")
    finally:
        await relay.close()


async def test_serve_gives_up_at_start_timeout_naming_every_host_and_why(
    tmp_path: Path, upstream: FakeUpstream, table: str
) -> None:
    silent = Relay(("127.0.0.1", free_port()))  # accepts, then holds every byte
    await silent.start()
    await silent.set_mode("blackhole")
    refused = free_port()
    try:
        dsn = (
            f"postgresql://dedup@127.0.0.1:{silent.port},127.0.0.1:{refused}/dedup"
            "?target_session_attrs=read-write"
        )
        settings = serve_settings(
            upstream.url, dsn, table, database={"connect_timeout": "1s", "start_timeout": "4s"}
        )
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({**settings, "log": {"format": "text"}}))
        served = await start_serve(path, tmp_path / "serve.log")
        async with aiohttp_session() as session:
            reason = (await (await session.get(f"{served.admin_url}/readyz")).json())["reason"]
        code = await asyncio.wait_for(served.process.wait(), 30)
    finally:
        await silent.close()
    text = served.output()
    assert code == 1, text
    both = (
        f"127.0.0.1:{silent.port}: no answer within 1s (database.connect_timeout); "
        f"127.0.0.1:{refused}: connection refused: nothing listens on that port"
    )
    assert both in reason
    assert "cannot start: the database did not answer within 4s (database.start_timeout): " in text
    assert both in text
    assert "Traceback" not in text


async def test_a_multi_host_dsn_reaches_the_second_host_past_one_that_drops_packets(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """asyncpg's connect timeout covers every host together: a dead primary whose address
    drops packets took all of it, and the promoted standby behind it was never tried."""
    silent = Relay(("127.0.0.1", free_port()))
    await silent.start()
    await silent.set_mode("blackhole")
    try:
        relay = Relay(pg_target(pg_dsn))
        await relay.start()
        try:
            dsn = via(pg_dsn, relay.port, first=f"127.0.0.1:{silent.port}")
            proxy = await make_proxy(database={"dsn": dsn, "connect_timeout": "1s"})
            answer = await proxy.post("/webhooks/corvel", data=event("past-the-dead-one"))
            assert answer.status == 200, await answer.text()
        finally:
            await relay.close()
    finally:
        await silent.close()
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["past-the-dead-one"]


def test_asyncpg_s_state_clash_is_said_in_words() -> None:
    clash = asyncpg.InternalClientError(
        "cannot switch to state 15; another operation (2) is in progress"
    )
    with pytest.raises(errors.StoreUnavailable) as raised, pool.translated("claim failed"):
        raise clash
    assert raised.value.message == (
        "claim failed: the connection broke while an earlier operation on it was still under "
        "way (asyncpg: cannot switch to state 15; another operation (2) is in progress); it "
        "is closed, and the next request opens a fresh one"
    )


def test_the_back_off_grows_to_its_bound_with_jitter() -> None:
    assert pool.backoff(1) == 0.0  # the first reconnect at once
    waits = [pool.backoff(n) for n in range(2, 40)]
    assert all(0 < wait <= pool.BACKOFF_MAX for wait in waits)
    assert max(waits) > pool.BACKOFF_MAX / 2
    assert len({pool.backoff(12) for _ in range(20)}) > 1  # jittered


@pytest.mark.parametrize(
    ("dsn", "hosts"),
    [
        (
            "postgresql://u:p@h1:5432,h2:5433/db?target_session_attrs=read-write",
            [("h1", 5432), ("h2", 5433)],
        ),
        ("postgresql://u:p@h1/db", [("h1", 5432)]),
        ("postgresql://u@[::1]:5433,[fd00::2]/db", [("::1", 5433), ("fd00::2", 5432)]),
        ("postgresql://u@h1,h2/db?port=5433", [("h1", 5433), ("h2", 5433)]),
        ("postgresql://u@/db?host=/a,/b&port=5432,5433", [("/a", 5432), ("/b", 5433)]),
        ("postgresql://u@/db?host=/a,/b&port=5433", [("/a", 5433), ("/b", 5433)]),
        ("postgresql://u@h1/db?host=/a,/b", [("h1", 5432)]),  # the URL's host wins, as asyncpg's
    ],
)
def test_the_hosts_of_a_dsn_are_read_as_asyncpg_reads_them(
    dsn: str, hosts: list[tuple[str, int]]
) -> None:
    assert pool.dsn_hosts(dsn) == hosts


def test_a_port_list_that_does_not_match_the_hosts_is_refused() -> None:
    with pytest.raises(ValueError, match="2 port numbers for 3 hosts"):
        pool.dsn_hosts("postgresql://u@/db?host=/a,/b,/c&port=5432,5433")


@pytest.mark.parametrize(
    ("error", "for_good"),
    [
        (asyncpg.InsufficientPrivilegeError("permission denied for schema s"), True),
        (asyncpg.InvalidSchemaNameError('schema "s" does not exist'), True),
        (asyncpg.CannotConnectNowError("the database system is starting up"), False),
        (asyncpg.AdminShutdownError("terminating connection"), False),
        (asyncpg.ReadOnlySQLTransactionError("cannot execute CREATE TABLE"), False),
        (asyncpg.LockNotAvailableError("lock timeout"), False),
        (ConnectionResetError(), False),
    ],
)
def test_a_start_is_refused_for_good_only_by_a_refusal(error: Exception, for_good: bool) -> None:
    assert pool.refused_for_good(error) is for_good


async def test_serve_whose_role_may_not_create_the_table_exits_at_once_not_at_start_timeout(
    tmp_path: Path, upstream: FakeUpstream, pg_dsn: str
) -> None:
    path = tmp_path / "config.yaml"
    settings = serve_settings(upstream.url, pg_dsn, "no_such_schema.events")
    path.write_text(yaml.safe_dump({**settings, "log": {"format": "text"}}))
    code, out, err = await asyncio.wait_for(run_cli("serve", "--config", str(path)), 30)
    assert code == 1, out + err
    assert "cannot start: cannot prepare table no_such_schema.events: " in out + err
    assert "start_timeout" not in out + err


async def test_while_connects_back_off_a_healthy_connection_is_still_lent(pg_dsn: str) -> None:
    """New connections failing (max_connections reached, a rotated password) while the open
    ones work: the back-off refuses only what needs a new one."""
    failing = False

    async def connect() -> pool.Connection:
        if failing:
            raise ConnectionRefusedError("refused")
        connection: pool.Connection = await asyncpg.connect(pg_dsn)
        return connection

    lender = await pool.Pool.open(connect, 2)
    try:
        healthy, broken = await lender.acquire(), await lender.acquire()
        broken.terminate()
        lender.release(healthy)
        lender.release(broken)  # on top now: an empty slot, a new connection to open
        failing = True
        for _ in range(2):  # the first reconnect comes at once; after the second, a back-off
            with pytest.raises(ConnectionRefusedError):
                await lender.acquire()
        lent = await lender.acquire()  # the empty slot on top again, but the back-off runs
        assert lent is healthy
        assert await lent.fetchval("SELECT 1") == 1
        lender.release(lent)
        assert lender.counts().backed_off == 0
    finally:
        await lender.close(5)


async def test_after_a_failover_a_webhook_reaches_the_host_after_one_that_drops_packets(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """On the request path too: pool_timeout bounds the wait for a slot, not the connect, which
    tries each host within connect_timeout."""
    first, second = Relay(pg_target(pg_dsn)), Relay(pg_target(pg_dsn))
    await first.start()
    await second.start()
    try:
        dsn = via(pg_dsn, second.port, first=f"127.0.0.1:{first.port}")
        proxy = await make_proxy(
            database={"dsn": dsn, "pool_size": 1, "pool_timeout": "1s", "connect_timeout": "1s"}
        )
        assert (await proxy.post("/webhooks/corvel", data=event("before"))).status == 200
        await first.set_mode("reset")  # the primary dies: its connections are cut...
        await first.set_mode("blackhole")  # ...and its address drops packets
        answers = []
        for n in range(5):
            answer = await proxy.post("/webhooks/corvel", data=event(f"after-{n}"))
            answers.append((answer.status, (await answer.text())[:120]))
        assert answers[-1][0] == 200, answers
        assert not any("No database connection is free" in text for _, text in answers), answers
    finally:
        await first.close()
        await second.close()
    assert {row[1] for row in await claimed(pg_dsn, table)} >= {"before", "after-4"}


# ---


def pg_target(dsn: str) -> tuple[str, int] | str:
    """Where ``dsn``'s server listens, for a relay: TCP, or the embedded server's socket."""
    parts = urlsplit(dsn)
    host = parse_qs(parts.query).get("host", [parts.hostname or ""])[0]
    if host.startswith("/"):
        return f"{host}/.s.PGSQL.{parts.port or 5432}"
    return (host, parts.port or 5432)


def via(dsn: str, port: int, *, first: str | None = None) -> str:
    """``dsn`` through 127.0.0.1:``port`` (after ``first``, a host:port tried before it)."""
    parts = urlsplit(dsn)
    user = parts.username or "postgres"
    password = f":{parts.password}" if parts.password else ""
    hosts = f"{first}," if first else ""
    query = "?target_session_attrs=read-write" if first else ""
    return f"postgresql://{user}{password}@{hosts}127.0.0.1:{port}{parts.path}{query}"


def aiohttp_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession()
