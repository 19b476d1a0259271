"""Running the proxy: the listeners, signal handling and the graceful drain on SIGTERM.

The public listener admits connections through ``limits`` (the per-worker connection bound);
the admin listener is aiohttp's plain ``TCPSite``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable

from aiohttp import http_parser, web

from proxy import admin, app, config, errors, limits, pipeline

log = logging.getLogger(__name__)


async def _listen(site: web.BaseSite) -> None:
    try:
        await site.start()
    except OSError as exc:
        raise errors.ListenFailed(f"cannot listen on {site.name}: {exc.strerror or exc}") from exc


async def serve(
    cfg: config.Config,
    *,
    worker: int | None = None,
    on_listening: Callable[[], None] | None = None,
    lifeline: int | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain: ``/readyz`` turns 503, the public listener
    closes (new connections are refused), in-flight requests finish and commit (bounded by
    ``shutdown_timeout``), the pool closes, and the admin listener goes last.

    A ``worker`` (one of ``workers: N``) binds both listeners with SO_REUSEPORT, beside its
    siblings: the kernel spreads new connections across them. Each worker keeps at most
    ``max_connections`` client connections open (see ``limits``)."""
    shared = worker is not None
    if http_parser.HttpRequestParser is not getattr(http_parser, "HttpRequestParserC", None):
        raise errors.UnsafeRuntime()
    bound = limits.connection_bound(cfg, limits.raise_open_files())
    proxy = app.create_app(cfg)
    runner = web.AppRunner(
        proxy,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=cfg.shutdown_timeout,
        **app.runner_options(cfg),
    )
    admin_runner = web.AppRunner(admin.create_admin_app(proxy), access_log=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if lifeline is not None:
        _watch_lifeline(loop, lifeline, stop)
    try:
        await admin_runner.setup()
        await _listen(
            web.TCPSite(
                admin_runner, cfg.admin.listen.host, cfg.admin.listen.port, reuse_port=shared
            )
        )
        await runner.setup()
        await _listen(
            limits.BoundedSite(
                runner,
                cfg.listen,
                bound=bound,
                shed=proxy[pipeline.METRICS].shed.labels("connections").inc,
                reuse_port=shared,
            )
        )
        log.info(
            "listening on %s (admin on %s), %d route(s), upstream %s%s",
            cfg.listen,
            cfg.admin.listen,
            len(cfg.routes),
            cfg.upstream.url,
            "" if worker is None else f", worker {worker} of {cfg.workers}",
            extra={"fields": {"listen": str(cfg.listen), "routes": [r.name for r in cfg.routes]}},
        )
        if on_listening is not None:
            on_listening()
        for route in cfg.routes if worker in (None, 1) else ():
            if route.verify is None:
                log.warning(
                    "route %s checks no signature: anyone who can reach the proxy and knows an "
                    "event ID can claim it first (see README, Security)",
                    route.name,
                )
        await stop.wait()
        proxy[pipeline.DRAINING].set()
        proxy[pipeline.METRICS].draining.set(1)
        log.info("draining: no new connections, waiting up to %gs", cfg.shutdown_timeout)
    finally:
        try:
            await runner.cleanup()
        finally:
            await admin_runner.cleanup()
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
            if lifeline is not None:
                loop.remove_reader(lifeline)
                os.close(lifeline)
    log.info("stopped")


def _watch_lifeline(loop: asyncio.AbstractEventLoop, fd: int, stop: asyncio.Event) -> None:
    """A worker drains when its supervisor is gone (killed, out of memory): otherwise it would
    go on serving beside the workers of a restarted supervisor, on the old configuration."""

    def readable() -> None:
        try:
            data = os.read(fd, 1)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            if not stop.is_set():
                log.warning("the supervisor is gone: draining")
                stop.set()

    loop.add_reader(fd, readable)
