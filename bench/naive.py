"""The floor to compare with: the smallest correct aiohttp + asyncpg dedup proxy.

``python bench/naive.py --port N --upstream URL --dsn DSN --table T [--pool 32]``. What the
issue calls the naive proxy: one process, one route, the event ID at ``body:/id``, claim in a
transaction, forward, commit on 2xx. No signature checks, header filtering, coalescing, metrics,
logs, timeouts or error translation: not a product, only the cost of the framework calls every
such proxy makes, measured beside dedup-proxy in the same run.
"""

from __future__ import annotations

import argparse
import json
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

    async def lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        state["pool"] = await asyncpg.create_pool(dsn, min_size=pool_size, max_size=pool_size)
        state["session"] = aiohttp.ClientSession()
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
    parser.add_argument("--pool", type=int, default=32)
    args = parser.parse_args(argv)
    loop = None
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        pass
    app = make_app(args.upstream, args.dsn, args.table, args.pool)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None, loop=loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
