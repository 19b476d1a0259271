"""No variant of a webhook path, method or tenant reaches the app unverified or undeduplicated.

Requests are written as raw request lines, so no client library normalizes them first. Every
variant of a configured route's path is either handled as that route (a forged request 401 and
no claim, a second copy a duplicate) or refused (400); none is passed through.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given
from hypothesis import strategies as st

from proxy import errors, paths
from tests.helpers import FakeUpstream, MakeProxy, claimed, event, stripe_headers, stripe_route

ROUTES = [
    stripe_route(),
    {"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"},
    {"name": "tenants", "path": "/hooks/{tenant}", "event_id": "body:/id"},
]

# (variant of /webhooks/X, what it gets): "route" is handled as the route, "refused" is 400.
VARIANTS = [
    ("/webhooks/X/", "route"),
    ("/WEBHOOKS/X", "route"),
    ("//webhooks/X", "route"),
    ("/webhooks//X", "route"),
    ("/webhooks/X/.", "route"),
    ("/webhooks/./X", "route"),
    ("/webhooks/x/../X", "route"),
    ("/webhooks/%2e/X", "route"),
    ("/webhooks/%2E%2E/webhooks/X", "route"),
    ("/./webhooks/X", "route"),
    ("/../webhooks/X", "route"),
    ("/%77ebhooks/X", "route"),
    ("/Webhooks/X/./", "route"),
    ("/webhooks/X?x=1", "route"),
    ("/webhooks/X;x=1", "refused"),
    ("/webhooks;x/X", "refused"),
    ("/webhooks/X%2F", "refused"),
    ("/webhooks%2FX", "refused"),
    ("/webhooks/X%5C", "refused"),
    ("/webhooks\\X", "refused"),
    ("/webhooks/X%20", "refused"),
    ("/webhooks/%20X", "refused"),
    ("/webhooks/X%00", "refused"),
    ("/webhooks/X%0A", "refused"),
    ("/webhooks/X%09", "refused"),
    ("/webhooks/X%3Bx=1", "refused"),
]


def variant(template: str, name: str) -> str:
    return template.replace("X", name).replace("/webhooks/x/", "/webhooks/zz/")


async def send(
    client: TestClient[Any, Any], method: str, target: str, body: bytes, headers: dict[str, str]
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 request; the status, headers (lower-cased names) and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    try:
        lines = [
            f"{method} {target} HTTP/1.1",
            "Host: proxy.test",
            "Connection: close",
            f"Content-Length: {len(body)}",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in header_lines)
    return int(status_line.split()[1]), {k.lower(): v for k, v in fields.items()}, payload


@pytest.mark.parametrize(("template", "expected"), VARIANTS)
async def test_a_forged_event_on_a_path_variant_never_reaches_the_app(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    template: str,
    expected: str,
) -> None:
    client = await make_proxy(routes=ROUTES)
    forged = event("evt_forged")

    status, _, body = await send(
        client,
        "POST",
        variant(template, "stripe"),
        forged,
        {**stripe_headers(forged, secret="whsec_not_the_right_one")},
    )

    assert (status, json.loads(body)["error"]) == (
        (401, "signature_invalid") if expected == "route" else (400, "path_refused")
    )
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


@pytest.mark.parametrize(("template", "expected"), VARIANTS)
async def test_a_second_copy_on_a_path_variant_is_a_duplicate_or_refused(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    template: str,
    expected: str,
) -> None:
    client = await make_proxy(routes=ROUTES)
    body = b'{"id": "evt_seen"}'
    first = await client.post("/webhooks/corvel", data=body)
    assert first.status == 200

    status, headers, _ = await send(client, "POST", variant(template, "corvel"), body, {})

    if expected == "route":
        assert (status, headers["dedup-status"]) == (200, "duplicate")
    else:
        assert status == 400
    assert [r.path_qs for r in upstream.requests] == ["/webhooks/corvel"]
    assert await claimed(pg_dsn, table) == [("corvel", "evt_seen", None)]


async def test_a_genuine_event_on_a_variant_reaches_the_app_at_the_routes_path(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=ROUTES)
    body = event("evt_genuine")

    status, _, _ = await send(
        client, "POST", "/WEBHOOKS/./x/../Stripe/?source=test", body, stripe_headers(body)
    )
    again, headers, _ = await send(client, "POST", "/webhooks/stripe", body, stripe_headers(body))

    assert (status, again, headers["dedup-status"]) == (200, 200, "duplicate")
    # The path the proxy routed on, whatever the app's router would make of the variant.
    assert [(r.method, r.path_qs) for r in upstream.requests] == [
        ("POST", "/webhooks/stripe?source=test")
    ]
    assert [row[:2] for row in await claimed(pg_dsn, table)] == [("stripe", "evt_genuine")]


@pytest.mark.parametrize("method", ["PUT", "PATCH", "GET", "DELETE", "HEAD", "OPTIONS"])
async def test_other_methods_on_a_webhook_path_are_405(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, method: str
) -> None:
    client = await make_proxy(routes=ROUTES)
    body = event("evt_put")

    status, headers, _ = await send(client, method, "/Webhooks/Stripe/", body, stripe_headers(body))

    assert (status, headers["allow"]) == (405, "POST")
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []


async def test_a_route_that_lists_its_methods_takes_them(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(
        routes=[{"name": "api", "path": "/api/pay", "event_id": "body:/id", "methods": ["PUT"]}]
    )
    put = await client.put("/api/pay", data=b'{"id": "p1"}')
    again = await client.put("/api/pay", data=b'{"id": "p1"}')
    post = await client.post("/api/pay", data=b'{"id": "p2"}')

    assert [put.status, again.status, post.status] == [200, 200, 405]
    assert again.headers["Dedup-Status"] == "duplicate"
    assert post.headers["Allow"] == "PUT"
    assert [(r.method, r.path_qs) for r in upstream.requests] == [("PUT", "/api/pay")]


async def test_the_tenant_in_a_templated_path_is_part_of_the_scope(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=ROUTES)
    body = b'{"id": 42}'

    answers = [
        await send(client, "POST", path, body, {})
        for path in (
            "/hooks/acme",
            "/hooks/globex",
            "/HOOKS/ACME/",
            "/hooks/acme%2Fx",
            "/hooks/ac;me",
            "/hooks/%61cme",
        )
    ]

    assert [status for status, _, _ in answers] == [200, 200, 200, 400, 400, 200]
    assert [headers.get("dedup-status") for _, headers, _ in answers[:3]] == [
        None,
        None,
        "duplicate",
    ]
    assert [r.path_qs for r in upstream.requests] == ["/hooks/acme", "/hooks/globex"]
    assert await claimed(pg_dsn, table) == [
        ("tenants/acme", "42", None),
        ("tenants/globex", "42", None),
    ]


async def test_an_explicit_scope_is_shared_by_every_tenant(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(
        routes=[{"name": "t", "path": "/hooks/{tenant}", "event_id": "body:/id", "scope": "all"}]
    )
    first = await client.post("/hooks/acme", data=b'{"id": "e"}')
    second = await client.post("/hooks/globex", data=b'{"id": "e"}')

    assert (first.status, second.headers["Dedup-Status"]) == (200, "duplicate")
    assert await claimed(pg_dsn, table) == [("all", "e", None)]


@pytest.mark.parametrize(
    "target",
    ["http://attacker.example/webhooks/corvel", "http://attacker.example/other"],
)
async def test_an_absolute_form_target_is_refused(
    make_proxy: MakeProxy, upstream: FakeUpstream, target: str
) -> None:
    client = await make_proxy(routes=ROUTES)

    status, _, body = await send(client, "POST", target, b'{"id": "abs"}', {})

    assert (status, json.loads(body)["error"]) == (400, "path_refused")
    assert upstream.requests == []


async def test_pass_through_keeps_unrelated_traffic_and_forwards_the_routed_path(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(routes=ROUTES)

    for target in ("/health?deep=1", "/static/a;v=2", "/api/./x/../items%2Fy?q=%20"):
        status, _, _ = await send(client, "GET", target, b"", {})
        assert status == 200

    assert [r.path_qs for r in upstream.requests] == [
        "/health?deep=1",
        "/static/a;v=2",  # matches no route even loosely: passed through as it is
        "/api/items%2Fy?q=%20",  # the path the proxy routed on, not the app's reading of it
    ]
    assert await claimed(pg_dsn, table) == []


@pytest.mark.parametrize(
    ("passthrough", "allowed"),
    [
        ("none", []),
        (["/api", "/status/"], ["/api", "/api/items", "/status"]),
    ],
)
async def test_pass_through_can_be_limited(
    make_proxy: MakeProxy, upstream: FakeUpstream, passthrough: Any, allowed: list[str]
) -> None:
    if passthrough != "none":
        passthrough = [p.rstrip("/") for p in passthrough]
    client = await make_proxy(routes=ROUTES, passthrough=passthrough)
    targets = ["/api", "/api/items", "/apix", "/status", "/other", "/"]

    statuses = {t: (await send(client, "GET", t, b"", {}))[0] for t in targets}

    assert statuses == {t: 200 if t in allowed else 404 for t in targets}
    assert [r.path_qs for r in upstream.requests] == allowed
    # The webhook routes are unaffected.
    assert (await client.post("/webhooks/corvel", data=b'{"id": "w"}')).status == 200


# The same property, on generated variants of configured paths.

PATTERNS = ["/webhooks/stripe", "/v1/hooks/{tenant}/events", "/a"]
TABLE = paths.Table([(paths.Pattern.parse(p), p) for p in PATTERNS])


@st.composite
def path_variants(draw: st.DrawFn) -> tuple[str, str]:
    """A configured path, and a variant of it an app's router might take for that path."""
    pattern = draw(st.sampled_from(PATTERNS))
    out = []
    for configured in pattern.strip("/").split("/"):
        segment = configured
        if configured.startswith("{"):
            # Anything an app might still take for one tenant segment.
            segment = draw(
                st.text("abcXYZ09-_.~%; \t", min_size=1, max_size=6).filter(
                    # (what comes before a ';' is all a Servlet container keeps)
                    lambda s: any(c.isalnum() for c in s.split(";")[0])
                )
            )
        letters = []
        for char in segment:
            how = draw(st.sampled_from(["same", "upper", "escape", "escape-lower"]))
            if how == "same":
                letters.append(char)
            elif how == "upper":
                letters.append(char.upper())
            else:
                letters.append(f"%{ord(char):02X}" if how == "escape" else f"%{ord(char):02x}")
        prefix = draw(st.sampled_from(["", "/", "./", "x/../", "%2e/", "//"]))
        suffix = draw(st.sampled_from(["", "", "", ";x=1", "%20", "%2F", "%00", "\\", "/."]))
        out.append(prefix + "".join(letters) + suffix)
    tail = draw(st.sampled_from(["", "/", "?a=b", "/?a=b", "//"]))
    return pattern, "/" + "/".join(out) + tail


@given(path_variants())
def test_a_path_variant_is_its_route_or_refused_never_passed_through(
    case: tuple[str, str],
) -> None:
    pattern, raw = case
    try:
        match = TABLE.match(paths.normalize(raw), raw)
    except errors.PathRefused:
        return
    assert match is not None, f"{raw!r} (a variant of {pattern}) would pass through"
    assert match.route == pattern


@given(st.text(alphabet="abc/.%2eEfF;\\?", max_size=30))
def test_normalization_is_idempotent(text: str) -> None:
    raw = "/" + text
    once = paths.normalize(raw)
    assert paths.normalize(once.path + once.query) == once


@given(st.text(alphabet="aB0-_~/.%2eEfF;\\:@!", max_size=30))
def test_a_path_taken_as_already_normal_is_what_normalizing_it_gives(text: str) -> None:
    path = "/" + text
    if paths.already_normal(path):
        assert paths.normalize_path(path) == path


def test_a_parameter_is_matched_and_forwarded_case_folded_with_the_query_as_sent() -> None:
    raw = "/V1/Hooks/AcMe/Events/?Region=EU"

    match = TABLE.match(paths.normalize(raw), raw)

    assert match is not None
    assert (match.route, match.values, match.target) == (
        "/v1/hooks/{tenant}/events",
        ("acme",),
        "/v1/hooks/acme/events?Region=EU",
    )
