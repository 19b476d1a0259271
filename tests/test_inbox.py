"""The inbox (``redeliver``), in process on a real PostgreSQL: a failed delivery is kept in its
claim's row and redelivered through it; what the app and the claim table received."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from proxy import app_keys, database, errors
from proxy.config import redeliver
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    connection,
    execute,
    fetch,
    free_port,
    run_cli,
    send,
    sweeper_of,
    wait_until,
)

FAST = {"schedule": ["200ms"], "for": "1d"}


def route(**redeliver: Any) -> dict[str, Any]:
    return {
        "name": "hooks",
        "path": "/hooks",
        "event_id": "body:/id",
        "redeliver": {**FAST, **redeliver},
    }


QUICK = {"poll": "100ms", "rate": 1000}


def failing(until: int, status: int = 503) -> Any:
    """The first ``until`` requests answered ``status``, the others 200."""
    return lambda n: web.Response(status=status if n < until else 200, text=f"answer {n}")


async def rows(dsn: str, table: str) -> dict[str, Any]:
    found = await fetch(
        dsn,
        f"SELECT event_id, inbox_state, inbox_body, inbox_request, inbox_attempts, "
        f'inbox_failures FROM "{table}" ORDER BY event_id',
    )
    return {row["event_id"]: row for row in found}


async def test_a_failed_delivery_is_kept_answered_202_and_redelivered_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)
    body = b'{"id": "evt_1", "n": 1}'

    first = await proxy.post("/hooks?x=1", data=body, headers={"X-Custom": "a"})

    assert first.status == 202
    assert first.headers["Dedup-Status"] == "queued"
    assert await first.json() == {"status": "queued", "event_id": "evt_1", "upstream_status": 503}
    await wait_until(lambda: _count(upstream, 2), "the redelivery")
    again = upstream.requests[1]
    assert (again.method, again.path_qs, again.body) == ("POST", "/hooks?x=1", body)
    assert again.headers["x-custom"] == ["a"]
    assert again.headers["x-request-id"] == upstream.requests[0].headers["x-request-id"]
    await wait_until(lambda: _state(pg_dsn, table, "evt_1", "delivered"), "delivered")
    row = (await rows(pg_dsn, table))["evt_1"]
    assert row["inbox_body"] is None  # dropped once delivered, and so is the request
    assert row["inbox_request"] is None
    attempts = json.loads(row["inbox_attempts"])
    assert [a["status"] for a in attempts] == [503, 200]
    # Delivered: a copy now is an ordinary duplicate, never forwarded.
    copy = await proxy.post("/hooks?x=1", data=body)
    assert (copy.status, copy.headers["Dedup-Status"]) == (200, "duplicate")
    await asyncio.sleep(0.5)
    assert len(upstream.requests) == 2


async def test_a_copy_of_a_pending_event_is_answered_and_never_forwarded(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(10**6)  # down for the whole test
    proxy = await make_proxy(routes=[route(schedule=["1h"])], redeliverer=QUICK)
    body = b'{"id": "evt_2"}'
    assert (await proxy.post("/hooks", data=body)).status == 202

    copies = await asyncio.gather(*(proxy.post("/hooks", data=body) for _ in range(5)))
    other = await proxy.post("/hooks", data=b'{"id": "evt_2", "other": true}')

    for copy in copies:
        assert copy.status == 202
        assert copy.headers["Dedup-Status"] == "duplicate_queued"
        assert await copy.json() == {"status": "duplicate", "event_id": "evt_2", "kept": "pending"}
    assert other.headers["Dedup-Status"] == "duplicate_queued"  # a mismatch is still one
    assert len(upstream.requests) == 1


async def test_an_unreachable_app_is_redelivered_once_it_listens(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_server: Any, pg_dsn: str, table: str
) -> None:
    port = free_port()
    proxy = await make_proxy(
        routes=[{**route(), "upstream": f"http://127.0.0.1:{port}"}], redeliverer=QUICK
    )
    first = await proxy.post("/hooks", data=b'{"id": "evt_3"}')
    assert (first.status, first.headers["Dedup-Status"]) == (202, "queued")
    await asyncio.sleep(0.6)  # a few failed redeliveries while nothing listens
    assert (await rows(pg_dsn, table))["evt_3"]["inbox_state"] == "pending"

    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", upstream.handle)
    await aiohttp_server(application, port=port)

    await wait_until(lambda: _state(pg_dsn, table, "evt_3", "delivered"), "delivered", 15)
    assert len(upstream.requests) == 1
    attempts = json.loads((await rows(pg_dsn, table))["evt_3"]["inbox_attempts"])
    assert attempts[0]["status"] is None
    assert "upstream" in attempts[0]["error"]
    assert attempts[-1]["status"] == 200


async def test_an_answer_retrying_cannot_fix_is_dead_at_once_and_an_operator_brings_it_back(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(1, status=422)
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)

    first = await proxy.post("/hooks", data=b'{"id": "evt_4"}')

    assert (first.status, first.headers["Dedup-Status"]) == (202, "dead_letter")
    await asyncio.sleep(0.6)
    assert len(upstream.requests) == 1  # dead: not redelivered by itself
    copy = await proxy.post("/hooks", data=b'{"id": "evt_4"}')
    assert (await copy.json())["kept"] == "dead"

    store = proxy.app[app_keys.STORE]
    changed = await store.inbox.redeliver("hooks", ["evt_4"], None, 3600.0)
    assert changed == [("hooks", "evt_4")]
    await wait_until(lambda: _state(pg_dsn, table, "evt_4", "delivered"), "delivered")
    assert len(upstream.requests) == 2


async def test_a_410_is_kept_and_recorded_alike_at_the_first_delivery_and_a_redelivery(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(2, status=410)  # the first delivery and the first redelivery
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)

    first = await proxy.post("/hooks", data=b'{"id": "evt_410"}')

    # Kept, never relayed (a Standard Webhooks sender disables an endpoint answering 410), and
    # the app's status said as it was, not as the 502 a route without redeliver answers.
    assert (first.status, first.headers["Dedup-Status"]) == (202, "queued")
    assert await first.json() == {"status": "queued", "event_id": "evt_410", "upstream_status": 410}
    await wait_until(lambda: _state(pg_dsn, table, "evt_410", "delivered"), "delivered")
    attempts = json.loads((await rows(pg_dsn, table))["evt_410"]["inbox_attempts"])
    gone = {"status": 410, "error": "upstream answered 410 Gone"}
    assert [{k: a.get(k) for k in gone} for a in attempts] == [
        gone,
        gone,
        {"status": 200, "error": None},
    ]
    assert len(upstream.requests) == 3


async def test_max_pending_bytes_counts_the_headers_a_kept_row_stores_not_only_its_body(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(10**6)
    proxy = await make_proxy(
        routes=[route(schedule=["1h"], max_pending_bytes="64KiB")], redeliverer=QUICK
    )
    # About 40 KiB of headers around a 13-byte body: two such rows do not fit 64 KiB.
    heavy = {f"X-Padding-{n}": "p" * 8000 for n in range(5)}

    answers = [
        await proxy.post("/hooks", data=f'{{"id": "h{n}"}}'.encode(), headers=heavy)
        for n in range(3)
    ]

    assert [a.status for a in answers] == [202, 503, 503]
    assert sorted(await rows(pg_dsn, table)) == ["h0"]


async def test_a_kept_row_records_the_bytes_it_stores_and_drops_them_once_delivered(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[route(schedule=["1h"])], redeliverer=QUICK)
    answer = await proxy.post("/hooks", data=b'{"id": "s1"}', headers={"X-Pad": "p" * 500})
    assert answer.status == 202

    stored = (
        "octet_length(inbox_request::text) + octet_length(inbox_body) "
        "+ octet_length(inbox_attempts::text)"
    )
    [row] = await fetch(pg_dsn, f'SELECT inbox_size, {stored} AS stored FROM "{table}"')
    assert row["inbox_size"] == row["stored"] > 500

    await proxy.app[app_keys.STORE].inbox.redeliver("hooks", ["s1"], None, 3600.0)
    await wait_until(lambda: _state(pg_dsn, table, "s1", "delivered"), "delivered")
    [row] = await fetch(pg_dsn, f'SELECT inbox_size FROM "{table}"')
    assert row["inbox_size"] is None


async def test_max_pending_bytes_counts_a_row_kept_without_its_size_from_what_it_stores(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(10**6)
    proxy = await make_proxy(
        routes=[route(schedule=["1h"], max_pending_bytes="64KiB")], redeliverer=QUICK
    )
    heavy = {f"X-Padding-{n}": "p" * 8000 for n in range(5)}
    assert (await proxy.post("/hooks", data=b'{"id": "h0"}', headers=heavy)).status == 202
    # As a replica of 0.2.0 keeps it (or as it was kept before the upgrade): no inbox_size.
    await execute(pg_dsn, f'UPDATE "{table}" SET inbox_size = NULL')

    answer = await proxy.post("/hooks", data=b'{"id": "h1"}', headers=heavy)

    assert answer.status == 503
    assert sorted(await rows(pg_dsn, table)) == ["h0"]


async def test_past_for_a_pending_event_is_dead(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(10**6)
    proxy = await make_proxy(routes=[route(schedule=["100ms"], **{"for": "1s"})], redeliverer=QUICK)
    assert (await proxy.post("/hooks", data=b'{"id": "evt_5"}')).status == 202

    await wait_until(lambda: _state(pg_dsn, table, "evt_5", "dead"), "dead", 10)
    row = (await rows(pg_dsn, table))["evt_5"]
    assert row["inbox_body"] == b'{"id": "evt_5"}'  # kept for inspection
    attempts = json.loads(row["inbox_attempts"])
    assert len(attempts) == len(upstream.requests) >= 3
    await asyncio.sleep(0.4)
    assert len(upstream.requests) == len(attempts)  # and tried no more


async def test_over_the_cap_the_failure_is_relayed_and_the_claim_released(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(10**6)
    proxy = await make_proxy(routes=[route(schedule=["1h"], max_pending=2)], redeliverer=QUICK)

    answers = [await proxy.post("/hooks", data=f'{{"id": "c{n}"}}'.encode()) for n in range(3)]

    assert [a.status for a in answers] == [202, 202, 503]
    assert await answers[2].text() == "answer 2"  # the app's own answer, relayed
    assert sorted(await rows(pg_dsn, table)) == ["c0", "c1"]  # c2 released, as without an inbox
    registry = proxy.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_inbox_full_total", {"route": "hooks"}) == 1
    # The provider's retry of c2 is claimed anew.
    assert (await proxy.post("/hooks", data=b'{"id": "c2"}')).status == 503
    assert len(upstream.requests) == 4


async def test_pending_and_dead_rows_are_never_swept_dead_ones_after_their_retention(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=422 if n == 1 else 503 if n else 200)
    proxy = await make_proxy(
        routes=[{**route(schedule=["1h"], dead_retention="2d"), "retention": "1d"}],
        redeliverer=QUICK,
    )
    for n in range(3):  # e0 delivered, e1 dead, e2 pending
        await proxy.post("/hooks", data=f'{{"id": "e{n}"}}'.encode())
    await execute(pg_dsn, f"UPDATE \"{table}\" SET received_at = now() - interval '5 days'")

    removed = await sweeper_of(proxy).sweep()

    assert removed == {"hooks": 1}
    assert sorted(await rows(pg_dsn, table)) == ["e1", "e2"]
    await execute(pg_dsn, f"UPDATE \"{table}\" SET inbox_changed = now() - interval '3 days'")
    assert await sweeper_of(proxy).sweep() == {"hooks": 1}
    assert sorted(await rows(pg_dsn, table)) == ["e2"]  # pending: never swept


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"on_duplicate": "replay"}, "not with on_duplicate: replay"),
        # Before: "not with on_duplicate: replay", a key the route never wrote.
        (
            {
                "preset": "twilio",
                "event_id": None,
                "verify": {"secret": "s", "public_url": "https://hooks.example.com"},
            },
            "redeliver: not with preset twilio, which answers a duplicate with the app's first "
            "answer (on_duplicate: replay, its default)",
        ),
        ({"semantics": "idempotency-key", "event_id": None}, "not with semantics: idempotency-key"),
        ({"retention": "1d", "redeliver": {"for": "3d"}}, "must be at most the route's retention"),
        ({"redeliver": "sometimes"}, "must be true, false or a mapping"),
        ({"redeliver": {"schedule": ["2h"], "for": "1h"}}, "must be shorter than 'for'"),
    ],
)
def test_routes_whose_answer_matters_refuse_redeliver(
    proxy_config: Any, extra: dict[str, Any], problem: str
) -> None:
    raw = {**route(), **extra}
    raw = {key: value for key, value in raw.items() if value is not None}
    with pytest.raises(errors.ConfigError) as refused:
        proxy_config(routes=[raw])
    assert problem in str(refused.value)


def test_a_pool_of_one_connection_is_refused_with_redeliver(proxy_config: Any) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        proxy_config(routes=[route()], database={"pool_size": 1})
    assert "database.pool_size: must be at least 2 with a route that redelivers" in str(
        refused.value
    )


def test_redeliver_true_takes_the_defaults(proxy_config: Any) -> None:
    cfg = proxy_config(routes=[{**route(), "redeliver": True}])
    assert cfg.routes[0].redeliver == redeliver.Redeliver()
    assert cfg.routes[0].redeliver.delay(1) == 10.0
    assert cfg.routes[0].redeliver.delay(99) == 6 * 3600.0


async def _count(upstream: FakeUpstream, n: int) -> bool:
    return len(upstream.requests) >= n


async def _state(dsn: str, table: str, event_id: str, state: str) -> bool:
    found = await fetch(dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1', event_id)
    return bool(found) and found[0]["inbox_state"] == state


async def test_two_replicas_never_redeliver_one_event_at_once(
    make_proxy: MakeProxy, aiohttp_server: Any, pg_dsn: str, table: str
) -> None:
    in_flight: dict[bytes, int] = {}
    overlaps: list[bytes] = []
    first_try: set[bytes] = set()

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        if body not in first_try:  # every first delivery fails
            first_try.add(body)
            return web.Response(status=503)
        in_flight[body] = in_flight.get(body, 0) + 1
        if in_flight[body] > 1:
            overlaps.append(body)
        await asyncio.sleep(0.3)  # held long enough for the other replica to look
        in_flight[body] -= 1
        delivered.append(body)
        return web.Response(status=200)

    delivered: list[bytes] = []
    application = web.Application()
    application.router.add_post("/hooks", handle)
    app_url = str((await aiohttp_server(application)).make_url("")).rstrip("/")
    many = {"concurrency": 4, "poll": "50ms", "rate": 1000}
    both = [{**route(), "upstream": app_url}]
    replicas = [await make_proxy(routes=both, redeliverer=many) for _ in range(2)]
    for n in range(10):
        answer = await replicas[n % 2].post("/hooks", data=f'{{"id": "r{n}"}}'.encode())
        assert answer.status == 202

    async def all_delivered() -> bool:
        found = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}"')
        return [r["inbox_state"] for r in found] == ["delivered"] * 10

    await wait_until(all_delivered, "every redelivery", 30)
    assert overlaps == []
    assert sorted(delivered) == sorted(f'{{"id": "r{n}"}}'.encode() for n in range(10))


async def test_a_redelivery_cut_off_by_shutdown_is_released_for_the_next_try(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    gate = asyncio.Event()
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK, shutdown_timeout="500ms")
    assert (await proxy.post("/hooks", data=b'{"id": "s1"}')).status == 202
    upstream.gate = gate  # the redelivery hangs in the app
    await wait_until(lambda: _count(upstream, 2), "the redelivery reaching the app")

    await proxy.close()  # the drain: the redelivery does not finish within shutdown_timeout

    row = (await rows(pg_dsn, table))["s1"]
    assert row["inbox_state"] == "pending"  # released, not lost, no attempt recorded
    assert row["inbox_failures"] == 1
    gate.set()
    upstream.gate = None
    await make_proxy(routes=[route()], redeliverer=QUICK)
    await wait_until(lambda: _state(pg_dsn, table, "s1", "delivered"), "the next try")


async def test_redeliveries_are_oldest_first_and_at_most_concurrency_at_once(
    make_proxy: MakeProxy, aiohttp_server: Any, pg_dsn: str, table: str
) -> None:
    order: list[str] = []
    level = {"now": 0, "max": 0}
    recovered = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        if not recovered.is_set():
            return web.Response(status=503)
        level["now"] += 1
        level["max"] = max(level["max"], level["now"])
        order.append(json.loads(await request.read())["id"])
        await asyncio.sleep(0.05)
        level["now"] -= 1
        return web.Response(status=200)

    application = web.Application()
    application.router.add_post("/hooks", handle)
    app_url = str((await aiohttp_server(application)).make_url("")).rstrip("/")
    proxy = await make_proxy(
        routes=[{**route(schedule=["1h"]), "upstream": app_url}],
        redeliverer={"concurrency": 2, "poll": "50ms", "rate": 1000},
    )
    ids = [f"o{n:02d}" for n in range(12)]
    for event_id in ids:
        assert (await proxy.post("/hooks", data=f'{{"id": "{event_id}"}}'.encode())).status == 202
    recovered.set()
    # Received in this order, a second apart, and all due at once.
    await execute(
        pg_dsn,
        "; ".join(
            f"UPDATE \"{table}\" SET received_at = now() - interval '{100 - n} seconds', "
            f"inbox_due = now() WHERE event_id = '{event_id}'"
            for n, event_id in enumerate(ids)
        ),
    )

    await wait_until(lambda: _delivered(order, len(ids)), "every redelivery", 30)
    assert level["max"] == 2  # both lanes at work, never more
    # Each lane takes the oldest due row no one holds: with two lanes, an event reaches the
    # app at most one place away from the order it was received in.
    assert sorted(order) == ids
    assert all(abs(order.index(event_id) - n) <= 1 for n, event_id in enumerate(ids))


async def _delivered(order: list[str], n: int) -> bool:
    return len(order) >= n


def test_redeliver_true_keeps_for_within_a_short_retention(proxy_config: Any) -> None:
    cfg = proxy_config(routes=[{**route(), "redeliver": True, "retention": "1d"}])
    assert cfg.routes[0].redeliver.for_ == 86400.0  # Slack's and Shopify's presets keep a day


async def test_a_copy_during_its_redelivery_does_not_wait_on_the_row_lock(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK, claim_wait="1s")
    body = b'{"id": "w1"}'
    assert (await proxy.post("/hooks", data=body)).status == 202
    upstream.gate = asyncio.Event()  # the redelivery holds the row lock, the app never answers
    await wait_until(lambda: _count(upstream, 2), "the redelivery to reach the app")

    copy = await proxy.post("/hooks", data=body)

    # A row locked FOR UPDATE does not hold up INSERT … ON CONFLICT DO NOTHING: no 503 after
    # claim_wait, and the copy is not forwarded.
    assert (copy.status, copy.headers["Dedup-Status"]) == (202, "duplicate_queued")
    assert len(upstream.requests) == 2
    upstream.gate.set()


async def test_check_says_how_a_route_redelivers(tmp_path: Any, pg_dsn: str) -> None:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        json.dumps(
            {
                "upstream": {"url": "http://127.0.0.1:9"},
                "database": {"dsn": pg_dsn},
                "routes": [route(schedule=["500ms", "10s", "2h"], **{"for": "3d"})],
            }
        )
    )
    code, out, _ = await run_cli("check", "--config", str(config_file))
    assert code == 0
    assert "failures kept, redelivered after 500ms/10s/2h for 3d" in out


async def test_a_header_in_utf8_is_kept_and_redelivered_byte_exact(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing(1)
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)
    body = b'{"id": "obs1"}'
    raw = (
        b"POST /hooks?q=%%e9 HTTP/1.1\r\nHost: proxy.test\r\nUser-Agent: caf\xc3\xa9\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    async with connection(proxy) as stream:
        answer = await send(stream, raw)

    assert answer is not None
    assert answer.status == 202
    await wait_until(lambda: _state(pg_dsn, table, "obs1", "delivered"), "the redelivery")
    first, again = upstream.requests
    assert again.headers["user-agent"] == first.headers["user-agent"] == ["caf\u00e9"]
    assert again.path_qs == first.path_qs


def test_a_header_kept_before_header_refused_is_redelivered_as_its_bytes() -> None:
    """A value that is not UTF-8 is refused now (400), but a row kept before may hold one:
    JSON cannot hold it as text, so it is kept as its bytes in base64 and read back as them."""
    agent = b"caf\xe9".decode("utf-8", "surrogateescape")
    kept = database.StoredRequest(
        "hooks", "http://app", "POST", "/hooks", (("User-Agent", agent),), b""
    )

    assert '{"base64":"Y2Fm6Q=="}' in kept.encoded()
    assert database.StoredRequest.decoded(kept.encoded(), b"") == kept


# An app's error page: markup, a terminal's controls and a NUL, past the bound kept of a body.
APP_ERROR = (
    b"<h1>Internal Server Error</h1><script>alert(1)</script>\x1b]52;c;aGk=\x07\x1b[2J\x00"
    + b"x" * 3000
)


def failing_with_a_body(until: int) -> Any:
    """The first ``until`` requests answered 500 with ``APP_ERROR``, the others 200."""

    def respond(n: int) -> web.Response:
        if n >= until:
            return web.Response(status=200, text="thanks")
        headers = {"Retry-After": "1", "Set-Cookie": "session=s3cret", "X-Trace": "t" * 400}
        headers.update({f"X-Extra-{i}": str(i) for i in range(20)})
        return web.Response(status=500, body=APP_ERROR, headers=headers, content_type="text/html")

    return respond


async def test_each_attempt_keeps_what_the_app_answered_bounded_and_how_long_it_took(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing_with_a_body(2)
    proxy = await make_proxy(routes=[route()], redeliverer=QUICK)
    assert (await proxy.post("/hooks", data=b'{"id": "evt_body"}')).status == 202

    await wait_until(lambda: _state(pg_dsn, table, "evt_body", "delivered"), "delivered")
    attempts = json.loads((await rows(pg_dsn, table))["evt_body"]["inbox_attempts"])
    assert [(a["n"], a["status"], a["error"]) for a in attempts] == [
        (1, 500, None), (2, 500, None), (3, 200, None)
    ]  # fmt: skip
    assert all(isinstance(a["ms"], int | float) and a["ms"] >= 0 for a in attempts)
    failed = attempts[0]
    assert failed["body_bytes"] == len(APP_ERROR)
    # The first ATTEMPT_BODY bytes, as text: the NUL (which jsonb cannot hold) replaced.
    assert failed["body"] == APP_ERROR[: database.ATTEMPT_BODY].decode().replace("\0", "\ufffd")
    assert len(failed["body"]) == database.ATTEMPT_BODY  # characters: one byte each but the NUL
    names = [name.lower() for name, _ in failed["headers"]]
    assert names[:2] == ["content-type", "retry-after"]  # the two that say most, first
    assert len(names) == database.ATTEMPT_HEADERS
    assert "set-cookie" not in names  # a credential the app sets: never kept
    trace = dict((n.lower(), v) for n, v in failed["headers"])["x-trace"]
    assert trace == "t" * database.ATTEMPT_HEADER_VALUE
    assert (attempts[2]["body"], attempts[2]["body_bytes"]) == ("thanks", 6)


async def test_a_row_keeps_its_first_and_newest_attempts_and_counts_their_bytes(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = failing_with_a_body(10**6)
    proxy = await make_proxy(routes=[route(schedule=["10ms"])], redeliverer=QUICK)
    assert (await proxy.post("/hooks", data=b'{"id": "evt_many"}')).status == 202
    made = "(inbox_attempts -> -1 ->> 'n')::int"

    async def tried() -> bool:
        found = await fetch(pg_dsn, f'SELECT {made} AS n FROM "{table}"')
        return found[0]["n"] >= database.ATTEMPTS_KEPT + 5

    await wait_until(tried, "more attempts than a row keeps", 30)
    stored = (
        "octet_length(inbox_request::text) + octet_length(inbox_body) "
        "+ octet_length(inbox_attempts::text)"
    )
    [row] = await fetch(
        pg_dsn, f'SELECT inbox_attempts, inbox_size, {stored} AS stored FROM "{table}"'
    )
    numbers = [a["n"] for a in json.loads(row["inbox_attempts"])]
    assert len(numbers) == database.ATTEMPTS_KEPT
    assert numbers[0] == 1
    assert numbers[1:] == list(range(numbers[-1] - database.ATTEMPTS_KEPT + 2, numbers[-1] + 1))
    # Every answer's bytes are in the row's size, which the inbox's byte cap sums.
    assert row["inbox_size"] == row["stored"] > database.ATTEMPTS_KEPT * database.ATTEMPT_BODY
    listed, _ = await proxy.app[app_keys.STORE].inbox.kept("hooks", database.InboxState.PENDING, 5)
    # Every attempt counted, not those kept; the redeliverer goes on every 10 ms, so more may
    # have been made since the row was read (seen on the compiled build).
    assert listed[0].attempts >= numbers[-1] > database.ATTEMPTS_KEPT
