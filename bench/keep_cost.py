"""What a delivery kept by the limit at the app costs, against a forwarded one, side by side.

    python bench/keep_cost.py [--rounds 4] [--duration 5] [--workers 2] [--pool 40]
                              [--connections 32,1] [--grow | --ordered | --shared]
                              [--statements] [--out FILE] [--json FILE]

Two proxies on the same embedded PostgreSQL and the same ``redeliver`` route: one forwards to a
fast app under a limit it never reaches (``upstream.concurrency`` 64); the other has
``upstream.concurrency`` = its workers (one place each), taken by a request its app never
answers, so that every webhook wrk sends it is kept by the limit (the short keep transaction:
claim, the row's UPDATE, COMMIT, answered 202; its route's ``hand_off`` of 1 ms keeps it at
once, where a route waits ``app_limit.KEEP_WAIT`` for a place first), each kept run from an
empty inbox unless ``--grow``; ``--statements`` adds where PostgreSQL's time goes in the kept
runs, per statement and kept webhook (pg_stat_statements). Each round runs wrk (new event IDs)
against each, the order reversed every other round, and reports CPU per webhook (the proxy and
PostgreSQL), throughput and latency, and kept ÷ forwarded. With ``--ordered``, what ``order``
costs instead: the second proxy forwards too, to an app of its own, on the same route with
``order: {key: body:/id}`` (each event its own object, so that nothing waits: the object row's
statement alone), and the table is ordered ÷ plain. With ``--shared``, what a limit shared by
every replica costs: both forward, each to an app of its own, on the same route, one under the
per-replica ``upstream.concurrency`` 64, the other under ``{limit: 64, shared: true}`` (each
webhook takes a place, a row of ``~slots/app`` locked in its claim's transaction: every
worker's room is 32 either way, so the room never binds), and the table is shared ÷ per-
replica; then one more c32 run on each, alone, counts the statements per webhook
(pg_stat_statements) and the connections the proxies opened and used, and the take is
EXPLAINed. Loopback only; every load run is bounded; every process started is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
import yaml

from bench import loads, procs, report
from bench.run import SCOPE, TABLE, Bench, Settings, prepare_database
from proxy.database import pool, slots

LIMIT = 64  # the forwarding proxy's: above what c32 sends
# The two proxies compared: the first forwards to a fast app on a plain route.
KEPT = ("forwarded", "kept")
ORDERED = ("plain", "ordered")
SHARED = ("per-replica", "shared")
KEPT_LIMIT = 'dedup_inbox_kept_total{reason="limit",route="kept"}'


def route(name: str, *, ordered: bool = False, kept: bool = False) -> dict[str, Any]:
    """The redeliver route, its scope its own: the forwarding proxy's redeliverer must not
    take the rows the other one keeps (replicas on one scope share their inbox). ``kept``: a
    hand_off of 1 ms, so that a webhook finding every place held is kept at once instead of
    waiting ``app_limit.KEEP_WAIT`` for one (the keep measured, not that wait)."""
    return {"name": name, "path": "/hook", "event_id": "body:/id",
            "redeliver": {"max_pending": 1_000_000, "max_pending_bytes": "4GiB"},
            **({"order": {"key": "body:/id"}} if ordered else {}),
            **({"hand_off": "1ms"} if kept else {})}  # fmt: skip


class Held(loads.Upstream):
    """The app that never answers: no call is expected during a run, so nothing to wait for."""

    def settle(self, expected: int, within: float = 10.0) -> dict[str, int]:
        return self.stats()


def admin_url(bench: Bench, name: str) -> str:
    config = yaml.safe_load((bench.workdir / f"{name}.yaml").read_text())
    return f"http://{config['admin']['listen']}"


def metric(url: str, sample: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    return 0.0


def fill_the_app(bench: Bench, kept: procs.Service, workers: int) -> None:
    """Send webhooks, each on a connection of its own that stays open (a daemon thread each),
    until every worker's one place is taken by one the held app never answers
    (dedup_app_in_flight = workers); the others are kept and answered at once. Bounded."""
    url = admin_url(bench, "kept")
    for n in range(200):
        if metric(url, "dedup_app_in_flight") >= workers:
            return
        body = json.dumps({"id": f"held-{bench.run_id()}-{n}"}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{kept.port}/hook", data=body)
        threading.Thread(target=_hold, args=(request,), daemon=True).start()
        time.sleep(0.1)
    raise RuntimeError("the held app's places are not all taken after 200 webhooks")


def _hold(request: urllib.request.Request) -> None:
    """One webhook, waited for until the proxy stops (then the connection's error is moot)."""
    with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=3600) as answer:
        answer.read()


def empty_the_inbox(bench: Bench) -> None:
    """Delete the rows the last kept run kept, and VACUUM: the keep's cap counts the route's
    kept rows (``inbox_sql.Statements.keep``), so each run starts from the same backlog.

    A row a lane is redelivering stays: while ``fill_the_app`` takes the places one by one, a
    lane with a place still free may take a row kept meanwhile to the held app, and hold its
    lock for as long as the proxy runs (a plain DELETE would wait on it for ever)."""
    bench.sql(
        f"DELETE FROM {TABLE} WHERE (scope, event_id) IN (SELECT scope, event_id FROM {TABLE} "
        "WHERE scope = 'kept' AND inbox_state = 'pending' FOR UPDATE SKIP LOCKED)"
    )
    bench.sql(f"VACUUM {TABLE}")


Run = tuple[procs.Service, procs.Service, loads.Upstream]


def start(
    bench: Bench, args: argparse.Namespace, names: tuple[str, str], warmup: int
) -> dict[str, Run]:
    """The two proxies and their apps, by name: with the counters of each app's calls."""
    fast = bench.start_upstream("app")
    forwarded = bench.start_proxy(names[0], fast, args.pool, workers=args.workers,
                                  concurrency=LIMIT, routes=[route(SCOPE)])  # fmt: skip
    if args.ordered or args.shared:
        other = bench.start_upstream(f"app-{names[1]}")
        limit: int | dict[str, Any] = {"limit": LIMIT, "shared": True} if args.shared else LIMIT
        second = bench.start_proxy(names[1], other, args.pool, workers=args.workers,
                                   concurrency=limit,
                                   routes=[route(names[1], ordered=args.ordered)])  # fmt: skip
        counters: loads.Upstream = loads.Upstream(other.port)
    else:
        other = bench.start_upstream("app-held", delay=86_400)
        # Its app's time-out past the run's end: the places stay taken throughout.
        second = bench.start_proxy("kept", other, args.pool, workers=args.workers,
                                   timeout="1h", concurrency=args.workers,
                                   routes=[route("kept", kept=True)])  # fmt: skip
        counters = Held(other.port)
        fill_the_app(bench, second, args.workers)
    bench.wrk("", f"warm-up {names[0]}", forwarded, fast, 32, seconds=warmup)
    if args.ordered or args.shared:
        bench.wrk("", f"warm-up {names[1]}", second, other, 32, seconds=warmup)
    return {
        names[0]: (forwarded, fast, loads.Upstream(fast.port)),
        names[1]: (second, other, counters),
    }


Results = dict[tuple[str, int, int], loads.Result]


def measure(
    bench: Bench, args: argparse.Namespace, runs: dict[str, Run], names: tuple[str, str]
) -> tuple[Results, dict[str, list[float]]]:
    """The rounds: each proxy under wrk at each connection count, the order reversed every
    other round; with ``--statements``, each kept run's time per statement too."""
    results: Results = {}
    statements: dict[str, list[float]] = {}
    for round_ in range(1, args.rounds + 1):
        for connections in (int(c) for c in args.connections.split(",")):
            for name in names if round_ % 2 else names[::-1]:
                proxy, app, counters = runs[name]
                if name == "kept" and not args.grow:
                    empty_the_inbox(bench)
                watched = args.statements and name == "kept"
                if watched:
                    bench.sql("SELECT pg_stat_statements_reset()")
                result = results[name, connections, round_] = bench._record("", loads.wrk(
                    f"{name} c{connections} (round {round_})",
                    f"http://127.0.0.1:{proxy.port}/hook", connections=connections,
                    seconds=args.duration, probes=bench.probes(proxy=proxy, upstream=app),
                    upstream=counters, run_id=bench.run_id(),
                ))  # fmt: skip
                if watched:
                    for text, total in statement_times(bench, result.sent).items():
                        statements.setdefault(text, []).append(total)
    return results, statements


def statement_times(bench: Bench, webhooks: int) -> dict[str, float]:
    """PostgreSQL's time (planning and execution, µs) per kept webhook for each statement since
    the last reset, by the statement's first 70 characters (the kept runs reset it first)."""
    rows = bench.value(
        "SELECT json_agg(json_build_array(text, ms)) FROM (SELECT left(regexp_replace(query, "
        "'\\s+', ' ', 'g'), 70) AS text, sum(total_exec_time + total_plan_time) AS ms "
        f"FROM pg_stat_statements WHERE query NOT LIKE '%{OURS}%' GROUP BY 1 "
        "ORDER BY 2 DESC LIMIT 8) AS top"
    )
    return {str(t): float(ms) * 1000 / max(webhooks, 1) for t, ms in json.loads(rows or "[]")}


def _statements_table(statements: dict[str, list[float]]) -> str:
    """Each statement's median µs per kept webhook over the kept runs, the largest first."""
    medians = {text: statistics.median(times) for text, times in statements.items()}
    lines = ["| statement (its start) | PostgreSQL µs per kept webhook, median of the kept runs |",
             "|---|---|"]  # fmt: skip
    for text, median in sorted(medians.items(), key=lambda item: -item[1]):
        lines.append(f"| `{text}` | {median:,.0f} |")
    return "\n".join(lines)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=int, default=5, help="seconds per load run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pool", type=int, default=40, help="database.pool_size per worker")
    parser.add_argument("--connections", default="32,1", help="comma-separated wrk -c values")
    parser.add_argument("--grow", action="store_true", help="keep the kept rows from run to "
                        "run (default: each kept run starts with an empty inbox)")  # fmt: skip
    parser.add_argument("--ordered", action="store_true", help="compare a route with order "
                        "against the same route without, both forwarding")  # fmt: skip
    parser.add_argument("--shared", action="store_true", help="compare a limit shared by "
                        "every replica against the per-replica one, both forwarding")  # fmt: skip
    parser.add_argument("--statements", action="store_true", help="also report where "
                        "PostgreSQL's time goes in the kept runs, by statement")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--json", type=Path, help="also write the runs as JSON here")
    args = parser.parse_args(argv)
    if (args.ordered or args.shared) and args.grow:
        parser.error("--grow is for the kept runs; --ordered and --shared have none")
    if args.ordered and args.shared:
        parser.error("--ordered and --shared are two comparisons: one at a time")
    if args.statements and (args.ordered or args.shared):
        parser.error("--statements is for the kept runs (--shared counts its own statements)")
    return args


def _setup(args: argparse.Namespace, kept_total: float) -> str:
    """What the two proxies were, for the table's heading."""
    if args.ordered:
        return (
            "plain and ordered (order: {key: body:/id}, each event its own object) both "
            f"forward, upstream.concurrency {LIMIT}, each to an app of its own"
        )
    if args.shared:
        return (
            f"per-replica (upstream.concurrency {LIMIT}) and shared ({{limit: {LIMIT}, shared: "
            "true}) both forward, each to an app of its own"
        )
    return (
        f"forwarded: upstream.concurrency {LIMIT}, kept: {args.workers} (each place held); "
        f"{kept_total:,.0f} kept by the limit in all; each kept run started with "
        f"{'the rows the runs before it kept' if args.grow else 'an empty inbox'}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    loads.wrk_path()
    settings = Settings(seconds=args.duration, pool=args.pool, warmup=2, rounds=args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-keep-cost-"))
    bench = Bench(settings, workdir)
    names = ORDERED if args.ordered else SHARED if args.shared else KEPT
    kept_total = 0.0
    counted = ""
    try:
        if args.shared or args.statements:  # the statements per webhook counted
            prepare_database(bench, **STATEMENTS_COUNTED)
            bench.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        else:
            prepare_database(bench)
        runs = start(bench, args, names, settings.warmup)
        results, statements = measure(bench, args, runs, names)
        if statements:
            counted = "\n" + _statements_table(statements) + "\n"
        if args.shared:
            counted = count(bench, runs, names, settings.seconds)
        elif not args.ordered:
            kept_total = metric(admin_url(bench, "kept"), KEPT_LIMIT)
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    _check(results)
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/keep_cost.py", *given])
    machine = report.machine()
    setup = _setup(args, kept_total)
    text = (
        f"`{command}`: {machine.get('nproc', '?')} CPUs, {args.duration} s per run, "
        f"{args.workers} workers, pool {args.pool} each; a redeliver route; {setup}\n\n"
        f"{_table(results, names)}\n{counted}"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    if args.json is not None:
        runs_json = {f"{n} c{c} r{r}": _figures(result) for (n, c, r), result in results.items()}
        args.json.write_text(json.dumps(runs_json, indent=2), encoding="utf-8")
    return 0


# The server's settings for ``count``: pg_stat_statements, planning times included.
STATEMENTS_COUNTED = {"shared_preload_libraries": "pg_stat_statements",
                      "pg_stat_statements.track_planning": "on"}  # fmt: skip
# The statements the bench's own sessions send (the sampler, the counts), not counted.
OURS = "pg_stat_"


def count(bench: Bench, runs: dict[str, Run], names: tuple[str, str], seconds: int) -> str:
    """One more c32 run on each proxy, alone, after pg_stat_statements_reset(): the statements
    per webhook each sent (every one whose calls reach a hundredth of the webhooks, and all of
    them together), the connections the proxies opened during the run and the most busy at
    once (sampled every 20 ms); then the shared take's plans. Markdown."""
    lines = ["", "Statements per webhook (pg_stat_statements, one c32 run on each, alone):", ""]
    for name in names:
        proxy, app, counters = runs[name]
        asyncio.run(_query(bench.dsn, "SELECT pg_stat_statements_reset()"))
        started = asyncio.run(_query(bench.dsn, "SELECT now()"))[0][0]
        busy: list[int] = []
        stop = threading.Event()
        sampler = threading.Thread(target=_sample_busy, args=(bench.dsn, busy, stop))
        sampler.start()
        try:
            result = bench._record("", loads.wrk(
                f"{name} c32 (statements)", f"http://127.0.0.1:{proxy.port}/hook",
                connections=32, seconds=seconds, probes=bench.probes(proxy=proxy, upstream=app),
                upstream=counters, run_id=bench.run_id(),
            ))  # fmt: skip
        finally:
            stop.set()
            sampler.join(timeout=30)
        webhooks = max(result.upstream.get("calls", 0), 1)
        rows = asyncio.run(_query(
            bench.dsn, "SELECT calls, regexp_replace(query, '\\s+', ' ', 'g'), total_exec_time, "
            "total_plan_time, wal_records FROM pg_stat_statements WHERE query NOT LIKE $1 "
            "ORDER BY calls DESC, query",
            f"%{OURS}%",
        ))  # fmt: skip
        opened = asyncio.run(_query(
            bench.dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
            "AND backend_start >= $2", pool.APPLICATION_NAME, started,
        ))[0][0]  # fmt: skip
        total = sum(calls for calls, *_ in rows)
        lines.append(f"**{name}**: {webhooks:,} webhooks, {total / webhooks:.2f} statements "
                     f"each; {opened} connections opened during the run, at most "
                     f"{max(busy, default=0)} busy at once")  # fmt: skip
        lines.append("")
        lines += ["| calls per webhook | mean ms planning, executing | WAL records per call "
                  "| statement |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {calls / webhooks:.3f} | {planned / calls:.3f}, {spent / calls:.3f} | "
                  f"{wal / calls:.2f} | `{_short(text)}` |"
                  for calls, text, spent, planned, wal in rows
                  if calls >= webhooks / 100]  # fmt: skip
        lines.append("")
    return "\n".join([*lines, _plans(bench), ""])


def _short(text: str, most: int = 160) -> str:
    return (text if len(text) <= most else text[: most - 1] + "…").replace("|", "\\|")


def _plans(bench: Bench) -> str:
    """The take's plan, run once in a transaction rolled back, over the table the runs filled
    (its planning too: a statement sent as text is planned at each call)."""
    places = slots.Slots(f'"{TABLE}"', LIMIT, 10.0)
    rows = asyncio.run(_query(bench.dsn, f"SELECT count(*) FROM {TABLE}"))[0][0]
    plan = asyncio.run(_explain(bench.dsn, places.take_statement))
    return (f"The take over {rows:,} rows of the claim table, EXPLAIN ANALYZE (rolled "
            f"back):\n\n```\n{plan}\n```")  # fmt: skip


async def _explain(dsn: str, statement: str) -> str:
    connection = await asyncpg.connect(dsn)
    transaction = connection.transaction()
    await transaction.start()
    try:
        found = await connection.fetch(f"EXPLAIN (ANALYZE, BUFFERS, TIMING OFF) {statement}")
        return "\n".join(row[0] for row in found)
    finally:
        await transaction.rollback()  # the row it locked
        await connection.close()


async def _query(dsn: str, query: str, *args: object) -> list[Any]:
    connection = await asyncpg.connect(dsn)
    try:
        return list(await connection.fetch(query, *args))
    finally:
        await connection.close()


def _sample_busy(dsn: str, busy: list[int], stop: threading.Event) -> None:
    """The proxies' connections in a statement or a transaction, every 20 ms until ``stop``."""

    async def sample() -> None:
        connection = await asyncpg.connect(dsn)
        try:
            while not stop.is_set():
                busy.append(await connection.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
                    "AND state <> 'idle'", pool.APPLICATION_NAME,
                ))  # fmt: skip
                await asyncio.sleep(0.02)
        finally:
            await connection.close()

    asyncio.run(sample())


def _check(results: Results) -> None:
    """Every kept run reached no app; every other one reached it once per webhook."""
    for (name, _, _), result in results.items():
        calls = result.upstream.get("calls", -1)
        expected = 0 if name == "kept" else result.uniques
        if calls != expected or result.errors:
            raise RuntimeError(f"{result.label}: {calls} app calls, {result.errors} errors")


def _figures(result: loads.Result) -> dict[str, Any]:
    return {"rate": result.rate, "p50_ms": result.p50_ms, "p99_ms": result.p99_ms,
            "proxy_us": result.cpu_us("proxy"), "postgres_us": result.cpu_us("postgres"),
            "errors": result.errors, "sent": result.sent}  # fmt: skip


def _table(results: Results, names: tuple[str, str]) -> str:
    a, b = names
    lines = [
        f"| connections | round | {a}: webhooks/s, p50, p99 ms, CPU µs proxy, PostgreSQL "
        f"| {b}: webhooks/s, p50, p99 ms, CPU µs proxy, PostgreSQL | proxy CPU {b} ÷ {a} "
        f"| PostgreSQL CPU {b} ÷ {a} | throughput {b} ÷ {a} |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(r: loads.Result) -> str:
        return (f"{r.rate:,.0f}, {r.p50_ms:.2f}, {r.p99_ms:.2f}, {r.cpu_us('proxy'):.0f}, "
                f"{r.cpu_us('postgres'):.0f}")  # fmt: skip

    for connections in sorted({c for _, c, _ in results}, reverse=True):
        cpu, pg, rate = [], [], []
        for round_ in sorted({r for _, c, r in results if c == connections}):
            f, k = results[a, connections, round_], results[b, connections, round_]
            cpu.append(k.cpu_us("proxy") / f.cpu_us("proxy"))
            pg.append(k.cpu_us("postgres") / f.cpu_us("postgres"))
            rate.append(k.rate / f.rate)
            lines.append(f"| {connections} | {round_} | {cell(f)} | {cell(k)} | {cpu[-1]:.3f} | "
                         f"{pg[-1]:.3f} | {rate[-1]:.3f} |")  # fmt: skip
        lines.append(
            f"| **{connections}** | **median** | | | **{statistics.median(cpu):.3f}** "
            f"({min(cpu):.3f} to {max(cpu):.3f}) | **{statistics.median(pg):.3f}** "
            f"({min(pg):.3f} to {max(pg):.3f}) | **{statistics.median(rate):.3f}** "
            f"({min(rate):.3f} to {max(rate):.3f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
