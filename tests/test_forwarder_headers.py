"""Header filtering between the webhook provider, the proxy and the upstream app."""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.upstream import forwarder, proxy_headers

HOP_BY_HOP_NAMES = [
    "Connection",
    "Keep-Alive",
    "Proxy-Connection",
    "Proxy-Authenticate",
    "Proxy-Authorization",
    "TE",
    "Trailer",
    "Transfer-Encoding",
    "Upgrade",
]
PEER = "203.0.113.7"


def outgoing(
    headers: list[tuple[str, str]],
    *,
    peer: str | None = PEER,
    scheme: str = "https",
    preserve_host: bool = True,
    keep_length: bool = False,
    trusted: bool = False,
) -> CIMultiDict[str]:
    return forwarder.request_headers(
        CIMultiDict(headers),
        peer=peer,
        scheme=scheme,
        preserve_host=preserve_host,
        keep_length=keep_length,
        trusted=trusted,
    )


def returned(headers: list[tuple[str, str]], *, keep_length: bool = False) -> CIMultiDict[str]:
    return forwarder.response_headers(
        CIMultiDictProxy(CIMultiDict(headers)), keep_length=keep_length
    )


def test_hop_by_hop_set() -> None:
    assert {name.lower() for name in HOP_BY_HOP_NAMES} == forwarder.HOP_BY_HOP


@pytest.mark.parametrize("name", [*HOP_BY_HOP_NAMES, "transfer-encoding", "UPGRADE"])
def test_hop_by_hop_header_is_not_forwarded(name: str) -> None:
    incoming = [("Content-Type", "application/json"), (name, "x"), ("Stripe-Signature", "t=1")]

    sent = outgoing(incoming)
    back = returned(incoming)

    assert name not in sent
    assert name not in back
    assert sent.getall("Stripe-Signature") == ["t=1"]
    assert list(back.items()) == [("Content-Type", "application/json"), ("Stripe-Signature", "t=1")]


def test_headers_named_by_connection_are_dropped() -> None:
    incoming = [
        ("Connection", "close, X-Foo"),
        ("X-Foo", "hop"),
        ("Connection", " x-TRACE ,keep-alive"),
        ("X-Trace", "hop"),
        ("X-Bar", "end-to-end"),
    ]

    sent = outgoing(incoming)
    back = returned(incoming)

    for headers in (sent, back):
        assert "X-Foo" not in headers
        assert "X-Trace" not in headers
        assert "Connection" not in headers
        assert headers.getall("X-Bar") == ["end-to-end"]


def test_request_headers_with_underscores_are_not_forwarded() -> None:
    # CGI, WSGI and Rack name a header HTTP_X_EVENT_ID whether it came as X-Event-Id or
    # X_Event_Id: the app could read a value the proxy never keyed on (nginx's
    # underscores_in_headers off, Envoy's headers_with_underscores_action: DROP_HEADER).
    incoming = [
        ("X-Event-Id", "evt_proxy"),
        ("X_Event_Id", "evt_app"),
        ("x_event-id", "evt_app"),
        ("Stripe-Signature", "t=1"),
        ("_", "x"),
    ]

    sent = outgoing(incoming)

    assert [name for name in sent if "_" in name] == []
    assert sent.getall("X-Event-Id") == ["evt_proxy"]
    assert sent.getall("Stripe-Signature") == ["t=1"]


@pytest.mark.parametrize("trusted", [False, True])
def test_a_clients_dedup_headers_never_reach_the_app(trusted: bool) -> None:
    # The proxy's own (Dedup-Receipt): a client's would have the app write the receipt of an
    # event still to come (issue 50 #3), on pass-through, on any webhook route, from any peer.
    incoming = [
        ("Dedup-Receipt", "f" * 64),
        ("dedup-receipt", "0" * 64),
        ("DEDUP-Anything", "x"),
        ("Dedup-Status", "processed"),
        ("X-Dedup-Receipt", "kept: not the proxy's"),
    ]

    sent = outgoing(incoming, trusted=trusted)

    assert [name for name in sent if name.lower().startswith("dedup-")] == []
    assert sent.getall("X-Dedup-Receipt") == ["kept: not the proxy's"]


def test_a_kept_deliverys_dedup_headers_are_not_sent_again() -> None:
    kept = CIMultiDict([("Dedup-Receipt", "f" * 64), ("Stripe-Signature", "t=1")])

    assert list(forwarder.without_own(kept).items()) == [("Stripe-Signature", "t=1")]


def test_response_headers_with_underscores_are_relayed() -> None:
    # Only the request is read by a CGI-style app; the provider gets the app's answer whole.
    assert returned([("X_App_Trace", "1")]).getall("X_App_Trace") == ["1"]


def test_repeated_end_to_end_headers_are_kept_in_order() -> None:
    upstream = [
        ("Set-Cookie", "a=1; Path=/"),
        ("Content-Type", "text/plain"),
        ("Transfer-Encoding", "chunked"),
        ("Set-Cookie", "b=2; Path=/"),
        ("X-Custom", "one"),
        ("X-Custom", "two"),
    ]

    back = returned(upstream)

    assert list(back.items()) == [
        ("Set-Cookie", "a=1; Path=/"),
        ("Content-Type", "text/plain"),
        ("Set-Cookie", "b=2; Path=/"),
        ("X-Custom", "one"),
        ("X-Custom", "two"),
    ]


def test_repeated_request_headers_are_kept_in_order() -> None:
    sent = outgoing([("X-Custom", "one"), ("Accept", "*/*"), ("X-Custom", "two")])

    assert sent.getall("X-Custom") == ["one", "two"]
    assert sent.getall("Accept") == ["*/*"]


@pytest.mark.parametrize(("keep_length", "expected"), [(False, []), (True, ["17"])])
def test_content_length_is_kept_only_when_asked(keep_length: bool, expected: list[str]) -> None:
    headers = [("Content-Length", "17"), ("Content-Type", "application/json")]

    assert outgoing(headers, keep_length=keep_length).getall("Content-Length", []) == expected
    assert returned(headers, keep_length=keep_length).getall("Content-Length", []) == expected


def test_forwarded_for_is_set_from_the_peer() -> None:
    assert outgoing([]).getall("X-Forwarded-For") == [PEER]


def test_forwarded_for_from_a_trusted_proxy_is_appended_to() -> None:
    chain = [("X-Forwarded-For", "198.51.100.1"), ("x-forwarded-for", "10.0.0.2")]

    trusted = outgoing(chain, trusted=True)
    untrusted = outgoing(chain)

    assert trusted.getall("X-Forwarded-For") == [f"198.51.100.1, 10.0.0.2, {PEER}"]
    assert untrusted.getall("X-Forwarded-For") == [PEER]  # a client's claim is dropped


def test_forwarded_for_without_a_peer() -> None:
    sent = [("X-Forwarded-For", "198.51.100.1")]
    assert outgoing([], peer=None).getall("X-Forwarded-For", []) == []
    assert outgoing(sent, peer=None, trusted=True).getall("X-Forwarded-For") == ["198.51.100.1"]
    assert outgoing(sent, peer=None).getall("X-Forwarded-For", []) == []


def test_forwarded_proto_and_host_are_set_when_absent() -> None:
    sent = outgoing([("Host", "hooks.example.com")], scheme="http")

    assert sent.getall("X-Forwarded-Proto") == ["http"]
    assert sent.getall("X-Forwarded-Host") == ["hooks.example.com"]


def test_forwarded_proto_and_host_from_a_trusted_ingress_win() -> None:
    incoming = [
        ("Host", "proxy.internal:8080"),
        ("X-Forwarded-Proto", "https"),
        ("X-Forwarded-Host", "hooks.example.com"),
    ]

    trusted = outgoing(incoming, scheme="http", trusted=True)
    untrusted = outgoing(incoming, scheme="http")

    assert trusted.getall("X-Forwarded-Proto") == ["https"]
    assert trusted.getall("X-Forwarded-Host") == ["hooks.example.com"]
    assert untrusted.getall("X-Forwarded-Proto") == ["http"]
    assert untrusted.getall("X-Forwarded-Host") == ["proxy.internal:8080"]


def test_no_forwarded_host_without_a_host() -> None:
    assert "X-Forwarded-Host" not in outgoing([])


def test_host_is_kept_when_preserved() -> None:
    sent = outgoing([("Host", "hooks.example.com")], preserve_host=True)

    assert sent.getall("Host") == ["hooks.example.com"]


def test_host_is_removed_when_not_preserved() -> None:
    sent = outgoing([("Host", "hooks.example.com")], preserve_host=False)

    assert "Host" not in sent
    assert sent.getall("X-Forwarded-Host") == ["hooks.example.com"]


def test_incoming_headers_are_not_modified() -> None:
    incoming = CIMultiDict(
        [("Host", "h"), ("Connection", "close"), ("Content-Length", "3"), ("X-Forwarded-For", "a")]
    )
    before = list(incoming.items())

    forwarder.request_headers(
        incoming, peer=PEER, scheme="https", preserve_host=False, keep_length=False
    )

    assert list(incoming.items()) == before


def _filtered_step_by_step(
    incoming: CIMultiDict[str], *, preserve_host: bool, keep_length: bool, trusted: bool
) -> CIMultiDict[str]:
    """The rules one at a time, as the filter was first written (one pass per rule): the model
    the one-pass filter must agree with."""
    dropped = set(forwarder.HOP_BY_HOP)
    for value in incoming.getall("Connection", []):
        dropped |= {token.strip().lower() for token in value.split(",")}
    headers = CIMultiDict((n, v) for n, v in incoming.items() if n.lower() not in dropped)
    for name in [name for name in headers if "_" in name or name.lower().startswith("dedup-")]:
        headers.popall(name, None)
    headers.popall("Expect", None)
    if not keep_length:
        headers.popall("Content-Length", None)
    host = incoming.get("Host")
    if not preserve_host:
        headers.popall("Host", None)
    proxy_headers.set_forwarded(headers, peer=PEER, scheme="https", host=host, trusted=trusted)
    return headers


_NAMES = st.sampled_from(
    [
        *HOP_BY_HOP_NAMES,
        "connection",
        "Host",
        "HOST",
        "Expect",
        "Content-Length",
        "X-Event_Id",
        "X-Forwarded-For",
        "x-forwarded-host",
        "X-Forwarded-Proto",
        "Forwarded",
        "X-Real-IP",
        "Stripe-Signature",
        "X-Custom",
        "x-custom",
        "Accept",
        "Dedup-Receipt",
        "dedup-status",
    ]
)
_VALUES = st.sampled_from(["1", "x-custom", "close, X-Custom", "keep-alive", "a, b", " Accept "])


@hypothesis.given(
    st.lists(st.tuples(_NAMES, _VALUES), max_size=12), st.booleans(), st.booleans(), st.booleans()
)
def test_the_one_pass_filter_agrees_with_the_rules_one_at_a_time(
    headers: list[tuple[str, str]], preserve_host: bool, keep_length: bool, trusted: bool
) -> None:
    got = outgoing(headers, preserve_host=preserve_host, keep_length=keep_length, trusted=trusted)
    expected = _filtered_step_by_step(
        CIMultiDict(headers), preserve_host=preserve_host, keep_length=keep_length, trusted=trusted
    )
    assert list(got.items()) == list(expected.items())
