"""A stand-in for your app: answers every request and prints what it received.

    python examples/upstream.py [PORT]     # listens on 127.0.0.1:3000

Any path is answered ``200 app processed delivery #N``; two answer as the apps of
docs/how-it-works.md do: ``/twilio/...`` with TwiML naming the form's ``Body``, and ``/payments``
with ``201`` and a JSON payment. N counts the requests to that path, so each walk-through starts
at 1. Add ``?fail=1`` to a webhook URL to make it answer 500 instead, and watch the proxy release
the claim so that the retry is forwarded again.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from xml.sax.saxutils import escape

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


if __name__ == "__main__":
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", handle)
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    web.run_app(application, host="127.0.0.1", port=port, print=None)
