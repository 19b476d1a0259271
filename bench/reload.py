"""A reload under traffic: SIGHUP to a ``workers: 2`` proxy while webhooks keep coming.

    python bench/reload.py [--senders 16] [--before 3] [--after 3] [--kept-alive] [--quick]

One proxy with ``workers: 2`` in front of the bench's app and embedded PostgreSQL. ``--senders``
clients send webhooks back to back, each on a new connection (``--kept-alive``: each on one
connection it keeps, as an ingress's pool does); ``--before`` seconds in, the configuration
file gets a second route and the supervisor a SIGHUP; the load goes on until ``--after``
seconds past the supervisor's "reloaded" line. Printed: webhooks sent and answered (and how
every other one ended), how long the reload took (SIGHUP to that line), the webhooks answered
meanwhile, and whether the new route claims.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs, report
from bench.run import Bench, Settings, prepare_database


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.senders, args.before, args.after = 4, 1.0, 1.0
    workdir = Path(tempfile.mkdtemp(prefix="dedup-reload-bench-"))
    bench = Bench(Settings(seconds=0, pool=args.pool, warmup=0), workdir)
    try:
        prepare_database(bench)
        app = bench.start_upstream("app")
        proxy = bench.start_proxy("proxy", app, args.pool, workers=2)
        _wait_for(proxy, "listening", count=2)
        text = asyncio.run(_reload_under_load(proxy, workdir / "proxy.yaml", args))
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)
    command = shlex.join(["python", "bench/reload.py", *(sys.argv[1:] if argv is None
                                                         else argv)])  # fmt: skip
    machine = report.machine()
    print(f"`{command}`: {machine.get('nproc', '?')} CPUs\n\n{text}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--senders", type=int, default=16, help="clients sending at once")
    parser.add_argument("--before", type=float, default=3.0, help="seconds of load before")
    parser.add_argument("--after", type=float, default=3.0, help="seconds of load after")
    parser.add_argument("--pool", type=int, default=8, help="pool_size of each worker")
    parser.add_argument("--kept-alive", action="store_true", help="a connection per sender")
    parser.add_argument("--quick", action="store_true", help="a short run: the harness only")
    return parser


def _lines(proxy: procs.Service) -> list[dict[str, object]]:
    lines = []
    for line in proxy.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:  # a line still being written
                continue
    return lines


def _logged(proxy: procs.Service, start: str) -> list[dict[str, object]]:
    return [x for x in _lines(proxy) if str(x.get("msg", "")).startswith(start)]


def _wait_for(proxy: procs.Service, start: str, count: int = 1, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while len(_logged(proxy, start)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {start!r} line within {within:g}s:\n{proxy.tail()}")
        time.sleep(0.05)


def _add_route(config_file: Path) -> None:
    settings = yaml.safe_load(config_file.read_text())
    settings["routes"].append({"name": "added", "path": "/added", "event_id": "body:/id"})
    config_file.write_text(yaml.safe_dump(settings))


class Load:
    """``senders`` clients sending webhooks back to back until ``stop``; each outcome kept with
    the time it came."""

    def __init__(self, url: str, senders: int, kept_alive: bool) -> None:
        self.url = url
        self.outcomes: list[tuple[float, str]] = []
        self.stopping = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._send(n, kept_alive)) for n in range(senders)]

    async def _send(self, sender: int, kept_alive: bool) -> None:
        connector = aiohttp.TCPConnector(limit=1, force_close=not kept_alive)
        async with aiohttp.ClientSession(connector=connector) as session:
            n = 0
            while not self.stopping.is_set():
                body = json.dumps({"id": f"reload-{sender}-{n}"})
                try:
                    async with session.post(f"{self.url}/hook", data=body) as response:
                        await response.read()
                        outcome = str(response.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    outcome = type(exc).__name__
                self.outcomes.append((time.monotonic(), outcome))
                n += 1

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self.tasks)


async def _reload_under_load(
    proxy: procs.Service, config_file: Path, args: argparse.Namespace
) -> str:
    url = f"http://127.0.0.1:{proxy.port}"
    load = Load(url, args.senders, args.kept_alive)
    try:
        await asyncio.sleep(args.before)
        await asyncio.to_thread(_add_route, config_file)
        hangup = time.monotonic()
        proxy.process.send_signal(signal.SIGHUP)
        await asyncio.to_thread(_wait_for, proxy, "reloaded")
        reloaded = time.monotonic()
        await asyncio.sleep(args.after)
    finally:
        await load.stop()
    async with aiohttp.ClientSession() as session:
        statuses = []
        for _ in range(2):
            async with session.post(f"{url}/added", data='{"id": "reload-added"}') as response:
                statuses.append(response.headers.get("Dedup-Status"))
    ends = collections.Counter(outcome for _, outcome in load.outcomes)
    during = sum(
        1 for at, outcome in load.outcomes if hangup <= at <= reloaded and outcome == "200"
    )
    (line,) = _logged(proxy, "reloaded")
    mode = "kept-alive connections" if args.kept_alive else "a new connection per webhook"
    others = ", ".join(f"{n} {end}" for end, n in sorted(ends.items()) if end != "200") or "none"
    return "\n".join([
        f"| {args.senders} senders, {mode} | |",
        "|---|---|",
        f"| webhooks sent | {len(load.outcomes):,} |",
        f"| answered 200 | {ends['200']:,} |",
        f"| ended otherwise | {others} |",
        f"| SIGHUP to 'reloaded' | {reloaded - hangup:.2f} s |",
        f"| answered 200 meanwhile | {during:,} |",
        f"| supervisor's line | {line['msg']} |",
        f"| the added route, a copy sent twice | {statuses[1] or 'not claimed'} |",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
