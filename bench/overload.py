"""Peak memory of one proxy under a burst of large webhooks, against its max_buffered budget.

    python bench/overload.py --dsn postgresql://... [--count 150] [--size 9MiB]
                             [--max-buffered 64MiB] [--app-delay 0.2]

Starts a slow stand-in app and ``dedup-proxy serve`` (default settings but the ones given),
sends ``--count`` webhooks of ``--size`` bytes at once (one body object shared by every
request; the event ID is in a header), and prints what each got and the proxy's peak RSS
(VmHWM) against its resident size at start plus ``max_buffered``. Loopback only; every wait
is bounded; the processes it starts it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import io
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
import yaml
from aiohttp import web

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import procs
from proxy.config import values

MIB = 1024 * 1024


@dataclass
class Result:
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    app_calls: collections.Counter[str] = field(default_factory=collections.Counter)
    claimed: set[str] = field(default_factory=set)
    rss_start: int = 0
    rss_peak: int = 0
    max_buffered: int = 0
    seconds: float = 0.0

    def report(self) -> str:
        over = self.rss_peak - self.rss_start
        return (
            f"answers: {dict(self.statuses)}; app calls: {sum(self.app_calls.values())} for "
            f"{len(self.app_calls)} events (each once: {set(self.app_calls.values()) <= {1}}); "
            f"claims: {len(self.claimed)}\n"
            f"proxy RSS: {self.rss_start / MIB:.0f} MiB at start, peak {self.rss_peak / MIB:.0f}"
            f" MiB (+{over / MIB:.0f} MiB) with max_buffered {self.max_buffered / MIB:.0f} MiB"
            f"; {self.seconds:.1f} s"
        )


def _kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(key)


async def run(  # noqa: PLR0915 (one scenario, read top to bottom)
    dsn: str, count: int, size: int, *, max_buffered: int | None, app_delay: float,
    table: str = "overload_events", within: float = 120.0,
) -> Result:  # fmt: skip
    """One burst; the table is dropped first and left for inspection."""
    result = Result()
    connection = await asyncpg.connect(dsn)
    await connection.execute(f'DROP TABLE IF EXISTS "{table}"')

    async def app_handler(request: web.Request) -> web.Response:
        await request.read()
        result.app_calls[request.headers["X-Event-Id"]] += 1
        await asyncio.sleep(app_delay)
        return web.Response(text="ok")

    app = web.Application(client_max_size=size + MIB)
    app.router.add_post("/load", app_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    app_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    folder = Path(tempfile.mkdtemp(prefix="overload-"))
    port, admin = procs.free_port(), procs.free_port()
    settings: dict[str, object] = {
        "listen": f"127.0.0.1:{port}",
        "admin": {"listen": f"127.0.0.1:{admin}"},
        "upstream": {"url": f"http://127.0.0.1:{app_port}"},
        "database": {"dsn": dsn, "table": table},
        "log": {"level": "error"},
        "routes": [
            {"name": "load", "path": "/load", "event_id": "header:X-Event-Id", "max_body": size}
        ],
    }
    if max_buffered is not None:
        settings["max_buffered"] = max_buffered
    (folder / "config.yaml").write_text(yaml.safe_dump(settings))
    proxy = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(folder / "config.yaml"),
        stdout=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        async with asyncio.timeout(30):
            while not await _accepts(port):  # noqa: ASYNC110 (polling another process)
                await asyncio.sleep(0.05)
        result.rss_start = _kib(proxy.pid, "VmRSS")
        result.max_buffered = max_buffered or 64 * MIB
        body = b"x" * size
        started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=within)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def send(n: int) -> str:
                try:
                    async with session.post(
                        # BytesIO shares the one body object (aiohttp warns on large bytes).
                        f"http://127.0.0.1:{port}/load", data=io.BytesIO(body),
                        headers={"X-Event-Id": f"evt-{n}"},
                    ) as response:  # fmt: skip
                        await response.read()
                        retry = response.headers.get("Retry-After")
                        return f"{response.status}" + (" Retry-After" if retry else "")
                except aiohttp.ClientError as exc:
                    return type(exc).__name__

            answers = await asyncio.gather(*(send(n) for n in range(count)))
        result.seconds = time.monotonic() - started
        result.statuses.update(answers)
        result.rss_peak = _kib(proxy.pid, "VmHWM")
        rows = await connection.fetch(f'SELECT event_id FROM "{table}"')
        result.claimed = {row["event_id"] for row in rows}
    finally:
        if proxy.returncode is None:
            proxy.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proxy.wait(), 30)
            except TimeoutError:
                proxy.kill()
                await proxy.wait()
        await runner.cleanup()
        await connection.close()
    return result


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("DEDUP_PROXY_TEST_DSN"), required=False)
    parser.add_argument("--count", type=int, default=150)
    parser.add_argument("--size", type=values.parse_size, default=9 * MIB)
    parser.add_argument("--max-buffered", type=values.parse_size, default=None)
    parser.add_argument("--app-delay", type=float, default=0.2)
    parser.add_argument("--table", default="overload_events")
    parser.add_argument("--within", type=float, default=120.0, help="seconds the burst may take")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if not args.dsn:
        parser.error("--dsn (or DEDUP_PROXY_TEST_DSN) is required")
    result = asyncio.run(
        run(
            args.dsn, args.count, args.size, max_buffered=args.max_buffered,
            app_delay=args.app_delay, table=args.table, within=args.within,
        )
    )  # fmt: skip
    if args.json:
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        print(json.dumps({**fields, "claimed": sorted(result.claimed)}))
    else:
        print(f"{args.count} x {args.size / MIB:g} MiB: {result.report()}")


if __name__ == "__main__":
    main()
