"""The baseline: the aiohttp + asyncpg dedup proxy a competent engineer writes in an afternoon.

``python bench/naive.py --port N --upstream URL --dsn DSN --table T [--pool 32] [--workers 1]``.
One route, the event ID at ``body:/id``, claim in a transaction, forward, commit on 2xx; on
uvloop, with an asyncpg pool whose reset query is turned off (nothing changes a session), its
prepared-statement cache on, and an aiohttp client keeping its upstream connections alive.
``--workers N`` forks N processes serving one listening socket, each with ``pool / N``
connections, as ``workers: N`` does for dedup-proxy. No signature checks, header filtering,
coalescing, metrics, logs, timeouts or error translation: not a product, only the cost of the
framework calls every such proxy makes, measured beside dedup-proxy in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys

import aiohttp
import asyncpg
from aiohttp import web


def make_app(upstream: str, dsn: str, table: str, pool_size: int) -> web.Application:
    insert = (
        f'INSERT INTO "{table}" (scope, event_id) VALUES ($1, $2) '
        "ON CONFLICT (scope, event_id) DO NOTHING RETURNING true"
    )
    app = web.Application(client_max_size=4 * 1024 * 1024)
    state: dict[str, object] = {}

    async def no_reset(connection: asyncpg.Connection) -> None:
        """Nothing to reset: no request changes its session (asyncpg's default runs a query)."""

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        state["pool"] = await asyncpg.create_pool(
            dsn, min_size=pool_size, max_size=pool_size, reset=no_reset
        )
        connector = aiohttp.TCPConnector(limit=pool_size, keepalive_timeout=30)
        state["session"] = aiohttp.ClientSession(connector=connector)
        yield
        await state["session"].close()  # type: ignore[attr-defined]
        await state["pool"].close()  # type: ignore[attr-defined]

    async def hook(request: web.Request) -> web.Response:
        body = await request.read()
        event_id = json.loads(body)["id"]
        pool: asyncpg.Pool = state["pool"]  # type: ignore[assignment]
        session: aiohttp.ClientSession = state["session"]  # type: ignore[assignment]
        async with pool.acquire() as connection:
            transaction = connection.transaction()
            await transaction.start()
            done = False
            try:
                if not await connection.fetchval(insert, "naive", event_id):
                    return web.json_response({"status": "duplicate"})
                async with session.post(upstream + request.raw_path, data=body) as answer:
                    payload = await answer.read()
                    status = answer.status
                if 200 <= status < 300:
                    await transaction.commit()
                    done = True
            finally:
                if not done:
                    await transaction.rollback()
        return web.Response(status=status, body=payload, content_type="application/json")

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/{tail:.*}", hook)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--pool", type=int, default=32, help="connections over all workers")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args(argv)
    listener = socket.create_server(("127.0.0.1", args.port), backlog=1024)
    pool = max(1, args.pool // args.workers)
    if args.workers == 1:
        serve(listener, args.upstream, args.dsn, args.table, pool)
        return 0
    workers = []
    for _ in range(args.workers):
        pid = os.fork()
        if pid == 0:
            serve(listener, args.upstream, args.dsn, args.table, pool)
            os._exit(0)
        workers.append(pid)

    def stop(signum: int, frame: object) -> None:
        for worker in workers:
            os.kill(worker, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for worker in workers:
        os.waitpid(worker, 0)
    return 0


def serve(listener: socket.socket, upstream: str, dsn: str, table: str, pool: int) -> None:
    import uvloop

    app = make_app(upstream, dsn, table, pool)
    web.run_app(app, sock=listener, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    sys.exit(main())
