"""One captured signed body against the inbox (``redeliver``): how many rows 50 replays of it
under fresh delivery IDs leave kept, and whether a genuine failure after them is still kept
(issue 36, finding 3); and whether one tenant filling its cap leaves another tenant's failures
kept (finding 7).

    python -m bench.inbox_replay [--dsn postgresql://...] [--checkout /path/to/other/checkout]

One ``dedup-proxy serve`` (from ``--checkout``: an older commit, say, so that both are measured
by the same probe) in front of an app that fails every request (``--status``, 422 by default:
kept as dead letters, as the probe found them). Its routes: GitHub with ``verify`` and
``redeliver`` (``max_pending: 40``), and a templated Stripe route with ``tenant_secrets`` and
``max_pending: 2``. The kept rows are counted in the claim table. Without ``--dsn`` an
embedded PostgreSQL is started in a temporary directory. Every loop is bounded; everything runs
on 127.0.0.1 and is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import yaml
from aiohttp import web

from bench.procs import free_port
from proxy import embedded

GITHUB_SECRET = "github-probe"
TENANTS = {"acme": "whsec_acme_probe", "globex": "whsec_globex_probe"}
MAX_PENDING = 40
TENANT_MAX_PENDING = 2


def github_headers(body: bytes, delivery: str) -> dict[str, str]:
    mac = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {
        "X-GitHub-Delivery": delivery,
        "X-GitHub-Hook-ID": "4242",
        "X-GitHub-Event": "pull_request",
        "X-Hub-Signature-256": f"sha256={mac}",
        "Content-Type": "application/json",
    }


def stripe_headers(body: bytes, secret: str) -> dict[str, str]:
    stamp = str(int(time.time()))
    mac = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={stamp},v1={mac}", "Content-Type": "application/json"}


async def start_app(status: int) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=status, text="failing")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


class Proxy:
    def __init__(self, checkout: Path, dsn: str, upstream: str, workdir: Path) -> None:
        self.port = free_port()
        self.table = f"inbox_replay_{os.getpid()}_{self.port}"
        redeliver = {"schedule": ["1h"], "for": "1d"}
        config = {
            "listen": f"127.0.0.1:{self.port}",
            "admin": {"listen": f"127.0.0.1:{free_port()}"},
            "upstream": {"url": upstream},
            "database": {"dsn": dsn, "table": self.table, "pool_size": 4},
            "log": {"format": "json", "level": "error"},
            "routes": [
                {"name": "github", "path": "/github", "preset": "github",
                 "verify": {"secret": GITHUB_SECRET},
                 "redeliver": {**redeliver, "max_pending": MAX_PENDING}},
                {"name": "tenants", "path": "/tenants/{tenant}", "preset": "stripe",
                 "verify": {"tenant_secrets": TENANTS},
                 "redeliver": {**redeliver, "max_pending": TENANT_MAX_PENDING}},
            ],
        }  # fmt: skip
        self.path = workdir / f"config-{self.port}.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.checkout = checkout

    async def __aenter__(self) -> Proxy:
        env = {**os.environ, "PYTHONPATH": str(self.checkout)}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(self.path),
            cwd=self.checkout, env=env, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(300):
            if self.process.returncode is not None:
                raise RuntimeError(f"the proxy exited with {self.process.returncode}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return self
            except OSError:
                await asyncio.sleep(0.1)
        raise RuntimeError("the proxy did not listen within 30 s")

    async def __aexit__(self, *exc: object) -> None:
        self.process.kill()
        await self.process.wait()


async def post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> int:
    async with session.post(url, data=body, headers=headers) as response:
        await response.read()
        return response.status


async def kept(dsn: str, table: str, scope: str | None = None) -> int:
    connection = await asyncpg.connect(dsn)
    try:
        count: int = await connection.fetchval(
            f"SELECT count(*) FROM \"{table}\" WHERE inbox_state IN ('pending', 'dead') "
            "AND ($1::text IS NULL OR scope = $1)",
            scope,
        )
        return count
    finally:
        await connection.close()


async def drop(dsn: str, table: str) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f'DROP TABLE IF EXISTS "{table}"')
    finally:
        await connection.close()


def tally(statuses: list[int]) -> str:
    return ", ".join(f"{count} x {status}" for status, count in sorted(Counter(statuses).items()))


async def probe(args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    app, url = await start_app(args.status)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            proxy = Proxy(args.checkout, dsn, url, Path(tmp))
            try:
                async with (
                    proxy,
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
                ):
                    base = f"http://127.0.0.1:{proxy.port}"
                    captured = json.dumps({"action": "opened", "number": 1}).encode()
                    replays = [
                        await post(session, f"{base}/github", captured,
                                   github_headers(captured, str(uuid.uuid4())))
                        for _ in range(args.replays)
                    ]  # fmt: skip
                    results[f"{args.replays} replays of one captured body answered"] = tally(
                        replays
                    )
                    results[
                        f"inbox rows after {args.replays} replays of one captured body"
                    ] = await kept(dsn, proxy.table)
                    genuine = json.dumps({"action": "opened", "number": 2}).encode()
                    status = await post(
                        session, f"{base}/github", genuine, github_headers(genuine, "genuine")
                    )
                    results["a genuine failure afterwards answered"] = (
                        f"{status} ({'kept' if status == 202 else 'relayed, not kept'})"
                    )
                    acme = []
                    for n in range(TENANT_MAX_PENDING + 1):
                        body = json.dumps({"id": f"evt_a{n}", "type": "x"}).encode()
                        acme.append(await post(session, f"{base}/tenants/acme", body,
                                               stripe_headers(body, TENANTS["acme"])))  # fmt: skip
                    body = json.dumps({"id": "evt_g0", "type": "x"}).encode()
                    globex = await post(
                        session, f"{base}/tenants/globex", body,
                        stripe_headers(body, TENANTS["globex"]),
                    )  # fmt: skip
                    results[f"tenant acme's {TENANT_MAX_PENDING + 1} failures answered"] = tally(
                        acme
                    )
                    results["then tenant globex's failure answered"] = (
                        f"{globex} ({'kept' if globex == 202 else 'relayed, not kept'})"
                    )
            finally:
                await drop(dsn, proxy.table)
    finally:
        await app.cleanup()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="an existing PostgreSQL (default: an embedded one)")
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--status", type=int, default=422, help="what the app answers")
    args = parser.parse_args()
    server = None
    with tempfile.TemporaryDirectory() as tmp:
        dsn = args.dsn
        if dsn is None:
            server = embedded.EmbeddedPostgres(Path(tmp) / "pg")
            dsn = server.start()
        try:
            print(f"checkout: {args.checkout}")
            for name, value in asyncio.run(probe(args, dsn)).items():
                print(f"{name}: {value}")
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
