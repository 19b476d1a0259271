"""What a receipt costs, the proxy on the happy path and the app's transaction, side by side.

    python bench/receipt_cost.py [--rounds 4] [--duration 5] [--workers 2] [--pool 40]
                                 [--connections 32,1] [--transactions 4000]
                                 [--app-concurrency 16,1] [--out FILE] [--json FILE]

The proxy's side: two proxies on the same embedded PostgreSQL and the same fast app
(bench/upstream.py), one route plain, one with ``receipt: true`` (the receipts in the claim
database). Each round runs wrk (new event IDs) against each, the order reversed every other
round, and reports throughput, p50/p99 and CPU per webhook (the proxy and PostgreSQL), and
receipt ÷ plain. The app writes no receipt, so the receipt route's one read per worker every
10 s (``pipeline.RECEIPT_CHECK_EVERY``) finds none and says so: that read, the key's hash and
its header are what the happy path adds, whether the app writes receipts or not.

The app's side: an app-like transaction over asyncpg (INSERT a ledger row; COMMIT) beside the
same with ``SELECT dedup_receipt($1)`` added, on the same PostgreSQL, N transactions at each
concurrency, the order reversed every other round: time per transaction, PostgreSQL's CPU per
transaction (and the client's), and receipt ÷ plain (CPU from /proc, in clock ticks per
process: a run needs thousands of transactions to be read to a few per cent). Each run starts
from an empty ledger and no receipts, and ends with its N rows (and N receipts) counted.
Loopback only; every load run is bounded; every process started is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

from bench import loads, procs, report
from bench.keep_cost import admin_url, metric
from bench.run import SCOPE, Bench, Settings, prepare_database
from proxy.database import receipts

LEDGER = "bench_ledger"
LEDGER_DDL = (
    f"CREATE TABLE IF NOT EXISTS {LEDGER} (id bigserial PRIMARY KEY, event text NOT NULL, "
    "amount bigint NOT NULL, booked_at timestamptz NOT NULL DEFAULT now())"
)
CREDIT = f"INSERT INTO {LEDGER} (event, amount) VALUES ($1, $2)"
RECEIPT = f"SELECT {receipts.FUNCTION}($1)"
RECEIPT_ROUTE = "receipt"
MISSING = f'dedup_receipts_total{{result="missing",route="{RECEIPT_ROUTE}"}}'
KINDS = ("plain", "receipt")
APP_RUN_LIMIT = 300.0  # seconds: one app run that takes longer is a bench's bug


def route(name: str, *, receipt: bool) -> dict[str, Any]:
    found: dict[str, Any] = {"name": name, "path": "/hook", "event_id": "body:/id"}
    if receipt:
        found["receipt"] = True  # in the claim database
    return found


# -- the app's side ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class AppRun:
    """``count`` app transactions at ``concurrency``, with the receipt or without."""

    kind: str
    concurrency: int
    count: int
    seconds: float
    latencies_ms: tuple[float, ...]
    postgres_s: float  # PostgreSQL's CPU over the run
    client_s: float  # this process's (asyncpg, the loop): the app's driver
    others: float  # other load, in cores
    ledger_rows: int  # counted after the run
    receipt_rows: int

    @property
    def rate(self) -> float:
        return self.count / max(self.seconds, 1e-9)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.latencies_ms)

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    def cpu_us(self, seconds: float) -> float:
        return seconds * 1e6 / max(self.count, 1)


async def app_run(
    dsn: str, kind: str, *, concurrency: int, count: int, tag: str,
    postgres_cpu: Callable[[], float],
) -> AppRun:  # fmt: skip
    """``count`` transactions on ``concurrency`` connections, each taking the next event until
    none is left (bounded by ``count`` and APP_RUN_LIMIT); each connection first runs one
    unmeasured transaction of the same kind (asyncpg prepares each statement once)."""
    with_receipt = kind == "receipt"
    keys = [hashlib.sha256(f"{tag}\n{n}".encode()).hexdigest() for n in range(count)]
    connections = [await asyncpg.connect(dsn) for _ in range(concurrency)]
    try:
        for number, connection in enumerate(connections):
            await _transaction(connection, f"warm-{tag}-{number}", with_receipt)
        await connections[0].execute(f"TRUNCATE {LEDGER}, {receipts.TABLE}")
        latencies: list[float] = []
        taken = iter(keys)

        async def lane(connection: asyncpg.Connection) -> None:
            for key in taken:  # a shared iterator: each key once, the loop bounded by count
                started = time.perf_counter()
                await _transaction(connection, key, with_receipt)
                latencies.append((time.perf_counter() - started) * 1000)

        window = procs.Window({"postgres": postgres_cpu, "client": time.process_time})
        started = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(lane(c) for c in connections)), APP_RUN_LIMIT)
        seconds = time.perf_counter() - started
        window.close()
        ledger_rows = await connections[0].fetchval(f"SELECT count(*) FROM {LEDGER}")
        receipt_rows = await connections[0].fetchval(f"SELECT count(*) FROM {receipts.TABLE}")
    finally:
        for connection in connections:
            await connection.close()
    return AppRun(
        kind=kind, concurrency=concurrency, count=count, seconds=seconds,
        latencies_ms=tuple(latencies), postgres_s=window.cpu["postgres"],
        client_s=window.cpu["client"], others=window.others, ledger_rows=ledger_rows,
        receipt_rows=receipt_rows,
    )  # fmt: skip


async def _transaction(connection: asyncpg.Connection, key: str, with_receipt: bool) -> None:
    """The app's business transaction: a ledger row, and with the receipt its one statement."""
    async with connection.transaction():
        await connection.execute(CREDIT, key, 100)
        if with_receipt:
            await connection.execute(RECEIPT, key)


def _check_app(run: AppRun, label: str) -> None:
    """Every transaction committed its ledger row, and with the receipt its receipt."""
    receipts_expected = run.count if run.kind == "receipt" else 0
    if run.ledger_rows != run.count or run.receipt_rows != receipts_expected:
        raise RuntimeError(f"{label}: {run.ledger_rows} ledger rows, {run.receipt_rows} "
                           f"receipts after {run.count} transactions")  # fmt: skip


# -- the run ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    loads.wrk_path()
    settings = Settings(seconds=args.duration, pool=args.pool, warmup=2, rounds=args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-receipt-cost-"))
    bench = Bench(settings, workdir)
    try:
        prepare_database(bench)
        for statement in (*receipts.DDL, LEDGER_DDL):
            bench.sql(statement)
        webhooks, checks = measure_webhooks(bench, args)
        transactions = measure_transactions(bench, args)
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    _check_webhooks(webhooks)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/receipt_cost.py", *given])
    others = [r.window.others for r in webhooks.values()]
    others += [r.others for r in transactions.values()]
    text = (
        f"`{command}`: {report.machine().get('nproc', '?')} CPUs, other load "
        f"{min(others):.2f} to {max(others):.2f} cores\n\n"
        f"The proxy: {args.duration} s per run, {args.workers} workers, pool {args.pool} each; "
        f"the same fast app; a route with receipt (in the claim database) beside a plain one; "
        f"{checks:,.0f} receipt check(s) on the receipt route, each finding none (the app "
        f"writes none)\n\n{_webhook_table(webhooks)}\n\n"
        f"The app: {args.transactions:,} transactions per run over asyncpg, INSERT a ledger "
        f"row; COMMIT, and the same with `{RECEIPT}`\n\n{_app_table(transactions)}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    if args.json is not None:
        found = {
            "receipt_checks": checks,
            "webhooks": {f"{k} c{c} r{r}": _webhook_figures(x)
                         for (k, c, r), x in webhooks.items()},
            "transactions": {f"{k} c{c} r{r}": _app_figures(x)
                             for (k, c, r), x in transactions.items()},
        }  # fmt: skip
        args.json.write_text(json.dumps(found, indent=2), encoding="utf-8")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=int, default=5, help="seconds per load run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pool", type=int, default=40, help="database.pool_size per worker")
    parser.add_argument("--connections", default="32,1", help="comma-separated wrk -c values")
    parser.add_argument("--transactions", type=int, default=4000,
                        help="app transactions per run (the app's side)")  # fmt: skip
    parser.add_argument("--app-concurrency", default="16,1",
                        help="comma-separated app connections (the app's side)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    parser.add_argument("--json", type=Path, help="also write the runs as JSON here")
    return parser


def measure_webhooks(
    bench: Bench, args: argparse.Namespace
) -> tuple[dict[tuple[str, int, int], loads.Result], float]:
    """The proxy's side: each round, wrk against the plain proxy and the receipt one at each
    connection count, the order reversed every other round; with the receipt route's checks
    (``dedup_receipts_total{result="missing"}``). The proxies are stopped afterwards."""
    fast = bench.start_upstream("app")
    proxies = {
        kind: bench.start_proxy(kind, fast, args.pool, workers=args.workers,
                                routes=[route(SCOPE if kind == "plain" else RECEIPT_ROUTE,
                                              receipt=kind == "receipt")])
        for kind in KINDS
    }  # fmt: skip
    for kind in KINDS:
        _wait_for_workers(proxies[kind], args.workers)
        bench.wrk("", f"warm-up {kind}", proxies[kind], fast, 32, seconds=bench.settings.warmup)
    results: dict[tuple[str, int, int], loads.Result] = {}
    for round_ in range(1, args.rounds + 1):
        order = KINDS if round_ % 2 else KINDS[::-1]
        for connections in (int(c) for c in args.connections.split(",")):
            for kind in order:
                results[kind, connections, round_] = bench.wrk(
                    "", f"{kind} c{connections} (round {round_})", proxies[kind], fast,
                    connections,
                )  # fmt: skip
    checks = metric(admin_url(bench, "receipt"), MISSING)
    for service in (*proxies.values(), fast):
        bench.stop(service)
    return results, checks


def _wait_for_workers(proxy: procs.Service, workers: int, within: float = 60.0) -> None:
    """Until each worker said it listens (the supervisor binds the port before they start: a
    warm-up begun then would measure their start). Polled, bounded."""
    deadline = time.monotonic() + within
    while True:
        log = proxy.log_path.read_text(errors="replace")
        if all(f"worker {n} of {workers}" in log for n in range(1, workers + 1)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proxy.name}: not every worker listens:\n{proxy.tail()}")
        time.sleep(0.1)


def measure_transactions(
    bench: Bench, args: argparse.Namespace
) -> dict[tuple[str, int, int], AppRun]:
    """The app's side: each round, the plain and the receipt transactions at each concurrency,
    the order reversed every other round; each run checked for its rows."""
    results: dict[tuple[str, int, int], AppRun] = {}
    for round_ in range(1, args.rounds + 1):
        order = KINDS if round_ % 2 else KINDS[::-1]
        for concurrency in (int(c) for c in args.app_concurrency.split(",")):
            for kind in order:
                label = f"app, {kind}, {concurrency} connections (round {round_})"
                run = asyncio.run(app_run(
                    bench.dsn, kind, concurrency=concurrency, count=args.transactions,
                    tag=bench.run_id(), postgres_cpu=bench.postgres_cpu,
                ))  # fmt: skip
                _check_app(run, label)
                results[kind, concurrency, round_] = run
                _print_app(bench, label, run)
    return results


def _print_app(bench: Bench, label: str, run: AppRun) -> None:
    elapsed = time.monotonic() - bench.started
    print(
        f"[{elapsed:5.0f}s] {label}: {run.rate:,.0f}/s, mean {run.mean_ms:.2f} ms, "
        f"p99 {run.percentile(0.99):.2f} ms, other load {run.others:.2f} cores",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def _check_webhooks(results: dict[tuple[str, int, int], loads.Result]) -> None:
    """Every run reached the app once per webhook, without an error."""
    for result in results.values():
        calls = result.upstream.get("calls", -1)
        if calls != result.uniques or result.errors:
            raise RuntimeError(f"{result.label}: {calls} app calls for {result.uniques} "
                               f"webhooks, {result.errors} errors")  # fmt: skip


def _webhook_figures(result: loads.Result) -> dict[str, Any]:
    return {"rate": result.rate, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms,
            "proxy_us": result.cpu_us("proxy"), "postgres_us": result.cpu_us("postgres"),
            "errors": result.errors, "sent": result.sent, "uniques": result.uniques,
            "app_calls": result.upstream.get("calls", -1),
            "other_load": result.window.others}  # fmt: skip


def _app_figures(run: AppRun) -> dict[str, Any]:
    return {"count": run.count, "rate": run.rate, "mean_ms": run.mean_ms,
            "p99_ms": run.percentile(0.99), "postgres_us": run.cpu_us(run.postgres_s),
            "client_us": run.cpu_us(run.client_s), "ledger_rows": run.ledger_rows,
            "receipt_rows": run.receipt_rows, "other_load": run.others}  # fmt: skip


def _ratio(a: float, b: float) -> float:
    """``a`` ÷ ``b``; NaN when ``b`` is nothing (a run too short for /proc's clock ticks)."""
    return a / b if b else math.nan


def _spread(ratios: list[float]) -> str:
    return f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f} to {max(ratios):.3f})"


def _webhook_table(results: dict[tuple[str, int, int], loads.Result]) -> str:
    lines = [
        "| wrk | round | plain: webhooks/s, p50, p99 ms; CPU µs proxy, PostgreSQL | receipt: "
        "the same | throughput receipt ÷ plain | p50 | p99 | proxy CPU | PostgreSQL CPU | "
        "other load, cores |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: loads.Result) -> str:
        return (f"{r.rate:,.0f}, {r.p50_ms:.2f}, {r.p99_ms:.2f}; {r.cpu_us('proxy'):.0f}, "
                f"{r.cpu_us('postgres'):.0f}")  # fmt: skip

    for connections in sorted({c for _, c, _ in results}, reverse=True):
        ratios: list[list[float]] = [[], [], [], [], []]
        for round_ in sorted({r for _, c, r in results if c == connections}):
            p, k = results["plain", connections, round_], results["receipt", connections, round_]
            found = (_ratio(k.rate, p.rate), _ratio(k.p50_ms, p.p50_ms),
                     _ratio(k.p99_ms, p.p99_ms), _ratio(k.cpu_us("proxy"), p.cpu_us("proxy")),
                     _ratio(k.cpu_us("postgres"), p.cpu_us("postgres")))  # fmt: skip
            for column, value in zip(ratios, found, strict=True):
                column.append(value)
            others = f"{p.window.others:.2f}, {k.window.others:.2f}"
            lines.append(f"| c{connections} | {round_} | {cell(p)} | {cell(k)} | "
                         + " | ".join(f"{v:.3f}" for v in found) + f" | {others} |")  # fmt: skip
        lines.append(f"| **c{connections}** | **median** | | | "
                     + " | ".join(_spread(column) for column in ratios) + " | |")  # fmt: skip
    return "\n".join(lines)


def _app_table(runs: dict[tuple[str, int, int], AppRun]) -> str:
    lines = [
        "| connections | round | plain: tx/s, mean, p99 ms; CPU µs PostgreSQL, client | "
        "receipt: the same | time per transaction receipt ÷ plain | PostgreSQL CPU | "
        "client CPU | other load, cores |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(r: AppRun) -> str:
        return (f"{r.rate:,.0f}, {r.mean_ms:.2f}, {r.percentile(0.99):.2f}; "
                f"{r.cpu_us(r.postgres_s):.0f}, {r.cpu_us(r.client_s):.0f}")  # fmt: skip

    for concurrency in sorted({c for _, c, _ in runs}, reverse=True):
        ratios: list[list[float]] = [[], [], []]
        for round_ in sorted({r for _, c, r in runs if c == concurrency}):
            p, k = runs["plain", concurrency, round_], runs["receipt", concurrency, round_]
            found = (_ratio(k.mean_ms, p.mean_ms), _ratio(k.postgres_s, p.postgres_s),
                     _ratio(k.client_s, p.client_s))  # fmt: skip
            for column, value in zip(ratios, found, strict=True):
                column.append(value)
            lines.append(f"| {concurrency} | {round_} | {cell(p)} | {cell(k)} | "
                         + " | ".join(f"{v:.3f}" for v in found)
                         + f" | {p.others:.2f}, {k.others:.2f} |")  # fmt: skip
        lines.append(f"| **{concurrency}** | **median** | | | "
                     + " | ".join(_spread(column) for column in ratios) + " | |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
