"""The admin listener: ``/metrics``, ``/healthz``, ``/readyz`` and the operator console
(``/console/``, ``proxy.console``), never on the public port.

It is a separate application bound to ``admin.listen`` (loopback by default) that reads the
proxy application's state: its metrics registry, its claim store and whether it is draining.

Its clients are a kubelet, one or two Prometheus servers and an operator's browser, a few short
requests at a time, so it needs few connections and none for long. Each process keeps at most
``MAX_CONNECTIONS`` of them (``connections.ConnectionLimit``, the one waiting longest for a
request closed to make room), and closes one that has not sent a whole request within
``KEEPALIVE`` seconds of connecting or of its previous answer: otherwise idle admin connections
could take the descriptors that ``connections.MARGIN`` keeps for the proxy's own files, and
webhooks would fail for want of one.

It answers only requests whose ``Host`` names it (``AllowedHosts``), as Django's
``ALLOWED_HOSTS`` and Jupyter do, against DNS rebinding: a page in an operator's browser whose
name the attacker turns to 127.0.0.1 while ``kubectl port-forward`` holds that port would
otherwise read ``/metrics`` and the console as same-origin GETs. Such a request always carries
the attacker's name, never an IP address (a page's origin is the host its URL names; a page
served from an IP address is of that address alone, whatever DNS says): so localhost, any IP
address, the listener's own name and ``admin.allowed_hosts`` are answered, and the probes
(``PROBES``, which show nothing) whatever their ``Host``. Others get ``421``.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from dataclasses import dataclass

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy import app_keys, config, console, errors
from proxy.upstream import forwarder

log = logging.getLogger(__name__)

# Within connections.MARGIN, beside the listeners, the loop's own descriptors and the public
# listener's refusals; refused admin connections are closed at once, not left to linger.
MAX_CONNECTIONS = 16
# Below the usual scrape intervals (15 s and up), so a scraper holds nothing between scrapes; the
# time a client has to send its headers too (aiohttp's keep-alive timer runs from the start).
KEEPALIVE = 5.0
# The console's forms are a few fields; nothing else here reads a body.
MAX_BODY = 64 * 1024
# What a kubelet asks whatever Host it sends (the pod IP, or a probe's httpHeaders): they say
# only whether the proxy is alive and ready.
PROBES = frozenset({"/healthz", "/readyz"})
# A Host header's value: a bracketed IPv6 address or a name (IPv4 addresses too), and a port.
_HOST = re.compile(r"(?:\[([0-9a-f:.]+)\]|([a-z0-9._-]+))(?::[0-9]{1,5})?")


@dataclass(frozen=True, slots=True)
class AllowedHosts:
    """The ``Host`` values the admin listener answers: no ``Host`` (no browser sends none), an
    IP address, ``localhost``, the listener's own name, ``admin.allowed_hosts``."""

    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.org": its subdomains
    any_name: bool = False

    @classmethod
    def of(cls, settings: config.AdminConfig) -> AllowedHosts:
        names = {"localhost", settings.listen.host.lower().rstrip(".")}
        names.update(n for n in settings.allowed_hosts if n != "*")
        suffixes = tuple(n for n in settings.allowed_hosts if n.startswith("."))
        names.update(s.removeprefix(".") for s in suffixes)
        return cls(frozenset(names), suffixes, any_name="*" in settings.allowed_hosts)

    def admit(self, host: str | None) -> bool:
        if host is None:
            return True
        match = _HOST.fullmatch(host.strip().lower())
        if match is None:
            return False
        if match[1] is not None:
            return _address(match[1])
        name = match[2].rstrip(".")
        if _address(name) or self.any_name or name in self.names:
            return True
        return name.endswith(self.suffixes) if self.suffixes else False


def _address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def host_guard(allowed: AllowedHosts) -> Middleware:
    """The admin application's middleware: a request for a ``Host`` not ``allowed`` is answered
    ``421`` (the probes' excepted); the first one is logged, the others not."""
    said = False

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        nonlocal said
        host = request.headers.get(hdrs.HOST)
        if request.path in PROBES or allowed.admit(host):
            return await handler(request)
        if not said:
            said = True
            log.warning(
                "the admin listener refused a request for Host %r (DNS rebinding): if that "
                "name is yours, add it to admin.allowed_hosts; further refusals are not logged",
                (host or "")[:100],
            )
        raise web.HTTPMisdirectedRequest(
            text="refused: the admin listener does not answer to this Host (DNS rebinding); "
            "add the name to admin.allowed_hosts, or use localhost or an IP address\n",
            headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-store"},
        )

    return middleware


async def healthz(request: web.Request) -> web.Response:
    """The process is alive and its event loop answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready to take webhooks: not draining, and a claim can commit (the database answers and
    takes writes, the claim table is there and the role holds its grants)."""
    proxy = request.app[app_keys.PROXY]
    if proxy[app_keys.DRAINING].is_set():
        return web.json_response({"status": "draining"}, status=503)
    store = proxy.get(app_keys.STORE)
    if store is None:
        return web.json_response({"status": "starting"}, status=503)
    try:
        await store.check()
    except errors.Starting as exc:
        return web.json_response({"status": "starting", "reason": exc.message}, status=503)
    except errors.StoreUnavailable as exc:
        return web.json_response({"status": "unavailable", "reason": exc.message}, status=503)
    return web.json_response({"status": "ready"})


async def _to_console(request: web.Request) -> web.Response:
    raise web.HTTPMovedPermanently("/console/")


def warn_open_console(settings: config.AdminConfig) -> None:
    """Once per proxy: the console shown to whoever reaches a listener beyond loopback."""
    if settings.open_console:
        log.warning(
            "the console on admin.listen %s asks for no credentials "
            "(admin.console.unauthenticated: true): whoever reaches that address reads the "
            "kept deliveries, customers' data (see docs/security.md)",
            settings.listen,
        )


def create_admin_app(proxy: web.Application) -> web.Application:
    settings = proxy[app_keys.CONFIG].admin
    admin = web.Application(
        client_max_size=MAX_BODY, middlewares=[host_guard(AllowedHosts.of(settings))]
    )
    admin.on_response_prepare.append(forwarder.name_the_server)
    admin[app_keys.PROXY] = proxy
    meters = proxy[app_keys.METRICS]
    exposition = make_aiohttp_handler(meters.exposition_registry())

    async def metrics(request: web.Request) -> web.StreamResponse:
        meters.flush()  # what the requests added up since the last scrape (metrics.py)
        return await exposition(request)

    admin.router.add_get("/metrics", metrics)
    admin.router.add_get("/healthz", healthz)
    admin.router.add_get("/readyz", readyz)
    if settings.console.enabled:
        admin.router.add_get("/console", _to_console)
        admin.add_subapp("/console", console.create_console_app(proxy))
    return admin
