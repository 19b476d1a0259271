"""End-to-end behaviour through ``create_app``: the rows of the README's situation table that no
module of their own covers (a new event, the app's non-2xx, an unreachable or slow app, a
duplicate, an unusable event ID, a COMMIT that fails, a body over ``max_body`` or cut off by the
provider, pass-through).

The other rows, by module: a malformed or cut-short answer ``test_http1``, ``test_obs_text``;
replay ``test_replay``; signatures ``test_providers``, ``test_signatures``; idempotency keys
``test_idempotency``; copies in flight and ``claim_wait`` ``test_concurrency``; the database or
its pool unavailable ``test_store``; the reconciled COMMIT ``test_ambiguous_commit``; an
upstream 410 ``test_reliability``; ``max_buffered`` ``test_memory``, ``test_unread_clients``;
``max_connections`` ``test_connections``; slow bodies ``test_slow_bodies``,
``test_hostile_http``; path variants and methods ``test_paths``.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
from typing import Any

import pytest
from aiohttp import web

from proxy import app_keys
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    claimed,
    connection,
    event,
    execute,
    free_port,
    logged_errors,
    read_answer,
    wait_until,
)


async def test_new_event_is_forwarded_once_and_relayed_byte_exact(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy()
    body = event("evt_1", amount=100)

    response = await client.post("/webhooks/corvel?x=1", data=body)

    assert response.status == 200
    assert await response.read() == b"processed\x00bytes"
    assert response.headers["X-Upstream"] == "yes"
    assert "Dedup-Status" not in response.headers
    assert [(r.method, r.path_qs, r.body) for r in upstream.requests] == [
        ("POST", "/webhooks/corvel?x=1", body)
    ]
    assert await claimed(pg_dsn, table) == [("corvel", "evt_1", "charge.succeeded")]


async def test_duplicate_of_committed_event_is_absorbed(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    client = await make_proxy()
    first = await client.post("/webhooks/corvel", data=event("evt_dup"))
    assert first.status == 200

    second = await client.post("/webhooks/corvel", data=event("evt_dup"))

    assert second.status == 200
    assert second.headers["Dedup-Status"] == "duplicate"
    assert await second.json() == {"status": "duplicate", "event_id": "evt_dup"}
    assert len(upstream.requests) == 1


async def test_integer_id_and_header_id(make_proxy: MakeProxy, upstream: FakeUpstream) -> None:
    client = await make_proxy()
    assert (await client.post("/webhooks/corvel", data=event(42))).status == 200
    duplicate = await client.post("/webhooks/corvel", data=event(42))
    assert await duplicate.json() == {"status": "duplicate", "event_id": "42"}

    headers = {"X-GitHub-Delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958"}
    assert (await client.post("/webhooks/github", data=b"{}", headers=headers)).status == 200
    again = await client.post("/webhooks/github", data=b"{}", headers=headers)
    assert again.headers["Dedup-Status"] == "duplicate"
    assert len(upstream.requests) == 2


async def test_same_id_on_two_routes_is_two_events(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy()
    await client.post("/webhooks/corvel", data=event("shared-id"))
    await client.post("/webhooks/github", data=b"{}", headers={"X-GitHub-Delivery": "shared-id"})

    assert len(upstream.requests) == 2
    assert [row[:2] for row in await claimed(pg_dsn, table)] == [
        ("corvel", "shared-id"),
        ("github", "shared-id"),
    ]


async def test_upstream_failure_releases_the_claim_and_the_retry_goes_through(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: (
        web.Response(status=500, text="boom") if n == 0 else web.Response(text="ok")
    )
    client = await make_proxy()

    failed = await client.post("/webhooks/corvel", data=event("evt_retry"))
    assert failed.status == 500
    assert await failed.text() == "boom"
    assert await claimed(pg_dsn, table) == []

    retried = await client.post("/webhooks/corvel", data=event("evt_retry"))
    assert retried.status == 200
    assert await retried.text() == "ok"
    assert len(upstream.requests) == 2
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_retry"]


async def test_unreachable_upstream_gives_502_and_no_claim(
    make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(upstream={"url": f"http://127.0.0.1:{free_port()}"})

    response = await client.post("/webhooks/corvel", data=event("evt_502"))

    assert response.status == 502
    assert (await response.json())["error"] == "upstream_unavailable"
    assert response.headers["Dedup-Status"] == "upstream_error"
    assert await claimed(pg_dsn, table) == []


async def test_upstream_timeout_gives_504_and_no_claim(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    client = await make_proxy(upstream={"timeout": "300ms"})
    try:
        response = await client.post("/webhooks/corvel", data=event("evt_504"))
    finally:
        upstream.gate.set()

    assert response.status == 504
    assert (await response.json())["error"] == "upstream_timeout"
    assert await claimed(pg_dsn, table) == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"type": "x"}', "no event ID at body:/id"),
        (b"not json", "body is not valid JSON"),
        (b'{"id": ""}', "must be a non-empty string"),
        (b'{"id": {"nested": 1}}', "got object"),
        (b'{"id": null}', "got null"),
        (b'{"id": "a\\u0000b"}', "no control characters"),
    ],
)
async def test_unusable_event_id_gives_400_and_nothing_forwarded(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    body: bytes,
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await make_proxy()

    response = await client.post("/webhooks/corvel", data=body)

    assert response.status == 400
    payload = await response.json()
    assert payload["error"] == "event_id_invalid"
    # A fixed message per error class; the details are in the log line only.
    assert payload["message"] in (
        "The request carries no usable event ID.",
        "The request carries no event ID.",
    )
    (detail,) = logged_errors(caplog)
    assert detail.startswith("route 'corvel': ")
    assert reason in detail
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


async def test_body_over_max_body_gives_413(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(max_body="1KiB")
    big = event("evt_big", padding="x" * 2000)

    declared = await client.post("/webhooks/corvel", data=big)

    async def chunks() -> Any:
        for start in range(0, len(big), 100):
            yield big[start : start + 100]

    streamed = await client.post("/webhooks/corvel", data=chunks())

    assert declared.status == 413
    assert streamed.status == 413
    assert (await streamed.json())["error"] == "body_too_large"
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []
    # Counted on their own: unlike other refusals, a 413 is the operator's to fix.
    registry = client.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_oversized_bodies_total", {"route": "corvel"}) == 2


async def test_the_apps_own_413_is_relayed_but_not_counted_as_over_max_body(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = lambda n: web.Response(status=413, text="too big for the app")
    client = await make_proxy()
    response = await client.post("/webhooks/corvel", data=event("evt_413"))
    assert (response.status, await response.text()) == (413, "too big for the app")
    registry = client.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_oversized_bodies_total", {"route": "corvel"}) == 0


async def test_unrouted_paths_pass_through_without_a_claim(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy()

    get = await client.get("/health?deep=1")
    put = await client.put("/api/items/7", data=b"payload")
    webhook_get = await client.get("/webhooks/corvel")

    assert [r.status for r in (get, put, webhook_get)] == [200, 200, 405]
    # A webhook path is the route's whatever the method: never passed through.
    assert webhook_get.headers["Allow"] == "POST"
    assert (await webhook_get.json())["error"] == "method_not_allowed"
    assert [(r.method, r.path_qs, r.body) for r in upstream.requests] == [
        ("GET", "/health?deep=1", b""),
        ("PUT", "/api/items/7", b"payload"),
    ]
    assert await claimed(pg_dsn, table) == []


async def test_bytes_and_headers_are_forwarded_exactly_minus_hop_by_hop(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    compressed = gzip.compress(event("evt_gzip"))
    raw_answer = gzip.compress(b"accepted")
    upstream.respond = lambda n: web.Response(
        body=raw_answer,
        headers={"Content-Encoding": "gzip", "Keep-Alive": "timeout=5", "X-Trace": "t1"},
    )
    client = await make_proxy(
        routes=[{"name": "raw", "path": "/webhooks/raw", "event_id": "header:Webhook-Id"}]
    )

    response = await client.post(
        "/webhooks/raw",
        data=compressed,
        headers={
            "Webhook-Id": "msg_1",
            "Content-Encoding": "gzip",
            "Content-Type": "application/json",
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "secret-to-this-hop",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic Zm9vOmJhcg==",
            "TE": "trailers",
            "Expect": "100-continue",
            "X-Signature": "sig",
        },
        skip_auto_headers=["User-Agent", "Accept-Encoding", "Accept"],
        auto_decompress=False,
    )

    assert response.status == 200
    assert await response.read() == raw_answer
    assert response.headers["Content-Encoding"] == "gzip"
    assert response.headers["X-Trace"] == "t1"
    assert "Keep-Alive" not in response.headers
    (received,) = upstream.requests
    assert received.body == compressed
    headers = received.headers
    assert headers["content-encoding"] == ["gzip"]
    assert headers["content-type"] == ["application/json"]
    assert headers["x-signature"] == ["sig"]
    assert headers["content-length"] == [str(len(compressed))]
    for dropped in ("x-hop", "keep-alive", "proxy-authorization", "te", "expect"):
        assert dropped not in headers
    # Nothing the provider did not send, apart from X-Forwarded-*.
    for added in ("user-agent", "accept-encoding", "accept"):
        assert added not in headers
    assert headers["x-forwarded-for"] == ["127.0.0.1"]
    assert headers["x-forwarded-proto"] == ["http"]
    assert headers["host"] == headers["x-forwarded-host"]


async def test_commit_that_cannot_be_reconciled_still_answers_2xx_and_logs(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await make_proxy()
    await client.post("/webhooks/corvel", data=event("evt_ok"))  # creates the table
    # A deferred constraint trigger runs at COMMIT: a real PostgreSQL commit failure.
    await execute(
        pg_dsn,
        f"""
        CREATE FUNCTION "{table}_fail"() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF NEW.event_id = 'evt_commit_fails' THEN RAISE EXCEPTION 'commit refused'; END IF;
          RETURN NULL;
        END $$;
        CREATE CONSTRAINT TRIGGER fail_at_commit AFTER INSERT ON "{table}"
          DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION "{table}_fail"();
        """,
    )
    try:
        with caplog.at_level(logging.ERROR, logger="proxy.pipeline"):
            response = await client.post("/webhooks/corvel", data=event("evt_commit_fails"))
    finally:
        await execute(pg_dsn, f'DROP FUNCTION "{table}_fail" CASCADE')

    assert response.status == 200
    assert await response.read() == b"processed\x00bytes"
    assert len(upstream.requests) == 2
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_ok"]
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["outcome"] == "ambiguous_commit"
    assert fields["event_id"] == "evt_commit_fails"
    assert "commit refused" in fields["error"]


async def test_provider_hanging_up_does_not_undo_the_work(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    client = await make_proxy()
    request = asyncio.create_task(client.post("/webhooks/corvel", data=event("evt_hangup")))
    await upstream.arrived.wait()
    request.cancel()  # the provider gives up and closes its connection
    with pytest.raises(asyncio.CancelledError):
        await request

    upstream.gate.set()

    async def committed() -> bool:
        return [row[1] for row in await claimed(pg_dsn, table)] == ["evt_hangup"]

    await wait_until(committed, "the claim to commit after the provider hung up")
    retry = await client.post("/webhooks/corvel", data=event("evt_hangup"))
    assert retry.headers["Dedup-Status"] == "duplicate"
    assert len(upstream.requests) == 1


async def test_redirect_is_relayed_not_followed_and_releases_the_claim(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=302, headers={"Location": "/elsewhere"})
    client = await make_proxy()

    response = await client.post("/webhooks/corvel", data=event("evt_302"), allow_redirects=False)

    assert response.status == 302
    assert response.headers["Location"] == "/elsewhere"
    assert [r.path_qs for r in upstream.requests] == ["/webhooks/corvel"]
    assert await claimed(pg_dsn, table) == []


async def test_route_upstream_override(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_server: Any
) -> None:
    other = FakeUpstream()
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", other.handle)
    other_url = str((await aiohttp_server(application)).make_url("")).rstrip("/")
    client = await make_proxy(
        routes=[
            {"name": "a", "path": "/hooks/a", "event_id": "body:/id"},
            {"name": "b", "path": "/hooks/b", "event_id": "body:/id", "upstream": other_url},
        ]
    )

    await client.post("/hooks/a", data=event("1"))
    await client.post("/hooks/b", data=event("1"))
    await client.get("/unrouted")

    assert [r.path_qs for r in upstream.requests] == ["/hooks/a", "/unrouted"]
    assert [r.path_qs for r in other.requests] == ["/hooks/b"]


@pytest.mark.parametrize(
    "event_id",
    ["it's", "back\\slash\\x41", "'; DROP TABLE x; --", "$$dollar$$", "ünïcødé 🎉", "a" * 256],
)
async def test_ids_with_sql_metacharacters_are_stored_exactly(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, event_id: str
) -> None:
    client = await make_proxy()

    first = await client.post("/webhooks/corvel", data=event(event_id, event_type="t'x\\"))
    again = await client.post("/webhooks/corvel", data=event(event_id, event_type="t'x\\"))

    assert first.status == 200
    assert again.headers["Dedup-Status"] == "duplicate"
    assert await claimed(pg_dsn, table) == [("corvel", event_id, "t'x\\")]
    assert len(upstream.requests) == 1


async def test_the_apps_failures_are_logged_at_warning_level(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.respond = lambda n: web.Response(status=500)
    client = await make_proxy()
    down = await make_proxy(upstream={"url": f"http://127.0.0.1:{free_port()}"})

    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        failed = await client.post("/webhooks/corvel", data=b'{"id": "evt_500"}')
        refused = await down.post("/webhooks/corvel", data=b'{"id": "evt_down"}')
        passed = await down.get("/health")

    assert [failed.status, refused.status, passed.status] == [500, 502, 502]
    lines = [(r.levelname, r.fields["outcome"]) for r in caplog.records if hasattr(r, "fields")]
    assert lines == [("WARNING", "upstream_error")] * 3


async def test_each_outcome_is_logged_at_its_level(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    """A duplicate absorbed is the product (info, as a processed webhook); a scanner's 404 or
    405 is noise for warning-level alerting (info); a webhook refused on a route stays a
    warning (its provider will not retry a 4xx)."""
    client = await make_proxy(passthrough=["/api"])

    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        await client.post("/webhooks/corvel", data=b'{"id": "evt_lv"}')
        await client.post("/webhooks/corvel", data=b'{"id": "evt_lv"}')
        await client.get("/wp-login.php")
        await client.get("/webhooks/corvel")
        await client.post("/webhooks/corvel", data=b'{"no_id": 1}')

    lines = [
        (r.levelname, r.fields["outcome"], r.fields["status"])
        for r in caplog.records
        if hasattr(r, "fields")
    ]
    assert lines == [
        ("INFO", "processed", 200),
        ("INFO", "duplicate", 200),
        ("INFO", "rejected", 404),
        ("INFO", "rejected", 405),
        ("WARNING", "rejected", 400),
    ]


async def test_a_request_body_the_provider_cuts_off_is_400_and_never_forwarded(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    client = await make_proxy()
    with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
        async with connection(client) as (reader, writer):
            writer.write(
                b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 100\r\n"
                b'\r\n{"id": "evt_cut", "type": "t"'
            )
            writer.write_eof()  # the provider's side ends 70 bytes short of its Content-Length
            assert await read_answer(reader) is None  # nobody is left to read the 400

    (line,) = [r.fields for r in caplog.records if hasattr(r, "fields")]
    assert (line["status"], line["outcome"]) == (400, "rejected")
    assert line["error"].startswith("request body ended early")
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


async def test_requests_skip_the_router_but_expect_and_the_response_hook_do_not(
    make_proxy: MakeProxy, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``app.Runner`` hands a request straight to the one route's handler: the router is never
    asked, yet ``request.app`` and the response hook (``Connection: close`` after a chunked
    request) work as through ``Application._handle``, which an ``Expect`` header still takes."""
    client = await make_proxy()
    resolved: list[str] = []
    router = client.app.router
    resolve = router.resolve

    async def counting(request: web.Request) -> Any:
        resolved.append(request.path)
        return await resolve(request)

    monkeypatch.setattr(router, "resolve", counting)
    plain = await client.post("/webhooks/corvel", data=event("evt_direct"))
    assert plain.status == 200
    assert resolved == []

    async with connection(client) as (reader, writer):
        body = event("evt_chunked")
        writer.write(
            b"POST /webhooks/corvel HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        chunked = await read_answer(reader)
    assert chunked is not None
    assert chunked.status == 200
    assert chunked.headers["connection"] == "close"
    assert resolved == []

    async with connection(client) as (reader, writer):
        body = event("evt_expect")
        writer.write(
            b"POST /webhooks/corvel HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        expected = await read_answer(reader)
    assert expected is not None
    assert expected.status == 200
    assert resolved == ["/webhooks/corvel"]
    for target in (b"OPTIONS * HTTP/1.1", b"CONNECT proxy.test:443 HTTP/1.1"):
        async with connection(client) as (reader, writer):
            writer.write(target + b"\r\nHost: proxy.test\r\n\r\n")
            answer = await read_answer(reader)
        assert answer is not None
        assert answer.status == 404  # the router's, as through Application._handle
    assert [r.body for r in upstream.requests] == [
        event("evt_direct"),
        event("evt_chunked"),
        event("evt_expect"),
    ]
