"""Receipts (``receipt``): an app that writes its effect and the receipt in one transaction has
its effect once, whatever went wrong between it and the proxy. A real app on a real PostgreSQL:
its ledger and the receipt commit together, or not at all."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from proxy import database
from proxy.database import sql
from tests.helpers import MakeProxy, Serve, execute, fetch, wait_until
from tests.roles import DOCUMENTED, limited_role

ROUTE = {"name": "pay", "path": "/pay", "event_id": "body:/id", "receipt": True}
# The receipts' table is shared by every test (one per database): each test's claim table
# is its own, and a receipt's key names it.


class LedgerApp:
    """An app that credits an account in its own transaction, with the receipt: ``mode``
    says what goes wrong after (or instead of) its COMMIT."""

    def __init__(self, dsn: str, ledger: str) -> None:
        self.dsn = dsn
        self.ledger = ledger
        self.mode = "ok"
        self.calls = 0
        self.committed = asyncio.Event()
        self.gate = asyncio.Event()
        self.pool: asyncpg.Pool | None = None
        self.receipts: list[str | None] = []  # each request's Dedup-Receipt, as received

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        self.receipts.append(request.headers.get("Dedup-Receipt"))
        receipt = request.headers["Dedup-Receipt"]
        assert self.pool is not None
        async with self.pool.acquire() as connection:
            transaction = connection.transaction()
            await transaction.start()
            try:
                await connection.execute(
                    f'INSERT INTO "{self.ledger}" (event, amount) VALUES ($1, 100)', body["id"]
                )
                await connection.execute("SELECT dedup_receipt($1)", receipt)
            except asyncpg.UniqueViolationError:
                await transaction.rollback()  # a second receipt: the effect is done already
                return web.Response(status=500, text="done already")
            if self.mode == "rollback":
                await transaction.rollback()
                return web.Response(status=500, text="failed")
            if self.mode == "open":  # answers before its COMMIT, then commits
                response = web.Response(status=503, text="busy")
                await response.prepare(request)
                await response.write_eof()
                await asyncio.sleep(0.5)
                await transaction.commit()
                self.committed.set()
                return response
            await transaction.commit()
            self.committed.set()
        if self.mode == "late":
            await asyncio.sleep(3)  # past upstream.timeout
        elif self.mode == "reset":
            assert request.transport is not None
            request.transport.abort()
        elif self.mode == "hang":
            await self.gate.wait()
        return web.Response(text="credited")

    async def credits(self, event: str) -> int:
        rows = await fetch(self.dsn, f'SELECT count(*) AS n FROM "{self.ledger}" WHERE event = $1',
                           event)  # fmt: skip
        return int(rows[0]["n"])


@pytest.fixture
async def app(aiohttp_server: Any, pg_dsn: str, table: str) -> AsyncIterator[LedgerApp]:
    ledger = f"{table}_ledger"
    await execute(pg_dsn, f'CREATE TABLE "{ledger}" (event text, amount int)')
    await execute(
        pg_dsn,
        "CREATE TABLE IF NOT EXISTS dedup_receipts (key text PRIMARY KEY, "
        "written_at timestamptz NOT NULL DEFAULT now());"
        "CREATE OR REPLACE FUNCTION dedup_receipt(receipt text) RETURNS void LANGUAGE sql AS "
        "$$ INSERT INTO dedup_receipts (key) VALUES (receipt) $$",
    )
    ledger_app = LedgerApp(pg_dsn, ledger)
    ledger_app.pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=4)
    application = web.Application()
    application.router.add_post("/{tail:.*}", ledger_app.handle)
    server = await aiohttp_server(application)
    ledger_app.url = str(server.make_url("")).rstrip("/")  # type: ignore[attr-defined]
    yield ledger_app
    await ledger_app.pool.close()


def settings(app: LedgerApp, **route: Any) -> dict[str, Any]:
    return {
        "routes": [{**ROUTE, **route}],
        "upstream": {"url": app.url, "timeout": "1s"},  # type: ignore[attr-defined]
    }


@pytest.mark.parametrize(
    ("mode", "first"),
    [("late", 504), ("reset", 502)],
    ids=["answer-after-upstream-timeout", "reset-after-commit"],
)
async def test_the_apps_answer_lost_after_its_commit_is_settled_by_the_receipt(
    make_proxy: MakeProxy, app: LedgerApp, mode: str, first: int
) -> None:
    app.mode = mode
    proxy = await make_proxy(**settings(app))

    answer = await proxy.post("/pay", data=b'{"id": "p1"}')

    # Without the receipt the provider would get `first` and send it again: the receipt says
    # the app committed, so the claim is committed and the provider told so.
    assert answer.status == 200, first
    assert await answer.json() == {"status": "processed", "event_id": "p1", "receipt": "written"}
    app.mode = "ok"
    copy = await proxy.post("/pay", data=b'{"id": "p1"}')
    assert copy.headers["Dedup-Status"] == "duplicate"
    assert await app.credits("p1") == 1
    assert app.calls == 1


async def test_a_transaction_still_open_when_the_proxy_looks_is_waited_for(
    make_proxy: MakeProxy, app: LedgerApp
) -> None:
    app.mode = "open"  # answers 503 before its COMMIT, commits 0.5 s later
    proxy = await make_proxy(**settings(app))

    answer = await proxy.post("/pay", data=b'{"id": "p2"}')

    assert answer.status == 200  # the probe waited for the app's transaction, then saw it
    assert await app.credits("p2") == 1


async def test_a_transaction_rolled_back_is_not_done_and_the_next_copy_is_processed_once(
    make_proxy: MakeProxy, app: LedgerApp
) -> None:
    app.mode = "rollback"
    proxy = await make_proxy(**settings(app))

    assert (await proxy.post("/pay", data=b'{"id": "p3"}')).status == 500
    app.mode = "ok"
    again = await proxy.post("/pay", data=b'{"id": "p3"}')

    assert again.status == 200
    assert await again.text() == "credited"
    assert await app.credits("p3") == 1
    assert app.calls == 2


async def test_a_claim_lost_after_the_app_committed_is_settled_by_the_receipt_not_sent_twice(
    make_proxy: MakeProxy, app: LedgerApp, pg_dsn: str, table: str
) -> None:
    """A failover to a standby that lacked the claim, or a COMMIT that never landed: the claim
    is gone but the app's effect and its receipt are not. The next copy reaches the app, whose
    second receipt fails with its transaction; the proxy then reads the first."""
    proxy = await make_proxy(**settings(app, receipt={"dsn": pg_dsn}))
    assert (await proxy.post("/pay", data=b'{"id": "p4"}')).status == 200
    await execute(pg_dsn, f"DELETE FROM \"{table}\" WHERE event_id = 'p4'")  # the claim lost

    copy = await proxy.post("/pay", data=b'{"id": "p4"}')

    assert copy.status == 200
    assert await copy.json() == {"status": "processed", "event_id": "p4", "receipt": "written"}
    assert await app.credits("p4") == 1
    assert app.calls == 2  # it reached the app, which refused to do it twice
    third = await proxy.post("/pay", data=b'{"id": "p4"}')
    assert third.headers["Dedup-Status"] == "duplicate"  # settled: committed as processed


async def test_kill_9_after_the_app_committed_and_before_the_claims_commit_credits_once(
    serve: Serve, app: LedgerApp, pg_dsn: str, table: str
) -> None:
    app.mode = "hang"  # committed, then its answer waits
    config = settings(app)
    config["upstream"]["timeout"] = "30s"
    served = await serve(**config)
    async with aiohttp.ClientSession() as session:
        sent = asyncio.ensure_future(session.post(f"{served.url}/pay", data=b'{"id": "p5"}'))
        await asyncio.wait_for(app.committed.wait(), 15)
        await served.kill()  # the claim's transaction dies uncommitted
        with pytest.raises(aiohttp.ClientError):
            await sent
        assert await fetch(pg_dsn, f"SELECT 1 FROM \"{table}\" WHERE event_id = 'p5'") == []
        app.gate.set()
        app.mode = "ok"
        again = await serve(**config)
        async with session.post(f"{again.url}/pay", data=b'{"id": "p5"}') as copy:
            assert copy.status == 200
            assert json.loads(await copy.text())["receipt"] == "written"
    assert await app.credits("p5") == 1


async def test_a_route_whose_app_writes_no_receipt_says_so(
    make_proxy: MakeProxy, upstream: Any, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await make_proxy(routes=[ROUTE])  # the fake app writes nothing
    await wait_until(lambda: _receipts_ready(proxy), "the receipts' table")

    assert (await proxy.post("/pay", data=b'{"id": "p6"}')).status == 200

    assert any("asks for receipts, but the app answered" in r.getMessage() for r in caplog.records)


async def _receipts_ready(proxy: Any) -> bool:
    from proxy import app_keys

    receipts = proxy.app[app_keys.RECEIPTS]["pay"]
    return not await receipts.missing()


async def test_a_look_waiting_on_an_open_transaction_holds_up_no_look_at_another_receipt(
    pg_dsn: str, table: str
) -> None:
    # Deliveries in doubt at once (a latency spike makes every call late) each look at their
    # own receipt: one waiting on its app's transaction must not make the others wait too.
    receipts_ = database.Receipts(pg_dsn, connect_timeout=5.0, op_timeout=5.0)
    await receipts_.migrate()
    keys = database.receipts.Keys(b"k" * database.receipts.SECRET_BYTES)
    pending, done = (keys.key(table, "pay", event) for event in ("open", "done"))
    await execute(pg_dsn, f"SELECT dedup_receipt('{done}')")
    app = await asyncpg.connect(pg_dsn)
    transaction = app.transaction()
    await transaction.start()
    await app.execute("SELECT dedup_receipt($1)", pending)
    looking = asyncio.create_task(receipts_.written(pending, wait=30.0))
    try:

        async def probe_waits() -> bool:
            rows = await fetch(
                pg_dsn,
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1 "
                "AND datname = current_database()",
                "INSERT INTO dedup_receipts%",
            )
            return bool(rows)

        await wait_until(probe_waits, "the first look waiting on the app's transaction")
        assert await receipts_.written(done, wait=30.0) is True
        assert not looking.done()  # still waiting on the app's transaction, not decided
        await transaction.commit()
        assert await looking is True
    finally:
        if not looking.done():
            looking.cancel()
        await asyncio.gather(looking, return_exceptions=True)
        await app.close()
        await receipts_.close()


async def test_a_clients_dedup_receipt_cannot_squat_the_receipt_of_an_event_to_come(
    make_proxy: MakeProxy, app: LedgerApp, table: str
) -> None:
    # Issue 50 #3: a pass-through POST carrying the key of a predictable event ID reached the
    # app, which wrote that receipt; the event itself was then refused by the app (its receipt
    # INSERT hit the squatted row) and answered 200 processed, receipt written: never applied.
    proxy = await make_proxy(**settings(app))
    await wait_until(lambda: _receipts_ready(proxy), "the receipts' table")
    unkeyed = hashlib.sha256(f"{table}\npay\nevt_next".encode()).hexdigest()

    await proxy.post(
        "/account/avatar", data=b'{"id": "avatar"}', headers={"Dedup-Receipt": unkeyed}
    )
    genuine = await proxy.post("/pay", data=b'{"id": "evt_next"}')

    assert genuine.status == 200
    assert await genuine.text() == "credited"  # the app's own answer: it took the event
    assert await app.credits("evt_next") == 1
    assert app.receipts[0] is None  # a client's Dedup-Receipt never reached the app


async def test_the_receipts_key_is_keyed_and_shared_by_every_replica(
    make_proxy: MakeProxy, app: LedgerApp, pg_dsn: str, table: str
) -> None:
    # Unkeyed (SHA-256 of table, scope and ID) anyone could compute an event's key; under the
    # deployment's secret nobody outside can, and every replica of it sends the same.
    first = await make_proxy(**settings(app))
    second = await make_proxy(**settings(app))
    await wait_until(lambda: _receipts_ready(first), "the receipts' table")

    assert (await first.post("/pay", data=b'{"id": "k1"}')).status == 200
    assert (await second.post("/pay", data=b'{"id": "k1"}')).status == 200  # a duplicate
    assert (await second.post("/pay", data=b'{"id": "k2"}')).status == 200

    sent = [key for key in app.receipts if key is not None]
    assert [len(key) for key in sent] == [64, 64]
    for key, event in zip(sent, ("k1", "k2"), strict=True):
        assert key != hashlib.sha256(f"{table}\npay\n{event}".encode()).hexdigest()
    rows = await fetch(
        pg_dsn, f'SELECT body_sha256 FROM "{table}" WHERE scope = $1', database.sql.RECEIPT_KEY
    )
    assert len(rows) == 1  # one secret for the deployment, made by the first replica
    secret = database.receipts.Keys(bytes(rows[0]["body_sha256"]))
    assert sent == [secret.key(table, "pay", "k1"), secret.key(table, "pay", "k2")]


async def test_a_redelivery_carries_the_proxys_receipt_and_no_dedup_header_it_was_kept_with(
    make_proxy: MakeProxy, upstream: Any, pg_dsn: str, table: str
) -> None:
    # A row kept by a release that forwarded a client's Dedup-* holds it among its headers:
    # sent again as kept, it would reach the app on every redelivery.
    upstream.respond = lambda n: web.Response(status=503 if n == 0 else 200)
    redelivered = {**ROUTE, "redeliver": {"schedule": ["1h"], "for": "1d"}}
    proxy = await make_proxy(routes=[redelivered], redeliverer={"poll": "100ms", "rate": 1000})
    await wait_until(lambda: _receipts_ready(proxy), "the receipts' table")
    forged = "f" * 64

    first = await proxy.post("/pay", data=b'{"id": "r1"}', headers={"Dedup-Receipt": forged})
    assert first.status == 202
    await execute(
        pg_dsn,
        f'UPDATE "{table}" SET inbox_due = now(), inbox_request = jsonb_set(inbox_request, '
        "'{headers}', (inbox_request->'headers') || "
        """'[["Dedup-Receipt", "%s"], ["Dedup-Other", "x"]]'::jsonb) WHERE event_id = 'r1'"""
        % forged,
    )
    await wait_until(lambda: asyncio.sleep(0, result=len(upstream.requests) >= 2), "redelivery")

    sent, again = upstream.requests[0].headers, upstream.requests[1].headers
    assert sent["dedup-receipt"] == again["dedup-receipt"] != [forged]
    assert "dedup-other" not in again


async def test_a_start_under_the_documented_grants_warns_of_nothing(
    make_proxy: MakeProxy, app: LedgerApp, pg_dsn: str, table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """create_schema: true (the default), the tables made by their owner, the proxy's role
    holding only the grants docs/deployment.md lists: its start has nothing to say of the
    receipts (before: "the receipts' database is not ready yet: … permission denied for schema
    public" at every start, from DDL it did not need)."""
    await execute(pg_dsn, sql.for_table(table).schema)
    # The start's look says what it found, at debug level when all is there (a session's query
    # text in pg_stat_activity is not what a role other than a superuser may read).
    caplog.set_level(logging.DEBUG, logger="proxy.app")
    async with limited_role(pg_dsn, table, DOCUMENTED) as (role, dsn):
        await execute(pg_dsn, f"GRANT SELECT, INSERT, DELETE ON dedup_receipts TO {role}")
        try:
            await make_proxy(**settings(app), database={"dsn": dsn})

            async def looked() -> bool:
                return any("receipts'" in r.getMessage() for r in caplog.records)

            await wait_until(looked, "the start's look at the receipts' table")
        finally:
            await execute(pg_dsn, f"REVOKE ALL ON dedup_receipts FROM {role}")

    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [message for message in said if "receipts'" in message], said


async def test_a_delivery_kept_before_receipt_was_turned_on_is_redelivered_with_its_key(
    make_proxy: MakeProxy, upstream: Any, pg_dsn: str, table: str
) -> None:
    # Issue 51: turning receipt on with deliveries already kept sent them without the key, and
    # an app that indexes the header failed each of them on every attempt.
    upstream.respond = lambda n: web.Response(status=503 if n == 0 else 200)
    plain = {**ROUTE, "receipt": False, "redeliver": {"schedule": ["1h"], "for": "1d"}}
    before = await make_proxy(routes=[plain])  # its schedule: due in an hour
    assert (await before.post("/pay", data=b'{"id": "t1"}')).status == 202  # kept, no key
    await before.close()

    after = await make_proxy(
        routes=[{**plain, "receipt": True}], redeliverer={"poll": "100ms", "rate": 1000}
    )
    await wait_until(lambda: _receipts_ready(after), "the receipts' table")
    await execute(pg_dsn, f"UPDATE \"{table}\" SET inbox_due = now() WHERE event_id = 't1'")
    await wait_until(lambda: asyncio.sleep(0, result=len(upstream.requests) >= 2), "redelivery")

    assert "dedup-receipt" not in upstream.requests[0].headers
    assert len(upstream.requests[1].headers["dedup-receipt"][0]) == 64
