"""Event-ID sources and their extraction from a request's headers, query and body."""

from __future__ import annotations

import gc
import hashlib
import json
import re
import sys
import unicodedata
from urllib.parse import urlencode

import pytest
import yarl
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, MultiDict

from proxy import errors, event_ids

ROUTE = "stripe"


def extract(
    id_source: str,
    body: bytes = b"",
    *,
    headers: list[tuple[str, str]] | None = None,
    query: list[tuple[str, str]] | str | None = None,
    type_source: str | None = None,
) -> tuple[str, str | None]:
    """Extract from a request; a query given as a string is the raw query (after the "?"), a
    list is one already decoded (what aiohttp's ``request.query`` gives)."""
    extractor = event_ids.Extractor(
        ROUTE,
        event_ids.parse_source(id_source),
        event_ids.parse_source(type_source) if type_source else None,
    )
    decoded = query if isinstance(query, str) else MultiDict(query or [])
    return extractor.extract(CIMultiDict(headers or []), decoded, body)


def body_id(value: object) -> bytes:
    return json.dumps({"id": value}).encode()


def rejected(
    id_source: str,
    body: bytes = b"",
    *,
    headers: list[tuple[str, str]] | None = None,
    query: list[tuple[str, str]] | str | None = None,
    type_source: str | None = None,
) -> str:
    """The message of the EventIdInvalid raised for this request."""
    with pytest.raises(errors.EventIdInvalid) as info:
        extract(id_source, body, headers=headers, query=query, type_source=type_source)
    assert info.value.status == 400
    assert info.value.code == "event_id_invalid"
    return info.value.message


# --- sources -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("body:/id", event_ids.Source("body", "/id", ("id",))),
        (
            "body:/data/object/id",
            event_ids.Source("body", "/data/object/id", ("data", "object", "id")),
        ),
        ("body:/a~1b/c~0d", event_ids.Source("body", "/a~1b/c~0d", ("a/b", "c~d"))),
        ("body:/~01", event_ids.Source("body", "/~01", ("~1",))),
        ("body:/events/0", event_ids.Source("body", "/events/0", ("events", "0"))),
        ("body:", event_ids.Source("body", "", ())),
        ("body:/", event_ids.Source("body", "/", ("",))),
        ("header:X-GitHub-Delivery", event_ids.Source("header", "X-GitHub-Delivery")),
        ("query:event_id", event_ids.Source("query", "event_id")),
    ],
)
def test_parse_source(text: str, source: event_ids.Source) -> None:
    assert event_ids.parse_source(text) == source
    assert str(source) == text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "must be body:/pointer, header:Name or query:name, got ''"),
        ("id", "must be body:/pointer, header:Name or query:name, got 'id'"),
        ("cookie:id", "must be body:/pointer, header:Name or query:name, got 'cookie:id'"),
        ("Body:/id", "must be body:/pointer, header:Name or query:name, got 'Body:/id'"),
        ("body:id", "a JSON pointer must be empty or start with '/', got 'id'"),
        ("header:", "header name must be a non-empty token, got ''"),
        ("query:", "query name must be a non-empty token, got ''"),
        ("header:X Id", "header name must be a non-empty token, got 'X Id'"),
        ("header:X\tId", "header name must be a non-empty token, got 'X\\tId'"),
        (
            "header:X_Event_Id",
            "header name must not contain '_' (such headers are not forwarded), got 'X_Event_Id'",
        ),
    ],
)
def test_parse_source_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        event_ids.parse_source(text)
    assert str(info.value) == message


# --- the event ID ------------------------------------------------------------------------------


def test_string_id_and_type_from_body() -> None:
    body = b'{"id": "evt_1NqX", "type": "invoice.paid", "data": {}}'

    assert extract("body:/id", body, type_source="body:/type") == ("evt_1NqX", "invoice.paid")


@pytest.mark.parametrize(("value", "stored"), [(12345, "12345"), (0, "0"), (-7, "-7")])
def test_integer_id_is_stored_as_text(value: int, stored: str) -> None:
    assert extract("body:/id", body_id(value)) == (stored, None)


def test_nested_pointer_and_array_index() -> None:
    body = json.dumps(
        {"data": {"object": {"id": "obj_1"}}, "events": [{"id": "first"}, {"id": "second"}]}
    ).encode()

    assert extract("body:/data/object/id", body)[0] == "obj_1"
    assert extract("body:/events/0/id", body)[0] == "first"
    assert extract("body:/events/1/id", body)[0] == "second"


def test_escaped_pointer_tokens() -> None:
    body = json.dumps({"a/b": {"c~d": "x1"}, "": "empty-key"}).encode()

    assert extract("body:/a~1b/c~0d", body)[0] == "x1"
    assert extract("body:/", body)[0] == "empty-key"


@pytest.mark.parametrize(("body", "event_id"), [(b'"evt_9"', "evt_9"), (b"42", "42")])
def test_empty_pointer_is_the_whole_document(body: bytes, event_id: str) -> None:
    assert extract("body:", body) == (event_id, None)


@pytest.mark.parametrize("pointer", ["/events/01", "/events/00", "/events/-", "/events/3"])
def test_pointer_that_is_not_an_index_finds_nothing(pointer: str) -> None:
    body = b'{"events": ["a", "b", "c"]}'

    assert rejected(f"body:{pointer}", body) == f"route 'stripe': no event ID at body:{pointer}"


@pytest.mark.parametrize("pointer", ["/id/x", "/n/0", "/list/x"])
def test_pointer_through_a_scalar_or_by_name_into_a_list_finds_nothing(pointer: str) -> None:
    body = b'{"id": "evt", "n": 5, "list": ["a"]}'

    assert rejected(f"body:{pointer}", body) == f"route 'stripe': no event ID at body:{pointer}"


@pytest.mark.parametrize("pointer", ["/items/\u00b2", "/items/\u0661"])
def test_non_ascii_digits_are_not_array_indexes(pointer: str) -> None:
    # RFC 6901 array indexes are ASCII digits; superscripts and Arabic-Indic
    # digits pass str.isdigit().
    body = b'{"items": ["zero", "one", "two"]}'

    assert rejected(f"body:{pointer}", body) == f"route 'stripe': no event ID at body:{pointer}"


def test_missing_body_id_names_route_and_source() -> None:
    assert rejected("body:/id", b'{"type": "x"}') == "route 'stripe': no event ID at body:/id"


def test_missing_header_id_names_route_and_source() -> None:
    assert rejected("header:X-GitHub-Delivery", headers=[("X-Other", "1")]) == (
        "route 'stripe': no event ID at header:X-GitHub-Delivery"
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"id=evt_1",
        b'{"id": "evt_1"',
        b'{"id": "\xff"}',
        b'{"id": "caf\xc3"}',
        b"[" * 100_000,
        b'{"a":' * 100_000,
        b'{"id": ' + b"1" * 5000 + b"}",
    ],
    ids=[
        "empty",
        "form",
        "truncated",
        "invalid-utf8",
        "cut-utf8",
        "deep-array",
        "deep-object",
        "5000-digits",
    ],
)
def test_body_that_is_not_json(body: bytes) -> None:
    assert rejected("body:/id", body) == (
        "route 'stripe': body is not valid JSON (needed for body:/id)"
    )


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, "null"),
        (True, "boolean"),
        (False, "boolean"),
        (1.5, "number"),
        (1.0, "number"),
        ({"id": "x"}, "object"),
        (["x"], "array"),
        ("", "str"),
    ],
)
def test_id_of_the_wrong_type_is_rejected(value: object, kind: str) -> None:
    assert rejected("body:/id", body_id(value)) == (
        "route 'stripe': event ID at body:/id must be a non-empty string (at most 256 bytes, "
        f"no control characters or Unicode format characters) or an integer, got {kind}"
    )


@pytest.mark.parametrize("event_id", ["a" * 256, "\u00e9" * 128, "\u20ac" * 85 + "a"])
def test_id_of_256_bytes_is_accepted(event_id: str) -> None:
    assert len(event_id.encode()) == 256
    assert extract("body:/id", body_id(event_id)) == (event_id, None)


@pytest.mark.parametrize("event_id", ["a" * 257, "\u00e9" * 128 + "a", "\u20ac" * 86])
def test_id_over_256_bytes_is_rejected(event_id: str) -> None:
    assert "must be a non-empty string (at most 256 bytes" in rejected(
        "body:/id", body_id(event_id)
    )
    assert "must be a non-empty string (at most 256 bytes" in rejected(
        "header:X-Id", headers=[("X-Id", event_id)]
    )


def test_integer_id_over_256_digits_is_rejected() -> None:
    assert extract("body:/id", body_id(10**255))[0] == "1" + "0" * 255
    assert "must be a non-empty string (at most 256 bytes" in rejected("body:/id", body_id(10**256))


@pytest.mark.parametrize(
    "event_id", ["evt\x001", "evt\n1", "\tevt", "evt\x7f", "evt\x1b[31m", "evt\x85", "\ud800"]
)
def test_control_characters_are_rejected(event_id: str) -> None:
    assert rejected("body:/id", body_id(event_id)).endswith(
        "no control characters or Unicode format characters) or an integer, got str"
    )
    if event_id != "\ud800":
        assert rejected("header:X-Id", headers=[("X-Id", event_id)]).endswith("got str")


def test_unicode_id_is_kept_as_is() -> None:
    assert extract("body:/id", body_id("évt-☃-1")) == ("évt-☃-1", None)


def test_header_lookup_is_case_insensitive() -> None:
    headers = [("x-github-delivery", "72d3162e-cc78-11e3")]

    assert extract("header:X-GitHub-Delivery", headers=headers) == ("72d3162e-cc78-11e3", None)


def test_query_id() -> None:
    assert extract("query:event_id", query=[("event_id", "q-1"), ("other", "2")]) == ("q-1", None)


def test_header_id_ignores_a_non_json_body() -> None:
    assert extract("header:X-Id", b"\xff not json", headers=[("X-Id", "h-1")]) == ("h-1", None)


@pytest.mark.parametrize(
    ("source", "headers", "query"),
    [
        ("header:X-Id", [("X-Id", "a"), ("x-id", "b")], []),
        ("header:X-Id", [("X-Id", "a"), ("X-Id", "a")], []),
        ("query:id", [], [("id", "a"), ("id", "b")]),
        ("query:id", [], "id=a&id=b"),
        ("query:id", [], "id=a&x=1&%69d=a"),
    ],
)
def test_repeated_header_or_query_parameter_is_rejected(
    source: str, headers: list[tuple[str, str]], query: list[tuple[str, str]] | str
) -> None:
    assert rejected(source, headers=headers, query=query) == (
        f"route 'stripe': {source} appears 2 times"
    )


# --- only the documented input: UTF-8 JSON, UTF-8 queries, visible IDs --------------------------

EVENT = '{"id": "evt_1", "type": "invoice.paid"}'
NOT_JSON = "route 'stripe': body is not valid JSON (needed for body:/id)"
# U+1F600 in CESU-8: each half of its UTF-16 surrogate pair encoded alone, in three bytes.
CESU8_EMOJI = b"\xed\xa0\xbd\xed\xb8\x80"


@pytest.mark.parametrize(
    "encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]
)
def test_json_in_utf16_or_utf32_is_refused(encoding: str) -> None:
    assert rejected("body:/id", EVENT.encode(encoding)) == NOT_JSON


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "evt_1", "note": "' + CESU8_EMOJI + b'"}',
        b'{"id": "evt_1", "note": "\xed\xa0\x80"}',
        b'{"id": "evt_' + CESU8_EMOJI + b'"}',
    ],
    ids=["cesu8-beside-the-id", "lone-surrogate-beside-the-id", "cesu8-in-the-id"],
)
def test_surrogates_encoded_as_three_bytes_are_refused(body: bytes) -> None:
    assert rejected("body:/id", body) == NOT_JSON


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(constant: str) -> None:
    body = f'{{"id": "evt_1", "amount": {constant}}}'.encode()

    assert rejected("body:/id", body) == NOT_JSON


def test_one_utf8_byte_order_mark_is_ignored_and_a_second_is_refused() -> None:
    # RFC 8259 section 8.1: senders must not add one, parsers may ignore it. Ignoring it cannot
    # change the ID, so the proxy and an app that refuses it never disagree about an event.
    bom = b"\xef\xbb\xbf"

    assert extract("body:/id", bom + EVENT.encode(), type_source="body:/type") == (
        "evt_1",
        "invoice.paid",
    )
    assert rejected("body:/id", bom + bom + EVENT.encode()) == NOT_JSON


@pytest.mark.parametrize(
    ("raw", "event_id"),
    [
        ("id=evt_1", "evt_1"),
        ("id=%EF%BF%BD", "\ufffd"),
        ("id=caf%C3%A9", "caf\u00e9"),
        ("id=caf%c3%a9", "caf\u00e9"),
        ("id=a+b", "a b"),
        ("id=a%2Bb", "a+b"),
        ("id=a=b", "a=b"),
        ("%69d=evt_2", "evt_2"),
        ("other=%FF&id=evt_3", "evt_3"),
        ("&x&id=evt_4&", "evt_4"),
    ],
)
def test_raw_query_id_is_percent_decoded_as_utf8(raw: str, event_id: str) -> None:
    assert extract("query:id", query=raw) == (event_id, None)


@pytest.mark.parametrize(
    "escape", ["%E9", "%FF", "%C0", "%C0%AF", "%ED%A0%80", "%F4%90%80%80", "evt%E9", "%zz", "%4"]
)
def test_query_id_that_is_not_percent_encoded_utf8_is_refused(escape: str) -> None:
    # aiohttp's request.query decodes with errors="replace": the first three would be one
    # claim with a real U+FFFD (%EF%BF%BD), and all but the first event lost as duplicates.
    assert rejected("query:id", query=f"id={escape}") == (
        "route 'stripe': query:id is not percent-encoded UTF-8"
    )


@pytest.mark.parametrize("escape", ["%E9", "%FF", "%C0", "%EF%BF%BD"])
def test_replacement_character_in_an_already_decoded_query_is_refused(escape: str) -> None:
    decoded = list(yarl.URL(f"/hook?id={escape}").query.items())

    assert decoded == [("id", "\ufffd")]
    assert rejected("query:id", query=decoded) == (
        "route 'stripe': query:id holds U+FFFD, which stands for any byte that was not UTF-8"
    )


@pytest.mark.parametrize("raw", ["id=evt_1#frag", "x=1#&id=evt_1", "id=evt_1;x=1", "x=1;id=evt_1"])
def test_query_with_a_fragment_or_semicolon_is_refused(raw: str) -> None:
    # Go's net/http keeps "#..." in the query, other parsers drop it; Rack 2 splits on ";".
    assert rejected("query:id", query=raw) == (
        "route 'stripe': the query has '#' or ';', which parsers split differently"
    )


FORMAT_CHARACTERS = [
    *"\u202a\u202b\u202c\u202d\u202e",  # bidi embeddings and overrides
    *"\u2066\u2067\u2068\u2069",  # bidi isolates
    *"\u200e\u200f\u061c",  # bidi marks
    *"\u200b\u200c\u200d\u2060\ufeff\u00ad",  # zero width, soft hyphen
]


@pytest.mark.parametrize("char", FORMAT_CHARACTERS, ids=lambda char: f"U+{ord(char):04X}")
def test_bidi_and_zero_width_characters_are_refused_from_every_source(char: str) -> None:
    event_id = f"evt_{char}1"
    reason = "no control characters or Unicode format characters) or an integer, got str"

    assert rejected("body:/id", body_id(event_id)).endswith(reason)
    assert rejected("header:X-Id", headers=[("X-Id", event_id)]).endswith(reason)
    assert rejected("query:id", query=urlencode({"id": event_id})).endswith(reason)


@settings(max_examples=200, deadline=None)
@given(char=st.characters(categories=["Cf"]))
def test_any_format_character_is_refused(char: str) -> None:
    assert unicodedata.category(char) == "Cf"
    assert "got str" in rejected("body:/id", body_id(f"evt{char}"))


@pytest.mark.parametrize(
    "connection",
    [
        [("Connection", "X-Id")],
        [("Connection", "keep-alive, x-ID")],
        [("Connection", "close"), ("Connection", " x-id ")],
    ],
)
def test_connection_naming_the_id_header_is_refused(connection: list[tuple[str, str]]) -> None:
    # The forwarder removes what Connection names: the app would never see the ID.
    assert rejected("header:X-Id", headers=[*connection, ("X-Id", "h-1")]) == (
        "route 'stripe': Connection names X-Id, which would not reach the app"
    )


def test_connection_naming_the_type_header_is_refused() -> None:
    headers = [("Connection", "x-type"), ("X-Id", "h-1"), ("X-Type", "push")]

    assert rejected("header:X-Id", headers=headers, type_source="header:X-Type") == (
        "route 'stripe': Connection names X-Type, which would not reach the app"
    )


def test_connection_naming_other_headers_is_accepted() -> None:
    headers = [("Connection", "keep-alive, X-Trace"), ("X-Id", "h-1"), ("X-Trace", "t")]

    assert extract("header:X-Id", headers=headers) == ("h-1", None)
    assert extract("body:/id", EVENT.encode(), headers=[("Connection", "id")]) == ("evt_1", None)


def test_refuse_connection_naming_for_the_signature_headers() -> None:
    names = ("Stripe-Signature", "X-Hub-Signature-256")
    event_ids.refuse_connection_naming(
        CIMultiDict([("Connection", "close, Upgrade")]), names, ROUTE
    )

    with pytest.raises(errors.EventIdInvalid) as info:
        event_ids.refuse_connection_naming(
            CIMultiDict([("Connection", "keep-alive"), ("connection", "x-hub-signature-256")]),
            names,
            ROUTE,
        )

    assert info.value.status == 400
    assert info.value.message == (
        "route 'stripe': Connection names X-Hub-Signature-256, which would not reach the app"
    )


# --- the event type ----------------------------------------------------------------------------


def test_type_from_header_while_id_from_body() -> None:
    assert extract(
        "body:/id",
        b'{"id": "evt_2"}',
        headers=[("X-Event-Type", "push")],
        type_source="header:X-Event-Type",
    ) == ("evt_2", "push")


def test_integer_type_is_stored_as_text() -> None:
    assert extract("body:/id", b'{"id": "e", "type": 7}', type_source="body:/type") == ("e", "7")


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "e"}',
        b'{"id": "e", "type": null}',
        b'{"id": "e", "type": true}',
        b'{"id": "e", "type": 1.5}',
        b'{"id": "e", "type": {"a": 1}}',
        b'{"id": "e", "type": ["a"]}',
        b'{"id": "e", "type": ""}',
        b'{"id": "e", "type": "bad\\u0000type"}',
        json.dumps({"id": "e", "type": "t" * 300}).encode(),
    ],
    ids=["missing", "null", "bool", "float", "object", "array", "empty", "nul", "long"],
)
def test_missing_or_odd_type_is_none(body: bytes) -> None:
    assert extract("body:/id", body, type_source="body:/type") == ("e", None)


def test_missing_type_header_is_none() -> None:
    assert extract("header:X-Id", headers=[("X-Id", "h")], type_source="header:X-Type") == (
        "h",
        None,
    )


def test_repeated_type_header_is_none_not_an_error() -> None:
    # The type is informational: the request must not be refused over it.
    headers = [("X-Id", "h"), ("X-Type", "push"), ("X-Type", "pull")]

    assert extract("header:X-Id", headers=headers, type_source="header:X-Type") == ("h", None)


@pytest.mark.parametrize("raw", ["type=%FF", "type=push;x", "type=push&type=pull"])
def test_unreadable_type_in_the_query_is_none_not_an_error(raw: str) -> None:
    assert extract("header:X-Id", headers=[("X-Id", "h")], query=raw, type_source="query:type") == (
        "h",
        None,
    )


def test_type_in_body_does_not_make_a_non_json_body_fatal() -> None:
    # The ID is in a header; only the informational type needs the body to be JSON.
    assert extract(
        "header:X-Id", b"payload=1", headers=[("X-Id", "h")], type_source="body:/type"
    ) == ("h", None)


# --- any input ---------------------------------------------------------------------------------

EXTRACTORS = [
    event_ids.Extractor(
        "a", event_ids.parse_source("body:/id"), event_ids.parse_source("body:/type")
    ),
    event_ids.Extractor("b", event_ids.parse_source("body:/data/0/id")),
    event_ids.Extractor("c", event_ids.parse_source("body:")),
    event_ids.Extractor(
        "d", event_ids.parse_source("header:X-Id"), event_ids.parse_source("header:X-Type")
    ),
    event_ids.Extractor(
        "e", event_ids.parse_source("query:id"), event_ids.parse_source("body:/type")
    ),
]
_text = st.text(max_size=300) | st.text(
    st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=300
)
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | _text,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(["id", "type", "data", "0"]), children, max_size=4)
    ),
    max_leaves=12,
)
_scalar = _text | st.integers() | _json
_webhook = st.fixed_dictionaries(
    {"id": _scalar, "type": _scalar, "data": st.lists(st.fixed_dictionaries({"id": _scalar}))}
)
# Arbitrary bytes, arbitrary JSON, and webhook-shaped JSON with arbitrary values.
_bodies = st.one_of(
    st.binary(max_size=200),
    _json.map(lambda value: json.dumps(value).encode()),
    _webhook.map(lambda value: json.dumps(value).encode()),
)
_pairs = st.lists(
    st.tuples(st.sampled_from(["X-Id", "x-id", "X-Type", "id", "Connection"]), _text), max_size=3
)
# The raw query as sent (arbitrary, or form-encoded pairs), or as aiohttp has decoded it.
_queries = st.one_of(
    st.text(st.sampled_from("id=&%+#;aE9Fc0 "), max_size=30),
    _pairs.map(urlencode),
    _pairs.map(MultiDict),
)


@settings(max_examples=300, deadline=None)
@given(extractor=st.sampled_from(EXTRACTORS), body=_bodies, headers=_pairs, query=_queries)
def test_any_request_gives_an_id_or_event_id_invalid(
    extractor: event_ids.Extractor,
    body: bytes,
    headers: list[tuple[str, str]],
    query: str | MultiDict[str],
) -> None:
    try:
        result = extractor.extract(CIMultiDict(headers), query, body)
    except errors.EventIdInvalid as exc:
        message = exc.message
        result = None
    if result is None:
        assert message.startswith(f"route {extractor.route!r}: ")
        return
    event_id, event_type = result
    assert isinstance(event_id, str)
    assert event_id
    assert event_type is None or (isinstance(event_type, str) and event_type)
    for value in (event_id, event_type or ""):
        assert not {unicodedata.category(char) for char in value} & {"Cc", "Cf", "Cs"}


def test_a_duplicate_key_on_the_way_to_the_id_is_refused_elsewhere_it_is_not_ours() -> None:
    extractor = event_ids.Extractor(
        "r", event_ids.parse_source("body:/data/id"), event_ids.parse_source("body:/type")
    )
    on_the_way = b'{"data": {"id": "a", "id": "b"}, "type": "t"}'
    above = b'{"data": {"id": "a"}, "data": {"id": "b"}}'
    elsewhere = b'{"data": {"id": "a", "x": 1, "x": 2}, "meta": {"k": 1, "k": 2}, "type": "t"}'

    for body in (on_the_way, above):
        with pytest.raises(errors.EventIdInvalid, match="duplicate JSON key"):
            extractor.extract(CIMultiDict(), "", body)
    # Keys the proxy does not read cannot make it and the app read different IDs.
    assert extractor.extract(CIMultiDict(), "", elsewhere) == ("a", "t")


def test_parsing_makes_no_python_call_per_json_object() -> None:
    """A body of many small objects must not cost a Python function call each: one client
    sending megabytes of them would otherwise hold the event loop for seconds."""
    body = b'{"id": "x", "items": [' + b'{"a": {}},' * 10_000 + b"{}]}"
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    # The earlier tests' garbage is collected first, and the collector kept off meanwhile: a
    # finalizer it would run (a socket's, a transport's) is a Python call that is not the
    # parser's (184 calls in one CI run).
    gc.collect()
    gc.disable()
    sys.setprofile(count)
    try:
        event_ids.parse_json(body)
    finally:
        sys.setprofile(None)
        gc.enable()
    assert calls < 100


# --- batches: one POST, an array of events (SendGrid, HubSpot, Adyen) ---------------------------


def batch_of(*ids: object, key: str = "sg_event_id") -> bytes:
    return json.dumps([{key: value, "event": "delivered"} for value in ids]).encode()


def digest(*ids: str) -> str:
    return "batch:sha256:" + hashlib.sha256(event_ids.join(sorted(ids)).encode()).hexdigest()


def test_a_batch_of_one_event_is_keyed_by_its_id() -> None:
    assert extract("body:/*/sg_event_id", batch_of("ZHJvcC0x")) == ("ZHJvcC0x", None)
    assert extract("body:/*/sg_event_id", batch_of(7, 7)) == ("7", None)


def test_a_batch_of_several_events_is_keyed_by_the_digest_of_their_ids_in_any_order() -> None:
    key, _ = extract("body:/*/sg_event_id", batch_of("a", "b", "c"))

    assert key == digest("a", "b", "c")
    assert extract("body:/*/sg_event_id", batch_of("c", "a", "b", "a"))[0] == key
    # Regrouped, the events make other deliveries: forwarded again, never dropped as copies.
    assert extract("body:/*/sg_event_id", batch_of("a", "b"))[0] not in (key, "a", "b")
    assert extract("body:/*/sg_event_id", batch_of("a", "b", "c", "d"))[0] != key


def test_a_composite_batch_key_pairs_each_events_parts() -> None:
    def notification(*items: tuple[str, str]) -> bytes:
        return json.dumps({"notificationItems": [
            {"NotificationRequestItem": {"pspReference": psp, "eventCode": code}}
            for psp, code in items
        ]}).encode()  # fmt: skip

    body = notification(("p1", "AUTHORISATION"), ("p2", "REFUND"))
    swapped = notification(("p1", "REFUND"), ("p2", "AUTHORISATION"))
    extractor = event_ids.Extractor(ROUTE, (
        event_ids.parse_source("body:/notificationItems/*/NotificationRequestItem/pspReference"),
        event_ids.parse_source("body:/notificationItems/*/NotificationRequestItem/eventCode"),
    ))  # fmt: skip

    key, _ = extractor.extract(CIMultiDict(), "", body)

    assert key == digest("p1:AUTHORISATION", "p2:REFUND")
    assert extractor.extract(CIMultiDict(), "", swapped)[0] != key
    one = notification(("p1", "AUTHORISATION"))
    assert extractor.extract(CIMultiDict(), "", one)[0] == "p1:AUTHORISATION"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[]", "no event ID at body:/*/sg_event_id (no array, or an empty one)"),
        (b'{"sg_event_id": "a"}', "no event ID at body:/*/sg_event_id (no array, or an empty one)"),
        (batch_of("a")[:-1] + b', {"event": "open"}]', "no event ID at body:/*/sg_event_id"),
    ],
)
def test_a_batch_without_an_id_in_every_event_has_none(body: bytes, message: str) -> None:
    assert rejected("body:/*/sg_event_id", body) == f"route 'stripe': {message}"


def test_a_batch_event_with_an_invalid_id_is_refused() -> None:
    with pytest.raises(errors.EventIdInvalid, match="must be a non-empty string"):
        extract("body:/*/sg_event_id", batch_of("a", ""))
    body = b'[{"sg_event_id": "a"}, {"sg_event_id": "b", "sg_event_id": "c"}]'
    with pytest.raises(errors.EventIdInvalid, match="duplicate JSON key 'sg_event_id'"):
        extract("body:/*/sg_event_id", body)


def test_a_pointer_holds_one_star_and_a_composite_batch_key_one_array() -> None:
    with pytest.raises(ValueError, match="may hold one"):
        event_ids.parse_source("body:/*/items/*/id")
    with pytest.raises(ValueError, match="same path to its"):
        event_ids.Extractor(ROUTE, (
            event_ids.parse_source("body:/a/*/id"), event_ids.parse_source("body:/b/*/id")
        ))  # fmt: skip
    with pytest.raises(ValueError, match="same path to its"):
        event_ids.Extractor(ROUTE, (
            event_ids.parse_source("body:/a/*/id"), event_ids.parse_source("header:X-Id")
        ))  # fmt: skip
