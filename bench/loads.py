"""The load generators: wrk against HTTP, pgbench against PostgreSQL, and a duplicate storm.

Each returns a ``Result`` with its throughput, latency percentiles, and the CPU every watched
process spent meanwhile (``procs.Window``). Every run is bounded in time.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from bench import procs

BENCH = Path(__file__).resolve().parent
WRK_SCRIPT = BENCH / "unique_ids.lua"
CLAIM_SQL = BENCH / "claim.sql"
WRK_MISSING = "wrk is not installed: apt-get install wrk (Debian/Ubuntu)"


@dataclass
class Result:
    """One bounded load run."""

    label: str
    requests: int  # answered within the run
    sent: int  # written to the server, which finishes them even if wrk leaves before the answer
    uniques: int  # of ``sent``, the ones with a new event ID
    rate: float  # answered per second
    p50_ms: float
    p99_ms: float
    errors: int  # socket errors, timeouts and non-2xx answers
    window: procs.Window
    upstream: dict[str, int] = field(default_factory=dict)  # counters seen by the upstream
    body_bytes: int = 0
    through_proxy: bool = False

    def cpu_us(self, name: str, per: int | None = None) -> float:
        """CPU microseconds ``name`` spent per request (per ``sent`` unless ``per``)."""
        count = per if per is not None else self.sent
        return self.window.cpu.get(name, 0.0) * 1e6 / max(count, 1)


class Upstream:
    """The counters of a running bench/upstream.py."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def _call(self, path: str, method: str = "GET") -> bytes:
        request = urllib.request.Request(self.url + path, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            body: bytes = response.read()
        return body

    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = json.loads(self._call("/__stats"))
        return stats

    def reset(self) -> None:
        self._call("/__reset", "POST")

    def settle(self, expected: int, within: float = 10.0) -> dict[str, int]:
        """The counters once ``expected`` calls arrived (or ``within`` passed), and a little
        later, so that any extra call (a duplicate let through) is counted too."""
        deadline = time.monotonic() + within
        while self.stats()["calls"] < expected and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        return self.stats()


def wrk_path() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise SystemExit(WRK_MISSING)
    return path


def wrk(
    label: str,
    url: str,
    *,
    connections: int,
    seconds: int,
    probes: dict[str, Callable[[], float]],
    upstream: Upstream,
    run_id: str,
    mode: str = "unique",
    body_bytes: int = 1024,
    seeds: int = 0,
    through_proxy: bool = True,
    stripe_secret: str = "",
) -> Result:
    """wrk --latency with bench/unique_ids.lua; the upstream's counters are reset first.

    Through the proxy the upstream should see each unique request once; straight at the
    upstream, every request sent.
    """
    threads = 1 if connections == 1 else 2
    argv = [
        wrk_path(), f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency",
        "--timeout", "10s", "-s", str(WRK_SCRIPT), url,
        "--", run_id, mode, str(body_bytes), str(seeds),
    ]  # fmt: skip
    signatures = None
    if mode == "stripe":
        signatures = tempfile.TemporaryDirectory(prefix="dedup-bench-signatures-")
        prefix = str(Path(signatures.name) / "sig")
        sign_stripe(prefix, stripe_secret, run_id, threads, body_bytes, count=SIGNED * seconds)
        argv.append(prefix)
    upstream.reset()
    window = procs.Window(probes)
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=seconds + 60, check=False
        )
    finally:
        if signatures is not None:
            signatures.cleanup()
    line = next((x for x in done.stdout.splitlines() if x.startswith("BENCH-JSON ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stdout}{done.stderr}")
    report: dict[str, Any] = json.loads(line.removeprefix("BENCH-JSON "))
    # The server finishes what wrk sent before it stopped: wait for it, then read the CPU.
    counters = upstream.settle(report["uniques"] if through_proxy else report["sent"])
    window.close()
    latency = report["latency_us"]
    return Result(
        label=label,
        requests=report["requests"],
        sent=report["sent"],
        uniques=report["uniques"],
        rate=report["requests"] * 1e6 / max(report["duration_us"], 1),
        p50_ms=latency["p50"] / 1000,
        p99_ms=latency["p99"] / 1000,
        errors=sum(report["errors"].values()),
        window=window,
        upstream=counters,
        body_bytes=body_bytes,
        through_proxy=through_proxy,
    )


SIGNED = 3000  # signatures per thread and second of a "stripe" run: above any rate here


def sign_stripe(
    prefix: str, secret: str, run_id: str, threads: int, body_bytes: int, *, count: int
) -> None:
    """The Stripe-Signature of each request bench/unique_ids.lua's "stripe" mode builds, one
    file per thread (``prefix.THREAD``), line N for its request N, signed now."""
    stamp = str(int(time.time()))
    key = secret.encode()
    for tid in range(1, threads + 1):
        id_length = 8 + 1 + len(run_id) + 1 + len(str(tid)) + 1 + 10
        pad = "x" * max(0, body_bytes - 22 - id_length)
        lines = []
        for n in range(1, count + 1):
            event_id = f"{(n * 2654435761) % 2147483648:08x}-{run_id}-{tid}-{n:010d}"
            body = f'{{"id":"{event_id}","pad":"{pad}"}}'
            mac = hmac.new(key, f"{stamp}.{body}".encode(), hashlib.sha256).hexdigest()
            lines.append(f"t={stamp},v1={mac}\n")
        Path(f"{prefix}.{tid}").write_text("".join(lines), encoding="ascii")


def pgbench(
    label: str,
    pgbench_bin: Path,
    dsn: str,
    *,
    clients: int,
    seconds: int,
    protocol: str,
    probes: dict[str, Callable[[], float]],
    log_dir: Path,
    settle: Callable[[], None] = lambda: None,
) -> Result:
    """pgbench with bench/claim.sql; latencies from its per-transaction log (-l).

    ``settle`` returns once pgbench's server processes are gone: until the postmaster has
    reaped one, its CPU time shows nowhere in /proc.
    """
    prefix = log_dir / ("pgbench-" + re.sub(r"\W+", "_", label))
    argv = [
        str(pgbench_bin), "-n", "-M", protocol, "-c", str(clients), "-j", str(min(clients, 2)),
        "-T", str(seconds), "-f", str(CLAIM_SQL), "-l", f"--log-prefix={prefix}", dsn,
    ]  # fmt: skip
    window = procs.Window(probes)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, check=False)
    settle()
    window.close()
    tps = re.search(r"^tps = ([\d.]+)", done.stdout, re.MULTILINE)
    if done.returncode != 0 or tps is None:
        raise RuntimeError(f"pgbench failed ({done.returncode}): {done.stdout}{done.stderr}")
    latencies: list[float] = []
    for log in log_dir.glob(f"{prefix.name}.*"):
        latencies += [int(line.split()[2]) / 1000 for line in log.read_text().splitlines()]
        log.unlink()
    failed = re.search(r"number of failed transactions: (\d+)", done.stdout)
    return Result(
        label=label,
        requests=len(latencies),
        sent=len(latencies),
        uniques=len(latencies),
        rate=float(tps[1]),
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        errors=int(failed[1]) if failed else 0,
        window=window,
    )


def percentile(values: list[float], pct: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=1000, method="inclusive")[round(pct * 10) - 1]


@dataclass
class StormResult:
    copies: int
    statuses: dict[str, int]  # "processed", "duplicate", "503", "error: …": how many
    upstream_calls: int
    peak_db: int  # proxy connections not idle, at most, during the storm
    polls: int
    sent_ms: float  # first copy sent → last copy written to its socket (the client's own pace)
    all_answered_ms: float  # first copy sent → last answer
    owner_ms: float  # first copy sent → the owner's answer (right after its COMMIT)
    after_commit_ms: float  # the owner's answer → the last answer
    listen_overflows: int  # SYNs dropped by a full listen queue (mostly while connecting)


class _ConnectionPeak(threading.Thread):
    """Polls pg_stat_activity as fast as it can, on its own event loop and connection."""

    QUERY = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = 'dedup-proxy' AND state <> 'idle'"
    )

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.peak = 0
        self.polls = 0

    def run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        connection = await asyncpg.connect(self.dsn, server_settings={"application_name": "bench"})
        try:
            self.ready.set()
            while not self.stopping.is_set():
                self.peak = max(self.peak, await connection.fetchval(self.QUERY))
                self.polls += 1
        finally:
            await connection.close()


def storm(url: str, dsn: str, upstream: Upstream, *, copies: int, event_id: str) -> StormResult:
    """``copies`` concurrent POSTs of one event, each on its own connection.

    The connections are opened (and used once, for a pass-through GET) beforehand, so that
    what is timed is the proxy answering the copies, not a thousand TCP handshakes.
    """
    upstream.reset()
    poller = _ConnectionPeak(dsn)
    poller.start()
    if not poller.ready.wait(10):
        raise RuntimeError("cannot poll pg_stat_activity")
    overflows = procs.listen_overflows()
    try:
        body = json.dumps({"id": event_id, "pad": "x" * 1000}, separators=(",", ":")).encode()
        fired = asyncio.run(_fire(url, body, copies))
    finally:
        poller.stopping.set()
        poller.join(10)
    statuses = collections.Counter(outcome for outcome, _ in fired.answers).most_common()
    last = max(at for _, at in fired.answers)
    owner = min(
        (at for outcome, at in fired.answers if outcome == "processed"), default=float("nan")
    )
    return StormResult(
        copies=copies,
        statuses=dict(statuses),
        upstream_calls=upstream.settle(1)["calls"],
        peak_db=poller.peak,
        polls=poller.polls,
        sent_ms=(fired.last_sent - fired.started) * 1000,
        all_answered_ms=(last - fired.started) * 1000,
        owner_ms=(owner - fired.started) * 1000,
        after_commit_ms=(last - owner) * 1000,
        listen_overflows=procs.listen_overflows() - overflows,
    )


@dataclass
class _Fired:
    started: float
    last_sent: float  # the last copy's body written to its socket
    answers: list[tuple[str, float]]  # (outcome, when answered)


async def _fire(url: str, body: bytes, copies: int) -> _Fired:
    sent: list[float] = []

    async def on_sent(*_: object) -> None:
        sent.append(time.monotonic())

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_sent)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trace_configs=[trace]
    ) as session:

        async def warm() -> None:
            # Not a webhook route: passed through to the upstream's uncounted /__stats.
            async with session.get(url.rsplit("/", 1)[0] + "/__stats") as response:
                await response.read()

        async def one() -> tuple[str, float]:
            try:
                async with session.post(url, data=body) as response:
                    await response.read()
                    if response.status == 200:
                        outcome = response.headers.get("Dedup-Status", "processed")
                    else:
                        outcome = str(response.status)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                outcome = f"error: {type(exc).__name__}"
            return outcome, time.monotonic()

        await asyncio.gather(*(warm() for _ in range(copies)))
        sent.clear()
        started = time.monotonic()
        answers = await asyncio.gather(*(one() for _ in range(copies)))
    return _Fired(started, max(sent, default=started), list(answers))
