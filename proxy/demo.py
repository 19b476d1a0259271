"""``dedup-proxy demo``: the proxy, a stand-in app and a burst of duplicated webhooks, at once.

Starts the embedded PostgreSQL and the proxy in front of a demo app that counts what reaches it,
delivers each of N events one to K times (some copies at once, while the first is in flight),
retries a failed delivery once as a provider would, and prints a report computed from what
happened: the app's counters, the proxy's answers and the claim table.

Exit codes: 0 each event reached the app successfully exactly once; 1 it did not, or the proxy
could not start; 2 the embedded PostgreSQL is not installed or could not start; 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import signal
import socket
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from proxy import app, app_keys, config, database, embedded, logs

EXIT_FAILURE = 1
DEFAULT_DATA_DIR = ".dedup-proxy/demo-pgdata"
TABLE = "demo_events"
PATH = "/webhooks/demo"
# The app takes a moment per request, so copies sent together meet while the first is in flight.
APP_LATENCY = 0.02
# Events delivered at once: each holds at most one database connection (the proxy keeps other
# copies of an event waiting in-process), so the pool always has one free.
PARALLEL_EVENTS = 8


def _positive(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, at least 1; got {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--events", type=_positive, default=50, metavar="N",
        help="distinct events to deliver (default: 50)",
    )  # fmt: skip
    parser.add_argument(
        "--copies", type=_positive, default=4, metavar="K",
        help="deliver each event 1 to K times, some copies at once (default: 4)",
    )  # fmt: skip
    parser.add_argument(
        "--data-dir", type=Path, default=DEFAULT_DATA_DIR, metavar="DIR",
        help=f"data directory of the embedded PostgreSQL (default: {DEFAULT_DATA_DIR})",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, help="seed for the random delivery plan")
    parser.add_argument(
        "--keep", action="store_true",
        help="leave the proxy running afterwards, to try it with curl (Ctrl-C stops it)",
    )  # fmt: skip


@dataclass
class DemoApp:
    """The app behind the proxy: counts deliveries per event, and fails the first of a few."""

    fail_first: frozenset[str]
    received: Counter[str] = field(default_factory=Counter)
    processed: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)

    async def handle(self, request: web.Request) -> web.Response:
        event_id = str(json.loads(await request.read())["id"])
        self.received[event_id] += 1
        await asyncio.sleep(APP_LATENCY)
        if event_id in self.fail_first and self.received[event_id] == 1:
            self.failed[event_id] += 1
            return web.Response(status=500, text=f"app failed on {event_id}\n")
        self.processed[event_id] += 1
        times = self.processed[event_id]
        return web.Response(text=f"app processed {event_id} (times so far: {times})\n")


@dataclass
class Burst:
    """The provider's side: what was sent, and how the proxy answered."""

    url: str
    session: aiohttp.ClientSession
    deliveries: int = 0
    concurrent: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)

    async def deliver(self, event_id: str) -> None:
        """One delivery, retried once if it is not answered 2xx."""
        body = _body(event_id)
        for _attempt in range(2):
            self.deliveries += 1
            if self.in_flight[event_id]:
                self.concurrent += 1
            self.in_flight[event_id] += 1
            try:
                async with self.session.post(self.url, data=body) as response:
                    await response.read()
                    answer = _answer(response.status, response.headers.get("Dedup-Status"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                answer = f"no answer ({type(exc).__name__})"
            finally:
                self.in_flight[event_id] -= 1
            self.answers[answer] += 1
            if answer in ("processed", "duplicate"):
                return

    async def event(
        self, event_id: str, copies: int, together: int, limit: asyncio.Semaphore
    ) -> None:
        """Deliver ``together`` copies at once, then the rest one after another."""
        async with limit:
            await asyncio.gather(*(self.deliver(event_id) for _ in range(together)))
            for _ in range(copies - together):
                await self.deliver(event_id)


def _body(event_id: str) -> bytes:
    return json.dumps({"id": event_id, "type": "payment.created"}).encode()


def _answer(status: int, dedup_status: str | None) -> str:
    if dedup_status == "duplicate":
        return "duplicate"
    if dedup_status is None and 200 <= status < 300:
        return "processed"
    if dedup_status is None and status == 500:
        return "app failed"
    return f"{status} {dedup_status or ''}".strip()


def _report(events: int, burst: Burst, demo_app: DemoApp, claims: int) -> tuple[list[str], bool]:
    """The report's lines, and whether every event reached the app successfully exactly once."""
    forwarded = sum(demo_app.received.values())
    successes = Counter(demo_app.processed.values())
    once, twice = successes[1], sum(n for times, n in successes.items() if times > 1)
    never = events - once - twice
    saw = f"exactly once after success ({once}/{events})"
    if twice or never:
        saw += f"; {twice} more than once, {never} never"
    lines = [
        f"dedup-proxy demo: {events} event{'s' * (events != 1)}, {burst.deliveries} deliveries "
        f"({burst.concurrent} sent while another copy was in flight)",
        f"  forwarded to the app:   {forwarded}  ({sum(demo_app.processed.values())} answered "
        f"200 + {sum(demo_app.failed.values())} answered 500 and released for a retry)",
        f"  absorbed as duplicates: {burst.answers['duplicate']}  "
        "(answered 200 by the proxy without reaching the app)",
        f"  app saw each event:     {saw}",
        f"  claims in PostgreSQL:   {claims}  (table {TABLE})",
    ]
    expected = ("processed", "duplicate", "app failed")
    other = {answer: n for answer, n in burst.answers.items() if answer not in expected}
    if other:
        details = ", ".join(f"{k}: {n}" for k, n in sorted(other.items()))
        lines.append(f"  other answers:          {sum(other.values())}  ({details})")
    ok = once == events and claims == events
    if not ok:
        lines.append("Not what the proxy promises: please report this, with the output above.")
    return lines, ok


@contextlib.contextmanager
def _logging(settings: config.LogConfig) -> Iterator[None]:
    """The proxy's warnings on stderr, stdout left to the report; restored afterwards."""
    root = logging.getLogger()
    pipeline_log = logging.getLogger("proxy.pipeline")
    handlers, level, embedded_level = root.handlers[:], root.level, embedded.log.level
    pipeline_level = pipeline_log.level
    logs.setup(settings, sys.stderr)
    # "For one machine only" is the premise of a demo, not news; nor are the app failures the
    # demo scripts itself (each request's line would be a warning): the report shows them.
    embedded.log.setLevel(logging.ERROR)
    pipeline_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pipeline_log.setLevel(pipeline_level)
        embedded.log.setLevel(embedded_level)
        root.handlers[:] = handlers
        root.setLevel(level)


def _bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


async def _claims(store: database.Store) -> int:
    """The claims in the demo's table."""
    return sum(scope.rows for scope in await store.stats())


async def _clear(store: database.Store, scope: str) -> None:
    """Remove an earlier run's claims (kept in the data directory): the retention sweep, with
    a retention of 0 s."""
    while await store.sweep_batch(scope, 0.0, 1000):
        pass


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def _config(data_dir: Path, app_port: int, proxy_port: int) -> config.Config:
    return config.parse(
        {
            "listen": f"127.0.0.1:{proxy_port}",
            "upstream": {"url": f"http://127.0.0.1:{app_port}", "timeout": "5s"},
            "database": {
                "dsn": "embedded",
                # "$$" is a literal "$": a path given on the command line is not interpolated.
                "data_dir": str(data_dir).replace("$", "$$"),
                "table": TABLE,
                "pool_size": PARALLEL_EVENTS + 2,
            },
            "claim_wait": "5s",
            "routes": [
                {"name": "demo", "path": PATH, "event_id": "body:/id", "event_type": "body:/type"}
            ],
            "log": {"level": "warning"},
        },
        source="the demo's configuration",
    )


async def _fire(url: str, ids: list[str], copies: int, rng: random.Random) -> Burst:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
        burst = Burst(url, session)
        limit = asyncio.Semaphore(PARALLEL_EVENTS)
        plan = [(event_id, rng.randint(1, copies)) for event_id in ids]
        await asyncio.gather(
            *(burst.event(event_id, n, rng.randint(1, n), limit) for event_id, n in plan)
        )
    return burst


async def _run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    ids = [f"evt_{n:04d}" for n in range(1, args.events + 1)]
    demo_app = DemoApp(frozenset(rng.sample(ids, max(1, args.events // 16))))
    app_runner = web.AppRunner(web.Application(), access_log=None)
    app_runner.app.router.add_post(PATH, demo_app.handle)
    with _bound_socket() as app_sock, _bound_socket() as proxy_sock:
        proxy_port = proxy_sock.getsockname()[1]
        cfg = _config(args.data_dir, app_sock.getsockname()[1], proxy_port)
        proxy_runner = web.AppRunner(
            app.create_app(cfg), access_log=None, shutdown_timeout=5, **app.runner_options(cfg)
        )
        url = f"http://127.0.0.1:{proxy_port}{PATH}"
        with _logging(cfg.log):
            try:
                await app_runner.setup()
                await web.SockSite(app_runner, app_sock).start()
                await proxy_runner.setup()
                await web.SockSite(proxy_runner, proxy_sock).start()
                store = proxy_runner.app[app_keys.STORE]
                await _clear(store, cfg.routes[0].scope)
                burst = await _fire(url, ids, args.copies, rng)
                claims = await _claims(store)
                lines, ok = _report(args.events, burst, demo_app, claims)
                print("\n".join(lines), flush=True)
                if not args.keep:
                    print("To try it with curl, leave it running: dedup-proxy demo --keep")
                    return 0 if ok else EXIT_FAILURE
                print(
                    f"Try it yourself: the proxy is still running at {url}\n"
                    f"  curl -i {url} -d '{_body(ids[0]).decode()}'   (a duplicate by now)\n"
                    f"  curl -i {url} -d '{_body('evt_new').decode()}'    (goes through once)\n"
                    "Press Ctrl-C to stop.",
                    flush=True,
                )
                await _wait_for_signal()
                return 0 if ok else EXIT_FAILURE
            finally:
                await proxy_runner.cleanup()
                await app_runner.cleanup()


def main(args: argparse.Namespace) -> int:
    """The demo's action: 0 if each event reached the app successfully exactly once, else 1
    (the CLI's exit ladder says what it raised)."""
    return asyncio.run(_run(args))
