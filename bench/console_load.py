"""Whether the operator console's pages slow the webhooks: the admin listener shares each
worker's event loop with the webhooks, so a page rendered is time a webhook waits.

    python bench/console_load.py [--rounds 4] [--duration 5] [--kept 10000] [--connections 32]
                                 [--out FILE]

One proxy (2 workers, pool 40 each, ``upstream.concurrency`` 64, the console on, as it is by
default) in front of a fast app, its route's inbox holding ``--kept`` rows
(``bench.console.FILL``: 70 % pending, due only in a day, so the redeliverer leaves them
alone). Each round runs wrk (new
event IDs) twice, the order reversed every other round: once alone, once while an operator's
browser fetches the console's heaviest pages one after the other, as fast as they come (the
overview, which counts the inbox, the kept list, an event, a lookup). It reports the
webhooks' throughput, p99 and CPU per webhook (the proxy) with the pages ÷ without, and the
pages fetched. Loopback only; every loop is bounded; every process started is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import asyncpg
import yaml

from bench import console, loads, report
from bench.run import TABLE, Bench, Settings, prepare_database

ROUTE: dict[str, Any] = {**console.ROUTE, "path": "/hook"}
# The pages one pass fetches: the overview (it counts the inbox), the kept list's first page
# and a filtered one, an event's page and a lookup by ID.
PAGES = ("", "events", "events?state=dead", "event?scope=hooks&id=evt_00000007",
         "lookup?id=evt_00000007")  # fmt: skip


class Browser:
    """Fetches the console's pages one after the other on its own thread until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.times: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._browse()), daemon=True)

    def __enter__(self) -> Browser:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _browse(self) -> None:
        async with aiohttp.ClientSession() as session:
            for n in range(1_000_000):  # bounded: stopped long before
                if self._stop.is_set():
                    return
                started = time.perf_counter()
                async with session.get(self.url + PAGES[n % len(PAGES)]) as answer:
                    await answer.read()
                    if answer.status != 200:
                        self.errors += 1
                self.times.append(time.perf_counter() - started)


def admin_url(bench: Bench, name: str) -> str:
    config = yaml.safe_load((bench.workdir / f"{name}.yaml").read_text())
    return f"http://{config['admin']['listen']}/console/"


async def _fill(dsn: str, kept: int) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(console.FILL.format(table=TABLE), kept)
        await connection.execute(f"VACUUM ANALYZE {TABLE}")
    finally:
        await connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=int, default=5, help="seconds per load run")
    parser.add_argument("--kept", type=int, default=10_000, help="kept rows in the inbox")
    parser.add_argument("--connections", type=int, default=32, help="wrk -c")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    loads.wrk_path()
    settings = Settings(seconds=args.duration, pool=40, warmup=2, rounds=args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-console-load-"))
    bench = Bench(settings, workdir)
    results: dict[tuple[str, int], loads.Result] = {}
    pages: dict[int, Browser] = {}
    try:
        prepare_database(bench)
        asyncio.run(_fill(bench.dsn, args.kept))
        fast = bench.start_upstream("app")
        proxy = bench.start_proxy("proxy", fast, settings.pool, workers=2, concurrency=64,
                                  routes=[ROUTE])  # fmt: skip
        url = admin_url(bench, "proxy")
        bench.wrk("", "warm-up", proxy, fast, args.connections, seconds=settings.warmup)
        for round_ in range(1, args.rounds + 1):
            order = ("alone", "pages") if round_ % 2 else ("pages", "alone")
            for name in order:
                label = f"{name} c{args.connections} (round {round_})"
                if name == "alone":
                    results[name, round_] = bench.wrk("", label, proxy, fast, args.connections)
                    continue
                with Browser(url) as browser:
                    results[name, round_] = bench.wrk("", label, proxy, fast, args.connections)
                pages[round_] = browser
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    _check(results, pages)
    given = sys.argv[1:] if argv is None else argv
    machine = report.machine()
    text = (
        f"`{shlex.join(['python', 'bench/console_load.py', *given])}`: "
        f"{machine.get('nproc', '?')} CPUs, {args.duration} s per run, 2 workers, "
        f"{args.kept:,} kept rows; the pages: {', '.join(p or 'overview' for p in PAGES)}\n\n"
        f"{_table(results, pages, args.duration)}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


def _check(results: dict[tuple[str, int], loads.Result], pages: dict[int, Browser]) -> None:
    """Every webhook reached the app once, and every page answered 200."""
    for result in results.values():
        calls = result.upstream.get("calls", -1)
        if calls != result.uniques or result.errors:
            raise RuntimeError(f"{result.label}: {calls} app calls, {result.errors} errors")
    for round_, browser in pages.items():
        if browser.errors or not browser.times:
            raise RuntimeError(f"round {round_}: {len(browser.times)} pages, "
                               f"{browser.errors} not 200")  # fmt: skip


def _table(
    results: dict[tuple[str, int], loads.Result], pages: dict[int, Browser], seconds: int
) -> str:
    lines = [
        "| round | alone: webhooks/s, p99 ms, CPU µs | with the pages: webhooks/s, p99 ms, "
        "CPU µs | pages fetched, median ms | throughput with ÷ alone | CPU with ÷ alone "
        "| p99 with ÷ alone |",
        "|---|---|---|---|---|---|---|",
    ]
    rate, cpu, p99 = [], [], []
    for round_ in sorted(pages):
        a, p, browser = results["alone", round_], results["pages", round_], pages[round_]
        rate.append(p.rate / a.rate)
        cpu.append(p.cpu_us("proxy") / a.cpu_us("proxy"))
        p99.append(p.p99_ms / a.p99_ms)
        lines.append(
            f"| {round_} | {a.rate:,.0f}, {a.p99_ms:.1f}, {a.cpu_us('proxy'):.0f} "
            f"| {p.rate:,.0f}, {p.p99_ms:.1f}, {p.cpu_us('proxy'):.0f} "
            f"| {len(browser.times)} ({len(browser.times) / seconds:.0f}/s), "
            f"{statistics.median(browser.times) * 1000:.1f} "
            f"| {rate[-1]:.3f} | {cpu[-1]:.3f} | {p99[-1]:.3f} |"
        )
    lines.append(
        f"| **median** | | | | **{statistics.median(rate):.3f}** ({min(rate):.3f} to "
        f"{max(rate):.3f}) | **{statistics.median(cpu):.3f}** ({min(cpu):.3f} to "
        f"{max(cpu):.3f}) | **{statistics.median(p99):.3f}** |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
