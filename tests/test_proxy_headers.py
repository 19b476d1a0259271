"""X-Forwarded-* from untrusted clients are replaced by what the proxy saw and the rest of the
forwarding family is removed; from trusted_proxies they are kept."""

from __future__ import annotations

import ipaddress

import pytest
from multidict import CIMultiDict

from proxy import config, errors
from proxy.upstream import proxy_headers
from tests.helpers import FakeUpstream, MakeProxy

SPOOFED = {
    "X-Forwarded-For": "203.0.113.66",
    "X-Forwarded-Proto": "https",
    "X-Forwarded-Host": "bank.example",
    "Forwarded": "for=203.0.113.66;proto=https",
}
# Written out here, not read from proxy_headers.py: what a client that reaches the sidecar directly
# sends to choose its address, scheme, port or target as the app reads them (chi's RealIP, Rack,
# Rails, Symfony, forward-auth services). The third probe saw the first eleven reach the app.
FAMILY = {
    "X-Real-IP": "203.0.113.66",
    "True-Client-IP": "203.0.113.66",
    "CF-Connecting-IP": "203.0.113.66",
    "Client-IP": "203.0.113.66",
    "Fastly-Client-IP": "203.0.113.66",
    "X-Forwarded-Ssl": "on",
    "X-Forwarded-Scheme": "https",
    "X-Forwarded-Port": "443",
    "X-Forwarded-Prefix": "/admin",
    "X-Client-IP": "203.0.113.66",
    "X-Cluster-Client-IP": "203.0.113.66",
    "CF-Connecting-IPv6": "2001:db8::66",
    "CF-Pseudo-IPv4": "240.0.0.66",
    "X-Original-Forwarded-For": "203.0.113.66",
    "X-Forwarded": "for=203.0.113.66",
    "Forwarded-For": "203.0.113.66",
    "X-Scheme": "https",
    "X-Url-Scheme": "https",
    "Front-End-Https": "on",
    "X-Forwarded-Protocol": "https",
    "CF-Visitor": '{"scheme":"https"}',
    "X-Forwarded-Server": "bank.example",
    "X-Forwarded-Path": "/admin",
    "X-Forwarded-Uri": "/admin/users",
    "X-Forwarded-Method": "GET",
    "X-Original-URI": "/admin/users",
    "X-Original-URL": "/webhooks/corvel",
    "X-Rewrite-URL": "/webhooks/corvel",
    "X-Forwarded-Tls-Client-Cert": "MIIB",
    "X-Forwarded-Tls-Client-Cert-Info": "Subject%3D%22CN%3Dadmin%22",
    "X-Forwarded-Client-Cert": "By=spiffe://bank/admin;Hash=00",
}


def test_trusted_proxies_match_addresses_and_networks() -> None:
    trusted = proxy_headers.TrustedProxies(
        proxy_headers.parse_networks(["10.0.0.0/8", "2001:db8::1"])
    )
    assert trusted.trusts("10.1.2.3")
    assert trusted.trusts("::ffff:10.1.2.3")  # an IPv4 peer on a dual-stack socket
    assert trusted.trusts("2001:db8::1")
    assert not trusted.trusts("11.0.0.1")
    assert not trusted.trusts("2001:db8::2")
    assert not trusted.trusts(None)
    assert not trusted.trusts("")
    assert not proxy_headers.TrustedProxies().trusts("10.1.2.3")  # nobody by default


def test_trusted_proxies_are_validated() -> None:
    base = {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "embedded"},
        "routes": [{"name": "a", "path": "/a", "event_id": "body:/id"}],
    }
    cfg = config.parse({**base, "trusted_proxies": ["10.1.2.3/8"]})
    assert cfg.trusted_proxies == (ipaddress.ip_network("10.0.0.0/8"),)
    assert config.parse(base).trusted_proxies == ()
    with pytest.raises(errors.ConfigError) as info:
        config.parse({**base, "trusted_proxies": ["10.0.0.0/33", "ingress"]})
    assert info.value.problems == ("trusted_proxies: '10.0.0.0/33' is not an IP address or CIDR",)
    with pytest.raises(errors.ConfigError) as info:
        config.parse({**base, "trusted_proxies": "10.0.0.0/8"})
    assert info.value.problems[0].startswith("trusted_proxies: must be a list")


@pytest.mark.parametrize("trusted", [False, True])
def test_set_forwarded(trusted: bool) -> None:
    headers = CIMultiDict(SPOOFED)
    proxy_headers.set_forwarded(
        headers, peer="192.0.2.7", scheme="http", host="hooks.example", trusted=trusted
    )
    if trusted:
        assert headers.getall("X-Forwarded-For") == ["203.0.113.66, 192.0.2.7"]
        assert headers.getall("X-Forwarded-Proto") == ["https"]
        assert headers.getall("X-Forwarded-Host") == ["bank.example"]
        assert headers.getall("Forwarded") == [SPOOFED["Forwarded"]]
    else:
        assert headers.getall("X-Forwarded-For") == ["192.0.2.7"]
        assert headers.getall("X-Forwarded-Proto") == ["http"]
        assert headers.getall("X-Forwarded-Host") == ["hooks.example"]
        assert "Forwarded" not in headers


@pytest.mark.parametrize("trusted", [False, True])
def test_the_rest_of_the_family_is_believed_only_from_a_trusted_peer(trusted: bool) -> None:
    # Lower-cased too: header names are case-insensitive, a filter on spellings would not be.
    sent = [*FAMILY.items(), *((name.lower(), value) for name, value in FAMILY.items())]
    headers = CIMultiDict([*sent, ("X-Request-Id", "r-1"), ("Authorization", "Bearer t")])
    proxy_headers.set_forwarded(
        headers, peer="192.0.2.7", scheme="http", host="hooks.example", trusted=trusted
    )
    family = {name.lower() for name in FAMILY}
    kept = [(name, value) for name, value in headers.items() if name.lower() in family]
    assert kept == (sent if trusted else [])
    assert (headers.getall("X-Request-Id"), headers.getall("Authorization")) == (
        ["r-1"],
        ["Bearer t"],
    )


@pytest.mark.parametrize(
    ("trusted_proxies", "believed"), [([], False), (["192.0.2.0/24", "127.0.0.1"], True)]
)
@pytest.mark.parametrize("path", ["/webhooks/corvel", "/api/other"])
async def test_the_app_sees_forwarded_values_it_can_rely_on(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    trusted_proxies: list[str],
    believed: bool,
    path: str,
) -> None:
    client = await make_proxy(trusted_proxies=trusted_proxies)
    response = await client.post(
        path, data=b'{"id": "evt_fwd"}', headers={**SPOOFED, "Host": "hooks.example"}
    )
    assert response.status == 200
    (seen,) = upstream.requests
    if believed:
        assert seen.headers["x-forwarded-for"] == ["203.0.113.66, 127.0.0.1"]
        assert seen.headers["x-forwarded-proto"] == ["https"]
        assert seen.headers["x-forwarded-host"] == ["bank.example"]
        assert seen.headers["forwarded"] == [SPOOFED["Forwarded"]]
    else:
        assert seen.headers["x-forwarded-for"] == ["127.0.0.1"]
        assert seen.headers["x-forwarded-proto"] == ["http"]
        assert seen.headers["x-forwarded-host"] == ["hooks.example"]
        assert "forwarded" not in seen.headers


@pytest.mark.parametrize(
    ("trusted_proxies", "believed"), [([], False), (["192.0.2.0/24", "127.0.0.1"], True)]
)
@pytest.mark.parametrize("path", ["/webhooks/corvel", "/api/other"])
async def test_the_app_sees_no_client_address_scheme_or_target_it_cannot_rely_on(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    trusted_proxies: list[str],
    believed: bool,
    path: str,
) -> None:
    client = await make_proxy(trusted_proxies=trusted_proxies)
    response = await client.post(path, data=b'{"id": "evt_family"}', headers=FAMILY)
    assert response.status == 200
    (seen,) = upstream.requests
    assert seen.path_qs == path  # X-Original-URL did not move the request
    received = {name: seen.headers[name.lower()] for name in FAMILY if name.lower() in seen.headers}
    assert received == ({name: [value] for name, value in FAMILY.items()} if believed else {})
