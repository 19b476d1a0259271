"""Templated routes keep tenants apart: each tenant's own secrets, and one spelling of the tenant.

On ``/hooks/{tenant}`` a tenant knows its own signing secret; that secret must not verify another
tenant's path, or one tenant could forge another's events (``verify.tenant_secrets``). And the
tenant the app is sent is the one the claim is scoped by: ``/hooks/ACME`` is ``/hooks/acme``'s
claims, so it reaches the app as ``/hooks/acme``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy import config, errors
from tests.helpers import FakeUpstream, MakeProxy, claimed, event, stripe_headers

ACME = "whsec_acme_signs_its_own_events"
GLOBEX_NEW = "whsec_globex_current_secret"
GLOBEX_OLD = "whsec_globex_previous_secret"
TENANTS_ROUTE: dict[str, Any] = {
    "name": "tenants",
    "path": "/hooks/{tenant}",
    "preset": "stripe",
    "verify": {"tenant_secrets": {"Acme": ACME, "globex": [GLOBEX_NEW, GLOBEX_OLD]}},
}


def parsed_route(route: dict[str, Any]) -> Any:
    raw = {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "embedded"},
        "routes": [route],
    }
    return config.parse(raw).routes[0]


# --- end to end (the first three need the pipeline to verify with route.verifier_for) ---------


async def test_a_tenants_secret_verifies_its_own_path_and_no_other_tenants(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[TENANTS_ROUTE])
    body = event("evt_1")

    forged = await client.post("/hooks/globex", data=body, headers=stripe_headers(body, ACME))
    genuine = await client.post("/hooks/acme", data=body, headers=stripe_headers(body, ACME))

    assert (forged.status, (await forged.json())["error"]) == (401, "signature_invalid")
    assert genuine.status == 200
    assert [r.path_qs for r in upstream.requests] == ["/hooks/acme"]
    assert await claimed(pg_dsn, table) == [("tenants/acme", "evt_1", "charge.succeeded")]


async def test_each_of_a_tenants_secrets_verifies_its_path_during_rotation(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[TENANTS_ROUTE])
    statuses = []
    for event_id, secret in (("evt_new", GLOBEX_NEW), ("evt_old", GLOBEX_OLD), ("evt_x", ACME)):
        body = event(event_id)
        response = await client.post(
            "/hooks/globex", data=body, headers=stripe_headers(body, secret)
        )
        statuses.append(response.status)

    assert statuses == [200, 200, 401]
    assert [row[:2] for row in await claimed(pg_dsn, table)] == [
        ("tenants/globex", "evt_new"),
        ("tenants/globex", "evt_old"),
    ]


async def test_a_tenant_is_found_case_insensitively_and_forwarded_as_scoped(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[TENANTS_ROUTE])
    body = event("evt_case")
    headers = stripe_headers(body, ACME)

    first = await client.post("/HOOKS/ACME/?From=Dashboard", data=body, headers=headers)
    again = await client.post("/hooks/Acme", data=body, headers=headers)

    assert (first.status, again.status, again.headers["Dedup-Status"]) == (200, 200, "duplicate")
    assert [r.path_qs for r in upstream.requests] == ["/hooks/acme?From=Dashboard"]
    assert [row[:2] for row in await claimed(pg_dsn, table)] == [("tenants/acme", "evt_case")]


async def test_a_tenant_without_secrets_is_refused_before_any_claim(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=[TENANTS_ROUTE])
    body = event("evt_squat")

    answers = [
        await client.post("/hooks/initech", data=body, headers=stripe_headers(body, secret))
        for secret in (ACME, GLOBEX_NEW, "whsec_initech_never_configured")
    ]

    assert [(a.status, (await a.json())["error"]) for a in answers] == [
        (401, "signature_invalid")
    ] * 3
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


async def test_a_shared_secret_verifies_every_tenants_path_when_the_route_says_so(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    route = {**TENANTS_ROUTE, "verify": {"secret": ACME, "shared_secret": True}}
    client = await make_proxy(routes=[route])
    body = event("evt_shared")

    answers = [
        await client.post(path, data=body, headers=stripe_headers(body, ACME))
        for path in ("/hooks/acme", "/hooks/globex")
    ]

    assert [a.status for a in answers] == [200, 200]
    assert [row[:2] for row in await claimed(pg_dsn, table)] == [
        ("tenants/acme", "evt_shared"),
        ("tenants/globex", "evt_shared"),
    ]


async def test_the_app_receives_the_tenant_the_claim_was_scoped_by(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(
        routes=[{"name": "t", "path": "/v1/{tenant}/events", "event_id": "body:/id"}]
    )

    first = await client.post("/V1/AcMe/Events?Region=EU", data=b'{"id": "e1"}')
    again = await client.post("/v1/acme/events", data=b'{"id": "e1"}')
    other = await client.post("/v1/ACME/events", data=b'{"id": "e2"}')

    assert [first.status, again.status, other.status] == [200, 200, 200]
    assert again.headers["Dedup-Status"] == "duplicate"
    # One tenant, one spelling: the app keying tenants by this segment sees the claims' tenant.
    assert [r.path_qs for r in upstream.requests] == [
        "/v1/acme/events?Region=EU",
        "/v1/acme/events",
    ]
    assert await claimed(pg_dsn, table) == [("t/acme", "e1", None), ("t/acme", "e2", None)]


# --- RouteConfig.verifier_for, as the pipeline calls it ------------------------------------------


def test_verifier_for_picks_the_tenants_own_verifier_case_insensitively() -> None:
    route = parsed_route(TENANTS_ROUTE)
    body = event("evt_1")
    headers = CIMultiDict(stripe_headers(body, ACME))

    for tenant in ("acme", "ACME", "aCmE"):
        route.verifier_for((tenant,)).verify(headers, body, time.time())
    for tenant in ("globex", "initech"):
        with pytest.raises(errors.SignatureInvalid):
            route.verifier_for((tenant,)).verify(headers, body, time.time())
    # Whatever verifies without naming the tenant is refused: it fails closed.
    with pytest.raises(errors.SignatureInvalid):
        route.verify.verify(headers, body, time.time())
    assert route.verify.headers == ("Stripe-Signature",)


def test_verifier_for_is_the_routes_verifier_without_tenant_secrets() -> None:
    shared = parsed_route({**TENANTS_ROUTE, "verify": {"secret": ACME, "shared_secret": True}})
    unverified = parsed_route({"name": "t", "path": "/hooks/{tenant}", "event_id": "body:/id"})

    assert shared.verifier_for(("anyone",)) is shared.verify is not None
    assert unverified.verifier_for(("anyone",)) is None
