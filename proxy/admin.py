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
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy import app_keys, console, errors
from proxy.upstream import forwarder

# Within connections.MARGIN, beside the listeners, the loop's own descriptors and the public
# listener's refusals; refused admin connections are closed at once, not left to linger.
MAX_CONNECTIONS = 16
# Below the usual scrape intervals (15 s and up), so a scraper holds nothing between scrapes; the
# time a client has to send its headers too (aiohttp's keep-alive timer runs from the start).
KEEPALIVE = 5.0
# The console's forms are a few fields; nothing else here reads a body.
MAX_BODY = 64 * 1024


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


def create_admin_app(proxy: web.Application) -> web.Application:
    admin = web.Application(client_max_size=MAX_BODY)
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
    if proxy[app_keys.CONFIG].admin.console.enabled:
        admin.router.add_get("/console", _to_console)
        admin.add_subapp("/console", console.create_console_app(proxy))
    return admin
