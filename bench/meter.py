"""Instructions and system calls per webhook: the cost of a webhook's path as counts, which a
shared 2-core machine cannot blur as it blurs CPU seconds.

    python bench/meter.py [--webhooks 300] [--warmup 50] [--runs 2] [--routes plain,stripe]
                          [--ablations floor,log-line,key,turn]
                          [--variants shared,ordered,receipt] [--build compiled|pure|both]
                          [--clock N] [--out FILE] [--json FILE]

The contenders: the proxy of ``HEAD``, the naive proxy (bench/naive.py) and ``HEAD`` with each
ablation applied (bench/ablations/*.patch, in scratch worktrees as bench/ablate.py makes them;
``floor`` is the proxy doing only what the naive proxy does); with ``--variants``, ``HEAD``
again with one of this round's features on, to say what it costs: ``shared``, its limit shared
by every replica (``upstream.concurrency: {limit: N, shared: true}``, N its share: each webhook
takes a place, one statement more); ``ordered``, the route with ``order: {key: body:/id}``
(each event its own object: the object row's statement alone); ``receipt``, the route with
``receipt`` (the receipt's key in each request to the app). ``--build``: the proxy as the
image runs it, its hot modules compiled with mypyc (setup.py; the default, and this Python needs
mypy), as the README's commands install it (pure Python), or ``both``: the compiled build, and
the pure one beside it as contender ``pure``; an ablation is built as the proxy is. Each runs
as one process (``workers: 1``, with the pool and the share of ``upstream.concurrency`` of one
of bench/ablate.py's workers) at ``nice 19`` with ``PYTHONHASHSEED=0``, in front of the same app
(bench/upstream.py) and embedded PostgreSQL, and gets the same stream from a small client in
this process: ``--warmup`` webhooks, then ``--webhooks`` measured ones, each with a new event
ID, one at a time over one keep-alive connection (not wrk: the same requests in the same order
every run, and no interleaving for the kernel to vary). The IDs are the same every run: the
contender's claims are deleted first. Two counts, each in a run of its own, of the contender's
process alone (not the app's, the database's or the client's), for the measured stream alone:

- instructions: under valgrind's callgrind, instrumentation off at start
  (``--instr-atstart=no``), switched on and off around the stream (``callgrind_control -i``),
  then dumped (``callgrind_control -d``);
- system calls: ``strace -c -f`` attached for the stream (SIGINT detaches it and prints its
  table);
- with ``--clock N``, a third: its CPU seconds (user and system apart, ``/proc/PID/stat``) for
  ``N`` webhooks of the same stream, natively (no valgrind or strace): whether the clock agrees
  with the count when the load is the same.

Each divided by the webhooks; each ÷ (and beyond) the naive proxy's on the same route, the least
of the runs against the least (a busy machine only adds to a count). ``--runs``: everything
again in fresh processes, the spread between runs reported beside the figures (instructions
within 1 % on this machine, system calls a few %: the loop's wake-ups vary with when answers
arrive). Under callgrind a webhook takes tens of times its native time: hence the modest
defaults. ``--routes``: ``plain`` (the event ID at ``body:/id``) and ``stripe`` (Stripe's
preset, each request signed; the naive proxy gets the same requests and checks nothing, and a
second contender, ``naive-verified``, is the naive proxy checking each signature as Stripe's
Python library does: the proxy's figure beside it says what the proxy costs beyond the check
every verifying proxy makes; before the stream, each contender that checks is sent a forged
signature, which it must answer 401 without the app seeing it). Every
webhook must be answered 200 and reach the app once, or the run fails. Needs valgrind and strace
(Debian: ``apt-get install valgrind strace``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import http.client
import json
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import ablate, loads, procs, report
from bench.run import (
    SCOPE,
    STRIPE_SECRET,
    TABLE,
    Bench,
    Settings,
    checkout_env,
    prepare_database,
)

WEBHOOKS = 300
WARMUP = 50
RUNS = 2
ROUTES = ("plain", "stripe")
BODY_BYTES = 1024  # as bench/loads.py's wrk runs
MARK = "-meter-"  # in every event ID the stream sends (its claims are deleted before a run)
# One of bench/ablate.py's workers: its pool, its share of upstream.concurrency.
POOL = ablate.POOL
CONCURRENCY = ablate.CONCURRENCY // ablate.WORKERS
# HEAD again with one feature on (--variants): what each adds to the route.
VARIANTS: dict[str, dict[str, Any]] = {
    "shared": {},  # the limit shared by every replica: upstream.concurrency, not the route
    "ordered": {"order": {"key": "body:/id"}},
    "receipt": {"receipt": True},
}
# The proxy's build: as the image has it (setup.py, DEDUP_PROXY_COMPILE=1), as the README's
# commands install it, or the first with the second beside it as contender "pure".
BUILDS = ("compiled", "pure", "both")
BUILD = "compiled"
BUILT = {
    "compiled": "compiled with mypyc (the image's build)",
    "pure": "pure Python (the README's install)",
    "both": "compiled with mypyc (the image's build), and pure Python as `pure`",
}
# The naive proxy with bench/naive.py's Stripe check (--stripe-secret): on the stripe route only.
NAIVE_VERIFIED = "naive-verified"
SETTLE = 0.3  # seconds for the work after the last answer (the log line) before a switch


@dataclass(frozen=True, slots=True, kw_only=True)
class Count:
    """One contender's counts per webhook on one route in one run."""

    contender: str
    route: str
    run: int
    instructions: float
    syscalls: float
    calls: dict[str, float] = field(default_factory=dict)  # per system call's name
    # --clock: CPU microseconds per webhook, natively, user and system apart (0: not measured)
    user_us: float = 0.0
    system_us: float = 0.0


class Stream:
    """The webhooks, one at a time over one keep-alive connection; the same bytes every run
    but for a Stripe signature's timestamp (and so its MAC)."""

    def __init__(self, port: int, signed: bool) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        self.signed = signed

    def send(self, phase: str, count: int) -> None:
        for n in range(1, count + 1):
            event_id = f"{(n * 2654435761) % 2147483648:08x}{MARK}{phase}-{n:06d}"
            pad = "x" * max(0, BODY_BYTES - 22 - len(event_id))
            body = f'{{"id":"{event_id}","pad":"{pad}"}}'
            if (status := self._post(body.encode())) != 200:
                raise RuntimeError(f"webhook {event_id}: {status}")

    def forged(self) -> int:
        """The status answered to a webhook whose signature is not its body's (a verifying
        contender must refuse it, and the app must not see it)."""
        return self._post(b'{"id":"forged' + MARK.encode() + b'"}', signs=b"{}")

    def _post(self, body: bytes, signs: bytes | None = None) -> int:
        """POST ``body``, on a signed stream with the Stripe signature of ``signs`` (by
        default the body itself): the answer's status."""
        headers = {"Content-Type": "application/json"}
        if self.signed:
            stamp = str(int(time.time()))
            message = f"{stamp}.".encode() + (body if signs is None else signs)
            mac = hmac.new(STRIPE_SECRET.encode(), message, hashlib.sha256)
            headers["Stripe-Signature"] = f"t={stamp},v1={mac.hexdigest()}"
        self.connection.request("POST", "/hook", body, headers)
        answer = self.connection.getresponse()
        answer.read()
        return answer.status

    def close(self) -> None:
        self.connection.close()


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed: {done.stdout}{done.stderr}")
    return done.stdout


class Callgrind:
    """Instructions counted by callgrind between ``on`` and ``off``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pid = 0

    def launcher(self) -> list[str]:
        return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no",
                f"--callgrind-out-file={self.out}"]  # fmt: skip

    def on(self, pid: int) -> None:
        self.pid = pid
        _run("callgrind_control", "-i", "on", str(pid))

    def off(self) -> float:
        _run("callgrind_control", "-i", "off", str(self.pid))
        _run("callgrind_control", "-d", str(self.pid))
        totals = 0
        for dump in self.out.parent.glob(self.out.name + ".*"):
            for line in dump.read_text(errors="replace").splitlines():
                if line.startswith("totals:"):
                    totals += int(line.split()[1])
        if not totals:
            raise RuntimeError(f"callgrind dumped no instructions for {self.pid}")
        return totals


class Clock:
    """CPU seconds, user and system apart, spent between ``on`` and ``off``, natively."""

    def __init__(self, out: Path) -> None:
        self.pid = 0
        self.start = (0.0, 0.0)

    def launcher(self) -> list[str]:
        return []

    def on(self, pid: int) -> None:
        self.pid = pid
        self.start = procs.user_system_seconds(pid)

    def off(self) -> dict[str, float]:
        user, system = procs.user_system_seconds(self.pid)
        return {"user": user - self.start[0], "system": system - self.start[1]}


class Strace:
    """System calls counted by ``strace -c -f``, attached between ``on`` and ``off``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.process: subprocess.Popen[bytes] | None = None

    def launcher(self) -> list[str]:
        return []

    def on(self, pid: int) -> None:
        self.process = subprocess.Popen(
            ["strace", "-c", "-f", "-q", "-o", str(self.out), "-p", str(pid)],
            stderr=subprocess.PIPE,
        )
        # strace attaches before the first call it counts; what it says then is the sign.
        deadline = time.monotonic() + 10
        while not self._attached(pid):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"strace did not attach to {pid}")
            time.sleep(0.02)

    @staticmethod
    def _attached(pid: int) -> bool:
        status = Path(f"/proc/{pid}/status").read_text()
        return any(line.split()[1] != "0" for line in status.splitlines()
                   if line.startswith("TracerPid:"))  # fmt: skip

    def off(self) -> dict[str, int]:
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        self.process.wait(60)
        calls: dict[str, int] = {}
        for line in self.out.read_text().splitlines():
            cells = line.split()
            # "% time  seconds  usecs/call  calls  [errors]  syscall", then a "total" row.
            if len(cells) >= 5 and cells[0][0].isdigit() and cells[-1] != "total":
                calls[cells[-1]] = int(cells[3])
        return calls


def one(
    bench: Bench, app: procs.Service, *, contender: str, route: str, how: str,
    checkout: Path | None, webhooks: int, warmup: int,
) -> float | dict[str, int] | dict[str, float]:  # fmt: skip
    """One contender's ``how`` count for the measured stream, in a process of its own (a
    variant's: ``HEAD`` with its feature on, ``VARIANTS``)."""
    tag = f"{contender}-{route}-{how}-{bench.run_id()}"
    kinds: dict[str, type[Callgrind | Strace | Clock]] = {
        "instructions": Callgrind, "syscalls": Strace, "cpu": Clock,
    }  # fmt: skip
    meter = kinds[how](bench.workdir / f"{how}.{tag}")
    # At the lowest priority: the app's and PostgreSQL's answers are then ready when the
    # contender polls, as they are on a quiet machine, rather than a wake-up later under load
    # (three runs at a load average of 5: within 0.9 % with it, 2 % without).
    launcher = ["env", "PYTHONHASHSEED=0", "nice", "-n", "19", *meter.launcher()]
    bench.sql(f"DELETE FROM {TABLE} WHERE event_id LIKE '%{MARK}%'")
    if checkout is None:
        secret = STRIPE_SECRET if contender == NAIVE_VERIFIED else ""
        service = bench.start_naive(tag, app, POOL, launcher=launcher, stripe_secret=secret)
    else:
        service = bench.start_proxy(
            tag, app, POOL, env=checkout_env(checkout),
            concurrency={"limit": CONCURRENCY, "shared": True}
            if contender == "shared" else CONCURRENCY,
            stripe_secret=STRIPE_SECRET if route == "stripe" else "", launcher=launcher,
            routes=_variant_routes(route, contender),
        )  # fmt: skip
    upstream = loads.Upstream(app.port)
    upstream.reset()
    stream = Stream(service.port, signed=route == "stripe")
    try:
        if route == "stripe" and contender != "naive" and (status := stream.forged()) != 401:
            raise RuntimeError(f"{tag}: a forged signature was answered {status}, not 401")
        stream.send("warm", warmup)
        time.sleep(SETTLE)
        meter.on(service.pid)
        stream.send("measured", webhooks)
        time.sleep(SETTLE)
        counted = meter.off()
    finally:
        stream.close()
        bench.stop(service)
    seen = upstream.stats()
    if seen["calls"] != warmup + webhooks or seen["distinct"] != seen["calls"]:
        raise RuntimeError(f"{tag}: the app saw {seen} for {warmup + webhooks} webhooks")
    print(f"{tag}: {counted if isinstance(counted, float | int) else sum(counted.values())}",
          file=sys.stderr, flush=True)  # fmt: skip
    return counted


def _variant_routes(route: str, contender: str) -> list[dict[str, Any]] | None:
    """The route of a variant that changes it (``VARIANTS``), as ``Bench.start_proxy`` makes
    ``route``'s with its feature added; None for every other contender."""
    extra = VARIANTS.get(contender)
    if not extra:
        return None
    if route == "stripe":
        base = {"name": SCOPE, "path": "/hook", "preset": "stripe",
                "verify": {"secrets": [STRIPE_SECRET]}}  # fmt: skip
    else:
        base = {"name": SCOPE, "path": "/hook", "event_id": "body:/id"}
    return [{**base, **extra}]


def _contenders(
    workdir: Path, trees: list[Path], *, names: Sequence[str], routes: Sequence[str],
    variants: Sequence[str], build: str,
) -> dict[str, Path | None]:  # fmt: skip
    """Each contender's checkout (None: the naive proxy's), its scratch worktrees in ``trees``."""
    checkouts: dict[str, Path | None] = {"naive": None}
    if "stripe" in routes:
        checkouts[NAIVE_VERIFIED] = None
    compiled = build != "pure"  # the proxy and each ablation; "both" adds a pure tree
    checkouts["proxy"] = ablate.worktree(workdir / "tree-head", trees, compiled=compiled)
    if build == "both":
        checkouts["pure"] = ablate.worktree(workdir / "tree-pure", trees)
    for variant in variants:
        checkouts[variant] = checkouts["proxy"]
    for name in names:
        checkouts[name] = ablate.worktree(workdir / f"tree-{name}", trees, name, compiled=compiled)
    return checkouts


def _count(
    bench: Bench, app: procs.Service, *, contender: str, route: str, run: int,
    checkout: Path | None, webhooks: int, warmup: int, clock: int,
) -> Count:  # fmt: skip
    """One contender's counts on ``route`` in run ``run``, each in a process of its own; with
    ``clock``, also its CPU for that many webhooks."""
    measured = functools.partial(
        one, bench, app, contender=contender, route=route, checkout=checkout, warmup=warmup
    )
    instructions = measured(how="instructions", webhooks=webhooks)
    calls = measured(how="syscalls", webhooks=webhooks)
    assert isinstance(instructions, int | float)
    assert isinstance(calls, dict)
    user = system = 0.0
    if clock:
        cpu = measured(how="cpu", webhooks=clock)
        assert isinstance(cpu, dict)
        user, system = cpu["user"] / clock * 1e6, cpu["system"] / clock * 1e6
    return Count(
        contender=contender, route=route, run=run, instructions=instructions / webhooks,
        syscalls=sum(calls.values()) / webhooks,
        calls={name: n / webhooks for name, n in sorted(calls.items())},
        user_us=user, system_us=system,
    )  # fmt: skip


def measure(
    names: Sequence[str], routes: Sequence[str], *, webhooks: int = WEBHOOKS,
    warmup: int = WARMUP, runs: int = RUNS, variants: Sequence[str] = (), build: str = BUILD,
    clock: int = 0,
) -> list[Count]:  # fmt: skip
    """Every contender's counts on every route, ``runs`` times."""
    for tool in ("valgrind", "callgrind_control", "strace"):
        if shutil.which(tool) is None:
            raise SystemExit(f"bench/meter.py needs {tool}: apt-get install valgrind strace")
    workdir = Path(tempfile.mkdtemp(prefix="dedup-meter-"))
    bench = Bench(Settings(seconds=1, pool=ablate.POOL, warmup=0), workdir)
    trees: list[Path] = []
    counts: list[Count] = []
    try:
        prepare_database(bench)
        app = bench.start_upstream("app")
        checkouts = _contenders(
            workdir, trees, names=names, routes=routes, variants=variants, build=build
        )
        for run in range(1, runs + 1):
            for route in routes:
                for contender, checkout in checkouts.items():
                    if contender == NAIVE_VERIFIED and route != "stripe":
                        continue
                    counts.append(_count(
                        bench, app, contender=contender, route=route, run=run,
                        checkout=checkout, webhooks=webhooks, warmup=warmup, clock=clock,
                    ))  # fmt: skip
    finally:
        bench.close()
        ablate.remove(trees)
        shutil.rmtree(workdir, ignore_errors=True)
    return counts


def _spread(values: list[float]) -> float:
    """The runs' range as a fraction of their smallest."""
    return (max(values) - min(values)) / min(values) if min(values) else 0.0


def table(counts: list[Count]) -> str:
    """One row per route and contender: each run's counts, their spread, and the naive
    proxy's ratio (instructions) and difference (system calls), each on the least of the runs
    (a busy machine only adds to a count: an answer from the app or PostgreSQL that comes later
    costs the loop another wake-up and an await another suspension); on the stripe route also
    the ratio to ``naive-verified``'s instructions (elsewhere "-")."""
    lines = [
        "| route | contender | instructions per webhook (each run) | spread | ÷ naive | "
        f"÷ {NAIVE_VERIFIED} | system calls per webhook (each run) | spread | beyond naive |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for route in dict.fromkeys(c.route for c in counts):
        rows = [c for c in counts if c.route == route]
        naive_instructions = min(c.instructions for c in rows if c.contender == "naive")
        naive_syscalls = min(c.syscalls for c in rows if c.contender == "naive")
        verified = [c.instructions for c in rows if c.contender == NAIVE_VERIFIED]
        for contender in dict.fromkeys(c.contender for c in rows):
            mine = [c for c in rows if c.contender == contender]
            instructions = [c.instructions for c in mine]
            syscalls = [c.syscalls for c in mine]
            beside = f"{min(instructions) / min(verified):.3f}" if verified else "-"
            lines.append(
                f"| {route} | {contender} | "
                f"{', '.join(f'{v / 1e6:.4f} M' for v in instructions)} | "
                f"{_spread(instructions):.2%} | "
                f"{min(instructions) / naive_instructions:.3f} | {beside} | "
                f"{', '.join(f'{v:.2f}' for v in syscalls)} | {_spread(syscalls):.2%} | "
                f"{min(syscalls) - naive_syscalls:+.2f} |"
            )
    return "\n".join(lines)


def clock_table(counts: list[Count]) -> str:
    """``--clock``: the CPU per webhook on the same stream, natively, beside the instruction
    ratio: each run's user + system microseconds, and each ÷ the naive proxy's on the route (the
    least of the runs against the least)."""
    lines = [
        "| route | contender | CPU µs per webhook, user + system (each run) | CPU ÷ naive | "
        "user ÷ naive | system ÷ naive | instructions ÷ naive |",
        "|---|---|---|---|---|---|---|",
    ]
    for route in dict.fromkeys(c.route for c in counts):
        rows = [c for c in counts if c.route == route]
        naive = [c for c in rows if c.contender == "naive"]
        least = {
            "cpu": min(c.user_us + c.system_us for c in naive),
            "user": min(c.user_us for c in naive),
            "system": min(c.system_us for c in naive),
            "instructions": min(c.instructions for c in naive),
        }
        for contender in dict.fromkeys(c.contender for c in rows):
            mine = [c for c in rows if c.contender == contender]
            each = ", ".join(f"{c.user_us:.0f} + {c.system_us:.0f}" for c in mine)
            ratios = [
                min(c.user_us + c.system_us for c in mine) / least["cpu"],
                min(c.user_us for c in mine) / least["user"],
                min(c.system_us for c in mine) / least["system"],
                min(c.instructions for c in mine) / least["instructions"],
            ]
            lines.append(f"| {route} | {contender} | {each} | "
                         + " | ".join(f"{r:.3f}" for r in ratios) + " |")  # fmt: skip
    return "\n".join(lines)


def parts(counts: list[Count]) -> str:
    """What each ablation removes: the proxy's count minus the ablated proxy's, per webhook
    (each run's, so that the spread shows) and as a share of the proxy's (the least)."""
    lines = [
        "| route | part removed | instructions per webhook (each run) | share of the proxy's | "
        "system calls per webhook |",
        "|---|---|---|---|---|",
    ]
    by = {(c.route, c.contender, c.run): c for c in counts}
    for route in dict.fromkeys(c.route for c in counts):
        runs = sorted({c.run for c in counts if c.route == route})
        for contender in dict.fromkeys(c.contender for c in counts if c.route == route):
            if contender in ("proxy", "naive", NAIVE_VERIFIED):
                continue
            proxy = [by[route, "proxy", r] for r in runs]
            ablated = [by[route, contender, r] for r in runs]
            saved = [p.instructions - a.instructions for p, a in zip(proxy, ablated, strict=True)]
            share = min(saved) / min(p.instructions for p in proxy)
            calls = statistics.mean(
                p.syscalls - a.syscalls for p, a in zip(proxy, ablated, strict=True)
            )
            lines.append(
                f"| {route} | {contender} | {', '.join(f'{v / 1e3:,.1f} k' for v in saved)} | "
                f"{share:.1%} | {calls:+.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--webhooks", type=int, default=WEBHOOKS, help="measured, per run")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="webhooks before them")
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--routes", default=",".join(ROUTES), help="plain, stripe or both")
    parser.add_argument("--ablations", default="",
                        help="comma-separated names of bench/ablations/*.patch")  # fmt: skip
    parser.add_argument("--variants", default="", help="comma-separated: also HEAD with one "
                        f"feature on, of {', '.join(VARIANTS)}")  # fmt: skip
    parser.add_argument("--build", choices=BUILDS, default=BUILD,
                        help="the proxy's modules compiled with mypyc as the image has them "
                        "(needs mypy), pure Python, or both: the pure build as contender "
                        "'pure'")  # fmt: skip
    parser.add_argument("--clock", type=int, default=0, metavar="N",
                        help="also each contender's CPU seconds for N webhooks of the same "
                        "stream, natively (0: not measured)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    parser.add_argument("--json", type=Path, help="also write every count here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.ablations.split(",") if n.strip()]
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    known = sorted(p.stem for p in ablate.ABLATIONS.glob("*.patch"))
    if unknown := [n for n in names if n not in known]:
        parser.error(f"no ablation {', '.join(unknown)}: one of {', '.join(known)}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if odd := [v for v in variants if v not in VARIANTS]:
        parser.error(f"no variant {', '.join(odd)}: one of {', '.join(VARIANTS)}")
    if wrong := [r for r in routes if r not in ROUTES]:
        parser.error(f"no route {', '.join(wrong)}: one of {', '.join(ROUTES)}")
    head = ablate._git("rev-parse", "--short", "HEAD").strip()  # what the worktrees check out
    counts = measure(names, routes, webhooks=args.webhooks, warmup=args.warmup, runs=args.runs,
                     variants=variants, build=args.build, clock=args.clock)  # fmt: skip
    command = shlex.join(["python", "bench/meter.py", *(sys.argv[1:] if argv is None else argv)])
    machine = report.machine()
    text = (
        f"`{command}`: {machine.get('nproc', '?')} CPUs; {args.warmup} webhooks of warm-up, "
        f"then {args.webhooks} counted, one at a time, each contender one process, "
        f"{args.runs} run(s); the proxy {BUILT[args.build]}; at `{head}`\n\n{table(counts)}\n"
    )
    if names:
        text += f"\n{parts(counts)}\n"
    if args.clock:
        text += f"\n{clock_table(counts)}\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(c) for c in counts], indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
