"""The reconciler against a stand-in of GitHub's hook deliveries API (tests/provider_standins.py,
built from the operations vendored under tests/provider_api/), through a real proxy on the
session's PostgreSQL: events refused while the proxy could not reach its database are
redelivered and reach the app once; events with a claim are never asked for again; a page
boundary, a rate-limit answer, an expired token and a provider outage behave as documented.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from aiohttp import web

from proxy import app_keys, config, errors, providers_api, reconciler
from proxy.config import reconcile as reconciling
from proxy.providers_api import github
from tests.faults.relay import Relay
from tests.helpers import (
    GITHUB_SECRET,
    FakeUpstream,
    MakeProxy,
    github_route,
    metrics_text,
    reaches_database,
    reconcile_once,
    wait_until,
)
from tests.provider_standins import GitHubHook, json_schema

TOKEN = "github_pat_stand_in_token_0123456789"
# The TCP fault relay (the database link cut) is written for asyncio's transports (conftest).
RELAY_IN_LOOP = True
VENDORED = Path(__file__).parent / "provider_api" / "github-hook-deliveries.yaml"


def _route(api_url: str, **reconcile: Any) -> dict[str, Any]:
    settings = {"every": "1h", "since": "1h", "repository": "octo/app", "hook_id": 1,
                "token": TOKEN, "api_url": api_url, **reconcile}  # fmt: skip
    return github_route(reconcile=settings)


@pytest.fixture
async def hook(aiohttp_server: Any) -> GitHubHook:
    stand_in = GitHubHook(secret=GITHUB_SECRET, token=TOKEN)
    server = await aiohttp_server(stand_in.app())
    stand_in.api_url = str(server.make_url(""))
    return stand_in


def _body(n: int) -> bytes:
    return json.dumps({"ref": "refs/heads/main", "n": n}).encode()


def _delivered(upstream: FakeUpstream) -> Counter[str]:
    return Counter(r.headers["x-github-delivery"][0] for r in upstream.requests)


@pytest.mark.usefixtures("no_background_runs")
async def test_events_refused_while_the_database_was_unreachable_reach_the_app_once_after_a_run(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    hook: GitHubHook,
    relayed_database: tuple[Relay, str],
) -> None:
    link, dsn = relayed_database
    proxy = await make_proxy(
        routes=[_route(hook.api_url, since="1h")],
        database={"dsn": dsn, "connect_timeout": "1s", "pool_timeout": "1s"},
    )
    hook.target = str(proxy.make_url("/webhooks/github"))
    # Before the outage: processed, claimed.
    assert [await hook.deliver(f"before-{n}", _body(n)) for n in range(5)] == [200] * 5
    await link.set_mode("refuse")
    # A sender that never retries: each event once, every one refused.
    refused = [await hook.deliver(f"during-{n}", _body(100 + n)) for n in range(50)]
    assert set(refused) == {503}
    await link.set_mode("pass")
    await wait_until(
        lambda: reaches_database(proxy), "the proxy reaches its database again", within=30
    )

    report = await reconcile_once(proxy)

    assert len(report.failed) == 50
    assert len(report.gaps) == 50
    assert len(report.recovered) == 50
    assert report.stopped is None
    delivered = _delivered(upstream)
    assert set(delivered.values()) == {1}
    assert set(delivered) == {f"before-{n}" for n in range(5)} | {f"during-{n}" for n in range(50)}
    # Run again: every failed event has its claim now; nothing is asked for again.
    asked = len(hook.redelivery_requests)
    again = await reconcile_once(proxy)
    assert (len(again.gaps), len(again.recovered), len(hook.redelivery_requests)) == (0, 0, asked)
    assert set(_delivered(upstream).values()) == {1}
    metrics = metrics_text(proxy)
    assert 'dedup_reconcile_recovered_total{route="github"} 50.0' in metrics
    assert 'dedup_reconcile_gaps_total{route="github"} 50.0' in metrics


@pytest.mark.usefixtures("no_background_runs")
async def test_a_failed_event_with_a_claim_is_never_asked_for_again(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook
) -> None:
    """The app was slow: GitHub logged a timeout, but the proxy claimed and processed it."""
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    hook.target = str(proxy.make_url("/webhooks/github"))
    assert await hook.deliver("slow", _body(1)) == 200
    hook.attempts[-1].status_code = 504  # as GitHub logs a delivery it gave up waiting on

    report = await reconcile_once(proxy)

    assert [d.event_id for d in report.failed] == ["1:slow"]
    assert [d.event_id for d in report.claimed] == ["1:slow"]
    assert (report.gaps, hook.redelivery_requests) == ([], [])
    assert len(upstream.requests) == 1


@pytest.mark.usefixtures("no_background_runs")
async def test_a_gap_claimed_while_the_gaps_before_it_were_recovered_is_not_asked_for(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook
) -> None:
    """The recoveries are paced, so a gap's turn can come long after the log was read: a copy
    that arrived meanwhile was claimed, and the reconciler looks again before it asks."""
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    hook.target = "http://127.0.0.1:9/unreachable"
    for n in range(2):
        await hook.deliver(f"gap-{n}", _body(n))
    hook.target = str(proxy.make_url("/webhooks/github"))
    copied: list[str] = []

    class CopyArrives:
        """GitHub's log; before the first recovery, a copy of the other gap arrives."""

        def __init__(self, settings: reconciling.Reconcile) -> None:
            self.log = github.HookDeliveries(settings, user_agent="dedup-proxy/test")

        def deliveries(self, since: float) -> AsyncIterator[providers_api.Delivery]:
            return self.log.deliveries(since)

        async def recover(self, delivery: providers_api.Delivery) -> None:
            if not copied:
                other = "gap-1" if delivery.event_id == "1:gap-0" else "gap-0"
                copied.append(f"1:{other}")
                assert await hook.deliver(other, _body(int(other[-1]))) == 200
            await self.log.recover(delivery)

        async def close(self) -> None:
            await self.log.close()

        @property
        def truncated(self) -> bool:
            return self.log.truncated

    app = proxy.app
    assert app is not None
    runs = reconciler.Reconciler(
        app[app_keys.STORE], app[app_keys.CONFIG].routes, app[app_keys.METRICS], pace=1000.0,
        open_log=CopyArrives,
    )  # fmt: skip
    report = await runs.reconcile(app[app_keys.CONFIG].routes[0])

    assert [d.event_id for d in report.claimed] == copied
    assert [d.event_id for d in report.gaps] == [d.event_id for d in report.recovered]
    assert len(report.recovered) == len(hook.redelivery_requests) == 1
    assert set(_delivered(upstream).values()) == {1}
    assert len(_delivered(upstream)) == 2


@pytest.mark.usefixtures("no_background_runs")
async def test_pages_are_walked_with_the_cursor_and_a_retry_after_is_waited_out(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("proxy.providers_api.github.PER_PAGE", 7)
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    hook.target = "http://127.0.0.1:9/unreachable"  # every first delivery fails to connect
    for n in range(20):
        await hook.deliver(f"page-{n}", _body(n))
    hook.target = str(proxy.make_url("/webhooks/github"))
    hook.faults.append((429, {"Retry-After": "1"}))

    report = await reconcile_once(proxy)

    assert hook.list_requests == 1 + 3  # the 429, then 20 attempts in pages of 7
    assert len(report.recovered) == 20
    assert report.stopped is None
    assert set(_delivered(upstream).values()) == {1}
    assert len(_delivered(upstream)) == 20
    metrics = metrics_text(proxy)
    assert 'dedup_reconcile_errors_total{kind="rate_limited",route="github"} 1.0' in metrics


@pytest.mark.usefixtures("no_background_runs")
async def test_a_log_read_in_longer_than_the_period_still_leaves_time_to_recover(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy hook's log takes longer than ``every`` to read: the run still recovers (before,
    its period had ended by then, and every run recovered nothing, while reporting success)."""
    monkeypatch.setattr("proxy.providers_api.github.PER_PAGE", 7)
    page = github.HookDeliveries._page

    async def slow(deliveries: github.HookDeliveries, url: str) -> Any:
        await asyncio.sleep(0.5)  # three pages: longer than the period below
        return await page(deliveries, url)

    monkeypatch.setattr(github.HookDeliveries, "_page", slow)
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    hook.target = "http://127.0.0.1:9/unreachable"
    for n in range(20):
        await hook.deliver(f"slow-{n}", _body(n))
    hook.target = str(proxy.make_url("/webhooks/github"))
    app = proxy.app
    assert app is not None
    route = app[app_keys.CONFIG].routes[0]
    assert route.reconcile is not None
    # A period shorter than the configuration allows, as a log 100 times longer would take.
    short = dataclasses.replace(route, reconcile=dataclasses.replace(route.reconcile, every=1.0))
    runs = reconciler.Reconciler(app[app_keys.STORE], (short,), app[app_keys.METRICS], pace=1000.0)

    report = await runs.reconcile(short)

    assert hook.list_requests == 3
    assert len(report.gaps) == 20
    assert report.recovered
    assert set(_delivered(upstream).values()) == {1}


@pytest.mark.usefixtures("no_background_runs")
@pytest.mark.parametrize(
    ("fault", "kind"),
    [((401, {}), "unauthorized"), ((503, {}), "unavailable"),
     ((403, {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "4102444800"}), "rate_limited")],
)  # fmt: skip
async def test_an_expired_token_or_an_outage_ends_the_run_and_the_next_one_recovers_once(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    hook: GitHubHook,
    fault: tuple[int, dict[str, str]],
    kind: str,
) -> None:
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    hook.target = "http://127.0.0.1:9/unreachable"
    for n in range(3):
        await hook.deliver(f"gap-{n}", _body(n))
    hook.target = str(proxy.make_url("/webhooks/github"))
    hook.faults.append(fault)

    stopped = await reconcile_once(proxy)

    assert stopped.stopped is not None
    assert stopped.stopped.kind == kind
    assert (stopped.recovered, hook.redelivery_requests, upstream.requests) == ([], [], [])
    metrics = metrics_text(proxy)
    assert f'dedup_reconcile_errors_total{{kind="{kind}",route="github"}} 1.0' in metrics
    assert "dedup_reconcile_last_success_timestamp_seconds{" not in metrics

    report = await reconcile_once(proxy)  # the next period: the token renewed, the API back

    assert len(report.recovered) == 3
    assert report.stopped is None
    assert set(_delivered(upstream).values()) == {1}
    assert len(_delivered(upstream)) == 3


async def test_the_proxy_runs_the_reconcile_itself_and_one_replica_takes_each_period(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciler, "FIRST_RUN_DELAY", 0.1)
    hook.target = "http://127.0.0.1:9/unreachable"
    for n in range(4):
        await hook.deliver(f"auto-{n}", _body(n))
    routes = [_route(hook.api_url, every="10s")]
    first = await make_proxy(routes=routes)
    # Before the second replica starts: the first one's run may begin while it does.
    hook.target = str(first.make_url("/webhooks/github"))
    second = await make_proxy(routes=routes)  # another replica on the same claim table

    await wait_until(
        lambda: _settled(upstream, 4), "the proxy's own run recovers every gap", within=30
    )

    assert set(_delivered(upstream).values()) == {1}
    assert len(hook.redelivery_requests) == 4  # one run in the period, on one replica
    assert first is not second


async def _settled(upstream: FakeUpstream, count: int) -> bool:
    return len(_delivered(upstream)) >= count


def test_the_stand_in_answers_as_the_vendored_description_says() -> None:
    described = yaml.safe_load(VENDORED.read_text())
    item = json_schema(described["components"]["schemas"]["hook-delivery-item"])
    listing = described["paths"]["/repos/{owner}/{repo}/hooks/{hook_id}/deliveries"]["get"]
    assert listing["operationId"] == "repos/list-webhook-deliveries"
    names = {p["$ref"].rsplit("/", 1)[1] for p in listing["parameters"]}
    assert {"per-page", "cursor"} <= names
    stand_in = GitHubHook(secret=GITHUB_SECRET, token=TOKEN)

    async def attempts() -> None:
        stand_in.target = "http://127.0.0.1:9/unreachable"
        await stand_in.deliver("guid-1", _body(1))

    asyncio.run(attempts())
    jsonschema.validate(stand_in.items(), {"type": "array", "items": item})
    bad = {**stand_in.items()[0], "status_code": "500"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([bad], {"type": "array", "items": item})


def test_the_token_is_never_in_the_configuration_repr() -> None:
    cfg = config.parse({
        "upstream": {"url": "http://127.0.0.1:9"}, "database": {"dsn": "embedded"},
        "routes": [_route("http://127.0.0.1:9")],
    })  # fmt: skip
    route = cfg.routes[0]
    assert route.reconcile is not None
    assert route.reconcile.token == TOKEN
    assert TOKEN not in repr(cfg)
    unread = config.parse({
        "upstream": {"url": "http://127.0.0.1:9"}, "database": {"dsn": "embedded"},
        "routes": [_route("http://127.0.0.1:9", token="${UNSET_TOKEN_VARIABLE}")],
    }, secrets=False)  # fmt: skip
    assert unread.routes[0].reconcile is not None


def test_reconcile_is_refused_where_the_provider_has_no_delivery_log_api() -> None:
    with pytest.raises(errors.ConfigError) as raised:
        config.parse({
            "upstream": {"url": "http://127.0.0.1:9"}, "database": {"dsn": "embedded"},
            "routes": [{"name": "s", "path": "/s", "preset": "shopify",
                        "reconcile": {"token": "x", "hook_id": 1}}],
        })  # fmt: skip
    assert (
        "routes[0].reconcile: only on a route with preset github, stripe, paddle or paypal"
        in str(raised.value)
    )


# --- An API that answers other than as GitHub does ----------------------------------------


@pytest.fixture
async def elsewhere(aiohttp_server: Any) -> tuple[str, list[str]]:
    """Another port of the same host (the proxy's admin port, say): its URL, and the
    Authorization header of every request it gets."""
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response([])

    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", record)
    server = await aiohttp_server(application)
    return str(server.make_url("")), seen


async def _gaps(hook: GitHubHook, count: int, prefix: str = "gap") -> None:
    hook.target = "http://127.0.0.1:9/unreachable"  # every first delivery fails to connect
    for n in range(count):
        await hook.deliver(f"{prefix}-{n}", _body(n))


@pytest.mark.usefixtures("no_background_runs")
async def test_a_next_page_on_another_host_is_not_followed_and_the_token_stays_home(
    make_proxy: MakeProxy,
    hook: GitHubHook,
    elsewhere: tuple[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("proxy.providers_api.github.PER_PAGE", 2)
    url, seen = elsewhere
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    await _gaps(hook, 3)
    hook.next_origin = url

    report = await reconcile_once(proxy)

    assert seen == []  # before: ["Bearer github_pat_stand_in_token_0123456789"]
    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert "another host than api_url's" in report.stopped.message
    assert (report.recovered, hook.redelivery_requests) == ([], [])


@pytest.mark.usefixtures("no_background_runs")
async def test_a_delivery_id_that_is_not_a_number_is_never_put_in_a_url(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook
) -> None:
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    await _gaps(hook, 1)
    hook.target = str(proxy.make_url("/webhooks/github"))
    hook.tamper = lambda page: [{**item, "id": "../../../../user/keys"} for item in page]

    report = await reconcile_once(proxy)

    assert report.stopped is not None
    assert "a delivery's id is not a number" in report.stopped.message  # before: a 404's
    assert (report.recovered, hook.redelivery_requests, upstream.requests) == ([], [], [])


@pytest.mark.usefixtures("no_background_runs")
async def test_an_answer_over_the_bound_is_refused_unread(
    make_proxy: MakeProxy, hook: GitHubHook
) -> None:
    proxy = await make_proxy(routes=[_route(hook.api_url)])
    await _gaps(hook, 1)
    padding = "x" * (8 * 1024 * 1024 + 1)  # providers_api.MAX_ANSWER, and a byte
    hook.tamper = lambda page: [{**item, "padding": padding} for item in page]

    report = await reconcile_once(proxy)

    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert "an answer over 8 MiB, refused unread" in report.stopped.message
    assert (report.deliveries, hook.redelivery_requests) == ([], [])


@pytest.mark.usefixtures("no_background_runs")
@pytest.mark.parametrize(
    "tamper",
    [
        lambda page: [{"guid": item["guid"]} for item in page],  # no delivered_at
        lambda page: [1, 2],
        lambda page: [{**item, "delivered_at": 17} for item in page],
        lambda page: {"deliveries": page},
    ],
    ids=["no-time", "not-objects", "time-a-number", "not-a-list"],
)
async def test_an_answer_not_as_described_stops_the_run_and_the_command_exits_1_without_a_traceback(
    make_proxy: MakeProxy, proxy_config: Any, hook: GitHubHook, tamper: Any
) -> None:
    routes = [_route(hook.api_url)]
    proxy = await make_proxy(routes=routes)
    await _gaps(hook, 2)
    hook.tamper = tamper

    report = await reconcile_once(proxy)
    out = io.StringIO()
    status = await reconciler.command(
        proxy_config(routes=routes), "github", since=None, dry_run=False, out=out
    )

    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert status == 1
    assert "stopped: listing the hook's deliveries: an answer not as described" in out.getvalue()
    assert 'dedup_reconcile_errors_total{kind="refused",route="github"} 1.0' in metrics_text(proxy)


@pytest.mark.usefixtures("no_background_runs")
async def test_a_run_that_reaches_its_page_bound_says_so_counts_it_and_exits_3(
    make_proxy: MakeProxy,
    proxy_config: Any,
    hook: GitHubHook,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr("proxy.providers_api.github.PER_PAGE", 2)
    monkeypatch.setattr("proxy.providers_api.github.MAX_PAGES", 2)
    routes = [_route(hook.api_url)]
    proxy = await make_proxy(routes=routes)
    await _gaps(hook, 5)

    report = await reconcile_once(proxy, dry_run=True)
    out = io.StringIO()
    status = await reconciler.command(
        proxy_config(routes=routes), "github", since=None, dry_run=True, out=out
    )

    assert len(report.deliveries) == 4  # the newest two pages
    assert report.truncated
    assert 'dedup_reconcile_errors_total{kind="page_bound",route="github"} 1.0' in metrics_text(
        proxy
    )
    assert "is longer than a run reads" in caplog.text
    assert status == 3  # before: 0, and nothing said
    assert "warning: the provider's log over the window is longer than a run reads" in (
        out.getvalue()
    )


@pytest.mark.usefixtures("no_background_runs")
async def test_what_the_api_says_reaches_the_terminal_escaped(
    make_proxy: MakeProxy, proxy_config: Any, hook: GitHubHook
) -> None:
    routes = [_route(hook.api_url)]
    await make_proxy(routes=routes)
    await _gaps(hook, 1)
    hostile = "push\x1b]52;c;Y3VybCBldmlsfHNo\x07\x1b[2J\u202egnp.exe\x9b31m\x7f"
    hook.tamper = lambda page: [
        {**item, "event": hostile, "status": hostile, "guid": f"g-{hostile}"} for item in page
    ]
    out = io.StringIO()

    await reconciler.command(
        proxy_config(routes=routes), "github", since=None, dry_run=True, out=out
    )

    shown = out.getvalue()
    assert "would be recovered" in shown
    for control in ("\x1b", "\x07", "\u202e", "\x9b", "\x7f"):
        assert control not in shown
    assert "push\\u001b]52;c;" in shown


async def test_a_run_that_fails_unexpectedly_is_logged_and_counted_and_the_other_routes_go_on(
    make_proxy: MakeProxy,
    proxy_config: Any,
    upstream: FakeUpstream,
    hook: GitHubHook,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The proxy's own runs (``Reconciler.run``): before, a run that raised anything but an API
    error ended every route's runs on that worker, with no log line and no metric."""
    monkeypatch.setattr(reconciler, "FIRST_RUN_DELAY", 0.0)
    # A route whose turn another route's held (one lock decides every turn) looks again soon.
    monkeypatch.setattr(reconciler, "_RECHECK", 0.1)
    broken = {**_route(hook.api_url), "name": "broken", "path": "/webhooks/broken"}
    unreconciled = {key: value for key, value in broken.items() if key != "reconcile"}
    proxy = await make_proxy(routes=[github_route(), unreconciled])
    await _gaps(hook, 2)
    hook.target = str(proxy.make_url("/webhooks/github"))

    def open_log(settings: reconciling.Reconcile) -> providers_api.DeliveryLog:
        if settings.token == "broken":
            raise RuntimeError("a bug in the reconciler")
        return reconciler.delivery_log(settings)

    app = proxy.app
    assert app is not None
    configured = proxy_config(
        routes=[{**broken, "reconcile": {**broken["reconcile"], "token": "broken"}},
                _route(hook.api_url)]
    ).routes  # fmt: skip
    runs = reconciler.Reconciler(
        app[app_keys.STORE], configured, app[app_keys.METRICS], pace=1000.0, open_log=open_log
    )
    caplog.set_level(logging.INFO, "proxy.reconciler")
    task = asyncio.create_task(runs.run())

    async def crashed() -> bool:
        return "reconcile of route broken failed" in caplog.text

    try:
        await wait_until(crashed, "the broken route's run fails", within=30)
        await wait_until(
            lambda: _settled(upstream, 2), "the other route's run recovers its gaps", within=30
        )
        assert not task.done()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    assert set(_delivered(upstream).values()) == {1}
    failed = [r for r in caplog.records if "reconcile of route broken failed" in r.getMessage()]
    assert [r.getMessage() for r in failed] == [
        "reconcile of route broken failed: RuntimeError: a bug in the reconciler (the next "
        "run in 1h)"
    ]
    assert 'dedup_reconcile_errors_total{kind="crashed",route="broken"} 1.0' in metrics_text(proxy)


@pytest.mark.usefixtures("no_background_runs")
async def test_a_one_off_run_says_its_progress_on_stderr_and_promises_no_next_run(
    make_proxy: MakeProxy,
    proxy_config: Any,
    hook: GitHubHook,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(reconciler, "PROGRESS_READ", 2)
    monkeypatch.setattr(reconciler, "PROGRESS_RECOVERED", 2)
    routes = [_route(hook.api_url)]
    proxy = await make_proxy(routes=routes)
    await _gaps(hook, 5)
    hook.target = str(proxy.make_url("/webhooks/github"))
    progress = io.StringIO()

    status = await reconciler.command(
        proxy_config(routes=routes), "github", since=None, dry_run=False, out=io.StringIO(),
        progress=progress,
    )  # fmt: skip

    assert status == 0
    said = progress.getvalue().splitlines()  # before: nothing until the run's end
    assert "read 4 event(s) of the provider's log so far" in said
    assert any(line.startswith("5 gap(s); recovering 5, at most ") for line in said)
    assert "4 of 5 gap(s) done, 4 recovered" in said

    await _gaps(hook, 1, prefix="late")
    hook.faults.append((401, {}))
    caplog.clear()
    status = await reconciler.command(
        proxy_config(routes=routes), "github", since=None, dry_run=False, out=io.StringIO(),
        progress=io.StringIO(),
    )  # fmt: skip

    assert status == 1
    stopped = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert stopped
    assert not any("the next run in" in message for message in stopped)  # a one-off run
