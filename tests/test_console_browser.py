"""The operator console in a real browser: Debian's Chromium (``/usr/bin/chromium``) driven by
Playwright, against a ``dedup-proxy serve`` process, a real PostgreSQL and a fake app that fails
some webhooks, so that the proxy keeps them.

It checks what only a browser shows: each page renders the kept deliveries; the filters and
the paging work as an operator uses them; an event whose body, headers, ID and type are
``<script>`` and ``onerror=`` payloads renders them as text and runs nothing; following every
link of every page changes nothing in the database; an action is refused without the
credential, and from a page of another origin, and redelivers with it (the app gets the event
once); a route paused from the overview holds its deliveries, and resumed sends each once; on
a phone's 390 px no page scrolls sideways (the lists are cards, wider tables scroll in their own
box) and a bulk redeliver's answer reloads without redelivering; axe-core finds no serious or
critical accessibility violation. Screenshots of each page
are saved in the test's tmp_path (``console-*.png``).
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from axe_playwright_python.async_playwright import Axe
from playwright.async_api import Browser, Page, ViewportSize, async_playwright
from playwright.async_api import Error as PlaywrightError

from tests.helpers import (
    FakeUpstream,
    Serve,
    Served,
    fetch,
    github_headers,
    github_route,
    wait_until,
)

CHROMIUM = Path("/usr/bin/chromium")
INSTALLED = CHROMIUM.exists()
pytestmark = pytest.mark.timeout(240)

PASSWORD = "correct-horse-battery-staple"
KEPT = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "event_type": "body:/type",
    "redeliver": {"schedule": ["1h"], "for": "1d"},
}
SETTINGS: dict[str, Any] = {"routes": [KEPT], "redeliverer": {"poll": "100ms"}}
ACTIONS = {"console": {"actions": True, "credentials": [f"alice:{PASSWORD}"]}}
HOSTILE = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
# The app's answer to an event's first delivery, by its ID's prefix (any other: 200); to a
# redelivery, 200.
# How long a paused route is watched for a delivery that must not come (many redeliverer polls).
WATCH = 1.0
FAILS = {"dead_": 422, "pend_": 503, "evil": 503}


def by_event(upstream: FakeUpstream) -> None:
    def respond(n: int) -> web.Response:
        ids = [json.loads(r.body)["id"] for r in upstream.requests[: n + 1]]
        event_id = ids[-1]
        if event_id in ids[:-1]:
            return web.Response(status=200)
        for prefix, status in FAILS.items():
            if event_id.startswith(prefix):
                return web.Response(status=status)
        return web.Response(status=200)

    upstream.respond = respond


async def send(
    served: Served, event_id: str, event_type: str = "charge.failed", *, headers: Any = None,
    **body: Any,
) -> None:  # fmt: skip
    payload = json.dumps({"id": event_id, "type": event_type, **body})
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{served.url}/hooks", data=payload, headers={
            "Content-Type": "application/json", "Stripe-Signature": "t=1,v1=" + "cd" * 32,
            **(headers or {})}) as answer,
    ):  # fmt: skip
        assert answer.status in (200, 202), await answer.text()


async def snapshot(dsn: str, table: str) -> list[tuple[Any, ...]]:
    rows = await fetch(dsn, f'SELECT * FROM "{table}" ORDER BY scope, event_id')
    return [tuple(row) for row in rows]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not INSTALLED:
        pytest.fail("the console's browser tests need Chromium: apt-get install chromium")
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield launched
        finally:
            await launched.close()


async def watched(page: Page) -> list[str]:
    """What the page would have run: dialogs opened, and every script error."""
    seen: list[str] = []
    page.on("dialog", lambda dialog: seen.append(f"dialog {dialog.message}"))
    page.on("pageerror", lambda error: seen.append(f"error {error}"))
    return seen


async def accessible(page: Page) -> list[str]:
    """axe-core's serious and critical violations on the page."""
    results = await Axe().run(page)
    return [
        f"{v['id']} ({v['impact']}): {v['help']}"
        for v in results.response["violations"]
        if v["impact"] in ("serious", "critical")
    ]


async def status(page: Page, url: str) -> int:
    # A link into the page it is on (an attempt's anchor) is no navigation: its page is fetched.
    response = await page.goto(url.partition("#")[0])
    assert response is not None, url
    return response.status


async def filter_and_page(page: Page, events: str) -> None:
    """The filters and the paging, as an operator uses them."""
    await page.goto(events)
    await page.select_option("#f-state", "dead")
    await page.click("button[type=submit]")
    assert await page.locator("tbody tr").count() == 1
    assert "dead_1" in await page.inner_text("tbody")
    await page.goto(events)
    await page.fill("#f-body", "data.object.customer=cus_3")
    await page.click("button[type=submit]")
    shown = await page.locator("tbody td:nth-child(3)").all_inner_texts()
    assert shown == [f"pend_{n:02}" for n in range(54, -1, -1) if n % 5 == 3]
    await page.goto(events + "?route=hooks&state=pending")
    first = await page.locator("tbody td:nth-child(3)").all_inner_texts()
    await page.click("a[rel=next]")
    second = await page.locator("tbody td:nth-child(3)").all_inner_texts()
    assert first + second == ["evil" + HOSTILE] + [f"pend_{n:02}" for n in range(54, -1, -1)]
    assert len(first) == 50


async def follow_every_link(page: Page, console: str, start: list[str]) -> int:
    """Visit every console page linked from ``start`` and the pages they link to, and so on
    (200 at most): how many."""
    visited: set[str] = set()
    queue = list(start)
    while queue and len(visited) < 200:
        url = queue.pop()
        if url in visited:
            continue
        visited.add(url)
        assert await status(page, url) < 500, url
        for href in await page.eval_on_selector_all("a[href]", "as => as.map(a => a.href)"):
            if href.startswith(console) and href not in visited:
                queue.append(href)
    return len(visited)


async def test_every_page_renders_inert_and_accessible_and_links_change_nothing(
    serve: Serve, upstream: FakeUpstream, browser: Browser, pg_dsn: str, table: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    by_event(upstream)
    served = await serve(**SETTINGS)
    await send(served, "ok_1")
    for n in range(55):
        await send(served, f"pend_{n:02}", "invoice.payment_failed",
                   data={"object": {"customer": f"cus_{n % 5}"}})  # fmt: skip
    await send(served, "dead_1", "customer.deleted")
    await send(served, f"evil{HOSTILE}", HOSTILE, headers={"X-Note": HOSTILE}, note=HOSTILE)
    before = await snapshot(pg_dsn, table)
    console = f"{served.admin_url}/console/"

    page = await browser.new_page()
    seen = await watched(page)
    pages = {
        "overview": console,
        "events": console + "events",
        "event": console + "event?" + urllib.parse.urlencode(
            {"scope": "hooks", "id": f"evil{HOSTILE}"}),
        "lookup": console + "lookup?" + urllib.parse.urlencode({"id": "ok_1"}),
    }  # fmt: skip
    for name, url in pages.items():
        assert await status(page, url) == 200, name
        assert await page.evaluate("window.pwned") is None, name
        assert await accessible(page) == [], name
        await page.screenshot(path=tmp_path / f"console-{name}.png", full_page=True)

    # What each page shows.
    await page.goto(pages["overview"])
    row = page.locator("tbody tr", has_text="hooks")
    assert (await row.locator("td.n").all_inner_texts())[:2] == ["56", "1"]
    await page.goto(pages["event"])
    text = await page.inner_text("main")
    # The payloads, as text: in the ID, the type and a header, and three times in the body
    # (its id, type and note, JSON-escaped).
    assert text.count(HOSTILE) == 3
    assert text.count("<script>window.pwned=1</script><img src=x onerror=") == 6
    assert "cd" * 32 not in text
    assert "<redacted " in text
    await page.goto(pages["lookup"])
    assert "delivered at the first try" in await page.inner_text("main")

    await filter_and_page(page, pages["events"])
    await page.screenshot(path=tmp_path / "console-events-page-2.png", full_page=True)

    # Every link on every page reached from the overview, followed: nothing changes.
    assert await follow_every_link(page, console, [console, *pages.values()]) > 20
    assert seen == []
    assert await snapshot(pg_dsn, table) == before


GUID = "20ed78ab-6a3e-11ef-8d3c-5d1e2b1c9f00"


async def test_a_github_guid_as_github_shows_it_is_found_by_the_lookup_and_the_filter(
    serve: Serve, upstream: FakeUpstream, browser: Browser, tmp_path: Path
) -> None:
    """An operator pastes the GUID of GitHub's delivery page (no hook ID) into "Was this event
    processed?" and the events' filter: the input shows all 36 characters, and the claim
    (``<hook ID>:<GUID>`` bound to the body) is found; an unknown GUID's page names the forms
    looked for and does not say the proxy never received it."""
    by_event(upstream)
    served = await serve(routes=[KEPT, github_route(redeliver=KEPT["redeliver"])],
                         redeliverer={"poll": "100ms"})  # fmt: skip
    body = json.dumps({"id": "pend_gh", "zen": "Design for failure."}).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{served.url}/webhooks/github", data=body,
                     headers=github_headers(body, GUID, "77")) as answer,
    ):  # fmt: skip
        assert answer.status == 202, await answer.text()
    console = f"{served.admin_url}/console/"
    page = await browser.new_page()

    await page.goto(console + "lookup")
    await page.fill("#l-id", GUID)
    assert await page.eval_on_selector("#l-id", "e => e.scrollWidth <= e.clientWidth")
    await page.click("button[type=submit]")
    table = await page.inner_text("table")
    assert f"77:{GUID}~" in table, table
    assert "pending" in table
    await page.screenshot(path=tmp_path / "console-lookup-guid.png", full_page=True)
    await page.click(f"a:has-text('77:{GUID}')")
    assert f"77:{GUID}" in await page.inner_text("main")

    await page.goto(console + "events")
    await page.fill("#f-id", GUID)
    assert await page.eval_on_selector("#f-id", "e => e.scrollWidth <= e.clientWidth")
    await page.click("button[type=submit]")
    assert (await page.locator("tbody td:nth-child(3)").all_inner_texts()) == [f"77:{GUID}"]

    unknown = "0f0f0f0f-0000-4000-8000-000000000000"
    await page.goto(console + "lookup")
    await page.fill("#l-id", unknown)
    await page.click("button[type=submit]")
    said = await page.inner_text("main")
    assert f"<X-GitHub-Hook-ID>:{unknown}[~<digest>]" in said, said
    assert f"{unknown}~<digest>" in said
    assert "has not received" not in said
    assert "does not show that the proxy never received it" in said
    assert await accessible(page) == []


async def test_actions_are_refused_without_the_credential_and_redeliver_with_it(
    serve: Serve, upstream: FakeUpstream, browser: Browser, pg_dsn: str, table: str,
    tmp_path: Path, aiohttp_server: Any,
) -> None:  # fmt: skip
    by_event(upstream)
    served = await serve(**SETTINGS, admin=ACTIONS)
    await send(served, "dead_1", "customer.deleted")
    event = f"{served.admin_url}/console/event?scope=hooks&id=dead_1"

    anonymous = await browser.new_context()
    with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
        await (await anonymous.new_page()).goto(event)  # Chromium gives up on the 401
    answer = await anonymous.request.get(event)
    assert answer.status == 401
    answer = await anonymous.request.post(
        f"{served.admin_url}/console/redeliver", form={"scope": "hooks", "id": "dead_1"},
        headers={"Origin": served.admin_url},
    )  # fmt: skip
    assert answer.status == 401

    # A page of another origin posting the console's form, with the operator's credential in
    # the browser: refused (its Origin, and it cannot know the token).
    forged = web.Application()
    form = (
        f'<form method="post" action="{served.admin_url}/console/redeliver">'
        '<input name="scope" value="hooks"><input name="id" value="dead_1">'
        '<input name="csrf" value="guess"></form>'
        "<script>document.forms[0].submit()</script>"
    )

    async def attack(request: web.Request) -> web.Response:
        return web.Response(text=form, content_type="text/html")

    forged.router.add_get("/", attack)
    attacker = await aiohttp_server(forged)
    context = await browser.new_context(
        http_credentials={"username": "alice", "password": PASSWORD}
    )
    page = await context.new_page()
    async with page.expect_navigation(url=f"{served.admin_url}/console/redeliver"):
        await page.goto(str(attacker.make_url("/")))
    assert "refused" in await page.inner_text("body")
    rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}"')
    assert rows[0]["inbox_state"] == "dead"

    await page.goto(event)
    assert await accessible(page) == []
    await page.screenshot(path=tmp_path / "console-event-actions.png", full_page=True)
    await page.click("text=Redeliver now")
    assert "Made due now" in await page.inner_text("body")

    async def delivered() -> bool:
        rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}"')
        return rows[0]["inbox_state"] == "delivered"

    await wait_until(delivered, "the redelivery to reach the app", within=15)
    bodies = [json.loads(r.body)["id"] for r in upstream.requests]
    assert bodies == ["dead_1", "dead_1"]  # the first delivery, and the redelivery once
    await page.goto(event)
    assert "delivered" in await page.inner_text("main")
    assert await page.locator("form[method=post]").count() == 0  # nothing left to act on


async def test_a_route_paused_from_the_overview_holds_and_resumed_sends_each_event_once(
    serve: Serve, upstream: FakeUpstream, browser: Browser, pg_dsn: str, table: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    served = await serve(**SETTINGS, admin=ACTIONS)
    overview = f"{served.admin_url}/console/"
    context = await browser.new_context(
        http_credentials={"username": "alice", "password": PASSWORD}
    )
    page = await context.new_page()
    seen = await watched(page)
    await page.goto(overview)
    await page.select_option("#p-route", "hooks")
    await page.fill("#p-note", "deploy <b>v2</b>")
    await page.click("button:text-is('Pause')")
    assert "Paused:" in await page.inner_text("main")
    row = await page.inner_text("tbody tr:has-text('hooks')")
    assert "paused by alice since" in row
    assert "until resumed: deploy <b>v2</b>" in row
    assert await accessible(page) == []
    await page.screenshot(path=tmp_path / "console-overview-paused.png", full_page=True)

    for event_id in ("ok_1", "ok_2"):  # kept for later, due now, not sent while paused
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{served.url}/hooks", data=json.dumps({"id": event_id})) as answer,
        ):
            assert answer.status == 202
            assert (await answer.json())["kept_for"] == "paused"
    await asyncio.sleep(WATCH)  # some redeliverer polls: the app gets nothing meanwhile
    assert upstream.requests == []

    await page.click("button:text-is('Resume hooks')")
    assert "Resumed:" in await page.inner_text("main")
    assert await page.locator("form[action=resume]").count() == 0

    async def delivered() -> bool:
        rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}" WHERE scope = $1', "hooks")
        return [row["inbox_state"] for row in rows] == ["delivered", "delivered"]

    await wait_until(delivered, "the kept deliveries to reach the app", within=15)
    assert sorted(json.loads(r.body)["id"] for r in upstream.requests) == ["ok_1", "ok_2"]
    assert seen == []


# A phone's viewport: the console is read there without scrolling sideways.
PHONE: ViewportSize = {"width": 390, "height": 844}
# An ID as long as a GitHub delivery's (its hook ID and GUID), without a space to break at.
LONG_ID = "pend_" + "0123456789abcdef" * 3


async def test_on_a_phone_the_pages_do_not_scroll_sideways_and_a_bulk_redeliver_reloads_safely(
    serve: Serve, upstream: FakeUpstream, browser: Browser, pg_dsn: str, table: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """At 390 px the lists are cards, each cell under its column's name, and the wider tables
    (the overview's routes, an event's headers and attempts) scroll in their own box: the page
    itself is never wider than the screen. A bulk redeliver's answer is a page of its own (Post/
    Redirect/Get): reloading it sends nothing again."""
    by_event(upstream)
    served = await serve(**SETTINGS, admin=ACTIONS)
    await send(served, LONG_ID, "invoice.payment_failed")
    await send(served, "dead_1", "customer.deleted")
    await send(served, "ok_1")
    console = f"{served.admin_url}/console/"
    context = await browser.new_context(
        viewport=PHONE, http_credentials={"username": "alice", "password": PASSWORD}
    )
    page = await context.new_page()
    seen = await watched(page)
    pages = {
        "overview": console,
        "events": console + "events",
        "events-all": console + "events?state=all&since=1h",
        "event": console + "event?" + urllib.parse.urlencode({"scope": "hooks", "id": LONG_ID}),
        "lookup": console + "lookup?" + urllib.parse.urlencode({"id": "ok_1"}),
        "bulk": console + "bulk?event_type=customer.deleted",
    }  # fmt: skip
    for name, url in pages.items():
        assert await status(page, url) == 200, name
        width = await page.evaluate("document.scrollingElement.scrollWidth")
        await page.screenshot(path=tmp_path / f"console-phone-{name}.png", full_page=True)
        assert width <= PHONE["width"], (name, width)
        assert await accessible(page) == [], name

    # The list's rows as cards: each cell under its column's name, the long ID whole.
    await page.goto(pages["events"])
    card = page.locator("tbody tr", has_text="pend_")
    labels = await card.evaluate(
        "tr => [...tr.cells].map(td => getComputedStyle(td, '::before').content)"
    )
    assert labels[:5] == ['"Received (UTC): "', '"Scope: "', '"Event: "', '"Type: "', '"State: "']
    box = await card.bounding_box()
    assert box is not None
    assert box["width"] <= PHONE["width"]
    assert LONG_ID in (await card.inner_text()).replace("\n", "")
    assert "ok_1" not in await page.inner_text("tbody")  # delivered: not what needs attention

    await page.goto(pages["bulk"])
    assert "dead_1" in await page.inner_text("main")
    await page.click("button:text-is('Redeliver these 1 now')")
    assert "/console/redelivering?" in page.url
    assert "1 delivery(ies) made due now" in await page.inner_text("main")

    async def delivered() -> bool:
        rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1',
                           "dead_1")  # fmt: skip
        return rows[0]["inbox_state"] == "delivered"

    await wait_until(delivered, "the redelivery to reach the app", within=15)
    await page.reload()
    assert "/console/redelivering?" in page.url
    await asyncio.sleep(WATCH)  # some redeliverer polls: a second redeliver would go out
    ids = [json.loads(r.body)["id"] for r in upstream.requests]
    assert ids.count("dead_1") == 2  # the first delivery, and the redelivery once
    assert seen == []
