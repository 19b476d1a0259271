"""The reconciler against a stand-in of PayPal's webhook events API (tests/provider_standins.py,
built from the operations vendored under tests/provider_api/paypal-webhooks-events.yaml),
through a real proxy on the session's PostgreSQL whose route verifies PayPal's signatures
against a stand-in certificate host: events refused while the proxy could not reach its
database are resent by PayPal and reach the app once; events with a claim are never resent;
the OAuth token is asked for once and again near its end, its secret never shown; pages, a next
link on another host, an answer not as described and an event ID not of PayPal's form behave as
the bounds say.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import trustme
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from cryptography.hazmat.primitives import serialization
from yarl import URL

from proxy import app_keys, cli, config, errors, reconciler
from proxy.providers_api import paypal
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
from tests.provider_standins import PayPalApp, json_schema

CLIENT_ID = "AeA1QIZXiflr1_-r0U2UbWTziOWX1GRQer5jkUq4ZfWT5qwb6qQRPq7jDtv57TL4POEEezGLdutcxnkJ"
CLIENT_SECRET = "ECYYrrSHdKfk_Q0EdvzdGkzj58a66kKaUQ5dZAEv4HvvtDId2_DpSuYDB088BZxGuMji7G4OFUnPog6p"
WEBHOOK_ID = "1JE4291016473214C"
CERT_PATH = "/v1/notifications/certs/CERT-360caa42-fca2a594-a5cafa77"
# The TCP fault relay (the database link cut) is written for asyncio's transports (conftest).
RELAY_IN_LOOP = True
VENDORED = Path(__file__).parent / "provider_api" / "paypal-webhooks-events.yaml"
BASE = {"upstream": {"url": "http://127.0.0.1:9"}, "database": {"dsn": "embedded"}}


class CertHost:
    """PayPal's certificate host: the signing certificate, issued for
    messageverificationcerts.paypal.com by a test CA through an intermediate, as PayPal's is."""

    def __init__(self) -> None:
        self.ca = trustme.CA(key_type=trustme.KeyType.RSA)
        intermediate = self.ca.create_child_ca(key_type=trustme.KeyType.RSA)
        self.signer = intermediate.issue_cert(
            "messageverificationcerts.paypal.com", key_type=trustme.KeyType.RSA
        )
        self.netloc = ""

    def key(self) -> Any:
        return serialization.load_pem_private_key(self.signer.private_key_pem.bytes(), None)

    async def handle(self, request: web.Request) -> web.Response:
        if request.path != CERT_PATH:
            return web.Response(status=404)
        return web.Response(body=b"".join(blob.bytes() for blob in self.signer.cert_chain_pems))


@pytest.fixture
async def cert_host(aiohttp_server: Any, server_tls: Any) -> CertHost:
    host = CertHost()
    application = web.Application()
    application.router.add_get("/{tail:.*}", host.handle)
    server = await aiohttp_server(application, ssl=server_tls)
    host.netloc = f"127.0.0.1:{server.port}"
    return host


@pytest.fixture
def ca_file(ca: trustme.CA, cert_host: CertHost, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    path.write_bytes(ca.cert_pem.bytes() + cert_host.ca.cert_pem.bytes())
    return str(path)


@pytest.fixture
async def app_api(aiohttp_server: Any, cert_host: CertHost) -> PayPalApp:
    stand_in = PayPalApp(
        client_id=CLIENT_ID,
        client_secret=CLIENT_SECRET,
        webhook_id=WEBHOOK_ID,
        signing_key=cert_host.key(),
        cert_url=f"https://{cert_host.netloc}{CERT_PATH}",
    )
    server = await aiohttp_server(stand_in.app())
    stand_in.api_url = str(server.make_url(""))
    return stand_in


@pytest.fixture
def route(app_api: PayPalApp, cert_host: CertHost, ca_file: str) -> Any:
    def build(**reconcile: Any) -> dict[str, Any]:
        settings = {"every": "1h", "since": "1h", "client_id": CLIENT_ID,
                    "client_secret": CLIENT_SECRET, "webhook_id": WEBHOOK_ID,
                    "api_url": app_api.api_url, **reconcile}  # fmt: skip
        verify = {"secret": WEBHOOK_ID, "cert_hosts": [cert_host.netloc], "ca_file": ca_file}
        return {"name": "paypal", "path": "/webhooks/paypal", "preset": "paypal",
                "verify": verify, "reconcile": settings}  # fmt: skip

    return build


def _delivered(upstream: FakeUpstream) -> Counter[str]:
    return Counter(json.loads(r.body)["id"] for r in upstream.requests)


async def _gaps(app_api: PayPalApp, proxy: TestClient[Any, Any], count: int) -> None:
    app_api.target = "http://127.0.0.1:9/unreachable"
    for n in range(count):
        await app_api.send(n=n)
    app_api.target = str(proxy.make_url("/webhooks/paypal"))


@pytest.mark.usefixtures("no_background_runs")
async def test_events_refused_while_the_database_was_unreachable_are_resent_once(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    app_api: PayPalApp,
    route: Any,
    relayed_database: tuple[Relay, str],
    pg_dsn: str,
    table: str,
) -> None:
    link, dsn = relayed_database
    proxy = await make_proxy(
        routes=[route()], database={"dsn": dsn, "connect_timeout": "1s", "pool_timeout": "1s"}
    )
    app_api.target = str(proxy.make_url("/webhooks/paypal"))
    assert [await app_api.send(n=n) for n in range(3)] == [200] * 3
    await link.set_mode("refuse")
    assert {await app_api.send(n=100 + n) for n in range(20)} == {503}
    await link.set_mode("pass")
    await wait_until(
        lambda: reaches_database(proxy), "the proxy reaches its database again", within=30
    )

    report = await reconcile_once(proxy)

    # PayPal lists every event, delivered or not: the 3 claimed, the 20 gaps resent.
    assert (len(report.failed), len(report.claimed), len(report.recovered)) == (23, 3, 20)
    assert report.stopped is None
    events = {event.id for event in app_api.events}
    assert _delivered(upstream) == Counter(dict.fromkeys(events, 1))
    assert {event_id for _, event_id, _ in await claimed(pg_dsn, table)} == events
    assert {tuple(body["webhook_ids"]) for _, body in app_api.resend_requests} == {(WEBHOOK_ID,)}
    assert app_api.token_requests == 1  # one token for the run's 1 page and 20 resends
    again = await reconcile_once(proxy)
    assert (len(again.claimed), len(again.recovered)) == (23, 0)
    assert len(app_api.resend_requests) == 20
    assert len(upstream.requests) == 23
    assert 'dedup_reconcile_recovered_total{route="paypal"} 20.0' in metrics_text(proxy)


@pytest.mark.usefixtures("no_background_runs")
async def test_a_token_near_its_end_is_asked_for_again_and_a_wrong_secret_is_unauthorized(
    make_proxy: MakeProxy, upstream: FakeUpstream, app_api: PayPalApp, route: Any
) -> None:
    app_api.expires_in = int(paypal.RENEW_BEFORE)  # every request finds it near its end
    proxy = await make_proxy(routes=[route()])
    await _gaps(app_api, proxy, 2)

    report = await reconcile_once(proxy)

    assert (len(report.recovered), app_api.token_requests) == (2, 3)  # the page, 2 resends

    wrong = await make_proxy(routes=[route(client_secret="not-the-secret")])
    refused = await reconcile_once(wrong)

    assert refused.stopped is not None
    assert refused.stopped.kind == "unauthorized"
    assert "not-the-secret" not in refused.stopped.message


@pytest.mark.usefixtures("no_background_runs")
@pytest.mark.parametrize(
    ("tamper", "said"),
    [
        (lambda a: {**a, "token_type": "MAC"}, "token_type is not Bearer"),
        (lambda a: {**a, "access_token": a["access_token"] + "\r\nX-Evil: 1"},
         "access_token is not a bearer token"),
        (lambda a: {**a, "expires_in": "32400"}, "expires_in is not a positive integer"),
        (lambda a: {k: v for k, v in a.items() if k != "access_token"},
         "an answer not as described: KeyError('access_token')"),
    ],
)  # fmt: skip
async def test_a_token_answer_not_as_rfc_6749_says_stops_the_run_without_the_token(
    make_proxy: MakeProxy, app_api: PayPalApp, route: Any, tamper: Any, said: str
) -> None:
    proxy = await make_proxy(routes=[route()])
    await _gaps(app_api, proxy, 1)
    app_api.tamper_token = tamper

    report = await reconcile_once(proxy)

    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert said in report.stopped.message
    assert "A21AA" not in report.stopped.message  # the token's text
    assert (app_api.list_requests, app_api.resend_requests) == ([], [])


@pytest.mark.usefixtures("no_background_runs")
async def test_pages_are_walked_through_the_next_link_and_bounded(
    make_proxy: MakeProxy,
    proxy_config: Any,
    upstream: FakeUpstream,
    app_api: PayPalApp,
    route: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paypal, "PAGE_SIZE", 3)
    routes = [route()]
    proxy = await make_proxy(routes=routes)
    await _gaps(app_api, proxy, 7)

    report = await reconcile_once(proxy)

    assert [query.get("page") for query in app_api.list_requests] == [None, "3", "6"]
    assert {query["page_size"] for query in app_api.list_requests} == {"3"}
    assert "start_time" in app_api.list_requests[0]
    assert (len(report.recovered), report.truncated) == (7, False)
    assert set(_delivered(upstream).values()) == {1}

    monkeypatch.setattr(paypal, "MAX_PAGES", 2)
    out = io.StringIO()
    status = await reconciler.command(
        proxy_config(routes=routes), "paypal", since=None, dry_run=True, out=out
    )
    assert status == reconciler.EXIT_TRUNCATED


@pytest.fixture
async def elsewhere(aiohttp_server: Any) -> tuple[str, list[str]]:
    """Another port of the same host: its URL, and the Authorization of every request."""
    seen: list[str] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization", ""))
        return web.json_response({"events": [], "links": []})

    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", record)
    server = await aiohttp_server(application)
    return str(server.make_url("")), seen


@pytest.mark.usefixtures("no_background_runs")
async def test_a_next_page_on_another_host_is_not_followed_and_the_token_stays_home(
    make_proxy: MakeProxy,
    app_api: PayPalApp,
    route: Any,
    elsewhere: tuple[str, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(paypal, "PAGE_SIZE", 2)
    url, seen = elsewhere
    proxy = await make_proxy(routes=[route()])
    await _gaps(app_api, proxy, 3)
    app_api.next_origin = url

    report = await reconcile_once(proxy)

    assert seen == []
    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert "another host than api_url's" in report.stopped.message
    assert (report.recovered, app_api.resend_requests) == ([], [])


@pytest.mark.usefixtures("no_background_runs")
@pytest.mark.parametrize(
    ("tamper", "said"),
    [
        (lambda page: {"count": 0}, "an answer not as described: KeyError('events')"),
        (lambda page: {**page, "events": [{**e, "id": "../../oauth2/token"}
                                          for e in page["events"]]},
         "an event's id is not of PayPal's form"),
        (lambda page: {**page, "events": [{**e, "create_time": None} for e in page["events"]]},
         "not a time: None"),
        (lambda page: {**page, "links": [{"href": 1}]}, "KeyError('rel')"),
    ],
    ids=["no-events", "id-a-path", "no-time", "link-without-rel"],
)  # fmt: skip
async def test_an_answer_not_as_described_stops_the_run_with_one_line_and_resends_nothing(
    make_proxy: MakeProxy,
    proxy_config: Any,
    upstream: FakeUpstream,
    app_api: PayPalApp,
    route: Any,
    tamper: Any,
    said: str,
) -> None:
    routes = [route()]
    proxy = await make_proxy(routes=routes)
    await _gaps(app_api, proxy, 2)
    app_api.tamper = tamper

    report = await reconcile_once(proxy)
    out = io.StringIO()
    status = await reconciler.command(
        proxy_config(routes=routes), "paypal", since=None, dry_run=False, out=out
    )

    assert report.stopped is not None
    assert report.stopped.kind == "refused"
    assert said in report.stopped.message
    assert "\n" not in report.stopped.message
    assert status == 1
    assert "stopped: listing the app's webhook events: " in out.getvalue()
    assert (app_api.resend_requests, upstream.requests) == ([], [])


@pytest.mark.usefixtures("no_background_runs")
async def test_an_event_of_a_type_the_webhook_does_not_ask_for_is_never_resent(
    make_proxy: MakeProxy, upstream: FakeUpstream, app_api: PayPalApp, route: Any
) -> None:
    """The list is the REST app's, every webhook together."""
    proxy = await make_proxy(
        routes=[route(types=["PAYMENT.CAPTURE.COMPLETED", "PAYMENT.CAPTURE.REFUNDED"])]
    )
    app_api.target = "http://127.0.0.1:9/unreachable"
    await app_api.send("PAYMENT.CAPTURE.COMPLETED", n=1)
    await app_api.send("CUSTOMER.DISPUTE.CREATED", n=2)
    await app_api.send("PAYMENT.CAPTURE.REFUNDED", n=3)
    app_api.target = str(proxy.make_url("/webhooks/paypal"))

    report = await reconcile_once(proxy)

    assert sorted(d.event for d in report.recovered) == [
        "PAYMENT.CAPTURE.COMPLETED", "PAYMENT.CAPTURE.REFUNDED"
    ]  # fmt: skip
    assert app_api.events[1].id not in _delivered(upstream)
    assert "event_type" not in app_api.list_requests[0]  # two types: filtered here


@pytest.mark.usefixtures("no_background_runs")
async def test_the_client_secret_is_never_in_a_log_line_nor_a_repr(
    make_proxy: MakeProxy, app_api: PayPalApp, route: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = await make_proxy(routes=[route()])
    await _gaps(app_api, proxy, 1)
    app_api.faults.append((500, {}))

    await reconcile_once(proxy)
    await reconcile_once(proxy)

    app = proxy.app
    assert app is not None
    settings = app[app_keys.CONFIG].routes[0].reconcile
    assert settings is not None
    credentials = paypal.WebhookEvents(settings, user_agent="t")
    try:
        assert CLIENT_SECRET not in repr(credentials._credentials)
    finally:
        await credentials.close()
    assert CLIENT_SECRET not in repr(app[app_keys.CONFIG])
    assert CLIENT_SECRET not in caplog.text
    assert "A21AA" not in caplog.text


def test_the_stand_in_answers_as_the_vendored_description_says(cert_host: CertHost) -> None:
    described = yaml.safe_load(VENDORED.read_text())
    listing = described["paths"]["/v1/notifications/webhooks-events"]["get"]
    assert listing["operationId"] == "webhooks-events.list"
    parameters = described["components"]["parameters"]
    names = {parameters[p["$ref"].rsplit("/", 1)[1]]["name"] for p in listing["parameters"]}
    assert {"page_size", "start_time", "end_time", "event_type"} <= names
    resend = described["paths"]["/v1/notifications/webhooks-events/{event_id}/resend"]["post"]
    assert resend["operationId"] == "webhooks-events.resend"
    flows = described["components"]["securitySchemes"]["Oauth2"]["flows"]
    assert flows["clientCredentials"]["tokenUrl"] == "/v1/oauth2/token"
    components = {"components": json_schema(described["components"])}
    answer = listing["responses"]["200"]["content"]["application/json"]["schema"]
    schema = {**json_schema(answer), **components}
    body = resend["requestBody"]["content"]["application/json"]["schema"]
    stand_in = PayPalApp(CLIENT_ID, CLIENT_SECRET, WEBHOOK_ID, cert_host.key())

    async def send() -> None:
        stand_in.target = "http://127.0.0.1:9/unreachable"
        for n in range(3):
            await stand_in.send(n=n)

    asyncio.run(send())
    url = URL("https://api-m.paypal.com/v1/notifications/webhooks-events?page_size=2")
    page = stand_in.page(dict(url.query), url)
    jsonschema.validate(page, schema)
    assert [link["rel"] for link in page["links"]] == ["self", "next"]
    jsonschema.validate({"webhook_ids": [WEBHOOK_ID]}, {**json_schema(body), **components})
    bad = {**page, "events": [{**page["events"][0], "resource_version": "two"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def _parse(route: dict[str, Any]) -> config.Config:
    return config.parse({**BASE, "routes": [route]})


def test_a_paypal_route_s_reconcile_is_configured_and_its_secret_never_shown(
    route: Any,
) -> None:
    cfg = _parse(route(api_url="https://api-m.sandbox.paypal.com"))
    settings = cfg.routes[0].reconcile
    assert settings is not None
    assert (settings.provider, settings.webhook_id, settings.client_id) == (
        "paypal", WEBHOOK_ID, CLIENT_ID
    )  # fmt: skip
    assert settings.client_secret == CLIENT_SECRET
    assert CLIENT_SECRET not in repr(cfg)
    default = dict(route())
    default["reconcile"] = {k: v for k, v in default["reconcile"].items() if k != "api_url"}
    settings = _parse(default).routes[0].reconcile
    assert settings is not None
    assert settings.api_url == "https://api-m.paypal.com"


@pytest.mark.parametrize(
    ("reconcile", "problems"),
    [
        ({"webhook_id": "1JE42/../x"},
         ["routes[0].reconcile.webhook_id: must be a PayPal webhook's ID"]),
        ({"webhook_id": "8PT597110X687430LKGECATA"},
         ["routes[0].reconcile.webhook_id: must be one of the route's verify secrets"]),
        ({"client_secret": None, "token": "x", "notification_setting_id": "ntfset_x"},
         ["routes[0].reconcile: give either client_secret",
          "routes[0].reconcile.token: not on a PayPal route",
          "routes[0].reconcile.notification_setting_id: not on a PayPal route"]),
        ({"client_id": None, "webhook_id": None},
         ["routes[0].reconcile.client_id: is required",
          "routes[0].reconcile.webhook_id: is required"]),
        ({"since": "5d", "every": "1h"},
         ["routes[0].reconcile.since: must be at most the route's retention"]),
    ],
)  # fmt: skip
def test_reconcile_on_a_paypal_route_collects_every_problem(
    route: Any, reconcile: dict[str, Any], problems: list[str]
) -> None:
    built = route(**reconcile)
    built["reconcile"] = {k: v for k, v in built["reconcile"].items() if v is not None}
    with pytest.raises(errors.ConfigError) as raised:
        _parse(built)
    for problem in problems:
        assert problem in str(raised.value)


def test_check_names_the_webhook_and_masks_the_secret(
    route: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAYPAL_CLIENT_SECRET", CLIENT_SECRET)
    path = tmp_path / "config.yaml"
    built = route(client_secret="${PAYPAL_CLIENT_SECRET}")
    path.write_text(yaml.safe_dump({**BASE, "listen": "127.0.0.1:8080", "routes": [built]}))

    assert cli.main(["check", "--config", str(path)]) == 0

    out = capsys.readouterr().out
    assert f"reconcile paypal events -> webhook {WEBHOOK_ID} every 1h" in out
    assert "secret (masked)" in out
    assert CLIENT_SECRET not in out
