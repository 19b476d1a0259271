"""What one take of a shared limit's place costs PostgreSQL, alone: the take as the proxy sends it
(``slots.Slots.take_statement``: IDs of one width, "below N", one range of the primary key)
beside the form it replaced (the N IDs listed, ``event_id = ANY('{0,1,…}')``) and a claim's
INSERT, each sent as text (as the proxy sends them: planned at each call).

    python bench/slot_take.py [--limits 64,512] [--calls 3000] [--rounds 3] [--out FILE]

An embedded PostgreSQL, a claim table of 50,000 claims and each limit's places; one connection
sends each statement ``--calls`` times in one transaction, rolled back (each take locks the
first place again: a transaction's own lock does not stop it, so this is a take that finds the
first place free; on a busy limit both forms also pass over the places held); the PostgreSQL
server's CPU per call (the process tree's, /proc) and the wall time per call. Each round runs
every statement in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

from bench import report
from bench.run import TABLE, Bench, Settings, prepare_database
from proxy.database import slots

CLAIMS = 50_000


def statements(limits: list[int]) -> dict[str, str]:
    """Each statement by its name: the take and the listed take per limit, and the claim."""
    quoted = f'"{TABLE}"'
    found: dict[str, str] = {}
    for limit in limits:
        places = slots.Slots(quoted, limit, 10.0)
        listed = "{" + ",".join(slots.place_id(n) for n in range(limit)) + "}"
        found[f"take, N = {limit}"] = places.take_statement
        found[f"listed take, N = {limit}"] = (
            f"SELECT FROM {quoted} WHERE scope = '{places.scope}' AND event_id = "
            f"ANY('{listed}'::text[]) LIMIT 1 FOR UPDATE SKIP LOCKED"
        )
    found["claim's INSERT"] = (
        f"INSERT INTO {quoted} (scope, event_id) VALUES ('bench', md5(random()::text)) "
        "ON CONFLICT (scope, event_id) DO NOTHING"
    )
    return found


async def _timed(bench: Bench, text: str, calls: int) -> tuple[float, float]:
    """PostgreSQL's CPU and the wall time per call, in µs."""
    connection = await asyncpg.connect(bench.dsn, statement_cache_size=0)
    transaction = connection.transaction()
    await transaction.start()
    try:
        cpu, wall = bench.postgres_cpu(), time.perf_counter()
        for _ in range(calls):
            await connection.execute(text)
        cpu, wall = bench.postgres_cpu() - cpu, time.perf_counter() - wall
    finally:
        await transaction.rollback()  # the places it locked, the claims it made
        await connection.close()
    return cpu * 1e6 / calls, wall * 1e6 / calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="64,512", help="comma-separated N")
    parser.add_argument("--calls", type=int, default=3000, help="per statement per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    limits = [int(n) for n in args.limits.split(",")]
    texts = statements(limits)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-slot-take-"))
    bench = Bench(Settings(seconds=1, pool=1, warmup=0), workdir)
    cpu: dict[str, list[float]] = {name: [] for name in texts}
    wall: dict[str, list[float]] = {name: [] for name in texts}
    try:
        prepare_database(bench)
        bench.sql(f"INSERT INTO {TABLE} (scope, event_id) "
                  f"SELECT 'bench', md5(g::text) FROM generate_series(1, {CLAIMS}) g")  # fmt: skip
        places = slots.Slots(f'"{TABLE}"', max(limits), 10.0)
        asyncio.run(_make(bench.dsn, places))
        bench.sql(f"ANALYZE {TABLE}")
        for _ in range(args.rounds):
            for name, text in texts.items():
                used, took = asyncio.run(_timed(bench, text, args.calls))
                cpu[name].append(used)
                wall[name].append(took)
    finally:
        bench.close()
    given = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "bench/slot_take.py", *given])
    machine = report.machine()
    lines = [
        f"`{command}`: {machine.get('nproc', '?')} CPUs, {args.calls:,} calls per statement per "
        f"round, {args.rounds} rounds, {CLAIMS:,} claims; the median of the rounds (their range)",
        "",
        "| statement | PostgreSQL CPU µs per call | wall µs per call |",
        "|---|---|---|",
    ]
    for name in texts:
        lines.append(
            f"| {name} | {statistics.median(cpu[name]):.0f} ({min(cpu[name]):.0f} to "
            f"{max(cpu[name]):.0f}) | {statistics.median(wall[name]):.0f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


async def _make(dsn: str, places: slots.Slots) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await places.make(connection)
    finally:
        await connection.close()


if __name__ == "__main__":
    sys.exit(main())
