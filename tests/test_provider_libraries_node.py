"""GitHub's, Linear's and Shopify's schemes cross-checked with the providers' own JavaScript
libraries, run by node: ``@octokit/webhooks-methods`` (GitHub's, behind Octokit's webhooks)
signs what the proxy forwards once and verifies what it forwarded; ``@linear/sdk``'s
``LinearWebhookClient`` and ``@shopify/shopify-api``'s ``webhooks.validate`` verify what the
proxy forwarded (they sign nothing: the test signs as their checks compute). A forged, a stale
(where the scheme dates its requests) and a body-swapped copy are refused 401 before any
claim."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    GITHUB_SECRET,
    FakeUpstream,
    MakeProxy,
    claimed,
    github_route,
    npm_install,
)

# The libraries' major versions, as their tests here were written against.
PACKAGES = ("@octokit/webhooks-methods@5", "@linear/sdk@98", "@shopify/shopify-api@11")
LINEAR_SECRET = "lin_wh_2b9d3c1e5f"
SHOPIFY_SECRET = "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"

# Each script runs inside the npm prefix, so that its imports resolve to the packages installed
# there (ES modules do not read NODE_PATH). Arguments: the secret, a file holding the body, and
# for a check the signature; it prints what the library says.
SCRIPTS = {
    "octokit_sign.mjs": """
import { readFileSync } from "node:fs";
import { sign } from "@octokit/webhooks-methods";
const [secret, file] = process.argv.slice(2);
console.log(await sign(secret, readFileSync(file, "utf8")));
""",
    "octokit_verify.mjs": """
import { readFileSync } from "node:fs";
import { verify } from "@octokit/webhooks-methods";
const [secret, file, signature] = process.argv.slice(2);
console.log(await verify(secret, readFileSync(file, "utf8"), signature));
""",
    "linear_verify.mjs": """
import { readFileSync } from "node:fs";
import { LinearWebhookClient } from "@linear/sdk/webhooks";
const [secret, file, signature] = process.argv.slice(2);
try {
  console.log(new LinearWebhookClient(secret).verify(readFileSync(file), signature));
} catch (error) {
  console.log(false, error.message);
}
""",
    # Arguments: the secret, the body's file, and the request's headers as JSON.
    "shopify_validate.mjs": """
import { readFileSync } from "node:fs";
import "@shopify/shopify-api/adapters/node";
import { shopifyApi, LATEST_API_VERSION, LogSeverity } from "@shopify/shopify-api";
const [secret, file, headers] = process.argv.slice(2);
const shopify = shopifyApi({
  apiKey: "stand-in", apiSecretKey: secret, scopes: [], hostName: "localhost",
  apiVersion: LATEST_API_VERSION, isEmbeddedApp: false, logger: { level: LogSeverity.Error },
});
const result = await shopify.webhooks.validate({
  rawBody: readFileSync(file, "utf8"),
  rawRequest: { headers: JSON.parse(headers), method: "POST", url: "/hooks/shopify" },
  rawResponse: {},
});
console.log(result.valid, result.reason ?? "");
""",
}


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The npm prefix holding the libraries and the scripts that call them."""
    where = tmp_path_factory.mktemp("provider-libraries")
    npm_install(where, *PACKAGES)
    for name, text in SCRIPTS.items():
        (where / name).write_text(text)
    return where


def node(libraries: Path, script: str, secret: str, body: bytes, *extra: str) -> str:
    body_file = libraries / f"body-{hashlib.sha256(body).hexdigest()[:16]}"
    body_file.write_bytes(body)
    done = subprocess.run(
        ["node", str(libraries / script), secret, str(body_file), *extra],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip()


async def refused(client: Any, path: str, body: bytes, headers: dict[str, str]) -> None:
    response = await client.post(path, data=body, headers=headers)
    assert response.status == 401, headers
    assert (await response.json())["error"] == "signature_invalid"


def github_headers(signature: str, delivery: str) -> dict[str, str]:
    return {"X-GitHub-Delivery": delivery, "X-GitHub-Hook-ID": "1", "X-GitHub-Event": "push",
            "X-Hub-Signature-256": signature, "Content-Type": "application/json"}  # fmt: skip


async def test_octokit_signs_what_the_proxy_forwards_once_and_verifies_what_it_forwarded(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, libraries: Path
) -> None:
    client = await make_proxy(routes=[github_route()])
    body = b'{"ref":"refs/heads/main","after":"6113728f27ae82c7b1a177c8d03f9e96e0adf246"}'
    swapped = body.replace(b"main", b"prod")
    signature = node(libraries, "octokit_sign.mjs", GITHUB_SECRET, body)
    forged = node(libraries, "octokit_sign.mjs", "not the secret", body)
    assert signature.startswith("sha256=")

    await refused(client, "/webhooks/github", body, github_headers(forged, "d-forged"))
    await refused(client, "/webhooks/github", swapped, github_headers(signature, "d-swapped"))
    assert await claimed(pg_dsn, table) == []
    headers = github_headers(signature, "72d3162e-cc78-11e3-81ab-4c9367dc0958")
    first = await client.post("/webhooks/github", data=body, headers=headers)
    second = await client.post("/webhooks/github", data=body, headers=headers)

    assert (first.status, second.status) == (200, 200)
    assert upstream.bodies() == [body]
    assert len(await claimed(pg_dsn, table)) == 1
    forwarded = upstream.requests[0]
    sent = forwarded.headers["x-hub-signature-256"][0]
    assert node(libraries, "octokit_verify.mjs", GITHUB_SECRET, forwarded.body, sent) == "true"
    assert node(libraries, "octokit_verify.mjs", GITHUB_SECRET, swapped, sent) == "false"


def linear_body(at_ms: int, title: str = "Fix the ledger") -> bytes:
    payload = {"action": "create", "type": "Issue", "data": {"id": "9c1f", "title": title},
               "webhookTimestamp": at_ms}  # fmt: skip
    return json.dumps(payload).encode()


def linear_headers(body: bytes, delivery: str, secret: str = LINEAR_SECRET) -> dict[str, str]:
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"Linear-Signature": digest, "Linear-Delivery": delivery, "Linear-Event": "Issue"}


async def test_linear_sdk_verifies_what_the_proxy_forwarded_and_the_proxy_refuses_forgeries(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, libraries: Path
) -> None:
    route = {"name": "linear", "path": "/hooks/linear", "preset": "linear",
             "verify": {"secret": LINEAR_SECRET}}  # fmt: skip
    client = await make_proxy(routes=[route])
    now_ms = int(time.time() * 1000)
    body, stale = linear_body(now_ms), linear_body(now_ms - 61_000)
    swapped = linear_body(now_ms, title="Drop the ledger")

    await refused(client, "/hooks/linear", body, linear_headers(body, "d-1", "guessed"))
    await refused(client, "/hooks/linear", stale, linear_headers(stale, "d-2"))
    await refused(client, "/hooks/linear", swapped, linear_headers(body, "d-3"))
    assert await claimed(pg_dsn, table) == []
    first = await client.post("/hooks/linear", data=body, headers=linear_headers(body, "d-5"))
    second = await client.post("/hooks/linear", data=body, headers=linear_headers(body, "d-5"))

    assert (first.status, second.status) == (200, 200)
    assert upstream.bodies() == [body]
    forwarded = upstream.requests[0]
    sent = forwarded.headers["linear-signature"][0]
    assert node(libraries, "linear_verify.mjs", LINEAR_SECRET, forwarded.body, sent) == "true"
    assert node(libraries, "linear_verify.mjs", LINEAR_SECRET, swapped, sent).startswith("false")
    # What the proxy refused as stale, or for want of a timestamp, the library refuses too.
    untimed = b'{"action":"create","type":"Issue","data":{"id":"9c1f"}}'
    await refused(client, "/hooks/linear", untimed, linear_headers(untimed, "d-6"))
    untimed_check = node(
        libraries, "linear_verify.mjs", LINEAR_SECRET, untimed,
        linear_headers(untimed, "x")["Linear-Signature"],
    )  # fmt: skip
    assert untimed_check == "false Missing webhook timestamp"
    stale_check = node(
        libraries,
        "linear_verify.mjs",
        LINEAR_SECRET,
        stale,
        linear_headers(stale, "x")["Linear-Signature"],
    )
    assert stale_check == "false Invalid webhook timestamp"


def shopify_headers(body: bytes, event: str, secret: str = SHOPIFY_SECRET) -> dict[str, str]:
    digest = base64.b64encode(hmac.digest(secret.encode(), body, "sha256")).decode()
    return {"X-Shopify-Hmac-Sha256": digest, "X-Shopify-Event-Id": event,
            "X-Shopify-Topic": "orders/create", "X-Shopify-API-Version": "2025-10",
            "X-Shopify-Shop-Domain": "ledger.myshopify.com",
            "X-Shopify-Webhook-Id": f"w-{event}"}  # fmt: skip


async def test_shopify_api_validates_what_the_proxy_forwarded_and_the_proxy_refuses_forgeries(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str, libraries: Path
) -> None:
    route = {"name": "shopify", "path": "/hooks/shopify", "preset": "shopify",
             "verify": {"secret": SHOPIFY_SECRET}}  # fmt: skip
    client = await make_proxy(routes=[route])
    body = b'{"id":820982911946154508,"email":"jon@example.com","total_price":"254.98"}'
    swapped = body.replace(b"254.98", b"0.01")

    await refused(client, "/hooks/shopify", body, shopify_headers(body, "e-1", "guessed"))
    await refused(client, "/hooks/shopify", swapped, shopify_headers(body, "e-2"))
    assert await claimed(pg_dsn, table) == []
    headers = shopify_headers(body, "e-3")
    first = await client.post("/hooks/shopify", data=body, headers=headers)
    second = await client.post("/hooks/shopify", data=body, headers=headers)

    assert (first.status, second.status) == (200, 200)
    assert upstream.bodies() == [body]
    # Shopify signs the body, not the event ID: the claim is bound to the body's digest.
    [(scope, claim, event_type)] = await claimed(pg_dsn, table)
    assert (scope, claim.partition("~")[0], event_type) == ("shopify", "e-3", "orders/create")
    forwarded = upstream.requests[0]
    sent = json.dumps({name: values[0] for name, values in forwarded.headers.items()})
    library = node(libraries, "shopify_validate.mjs", SHOPIFY_SECRET, forwarded.body, sent)
    assert library == "true"
    swapped_check = node(libraries, "shopify_validate.mjs", SHOPIFY_SECRET, swapped, sent)
    assert swapped_check == "false invalid_hmac"
