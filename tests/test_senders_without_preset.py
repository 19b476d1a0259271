"""docs/providers.md's "A sender without a preset": each worked example's YAML block, loaded as
the page shows it, verifies deliveries signed as the sender's docs sign them (Typeform:
base64 HMAC-SHA256 after ``sha256=``; Vercel: hex HMAC-SHA1), forwards a valid one once and
refuses a forged, unsigned or body-swapped one with 401 before any claim."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import FakeUpstream, MakeProxy, claimed

PROVIDERS = Path(__file__).resolve().parents[1] / "docs" / "providers.md"
SECTION = "A sender without a preset"
SECRET = "a-sender-secret-3f9c"


def example_routes() -> dict[str, dict[str, Any]]:
    """The section's YAML blocks' routes, by name."""
    text = PROVIDERS.read_text()
    found = re.search(rf"^## {re.escape(SECTION)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert found, f"no section {SECTION!r} in docs/providers.md"
    routes = {}
    for block in re.findall(r"^```yaml\n(.*?)^```", found[1], re.M | re.S):
        for route in yaml.safe_load(block)["routes"]:
            routes[route["name"]] = route
    return routes


def typeform_signature(body: bytes, secret: str) -> dict[str, str]:
    # As Typeform's "secure your webhooks" page computes it: HMAC-SHA256 of the payload with the
    # secret, base64 (Ruby's strict_encode64), 'sha256=' before it.
    digest = hmac.new(secret.encode(), body, hashlib.sha256).digest()
    return {"Typeform-Signature": "sha256=" + base64.b64encode(digest).decode()}


def vercel_signature(body: bytes, secret: str) -> dict[str, str]:
    # As Vercel's "securing webhooks" sample computes it: createHmac('sha1', secret)
    # .update(rawBody).digest('hex').
    return {"x-vercel-signature": hmac.new(secret.encode(), body, hashlib.sha1).hexdigest()}


# name: (the secret's environment variable, a delivery as the sender's docs show one, signer)
SENDERS: dict[str, tuple[str, bytes, Callable[[bytes, str], dict[str, str]]]] = {
    "typeform": (
        "TYPEFORM_WEBHOOK_SECRET",
        b'{"event_id":"LtWXD3crgy","event_type":"form_response","form_response":{"form_id":'
        b'"lT4Z3j","token":"a3a12ec67a1365927098a606107fac15","submitted_at":'
        b'"2018-01-18T18:17:02Z","answers":[{"type":"number","number":9}]}}',
        typeform_signature,
    ),
    "vercel": (
        "VERCEL_WEBHOOK_SECRET",
        b'{"id":"uid_4Kmb7Xd2","type":"deployment.created","createdAt":1700000000000,'
        b'"region":null,"payload":{"deployment":{"id":"dpl_2qXg5Qhz"},"project":{"id":"prj_7"}}}',
        vercel_signature,
    ),
}


def test_the_section_shows_one_block_per_worked_example() -> None:
    assert sorted(example_routes()) == sorted(SENDERS)


@pytest.mark.parametrize("name", sorted(SENDERS))
async def test_a_worked_example_forwards_a_signed_delivery_once_and_refuses_forgeries(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    variable, body, sign = SENDERS[name]
    route = example_routes()[name]
    assert route["verify"]["secret"] == f"${{{variable}}}"
    monkeypatch.setenv(variable, SECRET)
    client = await make_proxy(routes=[route])
    path = route["path"]
    swapped = body.replace(b'"type', b'"x":1,"type', 1)
    assert swapped != body

    for forged_body, headers in [
        (body, sign(body, "a-guessed-secret")),
        (body, {}),
        (swapped, sign(body, SECRET)),  # a captured signature on another body
    ]:
        response = await client.post(path, data=forged_body, headers=headers)
        assert response.status == 401, headers
        assert (await response.json())["error"] == "signature_invalid"
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []

    first = await client.post(path, data=body, headers=sign(body, SECRET))
    again = await client.post(path, data=body, headers=sign(body, SECRET))

    assert (first.status, again.status) == (200, 200)
    assert again.headers["Dedup-Status"] == "duplicate"
    assert upstream.bodies() == [body]
    event_id, event_type = ("LtWXD3crgy", "form_response") if name == "typeform" else (
        "uid_4Kmb7Xd2", "deployment.created")  # fmt: skip
    assert await claimed(pg_dsn, table) == [(name, event_id, event_type)]
