"""Through the proxy: the twilio preset (public_url, query, replay) and a preset's claim_wait."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from proxy import webhooks
from tests.helpers import FakeUpstream, MakeProxy, claimed

TOKEN = "12345678901234567890123456789012"
PUBLIC = "https://hooks.example.com/twilio/voice"
TWIML = b'<?xml version="1.0" encoding="UTF-8"?><Response><Say>Hi</Say></Response>'


def twilio_route(**extra: Any) -> dict[str, Any]:
    return {
        "name": "twilio",
        "path": "/twilio/voice",
        "preset": "twilio",
        "verify": {"secret": TOKEN, "public_url": PUBLIC},
        **extra,
    }


def claim_id(token: str, query: str, body: bytes) -> str:
    return webhooks.bound(token, query, hashlib.sha256(body).digest())


def twilio_headers(query: str, params: dict[str, str], token: str = "idem-1") -> dict[str, str]:
    signed = (f"{PUBLIC}?{query}" if query else PUBLIC) + "".join(
        k + v for k, v in sorted(params.items())
    )
    mac = hmac.new(TOKEN.encode(), signed.encode(), hashlib.sha1).digest()
    return {
        "X-Twilio-Signature": base64.b64encode(mac).decode(),
        "I-Twilio-Idempotency-Token": token,
        "Content-Type": "application/x-www-form-urlencoded",
    }


async def test_twilio_call_is_verified_over_public_url_and_query_and_replayed(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(body=TWIML, content_type="text/xml")
    client = await make_proxy(routes=[twilio_route()])
    params = {"CallSid": "CA1", "From": "+14158675310", "CallStatus": "ringing"}
    body = urlencode(params).encode()
    query = "tenant=acme"

    first = await client.post(
        f"/twilio/voice?{query}", data=body, headers=twilio_headers(query, params)
    )
    again = await client.post(
        f"/twilio/voice?{query}", data=body, headers=twilio_headers(query, params)
    )
    moved = await client.post(
        "/twilio/voice?tenant=globex", data=body, headers=twilio_headers(query, params)
    )

    assert first.status == 200
    assert await first.read() == TWIML
    assert (again.status, await again.read()) == (200, TWIML)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert moved.status == 401
    assert upstream.bodies() == [body]
    # Bound to what is signed: the token is not (see webhooks.bound).
    assert await claimed(pg_dsn, table) == [("twilio", claim_id("idem-1", query, body), None)]


async def test_slack_copy_waits_the_preset_claim_wait_not_the_global_one(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    secret = "8f742231b10e8888abcd99yyyzzz85a5"
    upstream.gate = asyncio.Event()
    client = await make_proxy(
        claim_wait="1h",
        routes=[
            {"name": "slack", "path": "/slack", "preset": "slack", "verify": {"secret": secret}}
        ],
    )
    event = b'{"event_id": "Ev1", "event": {"type": "app_mention"}}'

    def signed() -> dict[str, str]:
        import time

        stamp = str(int(time.time()))
        mac = hmac.new(secret.encode(), f"v0:{stamp}:".encode() + event, hashlib.sha256)
        return {"X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": f"v0={mac.hexdigest()}"}

    first = asyncio.create_task(client.post("/slack", data=event, headers=signed()))
    await upstream.arrived.wait()
    # With the global 1h the copy would outlive the test's timeout; the preset's 2s answers it.
    copy = await asyncio.wait_for(client.post("/slack", data=event, headers=signed()), 30)
    assert copy.status == 503
    assert (await copy.json())["error"] == "claim_wait_exceeded"
    upstream.gate.set()
    assert (await first).status == 200


async def test_a_request_signed_by_twilios_library_is_claimed_and_a_tampered_one_is_not(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    from twilio.request_validator import RequestValidator

    upstream.respond = lambda n: web.Response(body=TWIML, content_type="text/xml")
    client = await make_proxy(routes=[twilio_route()])
    params = {"MessageSid": "SM1", "Body": "hello", "From": "+14158675310"}
    signature = RequestValidator(TOKEN).compute_signature(PUBLIC, params)
    headers = {
        "X-Twilio-Signature": signature,
        "I-Twilio-Idempotency-Token": "idem-lib",
        "Content-Type": "application/x-www-form-urlencoded",
    }

    tampered = await client.post(
        "/twilio/voice", data=urlencode({**params, "Body": "hellO"}).encode(), headers=headers
    )
    signed = await client.post("/twilio/voice", data=urlencode(params).encode(), headers=headers)

    assert tampered.status == 401
    assert (signed.status, await signed.read()) == (200, TWIML)
    assert await claimed(pg_dsn, table) == [
        ("twilio", claim_id("idem-lib", "", urlencode(params).encode()), None)
    ]
    assert len(upstream.requests) == 1


def message(sid: str, text: str) -> tuple[bytes, dict[str, str]]:
    params = {"MessageSid": sid, "Body": text, "From": "+14158675310"}
    return urlencode(params).encode(), params


async def test_a_captured_request_under_a_victims_token_never_reads_the_victims_answer(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    # The app's TwiML names the message it answers (a one-time code, in real life).
    upstream.respond = lambda n: web.Response(
        body=b"<Response><Message>%s</Message></Response>" % upstream.requests[n].body[:16],
        content_type="text/xml",
    )
    client = await make_proxy(routes=[twilio_route()])
    captured, captured_params = message("SM-old", "hello")
    victim, victim_params = message("SM-victim", "code please")
    genuine = await client.post(
        "/twilio/voice", data=victim, headers=twilio_headers("", victim_params, token="T1")
    )

    # The captured request is validly signed; the token beside it is not covered by any
    # signature, so the attacker puts the victim's there.
    forged = await client.post(
        "/twilio/voice", data=captured, headers=twilio_headers("", captured_params, token="T1")
    )

    assert genuine.status == 200
    assert await forged.read() != await genuine.read()
    assert forged.headers.get("Idempotent-Replayed") is None
    # And the provider's own retry of the victim's request is still a duplicate.
    retry = await client.post(
        "/twilio/voice", data=victim, headers=twilio_headers("", victim_params, token="T1")
    )
    assert (retry.status, retry.headers["Idempotent-Replayed"]) == (200, "true")
    assert [r.body for r in upstream.requests] == [victim, captured]


async def test_a_captured_request_sent_first_under_a_future_token_does_not_swallow_it(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[twilio_route()])
    captured, captured_params = message("SM-old", "hello")
    stop, stop_params = message("SM-stop", "STOP")
    squat = await client.post(
        "/twilio/voice", data=captured, headers=twilio_headers("", captured_params, token="T9")
    )

    delivered = await client.post(
        "/twilio/voice", data=stop, headers=twilio_headers("", stop_params, token="T9")
    )

    assert (squat.status, delivered.status) == (200, 200)
    assert "Dedup-Status" not in delivered.headers  # the app's own answer
    assert upstream.bodies() == [captured, stop]
