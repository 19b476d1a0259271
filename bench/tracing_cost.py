"""What tracing costs a webhook: CPU per webhook and throughput with tracing off, on with a
sampler of 0, and on at 100 % (every span exported to a real OTLP/HTTP receiver, a process of
its own), side by side in one run; and at 100 % with a collector that hangs or is down (what
must not change a webhook's answer or latency).

    python bench/tracing_cost.py [--duration 5] [--rounds 2] [--out FILE] [--quick]

Five proxies (one worker each, the same pool) in front of one app and the embedded
PostgreSQL, each load run (wrk, new event IDs) against each in turn, at c32 then c1, ``rounds``
times, each round starting one mode later; the proxy's CPU (its process and its threads: the
SDK's batch thread exports there) per webhook, and the ratios to tracing off of the same round.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loads, procs, report
from bench.run import ROOT, Bench, Settings, prepare_database


def modes(receiver: str, hanging: str, down: str) -> dict[str, dict[str, str]]:
    """Each proxy's environment, as an operator turns tracing on; the last two export to a
    collector that takes each export and never answers, and to a port nothing listens on."""
    on = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver, "OTEL_TRACES_SAMPLER": "always_on"}
    return {
        "off": {},
        "on, sampler 0": {
            **on, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"
        },
        "on, 100 %": on,
        "on, 100 %, collector hangs": {**on, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": hanging},
        "on, 100 %, collector down": {**on, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": down},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per load run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    quick = "1 s runs, one round, no warm-up: checks the harness only"
    parser.add_argument("--quick", action="store_true", help=quick)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration, args.rounds = 1, 1
    loads.wrk_path()
    settings = Settings(
        seconds=args.duration, pool=args.pool, warmup=0 if args.quick else 2, rounds=args.rounds
    )
    workdir = Path(tempfile.mkdtemp(prefix="dedup-tracing-bench-"))
    bench = Bench(settings, workdir)
    rows: list[tuple[int, str, int, loads.Result]] = []
    received = ""
    try:
        prepare_database(bench)
        app = bench.start_upstream("app")
        receiver, hanging = (_receiver(bench, name, workdir) for name in ("otlp", "hang"))
        endpoints = [f"http://127.0.0.1:{port}/v1/traces"
                     for port in (receiver.port, hanging.port, procs.free_port())]  # fmt: skip
        proxies = {
            mode: bench.start_proxy(f"proxy-{n}", app, args.pool, env=env)
            for n, (mode, env) in enumerate(modes(*endpoints).items())
        }
        for mode, proxy in proxies.items() if settings.warmup else ():
            bench.wrk("", f"warm-up {mode}", proxy, app, 32, seconds=settings.warmup)
        order = list(proxies.items())
        for round_ in range(1, args.rounds + 1):
            for connections in (32, 1):
                # Each round starts one mode later: no mode always runs right after another's
                # backlog (a proxy at 100 % still exporting, one retrying a collector down).
                shift = (round_ - 1) % len(order)
                for mode, proxy in order[shift:] + order[:shift]:
                    label = f"tracing {mode}, c{connections} (round {round_})"
                    rows.append((round_, mode, connections, bench.wrk("", label, proxy, app,
                                                                      connections)))  # fmt: skip
        for proxy in proxies.values():
            bench.stop(proxy)  # each drains, exporting what is queued (5 s at most)
        bench.stop(receiver)
        received = receiver.tail(1)
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    table = _table(rows)
    command = shlex.join(["python", "bench/tracing_cost.py", *(sys.argv[1:] if argv is None
                                                                else argv)])  # fmt: skip
    machine = report.machine()
    text = (
        f"`{command}`: {machine.get('nproc', '?')} CPUs, {args.duration} s per run, one worker "
        f"per proxy, pool {args.pool}; the receiver took: {received.strip()}\n\n{table}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


def _receiver(bench: Bench, name: str, workdir: Path) -> procs.Service:
    """tests/otlp.py's receiver in a process of its own (``hang``: one that never answers)."""
    port = procs.free_port()
    argv = [sys.executable, "-m", "tests.otlp", str(port), *(["hang"] if name == "hang" else [])]
    service = procs.Service(
        f"otlp-{name}", argv, workdir / f"otlp-{name}.log", port, env={"PYTHONPATH": str(ROOT)}
    )
    bench.services.append(service)
    service.wait_listening()
    return service


def _table(rows: list[tuple[int, str, int, loads.Result]]) -> str:
    off = {(r, c): result for r, mode, c, result in rows if mode == "off"}
    lines = [
        "| round | connections | tracing | webhooks/s | CPU µs per webhook | CPU ÷ off | "
        "throughput ÷ off | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for round_, mode, connections, result in sorted(rows, key=lambda row: (row[2] != 32, row[0])):
        base = off[(round_, connections)]
        cpu, base_cpu = result.cpu_us("proxy"), base.cpu_us("proxy")
        lines.append(
            f"| {round_} | {connections} | {mode} | {result.rate:,.0f} | {cpu:.0f} | "
            f"{cpu / base_cpu:.2f} | {result.rate / base.rate:.2f} | {result.p50_ms:.2f} | "
            f"{result.p99_ms:.2f} | "
            f"{result.errors} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
