"""Slack's and Paddle's schemes cross-checked with the providers' own SDKs, both ways: what the
SDK signs, the proxy forwards once; what the proxy forwarded, the SDK's verifier accepts; a
forged, a stale and a body-swapped copy are refused 401 before any claim.

``slack_sdk`` (``slack_sdk.signature.SignatureVerifier``, Slack's Python SDK) and
``paddle-python-sdk`` (``paddle_billing.Notifications``, Paddle's Billing SDK) are test
dependencies only."""

from __future__ import annotations

import json
import time
from typing import Any

from paddle_billing.Notifications import Secret, Verifier
from paddle_billing.Notifications.PaddleSignature import PaddleSignature
from slack_sdk.signature import SignatureVerifier

from tests.helpers import FakeUpstream, MakeProxy, claimed

SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"  # the shape of Slack's documented example
PADDLE_SECRET = "pdl_ntfset_01gkpjp8bkm3tm53kdgkx6sms7_6h3qd3uFSi9YCD3OLYAShQI90XTI1vEK"


def route(preset: str, **extra: Any) -> dict[str, Any]:
    return {"name": preset, "path": f"/hooks/{preset}", "preset": preset, **extra}


async def refused(client: Any, path: str, body: bytes, headers: dict[str, str]) -> None:
    response = await client.post(path, data=body, headers=headers)
    assert response.status == 401, headers
    assert (await response.json())["error"] == "signature_invalid"


def slack_headers(
    body: bytes, *, at: float | None = None, secret: str = SLACK_SECRET
) -> dict[str, str]:
    stamp = str(int(time.time() if at is None else at))
    signature = SignatureVerifier(secret).generate_signature(timestamp=stamp, body=body)
    assert signature is not None
    return {"X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": signature}


async def test_slack_sdk_signs_what_the_proxy_forwards_once_and_verifies_what_it_forwarded(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("slack", verify={"secret": SLACK_SECRET})])
    body = (
        b'{"type":"event_callback","event_id":"Ev08MFMKH6","event":{"type":"app_mention",'
        b'"text":"<@U0LAN0Z89> is it everything a river should be?"}}'
    )

    await refused(client, "/hooks/slack", body, slack_headers(body, secret="not-the-secret"))
    await refused(client, "/hooks/slack", body, slack_headers(body, at=time.time() - 600))
    await refused(client, "/hooks/slack", body.replace(b"river", b"ocean"), slack_headers(body))
    await refused(client, "/hooks/slack", body, {})
    assert await claimed(pg_dsn, table) == []

    headers = slack_headers(body)
    first = await client.post("/hooks/slack", data=body, headers=headers)
    second = await client.post("/hooks/slack", data=body, headers=headers)

    assert (first.status, second.status) == (200, 200)
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [("slack", "Ev08MFMKH6", "app_mention")]
    sent = {name: values[0] for name, values in upstream.requests[0].headers.items()}
    verifier = SignatureVerifier(SLACK_SECRET)
    assert verifier.is_valid_request(upstream.requests[0].body, sent)
    assert not verifier.is_valid_request(body.replace(b"river", b"ocean"), sent)


def paddle_headers(
    body: bytes, *, at: float | None = None, secret: str = PADDLE_SECRET
) -> dict[str, str]:
    """Paddle-Signature as Paddle's SDK computes it (``PaddleSignature.calculate_hmac`` over
    ``{ts}:{body}``; the SDK verifies, it has no signer of its own)."""
    stamp = int(time.time() if at is None else at)
    digest = PaddleSignature.calculate_hmac(secret, f"{stamp}:".encode() + body).hexdigest()
    return {"Paddle-Signature": f"ts={stamp};h1={digest}"}


class _Received:
    """What Paddle's ``Verifier.verify`` reads of a request: its headers and body."""

    def __init__(self, headers: dict[str, str], body: bytes) -> None:
        self.headers = headers
        self.body = body


async def test_paddle_sdk_verifies_what_the_proxy_forwarded_and_the_proxy_refuses_forgeries(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[route("paddle", verify={"secret": PADDLE_SECRET})])
    body = json.dumps(
        {"event_id": "evt_01h8bzakzx3hm2fmen703n5q45", "event_type": "transaction.completed",
         "occurred_at": "2026-12-06T08:00:00.000000Z", "data": {"id": "txn_01h8bz"}},
        separators=(",", ":"),
    ).encode()  # fmt: skip

    await refused(client, "/hooks/paddle", body, paddle_headers(body, secret="pdl_other"))
    await refused(client, "/hooks/paddle", body, paddle_headers(body, at=time.time() - 5 * 86_400))
    await refused(client, "/hooks/paddle", body.replace(b"txn_", b"txm_"), paddle_headers(body))
    await refused(client, "/hooks/paddle", body, {})
    assert await claimed(pg_dsn, table) == []

    headers = paddle_headers(body)
    first = await client.post("/hooks/paddle", data=body, headers=headers)
    second = await client.post("/hooks/paddle", data=body, headers=headers)

    assert (first.status, second.status) == (200, 200)
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [
        ("paddle", "evt_01h8bzakzx3hm2fmen703n5q45", "transaction.completed")
    ]
    forwarded = upstream.requests[0]
    sent = {"Paddle-Signature": forwarded.headers["paddle-signature"][0]}
    verifier = Verifier()
    assert verifier.verify(_Received(sent, forwarded.body), Secret(PADDLE_SECRET))
    assert not verifier.verify(
        _Received(sent, body.replace(b"txn_", b"txm_")), Secret(PADDLE_SECRET)
    )
