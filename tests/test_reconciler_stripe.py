"""The reconciler against a stand-in of Stripe's events API (tests/provider_standins.py, built from
the operation vendored under tests/provider_api/stripe-events.yaml), through a real proxy on the
session's PostgreSQL: events refused while the proxy could not reach its database are delivered
by the reconciler itself, signed with the route's secret, and reach the app once; events with a
claim are never sent again; a page boundary, a rate-limit answer, a revoked key and a provider
outage behave as documented; a recovery signed with the wrong secret is refused by the route.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import cli, config, errors, providers_api, reconciler
from proxy.config import reconcile as reconciling
from proxy.providers_api import stripe
from tests.faults.relay import Relay
from tests.helpers import (
    STRIPE_SECRET,
    FakeUpstream,
    MakeProxy,
    metrics_text,
    reaches_database,
    reconcile_once,
    stripe_route,
    wait_until,
)
from tests.provider_standins import StripeAccount, json_schema

KEY = "rk_test_stand_in_restricted_key_0123456789"
# The TCP fault relay (the database link cut) is written for asyncio's transports (conftest).
RELAY_IN_LOOP = True
VENDORED = Path(__file__).parent / "provider_api" / "stripe-events.yaml"
BASE = {"upstream": {"url": "http://127.0.0.1:9"}, "database": {"dsn": "embedded"}}


def _route(api_url: str, **reconcile: Any) -> dict[str, Any]:
    settings = {"every": "1h", "since": "1h", "token": KEY, "api_url": api_url, **reconcile}
    return stripe_route(reconcile=settings)


@pytest.fixture
async def account(aiohttp_server: Any) -> StripeAccount:
    stand_in = StripeAccount(secret=STRIPE_SECRET, key=KEY)
    server = await aiohttp_server(stand_in.app())
    stand_in.api_url = str(server.make_url(""))
    return stand_in


def _delivered(upstream: FakeUpstream) -> Counter[str]:
    return Counter(json.loads(r.body)["id"] for r in upstream.requests)


def _to(proxy: TestClient[Any, Any], secret: bytes | None = None) -> reconciler.DeliveryLogFactory:
    """The route's log, its recoveries POSTed to the test's proxy (its port is the test
    server's, not the configured listener's); signed with ``secret`` instead, if given."""
    url = str(proxy.make_url("/webhooks/stripe"))

    def open_log(settings: reconciling.Reconcile) -> providers_api.DeliveryLog:
        changed = dataclasses.replace(settings, deliver_to=url)
        if secret is not None:
            changed = dataclasses.replace(changed, signing_secret=secret)
        return stripe.UndeliveredEvents(changed, user_agent="dedup-proxy/test")

    return open_log


async def _run(
    proxy: TestClient[Any, Any], *, secret: bytes | None = None, **kwargs: Any
) -> reconciler.Report:
    return await reconcile_once(proxy, open_log=_to(proxy, secret), **kwargs)


@pytest.mark.usefixtures("no_background_runs")
async def test_events_refused_while_the_database_was_unreachable_reach_the_app_once_after_a_run(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    account: StripeAccount,
    relayed_database: tuple[Relay, str],
) -> None:
    link, dsn = relayed_database
    proxy = await make_proxy(
        routes=[_route(account.api_url)],
        database={"dsn": dsn, "connect_timeout": "1s", "pool_timeout": "1s"},
    )
    account.target = str(proxy.make_url("/webhooks/stripe"))
    assert [await account.send(n=n) for n in range(5)] == [200] * 5
    await link.set_mode("refuse")
    # Each event sent once and never retried (the worst sender), every one refused.
    refused = [await account.send(n=100 + n) for n in range(50)]
    assert set(refused) == {503}
    await link.set_mode("pass")
    await wait_until(
        lambda: reaches_database(proxy), "the proxy reaches its database again", within=30
    )

    report = await _run(proxy)

    assert (len(report.failed), len(report.gaps), len(report.recovered)) == (50, 50, 50)
    assert report.stopped is None
    delivered = _delivered(upstream)
    assert set(delivered.values()) == {1}
    assert set(delivered) == {event.id for event in account.events}
    # The stand-in, as Stripe, still lists them as not delivered; each has its claim now.
    again = await _run(proxy)
    assert (len(again.failed), len(again.claimed), len(again.recovered)) == (50, 50, 0)
    assert len(upstream.requests) == 55
    assert account.list_requests[0]["delivery_success"] == "false"
    assert "created[gte]" in account.list_requests[0]
    metrics = metrics_text(proxy)
    assert 'dedup_reconcile_recovered_total{route="stripe"} 50.0' in metrics


@pytest.mark.usefixtures("no_background_runs")
async def test_pages_are_walked_with_starting_after_and_a_retry_after_is_waited_out(
    make_proxy: MakeProxy, upstream: FakeUpstream, account: StripeAccount, monkeypatch: Any
) -> None:
    monkeypatch.setattr(stripe, "LIMIT", 7)
    proxy = await make_proxy(routes=[_route(account.api_url)])
    account.target = "http://127.0.0.1:9/unreachable"  # every delivery fails to connect
    for n in range(20):
        await account.send(n=n)
    account.faults.append((429, {"Retry-After": "1"}))

    report = await _run(proxy)

    assert len(account.list_requests) == 1 + 3  # the 429, then 20 events in pages of 7
    cursors = [query.get("starting_after") for query in account.list_requests[1:]]
    newest_first = [event.id for event in reversed(account.events)]
    assert cursors == [None, newest_first[6], newest_first[13]]
    assert len(report.recovered) == 20
    assert report.stopped is None
    assert Counter(_delivered(upstream).values()) == Counter({1: 20})
    metrics = metrics_text(proxy)
    assert 'dedup_reconcile_errors_total{kind="rate_limited",route="stripe"} 1.0' in metrics


@pytest.mark.usefixtures("no_background_runs")
@pytest.mark.parametrize(
    ("fault", "kind"),
    [((401, {}), "unauthorized"), ((500, {}), "unavailable"),
     ((429, {"Retry-After": "3600"}), "rate_limited")],
)  # fmt: skip
async def test_a_revoked_key_or_an_outage_ends_the_run_and_the_next_one_recovers_once(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    account: StripeAccount,
    fault: tuple[int, dict[str, str]],
    kind: str,
) -> None:
    proxy = await make_proxy(routes=[_route(account.api_url)])
    account.target = "http://127.0.0.1:9/unreachable"
    for n in range(3):
        await account.send(n=n)
    account.faults.append(fault)

    stopped = await _run(proxy)

    assert stopped.stopped is not None
    assert stopped.stopped.kind == kind
    assert (stopped.recovered, upstream.requests) == ([], [])
    metrics = metrics_text(proxy)
    assert f'dedup_reconcile_errors_total{{kind="{kind}",route="stripe"}} 1.0' in metrics
    assert "dedup_reconcile_last_success_timestamp_seconds{" not in metrics

    report = await _run(proxy)  # the next period: the key renewed, the API back

    assert (len(report.recovered), report.stopped) == (3, None)
    assert Counter(_delivered(upstream).values()) == Counter({1: 3})


@pytest.mark.usefixtures("no_background_runs")
async def test_an_event_the_app_refuses_does_not_hold_back_the_gaps_behind_it(
    make_proxy: MakeProxy, upstream: FakeUpstream, account: StripeAccount
) -> None:
    """The app's 422 is about one event: the run goes on, and leaves that one for the next."""
    proxy = await make_proxy(routes=[_route(account.api_url)])
    account.target = "http://127.0.0.1:9/unreachable"
    for n in range(3):
        await account.send(n=n)
    # The app refuses the first event recovered (the oldest: these are of one second).
    upstream.respond = lambda number: web.Response(status=422 if number == 0 else 200)

    report = await _run(proxy)

    oldest = json.loads(upstream.requests[0].body)["id"]
    assert report.stopped is None
    assert list(report.refused) == [oldest]
    assert report.refused[oldest].status == 422
    assert sorted(d.event_id for d in report.recovered) == sorted(
        e.id for e in account.events if e.id != oldest
    )
    assert "refused by the route (422), left for the next run" in reconciler.describe(
        report, dry_run=False
    )
    metrics = metrics_text(proxy)
    assert 'dedup_reconcile_errors_total{kind="recovery_refused",route="stripe"} 1.0' in metrics

    upstream.respond = lambda number: web.Response(status=200)
    again = await _run(proxy)  # the app takes it now; the others have their claims

    assert [d.event_id for d in again.recovered] == [oldest]
    assert Counter(_delivered(upstream).values()) == Counter({1: 2, 2: 1})


@pytest.mark.usefixtures("no_background_runs")
async def test_a_recovery_signed_with_another_secret_is_refused_by_the_route_not_delivered(
    make_proxy: MakeProxy, upstream: FakeUpstream, account: StripeAccount
) -> None:
    """The recovered event goes through the route's own signature check."""
    proxy = await make_proxy(routes=[_route(account.api_url)])
    account.target = "http://127.0.0.1:9/unreachable"
    await account.send(n=1)

    refused = await _run(proxy, secret=b"whsec_not_the_endpoint_secret")

    assert refused.stopped is not None
    assert refused.stopped.kind == "recovery_refused"
    assert "answered 401" in refused.stopped.message
    assert (refused.recovered, upstream.requests) == ([], [])
    metrics = metrics_text(proxy)
    assert 'dedup_reconcile_errors_total{kind="recovery_refused",route="stripe"} 1.0' in metrics

    report = await _run(proxy)  # the route's own secret, from its verify

    assert len(report.recovered) == 1
    assert len(upstream.requests) == 1
    signature = upstream.requests[0].headers["stripe-signature"][0]
    assert signature.startswith("t=")
    assert ",v1=" in signature


def test_the_stand_in_answers_as_the_vendored_description_says() -> None:
    described = yaml.safe_load(VENDORED.read_text())
    listing = described["paths"]["/v1/events"]["get"]
    assert listing["operationId"] == "GetEvents"
    names = {parameter["name"] for parameter in listing["parameters"]}
    assert {"delivery_success", "created", "starting_after", "limit"} <= names
    answer = listing["responses"]["200"]["content"]["application/json"]["schema"]
    schema = {**json_schema(answer), "components": json_schema(described["components"])}
    stand_in = StripeAccount(secret=STRIPE_SECRET, key=KEY)

    async def events() -> None:
        stand_in.target = "http://127.0.0.1:9/unreachable"
        for n in range(3):
            await stand_in.send(n=n)

    asyncio.run(events())
    page = stand_in.page({"delivery_success": "false", "limit": "2"})
    jsonschema.validate(page, schema)
    assert (len(page["data"]), page["has_more"]) == (2, True)
    bad = {**page, "data": [{**page["data"][0], "pending_webhooks": "1"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_a_stripe_route_reconciles_through_its_own_listener_signed_with_its_secret() -> None:
    cfg = config.parse(
        {**BASE, "listen": "0.0.0.0:8443", "routes": [_route("https://api.stripe.test")]}
    )
    settings = cfg.routes[0].reconcile
    assert settings is not None
    assert settings.provider == "stripe"
    assert settings.deliver_to == "http://127.0.0.1:8443/webhooks/stripe"
    assert settings.signing_secret == STRIPE_SECRET.encode()
    assert (settings.token, settings.api_url) == (KEY, "https://api.stripe.test")
    assert KEY not in repr(cfg)
    assert STRIPE_SECRET not in repr(cfg)
    default = config.parse({**BASE, "routes": [stripe_route(reconcile={"token": KEY})]})
    assert default.routes[0].reconcile is not None
    assert default.routes[0].reconcile.api_url == "https://api.stripe.com"
    elsewhere = {"token": KEY, "deliver_to": "https://proxy.internal/webhooks/stripe",
                 "types": ["charge.succeeded", "invoice.paid"]}  # fmt: skip
    narrowed = config.parse({**BASE, "routes": [stripe_route(reconcile=elsewhere)]})
    assert narrowed.routes[0].reconcile is not None
    assert narrowed.routes[0].reconcile.deliver_to == "https://proxy.internal/webhooks/stripe"
    assert narrowed.routes[0].reconcile.types == ("charge.succeeded", "invoice.paid")


@pytest.mark.parametrize(
    ("route", "problem"),
    [
        (stripe_route(reconcile={"token": KEY, "hook_id": 1}),
         "routes[0].reconcile.hook_id: not on a Stripe route"),
        (stripe_route(reconcile={"token": KEY, "repository": "o/r"}),
         "routes[0].reconcile.repository: not on a Stripe route"),
        (stripe_route(reconcile={"token": KEY, "since": "31d", "every": "1h"}),
         "routes[0].reconcile.since: must be at most 30d"),
        # Stripe keeps listing an event the reconciler delivered: its claim must outlive since.
        (stripe_route(reconcile={"token": KEY, "since": "5d", "every": "1h"}),
         "routes[0].reconcile.since: must be at most the route's retention (345600s)"),
        (stripe_route(reconcile={"token": KEY, "types": [f"t.{n}" for n in range(21)]}),
         "routes[0].reconcile.types: at most 20"),
        (stripe_route(verify=None, reconcile={"token": KEY}),
         "routes[0].reconcile: needs the route's verify with scheme stripe"),
        (stripe_route(reconcile={"every": "5m"}),
         "routes[0].reconcile: give either token"),
        ({"name": "github", "path": "/g", "preset": "github", "verify": {"secret": "s"},
          "reconcile": {"token": "t", "repository": "o/r", "hook_id": 1, "deliver_to": "http://x"}},
         "routes[0].reconcile.deliver_to: only on a route with preset stripe"),
        (stripe_route(path="/stripe/{tenant}", scope="stripe",
                      verify={"secret": STRIPE_SECRET, "shared_secret": True},
                      reconcile={"token": KEY}),
         "routes[0].reconcile.deliver_to: is required on a path with {parameters}"),
    ],
)  # fmt: skip
def test_reconcile_on_a_stripe_route_refuses_what_does_not_apply(
    route: dict[str, Any], problem: str
) -> None:
    with pytest.raises(errors.ConfigError) as raised:
        config.parse({**BASE, "routes": [route]})
    assert problem in str(raised.value)


def test_check_shows_the_reconcile_and_never_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STRIPE_RECONCILE_KEY", KEY)
    path = tmp_path / "config.yaml"
    route = stripe_route(reconcile={"token": "${STRIPE_RECONCILE_KEY}"})
    path.write_text(yaml.safe_dump({**BASE, "listen": "127.0.0.1:8080", "routes": [route]}))

    assert cli.main(["check", "--config", str(path)]) == 0

    out = capsys.readouterr().out
    assert "reconcile stripe events -> http://127.0.0.1:8080/webhooks/stripe every 5m" in out
    assert "(key (masked))" in out
    assert KEY not in out


@pytest.mark.usefixtures("no_background_runs")
async def test_the_command_dry_run_lists_what_stripe_reports_and_sends_nothing(
    make_proxy: MakeProxy,
    proxy_config: Any,
    upstream: FakeUpstream,
    account: StripeAccount,
) -> None:
    routes = [_route(account.api_url)]
    proxy = await make_proxy(routes=routes)
    account.target = str(proxy.make_url("/webhooks/stripe"))
    assert await account.send(n=1) == 200
    account.target = "http://127.0.0.1:9/unreachable"
    await account.send("invoice.paid", n=2)
    out = io.StringIO()

    status = await reconciler.command(
        proxy_config(routes=routes), "stripe", since=None, dry_run=True, out=out
    )

    assert status == 0
    listed = out.getvalue()
    gap = account.events[1].id
    assert f"  {gap}  invoice.paid  " in listed
    assert "pending_webhooks 1, 1 attempt(s): would be recovered" in listed
    assert account.events[0].id not in listed  # delivered: not in Stripe's undelivered list
    assert "1 gap(s) (no claim), 0 claimed; would recover 1" in listed
    assert len(upstream.requests) == 1


@pytest.mark.usefixtures("no_background_runs")
async def test_an_event_of_a_type_the_route_does_not_ask_for_is_never_signed_nor_sent(
    make_proxy: MakeProxy, upstream: FakeUpstream, account: StripeAccount
) -> None:
    """Stripe's list is the account's: an API that answers more than ``types[]`` asked for (the
    stand-in ignores it) must not have the proxy sign and deliver another endpoint's events."""
    proxy = await make_proxy(routes=[_route(account.api_url, types=["invoice.paid"])])
    account.target = "http://127.0.0.1:9/unreachable"
    await account.send("charge.succeeded", n=1)
    await account.send("invoice.paid", n=2)
    await account.send("customer.deleted", n=3)

    report = await _run(proxy)

    assert account.list_requests[0]["types[]"] == "invoice.paid"
    assert [d.event for d in report.recovered] == ["invoice.paid"]
    assert list(_delivered(upstream)) == [account.events[1].id]  # before: all three


@pytest.mark.usefixtures("no_background_runs")
async def test_an_event_id_not_of_stripe_s_form_stops_the_run_before_anything_is_signed(
    make_proxy: MakeProxy, upstream: FakeUpstream, account: StripeAccount
) -> None:
    proxy = await make_proxy(routes=[_route(account.api_url)])
    account.target = "http://127.0.0.1:9/unreachable"
    await account.send(n=1)
    account.tamper = lambda page: {
        **page,
        "data": [{**item, "id": "../v1/charges"} for item in page["data"]],
    }

    report = await _run(proxy)

    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert "an event's id is not of Stripe's form" in report.stopped.message
    assert (report.recovered, upstream.requests) == ([], [])
