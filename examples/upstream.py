"""A stand-in for your app: answers every request and prints what it received.

    python examples/upstream.py [PORT]     # listens on 127.0.0.1:3000

Any path is answered ``200 app processed delivery #N``; two answer as the apps of
docs/how-it-works.md do: ``/twilio/...`` with TwiML naming the form's ``Body``, and ``/payments``
with ``201`` and a JSON payment. N counts the requests to that path, so each walk-through starts
at 1. Add ``?fail=1`` to a webhook URL to make it answer 500 instead, and watch the proxy release
the claim so that the retry is forwarded again.

    python examples/upstream.py [PORT] --receipts DSN   # the app of a route with receipt

With ``--receipts`` it is the app of a route with ``receipt`` (docs/how-it-works.md, "The
receipt"): each request credits a ledger (``example_ledger``, made if missing) and writes its
``Dedup-Receipt`` first in the same transaction (without one, the route's receipt off, it
credits alone); a second delivery of an event fails on the first's
receipt, rolls back, and is answered 500, which the proxy settles as processed. DSN is the
database that holds the receipts (``dedup-proxy migrate`` made ``dedup_receipt`` there).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from xml.sax.saxutils import escape

import asyncpg
from aiohttp import web

received: list[bytes] = []
calls: Counter[str] = Counter()

TWIML = '<?xml version="1.0" encoding="UTF-8"?><Response><Message>{}</Message></Response>'


async def handle(request: web.Request) -> web.Response:
    body = await request.read()
    received.append(body)
    calls[request.path] += 1
    count = calls[request.path]
    print(f"app received #{count}: {request.method} {request.path_qs} {body[:60]!r}", flush=True)
    if request.query.get("fail"):
        return web.Response(status=500, text="app failed\n")
    if request.path.startswith("/twilio/"):
        said = (await request.post()).get("Body", "")
        reply = TWIML.format(escape(f"Got {said} (call {count})"))
        return web.Response(text=reply, content_type="text/xml")
    if request.path == "/payments":
        amount = json.loads(body or b"{}").get("amount")
        return web.json_response({"payment": f"pay_{count}", "amount": amount}, status=201)
    return web.Response(text=f"app processed delivery #{count}\n")


async def credit(request: web.Request) -> web.Response:
    """``--receipts``: credit the ledger and write the receipt, in one transaction."""
    body = await request.read()
    receipt = request.headers.get("Dedup-Receipt")  # none: the route's receipt is off
    async with request.app[POOL].acquire() as connection:
        try:
            async with connection.transaction():
                if receipt is not None:  # first: a second delivery fails before any work
                    await connection.execute("SELECT dedup_receipt($1)", receipt)
                await connection.execute(
                    "INSERT INTO example_ledger (body) VALUES ($1)", body.decode("utf-8", "replace")
                )
        except asyncpg.UniqueViolationError:
            # Not caught to answer 2xx: the 500 sends the proxy to the first delivery's receipt.
            print(f"app refused a second delivery: receipt {receipt!s:.12}… exists", flush=True)
            return web.Response(status=500, text="done already\n")
    print(f"app credited {body[:60]!r} with receipt {receipt!s:.12}…", flush=True)
    return web.Response(text="credited\n")


POOL = web.AppKey("pool", asyncpg.Pool)


def with_receipts(dsn: str) -> web.Application:
    application = web.Application()

    async def pool(app: web.Application):  # type: ignore[no-untyped-def]
        app[POOL] = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
        await app[POOL].execute(
            "CREATE TABLE IF NOT EXISTS example_ledger (id bigserial PRIMARY KEY, body text)"
        )
        yield
        await app[POOL].close()

    application.cleanup_ctx.append(pool)
    application.router.add_route("*", "/{tail:.*}", credit)
    return application


if __name__ == "__main__":
    args = sys.argv[1:]
    dsn = None
    if "--receipts" in args:
        at = args.index("--receipts")
        dsn = args[at + 1]
        del args[at : at + 2]
    port = int(args[0]) if args else 3000
    if dsn is None:
        application = web.Application()
        application.router.add_route("*", "/{tail:.*}", handle)
    else:
        application = with_receipts(dsn)
    web.run_app(application, host="127.0.0.1", port=port, print=None)
