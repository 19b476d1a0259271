"""The benchmark's one table, its targets, and RESULTS.md around them.

Everything here is derived from ``Figures``; nothing is measured. Each target from the
performance issue is reported as met or not met, beside the figure it was judged on.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import loads

MB = 1_000_000


@dataclass
class Figures:
    """Everything measured, by name."""

    runs: dict[str, loads.Result] = field(default_factory=dict)
    storms: dict[str, loads.StormResult] = field(default_factory=dict)
    rss: dict[str, dict[int, int]] = field(default_factory=dict)  # label → {pid: VmHWM bytes}
    facts: dict[str, Any] = field(default_factory=dict)
    profile: list[str] = field(default_factory=list)
    storm_floor: loads.StormResult | None = None  # the storm sent to the upstream alone
    worker_rss: dict[int, int] = field(default_factory=dict)  # headline proxy's workers: VmHWM


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    measured: str
    limit: str
    ok: bool


def _lat(result: loads.Result) -> str:
    return f"p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.2f} ms"


def _rate(result: loads.Result, unit: str = "req/s") -> str:
    errors = f", **{result.errors} errors**" if result.errors else ""
    return f"{result.rate:,.0f} {unit} ({_lat(result)}{errors})"


def _growth(a: loads.Result, b: loads.Result) -> str:
    return f"p50 {a.p50_ms:.2f} → {b.p50_ms:.2f} ms; p99 {a.p99_ms:.2f} → {b.p99_ms:.2f} ms"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**NOT met**"


def exact(result: loads.Result) -> tuple[bool, str]:
    """Did the upstream get exactly one call per unique request, and no duplicate?"""
    u = result.upstream
    ok = (
        u.get("calls") == result.uniques
        and u.get("distinct") == u.get("calls")
        and u.get("repeated") == 0
        and u.get("seeded") == 0
    )
    text = (
        f"{u.get('calls', 0):,} upstream calls for {result.uniques:,} unique IDs sent, "
        f"{u.get('repeated', 0)} repeated, {u.get('seeded', 0)} already-committed IDs forwarded"
    )
    return ok, text


def proxy_runs(f: Figures) -> list[loads.Result]:
    return [r for r in f.runs.values() if r.through_proxy]


@dataclass(frozen=True, slots=True)
class Headline:
    """One figure of the performance issue's table, per round."""

    name: str
    values: list[float]
    unit: str
    limit: float
    higher_is_better: bool

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def ok(self) -> bool:
        return self.mean >= self.limit if self.higher_is_better else self.mean <= self.limit

    def show(self, value: float) -> str:
        if self.unit == "ms":
            return f"{value:+.2f} ms"
        if self.unit == "MB":
            return f"{value:.0f} MB"
        return f"{value:.2f} x"

    @property
    def target(self) -> str:
        return ("≥ " if self.higher_is_better else "≤ ") + self.show(self.limit).lstrip("+")


def rounds(f: Figures) -> list[int]:
    return [n for n in range(1, 10) if f"h{n}_proxy_c32" in f.runs]


def _cpu_per(run: loads.Result) -> float:
    return run.cpu_us("proxy")


def cpu_ratio(run: loads.Result) -> float:
    """The proxy's CPU per request ÷ the app's per call, in one run."""
    app = run.cpu_us("upstream", per=run.upstream.get("calls", 0))
    return run.cpu_us("proxy") / max(app, 1e-9)


def c1_gap(f: Figures, proxy: str, n: int) -> float:
    """Round ``n``'s median at c1 through ``proxy``, minus the app's and pgbench's claim."""
    r = f.runs
    return r[f"h{n}_{proxy}_c1"].p50_ms - r[f"h{n}_up_c1"].p50_ms - r[f"h{n}_pg_c1"].p50_ms


def headline(f: Figures) -> list[Headline]:
    """The five figures, each from every round: ratios of runs measured side by side."""
    r, ns = f.runs, rounds(f)
    if not ns:
        return []
    found = []
    for proxy, what in (("proxy", "the proxy"), ("stripe", "the proxy, Stripe-verified")):
        for c in (32, 1):
            if all(f"h{n}_{proxy}_c{c}" in r for n in ns):
                found += [
                    Headline(f"CPU per webhook, {what} ÷ the naive proxy's (c{c})",
                             [_cpu_per(r[f"h{n}_{proxy}_c{c}"]) / _cpu_per(r[f"h{n}_naive_c{c}"])
                              for n in ns], "x", 1.0, False),
                    Headline(f"throughput, {what} ÷ the naive proxy's (c{c})",
                             [r[f"h{n}_{proxy}_c{c}"].rate / r[f"h{n}_naive_c{c}"].rate
                              for n in ns], "x", 1.0, True),
                ]  # fmt: skip
    if f.worker_rss:
        peak = max(f.worker_rss.values()) / MB
        found.append(Headline("peak RSS per worker", [peak], "MB", 80, False))
    return found


def headline_table(f: Figures) -> str:
    """The issue's table, then the naive proxy's figures and the runs they come from."""
    r, ns = f.runs, rounds(f)
    rows = headline(f)
    if not rows:
        return ""
    names = " | ".join(f"round {n}" for n in ns)
    lines = [f"| figure | mean | {names} | target |", "|---|---|" + "---|" * len(ns) + "---|"]
    for row in rows:
        each = [row.show(v) for v in row.values] + [""] * (len(ns) - len(row.values))
        lines.append(f"| {row.name} | {row.show(row.mean)} | {' | '.join(each)} | "
                     f"{row.target}: {_verdict(row.ok)} |")  # fmt: skip

    def add(label: str, value: Callable[[int], str]) -> None:
        lines.append(f"| {label} | | " + " | ".join(value(n) for n in ns) + " | |")

    for key, label in (("proxy", "the proxy"), ("naive", "the naive proxy")):
        add(f"{label}: CPU per request ÷ the app's (c32; the last round's target was ≤ 2.5 x)",
            lambda n, k=key: f"{cpu_ratio(r[f'h{n}_{k}_c32']):.2f} x")  # type: ignore[misc]  # fmt: skip
        add(f"{label}: median at c1, above the app's, minus pgbench's",
            lambda n, k=key: f"{c1_gap(f, k, n):+.2f} ms")  # type: ignore[misc]  # fmt: skip
    add("the proxy: throughput at c32 ÷ pgbench's claim rate at c32",
        lambda n: f"{r[f'h{n}_proxy_c32'].rate / r[f'h{n}_pg_c32'].rate:.2f} x")  # fmt: skip
    keys = [("proxy_c32", "proxy c32"), ("stripe_c32", "proxy, Stripe-verified, c32"),
            ("naive_c32", "naive c32"), ("pg_c32", "pgbench c32"), ("up_c32", "app alone c32"),
            ("proxy_c1", "proxy c1"), ("stripe_c1", "proxy, Stripe-verified, c1"),
            ("naive_c1", "naive c1"), ("pg_c1", "pgbench c1"),
            ("up_c1", "app alone c1")]  # fmt: skip
    for key, label in keys:
        if all(f"h{n}_{key}" in r for n in ns):
            add(f"{label}: rate, p50",
                lambda n, k=key: f"{r[f'h{n}_{k}'].rate:,.0f}/s, {r[f'h{n}_{k}'].p50_ms:.2f} ms")  # type: ignore[misc]  # fmt: skip
    for key, label in keys:
        if key.split("_")[0] in ("proxy", "stripe", "naive") and all(
            f"h{n}_{key}" in r for n in ns
        ):
            add(f"{label}: CPU µs per request, proxy and app",
                lambda n, k=key: _cpu_pair(r[f"h{n}_{k}"]))  # type: ignore[misc]  # fmt: skip
    return "\n".join(lines)


def _cpu_pair(run: loads.Result) -> str:
    app = run.cpu_us("upstream", per=run.upstream.get("calls", 0))
    return f"{run.cpu_us('proxy'):.0f}, {app:.0f}"


def targets(f: Figures) -> list[Target]:
    found = [Target(row.name, row.show(row.mean), row.target, row.ok) for row in headline(f)]
    for name, storm in f.storms.items():
        ok = storm.upstream_calls == 1 and storm.peak_db <= 2 and storm.after_commit_ms <= 100
        found.append(Target(
            f"duplicate storm ({name} upstream)",
            f"{storm.upstream_calls} upstream call(s), {storm.peak_db} DB connections, "
            f"last answer {storm.after_commit_ms:.0f} ms after the first commit",
            "1 call, ≤ 2 connections, ≤ 100 ms", ok,
        ))  # fmt: skip
    checked = [r for r in proxy_runs(f) if r.body_bytes < 1024 * 1024]
    if checked:
        misses = [run.label for run in checked if not exact(run)[0]]
        found.append(Target(
            "one upstream call per unique request",
            f"{len(checked) - len(misses)} of {len(checked)} proxy runs exact"
            + (f" (not: {', '.join(misses)})" if misses else ""),
            "every run", not misses,
        ))  # fmt: skip
    return found


class _Rows:
    """The table being built: (section, measurement, result, target and verdict)."""

    def __init__(self, f: Figures) -> None:
        self.runs = f.runs
        self.goals = {t.name: t for t in targets(f)}
        self.lines: list[tuple[str, str, str, str]] = []
        self.section = ""

    def has(self, *keys: str) -> bool:
        return all(k in self.runs for k in keys)

    def add(self, measurement: str, result: str, goal: str = "") -> None:
        target = self.goals.get(goal)
        verdict = f"{target.limit}: {_verdict(target.ok)}" if target else ""
        self.lines.append((self.section, measurement, result, verdict))
        self.section = ""

    def render(self) -> str:
        header = ["| | measurement | result | target |", "|---|---|---|---|"]
        return "\n".join(header + ["| " + " | ".join(line) + " |" for line in self.lines])


def table(f: Figures, pool: int, rows: int) -> str:
    """The one table: pgbench, the upstream and the proxy side by side, with the targets."""
    t = _Rows(f)
    _throughput(t, f, pool)
    _latency(t)
    _duplicates(t, f)
    _duplicate_storm(t, f)
    _growth_rows(t, f, rows)
    t.section = "**memory**"
    for label, per_pid in f.rss.items():
        sizes = ", ".join(f"{rss / MB:.0f} MB (pid {pid})" for pid, rss in per_pid.items())
        t.add(f"peak RSS (VmHWM), {label}", sizes)
    return t.render()


def _throughput(t: _Rows, f: Figures, pool: int) -> None:
    r = t.runs
    t.section = "**throughput**"
    if t.has("pg_c32", "pg_c32_simple", "proxy_c32"):
        t.add("pgbench claim transaction, -M prepared, c32", _rate(r["pg_c32"], "tx/s"))
        t.add("pgbench claim transaction, -M simple, c32", _rate(r["pg_c32_simple"], "tx/s"))
        simple = r["proxy_c32"].rate / r["pg_c32_simple"].rate
        prepared = r["proxy_c32"].rate / r["pg_c32"].rate
        t.add(f"proxy, unique IDs, c32, pool {pool}",
              f"{_rate(r['proxy_c32'])}; {prepared:.2f} x pgbench prepared; "
              f"{simple:.2f} x pgbench simple")  # fmt: skip
    if t.has("proxy_w2_c32", "pg_c32"):
        run = r["proxy_w2_c32"]
        t.add(f"proxy, unique IDs, c32, 2 workers (pool {max(1, pool // 2)} each)",
              f"{_rate(run)}; {run.rate / r['pg_c32'].rate:.2f} x pgbench prepared")  # fmt: skip
    if t.has("naive_c32", "pg_c32"):
        run = r["naive_c32"]
        t.add("naive proxy (bench/naive.py: aiohttp + asyncpg, nothing else), c32",
              f"{_rate(run)}; {run.rate / r['pg_c32'].rate:.2f} x pgbench prepared")  # fmt: skip
    if t.has("up_c32"):
        loop = "uvloop" if f.facts.get("uvloop") else "asyncio loop"
        t.add(f"upstream alone, c32 ({loop})", _rate(r["up_c32"]))
    if t.has("up_c32_asyncio"):
        t.add("upstream alone, c32 (asyncio loop)", _rate(r["up_c32_asyncio"]))
    t.section = "**CPU**"
    for key in ("proxy_c32", "proxy_w2_c32", "naive_c32"):
        if t.has(key):
            run = r[key]
            up = run.cpu_us("upstream", per=run.upstream.get("calls", 0))
            t.add(f"CPU per request, {run.label}",
                  f"proxy {run.cpu_us('proxy'):.0f} µs vs upstream {up:.0f} µs "
                  f"= {run.cpu_us('proxy') / max(up, 1e-9):.2f} x")  # fmt: skip
    if t.has("proxy_c32", "pg_c32", "pg_c32_simple"):
        t.add("PostgreSQL CPU per claim",
              f"via the proxy {r['proxy_c32'].cpu_us('postgres'):.0f} µs; pgbench prepared "
              f"{r['pg_c32'].cpu_us('postgres'):.0f} µs, simple "
              f"{r['pg_c32_simple'].cpu_us('postgres'):.0f} µs")  # fmt: skip


def _latency(t: _Rows) -> None:
    r = t.runs
    t.section = "**latency**"
    for c, up, px in (("1", "up_c1", "proxy_c1"), ("32", "up_c32", "proxy_c32")):
        if t.has(up, px, f"naive_c{c}"):
            naive = r[f"naive_c{c}"]
            t.add(f"naive proxy at c{c}, for comparison",
                  f"p50 {naive.p50_ms:.2f} ms (+{naive.p50_ms - r[up].p50_ms:.2f}); "
                  f"p99 {naive.p99_ms:.2f} ms (+{naive.p99_ms - r[up].p99_ms:.2f})")  # fmt: skip
        if t.has(up, px):
            p50 = r[px].p50_ms - r[up].p50_ms
            p99 = r[px].p99_ms - r[up].p99_ms
            t.add(f"added latency at c{c} (proxy vs upstream alone)",
                  f"p50 {r[up].p50_ms:.2f} → {r[px].p50_ms:.2f} ms (+{p50:.2f}); "
                  f"p99 {r[up].p99_ms:.2f} → {r[px].p99_ms:.2f} ms (+{p99:.2f})")  # fmt: skip


def _duplicates(t: _Rows, f: Figures) -> None:
    r = t.runs
    t.section = "**duplicates**"
    for key in ("proxy_c1", "proxy_c32"):
        if t.has(key):
            t.add(f"one call per request: {r[key].label}", exact(r[key])[1],
                  "one upstream call per unique request")  # fmt: skip
    if t.has("proxy_dup50"):
        run = r["proxy_dup50"]
        t.add("50 % duplicates (committed IDs), c32", f"{_rate(run)}; {exact(run)[1]}",
              "one upstream call per unique request")  # fmt: skip


def _duplicate_storm(t: _Rows, f: Figures) -> None:
    """CPU per duplicate against CPU per new webhook in the same round; the 1,000 copies."""
    r = t.runs
    for n in range(1, 10):
        if not t.has(f"d{n}_new", f"d{n}_same", f"d{n}_other"):
            break
        new = r[f"d{n}_new"]
        for key, what in (("same", "the replica that committed them"),
                          ("other", "another replica")):  # fmt: skip
            run = r[f"d{n}_{key}"]
            t.add(f"duplicate storm at c32, copies of committed events, {what} (round {n})",
                  f"{_rate(run)}; CPU per duplicate: proxy {run.cpu_us('proxy'):.0f} µs "
                  f"({run.cpu_us('proxy') / new.cpu_us('proxy'):.2f} x a new webhook's "
                  f"{new.cpu_us('proxy'):.0f}), PostgreSQL {run.cpu_us('postgres'):.0f} µs "
                  f"({run.cpu_us('postgres') / new.cpu_us('postgres'):.2f} x "
                  f"{new.cpu_us('postgres'):.0f}); upstream calls "
                  f"{run.upstream.get('calls', 0)}", "no upstream call")  # fmt: skip
    for name, storm in f.storms.items():
        answers = ", ".join(f"{n} {k}" for k, n in storm.statuses.items())
        t.add(f"duplicate storm, {storm.copies} concurrent copies, {name} upstream",
              f"{storm.upstream_calls} upstream call(s); peak {storm.peak_db} DB connections "
              f"in use ({storm.polls} polls); copies sent within {storm.sent_ms:.0f} ms; "
              f"first commit answered at {storm.owner_ms:.0f} ms, "
              f"all answered at {storm.all_answered_ms:.0f} ms ({storm.after_commit_ms:.0f} ms "
              f"after); {answers}; {storm.listen_overflows} SYNs dropped by a full listen queue "
              "while the connections opened", f"duplicate storm ({name} upstream)")  # fmt: skip
    floor = f.storm_floor
    if floor is not None:
        t.add(f"the same storm straight at the upstream alone ({floor.copies} copies, no proxy)",
              f"first answer at {floor.owner_ms:.0f} ms, all answered at "
              f"{floor.all_answered_ms:.0f} ms ({floor.after_commit_ms:.0f} ms after the first): "
              "what this client and an aiohttp server take to answer that many at all")  # fmt: skip
    t.section = "**slow upstream**"
    for key, run in r.items():
        if key.startswith("slow_pool"):
            size = int(key.removeprefix("slow_pool"))
            ideal = size / 0.05
            share = f"{run.rate / ideal:.0%} of pool/latency = {ideal:,.0f}/s"
            t.add(f"50 ms upstream, c32, pool {size}", f"{_rate(run)}; {share}")


def _growth_rows(t: _Rows, f: Figures, rows: int) -> None:
    r = t.runs
    t.section = "**growth**"
    if t.has("pg_c1_empty", "pg_c1_full"):
        a, b = r["pg_c1_empty"], r["pg_c1_full"]
        size = f.facts.get("table_size", "?")
        t.add(f"claim latency, pgbench prepared c1: empty → {rows:,} rows",
              f"{_growth(a, b)}; {a.rate:,.0f} → {b.rate:,.0f} tx/s; table {size}")  # fmt: skip
    if t.has("proxy_c1", "proxy_c1_full"):
        t.add(f"proxy c1: empty → {rows:,} rows", _growth(r["proxy_c1"], r["proxy_c1_full"]))
    if t.has("up_c1", "proxy_c1", "up_c1_1mib", "proxy_c1_1mib"):
        small = r["proxy_c1"].p50_ms - r["up_c1"].p50_ms
        big = r["proxy_c1_1mib"].p50_ms - r["up_c1_1mib"].p50_ms
        t.add("1 KiB → 1 MiB body, c1",
              f"upstream p50 {r['up_c1'].p50_ms:.2f} → {r['up_c1_1mib'].p50_ms:.2f} ms; proxy "
              f"p50 {r['proxy_c1'].p50_ms:.2f} → {r['proxy_c1_1mib'].p50_ms:.2f} ms; added "
              f"{small:.2f} → {big:.2f} ms; proxy CPU {r['proxy_c1'].cpu_us('proxy'):.0f} → "
              f"{r['proxy_c1_1mib'].cpu_us('proxy'):.0f} µs/request; "
              f"{exact(r['proxy_c1_1mib'])[1]}")  # fmt: skip


def runs_table(f: Figures) -> str:
    """Every load run, with the CPU each process spent and what else ran on the machine."""
    lines = [
        "| run | sent | answered | rate/s | p50 ms | p99 ms | errors | CPU µs/req: proxy, "
        "upstream, postgres, load generator | other programs (cores) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in f.runs.values():
        cpu = ", ".join(
            f"{run.cpu_us(name):.0f}" if name in run.window.cpu else "-"
            for name in ("proxy", "upstream", "postgres")
        )
        loadgen = run.window.loadgen * 1e6 / max(run.sent, 1)
        lines.append(
            f"| {run.label} | {run.sent:,} | {run.requests:,} | {run.rate:,.0f} | "
            f"{run.p50_ms:.2f} | {run.p99_ms:.2f} | {run.errors} | {cpu}, {loadgen:.0f} | "
            f"{run.window.others:.2f} |"
        )
    return "\n".join(lines)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def machine() -> dict[str, str]:
    meminfo = Path("/proc/meminfo").read_text()
    memory = int(re.search(r"MemTotal:\s+(\d+)", meminfo)[1]) * 1024  # type: ignore[index]
    model = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
    wrk = shutil.which("wrk")
    wrk_version = (
        subprocess.run([wrk, "-v"], capture_output=True, text=True, check=False).stdout
        if wrk
        else "wrk missing"
    )
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "memory": f"{memory / 2**30:.1f} GiB",
        "cpu": model[1] if model else platform.machine(),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "packages": ", ".join(
            f"{name} {metadata.version(name)}"
            for name in ("aiohttp", "asyncpg", "uvloop")
            if _installed(name)
        ),
        "wrk": wrk_version.split("Copyright")[0].strip(),
        "load_before": loadavg(),
        "commit": commit(),
    }


def commit() -> str:
    """The checkout measured: its commit, marked when the tree differs from it."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "?"
    return (
        f"{head} with uncommitted changes" if git("status", "--porcelain", "--", "proxy") else head
    )


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


TITLE = "# dedup-proxy benchmark results"
HISTORY = "History: `git log -p bench/RESULTS.md`."
RUN_HEADING = "## run"


def splice(existing: str, run: str) -> str:
    """``existing`` (RESULTS.md) with its run section replaced by ``document``'s.

    The run section is what bench/run.py measures; the other studies' sections are kept by hand,
    each under a level-2 heading of its own, and survive a run. A file without a run section is
    replaced whole.
    """
    heading = re.compile(rf"^{re.escape(RUN_HEADING)}\n", re.M)
    old, new = heading.search(existing), heading.search(run)
    if old is None or new is None:
        return run
    after = re.compile(r"^## ", re.M).search(existing, old.end())
    rest = existing[after.start() :] if after else ""
    section = run[new.start() :].rstrip("\n") + "\n"
    return existing[: old.start()] + section + ("\n" + rest if rest else "")


def document(
    main_table: str, f: Figures, machine: dict[str, str], command: str, *, seconds: int, pool: int
) -> str:
    noise = [run.window.others for run in f.runs.values()]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    goals = "\n".join(
        f"- {t.name}: {t.measured} (target {t.limit}): {_verdict(t.ok)}" for t in targets(f)
    )
    fill = f.facts.get("fill_seconds")
    return f"""{TITLE}

{HISTORY}

{RUN_HEADING}

- Date: {now}
- Command: `{command}` (from the repository root, with the project's venv)
- Commit: `{machine["commit"]}`
- Machine: {machine["nproc"]} CPUs (`nproc`), {machine["memory"]} memory, {machine["cpu"]}, \
{machine["kernel"]}
- Software: Python {machine["python"]}, {machine["packages"]}, PostgreSQL \
{f.facts.get("postgres", "?")} (embedded, unix socket; {f.facts.get("pg_settings", "")}), \
{machine["wrk"]}; upstream loop: {"uvloop" if f.facts.get("uvloop") else "asyncio"}
- Each load run: {seconds} s; wrk `-t1 -c1` or `-t2 -c32`, `--latency`, 1 KiB JSON bodies with \
unique IDs unless stated; pgbench `-j2` with `bench/claim.sql`. \
{f"Table fill: {fill:.0f} s." if fill else ""}
- Noise: load average {machine["load_before"]} before, {machine["load_after"]} after; other \
programs on the machine used {sum(noise) / max(len(noise), 1):.2f} cores on average during the \
load runs (at most {max(noise, default=0):.2f}). Everything (PostgreSQL, upstream, proxy, load \
generator) shares the same {machine["nproc"]} CPUs.

### The performance issue's figures

The proxy and the naive one (`bench/naive.py`) with 2 workers and a pool of {pool} connections
each in all, the app alone and pgbench, at 1 and 32 connections, in {len(rounds(f))} rounds run
one after the other in this one run (the proxy, the Stripe-verified proxy and the naive proxy
in a rotated order each round). Ratios are of runs side by side in the same round; the verdict
is on the mean.

{headline_table(f)}

### Everything else

{main_table}

### Targets

{goals}

### Every run

{runs_table(f)}

### Method

- Event IDs: `bench/unique_ids.lua` gives every request `{{8 random hex}}-{{run}}-{{thread}}-{{n}}`,
  unique per run, thread and request, and scattered over the index like providers' IDs. The
  upstream (`bench/upstream.py`) counts calls and distinct IDs; "exact" means calls = unique IDs
  sent = distinct IDs, with none of the committed `seed-*` IDs (the 50 % mix reuses those).
- pgbench runs `bench/claim.sql` (BEGIN; the proxy's INSERT … ON CONFLICT DO NOTHING RETURNING
  with a fresh `gen_random_uuid()` ID; COMMIT) on the proxy's own table. The "empty" table holds
  the 1,000 seed rows and what earlier runs added; the full one adds random md5 IDs, then
  VACUUM ANALYZE and CHECKPOINT.
- Storm: the copies' connections are opened beforehand (one pass-through GET each), then all
  copies are POSTed at once from one aiohttp client (unlimited connector); "copies sent within"
  is how long that Python client took to write them all, a floor for the other times. Peak DB
  connections polls `pg_stat_activity` (application_name `dedup-proxy`, state not idle) as fast
  as it can from a thread of its own. "First commit" is when the one processed copy's answer
  arrived.
- Stripe-verified: the same proxy on a route with `preset: stripe` and `verify.secrets`; wrk
  sends each request with a `Stripe-Signature` that `bench/loads.py` computed beforehand for
  its body (`t=` the run's start, `v1=` the HMAC), and the naive proxy gets the same signed
  requests (it ignores the header). Every one was accepted: an unverified one would be a 400.
- Duplicate storm at c32: the 1,000 seed IDs are deleted and committed again through the
  proxy, then every request of a run reuses one of them (wrk `dup100`), against that proxy
  and against a second proxy on the same table (another replica), beside new webhooks on the
  first, in the same round. The proxy keeps no record of what it committed beyond the
  in-flight coalescing, so both take the same path: the claim, then ROLLBACK with the body
  comparison.
- Naive proxy: `bench/naive.py`, what a competent engineer writes in an afternoon with aiohttp
  and asyncpg (BEGIN, INSERT … ON CONFLICT DO NOTHING RETURNING, forward, COMMIT on 2xx; an
  asyncpg pool with its reset query off and its statement cache on, an aiohttp client keeping
  connections alive, uvloop; no header filtering, verification, coalescing, metrics, logs or
  timeouts), with the same pool and, in the headline table, the same 2 workers.
- 2 workers: the same proxy with `workers: 2` and half the pool each; its storm runs against it
  (copies spread over both processes meet at PostgreSQL's row lock). Its CPU is the supervisor's
  and both workers'.
- The proxy logs at its default level (`info`, JSON): one line per webhook, as in production.
- Slow upstream: the upstream sleeps 50 ms per call; each webhook holds a pool connection for
  that long, so pool_size / 50 ms is the ceiling.
- CPU per request is the process's utime + stime from `/proc/PID/stat` over the run (PostgreSQL:
  the postmaster and all its backends, live and exited), divided by the requests sent (the
  upstream's: by the calls it received). "Other programs" is the machine's busy time from
  `/proc/stat` minus ours, in cores: how noisy the run was. Peak RSS is `VmHWM` from
  `/proc/PID/status`.
"""


def as_json(f: Figures) -> dict[str, Any]:
    runs = {}
    for key, run in f.runs.items():
        entry = {
            fld.name: getattr(run, fld.name)
            for fld in dataclasses.fields(run)
            if fld.name != "window"
        }
        entry["cpu_us"] = {name: run.cpu_us(name) for name in run.window.cpu}
        entry["other_cores"] = run.window.others
        entry["exact"] = exact(run)[0] if run.through_proxy else None
        runs[key] = entry
    return {
        "runs": runs,
        "storms": {name: dataclasses.asdict(storm) for name, storm in f.storms.items()},
        "storm_floor": dataclasses.asdict(f.storm_floor) if f.storm_floor else None,
        "rss": f.rss,
        "targets": [dataclasses.asdict(t) for t in targets(f)],
        "facts": f.facts,
    }


def profile_top(path: Path, count: int = 15) -> list[str]:
    """The functions py-spy saw most, by own samples and by samples anywhere on the stack."""
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack:
            continue
        n = int(samples)
        total += n
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            anywhere[frame] += n
    lines = [f"{total} samples; own time (the function itself):"]
    lines += [f"{n / total:6.1%}  {frame}" for frame, n in own.most_common(count)]
    lines.append("anywhere on the stack (inclusive):")
    lines += [f"{n / total:6.1%}  {frame}" for frame, n in anywhere.most_common(count)]
    return lines
