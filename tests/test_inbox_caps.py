"""What one sender can fill of the inbox (``redeliver``), in process on a real PostgreSQL.

Where the signature does not cover the event ID (GitHub, Shopify, Twilio), a captured signed
body re-sent under fresh IDs is a new claim each time; while the app fails, each would be kept,
until the cap turned genuine failures away. The inbox keeps a signed body once per cap: a copy
under another ID is not kept again (its failure is relayed, its claim released). And on a
templated route with per-tenant secrets, each tenant has a cap of its own, so one tenant cannot
fill the cap another's failures need.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import uuid
from typing import Any
from urllib.parse import urlencode

import pytest
from aiohttp import web

from proxy import app_keys
from tests.helpers import FakeUpstream, MakeProxy, event, fetch, stripe_headers

GITHUB_SECRET = "inbox caps test secret"
HOOK_ID = "4242"


def github_route(**redeliver: Any) -> dict[str, Any]:
    return {
        "name": "github",
        "path": "/webhooks/github",
        "preset": "github",
        "verify": {"secret": GITHUB_SECRET},
        "redeliver": {"schedule": ["1h"], "for": "1d", **redeliver},
    }


def github_body(number: int) -> bytes:
    return json.dumps({"action": "opened", "number": number, "repository": "acme/app"}).encode()


def github_headers(body: bytes, delivery: str) -> dict[str, str]:
    """GitHub's headers for ``body``: the signature covers the body only, not the delivery ID."""
    signature = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-GitHub-Delivery": delivery,
        "X-GitHub-Hook-ID": HOOK_ID,
        "X-GitHub-Event": "pull_request",
        "X-Hub-Signature-256": f"sha256={signature}",
        "Content-Type": "application/json",
    }


async def kept_rows(dsn: str, table: str) -> list[tuple[str, str]]:
    found = await fetch(
        dsn,
        f"SELECT scope, inbox_state FROM \"{table}\" WHERE inbox_state IN ('pending', 'dead') "
        "ORDER BY received_at",
    )
    return [(row["scope"], row["inbox_state"]) for row in found]


def counted(proxy: Any, metric: str, route: str) -> float | None:
    registry = proxy.app[app_keys.METRICS].registry
    value: float | None = registry.get_sample_value(metric, {"route": route})
    return value


@pytest.mark.parametrize(("status", "outcome"), [(503, "queued"), (422, "dead_letter")])
async def test_a_captured_github_body_under_fresh_delivery_ids_is_kept_once(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    status: int,
    outcome: str,
) -> None:
    upstream.respond = lambda n: web.Response(status=status, text=f"answer {n}")
    proxy = await make_proxy(routes=[github_route(max_pending=40)])
    captured = github_body(1)

    replays = [
        await proxy.post(
            "/webhooks/github", data=captured, headers=github_headers(captured, str(uuid.uuid4()))
        )
        for _ in range(50)
    ]

    assert (await replays[0].json())["status"] == outcome
    assert [r.status for r in replays] == [202] + [status] * 49  # the app's answer, relayed
    assert await kept_rows(pg_dsn, table) == [("github", "dead" if status == 422 else "pending")]
    assert counted(proxy, "dedup_inbox_replays_total", "github") == 49
    assert counted(proxy, "dedup_inbox_full_total", "github") == 0

    genuine_body = github_body(2)
    genuine = await proxy.post(
        "/webhooks/github", data=genuine_body, headers=github_headers(genuine_body, "guid-2")
    )

    assert (genuine.status, (await genuine.json())["status"]) == (202, outcome)
    assert len(await kept_rows(pg_dsn, table)) == 2
    # Every copy was forwarded (each is a claim of its own), and only the kept ones are held.
    assert len(upstream.requests) == 51
    # The replays' claims were released, as over the cap (the route's row in scope '~id-forms'
    # records its upgrade window, docs/deployment.md "Upgrades").
    claims = await fetch(
        pg_dsn, f"SELECT count(*) AS n FROM \"{table}\" WHERE scope <> '~id-forms'"
    )
    assert claims[0]["n"] == 2


@pytest.mark.parametrize(("status", "outcome"), [(503, "pending"), (422, "dead")])
async def test_a_captured_body_replayed_four_at_a_time_is_kept_once(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    status: int,
    outcome: str,
) -> None:
    """The replays' keeps run at once (the app answers four together), each in its claim's
    transaction: one keeps the body, the others wait for its COMMIT and see it kept."""
    upstream.respond = lambda n: web.Response(status=status)
    # Room at the app for the four (the pool less the connections kept for short ones).
    proxy = await make_proxy(routes=[github_route(max_pending=60)], database={"pool_size": 8})
    captured = github_body(1)

    async def replay() -> int:
        headers = github_headers(captured, str(uuid.uuid4()))
        response = await proxy.post("/webhooks/github", data=captured, headers=headers)
        return response.status

    statuses = []
    for first in range(0, 50, 4):
        upstream.gate = asyncio.Event()
        batch = [asyncio.create_task(replay()) for _ in range(min(4, 50 - first))]
        arrived = first + len(batch)
        for _ in range(500):  # the batch at the app together (10 s at most)
            if len(upstream.requests) == arrived or any(task.done() for task in batch):
                break
            await asyncio.sleep(0.02)
        upstream.gate.set()
        statuses += await asyncio.gather(*batch)

    assert len(upstream.requests) == 50
    assert await kept_rows(pg_dsn, table) == [("github", outcome)]
    assert sorted(statuses) == sorted([202] + [status] * 49)
    assert counted(proxy, "dedup_inbox_replays_total", "github") == 49


async def test_github_redelivering_the_kept_event_is_its_duplicate_and_a_replay_is_not(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    proxy = await make_proxy(routes=[github_route()])
    body = github_body(7)

    first = await proxy.post("/webhooks/github", data=body, headers=github_headers(body, "g-7"))
    # GitHub's redelivery from its UI: the same GUID and bytes.
    again = await proxy.post("/webhooks/github", data=body, headers=github_headers(body, "g-7"))
    replay = await proxy.post("/webhooks/github", data=body, headers=github_headers(body, "g-8"))

    assert first.status == 202
    assert (again.status, (await again.json())["kept"]) == (202, "pending")
    assert replay.status == 503
    assert len(upstream.requests) == 2  # the copy under the same GUID never reached the app
    assert len(await kept_rows(pg_dsn, table)) == 1


async def test_the_log_line_names_the_id_the_replayed_body_is_kept_under(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    proxy = await make_proxy(routes=[github_route()])
    body = github_body(3)
    await proxy.post("/webhooks/github", data=body, headers=github_headers(body, "kept-3"))

    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        await proxy.post("/webhooks/github", data=body, headers=github_headers(body, "new-3"))

    *_, line = [r.fields for r in caplog.records if hasattr(r, "fields")]
    assert line["event_id"] == f"{HOOK_ID}:new-3"
    assert (line["outcome"], line["status"]) == ("upstream_error", 503)
    assert line["inbox_kept_as"].startswith(f"{HOOK_ID}:kept-3~")


async def test_a_captured_shopify_body_under_fresh_event_ids_is_kept_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=500)
    secret = "shopify caps secret"
    route = {
        "name": "shopify",
        "path": "/webhooks/shopify",
        "preset": "shopify",
        "verify": {"secret": secret},
        "redeliver": {"schedule": ["1h"], "for": "1d"},
    }
    proxy = await make_proxy(routes=[route])

    async def deliver(body: bytes, event_id: str) -> int:
        digest = hmac.new(secret.encode(), body, hashlib.sha256).digest()
        headers = {
            "X-Shopify-Event-Id": event_id,
            "X-Shopify-Topic": "orders/paid",
            "X-Shopify-Hmac-SHA256": base64.b64encode(digest).decode(),
        }
        answer = await proxy.post("/webhooks/shopify", data=body, headers=headers)
        return answer.status

    captured = b'{"order": 1, "total": "100.00"}'
    replays = [await deliver(captured, f"forged-{n}") for n in range(5)]
    genuine = await deliver(b'{"order": 2, "total": "5.00"}', "e2")

    assert replays == [202, 500, 500, 500, 500]
    assert genuine == 202
    assert len(await kept_rows(pg_dsn, table)) == 2


TWILIO_TOKEN = "12345678901234567890123456789012"
TWILIO_PUBLIC = "https://hooks.example.com/twilio/status"


def twilio_headers(params: dict[str, str], token: str) -> dict[str, str]:
    signed = TWILIO_PUBLIC + "".join(k + v for k, v in sorted(params.items()))
    mac = hmac.new(TWILIO_TOKEN.encode(), signed.encode(), hashlib.sha1).digest()
    return {
        "X-Twilio-Signature": base64.b64encode(mac).decode(),
        "I-Twilio-Idempotency-Token": token,
        "Content-Type": "application/x-www-form-urlencoded",
    }


async def test_a_captured_twilio_callback_under_fresh_tokens_is_kept_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    route = {
        "name": "twilio",
        "path": "/twilio/status",
        "preset": "twilio",
        "on_duplicate": "ack",  # a status callback: its answer is not acted on
        "verify": {"secret": TWILIO_TOKEN, "public_url": TWILIO_PUBLIC},
        "redeliver": {"schedule": ["1h"], "for": "1d"},
    }
    proxy = await make_proxy(routes=[route])
    params = {"MessageSid": "SM1", "MessageStatus": "delivered"}
    body = urlencode(params).encode()

    answers = [
        await proxy.post("/twilio/status", data=body, headers=twilio_headers(params, f"t-{n}"))
        for n in range(5)
    ]
    other = {"MessageSid": "SM2", "MessageStatus": "delivered"}
    genuine = await proxy.post(
        "/twilio/status", data=urlencode(other).encode(), headers=twilio_headers(other, "t-9")
    )

    assert [a.status for a in answers] == [202, 503, 503, 503, 503]
    assert genuine.status == 202
    assert len(await kept_rows(pg_dsn, table)) == 2


# --- a cap per tenant ---------------------------------------------------------------------

ACME = "whsec_acme_signs_its_own_events"
GLOBEX = "whsec_globex_signs_its_own"


def tenants_route(**redeliver: Any) -> dict[str, Any]:
    return {
        "name": "tenants",
        "path": "/hooks/{tenant}",
        "preset": "stripe",
        "verify": {"tenant_secrets": {"acme": ACME, "globex": GLOBEX}},
        "redeliver": {"schedule": ["1h"], "for": "1d", **redeliver},
    }


async def post_tenant(proxy: Any, tenant: str, secret: str, event_id: str, **headers: str) -> int:
    body = event(event_id)
    answer = await proxy.post(
        f"/hooks/{tenant}", data=body, headers={**stripe_headers(body, secret), **headers}
    )
    status: int = answer.status
    return status


async def test_one_tenant_filling_its_cap_leaves_another_tenants_failures_kept(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    proxy = await make_proxy(routes=[tenants_route(max_pending=2)])

    acme = [await post_tenant(proxy, "acme", ACME, f"evt_a{n}") for n in range(3)]
    globex = await post_tenant(proxy, "globex", GLOBEX, "evt_g0")

    assert acme == [202, 202, 503]  # acme's own cap
    assert globex == 202
    assert await kept_rows(pg_dsn, table) == [
        ("tenants/acme", "pending"),
        ("tenants/acme", "pending"),
        ("tenants/globex", "pending"),
    ]
    assert counted(proxy, "dedup_inbox_full_total", "tenants") == 1


async def test_max_pending_bytes_is_per_tenant_too(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=503)
    proxy = await make_proxy(routes=[tenants_route(max_pending_bytes="64KiB")])
    # About 40 KiB of stored headers each: two such rows do not fit one 64 KiB cap.
    heavy = {f"X-Padding-{n}": "p" * 8000 for n in range(5)}

    acme = [await post_tenant(proxy, "acme", ACME, f"evt_a{n}", **heavy) for n in range(2)]
    globex = await post_tenant(proxy, "globex", GLOBEX, "evt_g0", **heavy)

    assert acme == [202, 503]
    assert globex == 202
    assert [scope for scope, _ in await kept_rows(pg_dsn, table)] == [
        "tenants/acme",
        "tenants/globex",
    ]


async def test_a_templated_route_without_tenant_secrets_keeps_one_cap_for_every_path(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """Anyone can choose a path value on an unverified route (or sign for every one with a
    shared secret): a cap per path would be no cap."""
    upstream.respond = lambda n: web.Response(status=503)
    route = {
        "name": "open",
        "path": "/open/{tenant}",
        "event_id": "body:/id",
        "redeliver": {"schedule": ["1h"], "for": "1d", "max_pending": 2},
    }
    proxy = await make_proxy(routes=[route])

    answers = [(await proxy.post(f"/open/t{n}", data=event(f"evt_{n}"))).status for n in range(3)]

    assert answers == [202, 202, 503]
    assert len(await kept_rows(pg_dsn, table)) == 2
