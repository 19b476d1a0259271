"""The operator console's pages over a large inbox: each page's render time and size with
100,000 kept rows (and as many claims delivered at the first try beside them).

    python -m bench.console [--dsn postgresql://...] [--kept 100000] [--delivered 100000]

The rows are written straight into a claim table of the bench's own (created as the proxy
creates it): 70 % pending, 20 % dead, 10 % redelivered, received over the last 7 days, each with
a stored request and a 1 KB JSON body. One ``dedup-proxy serve`` process (its console
read-only, its app unreachable and nothing due, so nothing changes the rows) serves the pages;
each is fetched ``--rounds`` times over 127.0.0.1 and its median time and its size printed.
Without ``--dsn`` an embedded PostgreSQL is started in a temporary directory. Every loop is
bounded; the process is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import asyncpg
import yaml

from bench.procs import free_port
from proxy import embedded
from proxy.database import sql
from proxy.database.store import apply_schema

ROUTE: dict[str, object] = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "event_type": "body:/type",
    "redeliver": {"schedule": ["1d"], "for": "30d", "max_pending": 1_000_000},
}
# The kept rows: ID, type, state by position, received over the last week, a JSON body of
# about 1 KB naming one of 1,000 customers.
FILL = """
INSERT INTO {table} (scope, event_id, event_type, received_at, inbox_state, inbox_request,
    inbox_body, inbox_attempts, inbox_failures, inbox_due, inbox_until, inbox_changed)
SELECT 'hooks', 'evt_' || lpad(n::text, 8, '0'), 'type.' || (n % 20),
    now() - make_interval(secs => ($1::int - n) * (604800.0 / $1::int)),
    CASE WHEN n % 10 < 7 THEN 'pending' WHEN n % 10 < 9 THEN 'dead' ELSE 'delivered' END,
    CASE WHEN n % 10 < 9 THEN jsonb_build_object('route', 'hooks', 'upstream',
        'http://127.0.0.1:9', 'method', 'POST', 'target', '/hooks', 'headers',
        jsonb_build_array(jsonb_build_array('Content-Type', 'application/json'),
                          jsonb_build_array('Stripe-Signature', 't=1,v1=' || md5(n::text)))) END,
    CASE WHEN n % 10 < 9 THEN convert_to(json_build_object('id', 'evt_' || lpad(n::text, 8, '0'),
        'type', 'type.' || (n % 20), 'data', json_build_object('object', json_build_object(
        'customer', 'cus_' || (n % 1000), 'pad', repeat('x', 900))))::text, 'UTF8') END,
    jsonb_build_array(jsonb_build_object('at', now(), 'status', 503, 'error', NULL)),
    1, CASE WHEN n % 10 < 7 THEN now() + interval '1 day' END, now() + interval '30 days',
    now()
FROM generate_series(1, $1::int) AS n
"""
DELIVERED = """
INSERT INTO {table} (scope, event_id, event_type, received_at)
SELECT 'hooks', 'ok_' || lpad(n::text, 8, '0'), 'type.' || (n % 20),
    now() - make_interval(secs => ($1::int - n) * (604800.0 / $1::int))
FROM generate_series(1, $1::int) AS n
"""


async def fill(dsn: str, table: str, kept: int, delivered: int) -> None:
    queries = sql.for_table(table)
    connection = await asyncpg.connect(dsn)
    try:
        await apply_schema(connection, queries)
        await connection.execute(FILL.format(table=queries.quoted), kept)
        if delivered:
            await connection.execute(DELIVERED.format(table=queries.quoted), delivered)
        await connection.execute(f"ANALYZE {queries.quoted}")
    finally:
        await connection.close()


async def drop(dsn: str, table: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f"DROP TABLE IF EXISTS {sql.for_table(table).quoted}")
    finally:
        await connection.close()


async def serve(
    dsn: str, table: str, workdir: Path, *, upstream: str = "http://127.0.0.1:9",
    routes: list[dict[str, object]] | None = None, port: int | None = None,
) -> tuple[asyncio.subprocess.Process, str]:  # fmt: skip
    """A ``serve`` process over ``table`` (its webhooks on ``port``): it and its admin URL."""
    port, admin_port = port or free_port(), free_port()
    settings = {
        "listen": f"127.0.0.1:{port}",
        "admin": {"listen": f"127.0.0.1:{admin_port}"},
        "upstream": {"url": upstream},
        "database": {"dsn": dsn, "table": table, "pool_size": 4, "create_schema": False},
        "log": {"format": "json", "level": "warning"},
        "routes": routes or [ROUTE],
    }
    config = workdir / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    log = (workdir / "serve.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config),
        stdout=log, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{admin_port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(300):
            try:
                async with session.get(f"{url}/readyz") as answer:
                    if answer.status == 200:
                        return process, url
            except aiohttp.ClientError:
                pass
            if process.returncode is not None:
                break
            await asyncio.sleep(0.1)
    process.kill()
    await process.wait()
    raise SystemExit(f"serve did not become ready: {(workdir / 'serve.log').read_text()}")


async def measure(url: str, rounds: int, kept: int) -> list[tuple[str, float, int]]:
    console = f"{url}/console/"
    middle = f"{kept // 2:08}"
    pages = {
        "overview": "",
        "kept, newest page": "events",
        "kept, route + pending": "events?route=hooks&state=pending",
        "kept, dead": "events?state=dead",
        "kept, event type": "events?event_type=type.7",
        "kept, since 1 day": "events?since=" + time.strftime(
            "%Y-%m-%dT%H:%M", time.gmtime(time.time() - 86400)),
        "kept, body key": "events?body=data.object.customer%3Dcus_7",
        "kept, by ID": f"events?event_id=evt_{middle}",
        "event": f"event?scope=hooks&id=evt_{middle}",
        "lookup, kept": f"lookup?id=evt_{middle}",
        "lookup, first try": f"lookup?id=ok_{middle}",
        "lookup, missing": "lookup?id=nothing",
    }  # fmt: skip
    results = []
    async with aiohttp.ClientSession() as session:
        # Page 2 and 100 of the newest listing, by their cursors.
        path = "events"
        for number in range(1, 101):
            async with session.get(console + path) as answer:
                text = await answer.text()
            marker = 'href="events?'
            at = text.find(marker, text.find('rel="next"') - 300)
            path = text[at + len('href="') : text.index('"', at + len('href="'))]
            path = path.replace("&amp;", "&")
            if number in (1, 99):
                pages[f"kept, page {number + 1}"] = path
        for name, path in pages.items():
            times = []
            size = 0
            for _ in range(rounds):
                started = time.perf_counter()
                async with session.get(console + path) as answer:
                    body = await answer.read()
                    assert answer.status == 200, (name, answer.status, body[:300])
                times.append((time.perf_counter() - started) * 1000)
                size = len(body)
            results.append((name, statistics.median(times), size))
    return results


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        server = None
        dsn = args.dsn
        if dsn is None:
            server = embedded.EmbeddedPostgres(workdir / "pg")
            dsn = server.start()
        table = f"bench_console_{uuid.uuid4().hex[:8]}"
        process = None
        try:
            started = time.perf_counter()
            await fill(dsn, table, args.kept, args.delivered)
            print(f"filled {args.kept} kept rows and {args.delivered} delivered at the first "
                  f"try in {time.perf_counter() - started:.1f}s")  # fmt: skip
            process, url = await serve(dsn, table, workdir)
            results = await measure(url, args.rounds, args.kept)
            print(f"{'page':<24}{'median ms':>10}{'bytes':>9}")
            for name, ms, size in results:
                print(f"{name:<24}{ms:>10.1f}{size:>9}")
        finally:
            if process is not None and process.returncode is None:
                process.terminate()
                await process.wait()
            await drop(dsn, table)
            if server is not None:
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn")
    parser.add_argument("--kept", type=int, default=100_000)
    parser.add_argument("--delivered", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
