"""semantics: idempotency-key — an API route keyed by the client's Idempotency-Key, against the
real database."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web

from proxy import config, errors
from tests.helpers import FakeUpstream, MakeProxy, fetch

PAYMENT = b'{"amount": 100, "currency": "eur"}'


def api_route(**extra: Any) -> dict[str, Any]:
    return {
        "name": "payments",
        "path": "/payments",
        "semantics": "idempotency-key",
        "scope_from": "header:Authorization",
        **extra,
    }


def created(n: int) -> web.Response:
    return web.json_response({"payment": f"pay_{n}"}, status=201)


async def pay(client: Any, key: str | None, body: bytes = PAYMENT, token: str = "alice") -> Any:
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    return await client.post("/payments", data=body, headers=headers)


async def test_a_retry_gets_the_first_answer_and_quoted_and_bare_keys_are_one(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = created
    client = await make_proxy(routes=[api_route()])

    first = await pay(client, "8e03978e-40d5-43e8-bc93-6894a57f9324")
    again = await pay(client, '"8e03978e-40d5-43e8-bc93-6894a57f9324"')

    assert (first.status, await first.json()) == (201, {"payment": "pay_0"})
    assert (again.status, await again.json()) == (201, {"payment": "pay_0"})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.requests) == 1


async def test_the_same_key_with_another_request_is_422_and_not_forwarded(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = created
    client = await make_proxy(routes=[api_route()])
    await pay(client, "k1")

    changed = await pay(client, "k1", body=b'{"amount": 999, "currency": "eur"}')

    assert changed.status == 422
    assert changed.content_type == "application/problem+json"
    problem = await changed.json()
    assert (problem["status"], problem["code"]) == (422, "idempotency_key_reused")
    assert problem["title"] in ("Unprocessable Content", "Unprocessable Entity")  # RFC 9110, 7231
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("key", [None, "", 'a"b', "caf\u00e9", "x" * 257, '"open', '"a\\z"'])
async def test_a_missing_or_malformed_key_is_400(
    make_proxy: MakeProxy, upstream: FakeUpstream, key: str | None
) -> None:
    client = await make_proxy(routes=[api_route()])
    response = await pay(client, key)
    assert response.status == 400
    assert response.content_type == "application/problem+json"
    code = "idempotency_key_missing" if key is None else "idempotency_key_invalid"
    assert (await response.json())["code"] == code
    assert upstream.requests == []


async def test_two_clients_with_the_same_key_are_two_requests(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream.respond = created
    client = await make_proxy(routes=[api_route()])
    with caplog.at_level(logging.DEBUG, logger="proxy.pipeline"):
        alice = await pay(client, "same", token="alice-secret-token")
        bob = await pay(client, "same", token="bob-secret-token")

    assert [await alice.json(), await bob.json()] == [{"payment": "pay_0"}, {"payment": "pay_1"}]
    scopes = [row["scope"] for row in await fetch(pg_dsn, f'SELECT scope FROM "{table}"')]
    assert len(set(scopes)) == 2
    assert all(scope.startswith("payments/~") for scope in scopes)
    # The client's credential is hashed: never stored, never logged.
    logged = " ".join(str(r.fields) for r in caplog.records if hasattr(r, "fields"))
    assert "secret-token" not in " ".join(scopes) + logged


async def test_a_key_in_flight_is_409_at_once_on_this_proxy_and_on_another(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = created
    upstream.gate = asyncio.Event()
    one = await make_proxy(routes=[api_route()], claim_wait="1h")
    two = await make_proxy(routes=[api_route()], claim_wait="1h")
    first = asyncio.create_task(pay(one, "racing"))
    await upstream.arrived.wait()  # the first holds the key (and its row lock) at the app

    # claim_wait is an hour: an answer within the test's timeout means nobody waited.
    here, there = await pay(one, "racing"), await pay(two, "racing")
    upstream.gate.set()
    done = await first

    assert [here.status, there.status, done.status] == [409, 409, 201]
    problems = [await here.json(), await there.json()]
    assert [p["code"] for p in problems] == ["idempotency_key_in_progress"] * 2
    assert len(upstream.requests) == 1
    assert (await pay(two, "racing")).headers["Idempotent-Replayed"] == "true"


async def test_a_failed_answer_releases_the_key(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = lambda n: (
        web.json_response({"error": "card declined"}, status=402) if n == 0 else created(n)
    )
    client = await make_proxy(routes=[api_route()])
    declined = await pay(client, "k-fail")
    corrected = await pay(client, "k-fail")
    assert [declined.status, corrected.status] == [402, 201]
    assert "Idempotent-Replayed" not in corrected.headers
    assert len(upstream.requests) == 2


async def test_other_methods_are_pass_through_traffic_and_follow_passthrough(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    closed = await make_proxy(routes=[api_route()], passthrough="none")
    listing = await closed.get("/payments?limit=3")
    keyed = await closed.put("/payments", data=b"{}", headers={"Idempotency-Key": "k1"})
    assert [listing.status, keyed.status] == [405, 405]
    assert listing.headers["Allow"] == "POST"
    assert upstream.requests == []

    opened = await make_proxy(routes=[api_route()])  # passthrough: all
    listing = await opened.get("/payments?limit=3")
    # A key on a method the route does not claim is not honoured: both reach the app.
    replaced = [
        await opened.put("/payments", data=b"{}", headers={"Idempotency-Key": "k1"})
        for _ in range(2)
    ]
    assert [listing.status, *(r.status for r in replaced)] == [200, 200, 200]
    assert [(r.method, r.path_qs) for r in upstream.requests] == [
        ("GET", "/payments?limit=3"),
        ("PUT", "/payments"),
        ("PUT", "/payments"),
    ]
    assert await fetch(pg_dsn, f'SELECT 1 FROM "{table}"') == []


def test_idempotency_key_route_defaults_and_problems() -> None:
    base: dict[str, Any] = {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "embedded"},
    }
    (route,) = config.parse({**base, "routes": [api_route()]}).routes
    assert (str(route.event_id), route.methods, route.retention, route.replay) == (
        "header:Idempotency-Key",
        ("POST",),
        86400.0,
        True,
    )
    with pytest.raises(errors.ConfigError) as info:
        config.parse(
            {
                **base,
                "routes": [
                    api_route(methods=["POST", "PUT"], on_duplicate="ack"),
                    {
                        "name": "hook",
                        "path": "/hook",
                        "event_id": "body:/id",
                        "scope_from": "header:Authorization",
                    },
                ],
            }
        )
    assert info.value.problems == (
        "routes[0].methods: idempotency-key routes claim POST or PATCH, not ['PUT']",
        "routes[0].on_duplicate: idempotency-key routes always replay the first answer",
        "routes[1].scope_from: only for semantics: idempotency-key",
    )


async def test_clients_are_told_apart_by_their_whole_credential(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    upstream.respond = created
    client = await make_proxy(routes=[api_route()])
    jwt = "eyJ" + "x" * 1200  # bearer tokens run to kilobytes
    first = await pay(client, "k-jwt", token=jwt)
    other = await pay(client, "k-jwt", token=jwt[:-1] + "y")  # differs in its last byte
    anonymous = await client.post("/payments", data=PAYMENT, headers={"Idempotency-Key": "k"})
    assert [first.status, other.status, anonymous.status] == [201, 201, 400]
    assert (await anonymous.json())["code"] == "client_unidentified"
    assert len(upstream.requests) == 2


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"claim_wait": "2s"}, "routes[0].claim_wait: idempotency-key routes never wait"),
        ({"scope_from": "query:user"}, "routes[0].scope_from: must be header sources"),
    ],
)
def test_idempotency_key_route_option_problems(extra: dict[str, Any], problem: str) -> None:
    raw = {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "embedded"},
        "routes": [api_route(**extra)],
    }
    with pytest.raises(errors.ConfigError) as info:
        config.parse(raw)
    assert info.value.problems[0].startswith(problem)


@pytest.mark.parametrize(
    ("connection", "code"),
    [
        # The client's scope would be read from a header the app never receives.
        ("keep-alive, authorization", "client_unidentified"),
        # So would the key itself, on a route with no verify.
        ("Idempotency-Key", "idempotency_key_invalid"),
    ],
)
async def test_a_connection_header_naming_the_key_or_the_scope_header_is_400(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    connection: str,
    code: str,
) -> None:
    client = await make_proxy(routes=[api_route()])
    response = await client.post(
        "/payments",
        data=PAYMENT,
        headers={
            "Authorization": "Bearer alice",
            "Idempotency-Key": "k-hop",
            "Connection": connection,
        },
    )
    assert response.status == 400
    assert response.content_type == "application/problem+json"
    problem = await response.json()
    assert problem["code"] == code
    assert upstream.requests == []
    assert await fetch(pg_dsn, f'SELECT 1 FROM "{table}"') == []
