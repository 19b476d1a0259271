"""A burst ten times what the app can take, from a sender that never retries: flow control's figure.

    python bench/burst.py [--quick] [--dsn DSN] [--concurrency 16] [--app-time 0.2]
                          [--times 10] [--rate 400] [--workers 2] [--lanes N] [--json FILE]

Starts a stand-in app that takes ``--app-time`` per webhook and counts how many it has at once,
then ``dedup-proxy serve`` (``--workers`` workers, ``upstream.concurrency`` C) on a GitHub route
with ``verify`` and ``redeliver``, and sends B = ``--times`` x C signed deliveries at ``--rate``
a second (well above what the app takes, C ÷ app time), each once, as GitHub does. It then waits
for the inbox to drain and prints the answers by status, the accepted webhooks' latency (the
first and the last tenth of the burst apart: flat, not growing with the backlog), the peak at
the app against C, the drain time beside Little's law (B x T ÷ C), and the deliveries kept by
the limit (``dedup_inbox_kept_total{reason="limit"}``). The database is ``--dsn`` (or
``DEDUP_PROXY_TEST_DSN``), else an embedded PostgreSQL; its table is dropped at the end unless
``--keep``. Loopback only; every wait is bounded; the processes it starts it stops by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import hmac
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import asyncpg
import yaml
from aiohttp import web

from bench import loads, procs
from proxy import embedded

SECRET = "burst-bench-secret"
ROUTE = "github"
KEPT_LIMIT = f'dedup_inbox_kept_total{{reason="limit",route="{ROUTE}"}}'


@dataclass(frozen=True, slots=True, kw_only=True)
class Burst:
    """What one run sends, and to what."""

    concurrency: int  # upstream.concurrency, per replica
    app_time: float  # seconds the app takes per webhook
    times: int  # the burst is this many times the limit
    rate: float  # deliveries sent per second
    workers: int
    pool: int
    poll: str  # redeliverer.poll
    lanes: int | None = None  # redeliverer.concurrency (None: the default, the limit)

    @property
    def size(self) -> int:
        return self.times * self.concurrency

    @property
    def predicted_drain(self) -> float:
        """Little's law: B webhooks through C places of T seconds each."""
        return self.size * self.app_time / self.concurrency


@dataclass
class Figures:
    """What one burst measured (seconds are from the first send)."""

    statuses: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    latency_ms: dict[str, float] = field(default_factory=dict)
    peak_at_app: int = 0
    app_calls: int = 0
    app_events: int = 0
    events_more_than_once: int = 0
    sending_ended: float = 0.0
    last_answer: float = 0.0
    last_at_app: float = 0.0
    drain_after_sending: float = 0.0
    predicted_drain: float = 0.0
    kept_limit: float = 0.0
    kept: list[str] = field(default_factory=list)  # the deliveries answered 202
    # Each delivery the app was sent more than once: its calls (arrived, ended, from the first
    # send; the proxy's port; X-Request-ID) and its answer to the sender.
    twice: dict[str, Any] = field(default_factory=dict)
    first_kept_at_app: float = 0.0  # when the redeliverer sent the first of them
    kept_rate: float = 0.0  # kept deliveries at the app per second, from then on
    pending_after: int = -1


class App:
    """A stand-in app that takes ``delay`` per webhook: each delivery's calls, the most it had
    at once, and when it last finished one."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.now = 0
        self.peak = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self.last_done = 0.0
        self.arrived: dict[str, float] = {}  # each delivery's first arrival
        # Each call: the delivery, when it arrived and ended, the proxy's port, its request ID.
        self.log: list[tuple[str, float, float, int, str]] = []

    def twice(self, started: float, kept: list[str]) -> dict[str, Any]:
        """Each delivery called more than once: its calls (arrived and ended, from ``started``;
        the proxy's port; X-Request-ID) and whether the sender was answered 202."""
        return {
            delivery: {
                "calls": [(round(a - started, 3), round(e - started, 3), port, request_id)
                          for d, a, e, port, request_id in self.log if d == delivery],
                "answered": "202" if delivery in kept else "not 202",
            }
            for delivery, n in self.calls.items() if n > 1
        }  # fmt: skip

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        arrived = time.monotonic()
        self.arrived.setdefault(request.headers.get("X-GitHub-Delivery", "?"), arrived)
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.now -= 1
        self.calls[request.headers.get("X-GitHub-Delivery", "?")] += 1
        self.last_done = time.monotonic()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        delivery = request.headers.get("X-GitHub-Delivery", "?")
        request_id = request.headers.get("X-Request-ID", "")
        self.log.append((delivery, arrived, self.last_done, peer[1] if peer else 0, request_id))
        return web.Response(text="ok")


def signed(n: int) -> tuple[bytes, dict[str, str]]:
    """Delivery ``n`` as GitHub signs it (X-Hub-Signature-256 over the body)."""
    body = json.dumps({"action": "opened", "number": n, "pad": "x" * 900}).encode()
    signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    headers = {
        "X-GitHub-Delivery": f"burst-{n}",
        "X-GitHub-Hook-ID": "1",
        "X-GitHub-Event": "pull_request",
        "X-Hub-Signature-256": f"sha256={signature}",
        "Content-Type": "application/json",
    }
    return body, headers


def proxy_config(burst: Burst, *, app_url: str, dsn: str, table: str) -> dict[str, Any]:
    return {
        "listen": f"127.0.0.1:{procs.free_port()}",
        "admin": {"listen": f"127.0.0.1:{procs.free_port()}"},
        "upstream": {"url": app_url, "timeout": "30s", "concurrency": burst.concurrency},
        "database": {"dsn": dsn, "table": table, "pool_size": burst.pool},
        "log": {"level": "info", "format": "json"},
        "workers": burst.workers,
        "redeliverer": {"poll": burst.poll}
        | ({} if burst.lanes is None else {"concurrency": burst.lanes}),
        "routes": [
            {
                "name": ROUTE,
                "path": "/webhooks/github",
                "preset": "github",
                "verify": {"secret": SECRET},
                "redeliver": True,
            }
        ],
    }


async def run(burst: Burst, dsn: str, workdir: Path, *, keep: bool = False) -> Figures:
    """One burst against a fresh table; the figures once the inbox drained (or its deadline)."""
    table = f"burst_{os.getpid()}_{int(time.time()) % 100000}"
    app = App(burst.app_time)
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", app.handle)
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    app_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = proxy_config(burst, app_url=f"http://127.0.0.1:{app_port}", dsn=dsn, table=table)
    config_file = workdir / "burst.yaml"
    config_file.write_text(yaml.safe_dump(config))
    port = int(config["listen"].rpartition(":")[2])
    admin = config["admin"]["listen"]
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(config_file)]
    proxy = procs.Service("proxy", argv, workdir / "proxy.log", port)
    try:
        await asyncio.to_thread(proxy.wait_listening)
        await _ready(f"http://{admin}/readyz")
        started, result = await _send(burst, f"http://127.0.0.1:{port}/webhooks/github")
        await _drained(burst, app, dsn, table)
        result.pending_after = await _pending(dsn, table)
        result.peak_at_app = app.peak
        result.app_calls = sum(app.calls.values())
        result.app_events = len(app.calls)
        result.events_more_than_once = sum(1 for n in app.calls.values() if n > 1)
        result.twice = app.twice(started, result.kept)
        result.last_at_app = app.last_done - started
        if kept := [app.arrived[d] for d in result.kept if d in app.arrived]:
            result.first_kept_at_app = min(kept) - started
            span = result.last_at_app - result.first_kept_at_app
            result.kept_rate = len(kept) / span if span > 0 else 0.0
        result.drain_after_sending = result.last_at_app - result.sending_ended
        result.predicted_drain = burst.predicted_drain
        result.kept_limit = await _metric(f"http://{admin}/metrics", KEPT_LIMIT)
    finally:
        await asyncio.to_thread(proxy.stop)
        await runner.cleanup()
        if not keep:
            connection = await asyncpg.connect(dsn)
            try:
                await connection.execute(f'DROP TABLE IF EXISTS "{table}"')
            finally:
                await connection.close()
    if keep:
        print(f"kept: table {table}, configuration {config_file}", file=sys.stderr)
    return result


async def _ready(url: str, within: float = 30.0) -> None:
    """Until /readyz answered 200 on 20 new connections in a row (they spread over the
    workers): a worker still starting would add its start-up to the first answers."""
    deadline = time.monotonic() + within
    in_a_row = 0
    while in_a_row < 20:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready within {within:g} s")
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.get(url) as response,
            ):
                in_a_row = in_a_row + 1 if response.status == 200 else 0
        except aiohttp.ClientError:
            in_a_row = 0
        if in_a_row == 0:
            await asyncio.sleep(0.05)


async def _send(burst: Burst, url: str) -> tuple[float, Figures]:
    """The burst, each delivery once at its time: when it started, the answers by status and
    their latency."""
    deliveries = [signed(n) for n in range(burst.size)]
    answers: list[tuple[int, str, float, float]] = []  # n, status, latency, answered at
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.monotonic()

        async def one(n: int) -> None:
            await asyncio.sleep(max(0.0, started + n / burst.rate - time.monotonic()))
            body, headers = deliveries[n]
            sent = time.monotonic()
            try:
                async with session.post(url, data=body, headers=headers) as answer:
                    await answer.read()
                    status = str(answer.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                status = type(exc).__name__
            answers.append((n, status, time.monotonic() - sent, time.monotonic() - started))

        tasks = [asyncio.create_task(one(n)) for n in range(burst.size)]
        await asyncio.sleep(max(0.0, started + (burst.size - 1) / burst.rate - time.monotonic()))
        sending_ended = time.monotonic() - started
        await asyncio.gather(*tasks)
    answers.sort()
    figures = Figures(sending_ended=sending_ended, last_answer=max(a[3] for a in answers))
    figures.statuses = dict(sorted(collections.Counter(a[1] for a in answers).items()))
    figures.refused = sum(n for status, n in figures.statuses.items() if status[0] != "2")
    figures.kept = [f"burst-{a[0]}" for a in answers if a[1] == "202"]
    accepted = [a for a in answers if a[1].startswith("2")]
    tenth = max(1, len(answers) // 10)
    for label, chosen in (
        ("all", accepted),
        ("first tenth", [a for a in accepted if a[0] < tenth]),
        ("last tenth", [a for a in accepted if a[0] >= len(answers) - tenth]),
        ("200", [a for a in accepted if a[1] == "200"]),
        ("202", [a for a in accepted if a[1] == "202"]),
    ):
        latencies = [a[2] * 1000 for a in chosen]
        if latencies:
            figures.latency_ms[f"{label} p50"] = loads.percentile(latencies, 50)
            figures.latency_ms[f"{label} p99"] = loads.percentile(latencies, 99)
    return started, figures


async def _drained(burst: Burst, app: App, dsn: str, table: str) -> None:
    """Until every delivery reached the app and none is pending (bounded), then a moment more
    so that a second call of any of them would be counted too."""
    deadline = time.monotonic() + 3 * burst.predicted_drain + 60
    while time.monotonic() < deadline:
        if len(app.calls) >= burst.size and await _pending(dsn, table) == 0:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(max(1.0, 2 * burst.app_time))


async def _pending(dsn: str, table: str) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        found = await connection.fetchval(
            f"SELECT count(*) FROM \"{table}\" WHERE inbox_state = 'pending'"
        )
    finally:
        await connection.close()
    return int(found)


async def _metric(url: str, sample: str) -> float:
    """One sample of the admin listener's /metrics (0 if absent)."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


def table(burst: Burst, figures: Figures) -> str:
    lat = figures.latency_ms

    def pair(label: str) -> str:
        if f"{label} p50" not in lat:
            return "none"
        return f"{lat[f'{label} p50']:.1f} ms, {lat[f'{label} p99']:.1f} ms"

    statuses = ", ".join(f"{n:,} x {status}" for status, n in figures.statuses.items())
    rows = [
        ("burst", f"{burst.size:,} GitHub deliveries at {burst.rate:g}/s, each sent once; "
                  f"the app takes {burst.app_time * 1000:g} ms, upstream.concurrency "
                  f"{burst.concurrency} ({burst.workers} workers, pool {burst.pool} each): "
                  f"the app takes {burst.concurrency / burst.app_time:g}/s; "
                  f"{burst.lanes or burst.concurrency} redeliverer lanes"),
        ("answers by status", statuses),
        ("refused", f"{figures.refused}"),
        ("accepted latency p50, p99: all", pair("all")),
        ("… the first tenth sent", pair("first tenth")),
        ("… the last tenth sent", pair("last tenth")),
        ("… answered 200 (forwarded)", pair("200")),
        ("… answered 202 (kept)", pair("202")),
        ("peak at the app (its own count)", f"{figures.peak_at_app} (limit {burst.concurrency})"),
        ("at the app", f"{figures.app_calls:,} calls for {figures.app_events:,} events, "
                       f"{figures.events_more_than_once} more than once"),
        ("kept by the limit", f"{figures.kept_limit:,.0f}"),
        ("the first kept one at the app; kept ones at the app a second from then",
         f"{figures.first_kept_at_app:.2f} s; {figures.kept_rate:.1f}/s "
         f"({figures.kept_rate * burst.app_time / burst.concurrency:.0%} of C ÷ T)"),
        ("sending ended, last answer, last at the app",
         f"{figures.sending_ended:.2f} s, {figures.last_answer:.2f} s, "
         f"{figures.last_at_app:.2f} s"),
        ("drain: last at the app - end of sending",
         f"{figures.drain_after_sending:.2f} s"),
        ("Little's law: B x T ÷ C (from the first send)",
         f"{figures.predicted_drain:.2f} s (measured from the first send: "
         f"{figures.last_at_app:.2f} s, {figures.last_at_app / figures.predicted_drain:.2f} x)"),
        ("pending after the drain", f"{figures.pending_after}"),
    ]  # fmt: skip
    lines = ["| | burst |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="C 4, 40 deliveries, 100 ms app: checks the harness only")  # fmt: skip
    parser.add_argument("--dsn", default=os.environ.get("DEDUP_PROXY_TEST_DSN"),
                        help="PostgreSQL (DEDUP_PROXY_TEST_DSN, else embedded)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, help="upstream.concurrency (16; --quick 4)")
    parser.add_argument("--app-time", type=float, help="seconds per webhook (0.2; --quick 0.1)")
    parser.add_argument("--times", type=int, default=10, help="the burst is this many x C")
    parser.add_argument("--rate", type=float, help="deliveries per second (400; --quick 200)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pool", type=int, help="database.pool_size per worker (the default "
                        "10, or enough for C ÷ workers and its fifth for short keeps)")  # fmt: skip
    parser.add_argument("--poll", default="1s", help="redeliverer.poll (the default 1s)")
    parser.add_argument("--lanes", type=int, help="redeliverer.concurrency (default: the limit)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the table and work directory")
    args = parser.parse_args(argv)
    concurrency = args.concurrency or (4 if args.quick else 16)
    share = concurrency // args.workers
    burst = Burst(
        concurrency=concurrency,
        app_time=args.app_time or (0.1 if args.quick else 0.2),
        times=args.times,
        rate=args.rate or (200.0 if args.quick else 400.0),
        workers=args.workers,
        pool=args.pool or max(10, share + max(1, share // 4) + 1),
        poll=args.poll,
        lanes=args.lanes,
    )
    workdir = Path(tempfile.mkdtemp(prefix="dedup-burst-"))
    database = None
    figures = None
    try:
        dsn = args.dsn
        if not dsn:
            database = embedded.EmbeddedPostgres(workdir / "pg")
            dsn = database.start()
        figures = asyncio.run(run(burst, dsn, workdir, keep=args.keep))
    finally:
        if database is not None:
            database.stop()
        if figures is not None and figures.twice:
            # What a double needs looked at: which, when, on which connections; and the log.
            print(f"sent more than once: {json.dumps(figures.twice)}; the proxy's log: "
                  f"{workdir / 'proxy.log'}", file=sys.stderr)  # fmt: skip
        if args.keep or (figures is not None and figures.twice):  # a double's log stays
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(burst, figures))
    if args.json is not None:
        document = {"burst": asdict(burst), "figures": asdict(figures)}
        args.json.write_text(json.dumps(document, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
