"""What the app is told about the client: its address, the scheme and host it reached, the target
it first asked for.

A client can send these headers itself. Only a peer listed in ``trusted_proxies`` (an ingress
or load balancer in front of the sidecar) is believed: all of them are kept as it sent them
(setting or clearing them is its job) and its own address is appended to ``X-Forwarded-For``.
From any other peer, ``X-Forwarded-For``, ``-Proto`` and ``-Host`` are replaced by what the
proxy saw (the peer's address, the scheme it was reached by, the ``Host`` it was sent) and
every other header of the family (``UNTRUSTED_DROPPED``) is removed, so an app can rely on
what it reads whoever reaches the sidecar. aiohttp-remotes' ``XForwardedFiltered`` is the model
for the first, Traefik's ``forwardedheaders`` for the second.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from aiohttp import hdrs
from multidict import CIMultiDict

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Replaced, from an untrusted peer, by what the proxy saw.
REPLACED = (hdrs.X_FORWARDED_FOR, hdrs.X_FORWARDED_PROTO, hdrs.X_FORWARDED_HOST)
# Removed from an untrusted peer: headers in which a proxy or CDN, never a client, tells the
# app about the client. Frameworks read them ahead of or instead of the three above, so a client
# that reached the sidecar directly could pick its address, scheme or target as the app sees
# them. Their spellings with "_" never reach the app (forwarder.request_headers).
UNTRUSTED_DROPPED = (
    # Its address, as CDNs (Akamai, Cloudflare, Fastly) and proxies pass it on: chi's RealIP
    # reads True-Client-IP, then X-Real-IP; Rails' RemoteIp Client-IP; the request-ip package
    # all of these; ingress-nginx keeps a client's own X-Forwarded-For as -Original-.
    hdrs.FORWARDED, "X-Real-IP", "True-Client-IP", "CF-Connecting-IP", "CF-Connecting-IPv6",
    "CF-Pseudo-IPv4", "Fastly-Client-IP", "Client-IP", "X-Client-IP", "X-Cluster-Client-IP",
    "X-Original-Forwarded-For", "X-Forwarded", "Forwarded-For",
    # Its scheme and port: Rack reads X-Forwarded-Ssl and -Scheme before -Proto, and -Port;
    # PHP frameworks and Paste deployments Front-End-Https, X-Url-Scheme, -Protocol.
    "X-Forwarded-Scheme", "X-Scheme", "X-Forwarded-Ssl", "X-Url-Scheme", "Front-End-Https",
    "X-Forwarded-Protocol", "CF-Visitor", "X-Forwarded-Port",
    # The server, prefix and target it first asked for: URLs are built under -Prefix/-Path
    # (Spring, Werkzeug's ProxyFix, Kong); forward-auth services authorize -Uri/-Method and
    # X-Original-URI; Symfony and Zend routed by X-Original-URL/X-Rewrite-URL, which would take
    # a pass-through request to a webhook handler, past routing and verification.
    "X-Forwarded-Server", "X-Forwarded-Prefix", "X-Forwarded-Path", "X-Forwarded-Uri",
    "X-Forwarded-Method", "X-Original-URI", "X-Original-URL", "X-Rewrite-URL",
    # Its TLS certificate as the ingress verified it (Traefik's passTLSClientCert, Envoy's XFCC).
    "X-Forwarded-Tls-Client-Cert", "X-Forwarded-Tls-Client-Cert-Info", "X-Forwarded-Client-Cert",
)  # fmt: skip
_UNTRUSTED = frozenset(name.lower() for name in (*REPLACED, *UNTRUSTED_DROPPED))


def parse_networks(value: object) -> tuple[Network, ...]:
    """A list of addresses or CIDRs (``10.0.0.0/8``, ``::1``); ValueError otherwise."""
    if not isinstance(value, list):
        raise ValueError(f"must be a list of addresses or CIDRs, got {value!r}")
    networks = []
    for item in value:
        try:
            # strict=False: 10.1.2.3/8 means 10.0.0.0/8, as in nginx's set_real_ip_from.
            networks.append(ipaddress.ip_network(str(item), strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not an IP address or CIDR") from None
    return tuple(networks)


class TrustedProxies:
    """The peers whose X-Forwarded-* headers are believed."""

    def __init__(self, networks: Iterable[Network] = ()) -> None:
        self.networks = tuple(networks)

    def trusts(self, peer: str | None) -> bool:
        if not self.networks or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:  # a Unix socket's peer, or no peer at all
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in network for network in self.networks)


def set_forwarded(
    headers: CIMultiDict[str], *, peer: str | None, scheme: str, host: str | None, trusted: bool
) -> None:
    """Set the forwarding headers of a request to the app (``headers`` is its copy): from a
    ``trusted`` peer as it sent them, otherwise only what the proxy saw."""
    if trusted:
        prior = ", ".join(headers.popall(hdrs.X_FORWARDED_FOR, []))
        if peer:
            headers[hdrs.X_FORWARDED_FOR] = f"{prior}, {peer}" if prior else peer
        elif prior:
            headers[hdrs.X_FORWARDED_FOR] = prior
        headers.setdefault(hdrs.X_FORWARDED_PROTO, scheme)
        if host:
            headers.setdefault(hdrs.X_FORWARDED_HOST, host)
        return
    for name in [name for name in headers if name.lower() in _UNTRUSTED]:
        headers.popall(name, None)
    if peer:
        headers[hdrs.X_FORWARDED_FOR] = peer
    headers[hdrs.X_FORWARDED_PROTO] = scheme
    if host:
        headers[hdrs.X_FORWARDED_HOST] = host
