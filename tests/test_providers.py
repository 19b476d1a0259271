"""Presets, signature checks before the claim, payload mismatch, and start-up safety checks."""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from proxy import app_keys, cli, config, errors, webhooks
from tests.helpers import (
    STRIPE_SECRET,
    FakeUpstream,
    MakeProxy,
    claimed,
    event,
    logged_errors,
    run_cli,
    stripe_headers,
    stripe_route,
)

SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"


async def test_signed_delivery_is_processed_and_forwarded_byte_exact(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[stripe_route()])
    body = event("evt_signed")

    response = await client.post("/webhooks/stripe", data=body, headers=stripe_headers(body))

    assert response.status == 200
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [("stripe", "evt_signed", "charge.succeeded")]


async def test_forged_request_cannot_squat_an_event_id(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[stripe_route()])
    forged = event("evt_victim", amount=1)

    rejected = await client.post(
        "/webhooks/stripe", data=forged, headers=stripe_headers(forged, secret="whsec_guess")
    )
    unsigned = await client.post("/webhooks/stripe", data=forged)

    assert rejected.status == 401
    assert (await rejected.json())["error"] == "signature_invalid"
    assert unsigned.status == 401
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []
    # The real delivery is processed, not answered "duplicate".
    real = event("evt_victim", amount=100)
    response = await client.post("/webhooks/stripe", data=real, headers=stripe_headers(real))
    assert response.status == 200
    assert "Dedup-Status" not in response.headers
    assert upstream.bodies() == [real]


async def test_stale_signature_is_refused(make_proxy: MakeProxy, upstream: FakeUpstream) -> None:
    client = await make_proxy(routes=[stripe_route()])
    body = event("evt_replayed")

    old = stripe_headers(body, at=int(time.time()) - 3600)
    response = await client.post("/webhooks/stripe", data=body, headers=old)

    assert response.status == 401
    assert upstream.requests == []


async def test_secret_rotation_accepts_either_secret(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    client = await make_proxy(
        routes=[stripe_route(verify={"secrets": ["whsec_new_one", STRIPE_SECRET]})]
    )
    body = event("evt_rotated")
    response = await client.post("/webhooks/stripe", data=body, headers=stripe_headers(body))
    assert response.status == 200
    assert len(upstream.requests) == 1


async def test_github_preset_keys_by_hook_and_delivery(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    secret = "It's a Secret to Everybody"
    client = await make_proxy(
        routes=[
            {
                "name": "github",
                "path": "/webhooks/github",
                "preset": "github",
                "verify": {"secret": secret},
            }
        ]
    )
    body = b'{"zen": "Keep it logically awesome."}'
    signature = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()

    async def deliver(hook_id: str) -> int:
        response = await client.post(
            "/webhooks/github",
            data=body,
            headers={
                "X-GitHub-Delivery": "72d3162e-cc78-11e3-81ab-4c9367dc0958",
                "X-GitHub-Hook-ID": hook_id,
                "X-GitHub-Event": "ping",
                "X-Hub-Signature-256": signature,
            },
        )
        return response.status

    assert [await deliver("111"), await deliver("222"), await deliver("111")] == [200] * 3

    # One delivery GUID, two hooks: two events; the third call is a duplicate. The claims are
    # bound to the signed body (the GUID is not signed: see webhooks.bound).
    sha = hashlib.sha256(body).digest()
    assert len(upstream.requests) == 2
    assert await claimed(pg_dsn, table) == [
        ("github", webhooks.bound("111:72d3162e-cc78-11e3-81ab-4c9367dc0958", "", sha), "ping"),
        ("github", webhooks.bound("222:72d3162e-cc78-11e3-81ab-4c9367dc0958", "", sha), "ping"),
    ]


async def test_slack_handshake_without_event_id_is_forwarded_unclaimed(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(
        routes=[
            {
                "name": "slack",
                "path": "/slack/events",
                "preset": "slack",
                "verify": {"secret": SLACK_SECRET},
            }
        ]
    )
    body = b'{"token": "t", "challenge": "3eZbrw1aBm2rZgRN", "type": "url_verification"}'

    def signed(payload: bytes) -> dict[str, str]:
        timestamp = str(int(time.time()))
        base = f"v0:{timestamp}:".encode() + payload
        digest = hmac.new(SLACK_SECRET.encode(), base, hashlib.sha256).hexdigest()
        return {"X-Slack-Request-Timestamp": timestamp, "X-Slack-Signature": f"v0={digest}"}

    handshake = await client.post("/slack/events", data=body, headers=signed(body))
    unsigned = await client.post("/slack/events", data=body)

    assert handshake.status == 200
    assert unsigned.status == 401
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == []
    mention = b'{"event_id": "Ev123", "event": {"type": "app_mention"}}'
    for _ in range(2):
        response = await client.post("/slack/events", data=mention, headers=signed(mention))
        assert response.status == 200
    assert upstream.bodies() == [body, mention]
    assert await claimed(pg_dsn, table) == [("slack", "Ev123", "app_mention")]


async def test_duplicate_with_another_body_is_answered_200_and_logged_as_mismatch(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_proxy()
    await client.post("/webhooks/corvel", data=b'{"id": "evt_m", "amount": 1}')

    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        same = await client.post("/webhooks/corvel", data=b'{"id": "evt_m", "amount": 1}')
        other = await client.post("/webhooks/corvel", data=b'{"id": "evt_m", "amount": 999}')

    assert [same.status, other.status] == [200, 200]
    assert other.headers["Dedup-Status"] == "duplicate"
    assert len(upstream.requests) == 1
    lines = [(r.levelno, r.fields) for r in caplog.records if hasattr(r, "fields")]
    assert [(level, f.get("mismatch", False)) for level, f in lines] == [
        (logging.INFO, False),
        (logging.WARNING, True),
    ]


async def test_duplicate_json_keys_are_refused(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_proxy()
    response = await client.post("/webhooks/corvel", data=b'{"id": "evt_a", "id": "evt_b"}')
    assert response.status == 400
    assert "duplicate JSON key" in logged_errors(caplog)[0]
    assert upstream.requests == []


def test_explicit_route_settings_win_over_the_preset() -> None:
    cfg = config.parse(
        {
            "upstream": {"url": "http://127.0.0.1:3000"},
            "database": {"dsn": "embedded"},
            "routes": [
                {"name": "s", "path": "/s", "preset": "stripe", "event_id": "header:X-Id"},
                {"name": "t", "path": "/t", "preset": "stripe", "retention": "10d"},
            ],
        }
    )
    explicit, default = cfg.routes
    assert str(explicit.event_id) == "header:X-Id"
    assert str(explicit.event_type) == "body:/type"
    assert explicit.retention == 4 * 86400  # covers Stripe's 3 days of retries
    assert default.retention == 10 * 86400
    assert explicit.verify is None


@pytest.mark.parametrize(
    ("route", "problem"),
    [
        ({"preset": "stripes"}, "routes[0].preset: must be one of stripe, github"),
        (
            {"event_id": "body:/id", "verify": {"secret": "x"}},
            "routes[0].verify.scheme: is required",
        ),
        (
            {"preset": "square", "verify": {"secret": "x"}},
            "routes[0].verify: public_url is required for scheme square",
        ),
        (
            {
                "preset": "paypal",
                "verify": {"secret": "x", "cert_hosts": ["https://api.paypal.com"]},
            },
            "routes[0].verify: cert_hosts[0] must be a host name or host:port",
        ),
        (
            {"preset": "paypal", "verify": {"secret": "x", "ca_file": "ca.pem"}},
            "routes[0].verify.ca_file: must be an absolute path, got 'ca.pem'",
        ),
        ({"preset": "stripe", "verify": {}}, "routes[0].verify.secret: is required"),
        (
            {"preset": "stripe", "verify": {"secret": "a", "secrets": ["b"]}},
            "routes[0].verify: give either secret or secrets, not both",
        ),
        (
            {"event_id": ["body:/id"]},
            "routes[0].event_id: a composite event_id needs at least two sources",
        ),
        ({"preset": "stripe", "missing_id": "drop"}, "routes[0].missing_id: must be one of"),
    ],
)
def test_preset_and_verify_problems(route: dict[str, Any], problem: str) -> None:
    raw = {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "embedded"},
        "routes": [{"name": "r", "path": "/r", **route}],
    }
    with pytest.raises(errors.ConfigError) as info:
        config.parse(raw)
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


def test_secrets_come_from_the_environment_and_never_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STRIPE_WEBHOOK_SECRET", "whsec_very_secret_value")
    path = tmp_path / "config.yaml"
    path.write_text(
        "upstream: {url: 'http://127.0.0.1:3000'}\n"
        "database: {dsn: 'postgresql://app:dbpassword@127.0.0.1/db'}\n"
        "routes:\n"
        "  - {name: stripe, path: /s, preset: stripe,"
        " verify: {secrets: ['${STRIPE_WEBHOOK_SECRET}']}}\n"
    )
    assert cli.main(["check", "--config", str(path)]) == 0
    cfg = config.load(path)

    printed = capsys.readouterr().out
    assert "verify stripe" in printed
    for secret in ("whsec_very_secret_value", "dbpassword"):
        assert secret not in printed
        assert secret not in repr(cfg)


async def test_refuses_to_start_without_the_c_http_parser(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "upstream: {url: 'http://127.0.0.1:9'}\n"
        "database: {dsn: 'postgresql://nobody@127.0.0.1:1/none'}\n"
        "routes: [{name: a, path: /a, event_id: 'body:/id'}]\n"
    )
    code, stdout, stderr = await run_cli(
        "serve", "--config", str(path), env={"AIOHTTP_NO_EXTENSIONS": "1"}
    )

    assert code == 1
    assert "C HTTP parser is not in use" in stdout
    assert "Traceback" not in stdout + stderr


@pytest.mark.parametrize(
    ("preset", "signed_set", "claimed_set"),
    [
        ("standard-webhooks", "svix", "webhook"),
        ("svix", "webhook", "svix"),
    ],
)
async def test_a_signed_message_resent_under_a_forged_id_is_refused(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    preset: str,
    signed_set: str,
    claimed_set: str,
) -> None:
    secret = "whsec_" + base64.b64encode(b"standard-webhooks-test-key").decode()
    client = await make_proxy(
        routes=[{"name": "sw", "path": "/sw", "preset": preset, "verify": {"secret": secret}}]
    )
    body = b'{"type": "invoice.paid"}'
    stamp = str(int(time.time()))
    mac = hmac.new(b"standard-webhooks-test-key", f"msg_1.{stamp}.".encode() + body, "sha256")
    headers = {
        f"{signed_set}-id": "msg_1",
        f"{signed_set}-timestamp": stamp,
        f"{signed_set}-signature": "v1," + base64.b64encode(mac.digest()).decode(),
    }

    genuine = await client.post("/sw", data=body, headers={**headers, f"{claimed_set}-id": "msg_1"})
    forged = [
        await client.post("/sw", data=body, headers={**headers, f"{claimed_set}-id": f"forged-{n}"})
        for n in (1, 2)
    ]

    assert genuine.status == 200
    assert [response.status for response in forged] == [401, 401]
    assert len(upstream.requests) == 1
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["msg_1"]


async def test_a_signature_header_named_in_connection_is_refused(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[stripe_route()])
    body = event("evt_conn")

    response = await client.post(
        "/webhooks/stripe",
        data=body,
        headers={**stripe_headers(body), "Connection": "x, stripe-signature"},
    )

    assert response.status == 400
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


GITHUB_SECRET = "It's a Secret to Everybody"


def github_route(**extra: Any) -> dict[str, Any]:
    return {
        "name": "github",
        "path": "/webhooks/github",
        "preset": "github",
        "verify": {"secret": GITHUB_SECRET},
        **extra,
    }


def github_headers(body: bytes, delivery: str) -> dict[str, str]:
    signature = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-GitHub-Delivery": delivery,
        "X-GitHub-Hook-ID": "111",
        "X-GitHub-Event": "push",
        "X-Hub-Signature-256": f"sha256={signature}",
        "Content-Type": "application/json",
    }


def github_payload(size: int) -> bytes:
    """A JSON body of exactly ``size`` bytes."""
    head, tail = b'{"zen": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def test_a_preset_with_a_documented_cap_sets_the_default_max_body() -> None:
    cfg = config.parse(
        {
            "upstream": {"url": "http://127.0.0.1:3000"},
            "database": {"dsn": "embedded"},
            "max_body": "2MiB",
            "routes": [
                {"name": "gh", "path": "/gh", "preset": "github"},
                {"name": "small", "path": "/small", "preset": "github", "max_body": "1MiB"},
                {"name": "s", "path": "/s", "preset": "stripe"},
            ],
        }
    )
    github, explicit, stripe = cfg.routes
    # GitHub caps payloads at "25 MB"; read as MiB, the larger reading.
    assert github.max_body == 25 * 1024 * 1024
    assert explicit.max_body == 1024 * 1024
    assert stripe.max_body == 2 * 1024 * 1024  # no documented cap: the global max_body


async def test_a_github_payload_over_the_global_max_body_is_accepted(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[github_route()])
    body = github_payload(20_000_000)  # under GitHub's cap, over the global 1 MiB default

    response = await client.post(
        "/webhooks/github", data=io.BytesIO(body), headers=github_headers(body, "d-large")
    )

    assert response.status == 200
    assert len(upstream.requests) == 1
    assert upstream.requests[0].body == body
    bound = webhooks.bound("111:d-large", "", hashlib.sha256(body).digest())
    assert await claimed(pg_dsn, table) == [("github", bound, "push")]


async def test_an_explicit_route_max_body_wins_over_the_preset_cap(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[github_route(max_body="1MiB")])
    body = github_payload(2 * 1024 * 1024)

    response = await client.post(
        "/webhooks/github", data=io.BytesIO(body), headers=github_headers(body, "d-over")
    )

    assert response.status == 413
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


SHOPIFY_SECRET = "shpss_test_secret"


@pytest.mark.parametrize(
    ("preset", "signed"),
    [
        ("stripe", True),
        ("paddle", True),
        ("slack", True),
        ("standard-webhooks", True),
        ("svix", True),
        ("github", False),
        ("shopify", False),
    ],
)
def test_which_presets_sign_the_event_id(preset: str, signed: bool) -> None:
    secret = "whsec_" + base64.b64encode(b"k" * 24).decode()
    cfg = config.parse(
        {
            "upstream": {"url": "http://127.0.0.1:3000"},
            "database": {"dsn": "embedded"},
            "routes": [
                {"name": "r", "path": "/r", "preset": preset, "verify": {"secret": secret}},
                {"name": "u", "path": "/u", "preset": preset},
            ],
        }
    )
    verified, unverified = cfg.routes
    assert verified.id_signed is signed
    assert unverified.id_signed is False  # nothing is signed without verify


async def test_a_signed_body_resent_under_another_id_is_logged(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_proxy(
        routes=[
            {
                "name": "shopify",
                "path": "/webhooks/shopify",
                "preset": "shopify",
                "verify": {"secret": SHOPIFY_SECRET},
            }
        ]
    )

    async def deliver(body: bytes, event_id: str) -> int:
        digest = hmac.new(SHOPIFY_SECRET.encode(), body, hashlib.sha256).digest()
        response = await client.post(
            "/webhooks/shopify",
            data=body,
            headers={
                "X-Shopify-Event-Id": event_id,
                "X-Shopify-Topic": "orders/paid",
                "X-Shopify-Hmac-SHA256": base64.b64encode(digest).decode(),
            },
        )
        return response.status

    captured, other = b'{"order": 1, "total": "100.00"}', b'{"order": 2}'
    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        statuses = [
            await deliver(captured, "e1"),
            await deliver(captured, "e1"),  # the provider's retry: a duplicate, no warning
            await deliver(captured, "forged-2"),  # the captured body under a new ID
            await deliver(other, "e3"),
        ]

    # The signature is valid, so the proxy cannot tell a replay from a redelivery under a new
    # ID: it forwards it, and says so.
    assert statuses == [200] * 4
    assert len(upstream.requests) == 3
    lines = [(r.levelno, r.fields) for r in caplog.records if hasattr(r, "fields")]
    assert [(level, f["event_id"], f.get("body_claimed_as")) for level, f in lines] == [
        (logging.INFO, "e1", None),
        (logging.INFO, "e1", None),
        (logging.WARNING, "forged-2", "e1"),
        (logging.INFO, "e3", None),
    ]
    registry = client.app[app_keys.METRICS].registry
    assert registry.get_sample_value("dedup_reused_bodies_total", {"route": "shopify"}) == 1


def test_recent_bodies_remember_the_last_ids_only() -> None:
    recent = webhooks.RecentBodies(capacity=2)
    assert recent.claimed("s", b"a", "1") is None
    assert recent.claimed("s", b"b", "2") is None
    assert recent.claimed("t", b"a", "9") is None  # another scope is another ID space
    assert recent.claimed("s", b"a", "3") is None  # forgotten: capacity 2
    assert recent.claimed("t", b"a", "4") == "9"
    assert recent.claimed("t", b"a", "4") is None  # the same ID again: a redelivery
