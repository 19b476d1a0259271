"""What the app is told about the client: ``X-Forwarded-For``, ``-Proto`` and ``-Host``.

A client can send these headers itself. Only a peer listed in ``trusted_proxies`` (an ingress
or load balancer in front of the sidecar) is believed: its values are kept and its own address
is appended to ``X-Forwarded-For``. From any other peer they are replaced by what the proxy saw
(the peer's address, the scheme it was reached by, the ``Host`` it was sent), and the RFC 7239
``Forwarded`` header is dropped, so an app can rely on them whoever reaches the sidecar.
aiohttp-remotes' ``XForwardedFiltered`` is the model.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from aiohttp import hdrs
from multidict import CIMultiDict

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


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
    """Set the X-Forwarded-* fields of a request to the app (``headers`` is its copy)."""
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
    for name in (hdrs.X_FORWARDED_FOR, hdrs.X_FORWARDED_PROTO, hdrs.X_FORWARDED_HOST,
                 hdrs.FORWARDED):  # fmt: skip
        headers.popall(name, None)
    if peer:
        headers[hdrs.X_FORWARDED_FOR] = peer
    headers[hdrs.X_FORWARDED_PROTO] = scheme
    if host:
        headers[hdrs.X_FORWARDED_HOST] = host
