"""Event-ID sources and their extraction from a request's headers, query and body."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict, MultiDict

from proxy import errors, keys

ROUTE = "stripe"


def extract(
    id_source: str,
    body: bytes = b"",
    *,
    headers: list[tuple[str, str]] | None = None,
    query: list[tuple[str, str]] | None = None,
    type_source: str | None = None,
) -> tuple[str, str | None]:
    extractor = keys.Extractor(
        ROUTE,
        keys.parse_source(id_source),
        keys.parse_source(type_source) if type_source else None,
    )
    return extractor.extract(CIMultiDict(headers or []), MultiDict(query or []), body)


def body_id(value: object) -> bytes:
    return json.dumps({"id": value}).encode()


def rejected(
    id_source: str,
    body: bytes = b"",
    *,
    headers: list[tuple[str, str]] | None = None,
    query: list[tuple[str, str]] | None = None,
) -> str:
    """The message of the EventIdInvalid raised for this request."""
    with pytest.raises(errors.EventIdInvalid) as info:
        extract(id_source, body, headers=headers, query=query)
    assert info.value.status == 400
    assert info.value.code == "event_id_invalid"
    return info.value.message


# --- sources -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "source"),
    [
        ("body:/id", keys.Source("body", "/id", ("id",))),
        ("body:/data/object/id", keys.Source("body", "/data/object/id", ("data", "object", "id"))),
        ("body:/a~1b/c~0d", keys.Source("body", "/a~1b/c~0d", ("a/b", "c~d"))),
        ("body:/~01", keys.Source("body", "/~01", ("~1",))),
        ("body:/events/0", keys.Source("body", "/events/0", ("events", "0"))),
        ("body:", keys.Source("body", "", ())),
        ("body:/", keys.Source("body", "/", ("",))),
        ("header:X-GitHub-Delivery", keys.Source("header", "X-GitHub-Delivery")),
        ("query:event_id", keys.Source("query", "event_id")),
    ],
)
def test_parse_source(text: str, source: keys.Source) -> None:
    assert keys.parse_source(text) == source
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
    ],
)
def test_parse_source_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        keys.parse_source(text)
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
        f"no control characters) or an integer, got {kind}"
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
        "no control characters) or an integer, got str"
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
    ],
)
def test_repeated_header_or_query_parameter_is_rejected(
    source: str, headers: list[tuple[str, str]], query: list[tuple[str, str]]
) -> None:
    assert rejected(source, headers=headers, query=query) == (
        f"route 'stripe': {source} appears 2 times"
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


def test_type_in_body_does_not_make_a_non_json_body_fatal() -> None:
    # The ID is in a header; only the informational type needs the body to be JSON.
    assert extract(
        "header:X-Id", b"payload=1", headers=[("X-Id", "h")], type_source="body:/type"
    ) == ("h", None)


# --- any input ---------------------------------------------------------------------------------

EXTRACTORS = [
    keys.Extractor("a", keys.parse_source("body:/id"), keys.parse_source("body:/type")),
    keys.Extractor("b", keys.parse_source("body:/data/0/id")),
    keys.Extractor("c", keys.parse_source("body:")),
    keys.Extractor("d", keys.parse_source("header:X-Id"), keys.parse_source("header:X-Type")),
    keys.Extractor("e", keys.parse_source("query:id"), keys.parse_source("body:/type")),
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
_pairs = st.lists(st.tuples(st.sampled_from(["X-Id", "x-id", "X-Type", "id"]), _text), max_size=3)


@settings(max_examples=300, deadline=None)
@given(extractor=st.sampled_from(EXTRACTORS), body=_bodies, headers=_pairs, query=_pairs)
def test_any_request_gives_an_id_or_event_id_invalid(
    extractor: keys.Extractor,
    body: bytes,
    headers: list[tuple[str, str]],
    query: list[tuple[str, str]],
) -> None:
    try:
        result = extractor.extract(CIMultiDict(headers), MultiDict(query), body)
    except errors.EventIdInvalid as exc:
        message = exc.message
        result = None
    if result is None:
        assert message.startswith(f"route {extractor.route!r}: ")
        return
    assert isinstance(result, tuple)
    event_id, event_type = result
    assert isinstance(event_id, str)
    assert event_id
    assert event_type is None or (isinstance(event_type, str) and event_type)
