"""The presets of round two (Resend, Clerk, Meta, Linear, Intercom, Twitch, Discord, Zoom, Mailgun,
SendGrid, HubSpot) end
to end: a delivery signed as the provider signs it (by its own library where one is a test
dependency) is forwarded once, a forged, stale or body-swapped one is refused 401 before any
claim, and a handshake is answered by the proxy, once verified, never claimed or forwarded."""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib
import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

import discord_interactions
import nacl.signing
import pytest
import standardwebhooks
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from multidict import CIMultiDict

from proxy.config import presets
from tests.helpers import FakeUpstream, MakeProxy, claimed


def library(name: str) -> Any:
    """A provider's own library from the test extra, imported where a test uses it (so that one
    missing fails its tests, not the module's); these ship no type information."""
    return importlib.import_module(name)


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


# Twitch EventSub: sha256=<hex HMAC-SHA256 of message ID + timestamp + body>, as twitchdev's
# eventsub-webhooks-node-sample computes it (Twitch publishes no library or vector for it).

TWITCH_SECRET = "keepItSecretKeepItSafe"  # the secret of twitchdev's sample
TWITCH_SUBSCRIPTION = {
    "id": "f1c2a387-161a-49f9-a165-0f21d7a4e1c4", "status": "enabled", "type": "channel.follow",
    "version": "2", "condition": {"broadcaster_user_id": "12826"},
    "transport": {"method": "webhook", "callback": "https://example.com/hooks/twitch"},
    "created_at": "2019-11-16T10:11:12.634234626Z",
}  # fmt: skip


def twitch_body(**fields: Any) -> bytes:
    return json.dumps({"subscription": TWITCH_SUBSCRIPTION, **fields}).encode()


def twitch_headers(
    body: bytes, message_id: str, kind: str = "notification", *, age: float = 0.0,
    secret: str = TWITCH_SECRET,
) -> dict[str, str]:  # fmt: skip
    stamp = datetime.fromtimestamp(time.time() - age, UTC).isoformat().replace("+00:00", "Z")
    message = message_id.encode() + stamp.encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return {
        "Twitch-Eventsub-Message-Id": message_id,
        "Twitch-Eventsub-Message-Timestamp": stamp,
        "Twitch-Eventsub-Message-Signature": f"sha256={digest}",
        "Twitch-Eventsub-Message-Type": kind,
        "Twitch-Eventsub-Subscription-Type": "channel.follow",
    }


TWITCH_EVENT = twitch_body(event={"user_id": "1337", "user_login": "awesome_user",
                                  "broadcaster_user_id": "12826"})  # fmt: skip


async def test_twitch_forwards_a_signed_notification_once_and_refuses_forged_stale_and_swapped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("twitch", {"secret": TWITCH_SECRET})])
    swapped = TWITCH_EVENT.replace(b"1337", b"1338")

    await assert_refused(
        client,
        "/hooks/twitch",
        [
            (TWITCH_EVENT, twitch_headers(TWITCH_EVENT, "m-1", secret="guessed-secret")),
            (TWITCH_EVENT, twitch_headers(TWITCH_EVENT, "m-2", age=11 * 60)),
            (swapped, twitch_headers(TWITCH_EVENT, "m-3")),
            # A signed notification relabelled as its subscription's revocation.
            (TWITCH_EVENT, twitch_headers(TWITCH_EVENT, "m-4", "revocation")),
            (TWITCH_EVENT, {"Twitch-Eventsub-Message-Id": "m-5"}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    statuses = await deliver_twice(
        client, "/hooks/twitch", TWITCH_EVENT, twitch_headers(TWITCH_EVENT, "m-6")
    )

    assert statuses == (200, 200)
    assert upstream.bodies() == [TWITCH_EVENT]
    assert await claimed(pg_dsn, table) == [("twitch", "m-6", "channel.follow")]


async def test_twitch_callback_verification_is_answered_with_its_challenge_once_verified(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("twitch", {"secret": TWITCH_SECRET})])
    challenge = "pogchamp-kappa-360noscope-vohiyo"
    body = twitch_body(challenge=challenge)
    kind = "webhook_callback_verification"

    answered = await client.post(
        "/hooks/twitch", data=body, headers=twitch_headers(body, "v-1", kind)
    )
    unsigned = await client.post(
        "/hooks/twitch", data=body, headers={"Twitch-Eventsub-Message-Type": kind}
    )
    forged = await client.post(
        "/hooks/twitch", data=body, headers=twitch_headers(body, "v-2", kind, secret="guessed")
    )
    stale = await client.post(
        "/hooks/twitch", data=body, headers=twitch_headers(body, "v-3", kind, age=3600)
    )
    # A signed verification relabelled as a notification: never forwarded to the app as one.
    relabelled = await client.post("/hooks/twitch", data=body, headers=twitch_headers(body, "v-4"))

    assert answered.status == 200
    assert await answered.text() == challenge
    assert answered.headers["Content-Type"].startswith("text/plain")
    assert answered.headers["Dedup-Status"] == "handshake"
    assert [unsigned.status, forged.status, stale.status, relabelled.status] == [401] * 4
    assert challenge not in await forged.text()
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


async def test_twitch_revocation_is_claimed_and_forwarded_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("twitch", {"secret": TWITCH_SECRET})])
    body = twitch_body().replace(b'"enabled"', b'"authorization_revoked"')

    statuses = await deliver_twice(
        client, "/hooks/twitch", body, twitch_headers(body, "r-1", "revocation")
    )

    assert statuses == (200, 200)
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [("twitch", "r-1", "channel.follow")]


# Discord interactions: Ed25519 over X-Signature-Timestamp + body, signed here with PyNaCl and
# checked both ways with Discord's own discord_interactions.verify_key.


def discord_headers(
    key: nacl.signing.SigningKey, body: bytes, *, age: float = 0.0
) -> dict[str, str]:
    stamp = str(int(time.time() - age))
    signature = key.sign(stamp.encode() + body).signature.hex()
    return {"X-Signature-Ed25519": signature, "X-Signature-Timestamp": stamp}


DISCORD_KEY = nacl.signing.SigningKey(bytes(range(32)))
DISCORD_PUBLIC = DISCORD_KEY.verify_key.encode().hex()
DISCORD_COMMAND = (
    b'{"application_id":"775799577604522054","id":"786008729715212338","token":"A_UNIQUE_TOKEN",'
    b'"type":2,"version":1,"data":{"id":"771825006014889984","name":"blep"}}'
)
DISCORD_PING = b'{"application_id":"775799577604522054","id":"786008729715212339","type":1}'


async def test_discord_forwards_a_signed_interaction_once_and_refuses_forged_stale_and_swapped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("discord", {"secret": DISCORD_PUBLIC})])
    other = nacl.signing.SigningKey(bytes(range(1, 33)))
    swapped = DISCORD_COMMAND.replace(b"blep", b"ban")

    await assert_refused(
        client,
        "/hooks/discord",
        [
            (DISCORD_COMMAND, discord_headers(other, DISCORD_COMMAND)),
            (DISCORD_COMMAND, discord_headers(DISCORD_KEY, DISCORD_COMMAND, age=3600)),
            (swapped, discord_headers(DISCORD_KEY, DISCORD_COMMAND)),
            (DISCORD_COMMAND, {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    headers = discord_headers(DISCORD_KEY, DISCORD_COMMAND)
    first = await client.post("/hooks/discord", data=DISCORD_COMMAND, headers=headers)
    second = await client.post("/hooks/discord", data=DISCORD_COMMAND, headers=headers)

    assert (first.status, second.status) == (200, 200)
    # The app's answer is the interaction's response: a duplicate replays it (the preset's).
    assert await second.read() == await first.read()
    assert upstream.bodies() == [DISCORD_COMMAND]
    assert await claimed(pg_dsn, table) == [("discord", "786008729715212338", "2")]
    # What the proxy accepted, Discord's library accepts; what it refused, the library refuses.
    sent = upstream.requests[0].headers
    assert discord_interactions.verify_key(
        DISCORD_COMMAND, sent["x-signature-ed25519"][0], sent["x-signature-timestamp"][0],
        DISCORD_PUBLIC,
    )  # fmt: skip
    assert not discord_interactions.verify_key(
        swapped, headers["X-Signature-Ed25519"], headers["X-Signature-Timestamp"], DISCORD_PUBLIC
    )


async def test_discord_ping_is_answered_with_a_pong_once_verified_and_never_claimed(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("discord", {"secret": DISCORD_PUBLIC})])
    other = nacl.signing.SigningKey(bytes(range(1, 33)))
    headers = discord_headers(DISCORD_KEY, DISCORD_PING)
    assert discord_interactions.verify_key(
        DISCORD_PING, headers["X-Signature-Ed25519"], headers["X-Signature-Timestamp"],
        DISCORD_PUBLIC,
    )  # fmt: skip

    answered = await client.post("/hooks/discord", data=DISCORD_PING, headers=headers)
    unsigned = await client.post("/hooks/discord", data=DISCORD_PING)
    forged = await client.post(
        "/hooks/discord", data=DISCORD_PING, headers=discord_headers(other, DISCORD_PING)
    )
    stale = await client.post(
        "/hooks/discord", data=DISCORD_PING,
        headers=discord_headers(DISCORD_KEY, DISCORD_PING, age=3600),
    )  # fmt: skip

    assert answered.status == 200
    assert answered.headers["Content-Type"].startswith("application/json")
    assert await answered.json() == {"type": discord_interactions.InteractionResponseType.PONG}
    assert answered.headers["Dedup-Status"] == "handshake"
    assert [unsigned.status, forged.status, stale.status] == [401] * 3
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


def test_a_discord_public_key_that_is_not_64_hex_digits_is_a_configuration_error() -> None:
    from proxy import config
    from proxy.errors import ConfigError

    raw = {
        "database": {"dsn": "postgresql://u@localhost/db"},
        "upstream": {"url": "http://app"},
        "routes": [route("discord", {"secret": DISCORD_PUBLIC[:-2]})],
    }
    with pytest.raises(ConfigError, match=r"routes\[0\]\.verify\.secret: must be the appl"):
        config.parse(raw)


@pytest.mark.parametrize("preset", ["discord", "sendgrid"])
def test_a_public_key_route_is_read_without_its_keys_by_the_commands_that_verify_nothing(
    preset: str,
) -> None:
    from proxy import config, errors

    raw = {
        "database": {"dsn": "postgresql://u@localhost/db"},
        "upstream": {"url": "http://app"},
        "routes": [route(preset, {"secret": "${DEDUP_TEST_NEVER_SET_KEY}"})],
    }
    (unread,) = config.parse(raw, secrets=False).routes
    assert unread.verify is not None
    assert unread.verify.scheme == preset
    with pytest.raises(errors.SignatureInvalid, match="the signing secrets were not read"):
        unread.verify.verify(CIMultiDict(), b"{}", time.time())


# Zoom: x-zm-signature v0=<hex HMAC-SHA256 of "v0:{timestamp}:{body}">, and the
# endpoint.url_validation answered with hex HMAC-SHA256(secret, plainToken), both as Zoom's
# webhook-sample (zoom/webhook-sample, index.js) computes them; Zoom signs JSON.stringify of the
# body, which is the compact JSON built here.

ZOOM_SECRET = "zoom-webhook-secret-token"
ZOOM_ID = "body:/payload/object/uuid"


def zoom_body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def zoom_headers(body: bytes, *, age: float = 0.0, secret: str = ZOOM_SECRET) -> dict[str, str]:
    stamp = str(int(time.time() - age))
    message = f"v0:{stamp}:".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return {"x-zm-request-timestamp": stamp, "x-zm-signature": f"v0={digest}"}


ZOOM_EVENT = zoom_body({
    "event": "meeting.started",
    "payload": {"account_id": "AAAAAABBBB", "object": {"id": "1234567890",
                "uuid": "4444AAAiAAAAAiAiAiiAii==", "topic": "My Meeting", "type": 2}},
    "event_ts": 1635885799302,
})  # fmt: skip


async def test_zoom_forwards_a_signed_event_once_and_refuses_forged_stale_and_swapped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("zoom", {"secret": ZOOM_SECRET}, event_id=ZOOM_ID)])
    swapped = ZOOM_EVENT.replace(b"My Meeting", b"Not Mine")

    await assert_refused(
        client,
        "/hooks/zoom",
        [
            (ZOOM_EVENT, zoom_headers(ZOOM_EVENT, secret="guessed")),
            (ZOOM_EVENT, zoom_headers(ZOOM_EVENT, age=6 * 60)),
            (swapped, zoom_headers(ZOOM_EVENT)),
            (ZOOM_EVENT, {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    statuses = await deliver_twice(client, "/hooks/zoom", ZOOM_EVENT, zoom_headers(ZOOM_EVENT))

    assert statuses == (200, 200)
    assert upstream.bodies() == [ZOOM_EVENT]
    assert await claimed(pg_dsn, table) == [("zoom", "4444AAAiAAAAAiAiAiiAii==", "meeting.started")]


async def test_zoom_url_validation_is_answered_with_the_encrypted_token_once_verified(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    rotated = "the-new-secret-token"
    client = await make_proxy(
        routes=[route("zoom", {"secrets": [ZOOM_SECRET, rotated]}, event_id=ZOOM_ID)]
    )
    token = "qgg8vlvZRS6UYooatFL8Aw"
    body = zoom_body(
        {"payload": {"plainToken": token}, "event_ts": 1654503849680,
         "event": "endpoint.url_validation"}
    )  # fmt: skip

    answered = await client.post("/hooks/zoom", data=body, headers=zoom_headers(body))
    by_rotated = await client.post(
        "/hooks/zoom", data=body, headers=zoom_headers(body, secret=rotated)
    )
    unsigned = await client.post("/hooks/zoom", data=body)
    forged = await client.post("/hooks/zoom", data=body, headers=zoom_headers(body, secret="x"))
    stale = await client.post("/hooks/zoom", data=body, headers=zoom_headers(body, age=3600))

    assert answered.status == 200
    assert answered.headers["Content-Type"].startswith("application/json")
    assert answered.headers["Dedup-Status"] == "handshake"
    expected = hmac.new(ZOOM_SECRET.encode(), token.encode(), hashlib.sha256).hexdigest()
    assert await answered.json() == {"plainToken": token, "encryptedToken": expected}
    # Answered with the secret that signed it, as Zoom checks it against the one it holds.
    again = hmac.new(rotated.encode(), token.encode(), hashlib.sha256).hexdigest()
    assert await by_rotated.json() == {"plainToken": token, "encryptedToken": again}
    assert [unsigned.status, forged.status, stale.status] == [401] * 3
    assert token not in await forged.text()
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


def test_discord_without_cryptography_is_a_configuration_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from proxy import signatures

    monkeypatch.setitem(sys.modules, "cryptography", None)  # as if not installed

    with pytest.raises(ValueError, match=r"install webhook-dedup-proxy\[discord\]"):
        signatures.settings("discord")


# Mailgun: the body's signature object, hex HMAC-SHA256 of timestamp + token with the webhook
# signing key (Mailgun's "securing webhooks" page); the event data is not signed.

MAILGUN_KEY = "key-mailgun-signing"


def mailgun_body(event: str, token: str, *, at: float | None = None, key: str = MAILGUN_KEY,
                 stamp_type: type = str) -> bytes:  # fmt: skip
    stamp = str(int(time.time() if at is None else at))
    signature = hmac.new(key.encode(), (stamp + token).encode(), hashlib.sha256).hexdigest()
    signed = {"timestamp": stamp_type(stamp), "token": token, "signature": signature}
    data = {"event": event, "id": "CPgfbmQMTCKtHW6uIWtuVe", "recipient": "alice@example.com"}
    return json.dumps({"signature": signed, "event-data": data}).encode()


@pytest.mark.parametrize("stamp_type", [str, int])
async def test_mailgun_forwards_a_signed_event_once_and_refuses_forgeries(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, stamp_type: type
) -> None:
    client = await make_proxy(routes=[route("mailgun", {"secret": MAILGUN_KEY})])
    path = "/hooks/mailgun"
    token = "e0b5477167110d68991efc6b9f89f0a11066af27834600e123"
    body = mailgun_body("delivered", token, stamp_type=stamp_type)

    await assert_refused(
        client,
        path,
        [
            (mailgun_body("delivered", token, key="key-guessed"), {}),
            (mailgun_body("delivered", token, at=time.time() - 13 * 3600), {}),  # over 12 h
            (body.replace(token.encode(), b"f" + token[1:].encode()), {}),  # another token
            (json.dumps({"event-data": {"event": "delivered"}}).encode(), {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []
    assert await deliver_twice(client, path, body, {}) == (200, 200)
    # The event data is not signed: another body under the captured signature verifies, and
    # the claim on the signed token makes it a duplicate, never forwarded.
    swapped = body.replace(b'"delivered"', b'"failed"')
    assert (await client.post(path, data=swapped)).headers["Dedup-Status"] == "duplicate"

    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [("mailgun", token, "delivered")]


def test_mailgun_keeps_claims_longer_than_a_signature_stays_fresh() -> None:
    # A captured signature is then a duplicate (within retention) or stale (past tolerance).
    preset = presets.PRESETS["mailgun"]
    assert preset.tolerance is not None
    assert preset.tolerance < preset.retention


# SendGrid's Event Webhook: ECDSA P-256 over timestamp + body under the verification key; the
# proxy's acceptance checked with SendGrid's own EventWebhook (its published vectors, the other
# way, are in tests/test_signatures.py). A POST is a batch, keyed by every sg_event_id in it.

SENDGRID_KEY = ec.derive_private_key(0x5E4D_6121D, ec.SECP256R1())
SENDGRID_PUBLIC = base64.b64encode(
    SENDGRID_KEY.public_key().public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
).decode()


def sendgrid_body(*ids: str) -> bytes:
    events = [{"email": "alice@example.com", "event": "delivered", "sg_event_id": event_id,
               "sg_message_id": "LRzXl_NHStOGhQ4kofSm_A.0", "timestamp": 1600112492}
              for event_id in ids]  # fmt: skip
    return json.dumps(events, separators=(",", ":")).encode() + b"\r\n"


def sendgrid_headers(
    body: bytes, *, age: float = 0.0, key: ec.EllipticCurvePrivateKey = SENDGRID_KEY
) -> dict[str, str]:
    stamp = str(int(time.time() - age))
    signature = key.sign(stamp.encode() + body, ec.ECDSA(hashes.SHA256()))
    return {"X-Twilio-Email-Event-Webhook-Signature": base64.b64encode(signature).decode(),
            "X-Twilio-Email-Event-Webhook-Timestamp": stamp}  # fmt: skip


async def test_sendgrid_forwards_a_signed_batch_once_and_refuses_forged_stale_and_swapped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("sendgrid", {"secret": SENDGRID_PUBLIC})])
    path = "/hooks/sendgrid"
    body = sendgrid_body("ZHJvcC0xMDk5NDkxOS1MUnpYbF9OSFN0T0doUTRrb2ZTbV9BLTA")
    other = ec.derive_private_key(0xBAD, ec.SECP256R1())

    await assert_refused(
        client,
        path,
        [
            (body, sendgrid_headers(body, key=other)),
            (body, sendgrid_headers(body, age=3 * 86400)),  # over the preset's 2 days
            (body.replace(b"delivered", b"bounce"), sendgrid_headers(body)),
            (body, {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    # A retry is signed again (a fresh timestamp): the same batch, a duplicate.
    first = await client.post(path, data=body, headers=sendgrid_headers(body))
    again = await client.post(path, data=body, headers=sendgrid_headers(body, age=60))
    assert (first.status, again.status) == (200, 200)
    assert again.headers["Dedup-Status"] == "duplicate"
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [
        ("sendgrid", "ZHJvcC0xMDk5NDkxOS1MUnpYbF9OSFN0T0doUTRrb2ZTbV9BLTA", None)
    ]
    # What the proxy accepted, SendGrid's library accepts.
    sent = upstream.requests[0].headers
    webhook = library("sendgrid").EventWebhook(SENDGRID_PUBLIC)
    assert webhook.verify_signature(
        body.decode(), sent["x-twilio-email-event-webhook-signature"][0],
        sent["x-twilio-email-event-webhook-timestamp"][0],
    )  # fmt: skip


async def test_sendgrid_batches_are_one_delivery_each_keyed_by_all_their_events(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("sendgrid", {"secret": SENDGRID_PUBLIC})])
    path = "/hooks/sendgrid"
    batch = sendgrid_body("evt-a", "evt-b")
    reordered = sendgrid_body("evt-b", "evt-a")
    regrouped = sendgrid_body("evt-b", "evt-c")

    answers = [
        await client.post(path, data=sent, headers=sendgrid_headers(sent))
        for sent in (batch, reordered, regrouped)
    ]

    # The same events in another order are a copy; a batch with one new event is forwarded.
    assert [answer.status for answer in answers] == [200] * 3
    assert [answer.headers.get("Dedup-Status") for answer in answers] == [None, "duplicate", None]
    assert upstream.bodies() == [batch, regrouped]
    ids = sorted(event_id for _, event_id, _ in await claimed(pg_dsn, table))
    assert len(ids) == 2
    assert all(i.startswith("batch:sha256:") for i in ids)


# HubSpot v3: base64 HMAC-SHA256 of POST + the public URL + body + timestamp (ms), signed here
# by HubSpot's own library (hubspot-api-client), which also checks what the proxy forwarded.

HUBSPOT_SECRET = "yyyyyyyy-yyyy-yyyy-yyyy-yyyyyyyyyyyy"
HUBSPOT_URL = "https://hooks.example.com/hubspot"


def hubspot_body(*event_ids: int, attempt: int = 0) -> bytes:
    events = [{"eventId": event_id, "subscriptionId": 12345, "portalId": 62515,
               "occurredAt": 1564113600000, "subscriptionType": "contact.creation",
               "attemptNumber": attempt, "objectId": 123, "changeSource": "CRM",
               "changeFlag": "NEW", "appId": 54321} for event_id in event_ids]  # fmt: skip
    return json.dumps(events, separators=(",", ":")).encode()


def hubspot_headers(
    body: bytes, *, age: float = 0.0, secret: str = HUBSPOT_SECRET, url: str = HUBSPOT_URL
) -> dict[str, str]:
    stamp = str(int((time.time() - age) * 1000))
    signature = library("hubspot.utils.signature").Signature.get_signature(
        secret, body.decode(), "v3", http_uri=url, http_method="POST", timestamp=stamp
    )
    return {"X-HubSpot-Signature-v3": signature, "X-HubSpot-Request-Timestamp": stamp}


async def test_hubspot_forwards_a_signed_batch_once_and_refuses_forged_stale_and_swapped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    verify = {"secret": HUBSPOT_SECRET, "public_url": HUBSPOT_URL}
    client = await make_proxy(routes=[route("hubspot", verify)])
    path = "/hooks/hubspot"
    body = hubspot_body(1)

    await assert_refused(
        client,
        path,
        [
            (body, hubspot_headers(body, secret="guessed")),
            (body, hubspot_headers(body, age=600)),  # HubSpot's 5 minutes
            (body.replace(b'"objectId":123', b'"objectId":124'), hubspot_headers(body)),
            (body, hubspot_headers(body, url="https://elsewhere.example.com/hubspot")),
            (body, {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    # A retry is another body (attemptNumber) signed again: the same event, a duplicate.
    retry = hubspot_body(1, attempt=1)
    first = await client.post(path, data=body, headers=hubspot_headers(body))
    again = await client.post(path, data=retry, headers=hubspot_headers(retry))
    assert (first.status, again.status) == (200, 200)
    assert again.headers["Dedup-Status"] == "duplicate"
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [("hubspot", "62515:12345:1", None)]
    # What the proxy accepted, HubSpot's library accepts (it reads the clock: within 5 min).
    sent = upstream.requests[0].headers
    assert library("hubspot.utils.signature").Signature.is_valid(
        sent["x-hubspot-signature-v3"][0], HUBSPOT_SECRET, body.decode(), http_uri=HUBSPOT_URL,
        signature_version="v3", timestamp=sent["x-hubspot-request-timestamp"][0],
    )  # fmt: skip


# Adyen: each NotificationRequestItem's key fields joined by ":", base64 HMAC-SHA256 under a
# hex key, signed here by Adyen's own library (Adyen.util), which also checks what the proxy
# forwarded. Nothing signed ages: a replay is refused only as a duplicate.

ADYEN_KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"


def adyen_item(psp: str, code: str = "AUTHORISATION", success: str = "true") -> dict[str, Any]:
    item: dict[str, Any] = {
        "pspReference": psp, "merchantReference": "order-42", "merchantAccountCode": "Shop",
        "amount": {"currency": "EUR", "value": 1130}, "eventCode": code, "success": success,
        "eventDate": "2026-12-06T09:00:00+01:00", "reason": "039404:1111:03/2030",
    }  # fmt: skip
    signature = library("Adyen.util").generate_notification_sig(item, ADYEN_KEY).decode()
    return {**item, "additionalData": {"hmacSignature": signature, "authCode": "039404"}}


def adyen_body(*items: dict[str, Any]) -> bytes:
    wrapped = [{"NotificationRequestItem": item} for item in items]
    return json.dumps({"live": "false", "notificationItems": wrapped}).encode()


async def test_adyen_forwards_a_signed_notification_once_and_refuses_forged_and_swapped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("adyen", {"secret": ADYEN_KEY})])
    path = "/hooks/adyen"
    item = adyen_item("7914073381342284")
    body = adyen_body(item)
    guessed = library("Adyen.util").generate_notification_sig(item, "00" * 32).decode()
    forged = {**item, "additionalData": {"hmacSignature": guessed}}

    await assert_refused(
        client,
        path,
        [
            (adyen_body(forged), {}),
            (body.replace(b'"value": 1130', b'"value": 11300'), {}),  # a signed field
            (body.replace(b"7914073381342284", b"7914073381342285"), {}),  # the event's key
            (adyen_body(item, {**item, "pspReference": "7914073381342299"}), {}),
            (b'{"live": "false"}', {}),
        ],
    )
    assert await claimed(pg_dsn, table) == []

    assert await deliver_twice(client, path, body, {}) == (200, 200)
    # The unsigned rest of the body under the captured signature: a duplicate, never forwarded.
    swapped = body.replace(b'"authCode": "039404"', b'"authCode": "999999"')
    assert (await client.post(path, data=swapped)).headers["Dedup-Status"] == "duplicate"
    # An AUTHORISATION that failed and one that succeeded are two events.
    failed = adyen_body(adyen_item("7914073381342284", success="false"))
    assert (await client.post(path, data=failed)).status == 200

    assert upstream.bodies() == [body, failed]
    assert sorted(await claimed(pg_dsn, table)) == [
        ("adyen", "7914073381342284:AUTHORISATION:false", "AUTHORISATION"),
        ("adyen", "7914073381342284:AUTHORISATION:true", "AUTHORISATION"),
    ]
    # What the proxy accepted, Adyen's library accepts.
    assert library("Adyen.util").is_valid_hmac_notification(
        json.loads(upstream.bodies()[0]), ADYEN_KEY
    )


def test_adyen_keeps_claims_through_its_30_days_of_retries() -> None:
    assert presets.PRESETS["adyen"].retention > 30 * 86400
