"""The baseline: the aiohttp + asyncpg dedup proxy a competent engineer writes in an afternoon.

``python bench/naive.py --port N --upstream URL --dsn DSN --table T [--pool 32] [--workers 1]
[--stripe-secret S]``. One route, the event ID at ``body:/id``, claim in a transaction, forward,
commit on 2xx; on
uvloop, with an asyncpg pool whose reset query is turned off (nothing changes a session), its
prepared-statement cache on, and an aiohttp client keeping its upstream connections alive.
``--workers N`` forks N processes serving one listening socket, each with ``pool / N``
connections, as ``workers: N`` does for dedup-proxy. No header filtering, coalescing, metrics,
logs, timeouts or error translation: not a product, only the cost of the framework calls every
such proxy makes, measured beside dedup-proxy in the same run. No signature check either, unless
``--stripe-secret``: then each request's ``Stripe-Signature`` is checked first as Stripe's
Python library checks it (``stripe.WebhookSignature.verify_header``: the ``t`` and ``v1``
items, HMAC-SHA256 of ``{t}.{body}`` in hex compared with each ``v1``, at most 300 s old), in its
cheapest form (over the body's bytes, not decoded and encoded again), a failure answered 401
as the proxy answers it: the least a proxy that verifies does (bench/meter.py's
``naive-verified``).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import time

import aiohttp
import asyncpg
from aiohttp import web

STRIPE_TOLERANCE = 300  # seconds: Stripe's library's default


def stripe_verified(secret: bytes, header: str, body: bytes) -> bool:
    """Whether ``header`` (a ``Stripe-Signature``) signs ``body`` with ``secret``, not older
    than ``STRIPE_TOLERANCE``."""
    items = [item.split("=", 1) for item in header.split(",")]
    stamps = [item[1] for item in items if item[0] == "t" and len(item) == 2]
    signatures = [item[1] for item in items if item[0] == "v1" and len(item) == 2]
    if len(stamps) != 1 or not stamps[0].isdigit() or not signatures:
        return False
    expected = hmac.new(secret, stamps[0].encode() + b"." + body, hashlib.sha256).hexdigest()
    if not any(hmac.compare_digest(expected, signature) for signature in signatures):
        return False
    return int(stamps[0]) >= time.time() - STRIPE_TOLERANCE


def make_app(
    upstream: str, dsn: str, table: str, pool_size: int, stripe_secret: str = ""
) -> web.Application:
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
        if stripe_secret and not stripe_verified(
            stripe_secret.encode(), request.headers.get("Stripe-Signature", ""), body
        ):
            return web.json_response({"status": "signature invalid"}, status=401)
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
    parser.add_argument("--stripe-secret", default="", help="check Stripe-Signature with it")
    args = parser.parse_args(argv)
    listener = socket.create_server(("127.0.0.1", args.port), backlog=1024)
    pool = max(1, args.pool // args.workers)
    secret = args.stripe_secret
    if args.workers == 1:
        serve(listener, args.upstream, args.dsn, args.table, pool, stripe_secret=secret)
        return 0
    workers = []
    for _ in range(args.workers):
        pid = os.fork()
        if pid == 0:
            serve(
                listener,
                args.upstream,
                args.dsn,
                args.table,
                pool,
                stripe_secret=args.stripe_secret,
            )
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


def serve(
    listener: socket.socket, upstream: str, dsn: str, table: str, pool: int, *, stripe_secret: str
) -> None:
    import uvloop

    app = make_app(upstream, dsn, table, pool, stripe_secret)
    web.run_app(app, sock=listener, access_log=None, print=None, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    sys.exit(main())
