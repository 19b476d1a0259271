"""The operator console on the admin listener (``proxy.console``, ``proxy.console_gate``), through
aiohttp's test client over a real PostgreSQL: the pages with kept deliveries the proxy made from
real webhooks, the headers on every answer, escaping, the credential, the checks on an action
(origin, token) and the read-only default; the routes' holds, the limit at the app and this
replica's requests by outcome on the overview, a shared limit's places held by every replica,
and pausing and resuming a route from it; the list's default (what needs attention), its total
and its time filters (a time ago, as the CLI takes it); a bulk redeliver's confirmation (its
events) and its answer (a redirect to a page whose reload redelivers nothing), to follow it.
The browser's view of it is in tests/test_console_browser.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import app_keys, config, console, console_gate, database
from proxy.database import inbox_sql
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    admin_client,
    event,
    execute,
    fetch,
    stripe_headers,
    stripe_route,
    wait_until,
)

PASSWORD = "correct-horse-battery-staple"
OPERATOR = f"alice:{PASSWORD}"
KEPT = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "event_type": "body:/type",
    "redeliver": {"schedule": ["1h"], "for": "1d"},
}
ACTIONS = {"console": {"actions": True, "credentials": [OPERATOR]}}
HOSTILE = "<script>window.pwned=1</script><img src=x onerror=alert(1)>"


def basic(credential: str = OPERATOR) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(credential.encode()).decode()}


def failing(upstream: FakeUpstream, status: int = 503) -> None:
    upstream.respond = lambda n: web.Response(status=status)


async def start(
    make_proxy: MakeProxy, aiohttp_client: Any, **admin: Any
) -> tuple[TestClient[Any, Any], TestClient[Any, Any]]:
    proxy = await make_proxy(routes=[KEPT], admin=admin or {})
    return proxy, await admin_client(aiohttp_client, proxy)


async def send(
    proxy: TestClient[Any, Any], event_id: str, event_type: str = "charge.failed", **body: Any
) -> None:
    payload = json.dumps({"id": event_id, "type": event_type, **body})
    headers = {"Content-Type": "application/json", "Stripe-Signature": "t=1,v1=" + "ab" * 32}
    async with proxy.post("/hooks", data=payload, headers=headers) as answer:
        assert answer.status in (200, 202), await answer.text()


async def page(admin: TestClient[Any, Any], path: str, **kwargs: Any) -> str:
    async with admin.get(path, **kwargs) as response:
        assert response.status == 200, await response.text()
        return await response.text()


async def state(pg_dsn: str, table: str, event_id: str) -> str | None:
    rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1', event_id)
    return rows[0]["inbox_state"] if rows else None


def form_fields(html: str, action: str) -> dict[str, str]:
    """The hidden fields of the page's form posting to ``action``."""
    form = re.search(rf'<form method="post" action="{action}">(.*?)</form>', html, re.S)
    assert form is not None, html
    return dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form[1]))


async def test_the_pages_show_what_the_proxy_kept(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client)
    await send(proxy, "evt_ok")  # delivered at the first try
    failing(upstream)
    await send(proxy, "evt_pending", data={"object": {"customer": "cus_123"}})
    failing(upstream, 422)
    await send(proxy, "evt_dead", "invoice.failed")

    overview = await page(admin, "/console/")
    row = re.search(r"<tr>\s*<th scope=\"row\"><a href=\"events\?route=hooks\">hooks</a>.*?</tr>",
                    overview, re.S)  # fmt: skip
    assert row is not None
    numbers = re.findall(r'<td class="n">(?:<a [^>]*>)?([\w.]+)', row[0])
    # pending, dead, oldest pending, received, per minute, first try, redelivered, kept,
    # discarded
    assert numbers[:2] == ["1", "1"]
    assert numbers[3:] == ["3", "0.1", "1", "0", "2", "0"]

    listed = await page(admin, "/console/events")
    assert "evt_pending" in listed
    assert "evt_dead" in listed
    assert "evt_ok" not in listed
    dead = await page(admin, "/console/events?state=dead")
    assert "evt_dead" in dead
    assert "evt_pending" not in dead
    by_body = await page(admin, "/console/events?body=data.object.customer%3Dcus_123")
    assert "evt_pending" in by_body
    assert "evt_dead" not in by_body
    by_type = await page(admin, "/console/events?event_type=invoice.failed")
    assert "evt_dead" in by_type
    assert "evt_pending" not in by_type

    shown = await page(admin, "/console/event?scope=hooks&id=evt_pending")
    assert "POST /hooks" in shown
    assert "&#34;customer&#34;: &#34;cus_123&#34;" in shown
    # Masked as ``events show`` masks it (``presenting``): its size only, not a character.
    assert "<td>Stripe-Signature</td><td><code>&lt;redacted 71 bytes&gt;</code></td>" in shown
    assert "t=1,v1=" not in shown
    assert "503" in shown  # the attempt

    found = await page(admin, "/console/lookup?id=evt_ok")
    assert "delivered at the first try" in found
    missing = await page(admin, "/console/lookup?id=evt_never")
    assert "No claim found on any route. Looked for: <code>evt_never</code>" in missing


async def test_the_overview_shows_this_replicas_requests_by_outcome_since_it_started(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    proxy = await make_proxy(routes=[KEPT, stripe_route()])
    admin = await admin_client(aiohttp_client, proxy)
    sent: list[tuple[bytes, str | None]] = [(event(f"evt_{n}"), None) for n in range(6)]
    sent += [(event("evt_0"), None), (event("evt_forged"), "whsec_not_the_endpoints_secret")]
    statuses = []
    for body, secret in sent:
        headers = stripe_headers(body, secret) if secret else stripe_headers(body)
        async with proxy.post("/webhooks/stripe", data=body, headers=headers) as answer:
            statuses.append(answer.status)
    assert statuses == [200] * 7 + [401]

    overview = await page(admin, "/console/")
    assert "This replica's requests since it started" in overview
    assert "every replica's, from the database" in overview
    assert "deploy/grafana/dedup-proxy.json" in overview
    counted = {
        name: re.findall(r"<td[^>]*>([^<]*)</td>", row)
        for name, row in re.findall(r'<tr>\s*<th scope="row">(\w+)</th>(.*?)</tr>', overview, re.S)
    }
    # requests, by outcome: the duplicate and the forged one left no claim of their own
    assert counted == {
        "hooks": ["0", "none yet"],
        "stripe": ["8", "processed 6, duplicate 1, rejected 1"],
    }
    claims = re.search(r'<th scope="row"><a href="events\?route=stripe">.*?</tr>', overview, re.S)
    assert claims is not None
    numbers = re.findall(r'<td class="n">(?:<a [^>]*>)?([^<]+)', claims[0])
    assert numbers[3:5] == ["6", "0.1"]  # last hour: received, per minute


async def test_pages_page_by_keyset_newest_first(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client)
    failing(upstream)
    sent = [f"evt_{n:03}" for n in range(console.PAGE + 5)]
    for event_id in sent:
        await send(proxy, event_id)
    first = await page(admin, "/console/events?route=hooks")
    on_first = re.findall(r">(evt_\d+)</a>", first)
    older = re.search(r'href="events\?([^"]+)" rel="next"', first)
    assert older is not None
    await send(proxy, "evt_newer")  # arrives meanwhile: it moves no row to another page
    second = await page(admin, "/console/events?" + older[1].replace("&amp;", "&"))
    on_second = re.findall(r">(evt_\d+)</a>", second)
    assert on_first + on_second == sorted(sent, reverse=True)


async def test_every_answer_carries_the_policy_headers(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    _proxy, admin = await start(make_proxy, aiohttp_client, **ACTIONS)
    answers = [
        admin.get("/console/", headers=basic()),
        admin.get("/console/console.css", headers=basic()),
        admin.get("/console/event?scope=hooks&id=nothing", headers=basic()),
        admin.get("/console/events?since=yesterday", headers=basic()),
        admin.get("/console/"),  # no credential
        admin.post("/console/redeliver", headers=basic()),  # no origin, no token
        admin.put("/console/", headers=basic()),
    ]
    statuses = []
    for request in answers:
        async with request as response:
            statuses.append(response.status)
            for name, value in console_gate.HEADERS.items():
                assert response.headers.get(name) == value, (response.url, name)
    assert statuses == [200, 200, 404, 400, 401, 403, 405]
    assert "script-src 'none'" in console_gate.CSP
    assert "frame-ancestors 'none'" in console_gate.CSP


async def test_what_a_sender_sent_is_shown_as_text(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client)
    failing(upstream)
    await send(proxy, f"evt_{HOSTILE}", HOSTILE, note=HOSTILE)
    pages = [
        await page(admin, "/console/events"),
        await page(admin, "/console/lookup", params={"id": f"evt_{HOSTILE}"}),
        await page(admin, "/console/event", params={"scope": "hooks", "id": f"evt_{HOSTILE}"}),
        await page(admin, "/console/events", params={"event_type": HOSTILE}),
    ]
    for html in pages:
        assert "<script" not in html
        assert "<img" not in html
        assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in html


async def test_read_only_by_default_no_request_changes_anything(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client)
    failing(upstream)
    await send(proxy, "evt_1")
    html = await page(admin, "/console/event?scope=hooks&id=evt_1")
    assert 'method="post"' not in html
    assert "Read-only" in html
    for path in ("/console/redeliver", "/console/discard", "/console/bulk"):
        async with admin.post(path, data={"scope": "hooks", "id": "evt_1"}) as response:
            assert response.status in (403, 405)
    async with admin.get("/console/bulk") as response:  # not even its count
        assert response.status == 405
    assert await state(pg_dsn, table, "evt_1") == "pending"


async def test_the_credential_is_asked_for_on_every_page(
    make_proxy: MakeProxy, aiohttp_client: Any
) -> None:
    _, admin = await start(make_proxy, aiohttp_client, **ACTIONS)
    for headers in ({}, basic(f"alice:{PASSWORD}x"), basic(f"bob:{PASSWORD}"),
                    {"Authorization": "Bearer " + PASSWORD}):  # fmt: skip
        async with admin.get("/console/events", headers=headers) as response:
            assert response.status == 401
            assert response.headers["WWW-Authenticate"].startswith("Basic ")
    assert "Signed in as alice" in await page(admin, "/console/events", headers=basic())
    async with admin.get("/metrics") as response:  # the rest of the admin listener is as it was
        assert response.status == 200


async def test_an_action_needs_the_origin_and_the_token(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client, **ACTIONS)
    failing(upstream, 422)
    await send(proxy, "evt_1")
    html = await page(admin, "/console/event?scope=hooks&id=evt_1", headers=basic())
    fields = form_fields(html, "redeliver")
    origin = f"http://{admin.host}:{admin.port}"
    refused = [
        ({}, fields),  # no Origin
        ({"Origin": "http://evil.example"}, fields),
        ({"Origin": "null"}, fields),  # null only where Sec-Fetch-Site says same-origin
        ({"Origin": "null", "Sec-Fetch-Site": "same-site"}, fields),
        ({"Origin": origin, "Sec-Fetch-Site": "cross-site"}, fields),
        ({"Origin": origin}, {**fields, "csrf": "0" * 64}),
        ({"Origin": origin}, {k: v for k, v in fields.items() if k != "csrf"}),
    ]
    for headers, data in refused:
        async with admin.post("/console/redeliver", data=data,
                              headers={**basic(), **headers}) as response:  # fmt: skip
            assert response.status == 403
    assert await state(pg_dsn, table, "evt_1") == "dead"

    headers = {**basic(), "Origin": origin, "Sec-Fetch-Site": "same-origin"}
    upstream.respond = lambda n: web.Response(status=200)
    async with admin.post("/console/redeliver", data=fields, headers=headers,
                          allow_redirects=False) as response:  # fmt: skip
        assert response.status == 303
        assert response.headers["Location"].startswith("event?")

    async def delivered() -> bool:  # made due at once: the proxy's redeliverer sends it
        return await state(pg_dsn, table, "evt_1") == "delivered"

    await wait_until(delivered, "the redelivery")
    assert len(upstream.requests) == 2


async def test_discard_and_the_action_log(
    make_proxy: MakeProxy,
    aiohttp_client: Any,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client, **ACTIONS)
    failing(upstream)
    await send(proxy, "evt_1")
    html = await page(admin, "/console/event?scope=hooks&id=evt_1", headers=basic())
    headers = {**basic(), "Origin": f"http://{admin.host}:{admin.port}"}
    caplog.set_level("INFO", logger="proxy.console")
    async with admin.post("/console/discard", data=form_fields(html, "discard"),
                          headers=headers) as response:  # fmt: skip
        assert response.status == 200
        assert "Discarded" in await response.text()
    assert await state(pg_dsn, table, "evt_1") == "discarded"
    assert any("alice discarded 1 event(s) in scope hooks: evt_1" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert PASSWORD not in caplog.text


async def test_bulk_redeliver_counts_first_then_acts_on_what_the_filter_shows(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client, **ACTIONS)
    failing(upstream, 422)
    for n in range(3):
        await send(proxy, f"evt_a{n}", "a.failed")
    await send(proxy, "evt_b", "b.failed")
    confirm = await page(admin, "/console/bulk?event_type=a.failed&state=dead", headers=basic())
    assert "<strong>3</strong>" in confirm
    # The confirmation names the events, newest first, each linked to its page.
    assert re.findall(r'<a href="event\?scope=hooks&amp;id=(evt_\w+)">', confirm) == [
        "evt_a2", "evt_a1", "evt_a0"
    ]  # fmt: skip
    fields = form_fields(confirm, "bulk")
    assert fields["expected"] == "3"
    assert await state(pg_dsn, table, "evt_a0") == "dead"  # the GET changed nothing
    headers = {**basic(), "Origin": f"http://{admin.host}:{admin.port}"}
    await send(proxy, "evt_a3", "a.failed")  # one more since the count: asked again
    async with admin.post("/console/bulk", data=fields, headers=headers) as response:
        assert response.status == 409
        fields = form_fields(await response.text(), "bulk")
    upstream.respond = lambda n: web.Response(status=200)
    # Post/Redirect/Get: the answer is a page of its own, whose reload sends nothing again.
    async with admin.post(
        "/console/bulk", data=fields, headers=headers, allow_redirects=False
    ) as response:
        assert response.status == 303
        done = response.headers["Location"]
    assert done.startswith("redelivering?")
    answer = await page(admin, "/console/" + done, headers=basic())
    assert "4 delivery(ies) made due now, of 4" in answer
    # Progress is followed on the list of what the filter still shows pending (the redeliverer
    # may have sent some already), and on the overview.
    still = re.search(
        r'<a href="(events\?state=pending&amp;event_type=a.failed)"><strong>(\d+)</strong> still '
        r"pending</a>",
        answer,
    )
    assert still is not None, answer
    assert 0 <= int(still[2]) <= 4
    assert '<a href="./">The overview</a>' in answer
    assert "<script" not in answer

    async def states() -> list[tuple[str, str]]:
        rows = await fetch(pg_dsn, f'SELECT event_id, inbox_state FROM "{table}" ORDER BY 1')
        return [(r["event_id"], r["inbox_state"]) for r in rows]

    async def redelivered() -> bool:  # made due at once: the proxy's redeliverer sends them
        return [state for _, state in await states()][:4] == ["delivered"] * 4

    await wait_until(redelivered, "the redeliveries")
    assert (await states())[4] == ("evt_b", "dead")
    assert len(upstream.requests) == 5 + 4
    reloaded = await page(admin, "/console/" + done, headers=basic())
    assert re.search(r"<strong>0</strong> still pending", reloaded)
    assert await states() == [(f"evt_a{n}", "delivered") for n in range(4)] + [("evt_b", "dead")]
    assert len(upstream.requests) == 5 + 4  # the reload sent nothing again
    left = await page(admin, "/console/" + still[1].replace("&amp;", "&"), headers=basic())
    assert "evt_a" not in left


async def test_the_overview_shows_each_routes_hold_and_the_limits_use(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    proxy = await make_proxy(
        routes=[KEPT, {**KEPT, "name": "other", "path": "/other"}],
        upstream={"concurrency": 2},
    )
    admin = await admin_client(aiohttp_client, proxy)
    overview = await page(admin, "/console/")
    assert re.search(r"<strong>0</strong> of 2 requests in flight", overview)
    assert "paused by" not in overview
    assert "Retry-After since" not in overview

    store: database.Store = proxy.app[app_keys.STORE]
    await store.holds.hold("hooks", 3600, by="bob", note=f"deploy {HOSTILE}")
    upstream.respond = lambda n: web.Response(status=503, headers={"Retry-After": "120"})
    async with proxy.post("/other", data=json.dumps({"id": "e1"})) as answer:
        assert answer.status == 202  # kept, and the route held as long as the app asked
    overview = await page(admin, "/console/")
    hooks, other = (
        re.search(rf'<th scope="row"><a href="events\?route={name}">.*?</tr>', overview, re.S)
        for name in ("hooks", "other")
    )
    assert hooks is not None
    assert other is not None
    assert re.search(r"paused by bob since [-\d: ]+, until [-\d: ]+ \((59m \d+s|1h)", hooks[0])
    assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in hooks[0]
    assert "<script" not in overview
    assert re.search(r"held for the app&#39;s Retry-After since .*?, until .*? left\)", other[0])
    assert 'action="pause"' not in overview  # read-only: no forms
    # A delivery kept while its route is held: its page says why it was not sent.
    async with proxy.post("/other", data=json.dumps({"id": "held_1"})) as answer:
        assert (await answer.json())["kept_for"] == "retry_after"
    shown = await page(admin, "/console/event?scope=other&id=held_1")
    assert "<dt>Why pending</dt><dd>not sent: the app asked to wait (Retry-After)</dd>" in shown


async def test_pause_and_resume_need_the_credential_and_the_token(
    make_proxy: MakeProxy, aiohttp_client: Any
) -> None:
    _, read_only = await start(make_proxy, aiohttp_client)
    async with read_only.post("/console/pause", data={"route": "hooks"}) as response:
        assert response.status == 403
    proxy, admin = await start(make_proxy, aiohttp_client, **ACTIONS)
    store: database.Store = proxy.app[app_keys.STORE]
    overview = await page(admin, "/console/", headers=basic())
    fields = {**form_fields(overview, "pause"), "route": "hooks", "for": "2h"}
    origin = {"Origin": f"http://{admin.host}:{admin.port}"}
    refused = [
        (origin, fields, 401),  # no credential
        ({**basic(), **origin}, {**fields, "csrf": "0" * 64}, 403),
        ({**basic(), **origin}, {k: v for k, v in fields.items() if k != "csrf"}, 403),
        ({**basic(), "Origin": "http://evil.example"}, fields, 403),
    ]
    for headers, data, status in refused:
        async with admin.post("/console/pause", data=data, headers=headers) as response:
            assert response.status == status
    assert await store.holds.active() == {}
    await store.holds.hold("hooks", None, by="bob")
    for headers, data, status in refused:
        async with admin.post("/console/resume", data={**data, "route": "hooks"},
                              headers=headers) as response:  # fmt: skip
            assert response.status == status
    assert (await store.holds.active())["hooks"].by == "bob"


async def test_pause_and_resume_from_the_overview_hold_every_replica_and_are_logged(
    make_proxy: MakeProxy,
    aiohttp_client: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client, **ACTIONS)
    store: database.Store = proxy.app[app_keys.STORE]
    headers = {**basic(), "Origin": f"http://{admin.host}:{admin.port}"}
    caplog.set_level("INFO", logger="proxy.console")
    overview = await page(admin, "/console/", headers=basic())
    assert 'action="resume"' not in overview  # nothing held
    fields = form_fields(overview, "pause")
    for bad in ({"route": "nope"}, {"route": "hooks", "for": "soon"}):
        async with admin.post("/console/pause", data={**fields, **bad},
                              headers=headers) as response:  # fmt: skip
            assert response.status == 400
    assert await store.holds.active() == {}

    pause = {**fields, "route": "hooks", "for": "2h", "note": "deploy  of\nthe app"}
    async with admin.post("/console/pause", data=pause, headers=headers,
                          allow_redirects=False) as response:  # fmt: skip
        assert response.status == 303
        assert response.headers["Location"] == "./?done=paused"
    hold = (await store.holds.active())["hooks"]
    assert (hold.reason, hold.by, hold.note) == ("paused", "alice", "deploy of the app")
    assert hold.until is not None
    assert abs(hold.until - hold.since - 7200) < 1  # the 2h asked for
    assert proxy.app[app_keys.HOLDS].held("hooks") is not None  # this worker's copy, at once
    overview = await page(admin, "/console/?done=paused", headers=basic())
    assert "Paused: every running proxy holds the route" in overview
    assert "paused by alice since" in overview
    paused = "console: alice paused route hooks: paused: scope hooks paused by alice since"
    assert any(r.getMessage().startswith(paused) for r in caplog.records)

    resume = form_fields(overview, "resume")
    assert resume["route"] == "hooks"
    async with admin.post("/console/resume", data=resume, headers=headers) as response:
        assert response.status == 200
        assert "Resumed: every running proxy" in await response.text()
    assert await store.holds.active() == {}
    assert proxy.app[app_keys.HOLDS].held("hooks") is None
    resumed = "console: alice resumed route hooks: resumed: route hooks (scope hooks), paused"
    assert any(r.getMessage().startswith(resumed) for r in caplog.records)
    async with admin.post("/console/resume", data=resume, headers=headers) as response:
        assert "Nothing to resume" in await response.text()
    assert PASSWORD not in caplog.text


def test_a_body_is_pretty_printed_up_to_its_cap() -> None:
    text, cut = console.pretty_body(b'{"a":{"b":1}}')
    assert text == '{\n  "a": {\n    "b": 1\n  }\n}'
    assert not cut
    text, cut = console.pretty_body(b"x" * (console.BODY_CAP + 1))
    assert len(text) == console.BODY_CAP
    assert cut
    assert console.pretty_body(b"\xff<b>")[0] == "\ufffd<b>"


BASE: dict[str, Any] = {
    "upstream": {"url": "http://127.0.0.1:9"},
    "database": {"dsn": "embedded"},
    "routes": [KEPT],
}


def test_actions_need_a_credential_and_passwords_stay_out_of_repr(tmp_path: Any) -> None:
    with pytest.raises(Exception, match=r"admin.console.actions: needs credentials"):
        config.parse({**BASE, "admin": {"console": {"actions": True}}})
    with pytest.raises(Exception, match=r"password must be at least 16") as refused:
        config.parse({**BASE, "admin": {"console": {"credentials": "bob:short-one"}}})
    assert "short-one" not in str(refused.value)
    users = tmp_path / "users"
    users.write_text(f"{OPERATOR}\nbob:{PASSWORD}-bob\n")
    cfg = config.parse(
        {**BASE, "admin": {"console": {"actions": True, "credentials_file": str(users)}}}
    )
    assert [c.name for c in cfg.admin.console.credentials] == ["alice", "bob"]
    assert PASSWORD not in repr(cfg)


async def test_credentials_without_actions_guard_a_read_only_console(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client, console={"credentials": OPERATOR})
    failing(upstream, 422)
    await send(proxy, "evt_1")
    async with admin.get("/console/events") as response:
        assert response.status == 401
    html = await page(admin, "/console/event?scope=hooks&id=evt_1", headers=basic())
    assert "Signed in as alice: read-only" in html
    assert 'method="post"' not in html
    headers = {**basic(), "Origin": f"http://{admin.host}:{admin.port}"}
    token = console_gate.csrf_token(config.console.Credential(name="alice", password=PASSWORD))
    data = {"scope": "hooks", "id": "evt_1", "csrf": token}
    async with admin.post("/console/redeliver", data=data, headers=headers) as response:
        assert response.status == 403
    assert await state(pg_dsn, table, "evt_1") == "dead"


async def test_the_console_can_be_turned_off(make_proxy: MakeProxy, aiohttp_client: Any) -> None:
    _, admin = await start(make_proxy, aiohttp_client, console={"enabled": False})
    async with admin.get("/console/") as response:
        assert response.status == 404
    async with admin.get("/healthz") as response:
        assert response.status == 200


async def test_an_events_page_says_why_first_then_what_the_app_answered_at_each_attempt(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    # The app fails twice with an error page (markup, a terminal's controls), then takes it.
    error_page = f"<h1>down</h1>{HOSTILE}\x1b[2J" + "z" * 3000
    upstream.respond = lambda n: (
        web.Response(status=500, text=error_page, content_type="text/html")
        if n < 2
        else web.Response(status=200, text="ok")
    )
    proxy = await make_proxy(routes=[KEPT], admin={}, redeliverer={"poll": "100ms"})
    admin = await admin_client(aiohttp_client, proxy)
    await send(proxy, "evt_twice")
    store: database.Store = proxy.app[app_keys.STORE]

    async def attempts(n: int) -> bool:
        found = await fetch(
            pg_dsn, f'SELECT jsonb_array_length(inbox_attempts) AS n FROM "{table}"'
        )
        return bool(found[0]["n"] == n)

    await store.inbox.redeliver("hooks", ["evt_twice"], None, 86400.0)
    await wait_until(lambda: attempts(2), "the second attempt")
    # As if it had first been kept over the limit at the app, then tried twice.
    await execute(
        pg_dsn, f"UPDATE \"{table}\" SET inbox_request = inbox_request || "
        "'{\"kept_for\": \"limit\"}'::jsonb",
    )  # fmt: skip

    shown = await page(admin, "/console/event?scope=hooks&id=evt_twice")

    facts = re.findall(r"<dt>([^<]*)</dt><dd>(.*?)</dd>", shown)
    names = [name for name, _ in facts]
    # The current reason right below the state; the first one below, as history.
    assert names.index("Why pending") == names.index("State") + 1
    why = dict(facts)["Why pending"]
    assert re.fullmatch(r"attempt 2 failed: the app answered 500 after [\d.]+ ms", why)
    assert names.index("First kept because") > names.index("Why pending")
    assert "limit at the app" in dict(facts)["First kept because"]
    assert "Tried until" in names  # pending: tried until then
    rows = re.findall(r'<tr><td class="n"><a href="#attempt-(\d)">.*?</tr>', shown)
    assert rows == ["1", "2"]
    assert len(re.findall(r'<td class="n">\d+\.?\d*</td><td>-</td></tr>', shown)) == 2  # the ms
    assert shown.count("Attempt 1: what the app answered") == 1
    assert f"{len(error_page)} bytes, the first {database.ATTEMPT_BODY} bytes shown" in shown
    # The app's body, as text: never markup in the page, nor a raw control character.
    assert "<script" not in shown
    assert "<img" not in shown
    assert "\x1b" not in shown
    assert "&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;\\u001b[2J" in shown
    assert "&lt;h1&gt;down&lt;/h1&gt;&lt;script&gt;window.pwned=1&lt;/script&gt;" in shown
    assert "z" * 3000 not in shown  # cut at the bound

    await execute(pg_dsn, f"UPDATE \"{table}\" SET inbox_request = inbox_request - 'kept_for'")
    await store.inbox.redeliver("hooks", ["evt_twice"], None, 86400.0)

    async def delivered() -> bool:
        return await state(pg_dsn, table, "evt_twice") == "delivered"

    await wait_until(delivered, "delivered")
    shown = await page(admin, "/console/event?scope=hooks&id=evt_twice")
    assert "<dt>Why" not in shown  # delivered: nothing to explain
    assert "Attempt 3: what the app answered" in shown
    assert "<p>2 bytes.</p>" in shown


async def test_a_dead_events_page_says_why_and_no_longer_tried_until(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client)
    failing(upstream, 422)
    await send(proxy, "evt_dead")

    shown = await page(admin, "/console/event?scope=hooks&id=evt_dead")

    facts = dict(re.findall(r"<dt>([^<]*)</dt><dd>(.*?)</dd>", shown))
    assert re.fullmatch(
        r"the app answered 422 after [\d.]+ ms: retrying cannot fix it", facts["Why dead"]
    )
    assert "Tried until" not in facts


async def test_the_list_shows_what_needs_attention_by_default_and_every_state_on_asking(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy, admin = await start(make_proxy, aiohttp_client)
    failing(upstream)
    await send(proxy, "evt_pending", data={"customer": "cus_1"})
    failing(upstream, 422)
    await send(proxy, "evt_dead", data={"customer": "cus_1"})
    await send(proxy, "evt_gone", data={"customer": "cus_1"})
    store: database.Store = proxy.app[app_keys.STORE]
    assert await store.inbox.discard("hooks", ["evt_gone"])

    default = await page(admin, "/console/events?route=hooks")
    assert re.findall(r">(evt_\w+)</a>", default) == ["evt_dead", "evt_pending"]
    assert "that need attention (pending or dead)" in default
    every = re.search(r'<a href="(events\?route=hooks&amp;state=all)">Show every state', default)
    assert every is not None, default
    shown = await page(admin, "/console/" + every[1].replace("&amp;", "&"))
    assert re.findall(r">(evt_\w+)</a>", shown) == ["evt_gone", "evt_dead", "evt_pending"]
    assert '<option value="all" selected>any</option>' in shown
    assert "Only those that need attention" in shown
    discarded = await page(admin, "/console/events?state=discarded")
    assert re.findall(r">(evt_\w+)</a>", discarded) == ["evt_gone"]
    # With a body filter too (the states then checked by Inbox.browse, not its statement).
    by_body = "/console/events?body=data.customer%3Dcus_1"
    assert re.findall(r">(evt_\w+)</a>", await page(admin, by_body)) == ["evt_dead", "evt_pending"]
    dead = await page(admin, by_body + "&state=dead")
    assert re.findall(r">(evt_\w+)</a>", dead) == ["evt_dead"]


async def test_the_list_says_how_many_rows_its_filters_select_up_to_a_bound(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    proxy, admin = await start(make_proxy, aiohttp_client)
    failing(upstream)
    for n in range(console.PAGE + 3):
        await send(proxy, f"evt_{n:03}", "a.failed" if n % 2 else "b.failed")
    failing(upstream, 422)
    await send(proxy, "evt_dead", "a.failed")

    def total(html: str) -> str:
        found = re.search(r"<strong>([\d,+]+)</strong> kept deliveries", html)
        assert found is not None, html
        return found[1]

    first = await page(admin, "/console/events")
    assert total(first) == str(console.PAGE + 4)  # every page's, not this page's 50
    older = re.search(r'href="events\?([^"]+)" rel="next"', first)
    assert older is not None
    assert total(await page(admin, "/console/events?" + older[1].replace("&amp;", "&"))) == "54"
    assert total(await page(admin, "/console/events?event_type=a.failed")) == "27"
    assert total(await page(admin, "/console/events?event_type=a.failed&state=dead")) == "1"
    assert total(await page(admin, "/console/events?since=1h")) == "54"
    assert total(await page(admin, "/console/events?event_id=evt_001")) == "1"
    # A body filter's rows are checked by the server as each page is read: no total.
    by_body = await page(admin, "/console/events?body=type%3Da.failed")
    assert "not counted" in by_body
    monkeypatch.setattr(console, "COUNT_MAX", 10)
    assert total(await page(admin, "/console/events")) == "10+"
    # A count that takes longer than COUNT_TIME is given up by the server: the page is shown.
    monkeypatch.setattr(console, "COUNT_TIME", 0.05)
    counting = inbox_sql.Statements.count

    def slow(self: inbox_sql.Statements, *args: Any) -> tuple[str, list[object]]:
        statement, values = counting(self, *args)
        return f"SELECT ({statement}) FROM pg_sleep(5)", values

    monkeypatch.setattr(inbox_sql.Statements, "count", slow)
    slowly = await page(admin, "/console/events")
    assert "not counted (counting took over 0.05 s" in slowly
    assert len(re.findall(r">(evt_\w+)</a>", slowly)) == console.PAGE
    monkeypatch.setattr(inbox_sql.Statements, "count", counting)
    assert total(await page(admin, "/console/events")) == "10+"  # its connection serves on


@pytest.mark.parametrize(
    ("since", "until", "listed"),
    [("1h", "", True), ("90m", "", True), ("2d", "", True), ("", "1h", False),
     ("2000-01-01T00:00", "", True), ("", "2000-01-01", False)],
)  # fmt: skip
async def test_time_filters_take_a_time_ago_as_the_cli_does(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, since: str,
    until: str, listed: bool,
) -> None:  # fmt: skip
    proxy, admin = await start(make_proxy, aiohttp_client)
    failing(upstream)
    await send(proxy, "evt_recent")
    shown = await page(admin, "/console/events", params={"since": since, "until": until})
    assert ("evt_recent" in shown) is listed


async def test_a_time_filter_neither_a_time_nor_a_time_ago_is_refused_saying_so(
    make_proxy: MakeProxy, aiohttp_client: Any
) -> None:
    _proxy, admin = await start(make_proxy, aiohttp_client)
    for given in ("yesterday", "-1h", "1y", "9" * 30 + "d"):
        async with admin.get("/console/events", params={"since": given}) as response:
            assert response.status == 400, given
            assert "a time ago like 1h, 30m or 2d" in await response.text()


async def test_the_overview_shows_the_shared_limits_places_held_and_the_waits(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream
) -> None:
    """Two proxies on one table (two replicas): what one holds, the other's overview shows."""
    plain = {"name": "plain", "path": "/plain", "event_id": "body:/id"}
    settings: dict[str, Any] = {
        "routes": [plain], "upstream": {"concurrency": {"limit": 1, "shared": True}},
        "database": {"pool_timeout": "300ms"},
    }  # fmt: skip
    one, proxy = await make_proxy(**settings), await make_proxy(**settings)
    admin = await admin_client(aiohttp_client, proxy)

    def places(html: str) -> tuple[str, str, str]:
        found = re.search(
            r"<strong>(\d+)</strong> of (\d+) places at the app held by every replica together"
            r".*?Waits for a place: <strong>(\d+)</strong>", html, re.S,
        )  # fmt: skip
        assert found is not None, html
        return found[1], found[2], found[3]

    assert places(await page(admin, "/console/")) == ("0", "1", "0")
    upstream.gate = asyncio.Event()
    first = asyncio.ensure_future(one.post("/plain", data=b'{"id": "a"}'))
    await wait_until(lambda: _arrived(upstream), "the first at the app")
    async with proxy.post("/plain", data=b'{"id": "b"}') as refused:
        assert refused.status == 503  # the other replica holds the place: none within 300ms
    assert places(await page(admin, "/console/")) == ("1", "1", "1")
    upstream.gate.set()
    assert (await first).status == 200
    assert places(await page(admin, "/console/")) == ("0", "1", "1")


async def test_a_limit_not_shared_says_nothing_of_places(
    make_proxy: MakeProxy, aiohttp_client: Any
) -> None:
    _proxy, admin = await start(make_proxy, aiohttp_client)
    assert "places at the app" not in await page(admin, "/console/")


async def _arrived(upstream: FakeUpstream) -> bool:
    return bool(upstream.requests)
