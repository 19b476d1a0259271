"""Twilio: the ``twilio`` signature scheme against Twilio's own library, and the ``twilio`` preset.

Twilio's ``RequestValidator`` (the ``twilio`` package, test extra) is the reference: requests it
signs are accepted, tampered ones refused by both, and, property-based, the proxy accepts exactly
what the library accepts when an app hands it the URL Twilio called and the parsed form.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from types import ModuleType
from urllib.parse import parse_qsl, quote, urlencode

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, MultiDict

from proxy import errors, signatures
from proxy.config import presets

TOKEN = "12345678901234567890123456789012"  # an auth token: 32 hex-like characters
OLD = "abcdefabcdefabcdefabcdefabcdef12"
SHARED = "webhooks-shared-key-secret-0001"
URL = "https://hooks.example.com/twilio/voice"
QUERY = "tenant=acme&lang=en-US"
FORM = "application/x-www-form-urlencoded"
PARAMS = {
    "AccountSid": "AC" + "0" * 32,
    "CallSid": "CA" + "1" * 32,
    "CallStatus": "ringing",
    "From": "+14158675310",
    "To": "+18005551212",
    "Caller": "+14158675310",
    "Digits": "1234",
}
BODY = urlencode(PARAMS).encode()
SIGNATURE = "X-Twilio-Signature"
SETTINGS = "X-Twilio-Webhooks-Signature-Settings"


@pytest.fixture(scope="module")
def twilio() -> ModuleType:
    """The library, from the test extra: if it is missing the test fails, not skips."""
    try:
        return importlib.import_module("twilio.request_validator")
    except ImportError as exc:
        pytest.fail(f"twilio is needed for this cross-check; install the test extra ({exc})")


def full(url: str = URL, query: str = QUERY) -> str:
    return f"{url}?{query}" if query else url


def library_sign(
    twilio: ModuleType, url: str, params: object, token: str = TOKEN, algorithm: str | None = None
) -> str:
    return str(twilio.RequestValidator(token).compute_signature(url, params, algorithm))


def verify(
    signature: str,
    body: bytes = BODY,
    *,
    query: str = QUERY,
    public_url: str = URL,
    secrets: tuple[str, ...] = (TOKEN,),
    content_type: str | None = FORM,
    extra: tuple[tuple[str, str], ...] = (),
) -> None:
    headers = CIMultiDict([(SIGNATURE, signature), *extra])
    if content_type is not None:
        headers["Content-Type"] = content_type
    verifier = signatures.build("twilio", list(secrets), public_url=public_url)
    verifier.verify(headers, body, 0.0, query=query)


def refused(signature: str, body: bytes = BODY, **options: object) -> str:
    with pytest.raises(errors.SignatureInvalid) as info:
        verify(signature, body, **options)  # type: ignore[arg-type]
    assert (info.value.status, info.value.code) == (401, "signature_invalid")
    assert signature not in info.value.message or len(signature) < 8
    for secret in (TOKEN, OLD, SHARED):
        assert secret not in info.value.message
    return info.value.message


def accepts(signature: str, body: bytes, **options: object) -> bool:
    try:
        verify(signature, body, **options)  # type: ignore[arg-type]
    except errors.SignatureInvalid:
        return False
    return True


def form(body: bytes) -> MultiDict[str]:
    """The parameters as a web framework hands them to the validator."""
    return MultiDict(parse_qsl(body.decode(), keep_blank_values=True))


# --- what the library signs ---------------------------------------------------------------------


def test_form_request_signed_by_the_library_is_accepted(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(), PARAMS)
    verify(signature)
    verify(signature, secrets=(OLD, TOKEN))  # rotation: any configured token
    verify(signature, content_type=f"{FORM.upper()}; charset=utf-8")
    assert refused(signature, secrets=(OLD,)) == "no signature matches"


def test_long_published_example_vector() -> None:
    # The example of Twilio's security docs, as reproduced by public implementations; the
    # library computes the same value (test below), independently of this module.
    body = b"CallSid=CA1234567890ABCDE&Caller=%2B12349013030&Digits=1234&From=%2B12349013030"
    body += b"&To=%2B18005551212"
    verify(
        "0/KCTR6DLpKmkAf8muzZqo1nDgQ=",
        body,
        query="foo=1&bar=2",
        public_url="https://mycompany.com/myapp.php",
        secrets=("12345",),
    )


def test_library_computes_the_published_example(twilio: ModuleType) -> None:
    url = "https://mycompany.com/myapp.php?foo=1&bar=2"
    params = {
        "CallSid": "CA1234567890ABCDE",
        "Caller": "+12349013030",
        "Digits": "1234",
        "From": "+12349013030",
        "To": "+18005551212",
    }
    assert library_sign(twilio, url, params, "12345") == "0/KCTR6DLpKmkAf8muzZqo1nDgQ="


def test_parameter_order_and_encoding_of_the_body_do_not_matter(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(), PARAMS)
    reordered = urlencode(sorted(PARAMS.items(), reverse=True), quote_via=quote).encode()
    assert reordered != BODY
    verify(signature, reordered)


@pytest.mark.parametrize(
    ("change", "body", "query", "public_url"),
    [
        ("body parameter changed", BODY.replace(b"Digits=1234", b"Digits=1235"), QUERY, URL),
        ("body parameter added", BODY + b"&Extra=1", QUERY, URL),
        ("body parameter removed", BODY.replace(b"&Digits=1234", b""), QUERY, URL),
        ("query changed", BODY, "tenant=globex&lang=en-US", URL),
        ("query dropped", BODY, "", URL),
        ("query decoded", BODY, "tenant=acme&lang=en%2DUS", URL),
        ("path changed", BODY, QUERY, URL.replace("/voice", "/sms")),
        ("host changed", BODY, QUERY, URL.replace("hooks.", "other.")),
        ("scheme changed", BODY, QUERY, URL.replace("https:", "http:")),
        ("trailing slash", BODY, QUERY, URL + "/"),
    ],
)
def test_tampered_request_is_refused_as_the_library_refuses_it(
    twilio: ModuleType, change: str, body: bytes, query: str, public_url: str
) -> None:
    signature = library_sign(twilio, full(), PARAMS)
    assert refused(signature, body, query=query, public_url=public_url) == "no signature matches"
    validator = twilio.RequestValidator(TOKEN)
    assert not validator.validate(full(public_url, query), form(body), signature)


@pytest.mark.parametrize("position", [0, 10, 26])
def test_changed_signature_is_refused(twilio: ModuleType, position: int) -> None:
    signature = library_sign(twilio, full(), PARAMS)
    char = "A" if signature[position] != "A" else "B"
    forged = signature[:position] + char + signature[position + 1 :]
    assert refused(forged) == "no signature matches"
    assert not twilio.RequestValidator(TOKEN).validate(full(), PARAMS, forged)


def test_another_base64_spelling_of_the_signature_is_refused(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(), PARAMS)
    # 20 bytes of SHA-1 in base64: the last character carries 2 unused bits.
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    last = alphabet[alphabet.index(signature[-2]) ^ 1]
    sloppy = signature[:-2] + last + "="
    assert refused(sloppy) == "no signature matches"
    assert not twilio.RequestValidator(TOKEN).validate(full(), PARAMS, sloppy)


def test_repeated_parameters_are_signed_sorted_by_value_once_each(twilio: ModuleType) -> None:
    body = b"MediaUrl=b&To=%2B1&MediaUrl=a&MediaUrl=b"
    params = form(body)
    signature = library_sign(twilio, full(), params)
    assert signature == library_sign(
        twilio, full(), MultiDict([("MediaUrl", "a"), ("MediaUrl", "b"), ("To", "+1")])
    )
    verify(signature, body)
    verify(signature, b"To=%2B1&MediaUrl=a&MediaUrl=b")
    assert refused(signature, b"To=%2B1&MediaUrl=b") == "no signature matches"


def test_blank_values_and_unicode_are_signed_as_decoded(twilio: ModuleType) -> None:
    body = urlencode({"Body": "héllo wörld 👋 & =", "Empty": "", "Plus": "a+b"}).encode()
    signature = library_sign(twilio, full(), form(body))
    verify(signature, body)


def test_form_body_that_is_not_utf8_is_refused(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(), PARAMS)
    reason = f"{FORM} body is not UTF-8"
    assert refused(signature, b"Body=%FF") == reason
    assert refused(signature, b"Body=\xff") == reason


def test_idempotency_token_is_not_signed(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(), PARAMS)
    for token in ("idem-1", "idem-2"):
        verify(signature, extra=(("I-Twilio-Idempotency-Token", token),))
    verifier = signatures.build("twilio", [TOKEN], public_url=URL)
    assert "i-twilio-idempotency-token" not in verifier.signed_headers
    assert verifier.signed_headers == frozenset()


def test_without_the_query_a_signed_query_is_refused(twilio: ModuleType) -> None:
    # A call site that does not pass the query fails closed, never open.
    signature = library_sign(twilio, full(), PARAMS)
    assert refused(signature, query="") == "no signature matches"
    unsigned_query = library_sign(twilio, URL, PARAMS)
    verify(unsigned_query, query="")


# --- ports --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("public_url", "signed_url", "accepted"),
    [
        (URL, URL.replace(".com/", ".com:443/"), True),
        (URL.replace(".com/", ".com:443/"), URL, True),
        ("http://hooks.example.com/t", "http://hooks.example.com:80/t", True),
        ("http://hooks.example.com/t", "http://hooks.example.com:443/t", False),
        (URL, URL.replace(".com/", ".com:80/"), False),
        (URL.replace(".com/", ".com:8443/"), URL, True),  # the library drops any port
        (URL.replace(".com/", ".com:8443/"), URL.replace(".com/", ".com:8443/"), True),
        (URL.replace(".com/", ".com:8443/"), URL.replace(".com/", ".com:443/"), False),
        (URL, URL.replace(".com/", ".com:8443/"), False),
    ],
)
def test_url_is_tried_with_and_without_its_port_as_the_library_does(
    twilio: ModuleType, public_url: str, signed_url: str, accepted: bool
) -> None:
    signature = library_sign(twilio, full(signed_url), PARAMS)
    assert twilio.RequestValidator(TOKEN).validate(full(public_url), PARAMS, signature) == accepted
    if accepted:
        verify(signature, public_url=public_url)
    else:
        assert refused(signature, public_url=public_url) == "no signature matches"


# --- JSON bodies: bodySHA256 ---------------------------------------------------------------------

JSON_BODY = json.dumps({"event": "com.twilio.messaging.message.delivered", "sid": "SM1"}).encode()


def json_query(body: bytes = JSON_BODY) -> str:
    return f"{QUERY}&bodySHA256={hashlib.sha256(body).hexdigest()}"


def test_json_body_named_by_body_sha256_is_accepted(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(query=json_query()), {})
    validator = twilio.RequestValidator(TOKEN)
    assert validator.validate(full(query=json_query()), JSON_BODY.decode(), signature)
    verify(signature, JSON_BODY, query=json_query(), content_type="application/json")
    verify(signature, JSON_BODY, query=json_query(), content_type=None)


def test_json_body_that_is_not_the_one_named_is_refused(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(query=json_query()), {})
    tampered = JSON_BODY.replace(b"SM1", b"SM2")
    validator = twilio.RequestValidator(TOKEN)
    assert not validator.validate(full(query=json_query()), tampered.decode(), signature)
    reason = refused(signature, tampered, query=json_query(), content_type="application/json")
    assert reason == "no signature matches"
    # The hash is compared as the library does: lower-case hex only.
    upper = json_query().replace("bodySHA256=", "X=") + "&bodySHA256="
    upper += hashlib.sha256(JSON_BODY).hexdigest().upper()
    signature = library_sign(twilio, full(query=upper), {})
    assert not validator.validate(full(query=upper), JSON_BODY.decode(), signature)
    assert refused(signature, JSON_BODY, query=upper, content_type="application/json") == (
        "no signature matches"
    )


@pytest.mark.parametrize("query", [QUERY, f"{QUERY}&bodySHA256="])
def test_json_body_without_body_sha256_is_refused(twilio: ModuleType, query: str) -> None:
    signature = library_sign(twilio, full(query=query), {})
    reason = refused(signature, JSON_BODY, query=query, content_type="application/json")
    assert reason == f"body is neither {FORM} nor named by a bodySHA256 query parameter"


def test_request_without_body_is_signed_over_the_url_alone(twilio: ModuleType) -> None:
    signature = library_sign(twilio, full(), {})
    assert twilio.RequestValidator(TOKEN).validate(full(), {}, signature)
    verify(signature, b"", content_type=None)  # a GET callback
    verify(signature, b"", content_type=FORM)


# --- Webhooks Rules: SharedKey and HMAC-SHA256 ---------------------------------------------------


def test_shared_key_sha256_signature_named_by_the_settings_header_is_accepted(
    twilio: ModuleType,
) -> None:
    value = "key=webhooks_sharedkey_1,algorithm=HMAC_SHA256"
    algorithm = twilio.get_signature_algorithm(value)
    signature = library_sign(twilio, full(), PARAMS, SHARED, algorithm)
    assert len(signature) == 44
    verify(signature, secrets=(TOKEN, SHARED), extra=((SETTINGS, value),))
    reason = refused(signature, secrets=(TOKEN, SHARED))  # the header is what selects SHA-256
    assert reason == "no signature matches"
    sha1 = library_sign(twilio, full(), PARAMS, TOKEN)
    verify(sha1, extra=((SETTINGS, "key=webhooks_sharedkey_1"),))
    assert refused(sha1, extra=((SETTINGS, value),)) == "no signature matches"


def test_unsupported_algorithm_is_refused_as_the_library_refuses_it(twilio: ModuleType) -> None:
    value = "key=webhooks_sharedkey_1,algorithm=HMAC_SHA512"
    signature = library_sign(twilio, full(), PARAMS)
    validator = twilio.RequestValidator(TOKEN)
    assert not validator.validate(full(), PARAMS, signature, twilio.get_signature_algorithm(value))
    reason = refused(signature, extra=((SETTINGS, value),))
    assert reason == f"{SETTINGS} names an unsupported algorithm"


# --- property: the same verdict as the library ----------------------------------------------------

_text = st.text(alphabet=st.sampled_from("aZ09 +-_.~%&=?#/é😀"), min_size=0, max_size=8)
_pairs = st.lists(st.tuples(_text, _text), max_size=5)
_queries = st.sampled_from(["", QUERY, "a=%20b&c=d+e", "x", "bodySHA256=abc&y=1", "q=%2F/?"])
_urls = st.sampled_from(
    [
        URL,
        "https://hooks.example.com:443/twilio/voice",
        "https://Hooks.Example.com:8443/twilio/voice",
        "http://hooks.example.com/twilio",
        "https://hooks.example.com",
        "https://hooks.example.com/a;b/c%20d",
    ]
)


def resent(pairs: list[tuple[str, str]], other: list[tuple[str, str]], change: str) -> bytes:
    """The body as sent: the signed pairs, reordered, with a pair repeated, or other pairs."""
    sent = {
        "same": pairs,
        "reordered": pairs[::-1],
        "repeated": pairs + pairs[:1],
        "other": other,
    }[change]
    return urlencode(sent).encode()


@settings(max_examples=400, deadline=None)
@given(
    pairs=_pairs,
    other=_pairs,
    signed_url=_urls,
    other_url=_urls,
    signed_query=_queries,
    other_query=_queries,
    body_change=st.sampled_from(["same", "reordered", "repeated", "other"]),
    url_changed=st.booleans(),
    query_changed=st.booleans(),
    token=st.sampled_from([TOKEN, OLD]),
)
def test_form_verdict_is_the_library_verdict(
    twilio: ModuleType,
    pairs: list[tuple[str, str]],
    other: list[tuple[str, str]],
    signed_url: str,
    other_url: str,
    signed_query: str,
    other_query: str,
    body_change: str,
    url_changed: bool,
    query_changed: bool,
    token: str,
) -> None:
    signed_body = urlencode(pairs).encode()
    signature = library_sign(twilio, full(signed_url, signed_query), form(signed_body), token)
    body = resent(pairs, other, body_change)
    url = other_url if url_changed else signed_url
    query = other_query if query_changed else signed_query
    expected = twilio.RequestValidator(TOKEN).validate(full(url, query), form(body), signature)
    event("accepted" if expected else "refused")
    assert accepts(signature, body, query=query, public_url=url) == expected
    if token == TOKEN and body_change != "other" and not (url_changed or query_changed):
        assert expected


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(max_size=20),
    other=st.text(max_size=20),
    named=st.booleans(),
    body_changed=st.booleans(),
    signed_query=_queries,
    other_query=_queries,
    query_changed=st.booleans(),
    content_type=st.sampled_from(["application/json", None]),
)
def test_other_body_verdict_is_the_library_verdict(
    twilio: ModuleType,
    text: str,
    other: str,
    named: bool,
    body_changed: bool,
    signed_query: str,
    other_query: str,
    query_changed: bool,
    content_type: str | None,
) -> None:
    def with_hash(query: str) -> str:
        digest = hashlib.sha256(text.encode()).hexdigest()
        return "&".join(part for part in (query, f"bodySHA256={digest}") if part)

    signed_query = with_hash(signed_query) if named else signed_query
    signature = library_sign(twilio, full(URL, signed_query), {})
    sent = other if body_changed else text
    query = (with_hash(other_query) if named else other_query) if query_changed else signed_query
    try:
        expected = twilio.RequestValidator(TOKEN).validate(full(URL, query), sent, signature)
    except (TypeError, KeyError):
        expected = False  # the library cannot read a body it has no bodySHA256 for
    event("accepted" if expected else "refused")
    verdict = accepts(signature, sent.encode(), query=query, content_type=content_type)
    assert verdict == expected
    if named and sent == text and query == signed_query and query.count("bodySHA256") == 1:
        assert expected  # the first bodySHA256 is the one compared


# --- presets --------------------------------------------------------------------------------------


def test_twilio_preset_keys_by_the_idempotency_token_and_replays_duplicates() -> None:
    preset = presets.PRESETS["twilio"]
    assert preset.event_id == ("header:I-Twilio-Idempotency-Token",)
    assert preset.scheme == "twilio"
    assert preset.on_duplicate == "replay"
    assert preset.retention >= presets.DAY
    assert preset.scheme in signatures.SCHEMES


def test_presets_answer_within_the_provider_deadline() -> None:
    # Slack gives up after 3 s; a copy waiting longer is answered after Slack has gone.
    assert presets.PRESETS["slack"].claim_wait == 2.0
    for name, preset in presets.PRESETS.items():
        assert preset.claim_wait is None or preset.claim_wait > 0, name
        assert preset.on_duplicate in (None, "replay"), name
