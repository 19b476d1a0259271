"""A sustained load, below or above what the app takes, with app failures: flow control's
steady-state figure (bench/burst.py is its burst).

    python bench/sustained.py [--quick] [--dsn DSN] [--senders 8] [--seconds 60]
                              [--concurrency C] [--app-time 0.02] [--fail-every 50]
                              [--workers 2] [--after 15] [--json FILE]

Starts burst.py's stand-in app (``--app-time`` a webhook; one delivery in ``--fail-every``
answered 503 at its first call), then ``dedup-proxy serve`` on its GitHub route with ``verify``
and ``redeliver`` (the default schedule and caps), ``upstream.concurrency`` C (none by default:
the places the pool allows). ``--senders`` senders each send signed deliveries with fresh IDs
one after another (the next once the last is answered, as wrk does) for ``--seconds``; then one
sender sends 20 a second for ``--after`` seconds (the recovery), and the bench waits for the
inbox to drain.

It prints the answers: by the app itself (200, or 202 after the app failed it), kept for want
of a place (202, ``kept_for``), refused (anything else); the rate at the app against its
capacity (places ÷ app time), each event's successful calls (once each), the recovery (the
first second after the load from which every answer came from the app), the drain after the
load, and the proxy's RSS. The database is ``--dsn`` (or ``DEDUP_PROXY_TEST_DSN``), else an
embedded PostgreSQL; its table is dropped at the end. Loopback only; every wait is bounded;
the processes it starts it stops by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import asyncpg
import yaml
from aiohttp import web

from bench import burst, procs
from proxy import embedded

MIB = 1024 * 1024
RECOVERY_RATE = 20.0  # deliveries a second after the load


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """What one run sends, and to what."""

    senders: int
    seconds: float
    concurrency: int | None  # upstream.concurrency, per replica (None: the pool's places)
    app_time: float
    fail_every: int  # the app answers 503 to one call in this many (0: never)
    workers: int
    after: float  # seconds of the recovery's trickle


@dataclass
class Figures:
    """What one run measured (seconds from the load's start)."""

    answers: dict[str, int] = field(default_factory=dict)  # app, kept, refused
    statuses: dict[str, int] = field(default_factory=dict)
    by_app_share: float = 0.0  # of the accepted answers, those the app itself gave
    places: int = 0  # dedup_app_limit summed over the workers
    capacity: float = 0.0  # places ÷ app time, a second
    app_rate: float = 0.0  # calls at the app a second, during the load
    app_rate_share: float = 0.0
    sent_rate: float = 0.0  # deliveries sent a second, during the load
    events: int = 0
    taken_twice: int = 0  # events the app answered 2xx more than once
    never_taken: int = 0  # accepted events the app never answered 2xx
    recovery: list[str] = field(default_factory=list)  # per second after the load: app/all
    synchronous_after: float | None = None  # from the load's end: every answer from the app
    drain: float | None = None  # from the load's end to the inbox's last pending row
    rss_mib: dict[str, float] = field(default_factory=dict)  # start, end, peak (summed)


class App(burst.App):
    """burst.App, answering 503 to one delivery in ``fail_every`` at its first call (its
    redelivery succeeds): each delivery's 2xx calls."""

    def __init__(self, delay: float, fail_every: int) -> None:
        super().__init__(delay)
        self.fail_every = fail_every
        self.n = 0
        self.seen: set[str] = set()
        self.ended: list[float] = []  # when each call ended

    async def handle(self, request: web.Request) -> web.Response:
        delivery = request.headers.get("X-GitHub-Delivery", "?")
        first = delivery not in self.seen
        self.seen.add(delivery)
        self.n += first
        if first and self.fail_every and self.n % self.fail_every == 0:
            await request.read()
            await asyncio.sleep(self.delay)
            self.ended.append(time.monotonic())
            return web.Response(status=503, text="failed")
        answer = await super().handle(request)
        self.ended.append(time.monotonic())
        return answer


def _kind(status: int, body: bytes) -> str:
    """app: the app answered it (200; or 202, kept after the app failed it); kept: kept
    without reaching the app; refused: anything else."""
    if status == 200:
        return "app"
    if status == 202:
        answer = json.loads(body)
        return "kept" if "kept_for" in answer and "upstream_status" not in answer else "app"
    return "refused"


def _rss(service: procs.Service) -> int:
    total = 0
    for pid in service.pids():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


async def run(load: Load, dsn: str, workdir: Path) -> Figures:
    """One run against a fresh table: the figures once the inbox drained (or its deadline)."""
    table = f"sustained_{os.getpid()}_{int(time.time()) % 100000}"
    app = App(load.app_time, load.fail_every)
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", app.handle)
    runner = web.AppRunner(application, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    app_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    shape = burst.Burst(
        concurrency=load.concurrency or 0, app_time=load.app_time, times=1, rate=1.0,
        workers=load.workers, pool=10, poll="1s",
    )  # fmt: skip
    config = burst.proxy_config(shape, app_url=f"http://127.0.0.1:{app_port}", dsn=dsn, table=table)
    if load.concurrency is None:
        del config["upstream"]["concurrency"]
    else:
        share = load.concurrency // load.workers
        config["database"]["pool_size"] = max(10, share + max(1, share // 4) + 1)
    config["log"]["level"] = "warning"
    config_file = workdir / "sustained.yaml"
    config_file.write_text(yaml.safe_dump(config))
    port = int(config["listen"].rpartition(":")[2])
    admin = config["admin"]["listen"]
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(config_file)]
    proxy = procs.Service("proxy", argv, workdir / "proxy.log", port)
    result = Figures()
    try:
        await asyncio.to_thread(proxy.wait_listening)
        await burst._ready(f"http://{admin}/readyz")
        result.rss_mib["start"] = _rss(proxy) / MIB
        # The limit as configured; without one, what the workers report (each its share).
        result.places = load.concurrency or int(
            await _metric_sum(f"http://{admin}/metrics", "dedup_app_limit")
        )
        answers = await _send(load, f"http://127.0.0.1:{port}/webhooks/github", result)
        result.rss_mib["end of load"] = _rss(proxy) / MIB
        await _drained(load, app, dsn, table, answers=answers, result=result)
        result.rss_mib["peak"] = sum(proxy.peak_rss().values()) / MIB
        _figures(load, app, answers, result)
    finally:
        await asyncio.to_thread(proxy.stop)
        await runner.cleanup()
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(f'DROP TABLE IF EXISTS "{table}"')
        finally:
            await connection.close()
    return result


# One answer: the delivery, its kind, its status, when it was answered (from the load's start).
Answer = tuple[str, str, int, float]


async def _send(load: Load, url: str, result: Figures) -> list[Answer]:
    """The load, then the recovery's trickle: every answer."""
    answers: list[Answer] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    numbers = iter(range(10**9))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.monotonic()

        async def one() -> None:
            n = next(numbers)
            body, headers = burst.signed(n)
            try:
                async with session.post(url, data=body, headers=headers) as answer:
                    text = await answer.read()
                    kind, status = _kind(answer.status, text), answer.status
            except (aiohttp.ClientError, TimeoutError):
                kind, status = "refused", 0
            answers.append((f"burst-{n}", kind, status, time.monotonic() - started))

        async def sender() -> None:
            while time.monotonic() - started < load.seconds:
                await one()

        await asyncio.gather(*(sender() for _ in range(load.senders)))
        result.sent_rate = len(answers) / load.seconds
        trickle = []
        ended = time.monotonic()
        for k in range(int(load.after * RECOVERY_RATE)):
            await asyncio.sleep(max(0.0, ended + k / RECOVERY_RATE - time.monotonic()))
            trickle.append(asyncio.create_task(one()))
        await asyncio.gather(*trickle)
    return answers


async def _drained(
    load: Load, app: App, dsn: str, table: str, *, answers: list[Answer], result: Figures
) -> None:
    """Until every accepted delivery was taken by the app and none is pending (bounded)."""
    accepted = {a[0] for a in answers if a[1] != "refused"}
    deadline = time.monotonic() + 300
    started = time.monotonic() - max(a[3] for a in answers)  # the load's start, about
    while time.monotonic() < deadline:
        if accepted <= set(app.calls) and await burst._pending(dsn, table) == 0:
            result.drain = time.monotonic() - started - load.seconds
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(max(1.0, 2 * load.app_time))


def _figures(load: Load, app: App, answers: list[Answer], result: Figures) -> None:
    during = [a for a in answers if a[3] <= load.seconds + 5 * load.app_time]
    kinds = collections.Counter(a[1] for a in during)
    result.answers = {k: kinds.get(k, 0) for k in ("app", "kept", "refused")}
    result.statuses = dict(sorted(collections.Counter(str(a[2]) for a in during).items()))
    accepted = kinds["app"] + kinds["kept"]
    result.by_app_share = kinds["app"] / accepted if accepted else 0.0
    result.capacity = result.places / load.app_time
    if app.ended:
        first = min(app.ended)
        in_load = [t for t in app.ended if t - first <= load.seconds]
        result.app_rate = len(in_load) / load.seconds
        result.app_rate_share = result.app_rate / result.capacity if result.capacity else 0.0
    accepted_ids = {a[0] for a in answers if a[1] != "refused"}
    result.events = len(accepted_ids)
    result.taken_twice = sum(1 for n in app.calls.values() if n > 1)
    result.never_taken = len(accepted_ids - set(app.calls))
    after = [a for a in answers if a[3] > load.seconds + 5 * load.app_time]
    seconds = collections.defaultdict(list)
    for a in after:
        seconds[int(a[3] - load.seconds)].append(a[1])
    result.recovery = [
        f"{sum(k == 'app' for k in seconds[s])}/{len(seconds[s])}" for s in sorted(seconds)
    ]
    kept_times = [a[3] - load.seconds for a in after if a[1] != "app"]
    result.synchronous_after = max(kept_times, default=0.0)


async def _metric_sum(url: str, name: str) -> float:
    """The sum of a metric's samples over the workers (the admin listener adds them)."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name or sample.startswith(name + "{"):
            total += float(value)
    return total


def table(load: Load, figures: Figures) -> str:
    answers = figures.answers
    accepted = answers["app"] + answers["kept"]
    limit = "none (the pool's places)" if load.concurrency is None else str(load.concurrency)
    fails = (
        f"fails the first call of 1 delivery in {load.fail_every}"
        if load.fail_every
        else "never fails"
    )
    rows = [
        ("load", f"{load.senders} senders for {load.seconds:g} s, each delivery once; the app "
                 f"takes {load.app_time * 1000:g} ms and {fails}; "
                 f"upstream.concurrency {limit}, {load.workers} workers, "
                 f"{figures.places} places"),
        ("answers", f"{sum(answers.values()):,} ({figures.sent_rate:.0f}/s): "
                    f"{answers['app']:,} by the app, {answers['kept']:,} kept for want of a "
                    f"place, {answers['refused']:,} refused"),
        ("statuses", ", ".join(f"{n:,} x {s}" for s, n in figures.statuses.items())),
        ("answered by the app itself", f"{figures.by_app_share:.1%} of {accepted:,} accepted"),
        ("rate at the app, its capacity",
         f"{figures.app_rate:.0f}/s of {figures.capacity:.0f}/s "
         f"({figures.app_rate_share:.0%})"),
        ("events accepted, taken twice, never taken",
         f"{figures.events:,}, {figures.taken_twice}, {figures.never_taken}"),
        ("after the load, by the app/all, a second",
         " ".join(figures.recovery) or "none sent"),
        ("last answer not by the app, after the load",
         f"{figures.synchronous_after:.1f} s" if figures.synchronous_after is not None else "-"),
        ("drain (the load's end to the inbox empty)",
         "not within 300 s" if figures.drain is None else f"{figures.drain:.1f} s"),
        ("proxy RSS (all processes)",
         ", ".join(f"{k} {v:.0f} MiB" for k, v in figures.rss_mib.items())),
    ]  # fmt: skip
    lines = ["| | sustained |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="4 senders for 5 s, 5 s after: checks the harness only")  # fmt: skip
    parser.add_argument("--dsn", default=os.environ.get("DEDUP_PROXY_TEST_DSN"),
                        help="PostgreSQL (DEDUP_PROXY_TEST_DSN, else embedded)")  # fmt: skip
    parser.add_argument("--senders", type=int, help="senders at once (8; --quick 4)")
    parser.add_argument("--seconds", type=float, help="the load's length (60; --quick 5)")
    parser.add_argument("--concurrency", type=int, help="upstream.concurrency (none)")
    parser.add_argument("--app-time", type=float, default=0.02, help="seconds per webhook")
    parser.add_argument("--fail-every", type=int, default=50, help="0: the app never fails")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--after", type=float, help="the recovery's seconds (15; --quick 5)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    load = Load(
        senders=args.senders or (4 if args.quick else 8),
        seconds=args.seconds or (5.0 if args.quick else 60.0),
        concurrency=args.concurrency,
        app_time=args.app_time,
        fail_every=args.fail_every,
        workers=args.workers,
        after=args.after or (5.0 if args.quick else 15.0),
    )
    workdir = Path(tempfile.mkdtemp(prefix="dedup-sustained-"))
    database = None
    try:
        dsn = args.dsn
        if not dsn:
            database = embedded.EmbeddedPostgres(workdir / "pg")
            dsn = database.start()
        figures = asyncio.run(run(load, dsn, workdir))
    finally:
        if database is not None:
            database.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(load, figures))
    if args.json is not None:
        document = {"load": asdict(load), "figures": asdict(figures)}
        args.json.write_text(json.dumps(document, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
