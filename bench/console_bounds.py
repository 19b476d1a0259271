"""What one console page costs a ``dedup-proxy serve`` process: its RSS (and peak) before and
after an event page of a kept body of 19.5 MiB, and two body-filter pages over 120 kept bodies
of 1 MiB; and the slowest ``/healthz`` answer while each is served (polled every 10 ms).
``--lookups``: instead, the webhooks' median answer alone and while 16 loops ask the console's
"Was this event processed?" over 400,000 claims of a route with a path parameter.

    python -m bench.console_bounds [--dsn postgresql://...] [--proxy /work/main] [--lookups]

``--proxy``: the checkout whose ``proxy`` package the served process runs (to compare a release
with this one). Without ``--dsn`` an embedded PostgreSQL is started in a temporary directory;
the process is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import aiohttp.web
import asyncpg

from bench import console as console_bench
from bench import procs
from proxy import embedded
from proxy.database import sql
from proxy.database.store import apply_schema

MIB = 1024 * 1024
# A kept row like the bench's (bench/console.py), its body given as $1.
KEEP = """
INSERT INTO {table} (scope, event_id, event_type, received_at, inbox_state, inbox_request,
    inbox_body, inbox_attempts, inbox_failures, inbox_due, inbox_until, inbox_changed)
VALUES ('hooks', $2, 'push', now(), 'pending', jsonb_build_object('route', 'hooks', 'upstream',
    'http://127.0.0.1:9', 'method', 'POST', 'target', '/hooks', 'headers', '[]'::jsonb), $1,
    '[]'::jsonb, 1, now() + interval '1 day', now() + interval '30 days', now())
"""


def body(event_id: str, size: int) -> bytes:
    """A GitHub-like JSON body of ``size`` bytes: many small objects (as a push's commits)."""
    head = f'{{"id": "{event_id}", "data": {{"object": {{"customer": "cus_7"}}}}, "commits": ['
    item = '{"id": "0123456789abcdef", "message": "fix", "added": ["a.py", "b.py"]}, '
    count = (size - len(head) - 2) // len(item)
    text = head + item * count
    return (text[:-2] + "]}").encode().ljust(size, b" ")


def rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, MiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return tuple(int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


async def while_serving(url: str, paths: list[str]) -> tuple[list[int], float]:
    """The pages' statuses, and the slowest /healthz answer while they were served (ms)."""
    async with aiohttp.ClientSession() as session:
        done = asyncio.Event()
        slowest = 0.0

        async def poll() -> None:
            nonlocal slowest
            for _ in range(6000):  # bounded: a minute at most
                if done.is_set():
                    return
                started = time.perf_counter()
                async with session.get(f"{url}/healthz") as answer:
                    await answer.read()
                slowest = max(slowest, (time.perf_counter() - started) * 1000)
                await asyncio.sleep(0.01)

        async def get(path: str) -> int:
            async with session.get(f"{url}/console/{path}") as answer:
                await answer.read()
                return answer.status

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.05)
        statuses = await asyncio.gather(*(get(path) for path in paths))
        done.set()
        await poller
    return list(statuses), slowest


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        server = None
        dsn = args.dsn
        if dsn is None:
            server = embedded.EmbeddedPostgres(workdir / "pg")
            dsn = server.start()
        table = f"bench_bounds_{uuid.uuid4().hex[:8]}"
        process = None
        if args.lookups:
            try:
                await lookups(args, dsn, workdir, table)
            finally:
                await console_bench.drop(dsn, table)
                if server is not None:
                    server.stop()
            return
        try:
            connection = await asyncpg.connect(dsn)
            try:
                await apply_schema(connection, sql.for_table(table))
                keep = KEEP.format(table=f'"{table}"')
                await connection.execute(keep, body("evt_big", int(19.5 * MIB)), "evt_big")
                for n in range(120):
                    await connection.execute(keep, body(f"evt_{n}", MIB), f"evt_{n}")
            finally:
                await connection.close()
            cases = {
                "event page, 19.5 MiB body": ["event?scope=hooks&id=evt_big"],
                "2 body filters, 120 x 1 MiB": ["events?body=data.object.customer%3Dcus_7"] * 2,
            }
            for name, paths in cases.items():  # each in a process of its own: its own peak
                process, url = await console_bench.serve(dsn, table, workdir)
                before = rss(process.pid)
                statuses, slowest = await while_serving(url, paths)
                after = rss(process.pid)
                print(f"{name}: {statuses}; RSS {before[0]:.0f} -> {after[0]:.0f} MiB "
                      f"(peak {after[1]:.0f}); slowest /healthz {slowest:.0f} ms")  # fmt: skip
                process.terminate()
                await process.wait()
        finally:
            if process is not None and process.returncode is None:
                process.terminate()
                await process.wait()
            await console_bench.drop(dsn, table)
            if server is not None:
                server.stop()


LOOKUP_ROUTES: list[dict[str, object]] = [
    {"name": "hooks", "path": "/hooks", "event_id": "body:/id"},
    {"name": "tenants", "path": "/t/{tenant}/hooks", "event_id": "body:/id"},
]
CLAIMS = """
INSERT INTO {table} (scope, event_id, received_at)
SELECT 'tenants/t' || (n % 100), 'evt_' || n, now() - make_interval(secs => n)
FROM generate_series(1, $1::int) AS n
"""


async def webhooks(session: aiohttp.ClientSession, url: str, prefix: str, count: int) -> float:
    """The median answer (ms) of ``count`` new webhooks sent one after the other."""
    took = []
    for n in range(count):
        started = time.perf_counter()
        async with session.post(f"{url}/hooks", data=f'{{"id": "{prefix}{n}"}}') as answer:
            await answer.read()
            assert answer.status == 200, answer.status
        took.append((time.perf_counter() - started) * 1000)
    return sorted(took)[len(took) // 2]


async def lookups(args: argparse.Namespace, dsn: str, workdir: Path, table: str) -> None:
    """Webhooks' median alone, then with 16 lookup loops over 400,000 claims."""
    connection = await asyncpg.connect(dsn)
    try:
        await apply_schema(connection, sql.for_table(table))
        await connection.execute(CLAIMS.format(table=f'"{table}"'), 400_000)
        await connection.execute(f'ANALYZE "{table}"')
    finally:
        await connection.close()
    app = aiohttp.web.Application()
    app.router.add_post("/{tail:.*}", _ok)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    app_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    port = procs.free_port()
    process, admin = await console_bench.serve(
        dsn, table, workdir, upstream=app_url, routes=LOOKUP_ROUTES, port=port
    )
    proxy_url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            alone = await webhooks(session, proxy_url, "alone_", 300)
            stop = asyncio.Event()
            asked = 0
            statuses: dict[int, int] = {}

            async def loop(n: int) -> None:
                nonlocal asked
                for k in range(100_000):  # bounded; stopped long before
                    if stop.is_set():
                        return
                    target = (
                        f"{admin}/console/lookup?id=gone_{n}_{k}"  # never claimed: read to the end
                    )
                    async with session.get(target) as answer:
                        await answer.read()
                        statuses[answer.status] = statuses.get(answer.status, 0) + 1
                    asked += 1

            loops = [asyncio.create_task(loop(n)) for n in range(16)]
            await asyncio.sleep(1)
            during = await webhooks(session, proxy_url, "during_", 1500)
            stop.set()
            await asyncio.gather(*loops)
        print(f"400,000 claims: webhooks' median {alone:.1f} ms alone, {during:.1f} ms with 16 "
              f"lookup loops ({asked} lookups answered meanwhile: {statuses})")  # fmt: skip
    finally:
        process.terminate()
        await process.wait()
        await runner.cleanup()


async def _ok(request: aiohttp.web.Request) -> aiohttp.web.Response:
    await request.read()
    return aiohttp.web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn")
    parser.add_argument("--proxy", help="the checkout whose proxy package is served")
    parser.add_argument("--lookups", action="store_true", help="the lookup loops' case alone")
    args = parser.parse_args()
    if args.proxy:
        os.environ["PYTHONPATH"] = str(Path(args.proxy).resolve())
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
