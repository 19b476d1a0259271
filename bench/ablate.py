"""What each part of a webhook's path costs: the proxy against itself with that part removed.

    python bench/ablate.py [--ablations floor,log-line,key,turn] [--rounds 4] [--duration 5]
                           [--stripe] [--out FILE] [--meter wall|instructions] [--webhooks 300]

Each ablation is a patch in ``bench/ablations/`` (its first lines say what it removes), applied
to a scratch worktree of ``HEAD``: ``floor`` removes everything the naive proxy does not do,
the others one part each. The proxy (from ``HEAD`` too: a change not committed is in neither
side), the ablated proxy and the naive proxy (``bench/naive.py``) serve the same app and
embedded PostgreSQL, as in the headline: 2 workers each, a pool of 32, the proxies with
``upstream.concurrency`` 64, wrk with new event IDs at c32 and c1, the three in a rotated
order each round. Reported per ablation: the ablated proxy's CPU per webhook and throughput ÷
the proxy's and ÷ the naive proxy's, and the proxy's ÷ the naive proxy's, each the median over
the rounds with their range. ``--stripe``: on the headline's Stripe-verified route instead (the
naive proxy gets the same signed requests and verifies nothing). An ablated proxy is not a
product (it keeps no log, checks nothing); it only says what the part removed costs. A patch
that no longer applies fails the run: each names the code it removes.

``--meter instructions``: counts instead of the clock (bench/meter.py): each contender as one
process, instructions (callgrind) and system calls (strace) per webhook over the same stream of
``--webhooks``, twice; each part's cost is the proxy's count minus its ablated proxy's, which
the clock of this 2-core machine cannot resolve (±10 % a round).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import loads, report
from bench.run import STRIPE_SECRET, Bench, Settings, checkout_env, prepare_database

ROOT = Path(__file__).resolve().parent.parent
ABLATIONS = ROOT / "bench" / "ablations"
WORKERS = 2
POOL = 32
CONCURRENCY = 64  # upstream.concurrency, as the headline's proxies have it

Results = dict[tuple[str, str, int, int], loads.Result]  # (ablation, who, connections, round)


def _git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def worktree(
    scratch: Path, made: list[Path], ablation: str | None = None, *, compiled: bool = False
) -> Path:
    """A worktree of HEAD at ``scratch`` (listed in ``made`` first, so that it is removed
    even if the patch fails), with ``bench/ablations/<ablation>.patch`` applied; ``compiled``:
    then its hot modules built in place with mypyc, as the image has them (setup.py)."""
    made.append(scratch)
    _git("worktree", "add", "--detach", "--quiet", str(scratch), "HEAD")
    if ablation is not None:
        _git("apply", str(ABLATIONS / f"{ablation}.patch"), cwd=scratch)
    if compiled:
        compile_in_place(scratch)
    return scratch


def compile_in_place(checkout: Path) -> None:
    """setup.py's compiled build, its extension modules beside their sources in ``checkout``
    (which Python then imports instead of the sources); needs mypy in this Python."""
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=checkout,
        env={**os.environ, "DEDUP_PROXY_COMPILE": "1"}, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the compiled build in {checkout} failed:\n{done.stdout}{done.stderr}")


def remove(trees: list[Path]) -> None:
    """Remove the scratch worktrees, whatever happened to them (never raising: it runs on the
    way out of a failed run too)."""
    for tree in trees:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       capture_output=True, check=False)  # fmt: skip
    subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ablations", default="floor,log-line,key,turn",
                        help="comma-separated names of bench/ablations/*.patch")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--duration", type=int, default=5, help="seconds per load run")
    parser.add_argument("--connections", default="32,1", help="comma-separated wrk -c values")
    parser.add_argument("--stripe", action="store_true", help="the Stripe-verified route")
    parser.add_argument("--out", type=Path, help="also write the table here (markdown)")
    parser.add_argument("--meter", choices=("wall", "instructions"), default="wall",
                        help="CPU seconds under wrk, or counts (bench/meter.py)")  # fmt: skip
    parser.add_argument("--webhooks", type=int, default=300, help="counted (--meter only)")
    args = parser.parse_args(argv)
    secret = STRIPE_SECRET if args.stripe else ""
    signed = {"mode": "stripe", "stripe_secret": STRIPE_SECRET} if args.stripe else {}
    names = [n.strip() for n in args.ablations.split(",") if n.strip()]
    connections = [int(c) for c in args.connections.split(",")]
    known = sorted(p.stem for p in ABLATIONS.glob("*.patch"))
    if unknown := [n for n in names if n not in known]:
        parser.error(f"no ablation {', '.join(unknown)}: one of {', '.join(known)}")
    if args.meter == "instructions":
        return _metered(names, args.stripe, args.webhooks, args.out)
    loads.wrk_path()
    settings = Settings(seconds=args.duration, pool=POOL, warmup=2, rounds=args.rounds)
    workdir = Path(tempfile.mkdtemp(prefix="dedup-ablate-"))
    bench = Bench(settings, workdir)
    results: Results = {}
    worktrees: list[Path] = []
    try:
        prepare_database(bench)
        app = bench.start_upstream("app")
        head = worktree(workdir / "tree-head", worktrees)
        proxy = bench.start_proxy("proxy", app, POOL, workers=WORKERS, concurrency=CONCURRENCY,
                                  env=checkout_env(head), stripe_secret=secret)  # fmt: skip
        naive = bench.start_naive("naive", app, POOL, workers=WORKERS)
        for who, service in (("proxy", proxy), ("naive", naive)):
            bench.wrk("", f"warm-up {who}", service, app, 32, seconds=settings.warmup, **signed)
        for name in names:
            tree = worktree(workdir / f"tree-{name}", worktrees, name)
            variant = bench.start_proxy(name, app, POOL, workers=WORKERS, concurrency=CONCURRENCY,
                                        env=checkout_env(tree), stripe_secret=secret)  # fmt: skip
            bench.wrk("", f"warm-up {name}", variant, app, 32, seconds=settings.warmup, **signed)
            contenders = [("proxy", proxy), ("ablated", variant), ("naive", naive)]
            for round_ in range(1, args.rounds + 1):
                turn = (round_ - 1) % len(contenders)
                for c in connections:
                    for who, service in contenders[turn:] + contenders[:turn]:
                        label = f"{name}: {who} c{c} (round {round_})"
                        results[name, who, c, round_] = bench.wrk(
                            "", label, service, app, c, **signed
                        )
            bench.stop(variant)
    finally:
        bench.close()
        remove(worktrees)
        shutil.rmtree(workdir, ignore_errors=True)
    command = shlex.join(["python", "bench/ablate.py", *(sys.argv[1:] if argv is None else argv)])
    machine = report.machine()
    text = (
        f"`{command}`: {machine.get('nproc', '?')} CPUs, {args.duration} s per run, "
        f"{WORKERS} workers each, pool {POOL}, the proxies' upstream.concurrency {CONCURRENCY}"
        f"{', the Stripe-verified route' if args.stripe else ''}; "
        f"at `{_git('rev-parse', '--short', 'HEAD').strip()}`\n\n{table(results)}\n"
    )
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    return 0


def _metered(names: list[str], stripe: bool, webhooks: int, out: Path | None) -> int:
    """``--meter instructions``: bench/meter.py over the same ablations and route, as a process
    of its own (it reads the ablations from this module: no import back)."""
    argv = ["--ablations", ",".join(names), "--routes", "stripe" if stripe else "plain",
            "--webhooks", str(webhooks)]  # fmt: skip
    argv += ["--out", str(out)] if out is not None else []
    meter = Path(__file__).resolve().parent / "meter.py"
    return subprocess.run([sys.executable, str(meter), *argv], check=False).returncode


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f} to {max(values):.3f})"


def _cpu(these: list[loads.Result], those: list[loads.Result]) -> list[float]:
    """Each round's CPU per webhook of ``these`` ÷ that of ``those``."""
    return [x.cpu_us("proxy") / y.cpu_us("proxy") for x, y in zip(these, those, strict=True)]


def _rate(these: list[loads.Result], those: list[loads.Result]) -> list[float]:
    return [x.rate / y.rate for x, y in zip(these, those, strict=True)]


def table(results: Results) -> str:
    """One row per ablation and connection count: the medians over the rounds."""
    lines = [
        "| ablation | connections | CPU: ablated ÷ proxy | throughput: ablated ÷ proxy | "
        "CPU: ablated ÷ naive | CPU: proxy ÷ naive | throughput: proxy ÷ naive | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(n for n, _, _, _ in results):
        for c in sorted({c for n, _, c, _ in results if n == name}, reverse=True):
            rounds = sorted({r for n, _, cc, r in results if n == name and cc == c})
            ablated, proxy, naive = (
                [results[name, who, c, r] for r in rounds] for who in ("ablated", "proxy", "naive")
            )
            errors = sum(x.errors for x in ablated + proxy + naive)
            lines.append(
                f"| {name} | {c} | {_ratio(_cpu(ablated, proxy))} | "
                f"{_ratio(_rate(ablated, proxy))} | {_ratio(_cpu(ablated, naive))} | "
                f"{_ratio(_cpu(proxy, naive))} | {_ratio(_rate(proxy, naive))} | {errors} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
