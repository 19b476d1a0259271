"""Webhook signature verification: each provider's signing scheme as a small immutable verifier.

``build`` turns a route's ``verify`` settings into a ``Verifier`` once, at start-up; ``verify`` is
then a pure function of the request's headers, raw body, raw query string and the current time, so
this module knows nothing of aiohttp. Every configured secret is tried against every signature a
request carries, which is how rotation works. On a templated route with ``tenant_secrets`` each
tenant has a verifier of its own (``TenantSignatures``), so one tenant's secret never verifies
another tenant's path. A refusal's reason names the header at fault and never contains a secret or
a received signature. PayPal's scheme checks an RSA signature under a certificate the request
names: ``prepare`` fetches it first (``certificates``, the one part that reaches the network),
and ``verify`` reads it from the cache. SendGrid's (ECDSA) and Discord's (Ed25519) check a
public key's signature with ``cryptography``, imported only for such a route.
"""

from __future__ import annotations

import binascii
import datetime
import hashlib
import hmac
import json
import math
import re
import urllib.parse
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, NoReturn, Protocol, TypeGuard

from proxy import errors, event_ids

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePublicKey
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from proxy import certificates

SCHEMES: tuple[str, ...] = (
    "stripe", "github", "shopify", "standard-webhooks", "slack", "paddle", "twilio", "square",
    "paypal", "meta", "linear", "intercom", "twitch", "discord", "zoom", "mailgun", "sendgrid",
    "hubspot", "adyen", "sns", "hmac",
)  # fmt: skip
# The schemes that sign the URL the provider calls: they need ``public_url``.
URL_SCHEMES = ("twilio", "square", "hubspot")
# The schemes that check a public key's signature with ``cryptography`` (the extra named after
# each: ``discord``, ``sendgrid``).
KEY_SCHEMES = ("discord", "sendgrid")
# PayPal's certificate hosts (its live and sandbox APIs), and the domain its certificate names.
PAYPAL_CERT_HOSTS = (
    "api.paypal.com", "api-m.paypal.com", "api.sandbox.paypal.com", "api-m.sandbox.paypal.com",
)  # fmt: skip
PAYPAL_DOMAIN = "paypal.com"
# AWS SNS's certificate hosts, sns.<region>.amazonaws.com (.cn in China), as AWS's validators
# hold SigningCertURL to them; the allow-list of the ``sns`` scheme unless cert_hosts replaces it.
SNS_CERT_HOST = re.compile(r"sns\.[a-z0-9-]+\.amazonaws\.com(\.cn)?")
# The schemes that fetch a signing certificate (``certificates``): cert_hosts and ca_file.
CERT_SCHEMES = ("paypal", "sns")
DEFAULT_TOLERANCE = 300.0  # seconds
ALGORITHMS = ("sha1", "sha256", "sha512")
ENCODINGS = ("hex", "base64")

_STANDARD_PREFIX = "whsec_"
_FORM = "application/x-www-form-urlencoded"
_TWILIO_SETTINGS = "X-Twilio-Webhooks-Signature-Settings"
_TWILIO_ALGORITHMS = {"HMAC_SHA1": "sha1", "HMAC_SHA256": "sha256"}
_MAX_TIMESTAMP_DIGITS = 15
_MAX_TIME_TEXT = 40
_SQUARE = "x-square-hmacsha256-signature"
_PAYPAL_ALGORITHM = "SHA256withRSA"
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 field name

# scheme: (header, algorithm, encoding, prefix) for a signature over the body alone
_BODY_SCHEMES = {
    "github": ("X-Hub-Signature-256", "sha256", "hex", "sha256="),
    "shopify": ("X-Shopify-Hmac-Sha256", "sha256", "base64", ""),
    "intercom": ("X-Hub-Signature", "sha1", "hex", "sha1="),
}
# Meta's subscription check: a GET the proxy answers itself (``MetaSignature.handshake``).
_META_HEADER = "X-Hub-Signature-256"
# A challenge the proxy echoes (Meta's, Twitch's, Zoom's plainToken): printable ASCII, no space.
_CHALLENGE = re.compile(r"[!-~]{1,512}")
_TWITCH = "Twitch-Eventsub-Message-"
_TWITCH_VERIFICATION = "webhook_callback_verification"
_DISCORD_SIGNATURE = "X-Signature-Ed25519"
_DISCORD_TIMESTAMP = "X-Signature-Timestamp"
_DISCORD_PING = 1
_ZOOM_SIGNATURE = "x-zm-signature"
_ZOOM_TIMESTAMP = "x-zm-request-timestamp"
_ZOOM_VALIDATION = "endpoint.url_validation"
_SENDGRID = "X-Twilio-Email-Event-Webhook-"
_HUBSPOT_SIGNATURE = "X-HubSpot-Signature-v3"
_HUBSPOT_TIMESTAMP = "X-HubSpot-Request-Timestamp"
# The escapes HubSpot decodes in the URI it signs (its request validation page's table).
_HUBSPOT_DECODED = {f"%{ord(char):02X}": char for char in ":/?@!$'()*,;"}
# Adyen's signed fields of a NotificationRequestItem, in order (amount's value and currency
# in the middle); the ones that must hold no ":" (the joiner), so that no other split of the
# signed text moves the event's key (pspReference, eventCode, success).
_ADYEN_FIELDS = (
    "pspReference",
    "originalReference",
    "merchantAccountCode",
    "merchantReference",
    "value",
    "currency",
    "eventCode",
    "success",
)
_ADYEN_FIXED = ("pspReference", "value", "currency", "eventCode", "success")
# SNS: the fields each message type signs, in order ("Subject" only where the message has one).
_SNS_CONFIRMATION = ("Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn")
_SNS_SIGNED = {
    "Notification": ("Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"),
    "SubscriptionConfirmation": (*_SNS_CONFIRMATION, "Type"),
}
_SNS_SIGNED["UnsubscribeConfirmation"] = _SNS_SIGNED["SubscriptionConfirmation"]
_LINEAR_HEADER = "Linear-Signature"
_LINEAR_STAMP = "webhookTimestamp"
# scheme: (header, separator, timestamp key, signature key, joiner) for ``t=…,v1=…`` headers
_LISTED_SCHEMES = {
    "stripe": ("Stripe-Signature", ",", "t", "v1", "."),
    "paddle": ("Paddle-Signature", ";", "ts", "h1", ":"),
}


class Verifier(Protocol):
    """Checks the signature of one route's requests."""

    @property
    def scheme(self) -> str: ...

    @property
    def headers(self) -> tuple[str, ...]:
        """The header fields the signature is read from."""
        ...

    @property
    def signed_headers(self) -> frozenset[str]:
        """The header fields (lower-cased) whose values the signature covers, besides the body:
        an event ID read from any other header is not signed."""
        ...

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        """Return if the request is authentic; raise errors.SignatureInvalid(reason) otherwise.

        ``query`` is the request's raw query string (without ``?``), as received: only schemes
        that sign the URL (Twilio) read it.
        """


def _fail(reason: str) -> NoReturn:
    raise errors.SignatureInvalid(reason)


def _header(headers: event_ids.MultiMapping, name: str) -> str:
    values = headers.getall(name, [])
    if not values:
        _fail(f"{name} missing")
    if len(values) > 1:
        # Two values means the proxy and the app might check different signatures.
        _fail(f"{name} appears {len(values)} times")
    return values[0]


def _signature(text: str, encoding: str, name: str) -> bytes:
    """The raw bytes of one received signature; hex is accepted in either case."""
    try:
        raw = (
            binascii.unhexlify(text)
            if encoding == "hex"
            else binascii.a2b_base64(text, strict_mode=True)
        )
    except ValueError:  # binascii.Error, or text that is not ASCII
        raw = b""
    if not raw:
        _fail(f"{name} malformed")
    return raw


def _timestamp(text: str, name: str) -> int:
    if not (text.isascii() and text.isdigit() and len(text) <= _MAX_TIMESTAMP_DIGITS):
        _fail(f"{name} is not an integer")
    return int(text)


def _match(
    secrets: tuple[bytes, ...], algorithm: str, message: bytes, signatures: list[bytes]
) -> bytes:
    """The secret that signed ``message`` (Zoom's handshake answers with it)."""
    for secret in secrets:
        expected = hmac.digest(secret, message, algorithm)
        if any(hmac.compare_digest(expected, signature) for signature in signatures):
            return secret
    _fail("no signature matches")


def _check_age(stamp: float, now: float, tolerance: float, name: str) -> None:
    # Called after _match, so "outside tolerance" always means an authentic but stale (or
    # clock-skewed) request, and a forgery is always reported as "no signature matches".
    if abs(now - stamp) > tolerance:
        _fail(f"{name} outside tolerance of {tolerance:g}s")


def _prefixed(headers: event_ids.MultiMapping, name: str, prefix: str, encoding: str) -> bytes:
    """The raw bytes of the signature in header ``name``, which must start with ``prefix``."""
    value = _header(headers, name)
    if not value.startswith(prefix):
        _fail(f"{name} malformed")
    return _signature(value[len(prefix) :], encoding, name)


@dataclass(frozen=True, slots=True)
class _Scheme:
    """A verifier whose header fields (``HEADERS``) and signed ones (``SIGNED``) are constants of
    its class, not settings: every scheme's but ``BodySignature``'s and ``ListedSignature``'s."""

    HEADERS: ClassVar[tuple[str, ...]] = ()
    SIGNED: ClassVar[frozenset[str]] = frozenset()

    scheme: str

    @property
    def headers(self) -> tuple[str, ...]:
        return self.HEADERS

    @property
    def signed_headers(self) -> frozenset[str]:
        return self.SIGNED


@dataclass(frozen=True, slots=True)
class _Timed(_Scheme):
    """A scheme whose verifier takes the scheme, the tolerance that bounds the age of a signed
    timestamp, and the secrets: each of ``_TIMED_SCHEMES``, and PayPal besides its certificates."""

    tolerance: float
    secrets: tuple[bytes, ...] = field(repr=False)


def _match_fresh(
    signed: _Timed, message: bytes, signatures: list[bytes], *, stamp: float, now: float, name: str
) -> bytes:
    """``_match`` with HMAC-SHA256, then ``_check_age`` of the timestamp in ``name``: the secret
    that signed ``message``."""
    secret = _match(signed.secrets, "sha256", message, signatures)
    _check_age(stamp, now, signed.tolerance, name)
    return secret


def _match_v0(
    signed: _Timed,
    headers: event_ids.MultiMapping,
    body: bytes,
    now: float,
    *,
    stamp_name: str,
    signature_name: str,
) -> bytes:
    """``{signature_name}: v0=<hex>``, HMAC-SHA256 over ``v0:{timestamp}:{body}`` with the
    timestamp (Unix seconds) in ``stamp_name`` (Slack, Zoom): the secret that signed it."""
    stamp_text = _header(headers, stamp_name)
    version, sep, text = _header(headers, signature_name).partition("=")
    if version != "v0" or not sep:
        _fail(f"{signature_name} malformed")
    signature = _signature(text, "hex", signature_name)
    stamp = _timestamp(stamp_text, stamp_name)
    message = f"v0:{stamp_text}:".encode() + body
    return _match_fresh(signed, message, [signature], stamp=stamp, now=now, name=stamp_name)


@dataclass(frozen=True, slots=True)
class BodySignature:
    """One signature over the raw body alone, in one header: GitHub, Shopify, generic HMAC."""

    scheme: str
    header: str
    algorithm: str
    encoding: str
    prefix: str
    secrets: tuple[bytes, ...] = field(repr=False)

    @property
    def headers(self) -> tuple[str, ...]:
        return (self.header,)

    @property
    def signed_headers(self) -> frozenset[str]:
        return frozenset()

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        _match_body(self, headers, body)


def _match_body(signed: BodySignature, headers: event_ids.MultiMapping, body: bytes) -> None:
    signature = _prefixed(headers, signed.header, signed.prefix, signed.encoding)
    _match(signed.secrets, signed.algorithm, body, [signature])


@dataclass(frozen=True, slots=True)
class Handshake:
    """The proxy's own answer to a provider's handshake: never claimed, never forwarded.
    ``confirm``: a URL the proxy GETs first (``confirm``: SNS's ``SubscribeURL``)."""

    status: int
    content_type: str
    text: str
    confirm: str = ""


@dataclass(frozen=True, slots=True)
class MetaSignature(_Scheme):
    """Meta's (WhatsApp, Instagram, Messenger): ``X-Hub-Signature-256: sha256=<hex>``, HMAC-SHA256
    of the body with the app secret; and the subscription check, a GET with ``hub.mode=subscribe``,
    ``hub.verify_token`` and ``hub.challenge``, answered with the challenge when the token is one
    of ``verify_tokens`` (as Meta's sample app does), refused otherwise."""

    HEADERS = (_META_HEADER,)

    secrets: tuple[bytes, ...] = field(repr=False)
    verify_tokens: tuple[bytes, ...] = field(repr=False, default=())

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        _match_body(BodySignature(self.scheme, _META_HEADER, "sha256", "hex", "sha256=",
                                  self.secrets), headers, body)  # fmt: skip

    def handshake(
        self, method: str, query: str, headers: event_ids.MultiMapping, body: bytes, now: float
    ) -> Handshake | None:
        """The answer to a subscription check; None for any other request."""
        if method != "GET":
            return None
        try:
            params = urllib.parse.parse_qs(query, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            _fail("hub.* query parameters are not UTF-8")
        if "hub.mode" not in params:
            return None
        sent = {
            name: params.get(f"hub.{name}", []) for name in ("mode", "verify_token", "challenge")
        }
        if any(len(values) != 1 for values in sent.values()) or sent["mode"][0] != "subscribe":
            _fail("hub.mode, hub.verify_token and hub.challenge must each appear once, "
                  "hub.mode=subscribe")  # fmt: skip
        token = sent["verify_token"][0].encode()
        # Every configured token compared, in constant time: which one matched is not timed.
        if not sum(hmac.compare_digest(token, wanted) for wanted in self.verify_tokens):
            _fail("hub.verify_token matches no verify_token")
        challenge = sent["challenge"][0]
        if not _CHALLENGE.fullmatch(challenge):
            _fail("hub.challenge malformed")
        return Handshake(200, "text/plain", challenge)


def _json_object(body: bytes) -> dict[str, object] | None:
    """The body as a JSON object; None if it is not one."""
    try:
        payload = json.loads(body)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return payload if isinstance(payload, dict) else None


@dataclass(frozen=True, slots=True)
class TwitchSignature(_Timed):
    """Twitch EventSub's ``Twitch-Eventsub-Message-Signature: sha256=<hex>``: HMAC-SHA256 with the
    subscription's secret over ``{Message-Id}{Message-Timestamp}{body}``, as twitchdev's sample
    computes it; then the timestamp (RFC 3339) within ``tolerance`` (Twitch's 10 minutes).

    ``Twitch-Eventsub-Message-Type`` is not signed, so it must agree with the signed body: a
    ``webhook_callback_verification`` carries a ``challenge`` and nothing else does, a
    ``notification`` carries an ``event`` and a ``revocation`` none. The verification is
    answered by the proxy (``handshake``)."""

    HEADERS = tuple(_TWITCH + name for name in ("Id", "Timestamp", "Signature", "Type"))
    SIGNED = frozenset({f"{_TWITCH}id".lower(), f"{_TWITCH}timestamp".lower()})

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        self._verified(headers, body, now)

    def _verified(
        self, headers: event_ids.MultiMapping, body: bytes, now: float
    ) -> dict[str, object] | None:
        """The body as a JSON object (None if it is none), once the request is verified."""
        id_name, stamp_name, signature_name, type_name = self.headers
        id_text, stamp_text = _header(headers, id_name), _header(headers, stamp_name)
        signature = _prefixed(headers, signature_name, "sha256=", "hex")
        stamp = _iso_time(stamp_text, stamp_name)
        message = f"{id_text}{stamp_text}".encode("utf-8", "surrogateescape") + body
        _match_fresh(self, message, [signature], stamp=stamp, now=now, name=stamp_name)
        kind = _header(headers, type_name)
        payload = _json_object(body)
        fields = payload or {}
        if (
            (kind == _TWITCH_VERIFICATION) != ("challenge" in fields)
            or (kind == "notification" and "event" not in fields)
            or (kind == "revocation" and "event" in fields)
        ):
            # A signed message relabelled: a verification forwarded as a notification, or a
            # notification shown to the app as its subscription's revocation.
            _fail(f"{type_name} {kind!r} does not match the signed body")
        return payload

    def handshake(
        self, method: str, query: str, headers: event_ids.MultiMapping, body: bytes, now: float
    ) -> Handshake | None:
        """A ``webhook_callback_verification``, verified, answered with its raw ``challenge``
        as ``text/plain``; None for any other request."""
        kind = headers.getall(self.headers[3], [])
        if method != "POST" or kind != [_TWITCH_VERIFICATION]:
            return None
        challenge = (self._verified(headers, body, now) or {}).get("challenge")
        if not isinstance(challenge, str) or not _CHALLENGE.fullmatch(challenge):
            _fail("challenge malformed")
        return Handshake(200, "text/plain", challenge)


@dataclass(frozen=True, slots=True)
class DiscordSignature(_Scheme):
    """Discord interactions': ``X-Signature-Ed25519``, a hex Ed25519 signature over
    ``{X-Signature-Timestamp}{body}`` under the application's public key, as
    ``discord_interactions.verify_key`` checks it; then the timestamp (Unix seconds) within
    ``tolerance``, which the library does not check. A PING (``type`` 1) is answered by the
    proxy (``handshake``)."""

    HEADERS = (_DISCORD_SIGNATURE, _DISCORD_TIMESTAMP)
    SIGNED = frozenset({_DISCORD_TIMESTAMP.lower()})

    tolerance: float
    keys: tuple[Ed25519PublicKey, ...] = field(repr=False)

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        from cryptography.exceptions import InvalidSignature

        signature = _signature(_header(headers, _DISCORD_SIGNATURE), "hex", _DISCORD_SIGNATURE)
        stamp_text = _header(headers, _DISCORD_TIMESTAMP)
        stamp = _timestamp(stamp_text, _DISCORD_TIMESTAMP)
        message = stamp_text.encode() + body
        for key in self.keys:
            try:
                key.verify(signature, message)
            except InvalidSignature:
                continue
            _check_age(stamp, now, self.tolerance, _DISCORD_TIMESTAMP)
            return
        _fail("no signature matches")

    def handshake(
        self, method: str, query: str, headers: event_ids.MultiMapping, body: bytes, now: float
    ) -> Handshake | None:
        """A PING, verified, answered with a PONG (``{"type":1}``); None for any other request."""
        payload = _json_object(body) if method == "POST" else None
        kind = payload.get("type") if payload else None
        if type(kind) is not int or kind != _DISCORD_PING:  # (True is no PING)
            return None
        self.verify(headers, body, now)
        return Handshake(200, "application/json", '{"type":1}')


@dataclass(frozen=True, slots=True)
class SendGridSignature(_Scheme):
    """SendGrid's Event Webhook: ``X-Twilio-Email-Event-Webhook-Signature``, a base64 DER
    ECDSA (P-256, SHA-256) signature over ``{X-Twilio-Email-Event-Webhook-Timestamp}{body}``
    under the verification key SendGrid shows, as its library's
    ``EventWebhook.verify_signature`` checks it; then the timestamp (Unix seconds) within
    ``tolerance``, which the library does not check."""

    HEADERS = (f"{_SENDGRID}Signature", f"{_SENDGRID}Timestamp")
    SIGNED = frozenset({f"{_SENDGRID}Timestamp".lower()})

    tolerance: float
    keys: tuple[EllipticCurvePublicKey, ...] = field(repr=False)

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        signature_name, stamp_name = self.HEADERS
        signature = _signature(_header(headers, signature_name), "base64", signature_name)
        stamp_text = _header(headers, stamp_name)
        stamp = _timestamp(stamp_text, stamp_name)
        message = stamp_text.encode() + body
        for key in self.keys:
            try:
                key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
            except InvalidSignature:
                continue
            _check_age(stamp, now, self.tolerance, stamp_name)
            return
        _fail("no signature matches")


@dataclass(frozen=True, slots=True)
class ZoomSignature(_Timed):
    """Zoom's ``x-zm-signature: v0=<hex>``: HMAC-SHA256 with the secret token over
    ``v0:{x-zm-request-timestamp}:{body}``, as Zoom's webhook sample computes it; then the
    timestamp (Unix seconds) within ``tolerance``. An ``endpoint.url_validation``, signed like
    any event, is answered by the proxy (``handshake``)."""

    HEADERS = (_ZOOM_SIGNATURE, _ZOOM_TIMESTAMP)
    SIGNED = frozenset({_ZOOM_TIMESTAMP})

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        self._signer(headers, body, now)

    def _signer(self, headers: event_ids.MultiMapping, body: bytes, now: float) -> bytes:
        """The secret the request is signed with."""
        return _match_v0(
            self, headers, body, now, stamp_name=_ZOOM_TIMESTAMP, signature_name=_ZOOM_SIGNATURE
        )

    def handshake(
        self, method: str, query: str, headers: event_ids.MultiMapping, body: bytes, now: float
    ) -> Handshake | None:
        """An ``endpoint.url_validation``, verified, answered with its ``plainToken`` and
        ``encryptedToken`` (hex HMAC-SHA256 of it with the secret that signed the request);
        None for any other request."""
        payload = _json_object(body) if method == "POST" else None
        if payload is None or payload.get("event") != _ZOOM_VALIDATION:
            return None
        secret = self._signer(headers, body, now)
        inner = payload.get("payload")
        token = inner.get("plainToken") if isinstance(inner, dict) else None
        if not isinstance(token, str) or not _CHALLENGE.fullmatch(token):
            _fail("payload.plainToken malformed")
        encrypted = hmac.digest(secret, token.encode(), "sha256").hex()
        answer = json.dumps({"plainToken": token, "encryptedToken": encrypted})
        return Handshake(200, "application/json", answer)


@dataclass(frozen=True, slots=True)
class LinearSignature(_Timed):
    """Linear's ``Linear-Signature``: hex HMAC-SHA256 of the body, as the SDK's
    ``LinearWebhookClient.verify`` computes it; then, as it does (``@linear/sdk`` 98), the body's
    ``webhookTimestamp`` (milliseconds, a finite number), which must be there, within
    ``tolerance`` of now (the SDK's minute): a signed body without one is refused, so that no
    captured delivery verifies for ever."""

    HEADERS = (_LINEAR_HEADER,)

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        signature = _signature(_header(headers, _LINEAR_HEADER), "hex", _LINEAR_HEADER)
        _match(self.secrets, "sha256", body, [signature])
        stamp = (_json_object(body) or {}).get(_LINEAR_STAMP)
        if stamp is None:
            _fail(f"the body has no {_LINEAR_STAMP}")
        if (
            isinstance(stamp, bool)
            or not isinstance(stamp, int | float)
            or not math.isfinite(stamp)
        ):
            _fail(f"{_LINEAR_STAMP} is not a number")
        _check_age(stamp / 1000, now, self.tolerance, _LINEAR_STAMP)


@dataclass(frozen=True, slots=True)
class MailgunSignature(_Timed):
    """Mailgun's: the body's ``signature`` object, whose ``signature`` (and, for a subaccount's
    event, ``parent-signature``, under the primary account's key) is hex HMAC-SHA256 with the
    webhook signing key over ``{timestamp}{token}``, as Mailgun's "securing webhooks" page
    computes it; then the timestamp (Unix seconds) within ``tolerance``.

    Mailgun signs neither the event data nor the rest of the body: a captured signature verifies
    under any body until it is stale. The preset claims by the signed ``token``, so a second body
    under it is a duplicate, never forwarded; the first to arrive is the one forwarded."""

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        signed = (_json_object(body) or {}).get("signature")
        if not isinstance(signed, dict):
            _fail("the body has no signature object")
        stamp, token = signed.get("timestamp"), signed.get("token")
        if type(stamp) is int:  # (Mailgun's example sends a string, its table an integer)
            stamp = str(stamp)
        if not isinstance(stamp, str) or not isinstance(token, str) or not token.isascii():
            _fail("signature.timestamp or signature.token missing or malformed")
        received = [
            _signature(value, "hex", f"signature.{name}")
            for name in ("signature", "parent-signature")
            if (value := signed.get(name)) is not None and isinstance(value, str)
        ]
        if not received:
            _fail("signature.signature missing")
        name = "signature.timestamp"
        stamp_value = _timestamp(stamp, name)
        message = f"{stamp}{token}".encode()
        _match_fresh(self, message, received, stamp=stamp_value, now=now, name=name)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        # Parsers disagree on which duplicate wins: the app could read an unsigned value.
        raise ValueError("duplicate JSON key")
    return dict(pairs)


@dataclass(frozen=True, slots=True)
class AdyenSignature(_Scheme):
    """Adyen's: each ``NotificationRequestItem`` of the body carries, in
    ``additionalData.hmacSignature``, the base64 HMAC-SHA256 with the HMAC key (hex) of its
    fields ``pspReference``, ``originalReference``, ``merchantAccountCode``,
    ``merchantReference``, ``amount.value``, ``amount.currency``, ``eventCode`` and ``success``
    joined by ``:`` (a missing one empty), as ``Adyen.util.is_valid_hmac_notification``
    computes it; every item must verify, where the library checks the first.

    Adyen signs those fields, not the body, and no timestamp: the rest (``additionalData``,
    ``reason``, ``eventDate``, ``live``) is unsigned, so the preset claims by what is signed, and
    a body with a JSON key twice is refused (the app's parser could read the other value). The
    joiner is not escaped: the fields the event is keyed by, and the amount, may hold no ``:``,
    so no other split of the signed text changes them."""

    secrets: tuple[bytes, ...] = field(repr=False)

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        try:
            payload = json.loads(body, object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or a key twice
            payload = None
        items = payload.get("notificationItems") if isinstance(payload, dict) else None
        if not isinstance(items, list) or not items:
            _fail("the body has no notificationItems")
        for index, wrapper in enumerate(items):
            item = wrapper.get("NotificationRequestItem") if isinstance(wrapper, dict) else None
            if not isinstance(item, dict):
                _fail(f"notificationItems[{index}] has no NotificationRequestItem")
            _adyen_item(self.secrets, item, index)


def _adyen_item(secrets: tuple[bytes, ...], item: dict[str, object], index: int) -> None:
    """Verify one NotificationRequestItem."""
    name = f"notificationItems[{index}]"
    extra, amount = item.get("additionalData"), item.get("amount")
    received = extra.get("hmacSignature") if isinstance(extra, dict) else None
    if not isinstance(received, str):
        _fail(f"{name} has no additionalData.hmacSignature")
    _signature(received, "base64", f"{name}.additionalData.hmacSignature")
    values = {**item, **(amount if isinstance(amount, dict) else {})}
    texts = []
    for key in _ADYEN_FIELDS:
        value = values.get(key)
        if value is None:
            value = ""
        elif type(value) is int and key == "value":
            value = str(value)
        if not isinstance(value, str) or (key in _ADYEN_FIXED and ":" in value):
            _fail(f"{name}.{key} malformed")
        texts.append(value)
    _match_text(secrets, "sha256", [":".join(texts).encode()], received)


@dataclass(frozen=True, slots=True)
class ListedSignature:
    """``t=…,v1=…`` items in one header, HMAC-SHA256 over ``{t}{joiner}{body}``: Stripe, Paddle."""

    scheme: str
    header: str
    separator: str
    timestamp_key: str
    signature_key: str
    joiner: str
    tolerance: float
    secrets: tuple[bytes, ...] = field(repr=False)

    @property
    def headers(self) -> tuple[str, ...]:
        return (self.header,)

    @property
    def signed_headers(self) -> frozenset[str]:
        return frozenset()

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        value = _header(headers, self.header)
        stamps: list[str] = []
        signatures: list[bytes] = []
        for item in value.split(self.separator):
            key, sep, text = item.strip().partition("=")
            if not sep:
                _fail(f"{self.header} malformed")
            if key == self.timestamp_key:
                stamps.append(text)
            elif key == self.signature_key:
                signatures.append(_signature(text, "hex", self.header))
            # Other keys (Stripe's v0, future schemes) are signatures this verifier cannot check.
        if len(stamps) != 1:
            _fail(f"{self.header} must carry exactly one {self.timestamp_key}")
        if not signatures:
            _fail(f"{self.header} has no {self.signature_key} signature")
        name = f"{self.header} timestamp"
        stamp = _timestamp(stamps[0], name)
        message = f"{stamps[0]}{self.joiner}".encode() + body
        _match(self.secrets, "sha256", message, signatures)
        _check_age(stamp, now, self.tolerance, name)


@dataclass(frozen=True, slots=True)
class SlackSignature(_Timed):
    """``X-Slack-Signature: v0=<hex>`` over ``v0:{X-Slack-Request-Timestamp}:{body}``."""

    HEADERS = ("X-Slack-Request-Timestamp", "X-Slack-Signature")
    SIGNED = frozenset({"x-slack-request-timestamp"})

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        _match_v0(
            self, headers, body, now, stamp_name=self.HEADERS[0], signature_name=self.HEADERS[1]
        )


@dataclass(frozen=True, slots=True)
class StandardWebhooksSignature(_Timed):
    """Standard Webhooks' ``webhook-*`` headers, or Svix's ``svix-*`` when only those are sent."""

    HEADERS = tuple(f"{prefix}-{name}" for prefix in ("webhook", "svix")
                    for name in ("id", "timestamp", "signature"))  # fmt: skip
    # Both sets: verify() refuses a request whose two sets differ.
    SIGNED = frozenset({"webhook-id", "webhook-timestamp", "svix-id", "svix-timestamp"})

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        # The ID, timestamp and signature come from one set, and the other set, where present,
        # must say the same: the svix preset claims svix-id, the standard-webhooks preset
        # webhook-id, and a signed message re-sent with the other set's ID changed must not be
        # claimed (or squat an ID) under that forged ID.
        for field_name in ("id", "timestamp", "signature"):
            sent = {
                name: headers.getall(name, [])
                for name in (f"webhook-{field_name}", f"svix-{field_name}")
            }
            if all(sent.values()) and len({tuple(values) for values in sent.values()}) > 1:
                _fail(f"webhook-{field_name} and svix-{field_name} differ")
        svix = headers.getall("svix-signature", []) and not headers.getall("webhook-signature", [])
        prefix = "svix" if svix else "webhook"
        msg_id = _header(headers, f"{prefix}-id")
        stamp_text = _header(headers, f"{prefix}-timestamp")
        signature_name = f"{prefix}-signature"
        signatures: list[bytes] = []
        for entry in _header(headers, signature_name).split():
            version, sep, text = entry.partition(",")
            if not sep:
                _fail(f"{signature_name} malformed")
            if version == "v1":
                signatures.append(_signature(text, "base64", signature_name))
            # v1a (ed25519) and later versions need other keys than a shared secret.
        if not signatures:
            _fail(f"{signature_name} has no v1 signature")
        stamp = _timestamp(stamp_text, f"{prefix}-timestamp")
        # aiohttp decodes header bytes as UTF-8 with surrogateescape: this restores them exactly.
        message = f"{msg_id}.{stamp_text}.".encode("utf-8", "surrogateescape") + body
        _match_fresh(self, message, signatures, stamp=stamp, now=now, name=f"{prefix}-timestamp")


@dataclass(frozen=True, slots=True)
class _UrlSigned(_Scheme):
    """A scheme that signs the URL the provider calls (``URL_SCHEMES``), without a timestamp."""

    public_url: str
    secrets: tuple[bytes, ...] = field(repr=False)

    def url(self, query: str) -> str:
        """The URL the provider called: ``public_url`` with the request's raw query, if any."""
        return f"{self.public_url}?{query}" if query else self.public_url


def _match_text(
    secrets: tuple[bytes, ...], algorithm: str, messages: Sequence[bytes], received: str
) -> None:
    """Return if some secret's base64 HMAC over one of ``messages`` is ``received``: the text is
    compared, as Twilio's and Square's libraries compare it, so no other base64 spelling of the
    MAC passes."""
    wanted = received.encode("utf-8", "surrogateescape")
    for secret in secrets:
        for message in messages:
            expected = binascii.b2a_base64(hmac.digest(secret, message, algorithm), newline=False)
            if hmac.compare_digest(expected, wanted):
                return
    _fail("no signature matches")


@dataclass(frozen=True, slots=True)
class TwilioSignature(_UrlSigned):
    """``X-Twilio-Signature``: base64 HMAC over the URL Twilio called and the form parameters.

    Computed as the reference library (``twilio.request_validator.RequestValidator``) does: the
    public URL with the query string as sent, then, for a form-encoded body, each parameter name
    and value, sorted by name and, for a repeated name, by value, identical pairs once. Any other
    body is bound by the URL's ``bodySHA256`` parameter (hex SHA-256 of the body). The URL is
    tried without its port and with it (the default port added), as the library does. The hash
    is SHA-1 unless ``X-Twilio-Webhooks-Signature-Settings`` names ``HMAC_SHA256`` (a Webhooks
    Rule's SharedKey, which goes in ``secrets`` beside the auth token). No timestamp is signed,
    and no header: ``I-Twilio-Idempotency-Token`` is not covered.
    """

    # Content-Type too: it decides how the body is signed.
    HEADERS = ("X-Twilio-Signature", _TWILIO_SETTINGS, "Content-Type")

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        name = "X-Twilio-Signature"
        received = _header(headers, name)
        _signature(received, "base64", name)
        algorithm = _twilio_algorithm(headers)
        url = urllib.parse.urlsplit(self.url(query))
        if _media_type(headers) == _FORM:
            message = "".join(key + value for key, value in _form(body))
        elif (stamp := urllib.parse.parse_qs(url.query).get("bodySHA256")) is not None:
            # Reported as a mismatch: the body is not the one the signed URL names.
            if not hmac.compare_digest(
                hashlib.sha256(body).hexdigest().encode(), stamp[0].encode()
            ):
                _fail("no signature matches")
            message = ""
        elif body:
            _fail(f"body is neither {_FORM} nor named by a bodySHA256 query parameter")
        else:
            message = ""
        signed = [
            (candidate + message).encode("utf-8", "surrogateescape")
            for candidate in _twilio_urls(url)
        ]
        _match_text(self.secrets, algorithm, signed, received)


def _media_type(headers: event_ids.MultiMapping) -> str:
    values = headers.getall("Content-Type", [])
    return values[0].partition(";")[0].strip().lower() if len(values) == 1 else ""


def _form(body: bytes) -> list[tuple[str, str]]:
    """The body's parameters in Twilio's signing order; refuses a body that is not UTF-8."""
    try:
        pairs = urllib.parse.parse_qsl(
            body.decode(), keep_blank_values=True, encoding="utf-8", errors="strict"
        )
    except UnicodeDecodeError:
        _fail(f"{_FORM} body is not UTF-8")
    return sorted(set(pairs))


def _twilio_algorithm(headers: event_ids.MultiMapping) -> str:
    if not headers.getall(_TWILIO_SETTINGS, []):
        return "sha1"
    for part in _header(headers, _TWILIO_SETTINGS).split(","):
        key, sep, value = part.partition("=")
        if sep and key.strip() == "algorithm" and value.strip():
            algorithm = _TWILIO_ALGORITHMS.get(value.strip().upper())
            if algorithm is None:
                _fail(f"{_TWILIO_SETTINGS} names an unsupported algorithm")
            return algorithm
    return "sha1"


def _twilio_urls(url: urllib.parse.SplitResult) -> tuple[str, str]:
    """The URL without its port and with it (the scheme's default when none is given)."""
    host, _, port = url.netloc.partition(":")
    default = "443" if url.scheme == "https" else "80"
    return (
        url._replace(netloc=host).geturl(),
        url._replace(netloc=f"{host}:{port or default}").geturl(),
    )


@dataclass(frozen=True, slots=True)
class SquareSignature(_UrlSigned):
    """``x-square-hmacsha256-signature``: base64 HMAC-SHA256 with the subscription's signature
    key over the notification URL followed by the raw body.

    Computed as Square's SDK does (``square.utils.webhooks_helper.verify_signature``): the URL as
    given to Square, ``public_url`` with the request's raw query when it has one, then the
    body's bytes; the base64 text is compared, as the SDK compares it. No timestamp and no
    header is signed: a replay is refused only as a duplicate of its event.
    """

    HEADERS = (_SQUARE,)

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        received = _header(headers, _SQUARE)
        _signature(received, "base64", _SQUARE)
        message = self.url(query).encode("utf-8", "surrogateescape") + body
        _match_text(self.secrets, "sha256", [message], received)


@dataclass(frozen=True, slots=True)
class HubSpotSignature(_UrlSigned):
    """HubSpot's v3: ``X-HubSpot-Signature-v3``, base64 HMAC-SHA256 with the app's client
    secret over ``POST`` + the URI HubSpot called + the body + ``X-HubSpot-Request-Timestamp``
    (milliseconds), as ``hubspot.utils.signature.Signature`` computes it; then the timestamp
    within ``tolerance`` (HubSpot's 5 minutes), in both directions where the library checks
    only the past. The URI is ``public_url`` with the request's raw query; HubSpot decodes a
    few escapes (``%3A``, ``%2F``, …) in what it signs, so the query is tried as sent and with
    those decoded. The method signed is POST, the only one HubSpot's webhooks use."""

    HEADERS = (_HUBSPOT_SIGNATURE, _HUBSPOT_TIMESTAMP)
    SIGNED = frozenset({_HUBSPOT_TIMESTAMP.lower()})

    tolerance: float = DEFAULT_TOLERANCE

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        received = _header(headers, _HUBSPOT_SIGNATURE)
        _signature(received, "base64", _HUBSPOT_SIGNATURE)
        stamp_text = _header(headers, _HUBSPOT_TIMESTAMP)
        stamp = _timestamp(stamp_text, _HUBSPOT_TIMESTAMP)
        decoded = re.sub(
            "%[0-9A-Fa-f]{2}", lambda m: _HUBSPOT_DECODED.get(m[0].upper(), m[0]), query
        )
        tail = body + stamp_text.encode()
        messages = [
            b"POST" + self.url(sent).encode("utf-8", "surrogateescape") + tail
            for sent in dict.fromkeys((query, decoded))
        ]
        _match_text(self.secrets, "sha256", messages, received)
        _check_age(stamp / 1000, now, self.tolerance, _HUBSPOT_TIMESTAMP)


@dataclass(frozen=True, slots=True)
class PayPalSignature(_Timed):
    """PayPal's ``PAYPAL-TRANSMISSION-SIG``: base64 RSA (PKCS#1 v1.5, SHA-256) over
    ``{PAYPAL-TRANSMISSION-ID}|{PAYPAL-TRANSMISSION-TIME}|{webhook ID}|{CRC32 of the body}``
    (the CRC32 unsigned, in decimal), under the certificate at ``PAYPAL-CERT-URL``.

    The string is the one PayPal's SDKs build (``paypalrestsdk``'s ``WebhookEvent.verify``).
    ``secrets`` hold the webhook IDs PayPal shows for the subscription, which bind a signature
    to its webhook; the certificate comes from ``certificates`` (fetched from PayPal's hosts
    only, its chain and name checked), read here from the cache ``prepare`` filled.
    ``PAYPAL-AUTH-ALGO`` must be ``SHA256withRSA``. ``tolerance`` bounds the age of the
    transmission time, which the signature covers.
    """

    HEADERS = tuple(f"PAYPAL-{name}" for name in
                    ("TRANSMISSION-ID", "TRANSMISSION-TIME", "TRANSMISSION-SIG", "CERT-URL",
                     "AUTH-ALGO"))  # fmt: skip
    SIGNED = frozenset({"paypal-transmission-id", "paypal-transmission-time"})

    certificates: certificates.Certificates = field(repr=False, compare=False)

    async def prepare(self, headers: event_ids.MultiMapping) -> None:
        """Fetch the certificate the request names, if it may be fetched and is not cached."""
        urls = headers.getall("PAYPAL-CERT-URL", [])
        if len(urls) == 1:
            await self.certificates.fetch(urls[0])

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        sent = {name: _header(headers, name) for name in self.headers}
        id_text, time_text, signature_text, url, algorithm = sent.values()
        if algorithm != _PAYPAL_ALGORITHM:
            _fail(f"PAYPAL-AUTH-ALGO is not {_PAYPAL_ALGORITHM}")
        signature = _signature(signature_text, "base64", "PAYPAL-TRANSMISSION-SIG")
        stamp = _iso_time(time_text, "PAYPAL-TRANSMISSION-TIME")
        certificate = self.certificates.get(url, now)
        head = f"{id_text}|{time_text}|".encode("utf-8", "surrogateescape")
        tail = f"|{zlib.crc32(body)}".encode()
        if not any(
            certificate.verifies(signature, head + webhook_id + tail) for webhook_id in self.secrets
        ):
            _fail("no signature matches")
        _check_age(stamp, now, self.tolerance, "PAYPAL-TRANSMISSION-TIME")


@dataclass(frozen=True, slots=True)
class SnsSignature(_Scheme):
    """AWS SNS's: the body's ``Signature``, base64 RSA (PKCS#1 v1.5; SHA-1 for
    ``SignatureVersion`` 1, SHA-256 for 2) over the message type's fields, each
    ``{name}\n{value}\n`` in AWS's order, under the certificate at ``SigningCertURL`` (fetched
    from AWS's SNS hosts only, ``certificates``); then the signed ``Timestamp`` within
    ``tolerance``.

    ``secrets`` are the topic ARNs the route takes: AWS signs every topic's messages, so a
    message from anyone's topic would verify without them. The unsigned
    ``x-amz-sns-message-type`` and ``x-amz-sns-message-id`` headers, where sent, must agree
    with the signed body. A body with a JSON key twice is refused."""

    SIGNED = frozenset({"x-amz-sns-message-type", "x-amz-sns-message-id"})

    tolerance: float
    topics: tuple[str, ...]
    certificates: certificates.Certificates = field(repr=False, compare=False)
    # verify.confirm_subscription: the proxy confirms a SubscriptionConfirmation (``handshake``).
    confirms: bool = False

    async def prepare(self, body: bytes) -> None:
        """Fetch the certificate the message names, if it may be fetched and is not cached."""
        url = (_sns_message(body) or {}).get("SigningCertURL")
        if isinstance(url, str):
            await self.certificates.fetch(url)

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        message = _sns_message(body)
        if message is None:
            _fail("the body is not an SNS message (JSON, each key once)")
        signed = _sns_signed(message)
        version = message.get("SignatureVersion")
        if version not in ("1", "2"):
            _fail("SignatureVersion is neither 1 nor 2")
        signature, url = message.get("Signature"), message.get("SigningCertURL")
        if not isinstance(signature, str) or not isinstance(url, str):
            _fail("Signature or SigningCertURL missing")
        raw = _signature(signature, "base64", "Signature")
        certificate = self.certificates.get(url, now)
        if not certificate.verifies(raw, signed, sha1=version == "1"):
            _fail("no signature matches")
        if message["TopicArn"] not in self.topics:
            _fail("TopicArn is none of the route's topics (verify.secrets)")
        for header, name in (
            ("x-amz-sns-message-type", "Type"),
            ("x-amz-sns-message-id", "MessageId"),
        ):
            value = str(message[name])
            if headers.getall(header, [value]) != [value]:
                # The app may dispatch on the header: it must say what is signed.
                _fail(f"{header} does not match the signed {name}")
        stamp = _iso_time(str(message["Timestamp"]), "Timestamp")
        _check_age(stamp, now, self.tolerance, "Timestamp")

    def handshake(
        self, method: str, query: str, headers: event_ids.MultiMapping, body: bytes, now: float
    ) -> Handshake | None:
        """With ``confirms``, a SubscriptionConfirmation, verified (so of one of the route's
        topics), answered once the proxy has visited its ``SubscribeURL`` (on an allowed host,
        as the certificate); None for any other request, or without ``confirms``."""
        message = _sns_message(body) if self.confirms and method == "POST" else None
        if message is None or message.get("Type") != "SubscriptionConfirmation":
            return None
        self.verify(headers, body, now)
        url = str(message["SubscribeURL"])
        if (reason := self.certificates.refusal(url, "SubscribeURL")) is not None:
            _fail(reason)
        return Handshake(200, "text/plain", "subscription confirmed", confirm=url)


def _sns_signed(message: dict[str, object]) -> bytes:
    """What AWS signs of ``message``: each field its type signs, ``{name}\n{value}\n``."""
    kind = message.get("Type")
    if not isinstance(kind, str) or kind not in _SNS_SIGNED:
        _fail("Type is not an SNS message type")
    text = []
    for name in _SNS_SIGNED[kind]:
        value = message.get(name)
        if value is None and name == "Subject":
            continue
        if not isinstance(value, str):
            _fail(f"{name} missing or not a string")
        text.append(f"{name}\n{value}\n")
    return "".join(text).encode()


def _sns_message(body: bytes) -> dict[str, object] | None:
    try:
        payload = json.loads(body, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):
        return None
    return payload if isinstance(payload, dict) else None


def _iso_time(text: str, name: str) -> float:
    """An ISO 8601 time with its offset (``2024-05-01T12:00:00Z``), as a Unix time."""
    try:
        moment = datetime.datetime.fromisoformat(text) if len(text) <= _MAX_TIME_TEXT else None
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None or not text.isascii():
        _fail(f"{name} is not an ISO 8601 time with an offset")
    return moment.timestamp()


# The schemes that fetch what ``verify`` needs first (``prepare``), and those that answer a
# provider's handshake (``handshake``): built once, for the checks made on every request.
_PREPARING = (PayPalSignature, SnsSignature)
_HANDSHAKING = (MetaSignature, TwitchSignature, DiscordSignature, ZoomSignature, SnsSignature)


def prepares(verifier: Verifier | None) -> TypeGuard[PayPalSignature | SnsSignature]:
    """Whether ``prepare`` fetches anything for ``verifier``'s scheme (else a request need not
    await it)."""
    return isinstance(verifier, _PREPARING)


def handshakes(verifier: Verifier | None) -> bool:
    """Whether ``verifier``'s scheme has a handshake (else ``handshake`` is always None)."""
    return isinstance(verifier, _HANDSHAKING)


async def prepare(verifier: Verifier, headers: event_ids.MultiMapping, body: bytes) -> None:
    """Before ``verifier.verify``: fetch what it needs from elsewhere (the certificate a PayPal
    request or an SNS message names); nothing for a scheme that needs only its secrets
    (``prepares``). CertificateUnavailable if the provider could not be reached."""
    if isinstance(verifier, PayPalSignature):
        await verifier.prepare(headers)
    elif isinstance(verifier, SnsSignature):
        await verifier.prepare(body)


def handshake_methods(verifier: Verifier | None) -> tuple[str, ...]:
    """The methods of the handshakes ``verifier``'s scheme answers besides its route's methods
    (Meta's subscription check is a GET; the others are POSTs, the route's method)."""
    return ("GET",) if isinstance(verifier, MetaSignature) else ()


def handshake(
    verifier: Verifier | None,
    method: str,
    query: str,
    *,
    headers: event_ids.MultiMapping,
    body: bytes,
    now: float,
) -> Handshake | None:
    """The proxy's answer to a provider's handshake on this route (Meta's subscription check,
    Twitch's callback verification, Discord's PING, Zoom's URL validation); None if the request
    is none. SignatureInvalid for a handshake that fails its check (a wrong verify token, a
    forged or stale signature): a handshake is answered only once it is verified."""
    if isinstance(verifier, _HANDSHAKING):
        return verifier.handshake(method, query, headers, body, now)
    return None


async def confirm(verifier: Verifier | None, answer: Handshake) -> None:
    """Before ``answer`` is sent: the GET it asks for (SNS's ``SubscribeURL``), if any.
    CertificateUnavailable if the provider could not be reached or did not answer 200."""
    if answer.confirm and isinstance(verifier, SnsSignature):
        await verifier.certificates.confirm(answer.confirm, "SubscribeURL")


@dataclass(frozen=True, slots=True)
class TenantSignatures:
    """A templated route's verifiers, one per tenant, so that a tenant's secrets verify its own
    path only: ``for_tenant`` picks one by the tenant its path names (``RouteConfig.verifier_for``).

    As a verifier itself it describes the scheme (its headers) and refuses every request:
    ``for_tenant`` returns it for a tenant without secrets, and code that verifies without picking
    the tenant's verifier fails closed.
    """

    scheme: str
    headers: tuple[str, ...]
    signed_headers: frozenset[str]
    tenants: Mapping[str, Verifier] = field(hash=False)

    @classmethod
    def of(cls, tenants: Mapping[str, Verifier]) -> TenantSignatures:
        """From verifiers of one scheme with the same settings, keyed by tenant (non-empty)."""
        some = next(iter(tenants.values()))
        return cls(some.scheme, some.headers, some.signed_headers, MappingProxyType(dict(tenants)))

    def for_tenant(self, tenant: str) -> Verifier:
        return self.tenants.get(tenant, self)

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        _fail("no secret is configured for this path's tenant")


@dataclass(frozen=True, slots=True)
class SecretsUnread:
    """The verifier of a route whose secrets were not read (``config.load(secrets=False)``, for
    the commands that verify nothing): it describes the scheme as the real one would, and
    refuses every request, so that it fails closed if it is ever asked."""

    scheme: str
    headers: tuple[str, ...]
    signed_headers: frozenset[str]

    def verify(
        self, headers: event_ids.MultiMapping, body: bytes, now: float, *, query: str = ""
    ) -> None:
        _fail("the signing secrets were not read")


# A secret every scheme takes (Standard Webhooks': base64 after whsec_), for ``Settings.unread``.
_ANY_SECRET = "whsec_c2VjcmV0"


def _public_url(value: str, provider: str) -> str:
    """``scheme://host[:port]/path`` as the provider was told it; ValueError otherwise."""
    parts = urllib.parse.urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if (
        parts.scheme not in ("http", "https")
        or not value.startswith(f"{parts.scheme}://")
        or not parts.hostname
        or port == 0
        or parts.netloc.endswith(":")
        or not value.isascii()
        or any(char in value for char in " \t\r\n@[]?#")
        or not value.isprintable()
    ):
        raise ValueError(
            f"public_url must be the http(s) URL {provider} calls, scheme://host[:port]/path, "
            f"ASCII, without credentials, query or fragment; got {value!r}"
        )
    return value


def _refuse_foreign(scheme: str, owners: tuple[str, ...], **options: object) -> None:
    """ValueError naming the ``options`` given that only ``owners`` take."""
    given = [name for name, value in options.items() if value is not None]
    if scheme not in owners and given:
        which = f"scheme {owners[0]}" if len(owners) == 1 else f"schemes {', '.join(owners)}"
        raise ValueError(f"{', '.join(given)}: only for {which}, not {scheme}")


def _certificates(
    scheme: str, hosts: Sequence[str] | None, ca_file: str | None
) -> certificates.Certificates:
    """The route's certificate fetcher and cache (``CERT_SCHEMES``); ValueError for a bad host,
    an unreadable CA bundle, or no ``cryptography`` (the extra named after the scheme)."""
    try:
        from proxy import certificates
    except ImportError as exc:
        raise _without_cryptography(scheme, exc) from None
    if hosts is not None and (isinstance(hosts, str) or not hosts):
        raise ValueError("cert_hosts must be a non-empty list of host or host:port")
    paypal = scheme == "paypal"
    checked = []
    for index, host in enumerate((PAYPAL_CERT_HOSTS if paypal else ()) if hosts is None else hosts):
        try:
            checked.append(certificates.check_host(host))
        except ValueError as exc:
            raise ValueError(f"cert_hosts[{index}] {exc}") from None
    path = certificates.default_ca_file() if ca_file is None else ca_file
    try:
        roots = certificates.load_roots(path)
    except ValueError as exc:
        raise ValueError(f"ca_file: {exc}") from None
    if not paypal:
        pattern = SNS_CERT_HOST if hosts is None else None
        return certificates.Certificates(
            header="SigningCertURL",
            hosts=checked,
            roots=roots,
            ca_file=path,
            domain=None,
            host_pattern=pattern,
        )
    return certificates.Certificates(
        header="PAYPAL-CERT-URL", hosts=checked, roots=roots, ca_file=path, domain=PAYPAL_DOMAIN
    )


def _need_cryptography(scheme: str) -> None:
    """ValueError if ``scheme`` needs ``cryptography`` (the extra named after it: Discord's
    Ed25519, SendGrid's ECDSA) and it is not installed."""
    if scheme not in KEY_SCHEMES:
        return
    try:
        import cryptography  # noqa: F401
    except ImportError as exc:
        raise _without_cryptography(scheme, exc) from None


def _without_cryptography(scheme: str, exc: ImportError) -> ValueError:
    """What a scheme that needs ``cryptography`` says without it: the extra named after it."""
    return ValueError(
        f"scheme {scheme} needs the cryptography package: install "
        f"webhook-dedup-proxy[{scheme}] ({exc})"
    )


def _ed25519_keys(secrets: Sequence[str]) -> tuple[Ed25519PublicKey, ...]:
    """Discord's application public keys, each 64 hex digits (as its developer portal shows)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    keys = []
    for index, secret in enumerate(secrets):
        try:
            raw = bytes.fromhex(secret) if len(secret) == 64 else b""
        except ValueError:
            raw = b""
        if not raw:
            raise ValueError(
                f"secrets[{index}] must be the application's public key, 64 hex digits"
            )
        keys.append(Ed25519PublicKey.from_public_bytes(raw))
    return tuple(keys)


def _p256_keys(secrets: Sequence[str]) -> tuple[EllipticCurvePublicKey, ...]:
    """SendGrid's verification keys: each the base64 of a DER P-256 public key, as SendGrid's
    settings show it (its library wraps that text in a PEM)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_der_public_key

    keys = []
    for index, secret in enumerate(secrets):
        try:
            key = load_der_public_key(binascii.a2b_base64(secret, strict_mode=True))
        except ValueError:  # not base64, or not a DER public key
            key = None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
            raise ValueError(
                f"secrets[{index}] must be SendGrid's verification key: the base64 of a P-256 "
                "public key (DER), as its Event Webhook settings show it"
            )
        keys.append(key)
    return tuple(keys)


def _hex_key(secret: str, index: int) -> bytes:
    """Adyen's HMAC key: hex digits, as its Customer Area shows it."""
    try:
        key = bytes.fromhex(secret) if secret.isascii() and secret.isalnum() else b""
    except ValueError:
        key = b""
    if not key:
        raise ValueError(f"secrets[{index}] must be the HMAC key in hex, as Adyen shows it")
    return key


def _standard_key(secret: str, index: int) -> bytes:
    """The HMAC key of a Standard Webhooks secret: ``whsec_`` (optional) and base64."""
    text = secret.removeprefix(_STANDARD_PREFIX)
    try:
        # Secrets are sometimes shown without padding; the reference libraries accept that too.
        key = binascii.a2b_base64(text + "=" * (-len(text) % 4), strict_mode=True)
    except ValueError:
        key = b""
    if not key:
        raise ValueError(f"secrets[{index}] must be base64, optionally after {_STANDARD_PREFIX}")
    return key


def _choice(name: str, value: str | None, default: str, choices: tuple[str, ...]) -> str:
    value = default if value is None else value
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def build(
    scheme: str,
    secrets: Sequence[str],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    header: str | None = None,
    algorithm: str | None = None,
    encoding: str | None = None,
    prefix: str | None = None,
    public_url: str | None = None,
    cert_hosts: Sequence[str] | None = None,
    ca_file: str | None = None,
    verify_tokens: Sequence[str] | None = None,
    confirm_subscription: bool | None = None,
) -> Verifier:
    """The verifier for a route; ValueError messages complete "routes[0].verify: …".

    ``header``, ``algorithm`` (sha1, sha256, sha512; default sha256), ``encoding`` (hex, base64;
    default hex) and ``prefix`` (default none) apply to scheme ``hmac`` only, where ``header`` is
    required. ``public_url`` (``scheme://host[:port]/path``, the URL the provider was given, without
    its query) applies to and is required by schemes ``twilio``, ``square`` and ``hubspot``.
    ``cert_hosts`` (default ``PAYPAL_CERT_HOSTS``; ``host`` or ``host:port``) and ``ca_file`` (a
    PEM bundle; default the system's) apply to scheme ``paypal``, whose secrets are webhook IDs.
    ``verify_tokens`` (the tokens Meta's subscription check may carry) apply to scheme ``meta``,
    ``confirm_subscription`` (the proxy confirms SNS subscriptions) to scheme ``sns``.
    Scheme ``discord``'s secrets are the application's public keys (hex), scheme ``sendgrid``'s
    the Event Webhook's verification keys (base64 DER); each needs ``cryptography`` (the extra
    named after the scheme). Scheme ``adyen``'s secrets are HMAC keys in hex. ``hubspot``
    signs the URL: it needs ``public_url`` too.
    ``tolerance`` bounds the age of timestamped schemes' timestamps, in both directions.
    """
    checked = settings(
        scheme, tolerance=tolerance, header=header, algorithm=algorithm, encoding=encoding,
        prefix=prefix, public_url=public_url, cert_hosts=cert_hosts, ca_file=ca_file,
        verify_tokens=verify_tokens, confirm_subscription=confirm_subscription,
    )  # fmt: skip
    return checked.verifier(secrets)


@dataclass(frozen=True, slots=True)
class Settings:
    """A route's checked ``verify`` settings, secrets aside: one verifier per list of secrets
    (one list per tenant on a route with ``tenant_secrets``)."""

    scheme: str
    tolerance: float
    header: str = ""
    algorithm: str = ""
    encoding: str = ""
    prefix: str = ""
    public_url: str = ""
    # PayPal's: one cache of certificates for the route, shared by its tenants' verifiers.
    certificates: certificates.Certificates | None = field(default=None, compare=False)
    # Meta's: the subscription check's tokens, the route's (a GET names no tenant's secret).
    verify_tokens: tuple[bytes, ...] = field(default=(), repr=False)
    # SNS's: the proxy confirms a subscription itself.
    confirm_subscription: bool = False

    def unread(self) -> SecretsUnread:
        """The verifier of these settings without their secrets (``SecretsUnread``)."""
        if self.scheme in _SHAPED:
            # A public key or a hex key is no secret any scheme takes: the shape is the class's.
            shape = _SHAPED[self.scheme]
            return SecretsUnread(self.scheme, shape.HEADERS, shape.SIGNED)
        verifier = self.verifier([_ANY_SECRET])
        return SecretsUnread(verifier.scheme, verifier.headers, verifier.signed_headers)

    def verifier(self, secrets: Sequence[str]) -> Verifier:
        """The verifier with ``secrets``; ValueError messages complete "routes[0].verify: …"."""
        _check_secrets(secrets)
        scheme, tolerance = self.scheme, self.tolerance
        if scheme == "standard-webhooks":
            decoded = tuple(_standard_key(secret, index) for index, secret in enumerate(secrets))
            return StandardWebhooksSignature(scheme, tolerance, decoded)
        material = tuple(secret.encode() for secret in secrets)
        if scheme in _LISTED_SCHEMES:
            return ListedSignature(scheme, *_LISTED_SCHEMES[scheme], tolerance, material)
        if scheme in _BODY_SCHEMES:
            return BodySignature(scheme, *_BODY_SCHEMES[scheme], material)
        if scheme == "meta":
            return MetaSignature(scheme, material, self.verify_tokens)
        if scheme in _TIMED_SCHEMES:
            return _TIMED_SCHEMES[scheme](scheme, tolerance, material)
        return self._other(secrets, material)

    def _other(self, secrets: Sequence[str], material: tuple[bytes, ...]) -> Verifier:
        """The verifier of a scheme with a class of its own, or of ``hmac``."""
        scheme, tolerance = self.scheme, self.tolerance
        if scheme in _SHAPED:
            return self._keyed(secrets)
        if scheme == "hubspot":
            return HubSpotSignature(scheme, self.public_url, material, tolerance)
        if scheme == "twilio":
            return TwilioSignature(scheme, self.public_url, material)
        if scheme == "square":
            return SquareSignature(scheme, self.public_url, material)
        if scheme in CERT_SCHEMES:
            return self._certified(secrets, material)
        return BodySignature(
            scheme, self.header, self.algorithm, self.encoding, self.prefix, material
        )

    def _certified(self, secrets: Sequence[str], material: tuple[bytes, ...]) -> Verifier:
        """The verifier of a scheme that signs under a fetched certificate (``CERT_SCHEMES``):
        PayPal's secrets are webhook IDs, SNS's topic ARNs."""
        assert self.certificates is not None  # settings() gives them their certificates
        if self.scheme == "sns":
            topics = tuple(secrets)
            return SnsSignature(
                self.scheme, self.tolerance, topics, self.certificates, self.confirm_subscription
            )
        return PayPalSignature(self.scheme, self.tolerance, material, self.certificates)

    def _keyed(self, secrets: Sequence[str]) -> Verifier:
        """The verifier of a scheme whose secrets are keys of a form of their own (``_SHAPED``:
        public keys, Adyen's hex)."""
        if self.scheme == "adyen":
            keys = tuple(_hex_key(secret, index) for index, secret in enumerate(secrets))
            return AdyenSignature(self.scheme, keys)
        if self.scheme == "discord":
            return DiscordSignature(self.scheme, self.tolerance, _ed25519_keys(secrets))
        return SendGridSignature(self.scheme, self.tolerance, _p256_keys(secrets))


# The schemes whose secrets are keys of a form of their own (``Settings.unread``).
_SHAPED: dict[str, type[_Scheme]] = {
    "discord": DiscordSignature,
    "sendgrid": SendGridSignature,
    "adyen": AdyenSignature,
}
# The schemes whose verifier takes the scheme, the tolerance and the secrets, nothing else.
_TIMED_SCHEMES: dict[str, Callable[[str, float, tuple[bytes, ...]], Verifier]] = {
    "slack": SlackSignature,
    "linear": LinearSignature,
    "twitch": TwitchSignature,
    "zoom": ZoomSignature,
    "mailgun": MailgunSignature,
}


def _check_secrets(secrets: Sequence[str]) -> None:
    if isinstance(secrets, str) or not secrets:
        raise ValueError("secrets must be a non-empty list")
    for index, secret in enumerate(secrets):
        if not isinstance(secret, str) or not secret.strip():
            raise ValueError(f"secrets[{index}] must be a non-empty string")
        if secret != secret.strip():
            # A newline from a secrets file would otherwise fail every request, silently.
            raise ValueError(f"secrets[{index}] has leading or trailing whitespace")


def settings(
    scheme: str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    header: str | None = None,
    algorithm: str | None = None,
    encoding: str | None = None,
    prefix: str | None = None,
    public_url: str | None = None,
    cert_hosts: Sequence[str] | None = None,
    ca_file: str | None = None,
    verify_tokens: Sequence[str] | None = None,
    confirm_subscription: bool | None = None,
) -> Settings:
    """``build``'s settings checked without the secrets (ValueError as ``build``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
    _refuse_foreign(scheme, ("hmac",), header=header, algorithm=algorithm, encoding=encoding,
                    prefix=prefix)  # fmt: skip
    _refuse_foreign(scheme, URL_SCHEMES, public_url=public_url)
    _refuse_foreign(scheme, CERT_SCHEMES, cert_hosts=cert_hosts, ca_file=ca_file)
    _refuse_foreign(scheme, ("meta",), verify_token=verify_tokens)
    _refuse_foreign(scheme, ("sns",), confirm_subscription=confirm_subscription)
    if not (math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance must be a positive number of seconds, got {tolerance!r}")
    if scheme in URL_SCHEMES:
        if public_url is None:
            raise ValueError(f"public_url is required for scheme {scheme}")
        provider = {"hubspot": "HubSpot"}.get(scheme, scheme.capitalize())
        return Settings(scheme, tolerance, public_url=_public_url(public_url, provider))
    if scheme in CERT_SCHEMES:
        found = _certificates(scheme, cert_hosts, ca_file)
        confirms = bool(confirm_subscription)
        return Settings(scheme, tolerance, certificates=found, confirm_subscription=confirms)
    _need_cryptography(scheme)
    if scheme == "meta" and verify_tokens is not None:
        tokens = tuple(token.encode() for token in verify_tokens)
        return Settings(scheme, tolerance, verify_tokens=tokens)
    if scheme != "hmac":
        return Settings(scheme, tolerance)
    if header is None:
        raise ValueError("header is required for scheme hmac")
    if not _TOKEN.fullmatch(header) or "_" in header:
        # Headers with "_" are dropped on the way to the app (forwarder.request_headers).
        raise ValueError(f"header must be a header name without '_', got {header!r}")
    return Settings(
        scheme, tolerance, header=header, prefix=prefix or "",
        algorithm=_choice("algorithm", algorithm, "sha256", ALGORITHMS),
        encoding=_choice("encoding", encoding, "hex", ENCODINGS),
    )  # fmt: skip
