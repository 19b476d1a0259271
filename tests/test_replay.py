"""on_duplicate: replay — a duplicate gets the app's first 2xx answer, stored with the claim
before COMMIT, against the real database."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from typing import Any

import asyncpg
import pytest
from aiohttp import web
from multidict import CIMultiDict

from proxy import app_keys, config, database, errors, replay
from proxy.database import sql
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    event,
    execute,
    fetch,
    stripe_headers,
    stripe_route,
    wait_for_lock_waiters,
    wait_until,
)

BINARY = bytes(range(256)) * 4


def replay_route(**extra: Any) -> dict[str, Any]:
    return {
        "name": "corvel",
        "path": "/webhooks/corvel",
        "event_id": "body:/id",
        "on_duplicate": "replay",
        **extra,
    }


def twiml(n: int) -> web.Response:
    headers = CIMultiDict(
        [
            ("Content-Type", "text/xml; charset=utf-8"),
            ("X-Multi", "first"),
            ("Set-Cookie", "session=abc; HttpOnly"),
            ("X-Multi", "second"),
            ("X-Answer", f"answer-{n}"),
        ]
    )
    return web.Response(status=201, body=BINARY + str(n).encode(), headers=headers)


def end_to_end(response: Any) -> list[tuple[str, str]]:
    """The answer's headers the app chose, in order (not those aiohttp's server adds)."""
    added = {"date", "server", "content-length", "dedup-status", "idempotent-replayed"}
    return [(k, v) for k, v in response.headers.items() if k.lower() not in added]


async def test_a_duplicate_gets_the_first_answer_byte_exact(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = twiml
    client = await make_proxy(routes=[replay_route()])

    first = await client.post("/webhooks/corvel", data=b'{"id": "evt_r1"}')
    first_body = await first.read()
    again = await client.post("/webhooks/corvel", data=b'{"id": "evt_r1"}')
    again_body = await again.read()

    assert len(upstream.requests) == 1
    assert (first.status, again.status) == (201, 201)
    assert again_body == first_body == BINARY + b"0"
    # Set-Cookie is not replayed (the route does not allow it); everything else in order.
    assert end_to_end(again) == [(k, v) for k, v in end_to_end(first) if k.lower() != "set-cookie"]
    assert again.headers.getall("X-Multi") == ["first", "second"]
    assert again.headers["Content-Type"] == "text/xml; charset=utf-8"
    assert again.headers["Content-Length"] == str(len(BINARY) + 1)
    assert (again.headers["Dedup-Status"], again.headers["Idempotent-Replayed"]) == (
        "duplicate",
        "true",
    )
    assert "Idempotent-Replayed" not in first.headers


async def test_set_cookie_is_replayed_only_where_the_route_allows_it(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = twiml
    client = await make_proxy(routes=[replay_route(replay_set_cookie=True)])
    await client.post("/webhooks/corvel", data=b'{"id": "evt_c"}')
    again = await client.post("/webhooks/corvel", data=b'{"id": "evt_c"}')
    assert again.headers.getall("Set-Cookie") == ["session=abc; HttpOnly"]


async def test_a_copy_waiting_on_the_row_lock_gets_the_replay(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    # Two proxies (as two replicas): the copy meets the first at PostgreSQL's row lock, not
    # in one process's single-flight.
    upstream.respond = twiml
    upstream.gate = asyncio.Event()
    one = await make_proxy(routes=[replay_route()])
    two = await make_proxy(routes=[replay_route()])

    first = asyncio.create_task(one.post("/webhooks/corvel", data=b'{"id": "evt_w"}'))
    await upstream.arrived.wait()
    copy = asyncio.create_task(two.post("/webhooks/corvel", data=b'{"id": "evt_w"}'))
    await wait_for_lock_waiters(pg_dsn, table, 1)
    upstream.gate.set()
    first_response, copy_response = await first, await copy

    assert len(upstream.requests) == 1
    assert copy_response.headers["Idempotent-Replayed"] == "true"
    assert await copy_response.read() == await first_response.read() == BINARY + b"0"
    assert copy_response.status == 201


async def test_copies_in_one_process_get_the_replay_without_the_database(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = twiml
    upstream.gate = asyncio.Event()
    client = await make_proxy(routes=[replay_route()])
    sends = [
        asyncio.create_task(client.post("/webhooks/corvel", data=b'{"id": "evt_local"}'))
        for _ in range(5)
    ]
    await upstream.arrived.wait()
    upstream.gate.set()
    responses = await asyncio.gather(*sends)
    bodies = [await response.read() for response in responses]
    assert len(upstream.requests) == 1
    assert bodies == [BINARY + b"0"] * 5
    assert sorted(r.headers.get("Idempotent-Replayed", "-") for r in responses) == [
        "-",
        *["true"] * 4,
    ]


async def test_a_failure_stores_nothing_and_the_retry_answer_is_replayed(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: (
        web.Response(status=500, text="boom") if n == 0 else web.Response(text=f"ok-{n}")
    )
    client = await make_proxy(routes=[replay_route()])

    failed = await client.post("/webhooks/corvel", data=b'{"id": "evt_f"}')
    assert failed.status == 500
    assert await fetch(pg_dsn, f'SELECT 1 FROM "{table}"') == []
    retried = await client.post("/webhooks/corvel", data=b'{"id": "evt_f"}')
    duplicate = await client.post("/webhooks/corvel", data=b'{"id": "evt_f"}')

    assert [retried.status, duplicate.status] == [200, 200]
    assert await duplicate.text() == await retried.text() == "ok-1"
    (row,) = await fetch(pg_dsn, f'SELECT answer_status, answer_body FROM "{table}"')
    assert (row["answer_status"], row["answer_body"]) == (200, b"ok-1")


async def test_an_answer_over_replay_max_body_is_relayed_and_its_duplicates_acknowledged(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.respond = lambda n: web.Response(body=b"x" * 100)
    client = await make_proxy(routes=[replay_route(replay_max_body="64")])

    with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
        first = await client.post("/webhooks/corvel", data=b'{"id": "evt_big"}')
    again = await client.post("/webhooks/corvel", data=b'{"id": "evt_big"}')

    assert (first.status, await first.read()) == (200, b"x" * 100)
    assert await again.json() == {"status": "duplicate", "event_id": "evt_big"}
    assert "Idempotent-Replayed" not in again.headers
    (line,) = [r for r in caplog.records if hasattr(r, "fields")]
    assert line.levelno == logging.WARNING
    assert line.fields["replay_skipped"] == "answer of 100 bytes over replay_max_body"
    registry = client.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_replay_skipped_total", {"route": "corvel"}) == 1
    assert registry.get_sample_value("dedup_replays_total", {"route": "corvel"}) == 0


async def test_a_claim_from_before_replay_was_turned_on_is_acknowledged(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    before = await make_proxy(routes=[replay_route(on_duplicate="ack")])
    await before.post("/webhooks/corvel", data=b'{"id": "evt_old"}')
    after = await make_proxy(routes=[replay_route()])
    again = await after.post("/webhooks/corvel", data=b'{"id": "evt_old"}')
    assert await again.json() == {"status": "duplicate", "event_id": "evt_old"}
    assert len(upstream.requests) == 1


async def test_replays_are_counted_and_logged(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_proxy(routes=[replay_route()])
    await client.post("/webhooks/corvel", data=b'{"id": "evt_n"}')
    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        await client.post("/webhooks/corvel", data=b'{"id": "evt_n"}')
    (line,) = [r.fields for r in caplog.records if hasattr(r, "fields")]
    assert (line["outcome"], line["replayed"]) == ("duplicate", True)
    registry = client.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_replays_total", {"route": "corvel"}) == 1


async def create_previous_release_table(dsn: str, table: str) -> None:
    """The claim table as the release before the answer columns created it."""
    await execute(
        dsn,
        f'CREATE TABLE "{table}" (scope text NOT NULL, event_id text NOT NULL, '
        "event_type text, received_at timestamptz NOT NULL DEFAULT now(), body_sha256 bytea, "
        "PRIMARY KEY (scope, event_id)); "
        f'CREATE INDEX "{table}_received_at_idx" ON "{table}" (received_at)',
    )


async def test_a_table_without_the_answer_columns_is_upgraded(
    pg_dsn: str, table: str, make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    await create_previous_release_table(pg_dsn, table)
    connection = await asyncpg.connect(pg_dsn)
    try:
        lacking = await database.missing_schema(connection, sql.for_table(table))
    finally:
        await connection.close()
    assert lacking == "lacks the answer columns (on_duplicate: replay)"

    client = await make_proxy(routes=[replay_route()])  # create_schema: true upgrades it
    await client.post("/webhooks/corvel", data=b'{"id": "evt_up"}')
    again = await client.post("/webhooks/corvel", data=b'{"id": "evt_up"}')
    assert again.headers["Idempotent-Replayed"] == "true"


REPLAY_SECRET = "operator-replay-secret"


async def test_a_dead_letter_replay_goes_through_the_same_claim(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    # The operator's replay job posts to a route of its own that shares the provider route's
    # scope, signed with the operator's secret (hmac: no timestamp to go stale).
    replay = {
        "name": "stripe-replay",
        "path": "/replay/stripe",
        "preset": "stripe",
        "scope": "stripe",
        "verify": {"scheme": "hmac", "header": "X-Replay-Signature", "secret": REPLAY_SECRET},
    }
    upstream.respond = lambda n: web.Response(status=500 if n == 1 else 200, text=f"r{n}")
    client = await make_proxy(routes=[stripe_route(), replay])
    processed, failed = event("evt_done"), event("evt_lost")
    assert (
        await client.post("/webhooks/stripe", data=processed, headers=stripe_headers(processed))
    ).status == 200
    assert (
        await client.post("/webhooks/stripe", data=failed, headers=stripe_headers(failed))
    ).status == 500

    # Hours later the provider's signature is stale: the provider route refuses it.
    stale = stripe_headers(failed, at=int(time.time()) - 3 * 3600)
    assert (await client.post("/webhooks/stripe", data=failed, headers=stale)).status == 401

    def signed(body: bytes, secret: str = REPLAY_SECRET) -> dict[str, str]:
        digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        return {"X-Replay-Signature": digest, "Content-Type": "application/json"}

    forged = await client.post("/replay/stripe", data=failed, headers=signed(failed, "guess"))
    answers = [
        await client.post("/replay/stripe", data=body, headers=signed(body))
        for body in (processed, failed, failed)
    ]

    assert forged.status == 401
    assert [a.status for a in answers] == [200, 200, 200]
    # The app's own answer for the one processed; the proxy's acknowledgement for duplicates.
    assert [a.headers.get("Dedup-Status") for a in answers] == ["duplicate", None, "duplicate"]
    assert await answers[1].text() == "r2"
    # The app: evt_done once, evt_lost twice (its failed delivery, then the replay) and done.
    seen = [r.body for r in upstream.requests]
    assert seen == [processed, failed, failed]
    rows = await fetch(pg_dsn, f'SELECT scope, event_id FROM "{table}" ORDER BY event_id')
    assert [tuple(row) for row in rows] == [("stripe", "evt_done"), ("stripe", "evt_lost")]


def test_replay_options_need_replay_and_a_bounded_size() -> None:
    raw: dict[str, Any] = {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "embedded"},
        "routes": [
            replay_route(on_duplicate="ack", replay_set_cookie=True),
            {**replay_route(replay_max_body="2MiB"), "name": "b", "path": "/b"},
        ],
    }
    with pytest.raises(errors.ConfigError) as info:
        config.parse(raw)
    assert info.value.problems == (
        "routes[0].replay_set_cookie: only with on_duplicate: replay",
        "routes[1].replay_max_body: must be at most 1048576 (1MiB)",
    )


def test_answers_that_cannot_be_stored_as_text_are_not() -> None:
    assert replay.storable("text/xml; charset=utf-8")
    assert replay.storable("caf\u00e9")
    assert not replay.storable("a\udcff")  # a byte that was not UTF-8, surrogate-escaped
    assert not replay.storable("a\x00b")


async def test_the_answer_columns_are_added_only_for_replay_and_never_stall_claims(
    pg_dsn: str, table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await create_previous_release_table(pg_dsn, table)
    queries = sql.for_table(table)
    holder = await asyncpg.connect(pg_dsn)
    connection = await asyncpg.connect(pg_dsn)
    try:
        # Without replay the old table is complete: no DDL, no lock.
        assert await database.missing_schema(connection, queries, answers=False) == ""
        # A claim in flight holds the table; the upgrade gives up instead of queueing every
        # new claim behind it.
        await holder.execute(f"BEGIN; INSERT INTO \"{table}\" (scope, event_id) VALUES ('s', 'e')")
        monkeypatch.setattr(database.store, "DDL_LOCK_WAIT", 0.2)
        with pytest.raises(errors.StoreUnavailable, match=r"could not lock the table within 0\.2s"):
            await database.apply_schema(connection, queries)
        await holder.execute("ROLLBACK")
        await database.apply_schema(connection, queries)
        assert await database.missing_schema(connection, queries) == ""
    finally:
        await holder.close()
        await connection.close()


async def test_a_copy_with_another_body_never_gets_the_stored_answer(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = twiml
    client = await make_proxy(routes=[replay_route(replay_set_cookie=True)])
    first = await client.post("/webhooks/corvel", data=b'{"id": "e1", "to": "alice"}')

    other = await client.post("/webhooks/corvel", data=b'{"id": "e1", "to": "mallory"}')

    assert first.status == 201
    assert (other.status, other.headers["Dedup-Status"]) == (200, "duplicate")
    assert "Set-Cookie" not in other.headers
    assert "Idempotent-Replayed" not in other.headers
    assert await other.json() == {"status": "duplicate", "event_id": "e1"}
    assert len(upstream.requests) == 1


async def test_an_ack_route_sharing_a_scope_never_gets_the_replay_routes_answer_in_flight(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = twiml
    upstream.gate = asyncio.Event()
    client = await make_proxy(
        routes=[
            replay_route(scope="shared"),
            {"name": "plain", "path": "/webhooks/plain", "event_id": "body:/id", "scope": "shared"},
        ]
    )
    body = b'{"id": "e1"}'
    first = asyncio.create_task(client.post("/webhooks/corvel", data=body))
    await upstream.arrived.wait()
    # The copy on the ack route queues behind the first in this process's single-flight.
    copy = asyncio.create_task(client.post("/webhooks/plain", data=body))
    await wait_until(lambda: asyncio.sleep(0, result=in_flight(client, 2)), "the copy to queue")
    upstream.gate.set()

    replayed, acknowledged = await first, await copy

    assert replayed.status == 201
    assert await acknowledged.json() == {"status": "duplicate", "event_id": "e1"}
    assert "Idempotent-Replayed" not in acknowledged.headers
    assert len(upstream.requests) == 1


def in_flight(client: Any, count: int) -> bool:
    """Whether ``count`` requests for one event are in this process's single-flight."""
    return client.app[app_keys.FLIGHTS].waiting(("shared", "e1")) >= count
