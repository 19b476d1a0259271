"""Through the proxy: the twilio preset (public_url, query, replay) and a preset's claim_wait."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from tests.conftest import FakeUpstream, MakeProxy, claimed

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


def twilio_headers(query: str, params: dict[str, str], token: str = "idem-1") -> dict[str, str]:
    signed = f"{PUBLIC}?{query}" + "".join(k + v for k, v in sorted(params.items()))
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
    assert await claimed(pg_dsn, table) == [("twilio", "idem-1", None)]


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
    assert await claimed(pg_dsn, table) == [("twilio", "idem-lib", None)]
    assert len(upstream.requests) == 1
