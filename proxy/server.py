"""Running the proxy: the listener, signal handling and the graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import http_parser, web

from proxy import app, config, errors

log = logging.getLogger(__name__)


async def serve(cfg: config.Config) -> None:
    """Serve until SIGTERM or SIGINT, then drain: refuse new connections, let in-flight
    requests finish and commit (bounded by ``shutdown_timeout``), close the pool."""
    if http_parser.HttpRequestParser is not getattr(http_parser, "HttpRequestParserC", None):
        raise errors.UnsafeRuntime()
    runner = web.AppRunner(
        app.create_app(cfg),
        handle_signals=False,
        access_log=None,
        shutdown_timeout=cfg.shutdown_timeout,
        **app.runner_options(cfg),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await runner.setup()
        site = web.TCPSite(runner, cfg.listen.host, cfg.listen.port, reuse_address=True)
        await site.start()
        log.info(
            "listening on %s, %d route(s), upstream %s",
            cfg.listen,
            len(cfg.routes),
            cfg.upstream.url,
            extra={"fields": {"listen": str(cfg.listen), "routes": [r.name for r in cfg.routes]}},
        )
        for route in cfg.routes:
            if route.verify is None:
                log.warning(
                    "route %s checks no signature: anyone who can reach the proxy and knows an "
                    "event ID can claim it first (see README, Security)",
                    route.name,
                )
        await stop.wait()
        log.info("draining: no new connections, waiting up to %gs", cfg.shutdown_timeout)
    finally:
        await runner.cleanup()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
    log.info("stopped")
