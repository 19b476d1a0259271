"""A stand-in for your app: answers every request 200 and prints what it received.

    python examples/upstream.py            # listens on 127.0.0.1:3000

Add ``?fail=1`` to a webhook URL to make it answer 500 instead, and watch the proxy release the
claim so that the retry is forwarded again.
"""

from __future__ import annotations

import sys

from aiohttp import web

received: list[bytes] = []


async def handle(request: web.Request) -> web.Response:
    body = await request.read()
    received.append(body)
    count = len(received)
    print(f"app received #{count}: {request.method} {request.path_qs} {body[:60]!r}", flush=True)
    if request.query.get("fail"):
        return web.Response(status=500, text="app failed\n")
    return web.Response(text=f"app processed delivery #{count}\n")


if __name__ == "__main__":
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", handle)
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    web.run_app(application, host="127.0.0.1", port=port, print=None)
