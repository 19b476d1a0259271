"""Webhook signature schemes: provider formats, rotation, replay bounds and configuration errors.

Expected signatures are computed here with hmac/hashlib/base64, independently of the module. The
providers' own libraries (stripe, standardwebhooks; twilio in test_twilio.py) cross-check both
directions: what they sign we accept, and what we accept they accept; Square's SDK's own test
vectors check the square scheme. PayPal's scheme fetches a certificate: tests/test_paypal.py.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import importlib
import json
import re
from datetime import UTC, datetime, tzinfo
from types import ModuleType
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy import errors, signatures

NOW = 1_700_000_000
BODY = json.dumps({"id": "evt_1", "type": "invoice.paid"}, separators=(",", ":")).encode()
TAMPERED = BODY[:-2] + bytes([BODY[-2] ^ 0x01]) + BODY[-1:]
# Standard Webhooks secrets are base64 keys; the other schemes use the same strings as-is.
SECRET = "whsec_" + base64.b64encode(b"current signing key 24 b").decode()
OLD = "whsec_" + base64.b64encode(b"previous signing key 24b").decode()
UNKNOWN = "whsec_" + base64.b64encode(b"an attacker's own key 24").decode()
MSG_ID = "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"
HMAC_HEADER = "X-Signature"
TWILIO_URL = "https://hooks.example.com/twilio/voice"
SQUARE_URL = "https://hooks.example.com/square"
HUBSPOT_URL = "https://hooks.example.com/hubspot"
SW = "standard-webhooks"
HEX = "ab" * 32  # well-formed, but nobody's signature
B64 = base64.b64encode(b"\xab" * 32).decode()

# PayPal's (RSA, tests/test_paypal.py), Discord's (Ed25519) and SendGrid's (ECDSA) keys are not
# shared secrets; Mailgun's signature is in the body, not a header (tests/test_provider_presets.py).
# Adyen's signature is in the body too, and its key is hex; SNS's is RSA under a fetched
# certificate, as PayPal's (tests/test_sns.py). Linear's reads a timestamp inside the body
# (tests/test_provider_presets.py, tests/test_provider_libraries_node.py).
NOT_SHARED = ("paypal", "discord", "mailgun", "sendgrid", "adyen", "sns", "linear")
ALL = tuple(s for s in signatures.SCHEMES if s not in NOT_SHARED)
URL_SIGNED = ("twilio", "square", "hubspot")
TIMESTAMPED = ("stripe", "paddle", "slack", SW, "twitch", "zoom", "hubspot")
MULTI = ("stripe", "paddle", SW)  # one header may carry several signatures
STAMP = {
    "stripe": "Stripe-Signature timestamp",
    "paddle": "Paddle-Signature timestamp",
    "slack": "X-Slack-Request-Timestamp",
    SW: "webhook-timestamp",
    "twitch": "Twitch-Eventsub-Message-Timestamp",
    "zoom": "x-zm-request-timestamp",
    "hubspot": "X-HubSpot-Request-Timestamp",
}

Headers = list[tuple[str, str]]


def hex_mac(secret: str, message: bytes, algorithm: str = "sha256") -> str:
    return hmac.new(secret.encode(), message, algorithm).hexdigest()


def b64_mac(key: bytes, message: bytes, algorithm: str = "sha256") -> str:
    return base64.b64encode(hmac.new(key, message, algorithm).digest()).decode()


def standard_key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix("whsec_"))


def query_for(scheme: str, body: bytes) -> str:
    """The raw query string the request arrives with: Twilio names a JSON body's SHA-256."""
    return f"bodySHA256={hashlib.sha256(body).hexdigest()}" if scheme == "twilio" else ""


def signed(scheme: str, *secrets: str, body: bytes = BODY, stamp: int = NOW) -> Headers:
    """The headers a provider sends, with one signature per secret (several during rotation)."""
    secrets = secrets or (SECRET,)
    if scheme in MULTI:
        return signed_multi(scheme, secrets, body, stamp)
    (secret,) = secrets
    return signed_single(scheme, secret, body, stamp)


def signed_multi(scheme: str, secrets: tuple[str, ...], body: bytes, stamp: int) -> Headers:
    """The headers of a scheme whose header carries a signature per secret (MULTI)."""
    if scheme == "stripe":
        macs = ",".join(f"v1={hex_mac(s, f'{stamp}.'.encode() + body)}" for s in secrets)
        return [("Stripe-Signature", f"t={stamp},{macs}")]
    if scheme == "paddle":
        macs = ";".join(f"h1={hex_mac(s, f'{stamp}:'.encode() + body)}" for s in secrets)
        return [("Paddle-Signature", f"ts={stamp};{macs}")]
    assert scheme == SW
    message = f"{MSG_ID}.{stamp}.".encode() + body
    macs = " ".join(f"v1,{b64_mac(standard_key(s), message)}" for s in secrets)
    return [
        ("webhook-id", MSG_ID),
        ("webhook-timestamp", str(stamp)),
        ("webhook-signature", macs),
    ]


def signed_single(scheme: str, secret: str, body: bytes, stamp: int) -> Headers:
    """The headers of a scheme that signs with one secret only."""
    body_only = {
        "github": ("X-Hub-Signature-256", f"sha256={hex_mac(secret, body)}"),
        "meta": ("X-Hub-Signature-256", f"sha256={hex_mac(secret, body)}"),
        "linear": ("Linear-Signature", hex_mac(secret, body)),
        "intercom": ("X-Hub-Signature", f"sha1={hex_mac(secret, body, 'sha1')}"),
    }
    if scheme in body_only:
        return [body_only[scheme]]
    if scheme in ("slack", "zoom", "twitch", "hubspot"):
        return signed_with_stamp(scheme, secret, body, stamp)
    if scheme == "shopify":
        return [("X-Shopify-Hmac-Sha256", b64_mac(secret.encode(), body))]
    if scheme == "twilio":
        url = f"{TWILIO_URL}?{query_for(scheme, body)}"
        return [("X-Twilio-Signature", b64_mac(secret.encode(), url.encode(), "sha1"))]
    if scheme == "square":
        signature = b64_mac(secret.encode(), SQUARE_URL.encode() + body)
        return [("x-square-hmacsha256-signature", signature)]
    assert scheme == "hmac"
    return [(HMAC_HEADER, hex_mac(secret, body))]


def signed_with_stamp(scheme: str, secret: str, body: bytes, stamp: int) -> Headers:
    """Slack's, Zoom's, HubSpot's and Twitch's headers."""
    if scheme == "hubspot":
        millis = str(stamp * 1000)  # HubSpot's timestamp is in milliseconds
        signature = b64_mac(secret.encode(), f"POST{HUBSPOT_URL}".encode() + body + millis.encode())
        return [("X-HubSpot-Signature-v3", signature), ("X-HubSpot-Request-Timestamp", millis)]
    if scheme == "slack":
        mac = hex_mac(secret, f"v0:{stamp}:".encode() + body)
        return [("X-Slack-Request-Timestamp", str(stamp)), ("X-Slack-Signature", f"v0={mac}")]
    if scheme == "zoom":
        mac = hex_mac(secret, f"v0:{stamp}:".encode() + body)
        return [("x-zm-request-timestamp", str(stamp)), ("x-zm-signature", f"v0={mac}")]
    assert scheme == "twitch"
    when = datetime.fromtimestamp(stamp, UTC).isoformat()
    mac = hex_mac(secret, MSG_ID.encode() + when.encode() + body)
    # BODY carries no "event": as a message type, only a revocation's fits it.
    return [(f"Twitch-Eventsub-Message-{name}", value) for name, value in
            (("Id", MSG_ID), ("Timestamp", when), ("Signature", f"sha256={mac}"),
             ("Type", "revocation"))]  # fmt: skip


def build(scheme: str, *secrets: str, **options: object) -> signatures.Verifier:
    if scheme == "hmac":
        options.setdefault("header", HMAC_HEADER)
    if scheme == "twilio":
        options.setdefault("public_url", TWILIO_URL)
    if scheme == "square":
        options.setdefault("public_url", SQUARE_URL)
    if scheme == "hubspot":
        options.setdefault("public_url", HUBSPOT_URL)
    return signatures.build(scheme, list(secrets or (SECRET,)), **options)  # type: ignore[arg-type]


def check(
    scheme: str,
    headers: Headers,
    body: bytes = BODY,
    now: float = NOW,
    *,
    secrets: tuple[str, ...] = (SECRET,),
    **options: object,
) -> None:
    # A tampered body comes with its own bodySHA256: the signed URL is what catches it.
    verifier = build(scheme, *secrets, **options)
    verifier.verify(CIMultiDict(headers), body, now, query=query_for(scheme, body))


def refused(
    scheme: str,
    headers: Headers,
    body: bytes = BODY,
    now: float = NOW,
    *,
    secrets: tuple[str, ...] = (SECRET,),
    **options: object,
) -> str:
    """The reason of the SignatureInvalid raised for this request; checks it leaks nothing."""
    with pytest.raises(errors.SignatureInvalid) as info:
        check(scheme, headers, body, now, secrets=secrets, **options)
    error = info.value
    assert (error.status, error.code) == (401, "signature_invalid")
    for secret in (SECRET, OLD, UNKNOWN):
        assert secret not in error.message
        assert secret.removeprefix("whsec_") not in error.message
    received = [part for _, value in headers for part in re.split(r"[,;= ]", value)]
    assert not [part for part in received if len(part) >= 16 and part in error.message]
    return error.message


def replaced(headers: Headers, name: str, value: str) -> Headers:
    return [(key, value if key == name else old) for key, old in headers]


def provider_library(name: str) -> ModuleType:
    """A provider's own library, from the test extra: if it is missing the test fails, not skips."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is needed for this cross-check; install the test extra ({exc})")


# --- every scheme ------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ALL)
def test_valid_signature_passes(scheme: str) -> None:
    check(scheme, signed(scheme))


@pytest.mark.parametrize("scheme", ALL)
def test_binary_body_is_verified_byte_for_byte(scheme: str) -> None:
    body = bytes(range(256))
    check(scheme, signed(scheme, body=body), body)
    assert refused(scheme, signed(scheme, body=body), body[:-1]) == "no signature matches"


@pytest.mark.parametrize("scheme", ALL)
def test_header_names_are_case_insensitive(scheme: str) -> None:
    check(scheme, [(name.upper(), value) for name, value in signed(scheme)])


@pytest.mark.parametrize("scheme", ALL)
def test_wrong_secret_is_refused(scheme: str) -> None:
    assert refused(scheme, signed(scheme, UNKNOWN)) == "no signature matches"


@pytest.mark.parametrize("scheme", ALL)
def test_tampered_body_is_refused(scheme: str) -> None:
    assert len(TAMPERED) == len(BODY)
    assert sum(a != b for a, b in zip(TAMPERED, BODY, strict=True)) == 1
    assert refused(scheme, signed(scheme), TAMPERED) == "no signature matches"


@pytest.mark.parametrize("scheme", [scheme for scheme in ALL if scheme not in URL_SIGNED])
def test_query_is_ignored_where_the_url_is_not_signed(scheme: str) -> None:
    build(scheme).verify(CIMultiDict(signed(scheme)), BODY, NOW, query="page=2&x=%FF")


REQUIRED = [(scheme, name) for scheme in ALL for name, _ in signed(scheme)]


@pytest.mark.parametrize(("scheme", "name"), REQUIRED)
def test_missing_header_is_refused(scheme: str, name: str) -> None:
    headers = [(key, value) for key, value in signed(scheme) if key != name]
    assert refused(scheme, headers) == f"{name} missing"


@pytest.mark.parametrize(("scheme", "name"), REQUIRED)
def test_repeated_header_is_refused_even_when_identical(scheme: str, name: str) -> None:
    headers = signed(scheme)
    headers += [(key, value) for key, value in headers if key == name]
    assert refused(scheme, headers) == f"{name} appears 2 times"


@pytest.mark.parametrize(
    ("scheme", "name", "value", "reason"),
    [
        ("stripe", "Stripe-Signature", "", "Stripe-Signature malformed"),
        ("stripe", "Stripe-Signature", "garbage", "Stripe-Signature malformed"),
        ("stripe", "Stripe-Signature", f"t={NOW},v1={HEX},", "Stripe-Signature malformed"),
        ("stripe", "Stripe-Signature", f"t={NOW},v1=xyz", "Stripe-Signature malformed"),
        ("stripe", "Stripe-Signature", f"t={NOW},v1=abc", "Stripe-Signature malformed"),
        ("stripe", "Stripe-Signature", f"t={NOW},v1=", "Stripe-Signature malformed"),
        ("stripe", "Stripe-Signature", f"v1={HEX}", "Stripe-Signature must carry exactly one t"),
        (
            "stripe",
            "Stripe-Signature",
            f"t={NOW},t={NOW},v1={HEX}",
            "Stripe-Signature must carry exactly one t",
        ),
        ("stripe", "Stripe-Signature", f"t={NOW}", "Stripe-Signature has no v1 signature"),
        ("stripe", "Stripe-Signature", f"t={NOW},v0={HEX}", "Stripe-Signature has no v1 signature"),
        (
            "stripe",
            "Stripe-Signature",
            f"t=1.7e9,v1={HEX}",
            "Stripe-Signature timestamp is not an integer",
        ),
        (
            "stripe",
            "Stripe-Signature",
            f"t=-{NOW},v1={HEX}",
            "Stripe-Signature timestamp is not an integer",
        ),
        (
            "stripe",
            "Stripe-Signature",
            f"t=,v1={HEX}",
            "Stripe-Signature timestamp is not an integer",
        ),
        (
            "stripe",
            "Stripe-Signature",
            f"t={'9' * 5000},v1={HEX}",
            "Stripe-Signature timestamp is not an integer",
        ),
        (
            "paddle",
            "Paddle-Signature",
            f"ts={NOW},h1={HEX}",
            "Paddle-Signature has no h1 signature",
        ),
        ("paddle", "Paddle-Signature", f"ts={NOW};h1=é", "Paddle-Signature malformed"),
        ("paddle", "Paddle-Signature", f"h1={HEX}", "Paddle-Signature must carry exactly one ts"),
        (
            "paddle",
            "Paddle-Signature",
            f"ts=yesterday;h1={HEX}",
            "Paddle-Signature timestamp is not an integer",
        ),
        ("slack", "X-Slack-Signature", HEX, "X-Slack-Signature malformed"),
        ("slack", "X-Slack-Signature", f"v1={HEX}", "X-Slack-Signature malformed"),
        ("slack", "X-Slack-Signature", "v0=zz", "X-Slack-Signature malformed"),
        (
            "slack",
            "X-Slack-Request-Timestamp",
            "now",
            "X-Slack-Request-Timestamp is not an integer",
        ),
        ("github", "X-Hub-Signature-256", HEX, "X-Hub-Signature-256 malformed"),
        ("github", "X-Hub-Signature-256", f"sha1={HEX[:40]}", "X-Hub-Signature-256 malformed"),
        ("github", "X-Hub-Signature-256", "sha256=not-hex", "X-Hub-Signature-256 malformed"),
        ("github", "X-Hub-Signature-256", "sha256=", "X-Hub-Signature-256 malformed"),
        ("shopify", "X-Shopify-Hmac-Sha256", "not base64!", "X-Shopify-Hmac-Sha256 malformed"),
        ("shopify", "X-Shopify-Hmac-Sha256", B64.rstrip("="), "X-Shopify-Hmac-Sha256 malformed"),
        (SW, "webhook-signature", "v1", "webhook-signature malformed"),
        (SW, "webhook-signature", "v1,@@@@", "webhook-signature malformed"),
        (
            SW,
            "webhook-signature",
            f"v1a,{B64}",
            "webhook-signature has no v1 signature",
        ),
        (
            SW,
            "webhook-signature",
            f"v2,{B64}",
            "webhook-signature has no v1 signature",
        ),
        (
            SW,
            "webhook-timestamp",
            f"{NOW}.5",
            "webhook-timestamp is not an integer",
        ),
        ("twilio", "X-Twilio-Signature", "not base64!", "X-Twilio-Signature malformed"),
        ("twilio", "X-Twilio-Signature", "", "X-Twilio-Signature malformed"),
        ("twilio", "X-Twilio-Signature", B64.rstrip("="), "X-Twilio-Signature malformed"),
        ("hmac", HMAC_HEADER, "zz", f"{HMAC_HEADER} malformed"),
        ("square", "x-square-hmacsha256-signature", "", "x-square-hmacsha256-signature malformed"),
        (
            "square",
            "x-square-hmacsha256-signature",
            "not base64!",
            "x-square-hmacsha256-signature malformed",
        ),
    ],
)
def test_malformed_header_is_refused(scheme: str, name: str, value: str, reason: str) -> None:
    assert refused(scheme, replaced(signed(scheme), name, value)) == reason


# --- timestamps --------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [-301, 301, -86_400, 86_400])
@pytest.mark.parametrize("scheme", TIMESTAMPED)
def test_timestamp_outside_tolerance_is_refused(scheme: str, offset: int) -> None:
    reason = refused(scheme, signed(scheme, stamp=NOW + offset))
    assert reason == f"{STAMP[scheme]} outside tolerance of 300s"


@pytest.mark.parametrize("offset", [-300, 300])
@pytest.mark.parametrize("scheme", TIMESTAMPED)
def test_timestamp_at_the_tolerance_edge_passes(scheme: str, offset: int) -> None:
    check(scheme, signed(scheme, stamp=NOW + offset))


@pytest.mark.parametrize("scheme", TIMESTAMPED)
def test_tolerance_is_configurable(scheme: str) -> None:
    check(scheme, signed(scheme, stamp=NOW - 59), tolerance=60)
    check(scheme, signed(scheme, stamp=NOW - 59), now=NOW + 0.5, tolerance=60)
    reason = refused(scheme, signed(scheme, stamp=NOW - 59), now=NOW + 1.5, tolerance=60)
    assert reason == f"{STAMP[scheme]} outside tolerance of 60s"
    reason = refused(scheme, signed(scheme, stamp=NOW + 61), tolerance=60.5)
    assert reason == f"{STAMP[scheme]} outside tolerance of 60.5s"


@pytest.mark.parametrize("scheme", TIMESTAMPED)
def test_stale_forgery_is_reported_as_forgery(scheme: str) -> None:
    assert refused(scheme, signed(scheme, UNKNOWN, stamp=NOW - 3600)) == "no signature matches"


# --- rotation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ALL)
def test_any_configured_secret_verifies(scheme: str) -> None:
    check(scheme, signed(scheme, SECRET), secrets=(OLD, SECRET))
    check(scheme, signed(scheme, OLD), secrets=(OLD, SECRET))
    assert refused(scheme, signed(scheme, UNKNOWN), secrets=(OLD, SECRET)) == "no signature matches"


@pytest.mark.parametrize("scheme", MULTI)
def test_one_matching_signature_among_several_passes(scheme: str) -> None:
    check(scheme, signed(scheme, UNKNOWN, SECRET))
    check(scheme, signed(scheme, SECRET, UNKNOWN))
    check(scheme, signed(scheme, UNKNOWN, OLD), secrets=(SECRET, OLD))
    assert refused(scheme, signed(scheme, UNKNOWN, OLD)) == "no signature matches"


# --- scheme details ----------------------------------------------------------------------------


def test_github_documented_test_vector() -> None:
    # https://docs.github.com/en/webhooks/using-webhooks/validating-webhook-deliveries
    secret, payload = "It's a Secret to Everybody", b"Hello, World!"
    digest = "757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert hmac.new(secret.encode(), payload, hashlib.sha256).hexdigest() == digest
    check("github", [("X-Hub-Signature-256", f"sha256={digest}")], payload, secrets=(secret,))
    check(
        "hmac",
        [("X-Hub-Signature-256", f"sha256={digest}")],
        payload,
        secrets=(secret,),
        header="X-Hub-Signature-256",
        prefix="sha256=",
    )


def test_stripe_ignores_signatures_of_other_schemes() -> None:
    v1 = hex_mac(SECRET, f"{NOW}.".encode() + BODY)
    check("stripe", [("Stripe-Signature", f"t={NOW},v0=not-hex,v1={v1},v9=x")])
    reason = refused("stripe", [("Stripe-Signature", f"t={NOW},v0={v1}")])
    assert reason == "Stripe-Signature has no v1 signature"


def test_stripe_key_is_the_whole_secret_string() -> None:
    bare = SECRET.removeprefix("whsec_")
    headers = [("Stripe-Signature", f"t={NOW},v1={hex_mac(bare, f'{NOW}.'.encode() + BODY)}")]
    assert refused("stripe", headers) == "no signature matches"


def test_standard_webhooks_accepts_svix_header_names() -> None:
    svix = [(name.replace("webhook-", "svix-"), value) for name, value in signed(SW)]
    check(SW, svix)
    stale = [
        (name.replace("webhook-", "svix-"), value) for name, value in signed(SW, stamp=NOW - 301)
    ]
    reason = refused(SW, stale)
    assert reason == "svix-timestamp outside tolerance of 300s"


def test_standard_webhooks_refuses_two_header_sets_that_differ() -> None:
    svix = [(name.replace("webhook-", "svix-"), value) for name, value in signed(SW)]
    check(SW, signed(SW) + svix)  # both sets, the same values: fine
    forged = signed(SW, UNKNOWN)
    forged_svix = [(name.replace("webhook-", "svix-"), value) for name, value in forged]
    assert refused(SW, signed(SW) + forged_svix) == "webhook-signature and svix-signature differ"
    assert refused(SW, forged + svix) == "webhook-signature and svix-signature differ"
    # A signed svix-* message with a webhook-id added (or the mirror case): the preset that
    # claims the other set's ID would claim an ID nobody signed.
    for extra in (("webhook-id", "forged-1"), ("svix-id", "forged-1")):
        base = svix if extra[0] == "webhook-id" else signed(SW)
        field_name = extra[0].split("-")[1]
        assert refused(SW, [*base, extra]) == f"webhook-{field_name} and svix-{field_name} differ"


def test_standard_webhooks_ignores_asymmetric_signatures() -> None:
    headers = signed(SW)
    (value,) = [value for name, value in headers if name == "webhook-signature"]
    check(SW, replaced(headers, "webhook-signature", f"v1a,{B64}  {value}"))


def test_standard_webhooks_id_is_signed_as_the_bytes_received() -> None:
    raw_id = b"msg_\xff\xfe"  # not UTF-8: aiohttp hands it over surrogate-escaped
    mac = b64_mac(standard_key(SECRET), raw_id + f".{NOW}.".encode() + BODY)
    headers = replaced(signed(SW), "webhook-signature", f"v1,{mac}")
    check(SW, replaced(headers, "webhook-id", raw_id.decode("utf-8", "surrogateescape")))


@pytest.mark.parametrize(
    "secret",
    [
        SECRET.removeprefix("whsec_"),
        "whsec_" + base64.b64encode(b"a 23-byte signing key!!").decode().rstrip("="),
    ],
    ids=["without whsec_", "unpadded"],
)
def test_standard_webhooks_secret_forms(secret: str) -> None:
    message = f"{MSG_ID}.{NOW}.".encode() + BODY
    text = secret.removeprefix("whsec_")
    key = base64.b64decode(text + "=" * (-len(text) % 4))
    headers = replaced(signed(SW), "webhook-signature", f"v1,{b64_mac(key, message)}")
    check(SW, headers, secrets=(secret,))


@pytest.mark.parametrize("encoding", ["hex", "base64"])
@pytest.mark.parametrize("algorithm", ["sha1", "sha256", "sha512"])
def test_hmac_algorithms_and_encodings(algorithm: str, encoding: str) -> None:
    mac = hmac.new(SECRET.encode(), BODY, algorithm).digest()
    value = mac.hex() if encoding == "hex" else base64.b64encode(mac).decode()
    check("hmac", [(HMAC_HEADER, value)], algorithm=algorithm, encoding=encoding)
    other = "sha512" if algorithm == "sha256" else "sha256"
    reason = refused("hmac", [(HMAC_HEADER, value)], algorithm=other, encoding=encoding)
    assert reason == "no signature matches"


def test_hmac_defaults_to_sha256_hex_without_prefix() -> None:
    check("hmac", [(HMAC_HEADER, hex_mac(SECRET, BODY))])
    assert refused("hmac", [(HMAC_HEADER, "sha256=" + hex_mac(SECRET, BODY))]) == (
        f"{HMAC_HEADER} malformed"
    )


def test_hmac_hex_is_case_insensitive_base64_is_not() -> None:
    check("hmac", [(HMAC_HEADER, hex_mac(SECRET, BODY).upper())])
    swapped = b64_mac(SECRET.encode(), BODY).swapcase()
    assert refused("hmac", [(HMAC_HEADER, swapped)], encoding="base64") == "no signature matches"


def test_hmac_prefix_is_required_when_configured() -> None:
    mac = hex_mac(SECRET, BODY)
    check("hmac", [(HMAC_HEADER, f"sha256={mac}")], prefix="sha256=")
    assert refused("hmac", [(HMAC_HEADER, mac)], prefix="sha256=") == f"{HMAC_HEADER} malformed"


# --- build -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "secrets", "options", "message"),
    [
        (
            "worldpay",
            [SECRET],
            {},
            "scheme must be one of stripe, github, shopify, standard-webhooks, slack, paddle, "
            "twilio, square, paypal, meta, linear, intercom, twitch, discord, zoom, mailgun, "
            "sendgrid, hubspot, adyen, sns, hmac; got 'worldpay'",
        ),
        ("twilio", [SECRET], {}, "public_url is required for scheme twilio"),
        (
            "github",
            [SECRET],
            {"verify_tokens": ["t"]},
            "verify_token: only for scheme meta, not github",
        ),
        ("square", [SECRET], {}, "public_url is required for scheme square"),
        (
            "slack",
            [SECRET],
            {"public_url": TWILIO_URL},
            "public_url: only for schemes twilio, square, hubspot, not slack",
        ),
        (
            "square",
            [SECRET],
            {"public_url": SQUARE_URL, "cert_hosts": ["api.paypal.com"]},
            "cert_hosts: only for schemes paypal, sns, not square",
        ),
        (
            "twilio",
            [SECRET],
            {"public_url": TWILIO_URL, "header": "X-Sig"},
            ("header: only for scheme hmac, not twilio"),
        ),
        *[
            (
                "twilio",
                [SECRET],
                {"public_url": url},
                "public_url must be the http(s) URL Twilio calls, scheme://host[:port]/path, "
                f"ASCII, without credentials, query or fragment; got {url!r}",
            )
            for url in (
                "hooks.example.com/twilio",
                "ftp://hooks.example.com/twilio",
                "HTTPS://hooks.example.com/twilio",
                "https:/hooks.example.com/twilio",
                "https:///twilio",
                f"{TWILIO_URL}?a=1",
                f"{TWILIO_URL}?",
                f"{TWILIO_URL}#rc=2",
                "https://user:token@hooks.example.com/twilio",
                "https://[::1]:8443/twilio",
                "https://hooks.example.com:0/twilio",
                "https://hooks.example.com:65536/twilio",
                "https://hooks.example.com:https/twilio",
                "https://hooks.example.com:/twilio",
                "https://hooks.example.com/tw ilio",
                "https://hooks.example.com/twilio\n",
                "https://hooks.example.com/twílio",
            )
        ],
        ("stripe", [], {}, "secrets must be a non-empty list"),
        ("stripe", SECRET, {}, "secrets must be a non-empty list"),
        ("stripe", [SECRET, ""], {}, "secrets[1] must be a non-empty string"),
        ("github", ["  "], {}, "secrets[0] must be a non-empty string"),
        ("slack", [f"{SECRET}\n"], {}, "secrets[0] has leading or trailing whitespace"),
        (
            SW,
            ["whsec_not base64!"],
            {},
            "secrets[0] must be base64, optionally after whsec_",
        ),
        (
            SW,
            [SECRET, "whsec_"],
            {},
            "secrets[1] must be base64, optionally after whsec_",
        ),
        ("github", [SECRET], {"header": "X-Sig"}, "header: only for scheme hmac, not github"),
        (
            "stripe",
            [SECRET],
            {"algorithm": "sha1", "encoding": "hex"},
            "algorithm, encoding: only for scheme hmac, not stripe",
        ),
        ("shopify", [SECRET], {"prefix": ""}, "prefix: only for scheme hmac, not shopify"),
        ("hmac", [SECRET], {}, "header is required for scheme hmac"),
        (
            "hmac",
            [SECRET],
            {"header": "X Sig"},
            "header must be a header name without '_', got 'X Sig'",
        ),
        (
            "hmac",
            [SECRET],
            {"header": "X-Sig:"},
            "header must be a header name without '_', got 'X-Sig:'",
        ),
        ("hmac", [SECRET], {"header": ""}, "header must be a header name without '_', got ''"),
        (
            "hmac",
            [SECRET],
            {"header": "X_Sig"},
            "header must be a header name without '_', got 'X_Sig'",
        ),
        (
            "hmac",
            [SECRET],
            {"header": "X-Sig", "algorithm": "md5"},
            "algorithm must be one of sha1, sha256, sha512; got 'md5'",
        ),
        (
            "hmac",
            [SECRET],
            {"header": "X-Sig", "algorithm": "SHA256"},
            "algorithm must be one of sha1, sha256, sha512; got 'SHA256'",
        ),
        (
            "hmac",
            [SECRET],
            {"header": "X-Sig", "encoding": "base32"},
            "encoding must be one of hex, base64; got 'base32'",
        ),
        (
            "stripe",
            [SECRET],
            {"tolerance": 0},
            "tolerance must be a positive number of seconds, got 0",
        ),
        (
            "paddle",
            [SECRET],
            {"tolerance": -1.0},
            "tolerance must be a positive number of seconds, got -1.0",
        ),
        (
            "slack",
            [SECRET],
            {"tolerance": float("nan")},
            "tolerance must be a positive number of seconds, got nan",
        ),
        (
            SW,
            [SECRET],
            {"tolerance": float("inf")},
            "tolerance must be a positive number of seconds, got inf",
        ),
    ],
)
def test_build_rejects_bad_settings(
    scheme: str, secrets: list[str], options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        signatures.build(scheme, secrets, **options)  # type: ignore[arg-type]
    assert str(info.value) == message
    assert not [secret for secret in secrets if len(secret.strip()) > 6 and secret in message]


@pytest.mark.parametrize("scheme", ALL)
def test_verifier_hides_its_secrets(scheme: str) -> None:
    verifier = build(scheme, OLD, SECRET)
    shown = f"{verifier!r} {verifier!s}"
    assert verifier.scheme == scheme
    assert f"scheme='{scheme}'" in shown
    for secret in (OLD, SECRET):
        for form in (secret, secret.removeprefix("whsec_"), repr(secret.encode())):
            assert form not in shown
        assert repr(standard_key(secret)) not in shown


@pytest.mark.parametrize("scheme", ALL)
def test_verifier_is_immutable(scheme: str) -> None:
    verifier = build(scheme)
    assert dataclasses.is_dataclass(verifier)
    assert not hasattr(verifier, "__dict__")
    for field in dataclasses.fields(verifier):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(verifier, field.name, getattr(verifier, field.name))
    assert build(scheme) == verifier


@pytest.mark.parametrize("scheme", ALL)
def test_a_tenants_secret_verifies_for_that_tenant_only(scheme: str) -> None:
    tenants = signatures.TenantSignatures.of(
        {"acme": build(scheme, SECRET), "globex": build(scheme, OLD)}
    )
    headers, query = CIMultiDict(signed(scheme, SECRET)), query_for(scheme, BODY)

    tenants.for_tenant("acme").verify(headers, BODY, NOW, query=query)
    reasons = []
    for verifier in (tenants.for_tenant("globex"), tenants.for_tenant("initech"), tenants):
        with pytest.raises(errors.SignatureInvalid) as info:
            verifier.verify(headers, BODY, NOW, query=query)
        reasons.append(info.value.message)

    no_tenant = "no secret is configured for this path's tenant"
    assert reasons == ["no signature matches", no_tenant, no_tenant]
    alone = build(scheme)
    assert (tenants.scheme, tenants.headers, tenants.signed_headers) == (
        alone.scheme,
        alone.headers,
        alone.signed_headers,
    )
    shown = repr(tenants)
    assert not [s for s in (SECRET, OLD, repr(standard_key(SECRET))) if s in shown]


# --- the providers' own libraries ---------------------------------------------------------------


def test_stripe_library_signature_is_accepted() -> None:
    stripe = provider_library("stripe")
    header = stripe.WebhookSignature.generate_signature_header(BODY.decode(), SECRET, timestamp=NOW)
    check("stripe", [("Stripe-Signature", header)])
    check("stripe", [("Stripe-Signature", header)], secrets=(OLD, SECRET))
    assert (
        refused("stripe", [("Stripe-Signature", header)], secrets=(OLD,)) == "no signature matches"
    )


@pytest.mark.parametrize("signers", [(SECRET,), (UNKNOWN, SECRET), (SECRET, OLD)])
def test_what_we_accept_stripe_library_accepts(signers: tuple[str, ...]) -> None:
    stripe = provider_library("stripe")
    ((_, header),) = signed("stripe", *signers)
    check("stripe", [("Stripe-Signature", header)])
    # tolerance=None: the library would read the real clock; our tolerance is tested above.
    assert stripe.WebhookSignature.verify_header(BODY.decode(), header, SECRET, None)
    ((_, forged),) = signed("stripe", UNKNOWN)
    with pytest.raises(stripe.SignatureVerificationError):
        stripe.WebhookSignature.verify_header(BODY.decode(), forged, SECRET, None)


class FrozenDatetime(datetime):
    """``datetime`` whose ``now()`` is NOW, for a library that reads the clock itself."""

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> FrozenDatetime:
        return cls.fromtimestamp(NOW, tz)


@pytest.fixture
def standardwebhooks(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = provider_library("standardwebhooks")
    monkeypatch.setattr(
        importlib.import_module("standardwebhooks.webhooks"), "datetime", FrozenDatetime
    )
    return module


def test_standardwebhooks_library_signature_is_accepted(standardwebhooks: ModuleType) -> None:
    webhook = standardwebhooks.Webhook(SECRET)
    value = webhook.sign(MSG_ID, datetime.fromtimestamp(NOW, UTC), BODY.decode())
    headers = [
        ("webhook-id", MSG_ID),
        ("webhook-timestamp", str(NOW)),
        ("webhook-signature", value),
    ]
    check(SW, headers)
    check(SW, headers, secrets=(OLD, SECRET))
    assert refused(SW, headers, secrets=(OLD,)) == "no signature matches"


@pytest.mark.parametrize(
    ("signers", "stamp"),
    [((SECRET,), NOW), ((UNKNOWN, SECRET), NOW), ((SECRET,), NOW - 300), ((SECRET,), NOW + 300)],
)
def test_what_we_accept_standardwebhooks_library_accepts(
    standardwebhooks: ModuleType, signers: tuple[str, ...], stamp: int
) -> None:
    headers = signed(SW, *signers, stamp=stamp)
    check(SW, headers)
    assert standardwebhooks.Webhook(SECRET).verify(BODY, dict(headers)) == json.loads(BODY)


@pytest.mark.parametrize(
    ("signer", "stamp"), [(UNKNOWN, NOW), (SECRET, NOW - 301), (SECRET, NOW + 301)]
)
def test_what_we_refuse_standardwebhooks_library_refuses(
    standardwebhooks: ModuleType, signer: str, stamp: int
) -> None:
    headers = signed(SW, signer, stamp=stamp)
    refused(SW, headers)
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(SECRET).verify(BODY, dict(headers))


# Square's SDK (squareup, 7 MB of generated API client with httpx and pydantic) is not a test
# dependency: its webhook helper's own test vectors are, from square/square-python-sdk,
# tests/integration/test_webhooks_helper.py (commit ef5c175), checked against
# square.utils.webhooks_helper.verify_signature.
SQUARE_BODY = (
    b'{"merchant_id":"MLEFBHHSJGVHD","type":"webhooks.test_notification","event_id":'
    b'"ac3ac95b-f97d-458c-a6e6-18981597e05f","created_at":"2022-07-13T20:30:59.037339943Z",'
    b'"data":{"type":"webhooks","id":"bc368e64-01aa-407e-b46e-3231809b1129"}}'
)
SQUARE_SIGNATURE = "GF4YkrJgGBDZ9NIYbNXBnMzqb2HoL4RW/S6vkZ9/2N4="
SQUARE_KEY = "Ibxx_5AKakO-3qeNVR61Dw"
SQUARE_NOTIFIED = "https://webhook.site/679a4f3a-dcfa-49ee-bac5-9d0edad886b9"


def square_check(signature: str, key: str, url: str, body: bytes) -> None:
    headers = CIMultiDict({"x-square-hmacsha256-signature": signature})
    signatures.build("square", [key], public_url=url).verify(headers, body, NOW)


@pytest.mark.parametrize(
    ("signature", "key", "url", "body"),
    [
        (SQUARE_SIGNATURE, SQUARE_KEY, SQUARE_NOTIFIED, SQUARE_BODY),
        (
            "Cxt7+aTi4rKgcA0bC4g9EHdVtLSDWdqccmL5MvihU4U=",
            "signature-key",
            "https://webhook.site/webhooks",
            b'{"data":{"type":"webhooks","id":">id<"}}',
        ),
    ],
)
def test_square_sdk_vectors_are_accepted(signature: str, key: str, url: str, body: bytes) -> None:
    square_check(signature, key, url, body)


@pytest.mark.parametrize(
    ("signature", "key", "url", "body"),
    [
        # Another URL, another key, another signature, another body: as the SDK's tests refuse.
        (
            SQUARE_SIGNATURE,
            SQUARE_KEY,
            "https://webhook.site/79a4f3a-dcfa-49ee-bac5-9d0edad886b9",
            SQUARE_BODY,
        ),
        (SQUARE_SIGNATURE, "MCmhFRxGX82xMwg5FsaoQA", SQUARE_NOTIFIED, SQUARE_BODY),
        ("1z2n3DEJJiUPKcPzQo1ftvbxGdw=", SQUARE_KEY, SQUARE_NOTIFIED, SQUARE_BODY),
        (SQUARE_SIGNATURE, SQUARE_KEY, SQUARE_NOTIFIED, SQUARE_BODY.replace(b"07-13", b"06-13")),
        (SQUARE_SIGNATURE, SQUARE_KEY, SQUARE_NOTIFIED, SQUARE_BODY.replace(b",", b", ")),
    ],
)
def test_square_sdk_vectors_refused_are_refused(
    signature: str, key: str, url: str, body: bytes
) -> None:
    with pytest.raises(errors.SignatureInvalid, match=r"^no signature matches$"):
        square_check(signature, key, url, body)


def test_square_signs_the_query_the_notification_url_carries() -> None:
    url = "https://hooks.example.com/square"
    signature = b64_mac(SECRET.encode(), f"{url}?tenant=acme".encode() + BODY)
    headers = CIMultiDict({"x-square-hmacsha256-signature": signature})
    verifier = signatures.build("square", [SECRET], public_url=url)

    verifier.verify(headers, BODY, NOW, query="tenant=acme")
    with pytest.raises(errors.SignatureInvalid, match=r"^no signature matches$"):
        verifier.verify(headers, BODY, NOW, query="tenant=globex")
    with pytest.raises(errors.SignatureInvalid, match=r"^no signature matches$"):
        verifier.verify(headers, BODY, NOW)


# HubSpot v3: base64 HMAC-SHA256 of POST + the URI + body + timestamp (ms), cross-checked with
# HubSpot's own library (hubspot-api-client's hubspot.utils.signature.Signature) both ways.

HUBSPOT_BODY = (
    b'[{"eventId":1,"subscriptionId":12345,"portalId":62515,"occurredAt":1564113600000,'
    b'"subscriptionType":"contact.creation","attemptNumber":0,"objectId":123,'
    b'"changeSource":"CRM","changeFlag":"NEW","appId":54321}]'
)


@pytest.fixture
def hubspot_signature(monkeypatch: pytest.MonkeyPatch) -> Any:
    provider_library("hubspot")
    module = importlib.import_module("hubspot.utils.signature")
    monkeypatch.setattr(module, "datetime", FrozenDatetime)  # its clock reads NOW
    return module.Signature


@pytest.mark.parametrize("query", ["", "portal=62515&app=54321"])
def test_hubspot_library_signature_is_accepted_and_ours_by_it(
    hubspot_signature: Any, query: str
) -> None:
    uri = f"{HUBSPOT_URL}?{query}" if query else HUBSPOT_URL
    millis = str(NOW * 1000)
    theirs = hubspot_signature.get_signature(
        SECRET, HUBSPOT_BODY.decode(), "v3", http_uri=uri, http_method="POST", timestamp=millis
    )
    headers = CIMultiDict({"X-HubSpot-Signature-v3": theirs, "X-HubSpot-Request-Timestamp": millis})
    verifier = build("hubspot")

    verifier.verify(headers, HUBSPOT_BODY, NOW, query=query)
    assert hubspot_signature.is_valid(
        theirs, SECRET, HUBSPOT_BODY.decode(), http_uri=uri, signature_version="v3",
        timestamp=millis,
    )  # fmt: skip
    # What the library refuses (another body, URI or time), the proxy refuses.
    for body, sent_query, stamp in [
        (HUBSPOT_BODY.replace(b'"eventId":1', b'"eventId":2'), query, millis),
        (HUBSPOT_BODY, query + "&x=1", millis),
        (HUBSPOT_BODY, query, str(NOW * 1000 + 1)),
    ]:
        changed = CIMultiDict(headers)
        changed["X-HubSpot-Request-Timestamp"] = stamp
        assert not hubspot_signature.is_valid(
            theirs, SECRET, body.decode(), http_uri=f"{HUBSPOT_URL}?{sent_query}".rstrip("?"),
            signature_version="v3", timestamp=stamp,
        )  # fmt: skip
        with pytest.raises(errors.SignatureInvalid, match=r"^no signature matches$"):
            verifier.verify(changed, body, NOW, query=sent_query)


def test_hubspot_timestamp_is_milliseconds_within_five_minutes() -> None:
    stale = signed("hubspot", stamp=NOW - 301)
    assert refused("hubspot", stale) == "X-HubSpot-Request-Timestamp outside tolerance of 300s"
    check("hubspot", signed("hubspot", stamp=NOW - 299))


def test_hubspot_signs_the_query_with_its_listed_escapes_decoded() -> None:
    # HubSpot decodes %3A, %2F, %40, ... in the URI it signs: either spelling verifies.
    sent = "next=https%3A%2F%2Fexample.com%2Fa&who=a%40b&space=a%20b"
    decoded = "next=https://example.com/a&who=a@b&space=a%20b"
    millis = str(NOW * 1000)
    verifier = build("hubspot")
    for signed_query in (sent, decoded):
        message = f"POST{HUBSPOT_URL}?{signed_query}".encode() + BODY + millis.encode()
        headers = CIMultiDict(
            {"X-HubSpot-Signature-v3": b64_mac(SECRET.encode(), message),
             "X-HubSpot-Request-Timestamp": millis}
        )  # fmt: skip
        verifier.verify(headers, BODY, NOW, query=sent)
        with pytest.raises(errors.SignatureInvalid, match=r"^no signature matches$"):
            verifier.verify(headers, BODY, NOW, query=sent.replace("a%20b", "a%21b"))


# SendGrid's Event Webhook: ECDSA P-256 over timestamp + body; the vectors of SendGrid's own
# library (sendgrid/sendgrid-python, test/unit/test_eventwebhook.py), and its EventWebhook
# checked against the same requests.

SENDGRID_KEY = (
    "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE83T4O/n84iotIvIW4mdBgQ/7dAfSmpqIM8kF9mN1flpVKS3GRqe62gw"
    "+2fNNRaINXvVpiglSI8eNEc6wEA3F+g=="
)
SENDGRID_SIGNATURE = (
    "MEUCIGHQVtGj+Y3LkG9fLcxf3qfI10QysgDWmMOVmxG0u6ZUAiEAyBiXDWzM"
    "+uOe5W0JuG+luQAbPIqHh89M15TluLtEZtM="
)
SENDGRID_STAMP = "1600112502"
SENDGRID_BODY = (
    json.dumps(
        [{"email": "hello@world.com", "event": "dropped", "reason": "Bounced Address",
          "sg_event_id": "ZHJvcC0xMDk5NDkxOS1MUnpYbF9OSFN0T0doUTRrb2ZTbV9BLTA",
          "sg_message_id":
              "LRzXl_NHStOGhQ4kofSm_A.filterdrecv-p3mdw1-756b745b58-kmzbl-18-5F5FC76C-9.0",
          "smtp-id": "<LRzXl_NHStOGhQ4kofSm_A@ismtpd0039p1iad1.sendgrid.net>",
          "timestamp": 1600112492}],
        sort_keys=True, separators=(",", ":"),
    ) + "\r\n"
).encode()  # fmt: skip
SENDGRID_OTHER_KEY = (
    "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEqTxd43gyp8IOEto2LdIfjRQrIbsd4SXZkLW6jDutdhXSJCWHw8REntlo7"
    "aNDthvj+y7GjUuFDb/R1NGe1OPzpA=="
)
SENDGRID_BAD_SIGNATURE = (
    "MEUCIQCtIHJeH93Y+qpYeWrySphQgpNGNr/U+UyUlBkU6n7RAwIgJTz2C+8a"
    "8xonZGi6BpSzoQsbVRamr2nlxFDWYNH3j/0="
)


def sendgrid_check(key: str, body: bytes, signature: str, stamp: str) -> None:
    headers = CIMultiDict(
        {"X-Twilio-Email-Event-Webhook-Signature": signature,
         "X-Twilio-Email-Event-Webhook-Timestamp": stamp}
    )  # fmt: skip
    signatures.build("sendgrid", [key]).verify(headers, body, int(SENDGRID_STAMP))


def test_sendgrid_library_vectors_are_accepted_as_it_accepts_them() -> None:
    library = provider_library("sendgrid").EventWebhook(SENDGRID_KEY)
    assert library.verify_signature(SENDGRID_BODY.decode(), SENDGRID_SIGNATURE, SENDGRID_STAMP)
    sendgrid_check(SENDGRID_KEY, SENDGRID_BODY, SENDGRID_SIGNATURE, SENDGRID_STAMP)
    # Rotation: the key SendGrid shows now among others.
    headers = CIMultiDict(
        {"X-Twilio-Email-Event-Webhook-Signature": SENDGRID_SIGNATURE,
         "X-Twilio-Email-Event-Webhook-Timestamp": SENDGRID_STAMP}
    )  # fmt: skip
    both = signatures.build("sendgrid", [SENDGRID_OTHER_KEY, SENDGRID_KEY])
    both.verify(headers, SENDGRID_BODY, int(SENDGRID_STAMP))


@pytest.mark.parametrize(
    ("key", "body", "signature", "stamp"),
    [
        # Another key, body, signature or timestamp: as the library's tests refuse.
        (SENDGRID_OTHER_KEY, SENDGRID_BODY, SENDGRID_SIGNATURE, SENDGRID_STAMP),
        (SENDGRID_KEY, b"payload", SENDGRID_SIGNATURE, SENDGRID_STAMP),
        (SENDGRID_KEY, SENDGRID_BODY, SENDGRID_BAD_SIGNATURE, SENDGRID_STAMP),
        (SENDGRID_KEY, SENDGRID_BODY, SENDGRID_SIGNATURE, "1600112503"),
    ],
)
def test_sendgrid_library_vectors_refused_are_refused(
    key: str, body: bytes, signature: str, stamp: str
) -> None:
    library = provider_library("sendgrid").EventWebhook(key)
    assert not library.verify_signature(body.decode(), signature, stamp)
    with pytest.raises(errors.SignatureInvalid, match=r"^no signature matches$"):
        sendgrid_check(key, body, signature, stamp)


def test_sendgrid_timestamp_is_checked_where_the_library_does_not() -> None:
    headers = CIMultiDict(
        {"X-Twilio-Email-Event-Webhook-Signature": SENDGRID_SIGNATURE,
         "X-Twilio-Email-Event-Webhook-Timestamp": SENDGRID_STAMP}
    )  # fmt: skip
    verifier = signatures.build("sendgrid", [SENDGRID_KEY])
    with pytest.raises(errors.SignatureInvalid, match="Timestamp outside tolerance of 300s"):
        verifier.verify(headers, SENDGRID_BODY, int(SENDGRID_STAMP) + 301)


@pytest.mark.parametrize(
    "key",
    [
        "not base64!",
        base64.b64encode(b"\x30\x03\x02\x01\x01").decode(),  # DER, but no public key
        # An Ed25519 key (Discord's kind), not P-256.
        "MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE=",
        SENDGRID_KEY.rstrip("="),
    ],
)
def test_a_sendgrid_key_that_is_no_base64_p256_key_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match=r"^secrets\[0\] must be SendGrid's verification key"):
        signatures.build("sendgrid", [key])


@pytest.mark.parametrize("scheme", ["discord", "sendgrid"])
def test_a_public_key_scheme_describes_itself_with_its_keys_unread(scheme: str) -> None:
    unread = signatures.settings(scheme).unread()
    assert unread.scheme == scheme
    assert unread.headers
    assert unread.signed_headers
    with pytest.raises(errors.SignatureInvalid, match="the signing secrets were not read"):
        unread.verify(CIMultiDict(), BODY, NOW)


# Adyen: each NotificationRequestItem's fields joined by ":", base64 HMAC-SHA256 under a hex key;
# the vectors of Adyen's Python library (Adyen/adyen-python-api-library, test/test_util.py and
# test/mocks/util/*.json), and Adyen.util checked against the same bodies both ways.

ADYEN_KEY = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
ADYEN_ITEM: dict[str, object] = {
    "pspReference": "7914073381342284",
    "merchantReference": "TestPayment-1407325143704",
    "merchantAccountCode": "TestMerchant",
    "amount": {"currency": "EUR", "value": 1130},
    "eventCode": "AUTHORISATION",
    "success": "true",
    "eventDate": "2019-05-06T17:15:34.121+02:00",
    "operations": ["CANCEL", "CAPTURE", "REFUND"],
    "paymentMethod": "visa",
    "additionalData": {"hmacSignature": "coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="},
}
# Notifications Adyen signed, whose merchantReference holds a ":" or backslashes (unescaped).
ADYEN_MOCK_KEY = "74F490DD33F7327BAECC88B2947C011FC02D014A473AAA33A8EC93E4DC069174"
ADYEN_MOCKS: list[dict[str, object]] = [
    {"additionalData": {"hmacSignature": "2EQYm7YJpKO4EtHSPu55SQTyWf8dkW5u2nD1tJFpViA="},
     "amount": {"currency": "EUR", "value": 1000}, "eventCode": "AUTHORISATION",
     "eventDate": "2023-01-10T13:40:54+01:00", "merchantAccountCode": "AntoniStroinski",
     "merchantReference": ":slashes are fun", "pspReference": "M8NB66SBZSGLNK82",
     "reason": "039404:1111:03/2030", "success": "true"},
    {"additionalData": {"hmacSignature": "nIgT81gaB5oJpn2jPXupDq68iRo2wUlBsuYjtYfwKqo="},
     "amount": {"currency": "EUR", "value": 1000}, "eventCode": "AUTHORISATION",
     "eventDate": "2023-01-09T16:27:29+01:00", "merchantAccountCode": "AntoniStroinski",
     "merchantReference": "\\\\slashes are fun", "pspReference": "T7FD4VM4D3RZNN82",
     "reason": "076181:1111:03/2030", "success": "true"},
]  # fmt: skip


def adyen_body(*items: dict[str, object]) -> bytes:
    wrapped = [{"NotificationRequestItem": item} for item in items]
    return json.dumps({"live": "false", "notificationItems": wrapped}).encode()


def adyen_check(body: bytes, *keys: str) -> None:
    signatures.build("adyen", list(keys or (ADYEN_KEY,))).verify(CIMultiDict(), body, NOW)


def adyen_refused(body: bytes, *keys: str) -> str:
    with pytest.raises(errors.SignatureInvalid) as info:
        adyen_check(body, *keys)
    return info.value.message


@pytest.fixture
def adyen_util() -> Any:
    provider_library("Adyen")
    return importlib.import_module("Adyen.util")


@pytest.mark.parametrize(
    ("key", "item"), [(ADYEN_KEY, ADYEN_ITEM)] + [(ADYEN_MOCK_KEY, mock) for mock in ADYEN_MOCKS]
)
def test_adyen_library_vectors_are_accepted_as_it_accepts_them(
    adyen_util: Any, key: str, item: dict[str, object]
) -> None:
    assert adyen_util.is_valid_hmac_notification(json.loads(adyen_body(item)), key)
    adyen_check(adyen_body(item), key)
    adyen_check(adyen_body(item), ADYEN_MOCK_KEY.lower(), key)  # rotation; either case


def test_adyen_library_signature_is_accepted_and_what_we_refuse_it_refuses(
    adyen_util: Any,
) -> None:
    item = {key: value for key, value in ADYEN_ITEM.items() if key != "additionalData"}
    item |= {"originalReference": "8313842560770001", "eventCode": "REFUND"}
    signature = adyen_util.generate_notification_sig(item, ADYEN_KEY).decode()
    adyen_check(adyen_body({**item, "additionalData": {"hmacSignature": signature}}))
    for name, value in [("pspReference", "7914073381342285"), ("merchantReference", "x"),
                        ("success", "false"), ("amount", {"currency": "EUR", "value": 1131}),
                        ("originalReference", None)]:  # fmt: skip
        changed = {**item, name: value, "additionalData": {"hmacSignature": signature}}
        if value is None:
            del changed[name]
        body = adyen_body(changed)
        assert not adyen_util.is_valid_hmac_notification(json.loads(body), ADYEN_KEY)
        assert adyen_refused(body) == "no signature matches"


def test_adyen_verifies_every_item_where_its_library_checks_the_first(adyen_util: Any) -> None:
    forged = {**ADYEN_ITEM, "pspReference": "7914073381342299"}
    body = adyen_body(ADYEN_ITEM, forged)

    assert adyen_util.is_valid_hmac_notification(json.loads(body), ADYEN_KEY)
    assert adyen_refused(body) == "no signature matches"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[]", "the body has no notificationItems"),
        (b'{"notificationItems": []}', "the body has no notificationItems"),
        (b'{"notificationItems": [{"Item": {}}]}',
         "notificationItems[0] has no NotificationRequestItem"),
        (adyen_body({k: v for k, v in ADYEN_ITEM.items() if k != "additionalData"}),
         "notificationItems[0] has no additionalData.hmacSignature"),
        (adyen_body({**ADYEN_ITEM, "additionalData": {"hmacSignature": "not base64!"}}),
         "notificationItems[0].additionalData.hmacSignature malformed"),
        (adyen_body({**ADYEN_ITEM, "success": True}), "notificationItems[0].success malformed"),
        (adyen_body({**ADYEN_ITEM, "amount": {"currency": "EUR", "value": 11.3}}),
         "notificationItems[0].value malformed"),
        # A ":" where the joiner would let another split of the signed text move the key.
        (adyen_body({**ADYEN_ITEM, "pspReference": "7914073381342284:"}),
         "notificationItems[0].pspReference malformed"),
        (adyen_body({**ADYEN_ITEM, "eventCode": "AUTHORISATION:x"}),
         "notificationItems[0].eventCode malformed"),
        # A key twice: the app's parser may read the one that was not verified.
        (adyen_body(ADYEN_ITEM).replace(b'"pspReference"', b'"pspReference": "1", "pspReference"'),
         "the body has no notificationItems"),
    ],
)  # fmt: skip
def test_an_adyen_body_that_is_not_a_signed_notification_is_refused(
    body: bytes, reason: str
) -> None:
    assert adyen_refused(body) == reason


@pytest.mark.parametrize("key", ["not hex", ADYEN_KEY[:-1], "0x" + ADYEN_KEY, "é" * 4])
def test_an_adyen_key_that_is_not_hex_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match=r"^secrets\[0\] must be the HMAC key in hex"):
        signatures.build("adyen", [key])
