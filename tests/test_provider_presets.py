"""The presets of round two (Resend, Clerk, Meta, Linear, Intercom) end to end: a delivery signed
as the provider signs it (by its own library where one is a test dependency) is forwarded once,
a forged, stale or body-swapped one is refused 401 before any claim, and a handshake is answered
by the proxy, never claimed or forwarded."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import standardwebhooks

from proxy.config import presets
from tests.helpers import FakeUpstream, MakeProxy, claimed

SVIX_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
META_SECRET = "meta-app-secret"
META_TOKEN = "meatyhamhock"  # the verify token of Meta's getting-started page
LINEAR_SECRET = "lin_wh_secret"
INTERCOM_SECRET = "intercom-client-secret"


def route(preset: str, verify: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": preset, "path": f"/hooks/{preset}", "preset": preset, "verify": verify,
            **extra}  # fmt: skip


async def deliver_twice(
    client: Any, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, int]:
    first = await client.post(path, data=body, headers=headers)
    second = await client.post(path, data=body, headers=headers)
    return first.status, second.status


async def assert_refused(
    client: Any, path: str, requests: list[tuple[bytes, dict[str, str]]]
) -> None:
    for body, headers in requests:
        response = await client.post(path, data=body, headers=headers)
        assert response.status == 401, headers
        assert (await response.json())["error"] == "signature_invalid"


# Resend and Clerk: Svix underneath, signed here by the standardwebhooks package and sent under
# Svix's header names, as Resend's and Clerk's deliveries are.


def svix_headers(body: bytes, msg_id: str, *, at: float | None = None) -> dict[str, str]:
    stamp = int(time.time() if at is None else at)
    signature = standardwebhooks.Webhook(SVIX_SECRET).sign(
        msg_id, datetime.fromtimestamp(stamp, UTC), body.decode()
    )
    return {"svix-id": msg_id, "svix-timestamp": str(stamp), "svix-signature": signature}


@pytest.mark.parametrize(
    ("preset", "body"),
    [
        ("resend", b'{"type":"email.delivered","data":{"email_id":"4ef9a417"}}'),
        ("clerk", b'{"type":"user.created","object":"event","data":{"id":"user_29w83"}}'),
    ],
)
async def test_resend_and_clerk_forward_a_svix_signed_event_once_and_refuse_forgeries(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, preset: str, body: bytes
) -> None:
    client = await make_proxy(routes=[route(preset, {"secret": SVIX_SECRET})])
    path = f"/hooks/{preset}"
    swapped = body.replace(b'"data"', b'"data","x":1')
    forged = svix_headers(body, "msg_forged")
    forged["svix-signature"] = "v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="

    await assert_refused(
        client,
        path,
        [
            (body, forged),
            (body, svix_headers(body, "msg_stale", at=time.time() - 3600)),
            (swapped, svix_headers(body, "msg_swapped")),
            (body, {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []
    assert await deliver_twice(client, path, body, svix_headers(body, "msg_2a")) == (200, 200)

    assert upstream.bodies() == [body]
    event_type = json.loads(body)["type"]
    assert await claimed(pg_dsn, table) == [(preset, "msg_2a", event_type)]
    # What the proxy accepted, the library accepts.
    sent = upstream.requests[0].headers
    names = ("id", "timestamp", "signature")
    webhook_headers = {f"webhook-{name}": sent[f"svix-{name}"][0] for name in names}
    assert standardwebhooks.Webhook(SVIX_SECRET).verify(body, webhook_headers) == json.loads(body)


# Meta: X-Hub-Signature-256 over the body with the app secret; the subscription check is a GET.

META_BODY = (
    b'{"object":"whatsapp_business_account","entry":[{"id":"102290129340398","changes":[{"field":'
    b'"messages","value":{"messages":[{"id":"wamid.HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTA'
    b'zRTU2NjEA","type":"text"}]}}]}]}'
)
META_ID = "body:/entry/0/changes/0/value/messages/0/id"


def meta_headers(body: bytes, secret: str = META_SECRET) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"X-Hub-Signature-256": f"sha256={digest}"}


async def test_meta_forwards_a_signed_notification_once_and_refuses_forgeries(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(
        routes=[
            route("meta", {"secret": META_SECRET, "verify_token": META_TOKEN}, event_id=META_ID)
        ]
    )
    swapped = META_BODY.replace(b"text", b"image")
    await assert_refused(
        client,
        "/hooks/meta",
        [
            (META_BODY, meta_headers(META_BODY, "not-the-secret")),
            (swapped, meta_headers(META_BODY)),
            (META_BODY, {}),
            (META_BODY, {"X-Hub-Signature": "sha1=" + "0" * 40}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    statuses = await deliver_twice(client, "/hooks/meta", META_BODY, meta_headers(META_BODY))

    assert statuses == (200, 200)
    assert upstream.bodies() == [META_BODY]
    wamid = "wamid.HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTAzRTU2NjEA"
    assert await claimed(pg_dsn, table) == [("meta", wamid, None)]


async def test_meta_subscription_check_is_answered_by_the_proxy_and_never_claimed(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(
        routes=[
            route(
                "meta",
                {"secret": META_SECRET, "verify_token": ["rotated-token", META_TOKEN]},
                event_id=META_ID,
            )
        ]
    )
    check = "/hooks/meta?hub.mode=subscribe&hub.challenge=1158201444&hub.verify_token="

    answered = await client.get(check + META_TOKEN)
    wrong = await client.get(check + "guessed")
    bare = await client.get("/hooks/meta")
    twice = await client.get(check + META_TOKEN + "&hub.challenge=2")
    unsubscribe = await client.get(check.replace("subscribe", "unsubscribe") + META_TOKEN)

    assert answered.status == 200
    assert await answered.text() == "1158201444"
    assert answered.headers["Content-Type"].startswith("text/plain")
    assert answered.headers["Dedup-Status"] == "handshake"
    assert wrong.status == 401
    assert "1158201444" not in await wrong.text()
    assert bare.status == 405  # a GET that is no subscription check: not the route's method
    assert twice.status == 401
    assert unsubscribe.status == 401
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


async def test_meta_without_a_verify_token_answers_no_subscription_check(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    client = await make_proxy(routes=[route("meta", {"secret": META_SECRET}, event_id=META_ID)])

    response = await client.get(
        "/hooks/meta?hub.mode=subscribe&hub.challenge=1&hub.verify_token=anything"
    )

    assert response.status == 401
    assert upstream.requests == []


def test_the_meta_preset_needs_the_route_to_name_its_event_id() -> None:
    from proxy import config
    from proxy.errors import ConfigError

    raw = {
        "database": {"dsn": "postgresql://u@localhost/db"},
        "upstream": {"url": "http://app"},
        "routes": [route("meta", {"secret": META_SECRET})],
    }
    with pytest.raises(ConfigError, match=r"routes\[0\]\.event_id: is required"):
        config.parse(raw)
    assert presets.PRESETS["meta"].event_id == ()


# Linear: hex HMAC-SHA256 of the body in Linear-Signature, webhookTimestamp (ms) within a minute,
# as @linear/sdk's LinearWebhookClient.verify computes them.


def linear_body(at_ms: int, title: str = "Fix it") -> bytes:
    payload = {"action": "create", "type": "Issue", "data": {"id": "9c1f", "title": title},
               "webhookTimestamp": at_ms}  # fmt: skip
    return json.dumps(payload).encode()


def linear_headers(body: bytes, delivery: str, secret: str = LINEAR_SECRET) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"Linear-Signature": digest, "Linear-Delivery": delivery, "Linear-Event": "Issue"}


async def test_linear_forwards_a_signed_event_once_and_refuses_forged_stale_and_swapped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("linear", {"secret": LINEAR_SECRET})])
    now_ms = int(time.time() * 1000)
    body = linear_body(now_ms)
    stale = linear_body(now_ms - 61_000)
    swapped = linear_body(now_ms, title="Delete it")

    await assert_refused(
        client,
        "/hooks/linear",
        [
            (body, linear_headers(body, "d-1", "guessed")),
            (stale, linear_headers(stale, "d-2")),
            (swapped, linear_headers(body, "d-3")),
            (body, {"Linear-Delivery": "d-4"}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    statuses = await deliver_twice(client, "/hooks/linear", body, linear_headers(body, "d-5"))

    assert statuses == (200, 200)
    assert upstream.bodies() == [body]
    assert [row[0] for row in await claimed(pg_dsn, table)] == ["linear"]


# Intercom: X-Hub-Signature: sha1=<hex HMAC-SHA1 of the body>; the example body of Intercom's
# "Signed Notifications" page.

INTERCOM_BODY = (
    b'{"type":"notification_event","id":"notif_78c122d0-23ba-11e4-9464-79b01267cc2e",'
    b'"topic":"user.created","app_id":"a86dr8yl","data":{"type":"notification_event_data",'
    b'"item":{"type":"user","id":"530370b477ad7120001d","user_id":"25"}}}'
)


def intercom_headers(body: bytes, secret: str = INTERCOM_SECRET) -> dict[str, str]:
    return {"X-Hub-Signature": "sha1=" + hmac.new(secret.encode(), body, "sha1").hexdigest()}


async def test_intercom_forwards_a_signed_notification_once_and_refuses_forgeries(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("intercom", {"secret": INTERCOM_SECRET})])
    swapped = INTERCOM_BODY.replace(b"user.created", b"user.deleted")
    sha256 = hmac.new(INTERCOM_SECRET.encode(), INTERCOM_BODY, hashlib.sha256).hexdigest()

    await assert_refused(
        client,
        "/hooks/intercom",
        [
            (INTERCOM_BODY, intercom_headers(INTERCOM_BODY, "guessed")),
            (swapped, intercom_headers(INTERCOM_BODY)),
            (INTERCOM_BODY, {"X-Hub-Signature": f"sha256={sha256}"}),
            (INTERCOM_BODY, {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    statuses = await deliver_twice(
        client, "/hooks/intercom", INTERCOM_BODY, intercom_headers(INTERCOM_BODY)
    )

    assert statuses == (200, 200)
    assert upstream.bodies() == [INTERCOM_BODY]
    assert await claimed(pg_dsn, table) == [
        ("intercom", "notif_78c122d0-23ba-11e4-9464-79b01267cc2e", "user.created")
    ]
