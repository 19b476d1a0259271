"""The reconciler against a stand-in of Paddle's notifications API (tests/provider_standins.py,
built from the operations vendored under tests/provider_api/paddle-notifications.yaml), through
a real proxy on the session's PostgreSQL: notifications refused while the proxy could not reach
its database are replayed by Paddle and reach the app once; notifications whose event has a
claim are never replayed; pages, a next link on another host, an answer not as described and a
notification ID not of Paddle's form behave as the bounds say.
"""

from __future__ import annotations

import asyncio
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
from yarl import URL

from proxy import cli, config, errors, reconciler
from proxy.providers_api import paddle
from tests.faults.relay import Relay
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    claimed,
    metrics_text,
    reaches_database,
    reconcile_once,
    wait_until,
)
from tests.provider_standins import PaddleDestination, json_schema

KEY = "pdl_sdbx_apikey_01hv8stand0in0key0000000000_abcdefghijklmnopqrstuv"
SECRET = "pdl_ntfset_01hv8wptq8987qeep44cyrewp9_stand0in0secret"
SETTING = "ntfset_01hv8wptq8987qeep44cyrewp9"
# The TCP fault relay (the database link cut) is written for asyncio's transports (conftest).
RELAY_IN_LOOP = True
VENDORED = Path(__file__).parent / "provider_api" / "paddle-notifications.yaml"
BASE = {"upstream": {"url": "http://127.0.0.1:9"}, "database": {"dsn": "embedded"}}


def _route(api_url: str, **reconcile: Any) -> dict[str, Any]:
    settings = {"every": "1h", "since": "1h", "token": KEY, "api_url": api_url,
                "notification_setting_id": SETTING, **reconcile}  # fmt: skip
    return {"name": "paddle", "path": "/webhooks/paddle", "preset": "paddle",
            "verify": {"secret": SECRET}, "reconcile": settings}  # fmt: skip


@pytest.fixture
async def destination(aiohttp_server: Any) -> PaddleDestination:
    stand_in = PaddleDestination(secret=SECRET, key=KEY, setting_id=SETTING)
    server = await aiohttp_server(stand_in.app())
    stand_in.api_url = str(server.make_url(""))
    return stand_in


def _delivered(upstream: FakeUpstream) -> Counter[str]:
    return Counter(json.loads(r.body)["event_id"] for r in upstream.requests)


async def _gaps(destination: PaddleDestination, proxy: TestClient[Any, Any], count: int) -> None:
    """``count`` events whose one notification failed (the route unreachable), the route
    reachable again for the replays."""
    destination.target = "http://127.0.0.1:9/unreachable"
    for n in range(count):
        await destination.send(n=n)
    destination.target = str(proxy.make_url("/webhooks/paddle"))


@pytest.mark.usefixtures("no_background_runs")
async def test_notifications_refused_while_the_database_was_unreachable_are_replayed_once(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    destination: PaddleDestination,
    relayed_database: tuple[Relay, str],
    pg_dsn: str,
    table: str,
) -> None:
    link, dsn = relayed_database
    proxy = await make_proxy(
        routes=[_route(destination.api_url)],
        database={"dsn": dsn, "connect_timeout": "1s", "pool_timeout": "1s"},
    )
    destination.target = str(proxy.make_url("/webhooks/paddle"))
    assert [await destination.send(n=n) for n in range(3)] == [200] * 3
    await link.set_mode("refuse")
    # Each notified once and never retried (the worst sender), every one refused.
    assert {await destination.send(n=100 + n) for n in range(20)} == {503}
    await link.set_mode("pass")
    await wait_until(
        lambda: reaches_database(proxy), "the proxy reaches its database again", within=30
    )

    report = await reconcile_once(proxy)

    assert (len(report.failed), len(report.gaps), len(report.recovered)) == (20, 20, 20)
    assert report.stopped is None
    events = {n.event_id for n in destination.notifications}
    assert _delivered(upstream) == Counter(dict.fromkeys(events, 1))
    assert {event_id for _, event_id, _ in await claimed(pg_dsn, table)} == events
    replays = [n for n in destination.notifications if n.origin == "replay"]
    assert (len(replays), {n.status for n in replays}) == (20, {"delivered"})
    query = destination.list_requests[0]
    assert (query["status"], query["notification_setting_id"]) == ("failed", SETTING)
    # Paddle still lists the original notifications as failed: each has its claim now.
    again = await reconcile_once(proxy)
    assert (len(again.failed), len(again.claimed), len(again.recovered)) == (20, 20, 0)
    assert len(destination.replay_requests) == 20
    assert len(upstream.requests) == 23
    assert 'dedup_reconcile_recovered_total{route="paddle"} 20.0' in metrics_text(proxy)


@pytest.mark.usefixtures("no_background_runs")
async def test_pages_are_walked_through_meta_pagination_next_and_bounded(
    make_proxy: MakeProxy,
    proxy_config: Any,
    upstream: FakeUpstream,
    destination: PaddleDestination,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paddle, "PER_PAGE", 3)
    routes = [_route(destination.api_url)]
    proxy = await make_proxy(routes=routes)
    await _gaps(destination, proxy, 7)
    newest_first = sorted((n.id for n in destination.notifications), reverse=True)

    report = await reconcile_once(proxy)

    cursors = [query.get("after") for query in destination.list_requests]
    assert cursors == [None, newest_first[2], newest_first[5]]
    assert (len(report.recovered), report.truncated) == (7, False)
    assert set(_delivered(upstream).values()) == {1}

    monkeypatch.setattr(paddle, "MAX_PAGES", 2)
    out = io.StringIO()
    status = await reconciler.command(
        proxy_config(routes=routes), "paddle", since=None, dry_run=True, out=out
    )
    assert status == reconciler.EXIT_TRUNCATED
    assert "warning: the provider's log over the window is longer than a run reads" in (
        out.getvalue()
    )


@pytest.fixture
async def elsewhere(aiohttp_server: Any) -> tuple[str, list[str]]:
    """Another port of the same host: its URL, and the Authorization of every request."""
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"data": [], "meta": {}})

    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", record)
    server = await aiohttp_server(application)
    return str(server.make_url("")), seen


@pytest.mark.usefixtures("no_background_runs")
async def test_a_next_page_on_another_host_is_not_followed_and_the_key_stays_home(
    make_proxy: MakeProxy,
    destination: PaddleDestination,
    elsewhere: tuple[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paddle, "PER_PAGE", 2)
    url, seen = elsewhere
    proxy = await make_proxy(routes=[_route(destination.api_url)])
    await _gaps(destination, proxy, 3)
    destination.next_origin = url

    report = await reconcile_once(proxy)

    assert seen == []
    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert "another host than api_url's" in report.stopped.message
    assert (report.recovered, destination.replay_requests) == ([], [])


@pytest.mark.usefixtures("no_background_runs")
@pytest.mark.parametrize(
    ("tamper", "said"),
    [
        (lambda page: {"data": page["data"]}, "an answer not as described: KeyError('meta')"),
        (lambda page: [page], "an answer not as described"),
        (lambda page: {**page, "data": [{**n, "id": "../../api-keys"} for n in page["data"]]},
         "a notification's id is not of Paddle's form"),
        (lambda page: {**page, "data": [{**n, "payload": {**n["payload"], "event_id": 7}}
                                        for n in page["data"]]},
         "payload.event_id is not of Paddle's form"),
        (lambda page: {**page, "data": [{**n, "occurred_at": 17, "last_attempt_at": None}
                                        for n in page["data"]]},
         "not a time: 17"),
        (lambda page: {**page, "data": [{**n, "origin": "elsewhere"} for n in page["data"]]},
         "origin is not event or replay"),
    ],
    ids=["no-meta", "not-an-object", "id-a-path", "event-id-a-number", "time-a-number",
         "origin-unknown"],
)  # fmt: skip
async def test_an_answer_not_as_described_stops_the_run_with_one_line_and_replays_nothing(
    make_proxy: MakeProxy,
    proxy_config: Any,
    upstream: FakeUpstream,
    destination: PaddleDestination,
    tamper: Any,
    said: str,
) -> None:
    routes = [_route(destination.api_url)]
    proxy = await make_proxy(routes=routes)
    await _gaps(destination, proxy, 2)
    destination.tamper = tamper

    report = await reconcile_once(proxy)
    out = io.StringIO()
    status = await reconciler.command(
        proxy_config(routes=routes), "paddle", since=None, dry_run=False, out=out
    )

    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert said in report.stopped.message
    assert "\n" not in report.stopped.message
    assert status == 1
    assert "stopped: listing the destination's failed notifications: " in out.getvalue()
    assert (destination.replay_requests, upstream.requests) == ([], [])


@pytest.mark.usefixtures("no_background_runs")
@pytest.mark.parametrize(
    ("fault", "kind"),
    [((403, {}), "unauthorized"), ((503, {}), "unavailable"),
     ((429, {"Retry-After": "3600"}), "rate_limited")],
)  # fmt: skip
async def test_a_revoked_key_or_an_outage_ends_the_run_and_the_next_one_recovers_once(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    destination: PaddleDestination,
    fault: tuple[int, dict[str, str]],
    kind: str,
) -> None:
    proxy = await make_proxy(routes=[_route(destination.api_url)])
    await _gaps(destination, proxy, 3)
    destination.faults.append(fault)

    stopped = await reconcile_once(proxy)

    assert stopped.stopped is not None
    assert stopped.stopped.kind == kind
    assert (stopped.recovered, upstream.requests) == ([], [])

    report = await reconcile_once(proxy)

    assert (len(report.recovered), report.stopped) == (3, None)
    assert set(_delivered(upstream).values()) == {1}


@pytest.mark.usefixtures("no_background_runs")
async def test_a_replayed_notification_that_failed_is_not_replayed_but_its_original_is(
    make_proxy: MakeProxy, upstream: FakeUpstream, destination: PaddleDestination
) -> None:
    """Paddle refuses to replay a replay: the event's ``origin: event`` notification is asked
    for, once per event however many of its notifications failed."""
    proxy = await make_proxy(routes=[_route(destination.api_url)])
    await _gaps(destination, proxy, 1)
    original = destination.notifications[0]
    destination.target = "http://127.0.0.1:9/unreachable"
    await destination.replay(original.id)  # a replay that failed too
    destination.target = str(proxy.make_url("/webhooks/paddle"))

    report = await reconcile_once(proxy)

    assert [d.ref for d in report.recovered] == [original.id]
    assert destination.replay_requests == [original.id]
    assert _delivered(upstream) == Counter({original.event_id: 1})


def test_the_stand_in_answers_as_the_vendored_description_says() -> None:
    described = yaml.safe_load(VENDORED.read_text())
    listing = described["paths"]["/notifications"]["get"]
    assert listing["operationId"] == "list-notifications"
    parameters = described["components"]["parameters"]
    names = {parameters[p["$ref"].rsplit("/", 1)[1]]["name"] for p in listing["parameters"]}
    assert {"status", "notification_setting_id", "from", "per_page", "after"} <= names
    replay = described["paths"]["/notifications/{notification_id}/replay"]["post"]
    assert replay["operationId"] == "replay-notification"
    components = {"components": json_schema(described["components"])}
    answer = listing["responses"]["200"]["content"]["application/json"]["schema"]
    schema = {**json_schema(answer), **components}
    stand_in = PaddleDestination(secret=SECRET, key=KEY, setting_id=SETTING)

    async def notify() -> None:
        stand_in.target = "http://127.0.0.1:9/unreachable"
        for n in range(3):
            await stand_in.send(n=n)

    asyncio.run(notify())
    url = URL("https://api.paddle.com/notifications?status=failed&per_page=2")
    page = stand_in.page(dict(url.query), url)
    jsonschema.validate(page, schema)
    assert (len(page["data"]), page["meta"]["pagination"]["has_more"]) == (2, True)
    assert f"after={page['data'][-1]['id']}" in page["meta"]["pagination"]["next"]
    bad = {**page, "data": [{**page["data"][0], "id": "ntf_NOT-LOWER"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_a_paddle_route_s_reconcile_is_configured_and_its_key_never_shown() -> None:
    cfg = config.parse({**BASE, "routes": [_route("https://sandbox-api.paddle.com")]})
    settings = cfg.routes[0].reconcile
    assert settings is not None
    assert (settings.provider, settings.notification_setting_id) == ("paddle", SETTING)
    assert (settings.token, settings.api_url) == (KEY, "https://sandbox-api.paddle.com")
    assert KEY not in repr(cfg)
    default = config.parse({**BASE, "routes": [_route("https://api.paddle.com")]})
    assert default.routes[0].reconcile is not None
    assert default.routes[0].reconcile.api_url == "https://api.paddle.com"


@pytest.mark.parametrize(
    ("reconcile", "problems"),
    [
        ({"notification_setting_id": "ntfset_../../keys"},
         ["routes[0].reconcile.notification_setting_id: must be a notification destination's "
          "ID (ntfset_...)"]),
        ({"notification_setting_id": None, "hook_id": 1, "types": ["x"]},
         ["routes[0].reconcile.notification_setting_id: is required",
          "routes[0].reconcile.hook_id: not on a Paddle route",
          "routes[0].reconcile.types: not on a Paddle route"]),
        ({"since": "91d", "every": "1h"},
         ["routes[0].reconcile.since: must be at most 90d",
          "routes[0].reconcile.since: must be at most the route's retention"]),
        ({"token": None}, ["routes[0].reconcile: give either token"]),
        ({"webhook_id": "WH1"}, ["routes[0].reconcile.webhook_id: not on a Paddle route"]),
    ],
)  # fmt: skip
def test_reconcile_on_a_paddle_route_collects_every_problem(
    reconcile: dict[str, Any], problems: list[str]
) -> None:
    route = _route("https://api.paddle.com", **reconcile)
    route["reconcile"] = {k: v for k, v in route["reconcile"].items() if v is not None}
    with pytest.raises(errors.ConfigError) as raised:
        config.parse({**BASE, "routes": [route]})
    for problem in problems:
        assert problem in str(raised.value)


def test_check_names_the_destination_and_masks_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PADDLE_API_KEY", KEY)
    path = tmp_path / "config.yaml"
    route = _route("https://api.paddle.com", token="${PADDLE_API_KEY}")
    path.write_text(yaml.safe_dump({**BASE, "listen": "127.0.0.1:8080", "routes": [route]}))

    assert cli.main(["check", "--config", str(path)]) == 0

    out = capsys.readouterr().out
    assert f"reconcile paddle notifications of {SETTING} every 1h" in out
    assert "(API key (masked))" in out
    assert KEY not in out
