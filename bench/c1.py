"""Where one webhook's time goes at one connection: the proxy's phases beside what each costs alone.

    python bench/c1.py [--requests N] [--rounds R] [--workers W] [--profile FILE]

Starts an embedded PostgreSQL, the bench app (bench/upstream.py) and the proxy through its CLI
(one JSON log line per webhook), then sends ``N`` webhooks one after the other on one
kept-alive connection from a blocking socket in this process, timing each; and measures, the
same way, what each hop costs on its own:

- ``hop``: a 1-byte TCP echo to another process: the floor of any round trip between two
  processes on this machine (two wake-ups, no work);
- ``app alone``: the same webhooks straight to the app;
- ``claim SQL`` and ``COMMIT``: the proxy's own claim statement and COMMIT
  (``database.Store``), from this process;
- PostgreSQL's own time for the proxy's statements (``pg_stat_statements``, loaded at start);
- the proxy's log lines: ``claim_ms``, ``upstream_ms``, ``commit_ms``, ``total_ms``.

Each series is run in ``--rounds`` alternating rounds, and medians are reported, with the CPU
each process spent per webhook (the proxy's user and system time apart): at one connection
nothing overlaps, so the latency is close to the sum of the CPU every process spends in turn.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop

from bench import procs
from bench.run import TABLE, Bench, Settings, py_spy
from proxy import config, database

_ECHO = """
import socket, sys
listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
connection, _ = listener.accept()
connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := connection.recv(64):
    connection.sendall(data)
"""


class Client:
    """One kept-alive HTTP/1.1 connection, blocking: as little client-side work as can be."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port = port

    def post(self, body: bytes) -> tuple[float, bytes]:
        """Milliseconds from the first byte written to the last byte of the answer read."""
        request = (
            b"POST /hook HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        started = time.perf_counter()
        self.sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += self.sock.recv(65536)
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += self.sock.recv(65536)
        took = (time.perf_counter() - started) * 1000
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"answer {head[:40]!r}")
        return took, rest

    def close(self) -> None:
        self.sock.close()


def body(run: str, n: int) -> bytes:
    text = json.dumps({"id": f"{uuid.uuid4().hex[:8]}-{run}-{n}", "pad": "x" * 960})
    return text.encode()


def echo_series(port: int, count: int) -> list[float]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(count):
        started = time.perf_counter()
        sock.sendall(b"x")
        sock.recv(64)
        times.append((time.perf_counter() - started) * 1000)
    sock.close()
    return times


async def claim_series(dsn: str, count: int, run: str) -> tuple[list[float], list[float], float]:
    """The proxy's claim statement and COMMIT, through its own store, one after the other."""
    settings = config.DatabaseConfig(dsn=None, table=TABLE, pool_size=1)
    store = await database.Store.open(dsn, settings, claim_wait=10, upstream_timeout=30)
    claimed, committed = [], []
    cpu = time.process_time()
    try:
        for n in range(count):
            key = database.Key("c1-sql", f"{uuid.uuid4().hex[:8]}-{run}-{n}", None, b"\0" * 32)
            started = time.perf_counter()
            async with store.claim(key) as claim:
                middle = time.perf_counter()
                await claim.commit()
                ended = time.perf_counter()
            claimed.append((middle - started) * 1000)
            committed.append((ended - middle) * 1000)
        cpu = time.process_time() - cpu
    finally:
        await store.close()
    return claimed, committed, cpu * 1e6 / count


def user_system(service: procs.Service) -> tuple[float, float]:
    """The user and system CPU seconds of a service and its workers, summed."""
    pairs = [procs.user_system_seconds(pid) for pid in service.pids()]
    return sum(user for user, _ in pairs), sum(system for _, system in pairs)


def profile(out: Path, pid: int) -> subprocess.Popen[bytes]:
    """py-spy recording ``pid`` (Python on a CPU only: ``--gil``) until interrupted."""
    argv = py_spy(out, pid, "-r", "1000")
    recorder = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)  # attached
    return recorder


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def log_phases(path: Path, since: int) -> dict[str, list[float]]:
    """The phase fields of the proxy's log lines written after byte ``since``."""
    phases: dict[str, list[float]] = {"claim_ms": [], "upstream_ms": [], "commit_ms": [],
                                      "total_ms": []}  # fmt: skip
    with path.open("rb") as log:
        log.seek(since)
        for line in log:
            if not line.startswith(b"{"):
                continue
            entry: dict[str, Any] = json.loads(line)
            if entry.get("outcome") != "processed":
                continue
            for name, values in phases.items():
                values.append(float(entry[name]))
    return phases


# PostgreSQL's own time per statement of the proxy's (planning included), by the start of its
# text: pg_stat_statements keeps one entry per statement of a multi-statement query.
# (COMMIT's entry is left out: the WAL flush happens after the statement's timing ends.)
_STATEMENTS = (("BEGIN", "BEGIN%"), ("each SET LOCAL", "SET LOCAL%"),
               ("the claim's INSERT", "INSERT%"))  # fmt: skip


def prepare_database(bench: Bench) -> None:
    """The embedded PostgreSQL with pg_stat_statements loaded, and the claim table."""
    bench.start_database(**{"shared_preload_libraries": "pg_stat_statements",
                            "pg_stat_statements.track_planning": "on"})  # fmt: skip
    bench.sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    bench.sql(database.schema_sql(TABLE))


def server_times(bench: Bench) -> dict[str, float]:
    """Mean milliseconds PostgreSQL spent planning and running each of the proxy's statements
    since the last reset (the proxy's sessions only: application_name is not kept, so the
    reset comes right before the proxy's series and the reading right after)."""
    found = {}
    for name, pattern in _STATEMENTS:
        mean = bench.value(
            "SELECT sum(total_exec_time + total_plan_time) / nullif(sum(calls), 0) "
            "FROM pg_stat_statements WHERE query LIKE $1",
            pattern,
        )
        found[name] = float(mean or 0.0)
    return found


def measure(args: argparse.Namespace, bench: Bench, stack: ExitStack) -> dict[str, Any]:
    prepare_database(bench)
    app = bench.start_upstream("upstream")
    proxy = bench.start_proxy("proxy", app, 4, workers=args.workers)
    echo_port = procs.free_port()
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, str(echo_port)])
    stack.callback(echo.wait)  # callbacks run last in, first out: killed, then waited for
    stack.callback(echo.kill)
    time.sleep(0.5)
    series: dict[str, list[float]] = {}
    cpu: dict[str, float] = {"proxy": 0.0, "app": 0.0, "postgres": 0.0}
    phases: dict[str, list[float]] = {}
    hop = echo_series(echo_port, args.requests)  # one connection: the echo serves only one
    through_app, through_proxy = Client(app.port), Client(proxy.port)
    for n in range(args.rounds):
        run = f"{bench.run_id()}"
        for i in range(50):  # warm both paths
            through_app.post(body(run + "w", i))
            through_proxy.post(body(run + "v", i))
        series.setdefault("app alone", []).extend(
            through_app.post(body(run + "a", i))[0] for i in range(args.requests)
        )
        since = proxy.log_path.stat().st_size
        recorder = profile(args.profile, proxy.pid) if args.profile and n == 0 else None
        before = {"proxy": proxy.cpu(), "app": app.cpu(), "postgres": bench.postgres_cpu()}
        split = user_system(proxy)
        bench.sql("SELECT pg_stat_statements_reset()")
        series.setdefault("through the proxy", []).extend(
            through_proxy.post(body(run + "p", i))[0] for i in range(args.requests)
        )
        for name, mean in server_times(bench).items():
            series.setdefault(f"PostgreSQL: {name}", []).append(mean)
        time.sleep(0.3)  # the last log lines
        if recorder is not None:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(30)
        for name, probe in (("proxy", proxy.cpu), ("app", app.cpu),
                            ("postgres", bench.postgres_cpu)):  # fmt: skip
            cpu[name] += probe() - before[name]
        user, system = user_system(proxy)
        cpu["proxy: user"] = cpu.get("proxy: user", 0.0) + user - split[0]
        cpu["proxy: system"] = cpu.get("proxy: system", 0.0) + system - split[1]
        for name, values in log_phases(proxy.log_path, since).items():
            phases.setdefault(name, []).extend(values)
        claimed, committed, store_cpu = uvloop.run(claim_series(bench.dsn, args.requests, run))
        cpu["claim + COMMIT through the claim store (this process)"] = cpu.get(
            "claim + COMMIT through the claim store (this process)", 0.0
        ) + (store_cpu * args.requests / 1e6)
        series.setdefault("claim SQL", []).extend(claimed)
        series.setdefault("COMMIT", []).extend(committed)
        print(f"round {n + 1} of {args.rounds} done", file=sys.stderr, flush=True)
    through_app.close()
    through_proxy.close()
    series["hop"] = hop
    pgbench = bench.pgbench("", "pgbench prepared c1", 1, "prepared")
    requests = args.requests * args.rounds
    return {
        "medians": {name: median(values) for name, values in series.items()},
        "phases": {name: median(values) for name, values in phases.items()},
        "cpu_us": {name: seconds * 1e6 / requests for name, seconds in cpu.items()},
        "pgbench_p50": pgbench.p50_ms,
        "workers": args.workers,
        "requests": requests,
    }


def report(found: dict[str, Any]) -> str:
    m, p = found["medians"], found["phases"]
    added = m["through the proxy"] - m["app alone"]
    own = p["total_ms"] - p["claim_ms"] - p["upstream_ms"] - p["commit_ms"]
    outside = m["through the proxy"] - p["total_ms"]
    lines = [
        f"{found['requests']} sequential webhooks per series, medians, "
        f"{found['workers']} worker(s):",
        "",
        "| measured | ms |",
        "|---|---|",
        f"| a TCP round trip between two processes (1-byte echo) | {m['hop']:.3f} |",
        f"| app alone (client → app → client) | {m['app alone']:.3f} |",
        f"| through the proxy | {m['through the proxy']:.3f} |",
        f"| added by the proxy | {added:.3f} |",
        f"| pgbench prepared c1 (BEGIN, INSERT, COMMIT: 3 round trips) | "
        f"{found['pgbench_p50']:.3f} |",
        f"| the issue's figure: added minus pgbench | {added - found['pgbench_p50']:+.3f} |",
        f"| the proxy's claim SQL alone (1 round trip) | {m['claim SQL']:.3f} |",
        f"| the proxy's COMMIT alone (1 round trip, WAL flush) | {m['COMMIT']:.3f} |",
        "| **inside PostgreSQL (pg_stat_statements, the proxy's statements, planning "
        "included)** | |",
        *(f"| {name} | {m[f'PostgreSQL: {name}']:.3f} |" for name, _ in _STATEMENTS),
        "| **inside the proxy (its log line)** | |",
        f"| claim_ms | {p['claim_ms']:.3f} |",
        f"| upstream_ms (the app's answer; the app alone takes {m['app alone']:.3f}) | "
        f"{p['upstream_ms']:.3f} |",
        f"| commit_ms | {p['commit_ms']:.3f} |",
        f"| the rest of total_ms (read, verify, key, answer, log) | {own:.3f} |",
        f"| total_ms | {p['total_ms']:.3f} |",
        f"| outside total_ms (the client's hop, aiohttp's parse and write) | {outside:.3f} |",
        "| **CPU per webhook** | µs |",
        *(f"| {name} | {us:.0f} |" for name, us in found["cpu_us"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="per series and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--profile", type=Path, help="py-spy record the proxy's first round")
    args = parser.parse_args(argv)
    settings = Settings(seconds=5, pool=4, warmup=0)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-c1-"))
    bench = Bench(settings, workdir)
    with ExitStack() as stack:
        stack.callback(bench.close)
        found = measure(args, bench, stack)
    print(report(found))
    if args.json is not None:
        args.json.write_text(json.dumps(found, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
