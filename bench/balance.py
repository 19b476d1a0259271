"""How ``workers: 2`` shares the webhooks of a few kept-alive connections.

    python bench/balance.py [--rounds 6] [--duration 5] [--connections 8] [--control DIR]
                            [--cold] [--out FILE] [--quick]

One proxy with ``workers: 2`` in front of the bench's app and embedded PostgreSQL; each round
one wrk run opens ``--connections`` connections (as an ingress's pool) and keeps them for the
whole run. Each worker's share of the webhooks is counted from the log lines (``"worker":n``
on every webhook's line), and its CPU from /proc. ``--control DIR`` also runs, round by round,
the proxy of another checkout (``git worktree add DIR <commit>``), e.g. the one before the
per-worker sockets (one listening socket shared by both workers), side by side. ``--cold``
starts each proxy afresh for each round and opens the connections as soon as its port
answers, while its second worker may still be starting: how a soak or an ingress that connects
at once meets a proxy just started.
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loads, procs, report
from bench.run import Bench, Settings, checkout_env, prepare_database


@dataclass(frozen=True, slots=True)
class Share:
    proxy: str
    round: int
    result: loads.Result
    webhooks: dict[int, int]  # per worker number, from the log lines
    cpu: dict[int, float]  # seconds, per worker PID

    @property
    def busier(self) -> float:
        """The busier worker's share of the round's webhooks (0.5: even)."""
        total = sum(self.webhooks.values())
        return max(self.webhooks.values(), default=0) / total if total else 0.0


class Counter:
    """Webhooks per worker in a proxy's log, counted from where the last call stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def take(self) -> dict[int, int]:
        counts: collections.Counter[int] = collections.Counter()
        with self.path.open("rb") as log:
            log.seek(self.offset)
            data = log.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.splitlines():
            if b'"outcome"' not in line:
                continue
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            if fields.get("outcome") == "processed":
                counts[int(fields["worker"])] += 1
        return dict(counts)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.rounds, args.duration = 2, 1
    loads.wrk_path()
    settings = Settings(seconds=args.duration, pool=args.pool, warmup=0, rounds=args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-balance-bench-"))
    bench = Bench(settings, workdir)
    try:
        prepare_database(bench)
        shares = Rounds(bench, args).run()
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    command = shlex.join(["python", "bench/balance.py", *(sys.argv[1:] if argv is None
                                                          else argv)])  # fmt: skip
    machine = report.machine()
    cold = "; each round a proxy just started, loaded as soon as its port answered"
    text = (
        f"`{command}`: {machine.get('nproc', '?')} CPUs, {args.duration} s per run, "
        f"`workers: 2`, pool {args.pool} each, wrk -c{args.connections} (new connections each "
        f"round, kept alive through the run{cold if args.cold else ''})\n\n{_table(shares)}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--duration", type=int, default=5, help="seconds per load run")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--pool", type=int, default=16, help="pool_size of each worker")
    parser.add_argument("--control", type=Path, help="a checkout whose proxy runs beside")
    parser.add_argument("--cold", action="store_true", help="a fresh proxy for each round")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 s: the harness only")
    return parser


class Rounds:
    """Each round's run against each proxy (this checkout's, the control's), in turn."""

    def __init__(self, bench: Bench, args: argparse.Namespace) -> None:
        self.bench = bench
        self.args = args
        self.envs: dict[str, dict[str, str] | None] = {"this checkout": None}
        if args.control is not None:
            self.envs[f"control ({args.control})"] = checkout_env(args.control)
        self.app = bench.start_upstream("app")

    def start(self, name: str, round_: int) -> procs.Service:
        tag = "proxy" if self.envs[name] is None else "control"
        return self.bench.start_proxy(
            f"{tag}-{round_}", self.app, self.args.pool, workers=2, env=self.envs[name]
        )

    def run(self) -> list[Share]:
        bench, args, app = self.bench, self.args, self.app
        proxies = {} if args.cold else {name: self.start(name, 0) for name in self.envs}
        counters = {name: Counter(proxy.log_path) for name, proxy in proxies.items()}
        for name, proxy in proxies.items():
            if not args.quick:  # warm-up, not counted
                bench.wrk("", f"warm-up {name}", proxy, app, args.connections, seconds=2)
            counters[name].take()
        shares: list[Share] = []
        for round_ in range(1, args.rounds + 1):
            order = list(self.envs)
            for name in order if round_ % 2 else order[::-1]:
                if args.cold:  # loaded at once: wait_listening returned when a worker answered
                    proxies[name] = self.start(name, round_)
                    counters[name] = Counter(proxies[name].log_path)
                proxy = proxies[name]
                before = {pid: procs.cpu_seconds(pid) for pid in procs.children(proxy.pid)}
                label = f"{name}, {args.connections} kept-alive connections (round {round_})"
                result = bench.wrk("", label, proxy, app, args.connections)
                cpu = {pid: procs.cpu_seconds(pid) - before.get(pid, 0.0)
                       for pid in procs.children(proxy.pid)}  # fmt: skip
                shares.append(Share(name, round_, result, counters[name].take(), cpu))
                if args.cold:
                    bench.stop(proxy)
        return shares


def _table(shares: list[Share]) -> str:
    lines = [
        "| proxy | round | webhooks/s | webhooks: worker 1, worker 2 | busier worker's share | "
        "CPU s per worker | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for share in sorted(shares, key=lambda s: (s.proxy, s.round)):
        cpu = ", ".join(f"{seconds:.1f}" for seconds in share.cpu.values())
        lines.append(
            f"| {share.proxy} | {share.round} | {share.result.rate:,.0f} | "
            f"{share.webhooks.get(1, 0):,}, {share.webhooks.get(2, 0):,} | "
            f"{share.busier:.0%} | {cpu} | {share.result.errors} |"
        )
    by_proxy: dict[str, list[Share]] = collections.defaultdict(list)
    for share in shares:
        by_proxy[share.proxy].append(share)
    for proxy, rounds in by_proxy.items():
        mean = sum(s.busier for s in rounds) / len(rounds)
        alone = sum(1 for s in rounds if s.busier == 1.0)
        lines.append(
            f"| **{proxy}: mean** | {len(rounds)} rounds | "
            f"{sum(s.result.rate for s in rounds) / len(rounds):,.0f} | | **{mean:.0%}** "
            f"(one worker alone in {alone} of {len(rounds)}) | | |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
