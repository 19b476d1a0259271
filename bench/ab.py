"""A/B: this checkout's proxy against another checkout's, side by side in one run.

    python bench/ab.py --control DIR [--rounds 4] [--duration 5] [--workers 1] [--out FILE]
                       [--concurrency-a N] [--concurrency-b N]

``DIR`` is another checkout (``git worktree add DIR <commit>``): its ``proxy`` package runs
as the control. Both proxies serve the same app and embedded PostgreSQL with the same
configuration, but for ``upstream.concurrency`` (``--concurrency-a``, ``--concurrency-b``:
with ``--control .``, what the limit at the app costs). Each round runs wrk (new event IDs)
against each at c32 and then c1, the order reversed every other round (ABBA), and reports
each one's CPU per webhook and throughput, and B ÷ A per round. The figure of each lever in
bench/RESULTS.md comes from one such run.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loads, report
from bench.run import Bench, Settings, checkout_env, prepare_database


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--control", type=Path, required=True, help="the A checkout")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=int, default=5, help="seconds per load run")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--connections", default="32,1", help="comma-separated wrk -c values")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    for name in ("a", "b"):
        what = f"{name.upper()}'s upstream.concurrency (default unset)"
        parser.add_argument(f"--concurrency-{name}", type=int, help=what)
    args = parser.parse_args(argv)
    loads.wrk_path()
    settings = Settings(seconds=args.duration, pool=args.pool, warmup=2, rounds=args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-ab-bench-"))
    bench = Bench(settings, workdir)
    results: dict[tuple[str, int, int], loads.Result] = {}
    try:
        prepare_database(bench)
        app = bench.start_upstream("app")
        control = checkout_env(args.control)
        limits = {"A": args.concurrency_a, "B": args.concurrency_b}
        proxies = {
            name: bench.start_proxy(name.lower(), app, args.pool, workers=args.workers,
                                    env=env, concurrency=limits[name])
            for name, env in (("A", control), ("B", None))
        }  # fmt: skip
        for name, proxy in proxies.items():
            bench.wrk("", f"warm-up {name}", proxy, app, 32, seconds=settings.warmup)
        for round_ in range(1, args.rounds + 1):
            for connections in (int(c) for c in args.connections.split(",")):
                order = ("A", "B") if round_ % 2 else ("B", "A")
                for name in order:
                    label = f"{name} c{connections} (round {round_})"
                    results[name, connections, round_] = bench.wrk(
                        "", label, proxies[name], app, connections
                    )
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    command = shlex.join(["python", "bench/ab.py", *(sys.argv[1:] if argv is None else argv)])
    machine = report.machine()
    text = (
        f"`{command}`: {machine.get('nproc', '?')} CPUs, {args.duration} s per run, "
        f"{args.workers} worker(s), pool {args.pool}; A = {args.control}, B = this checkout"
        f"; upstream.concurrency A {args.concurrency_a}, B {args.concurrency_b}\n\n"
        f"{_table(results)}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


def _table(results: dict[tuple[str, int, int], loads.Result]) -> str:
    lines = [
        "| connections | round | A: webhooks/s, CPU µs | B: webhooks/s, CPU µs | CPU B ÷ A | "
        "throughput B ÷ A | errors A, B |",
        "|---|---|---|---|---|---|---|",
    ]
    for connections in sorted({c for _, c, _ in results}, reverse=True):
        cpu, rate = [], []
        for round_ in sorted({r for _, c, r in results if c == connections}):
            a, b = results["A", connections, round_], results["B", connections, round_]
            cpu.append(b.cpu_us("proxy") / a.cpu_us("proxy"))
            rate.append(b.rate / a.rate)
            lines.append(
                f"| {connections} | {round_} | {a.rate:,.0f}, {a.cpu_us('proxy'):.0f} | "
                f"{b.rate:,.0f}, {b.cpu_us('proxy'):.0f} | {cpu[-1]:.3f} | {rate[-1]:.3f} | "
                f"{a.errors}, {b.errors} |"
            )
        lines.append(
            f"| **{connections}** | **median** | | | **{statistics.median(cpu):.3f}** "
            f"({min(cpu):.3f} to {max(cpu):.3f}) | **{statistics.median(rate):.3f}** "
            f"({min(rate):.3f} to {max(rate):.3f}) | |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
