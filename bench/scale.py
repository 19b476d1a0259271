"""Scale: does a webhook cost the same against a full claim table, what does the retention
sweep cost its latency, and how far does the pool carry a slow app (Little's law); side by
side in one run.

    python bench/scale.py [--quick] [--rows N] [--duration S] [--rounds N] [--out FILE]

One embedded PostgreSQL, the fast app (bench/upstream.py), and the proxy through its CLI, one
worker each, as bench/run.py starts them; wrk with bench/unique_ids.lua (1 KiB JSON, new IDs).

1. Two proxies, each on its own claim table: one holding 1,000 seed rows, one filled with
   ``--rows`` (10M) by one INSERT … SELECT over generate_series (md5 IDs), then VACUUM ANALYZE
   and CHECKPOINT. c32 and c1 against each, the order swapped every round.
2. On the full table, c32 against a proxy whose route's retention (1 day) makes two thirds of
   the rows due, with ``sweeper.interval`` 1 s: its own sweeper deletes while it serves;
   beside the same load on the proxy of item 1 (retention 30 days, nothing due). The order
   swaps every round; VACUUM after each sweep, outside the measurements.
3. An app that answers after 200 ms, a proxy with ``database.pool_size`` 10, 50 and 200 in
   turn (the order rotated every round), wrk -c256; the proxy's PostgreSQL connections sampled
   from pg_stat_activity every 20 ms.

The full run (10M rows, 10 s runs, 4 rounds) takes about 11 minutes on 2 cores. ``--quick``:
100k rows, 1 s runs, 2 rounds, no warm-up; it checks the harness, its figures mean nothing.
Needs ``wrk``. Everything listens on 127.0.0.1, every run is bounded in time, and every
process started is stopped by PID. The report goes to ``--out`` (bench/SCALE.md) and stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg
import yaml

from bench import loads, procs, report
from bench.run import ROOT, Bench, Settings
from proxy import config as proxy_config
from proxy import database
from proxy.database import pool as database_pool

EMPTY = "scale_empty"  # the claim table that stays (nearly) empty
FULL = "scale_full"  # the one filled with --rows
SCOPE = "bench"  # every proxy's one route: its name, hence its scope
SEEDS = 1000
POOL = 32  # items 1 and 2: no webhook of c32 waits for a connection
FILL_SPAN_DAYS = 3  # the fill's received_at spans the last 3 days: 2/3 older than a day
RETENTION = "1d"
FILL_WORK_MEM = "2GB"
SLOW_DELAY = 0.2
SLOW_POOLS = (10, 50, 200)
WIDE = 256  # item 3's connections: more than the largest pool
SAMPLE_EVERY = 0.02
READY_WITHIN = 60.0
SWEEP_START_WITHIN = 20.0
TARGET = 0.9


@dataclass(frozen=True, slots=True)
class Proxy:
    """A proxy started by this script, and its admin listener."""

    service: procs.Service
    admin: int

    def _get(self, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{self.admin}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def wait_ready(self) -> None:
        """Until /readyz answers 200: the pool filled, the table checked."""
        deadline = time.monotonic() + READY_WITHIN
        while (status := self._get("/readyz"))[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.service.name} not ready: {status}")
            time.sleep(0.1)

    def swept(self) -> int:
        """Rows this proxy's sweeper deleted so far (dedup_retention_deleted_rows_total)."""
        text = self._get("/metrics")[1]
        found = re.findall(r"^dedup_retention_deleted_rows_total\{[^}]*\} (\S+)$", text, re.M)
        return int(sum(float(value) for value in found))

    def answers(self) -> collections.Counter[str]:
        """The proxy's answers so far, from its log lines: "200", "503 (shed: pool)", …"""
        found: collections.Counter[str] = collections.Counter()
        for text in self.service.log_path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(text)
            except ValueError:
                continue
            if isinstance(entry, dict) and "status" in entry and entry.get("route"):
                shed = f" (shed: {entry['shed']})" if entry.get("shed") else ""
                found[f"{entry['status']}{shed}"] += 1
        return found

    def sweep_finished(self) -> bool:
        """Whether a sweep round came to its end (the sweeper logs it only then)."""
        return "retention removed" in self.service.log_path.read_text(errors="replace")


def start_proxy(bench: Bench, name: str, app: procs.Service, *, table: str, pool: int,
                retention: str | None = None) -> Proxy:  # fmt: skip
    """The proxy through its CLI (as ``Bench.start_proxy``) on ``table``; with ``retention``,
    a route that keeps claims that long and a sweeper that wakes every second."""
    port, admin = _two_ports()
    route: dict[str, Any] = {"name": SCOPE, "path": "/hook", "event_id": "body:/id"}
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{port}",
        "admin": {"listen": f"127.0.0.1:{admin}"},
        "upstream": {"url": f"http://127.0.0.1:{app.port}", "timeout": "30s"},
        "database": {"dsn": bench.dsn, "table": table, "pool_size": pool},
        "shutdown_timeout": "5s",
        "log": {"level": "info", "format": "json"},  # one line per webhook, as in production
        "routes": [route],
        "workers": 1,
    }
    if retention is not None:
        route["retention"] = retention
        config["sweeper"] = {"interval": "1s"}
    config_file = bench.workdir / f"{name}.yaml"
    proxy_config.parse(config, source=str(config_file))  # a clear error before starting
    config_file.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "proxy", "serve", "--config", str(config_file)]
    service = procs.Service(name, argv, bench.workdir / f"{name}.log", port)
    bench.services.append(service)  # so that Bench.close stops it whatever happens
    service.wait_listening()
    proxy = Proxy(service, admin)
    proxy.wait_ready()
    return proxy


def _two_ports() -> tuple[int, int]:
    """Two free ports, different: ``free_port`` may hand the one it just closed again."""
    port = procs.free_port()
    for _ in range(100):
        if (other := procs.free_port()) != port:
            return port, other
    raise RuntimeError("no second free port")


class Connections(threading.Thread):
    """Samples pg_stat_activity every ``SAMPLE_EVERY`` on a connection of its own: at most how
    many of the proxy's connections were not idle (in a transaction: an open claim), and how
    many it had."""

    QUERY = (
        "SELECT count(*) FILTER (WHERE state <> 'idle'), count(*) FROM pg_stat_activity "
        "WHERE application_name = $1"
    )

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.busy = 0
        self.total = 0
        self.samples = 0

    def __enter__(self) -> Connections:
        self.start()
        if not self.ready.wait(10):
            raise RuntimeError("cannot sample pg_stat_activity")
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.join(10)

    def run(self) -> None:
        asyncio.run(self._sample())

    async def _sample(self) -> None:
        connection = await asyncpg.connect(self.dsn, server_settings={"application_name": "bench"})
        try:
            self.ready.set()
            while not self.stopping.is_set():
                row = await connection.fetchrow(self.QUERY, database_pool.APPLICATION_NAME)
                assert row is not None
                self.busy, self.total = max(self.busy, row[0]), max(self.total, row[1])
                self.samples += 1
                await asyncio.sleep(SAMPLE_EVERY)
        finally:
            await connection.close()


@dataclass
class Sweep:
    """What the sweeping proxy did around one load run."""

    during: int = 0  # rows deleted while wrk ran (the proxy's counter)
    lifetime: int = 0  # fill rows gone between before its start and after its stop (COUNT)
    seconds: float = 0.0  # how long it ran
    running_after: bool = False  # still deleting when the load run ended
    finished: bool = False  # a round came to its end (nothing due was left)
    failed: int = 0  # "retention sweep failed" warnings
    vacuum_seconds: float = 0.0


@dataclass
class Pooled:
    """One run of item 3: wrk's figures, the connections sampled, and every answer the proxy
    logged for the run's webhooks (also those answered after wrk left)."""

    result: loads.Result
    connections: Connections
    answers: collections.Counter[str]


@dataclass
class Run:
    item: str
    result: loads.Result
    exact: bool  # through the proxy: one call per unique ID; item 3 (503s): none repeated


@dataclass
class Scale:
    """Everything measured, by item."""

    runs: list[Run] = field(default_factory=list)
    flat: dict[tuple[int, str, int], loads.Result] = field(default_factory=dict)
    flat_order: dict[int, str] = field(default_factory=dict)
    sweep: dict[tuple[int, bool], loads.Result] = field(default_factory=dict)
    sweeps: dict[int, Sweep] = field(default_factory=dict)
    pools: dict[tuple[int, int], Pooled] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)


class Measure:
    def __init__(self, bench: Bench, rows: int) -> None:
        self.bench = bench
        self.rows = rows
        self.s = bench.settings
        self.scale = Scale()

    def wrk(self, item: str, label: str, proxy: Proxy, app: procs.Service,
            connections: int) -> loads.Result:  # fmt: skip
        result = self.bench.wrk("", label, proxy.service, app, connections)
        ok, _ = report.exact(result)
        if item == "3":
            u = result.upstream
            ok = u.get("repeated") == 0 and u.get("seeded") == 0 and u.get("distinct") == u.get(
                "calls") and u.get("calls", 0) <= result.uniques  # fmt: skip
        self.scale.runs.append(Run(item, result, ok))
        return result

    def warm(self, proxy: Proxy, app: procs.Service, connections: int = 32) -> None:
        if self.s.warmup:
            self.bench.wrk("", f"warm-up {proxy.service.name}", proxy.service, app, connections,
                           seconds=self.s.warmup)  # fmt: skip

    def prepare(self) -> None:
        bench = self.bench
        # Item 3's pool of 200 beside the others' pools, the sampler and the scripts' own.
        bench.start_database(max_connections="400")
        for table in (EMPTY, FULL):
            bench.sql(database.schema_sql(table))
        bench.sql(
            f"INSERT INTO {EMPTY} (scope, event_id) "
            f"SELECT '{SCOPE}', 'seed-' || g FROM generate_series(1, {SEEDS}) g"
        )
        self.fill()
        facts = self.scale.facts
        facts["postgres"] = bench.value("SHOW server_version")
        facts["pg_settings"] = bench.value(
            "SELECT string_agg(name || ' ' || current_setting(name), ', ' ORDER BY name) "
            "FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'shared_buffers', "
            "'max_connections', 'autovacuum', 'max_wal_size', 'checkpoint_timeout')"
        )

    def fill(self) -> None:
        """``rows`` claims in one INSERT … SELECT: md5 IDs in the route's scope, received_at
        spread over the last ``FILL_SPAN_DAYS`` days, rising with the ID (the ID's first 32
        bits as a fraction). Sorted by ID, both indexes fill in order, and the oldest rows lie
        first in the heap, as a table filled over time has them."""
        started = time.monotonic()
        fraction = "(('x' || left(id, 8))::bit(32)::bigint / 4294967296.0)"
        self.bench.sql(
            # Enough memory for the sort to stay in memory (one session, this statement only).
            f"SET work_mem = '{FILL_WORK_MEM}'; "
            f"INSERT INTO {FULL} (scope, event_id, event_type, received_at) "
            f"SELECT '{SCOPE}', id, 'fill', "
            f"now() - interval '{FILL_SPAN_DAYS} days' * (1 - {fraction}) "
            f"FROM (SELECT md5(g::text) AS id FROM generate_series(1, {self.rows}) g) ids "
            "ORDER BY id"
        )
        inserted = time.monotonic()
        self.bench.sql(f"VACUUM (ANALYZE) {FULL}")
        self.bench.sql("CHECKPOINT")
        facts = self.scale.facts
        facts["fill"] = (inserted - started, time.monotonic() - inserted)
        facts["table_size"] = self.bench.value(
            "SELECT pg_size_pretty(pg_total_relation_size($1))", FULL
        )
        facts["due"] = self.fill_rows(due=True)
        print(f"filled {self.rows:,} rows in {inserted - started:.0f} s", file=sys.stderr)

    def fill_rows(self, *, due: bool = False) -> int:
        older = f" AND received_at < now() - interval '{RETENTION}'" if due else ""
        return int(self.bench.value(f"SELECT count(*) FROM {FULL} WHERE event_type = 'fill'"
                                    + older))  # fmt: skip

    # -- item 1 ----------------------------------------------------------------------------

    def flat(self, app: procs.Service, empty: Proxy, full: Proxy) -> None:
        tables = [("empty", empty), ("full", full)]
        for round_ in range(1, self.s.rounds + 1):
            order = tables if round_ % 2 else tables[::-1]
            self.scale.flat_order[round_] = ", ".join(name for name, _ in order)
            for connections in (32, 1):
                for name, proxy in order:
                    label = f"1. {name} table, c{connections} (round {round_})"
                    self.scale.flat[(round_, name, connections)] = self.wrk(
                        "1", label, proxy, app, connections
                    )

    # -- item 2 ----------------------------------------------------------------------------

    def sweeps(self, app: procs.Service, full: Proxy) -> None:
        for round_ in range(1, self.s.rounds + 1):
            for sweeping in (False, True) if round_ % 2 else (True, False):
                if sweeping:
                    self.sweeping(round_, app)
                else:
                    label = f"2. full table, no sweep (round {round_})"
                    self.scale.sweep[(round_, False)] = self.wrk("2", label, full, app, 32)

    def sweeping(self, round_: int, app: procs.Service) -> None:
        """c32 on a proxy that sweeps the full table meanwhile; it is started once its first
        batch is gone and stopped after, then the table is vacuumed as autovacuum would."""
        sweep = Sweep()
        before = self.fill_rows()
        started = time.monotonic()
        proxy = start_proxy(self.bench, f"proxy-sweeping-{round_}", app, table=FULL, pool=POOL,
                            retention=RETENTION)  # fmt: skip
        try:
            deadline = time.monotonic() + SWEEP_START_WITHIN
            while proxy.swept() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.warm(proxy, app)
            first = proxy.swept()
            label = f"2. full table, retention sweep running (round {round_})"
            self.scale.sweep[(round_, True)] = self.wrk("2", label, proxy, app, 32)
            sweep.during = proxy.swept() - first
            time.sleep(0.5)
            sweep.running_after = proxy.swept() > first + sweep.during
            sweep.finished = proxy.sweep_finished()
            sweep.failed = proxy.service.log_path.read_text().count("retention sweep failed")
        finally:
            self.bench.stop(proxy.service)
        sweep.seconds = time.monotonic() - started
        sweep.lifetime = before - self.fill_rows()
        vacuum = time.monotonic()
        self.bench.sql(f"VACUUM {FULL}")
        sweep.vacuum_seconds = time.monotonic() - vacuum
        self.scale.sweeps[round_] = sweep

    # -- item 3 ----------------------------------------------------------------------------

    def pools(self) -> None:
        slow = self.bench.start_upstream("app-200ms", delay=SLOW_DELAY)
        for round_ in range(1, self.s.rounds + 1):
            shift = (round_ - 1) % len(SLOW_POOLS)
            for pool in SLOW_POOLS[shift:] + SLOW_POOLS[:shift]:
                proxy = start_proxy(self.bench, f"proxy-pool{pool}-{round_}", slow, table=EMPTY,
                                    pool=pool)  # fmt: skip
                try:
                    self.warm(proxy, slow, min(pool, WIDE))
                    warm = proxy.answers()
                    label = f"3. pool {pool}, 200 ms app, c{WIDE} (round {round_})"
                    with Connections(self.bench.dsn) as sampled:
                        result = self.wrk("3", label, proxy, slow, WIDE)
                finally:
                    self.bench.stop(proxy.service)  # drained: every answer is in the log
                answers = proxy.answers() - warm
                self.scale.pools[(round_, pool)] = Pooled(result, sampled, answers)
        self.bench.stop(slow)

    def all(self) -> Scale:
        bench = self.bench
        self.prepare()
        app = bench.start_upstream("app")
        self.scale.facts["uvloop"] = "uvloop" in app.tail()
        empty = start_proxy(bench, "proxy-empty", app, table=EMPTY, pool=POOL)
        full = start_proxy(bench, "proxy-full", app, table=FULL, pool=POOL)
        self.warm(empty, app)
        self.warm(full, app)
        self.flat(app, empty, full)
        bench.stop(empty.service)
        self.sweeps(app, full)
        bench.stop(full.service)
        bench.stop(app)
        self.pools()
        return self.scale


# -- the report --------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def _cpu(result: loads.Result) -> tuple[float, float]:
    return result.cpu_us("proxy"), result.cpu_us("postgres")


def flat_table(scale: Scale, rows: int) -> str:
    lines = [
        f"| round | order | webhooks/s empty | full ({rows:,} rows) | full ÷ empty | proxy CPU "
        "µs/webhook empty | full | ÷ | PostgreSQL CPU µs/webhook empty | full | ÷ | "
        "proxy + PostgreSQL ÷ | other programs (cores) empty, full |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: list[tuple[float, float, float, float]] = []
    for round_, order in scale.flat_order.items():
        empty, full = scale.flat[(round_, "empty", 32)], scale.flat[(round_, "full", 32)]
        (pe, ge), (pf, gf) = _cpu(empty), _cpu(full)
        r = (full.rate / empty.rate, pf / pe, gf / ge, (pf + gf) / (pe + ge))
        ratios.append(r)
        lines.append(
            f"| {round_} | {order} | {empty.rate:,.0f} | {full.rate:,.0f} | {r[0]:.2f} | "
            f"{pe:.0f} | {pf:.0f} | {r[1]:.2f} | {ge:.0f} | {gf:.0f} | {r[2]:.2f} | {r[3]:.2f} | "
            f"{empty.window.others:.2f}, {full.window.others:.2f} |"
        )
    means = [_mean([r[i] for r in ratios]) for i in range(4)]
    medians = [statistics.median([r[i] for r in ratios]) for i in range(4)]
    lines += [
        f"| mean | | | | **{means[0]:.2f}** | | | **{means[1]:.2f}** | | | **{means[2]:.2f}** | "
        f"**{means[3]:.2f}** | |",
        f"| median | | | | {medians[0]:.2f} | | | {medians[1]:.2f} | | | {medians[2]:.2f} | "
        f"{medians[3]:.2f} | |",
    ]
    limit = 1 / TARGET
    lines += [
        "",
        f"- Throughput full ÷ empty {means[0]:.2f} (target ≥ {TARGET}): "
        f"{_verdict(means[0] >= TARGET)}",
        f"- Proxy CPU per webhook full ÷ empty {means[1]:.2f} (target ≤ {limit:.2f}): "
        f"{_verdict(means[1] <= limit)}",
        f"- PostgreSQL CPU per webhook full ÷ empty {means[2]:.2f} (target ≤ {limit:.2f}): "
        f"{_verdict(means[2] <= limit)}; both together {means[3]:.2f}: "
        f"{_verdict(means[3] <= limit)}",
        "",
        "| round | c1 empty p50 / p99 ms | c1 full p50 / p99 ms | p50 full ÷ empty | "
        "p99 full ÷ empty |",
        "|---|---|---|---|---|",
    ]
    for round_ in scale.flat_order:
        empty, full = scale.flat[(round_, "empty", 1)], scale.flat[(round_, "full", 1)]
        lines.append(
            f"| {round_} | {empty.p50_ms:.2f} / {empty.p99_ms:.2f} | {full.p50_ms:.2f} / "
            f"{full.p99_ms:.2f} | {full.p50_ms / empty.p50_ms:.2f} | "
            f"{full.p99_ms / empty.p99_ms:.2f} |"
        )
    return "\n".join(lines)


def sweep_table(scale: Scale) -> str:
    lines = [
        "| round | first | no sweep p50 / p99 ms | sweeping p50 / p99 ms | p99 sweep ÷ none | "
        "p50 ÷ | webhooks/s none / sweeping | proxy CPU µs none / sweeping | rows deleted "
        "during the run | deleted while the sweeper ran (COUNT) | sweeping at the end | "
        "VACUUM after | other programs (cores) none, sweeping |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for round_, sweep in scale.sweeps.items():
        none, busy = scale.sweep[(round_, False)], scale.sweep[(round_, True)]
        ratio = busy.p99_ms / none.p99_ms
        ratios.append((ratio, busy.p50_ms / none.p50_ms))
        state = "yes" if sweep.running_after and not sweep.finished else "**no: it finished**"
        seconds = busy.requests / max(busy.rate, 1e-9)
        lines.append(
            f"| {round_} | {'no sweep' if round_ % 2 else 'sweep'} | {none.p50_ms:.2f} / "
            f"{none.p99_ms:.2f} | {busy.p50_ms:.2f} / {busy.p99_ms:.2f} | {ratio:.2f} | "
            f"{ratios[-1][1]:.2f} | {none.rate:,.0f} / {busy.rate:,.0f} | "
            f"{none.cpu_us('proxy'):.0f} / {busy.cpu_us('proxy'):.0f} | {sweep.during:,} "
            f"({sweep.during / seconds:,.0f}/s) | {sweep.lifetime:,} in {sweep.seconds:.0f} s | "
            f"{state}{f', {sweep.failed} failed rounds' if sweep.failed else ''} | "
            f"{sweep.vacuum_seconds:.0f} s | {none.window.others:.2f}, {busy.window.others:.2f} |"
        )
    lines += [
        f"| mean | | | | **{_mean([r[0] for r in ratios]):.2f}** | "
        f"{_mean([r[1] for r in ratios]):.2f} | | | | | | | |",
        f"| median | | | | {statistics.median([r[0] for r in ratios]):.2f} | "
        f"{statistics.median([r[1] for r in ratios]):.2f} | | | | | | | |",
    ]
    return "\n".join(lines)


def pool_table(scale: Scale) -> str:
    lines = [
        "| round | pool_size | expected pool ÷ 0.2 s | 2xx/s | measured ÷ expected | p50 ms | "
        "p99 ms | non-2xx / errors (wrk) | the proxy's answers (its log) | connections not "
        "idle, peak | connections, total | samples |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_pool: dict[int, list[float]] = {}
    for (round_, pool), run in scale.pools.items():
        result, sampled = run.result, run.connections
        answers = ", ".join(f"{status}: {n:,}" for status, n in sorted(run.answers.items()))
        expected = pool / SLOW_DELAY
        rate = _ok_rate(result)
        by_pool.setdefault(pool, []).append(rate)
        lines.append(
            f"| {round_} | {pool} | {expected:,.0f}/s | {rate:,.0f} | {rate / expected:.2f} | "
            f"{result.p50_ms:.1f} | {result.p99_ms:.1f} | {result.errors:,} | {answers} | "
            f"{sampled.busy} | {sampled.total} | {sampled.samples} |"
        )
    for pool, rates in sorted(by_pool.items()):
        mean = _mean(rates)
        lines.append(
            f"| mean | {pool} | {pool / SLOW_DELAY:,.0f}/s | **{mean:,.0f}** | "
            f"**{mean * SLOW_DELAY / pool:.2f}** | | | | | | | |"
        )
    return "\n".join(lines)


def _ok_rate(result: loads.Result) -> float:
    """Answers that were not errors, per second of the run."""
    seconds = result.requests / result.rate if result.rate else 1.0
    return max(0, result.requests - result.errors) / seconds


def runs_table(scale: Scale) -> str:
    lines = [
        "| run | sent | answered | rate/s | p50 ms | p99 ms | non-2xx / errors | app calls, "
        "distinct, repeated, seeds | checked | CPU µs/webhook: proxy, app, PostgreSQL, wrk | "
        "other programs (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in scale.runs:
        r, u = run.result, run.result.upstream
        cpu = ", ".join(f"{r.cpu_us(name):.0f}" for name in ("proxy", "upstream", "postgres"))
        check = "exact" if run.exact and run.item != "3" else "none repeated" if run.exact else (
            "**WRONG**")  # fmt: skip
        lines.append(
            f"| {r.label} | {r.sent:,} | {r.requests:,} | {r.rate:,.0f} | {r.p50_ms:.2f} | "
            f"{r.p99_ms:.2f} | {r.errors:,} | {u.get('calls', 0):,}, {u.get('distinct', 0):,}, "
            f"{u.get('repeated', 0)}, {u.get('seeded', 0)} | {check} | {cpu}, "
            f"{r.window.loadgen * 1e6 / max(r.sent, 1):.0f} | {r.window.others:.2f} |"
        )
    return "\n".join(lines)


def document(scale: Scale, machine: dict[str, str], command: str, settings: Settings, *,
             rows: int, elapsed: float) -> str:  # fmt: skip
    facts = scale.facts
    noise = [run.result.window.others for run in scale.runs]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    insert, vacuum = facts["fill"]
    quick = (
        "\n**Quick mode: checks the harness; the figures mean nothing.**\n" if settings.quick
        else ""
    )  # fmt: skip
    return f"""# Scale: a full claim table, the retention sweep, open claims
{quick}
- Date: {now}; the run took {elapsed / 60:.1f} min
- Command: `{command}` (from the repository root, with the project's venv)
- Machine: {machine["nproc"]} CPUs (`nproc`), {machine["memory"]} memory, {machine["cpu"]}, \
{machine["kernel"]}
- Software: Python {machine["python"]}, {machine["packages"]}, PostgreSQL \
{facts["postgres"]} (embedded, unix socket; {facts["pg_settings"]}), {machine["wrk"]}; \
app loop: {"uvloop" if facts.get("uvloop") else "asyncio"}
- Each load run: {settings.seconds} s, wrk `-t1 -c1`, `-t2 -c32` or `-t2 -c{WIDE}`, \
`--latency`, 1 KiB JSON bodies with unique IDs (`bench/unique_ids.lua`); \
{settings.warmup} s warm-up per proxy; {settings.rounds} rounds. Every proxy: one worker, \
logging one JSON line per webhook (the default level).
- Full table: {rows:,} rows, {facts["table_size"]} with its indexes; one INSERT … SELECT in \
{insert:.0f} s, VACUUM ANALYZE + CHECKPOINT in {vacuum:.0f} s; {facts["due"]:,} of its rows \
older than the sweeping route's retention ({RETENTION}).
- Noise: load average {machine["load_before"]} before, {machine["load_after"]} after; other \
programs used {_mean(noise):.2f} cores on average during the load runs (at most \
{max(noise, default=0):.2f}). PostgreSQL, the app, the proxy and wrk share the \
{machine["nproc"]} CPUs.

## 1. Flat as the claim table grows

Two proxies (pool {POOL}) on two tables: `{EMPTY}` ({SEEDS:,} seed rows, plus what the runs
add) and `{FULL}`. c32, then c1, against each, the order swapped every round. CPU per webhook
is the proxy's process, and PostgreSQL's postmaster with all its backends, over the run,
divided by the webhooks sent.

{flat_table(scale, rows)}

## 2. The retention sweep's cost on latency

c32 on the full table: against the proxy of item 1 (retention 30 days: nothing is due), and
against a proxy started for the run on the same table whose route keeps claims {RETENTION}
(`sweeper.interval: 1s`, `batch` the default), so that its own sweeper deletes the rows older
than that, in batches, while it serves the load; the load starts once its first batch is gone.
"Rows deleted during the run" is its `dedup_retention_deleted_rows_total` over the wrk run;
the COUNT is of the fill's rows before its start and after its stop. After each sweep run a
plain `VACUUM` (what autovacuum would do next), outside the measurements.

{sweep_table(scale)}

## 3. Open claims are the scale limit (Little's law)

The app answers after {SLOW_DELAY * 1000:.0f} ms; a claim's transaction stays open that long,
so one worker with `pool_size` P completes at most P ÷ 0.2 s webhooks per second. wrk
`-t2 -c{WIDE}` (the default `max_connections` is 1,000), one proxy per pool started for its
run, the order rotated every round. A webhook that finds no free connection within
`database.pool_timeout` (5 s) is answered 503; "2xx/s" leaves out those and any error.
Connections: the proxy's rows in `pg_stat_activity` (application_name `dedup-proxy`),
sampled every {SAMPLE_EVERY * 1000:.0f} ms; "not idle" are those in a transaction. The proxy's
answers are counted from its log (one line per webhook) between the warm-up and its stop, so
they include the webhooks still in flight when wrk stopped, which wrk does not count.

{pool_table(scale)}

## Every run

"Exact": the app got one call per unique ID sent, each distinct, none of the committed seeds.
Item 3 (503s expected): none repeated, no more calls than IDs sent.

{runs_table(scale)}
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    quick = "100k rows, 1 s runs, no warm-up: checks the harness only"
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--rows", type=int, help="rows in the full table (10M; --quick: 100k)")
    parser.add_argument("--duration", type=int, help="seconds per load run (10; --quick: 1)")
    parser.add_argument("--rounds", type=int, help="rounds of each item (4; --quick: 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "SCALE.md",
                        help="write the report here (bench/SCALE.md)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    loads.wrk_path()  # fail before starting anything
    rows = args.rows if args.rows is not None else (100_000 if args.quick else 10_000_000)
    rounds = args.rounds or (2 if args.quick else 4)
    settings = Settings(
        quick=args.quick, seconds=args.duration or (1 if args.quick else 10), pool=POOL,
        rows=rows, copies=0, slow_pools=SLOW_POOLS, compare_loops=False,
        warmup=0 if args.quick else 2, profile=None, keep=False, rounds=max(1, rounds),
    )  # fmt: skip
    command = shlex.join(["python", "bench/scale.py", *(sys.argv[1:] if argv is None else argv)])
    workdir = Path(tempfile.mkdtemp(prefix="dedup-scale-"))
    bench = Bench(settings, workdir)
    machine = report.machine()
    try:
        scale = Measure(bench, rows).all()
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    machine["load_after"] = report.loadavg()
    elapsed = time.monotonic() - bench.started
    text = document(scale, machine, command, settings, rows=rows, elapsed=elapsed)
    print(text)
    args.out.write_text(text, encoding="utf-8")
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
