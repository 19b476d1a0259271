"""The aiohttp application: one cleanup context per long-lived resource, one handler for every
request (it normalizes the path, then takes a configured webhook path through the pipeline and
passes anything else through to the upstream, when allowed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import hdrs, web, web_urldispatcher

from proxy import (
    app_keys,
    app_limit,
    config,
    database,
    delivery,
    embedded,
    errors,
    flights,
    memory,
    metrics,
    pipeline,
    reconciler,
    redeliverer,
    request_body,
    retention,
    route_holds,
    tracing,
)
from proxy.upstream import forwarder, proxy_headers

log = logging.getLogger(__name__)


def runner_options(cfg: config.Config) -> dict[str, Any]:
    """Server settings both `serve` and the tests use.

    The body is relayed as received (never inflated); a provider hanging up must not cancel a
    request the upstream may have acted on; and aiohttp's keep-alive timer, which also runs while
    a request's headers are still arriving, cuts off idle and slow-header (slowloris) clients.
    """
    return {
        "auto_decompress": False,
        "handler_cancellation": False,
        "keepalive_timeout": cfg.client_timeout,
    }


async def _database(app: web.Application) -> AsyncIterator[None]:
    settings = app[app_keys.CONFIG].database
    if settings.dsn is not None:
        app[app_keys.DSN] = settings.dsn.reveal()
        yield
        return
    server = embedded.EmbeddedPostgres(settings.data_dir, before=settings.data_dir_before)
    app[app_keys.DSN] = await asyncio.to_thread(server.start)
    try:
        yield
    finally:
        await asyncio.to_thread(server.stop)


# Between two tries of a start during an outage: from START_RETRY_BASE doubling up to
# START_RETRY_MAX, each a random part of it (jitter), so replicas started together spread out.
START_RETRY_BASE = 0.5
START_RETRY_MAX = 10.0


async def _claim_store(app: web.Application) -> AsyncIterator[None]:
    """The claim store, started before the public listener opens. A database that does not
    answer does not stop the start: the proxy listens (liveness up, readiness and webhooks 503
    with the reason) and tries again with a back-off until ``database.start_timeout``."""
    cfg = app[app_keys.CONFIG]
    store = database.Store.create(
        app[app_keys.DSN],
        cfg.database,
        claim_wait=cfg.claim_wait,
        upstream_timeout=cfg.upstream.timeout,
    )
    app[app_keys.STORE] = store
    app[app_keys.METRICS].watch_pool(
        store.pool_stats, lambda: None if store.replication is None else store.replication.waits
    )
    app[app_keys.METRICS].watch_grants(database.DEGRADED, lambda: store.degraded)
    # The answer columns are added only when a route replays: the ALTER TABLE that adds them
    # waits on every claim in flight (docs/deployment.md, "Upgrades"). A missing grant refuses
    # the start, rather than fail every sweep or every stored answer later.
    replay = any(route.replay for route in cfg.routes)
    # An ordered route's object rows live in the inbox's columns, and are locked by an UPDATE.
    # So is a shared limit's: its places are locked FOR UPDATE, which the inbox's grant allows.
    shared = cfg.upstream.concurrency if cfg.upstream.shared else None
    kept = any(route.redeliver or route.order for route in cfg.routes) or shared is not None
    # The scopes whose claims are bound, to their retention: the upgrade window's length.
    bound: dict[str, float] = {}
    for route in cfg.routes:
        if route.binds_claims:
            bound[route.scope] = max(bound.get(route.scope, 0.0), route.retention)
    receipted = any(route.receipt for route in cfg.routes)
    # The others: one whose claims were bound (verify removed) records that they are not.
    unbound = sorted({route.scope for route in cfg.routes} - bound.keys())
    start = functools.partial(
        store.start,
        answers=replay,
        kept=kept,
        bound=bound,
        unbound=unbound,
        receipted=receipted,
        shared=shared,
    )
    began = time.monotonic()
    retrying = None
    try:
        try:
            await start()
        except errors.NotPrepared:
            raise
        except errors.StoreUnavailable as exc:
            if cfg.database.embedded:
                raise  # started by this process a moment ago: not an outage to wait out
            log.warning(
                "the database does not answer (%s): listening anyway, and trying again for "
                "up to %s (database.start_timeout)",
                exc.message, config.values.format_duration(cfg.database.start_timeout),
            )  # fmt: skip
            later = _start_later(store, start, app[app_keys.START], cfg.database, began)
            retrying = asyncio.create_task(later, name="database-start")
        yield
    finally:
        try:
            if retrying is not None:
                retrying.cancel()
                await asyncio.wait([retrying])  # its own end, whatever it was: not raised here
        finally:
            await store.close()


async def _start_later(
    store: database.Store,
    start_store: Callable[[], Awaitable[None]],
    start: app_keys.Start,
    settings: config.DatabaseConfig,
    began: float,
) -> None:
    """Try ``start_store`` (the store's start, with its arguments) again until it succeeds, is
    refused, or ``start_timeout`` has passed since ``began``."""
    limit = settings.start_timeout
    for attempt in itertools.count(1):
        ceiling = min(START_RETRY_MAX, START_RETRY_BASE * 2 ** (attempt - 1))
        pause = random.uniform(ceiling / 2, ceiling)
        left = began + limit - time.monotonic()
        if left <= pause:
            await asyncio.sleep(max(0.0, left))
            start.fail(errors.StartTimedOut(
                f"the database did not answer within {config.values.format_duration(limit)} "
                f"(database.start_timeout): {store.start_problem}"
            ))  # fmt: skip
            return
        await asyncio.sleep(pause)
        try:
            await start_store()
        except errors.NotPrepared as exc:
            start.fail(exc)
            return
        except errors.StoreUnavailable as exc:
            log.warning(
                "the database does not answer yet (%s): try %d failed, the next in up to %gs",
                exc.message, attempt, min(START_RETRY_MAX, ceiling * 2),
            )  # fmt: skip
            continue
        except Exception as exc:
            # A bug: the start would never end, and the proxy never be ready.
            log.exception("the store's start failed")
            start.fail(errors.ProxyError(f"the store's start failed: {exc!r}"))
            return
        log.info("the database answered after %.1fs: ready", time.monotonic() - began)
        return


@contextlib.asynccontextmanager
async def _running(work: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """``work`` as a background task for the life of the block, cancelled at its end."""
    task = asyncio.create_task(work, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _metrics(app: web.Application) -> AsyncIterator[None]:
    """With workers, each writes its metrics to its files every second (a scrape answered by
    another worker cannot ask it), and once more when it stops; a scrape of this worker
    writes them first (admin.py)."""
    meters = app[app_keys.METRICS]
    if not meters.multiprocess:
        yield
        return

    async def flush() -> None:
        while True:
            try:
                meters.flush()
            except Exception:  # the next second tries again; the requests go on regardless
                log.exception("writing this worker's metrics failed")
            await asyncio.sleep(1)

    try:
        async with _running(flush(), "metrics-flush"):
            yield
    finally:
        meters.flush()


def _receipt_databases(
    cfg: config.Config, claim_dsn: str
) -> tuple[dict[str, database.Receipts], dict[database.Receipts, float]]:
    """Each route with ``receipt``'s receipts' database (one per DSN: the claim database's when
    it names none), and how long each keeps a receipt (its routes' longest retention)."""
    by_dsn: dict[str, database.Receipts] = {}
    routes_: dict[str, database.Receipts] = {}
    retention: dict[database.Receipts, float] = {}
    for route in cfg.routes:
        if route.receipt is None:
            continue
        dsn = route.receipt.dsn or claim_dsn
        receipts = by_dsn.get(dsn)
        if receipts is None:
            receipts = by_dsn[dsn] = database.Receipts(
                dsn, connect_timeout=cfg.database.connect_timeout,
                op_timeout=cfg.database.connect_timeout,
            )  # fmt: skip
        routes_[route.name] = receipts
        retention[receipts] = max(retention.get(receipts, 0.0), route.retention)
    return routes_, retention


async def _tend_receipts(cfg: config.Config, retention: dict[database.Receipts, float]) -> None:
    """Make the receipts' tables when they are missing (``create_schema``; else say so), then
    sweep them every ``sweeper.interval``."""
    missing = (
        "the receipts' table or function is missing: run dedup-proxy migrate (routes with receipt)"
    )
    for receipts in retention:
        try:
            # Looked at first, as the claim table is: under the documented grants the role may
            # not CREATE, and the DDL it needs not is no failure to report at every start.
            if not await receipts.missing():
                log.debug("the receipts' table and function are there")
                continue
            if not cfg.database.create_schema:
                log.error("%s", missing)
                continue
            await receipts.migrate()
        except errors.PermissionDenied as exc:
            log.error("%s: the role may not make them: %s", missing, exc.message)
        except errors.StoreUnavailable as exc:
            log.warning("the receipts' database is not ready yet: %s", exc.message)
    while True:
        await asyncio.sleep(cfg.sweeper.interval)
        for receipts, keep_for in retention.items():
            try:
                await receipts.sweep(keep_for, cfg.sweeper.batch)
            except errors.StoreUnavailable as exc:
                log.warning("sweeping receipts failed: %s", exc.message)


async def _receipts(app: web.Application) -> AsyncIterator[None]:
    """The receipts' databases of the routes with ``receipt`` (one connection each, opened
    when first asked: ``database.receipts``), made and swept in the background."""
    cfg = app[app_keys.CONFIG]
    app[app_keys.RECEIPTS], retention = _receipt_databases(cfg, app[app_keys.DSN])
    if not retention:
        yield
        return
    try:
        async with _running(_tend_receipts(cfg, retention), "receipts"):
            yield
    finally:
        for receipts in retention:
            with contextlib.suppress(Exception):
                await receipts.close()


async def _sweeper(app: web.Application) -> AsyncIterator[None]:
    cfg = app[app_keys.CONFIG]
    sweeper = retention.Sweeper(app[app_keys.STORE], cfg.routes, cfg.sweeper, app[app_keys.METRICS])
    async with _running(sweeper.run(), "retention-sweeper"):
        yield


async def _reconciler(app: web.Application) -> AsyncIterator[None]:
    """With a route that reconciles: its runs, from the store's start to the end. The pace is
    the limit at the app, as recoveries a second (``upstream.concurrency``, else the pool's
    size): a recovered event comes back as a delivery the app must take."""
    cfg = app[app_keys.CONFIG]
    runs = reconciler.Reconciler(
        app[app_keys.STORE], cfg.routes, app[app_keys.METRICS],
        pace=float(cfg.upstream.concurrency or cfg.database.pool_size),
    )  # fmt: skip
    if not runs.configured:
        yield
        return
    async with _running(runs.run(), "reconciler"):
        yield


async def _holds(app: web.Application) -> AsyncIterator[None]:
    """This worker's copy of the route holds, read every ``redeliverer.poll`` from the store's
    start to the end of the drain."""
    cfg = app[app_keys.CONFIG]
    copy = app[app_keys.HOLDS] = route_holds.Holds(
        app[app_keys.STORE], cfg.routes, poll=cfg.redeliverer.poll, meters=app[app_keys.METRICS]
    )
    async with _running(copy.run(), "route-holds"):
        yield


async def _services(app: web.Application) -> AsyncIterator[None]:
    """This worker's attempts at the app and what each leads to (``delivery.Executor``), for
    the pipeline and the redeliverer alike, and what every request uses (``Services``, handed
    to each request's cycle): once the forwarder, the receipts and the holds are."""
    executor = app[app_keys.EXECUTOR] = delivery.Executor(
        app[app_keys.STORE],
        app[app_keys.FORWARDER],
        holds=app[app_keys.HOLDS],
        receipts_=app[app_keys.RECEIPTS],
        meters=app[app_keys.METRICS],
    )
    app[app_keys.SERVICES] = app_keys.Services(
        store=app[app_keys.STORE],
        executor=executor,
        forwarder=app[app_keys.FORWARDER],
        room=app[app_keys.ROOM],
        holds=app[app_keys.HOLDS],
        flights=app[app_keys.FLIGHTS],
        budget=app[app_keys.BUDGET],
        metrics=app[app_keys.METRICS],
    )
    yield


async def _redeliverer(app: web.Application) -> AsyncIterator[None]:
    """With a route that redelivers: this worker's lanes, from start-up to the drain. On
    SIGTERM they take no more rows; at the end of the drain, a redelivery still in flight past
    ``shutdown_timeout`` is cancelled (its row rolled back: released for the next try)."""
    cfg = app[app_keys.CONFIG]
    lanes = redeliverer.Redeliverer(
        app[app_keys.STORE], app[app_keys.EXECUTOR], cfg.routes, settings=cfg.redeliverer,
        meters=app[app_keys.METRICS], budget=app[app_keys.BUDGET], room=app[app_keys.ROOM],
        workers=cfg.workers, traces=app[app_keys.TRACING],
    )  # fmt: skip
    if not lanes.configured:
        yield
        return
    draining = app[app_keys.DRAINING]

    async def stop_on_drain() -> None:
        await draining.wait()
        lanes.stop()

    running = asyncio.create_task(lanes.run(), name="redeliverer")
    try:
        async with _running(stop_on_drain(), "redeliverer-drain"):
            yield
    finally:
        stopped_at = lanes.stop()  # at SIGTERM, or now (an app closed without a signal)
        left = cfg.shutdown_timeout - (time.monotonic() - stopped_at)
        done, _ = await asyncio.wait([running], timeout=max(0.0, left))
        if not done:
            log.warning("%d redelivery(ies) still in flight at shutdown_timeout: released for "
                        "the next try", lanes.in_flight)  # fmt: skip
            running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def _forwarder(app: web.Application) -> AsyncIterator[None]:
    cfg = app[app_keys.CONFIG]
    client = forwarder.Forwarder(
        cfg.upstream.timeout,
        preserve_host=cfg.upstream.preserve_host,
        # Claimed webhooks are bounded by the database pool; unclaimed ones get headroom, and
        # pass-through has connections of its own (forwarder.PASSTHROUGH_CONNECTIONS).
        connections=cfg.database.pool_size + forwarder.UNCLAIMED_HEADROOM,
        keepalive=cfg.upstream.keepalive,
        # Each route's transport is chosen once, at start-up.
        upstreams={cfg.upstream.url, *(route.upstream for route in cfg.routes)},
        trusted_proxies=proxy_headers.TrustedProxies(cfg.trusted_proxies),
    )
    app[app_keys.FORWARDER] = client
    try:
        yield
    finally:
        await client.close()


async def _tracing(app: web.Application) -> AsyncIterator[None]:
    """Spans from start-up to the end of the drain (first in, last out: the drain's requests
    are traced), then what is queued exported within tracing.SHUTDOWN_TIMEOUT."""
    app[app_keys.TRACING].open()
    try:
        yield
    finally:
        await app[app_keys.TRACING].close()


async def _close_after_chunked(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Never let another request follow a chunked one on the same connection.

    aiohttp 3.14's C parser carries a chunked request's last trailer field over into the next
    request on the connection as a header (an event ID, a signature...); see
    docs/upstream/aiohttp-trailer-carry-over.md. A response hook, not a middleware: it also
    runs for the answers aiohttp makes itself (417 for an unknown Expect) before any handler.
    """
    if hdrs.TRANSFER_ENCODING in request.headers:
        response.force_close()
        # The hook runs after aiohttp chose the Connection header, before it is written.
        response.headers[hdrs.CONNECTION] = "close"


def _close_when_draining(
    draining: asyncio.Event,
) -> Callable[[web.BaseRequest, web.StreamResponse], Awaitable[None]]:
    """A response hook: while the proxy drains, every answer closes its connection, so that the
    client's next request goes on a new connection, to whoever holds the listener now (a
    reload's new worker), not onto one the drain is about to close (``connections.settle``)."""

    async def close(request: web.BaseRequest, response: web.StreamResponse) -> None:
        if draining.is_set():
            response.force_close()
            response.headers[hdrs.CONNECTION] = "close"

    return close


class Runner(web.AppRunner):
    """``web.AppRunner`` whose server hands each request straight to the one route's handler.

    The proxy's application has one catch-all route and no middleware: aiohttp's
    ``Application._handle`` would resolve every request through the router only to find that
    route, and build its match information anew. Here the route and its match information are
    found once, at start-up, and set on each request exactly as ``_handle`` sets them (the
    response hooks, ``request.app``, see them as ever); a request with an ``Expect`` header
    still goes through ``_handle``, which runs the route's Expect handler
    (``request_body.expectation``: 417 for an unknown expectation), and so does one whose
    target is not a path (``OPTIONS *``, ``CONNECT host:port``: the router's 404). Relied on, from
    aiohttp: ``Server.request_handler``, read by every connection's handler when it is made,
    and ``Request._match_info``.
    """

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.request_handler = _direct(self.app, server.request_handler)
        return server


def _direct(
    application: web.Application, handle: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    (resource,) = application.router.resources()
    (route,) = resource
    if application.middlewares:
        return handle
    match_info = web_urldispatcher.UrlMappingMatchInfo({}, route)
    match_info.add_app(application)
    match_info.freeze()
    dispatch = route.handler

    async def direct(request: web.BaseRequest) -> web.StreamResponse:
        if hdrs.EXPECT in request.headers or request.raw_path[:1] != "/":
            return await handle(request)  # Expect: its handler (417); "OPTIONS *", CONNECT: 404
        request._match_info = match_info  # type: ignore[attr-defined]
        return await dispatch(request)  # type: ignore[arg-type]

    return direct


def create_app(cfg: config.Config) -> web.Application:
    """Build the proxy application for ``cfg``; resources open when it starts."""
    app = web.Application()
    app.on_response_prepare.extend(
        [_close_after_chunked, request_body.close_unread, forwarder.name_the_server]
    )
    app[app_keys.CONFIG] = cfg
    app[app_keys.FLIGHTS] = flights.Flights()
    meters = app[app_keys.METRICS] = metrics.Metrics()
    app[app_keys.DRAINING] = asyncio.Event()
    app.on_response_prepare.append(_close_when_draining(app[app_keys.DRAINING]))
    app[app_keys.START] = app_keys.Start()
    shared = app[app_keys.BUDGET] = memory.Budget(cfg.max_buffered)
    meters.watch_buffered(lambda: shared.held)
    room = app[app_keys.ROOM] = app_limit.Room(
        app_limit.share(
            cfg.upstream.concurrency, cfg.workers, cfg.database.pool_size,
            keeps=any(route.redeliver for route in cfg.routes), shared=cfg.upstream.shared,
        )
    )  # fmt: skip
    meters.watch_room(room)
    traces = app[app_keys.TRACING] = tracing.Tracing(
        tracing.wanted(os.environ), proxy_headers.TrustedProxies(cfg.trusted_proxies),
        cfg.database.table, meters.count_spans,
    )  # fmt: skip
    app.cleanup_ctx.extend(
        [
            _tracing,
            _database,
            _claim_store,
            _metrics,
            _forwarder,
            _sweeper,
            _receipts,
            _holds,
            _services,
            _redeliverer,
            _reconciler,
        ]
    )
    # Every request, whatever its path: routing happens on the normalized path (paths.py),
    # not in aiohttp's router, which matches before any middleware could normalize it.
    app.router.add_route(
        "*", "/{tail:(?s:.*)}", pipeline.make_dispatcher(cfg, meters, traces),
        expect_handler=request_body.expectation,
    )  # fmt: skip
    return app
