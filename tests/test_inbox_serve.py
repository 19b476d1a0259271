"""The redeliverer in ``dedup-proxy serve`` processes with workers: SIGTERM lets a redelivery
in flight finish, or releases it at shutdown_timeout; either way nothing is lost."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import FakeUpstream, Serve, fetch, wait_until

KEPT = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "redeliver": {"schedule": ["200ms"], "for": "1d"},
}
SETTINGS = {
    "routes": [KEPT],
    "workers": 2,
    "redeliverer": {"poll": "100ms"},
}


async def state(dsn: str, table: str) -> str | None:
    rows = await fetch(dsn, f'SELECT inbox_state FROM "{table}"')
    return rows[0]["inbox_state"] if rows else None


async def exited(process: asyncio.subprocess.Process) -> bool:
    return process.returncode is not None


@pytest.mark.parametrize("finishes", [True, False], ids=["finishes", "released"])
async def test_sigterm_lets_a_redelivery_finish_or_releases_it(
    serve: Serve, upstream: FakeUpstream, pg_dsn: str, table: str, finishes: bool
) -> None:
    upstream.respond = lambda n: web.Response(status=503 if n == 0 else 200)
    served = await serve(**SETTINGS, shutdown_timeout="3s")
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{served.url}/hooks", data=b'{"id": "t1"}') as answer,
    ):
        assert answer.status == 202
    upstream.gate = asyncio.Event()  # the redelivery hangs in the app
    await wait_until(lambda: _received(upstream, 2), "the redelivery to reach the app", within=15)

    served.process.send_signal(signal.SIGTERM)
    if finishes:  # the app answers while the worker drains
        await asyncio.sleep(0.5)
        upstream.gate.set()
    await wait_until(lambda: exited(served.process), "serve to exit", within=30)

    assert served.process.returncode == 0
    if finishes:
        assert await state(pg_dsn, table) == "delivered"
        return
    assert await state(pg_dsn, table) == "pending"  # released: due again, nothing lost
    messages = [line.get("msg", "") for line in served.lines()]
    assert any("still in flight at shutdown_timeout" in m for m in messages)
    upstream.gate.set()
    await serve(**SETTINGS)
    await wait_until(lambda: _state_is(pg_dsn, table, "delivered"), "the next try", 15)
    assert len(upstream.requests) == 3


async def _received(upstream: FakeUpstream, n: int) -> bool:
    return len(upstream.requests) >= n


async def _state_is(dsn: str, table: str, wanted: str) -> bool:
    return await state(dsn, table) == wanted
