"""A minimal, fast stand-in app for the benchmark: answers every request 200 and keeps count.

``python bench/upstream.py --port N [--delay S] [--no-uvloop]``. Each request's event ID is read
from the start of the body (the wrk script and the storm put ``{"id":"…"`` first), so the count
of calls per ID costs a slice and a set lookup, not a JSON parse. ``GET /__stats`` answers the
counters as JSON and ``POST /__reset`` zeroes them; neither is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import web

_ID_PREFIX = b'{"id":"'
SEED_PREFIX = "seed-"  # IDs the benchmark committed before a run: they must never arrive here


class Counter:
    """Calls received, distinct event IDs, and IDs that arrived more than once."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.seen: set[bytes] = set()
        self.repeated = 0
        self.seeded = 0
        self.no_id = 0

    async def hook(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.calls += 1
        if body.startswith(_ID_PREFIX):
            event_id = body[len(_ID_PREFIX) : body.find(b'"', len(_ID_PREFIX))]
            if event_id in self.seen:
                self.repeated += 1
            else:
                self.seen.add(event_id)
            if event_id.startswith(SEED_PREFIX.encode()):
                self.seeded += 1
        else:
            self.no_id += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(body=b'{"ok":true}', content_type="application/json")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "calls": self.calls,
                "distinct": len(self.seen),
                "repeated": self.repeated,
                "seeded": self.seeded,
                "no_id": self.no_id,
            },
            dumps=json.dumps,
        )

    async def clear(self, request: web.Request) -> web.Response:
        self.reset()
        return web.Response(text="reset")


def make_app(counter: Counter) -> web.Application:
    app = web.Application(client_max_size=4 * 1024 * 1024)
    app.router.add_get("/__stats", counter.stats)
    app.router.add_post("/__reset", counter.clear)
    app.router.add_route("*", "/{tail:.*}", counter.hook)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before answering")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    args = parser.parse_args(argv)
    loop_factory = None
    if not args.no_uvloop:
        try:
            import uvloop

            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass
    print(f"loop: {'uvloop' if loop_factory else 'asyncio'}", flush=True)
    counter = Counter(args.delay)
    web.run_app(
        make_app(counter),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        backlog=4096,
        loop=loop_factory() if loop_factory else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
