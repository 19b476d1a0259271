"""What test modules share besides fixtures: the recording fake upstream, the test database's
queries, waiting with a deadline, webhook bodies, ``dedup-proxy`` run as a process, and raw
HTTP/1.1 connections. Fixtures live in ``conftest.py``; a test module imports this one and no
other test module.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import asyncpg
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy import admin, app, app_keys, config, errors, reconciler, retention
from tests.faults.relay import Relay

WITHIN = 10.0  # the default bound on every wait for the proxy (an answer, a close, a start)
MIB = 1024 * 1024
CORVEL = {"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}

# --- the app behind the proxy -------------------------------------------------------------


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
    # The paths of the requests whose heads arrived, before their bodies are read.
    started: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.started.append(request.path_qs)
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


MakeProxy = Callable[..., Awaitable[TestClient[Any, Any]]]

# --- webhooks -----------------------------------------------------------------------------

STRIPE_SECRET = "whsec_test_secret_for_the_proxy"


class SlowApp:
    """An app that takes ``delay`` per webhook: records each body it took and the most
    requests it had at once."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.now = 0
        self.peak = 0
        self.took: list[bytes] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.now -= 1
        self.took.append(body)
        return web.Response(text="ok")


async def slow_app(aiohttp_server: Any, delay: float) -> tuple[SlowApp, str]:
    stand_in = SlowApp(delay)
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", stand_in.handle)
    server = await aiohttp_server(application)
    return stand_in, str(server.make_url("")).rstrip("/")


def event(event_id: object, event_type: str = "charge.succeeded", **extra: Any) -> bytes:
    """A JSON event as providers send them: its ID, its type, and ``extra`` fields."""
    return json.dumps({"id": event_id, "type": event_type, **extra}).encode()


def stripe_headers(
    body: bytes, secret: str = STRIPE_SECRET, at: int | None = None
) -> dict[str, str]:
    """Stripe's signature headers for ``body``, signed at ``at`` (default: now)."""
    timestamp = int(time.time()) if at is None else at
    signed = f"{timestamp}.".encode() + body
    signature = hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={timestamp},v1={signature}", "Content-Type": "application/json"}


def stripe_route(**extra: Any) -> dict[str, Any]:
    return {
        "name": "stripe",
        "path": "/webhooks/stripe",
        "preset": "stripe",
        "verify": {"secrets": [STRIPE_SECRET]},
        **extra,
    }


GITHUB_SECRET = "It's a Secret to Everybody"


def github_route(**extra: Any) -> dict[str, Any]:
    """A GitHub route with ``verify``: its claims are bound to the body (``webhooks.bound``)."""
    return {"name": "github", "path": "/webhooks/github", "preset": "github",
            "verify": {"secret": GITHUB_SECRET}, **extra}  # fmt: skip


def github_headers(body: bytes, delivery: str, hook: str = "1") -> dict[str, str]:
    """A delivery as GitHub signs it: its event ID on the proxy is ``f"{hook}:{delivery}"``."""
    signature = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    return {"X-GitHub-Delivery": delivery, "X-GitHub-Hook-ID": hook, "X-GitHub-Event": "push",
            "X-Hub-Signature-256": f"sha256={signature}",
            "Content-Type": "application/json"}  # fmt: skip


# --- the test database and the app's state ------------------------------------------------


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
    """The committed claims, as (scope, event_id, event_type), sorted (not the rows that
    record since when a route's claims are bound, ``sql.ID_FORMS``)."""
    rows = await fetch(
        dsn,
        f"SELECT scope, event_id, event_type FROM \"{table}\" WHERE scope <> '~id-forms' "
        "ORDER BY 1, 2",
    )
    return [(r["scope"], r["event_id"], r["event_type"]) for r in rows]


def held(client: TestClient[Any, Any]) -> int:
    """The bytes the proxy's memory budget holds now."""
    return client.app[app_keys.BUDGET].held


async def start_up(cfg: config.Config) -> None:
    """Start the app as ``serve`` does, and clean up whatever started."""
    runner = web.AppRunner(app.create_app(cfg))
    try:
        await runner.setup()
    finally:
        await runner.cleanup()


async def admin_client(aiohttp_client: Any, proxy: TestClient[Any, Any]) -> TestClient[Any, Any]:
    """A client of ``proxy``'s admin application (metrics, health, readiness)."""
    client: TestClient[Any, Any] = await aiohttp_client(admin.create_admin_app(proxy.app))
    return client


async def scrape(
    client: TestClient[Any, Any],
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on /metrics, keyed by (name, sorted labels)."""
    response = await client.get("/metrics")
    assert response.status == 200
    samples = {}
    for family in text_string_to_metric_families(await response.text()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metrics_text(proxy: TestClient[Any, Any]) -> str:
    """The proxy's /metrics text, its buffered samples flushed first."""
    meters = proxy.app[app_keys.METRICS]
    meters.flush()
    return generate_latest(meters.registry).decode()


async def reaches_database(proxy: TestClient[Any, Any]) -> bool:
    """Whether the proxy's store answers (a lookup of a probe ID on its first route)."""
    cfg = proxy.app[app_keys.CONFIG]
    try:
        await proxy.app[app_keys.STORE].resolve(cfg.routes[0].scope, ["probe"])
    except errors.StoreUnavailable:
        return False
    return True


@contextlib.asynccontextmanager
async def database_relay(dsn: str) -> AsyncIterator[tuple[Relay, str]]:
    """A TCP fault relay (``tests.faults.relay``) in front of ``dsn``'s server, and the DSN
    through it: cut, refuse or pass the proxy's database link. Needs ``RELAY_IN_LOOP`` in the
    test module (the relay is written for asyncio's transports: conftest)."""
    parts = urlsplit(dsn)
    host = parse_qs(parts.query).get("host", [parts.hostname or ""])[0]
    port = parts.port or 5432
    link = Relay(f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port))
    await link.start()
    try:
        password = f":{parts.password}" if parts.password else ""
        user = parts.username or "postgres"
        yield link, f"postgresql://{user}{password}@127.0.0.1:{link.port}{parts.path}"
    finally:
        await link.close()


def sweeper_of(proxy: TestClient[Any, Any]) -> retention.Sweeper:
    """A retention sweeper over the proxy's own store and configuration."""
    cfg = proxy.app[app_keys.CONFIG]
    return retention.Sweeper(
        proxy.app[app_keys.STORE], cfg.routes, cfg.sweeper,
        proxy.app[app_keys.METRICS],
    )  # fmt: skip


def logged_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The ``error`` of each canonical request line logged (the details an answer omits)."""
    lines = [r.fields for r in caplog.records if hasattr(r, "fields")]
    return [line["error"] for line in lines if "error" in line]


# --- waiting ------------------------------------------------------------------------------


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


# --- dedup-proxy as a process -------------------------------------------------------------


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, never one handed out before in this process (the kernel can
    give a released port again at once), and, under pytest-xdist, one of this worker's own
    (by its index among the workers): two workers never hand out the same port."""
    share = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    mine = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % share
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        # port // 2: Linux hands bind() even ports by preference (connect() the odd ones).
        if port // 2 % share == mine and port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no new free port after 1000 tries ({len(_handed_out)} handed out)")


async def accepts(port: int) -> bool:
    """Whether a connection to 127.0.0.1:port is accepted."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def run_python(
    *args: str, env: Mapping[str, str] | None = None, within: float = 60, cwd: Path | None = None
) -> tuple[int, str, str]:
    """Run ``python *args`` to its end (in ``cwd``, else here): (exit status, stdout, stderr).
    ``env`` is added to the environment; a process still running after ``within`` seconds is
    killed and fails the test."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, *args, env={**os.environ, **(env or {})}, cwd=cwd,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = await asyncio.wait_for(process.communicate(), within)
    except TimeoutError:
        process.kill()
        await process.wait()
        pytest.fail(f"python {' '.join(args)} did not exit within {within:g}s")
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


async def run_cli(*args: str, env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """``dedup-proxy *args`` to its end: (exit status, stdout, stderr)."""
    return await run_python("-m", "proxy", *args, env=env)


def serve_settings(url: str, dsn: str, table: str, /, **overrides: Any) -> dict[str, Any]:
    """A ``serve`` configuration on free loopback ports, JSON logs and the route ``corvel``;
    keyword arguments override top-level keys (a dict is merged into the default's)."""
    settings: dict[str, Any] = {
        "listen": f"127.0.0.1:{free_port()}",
        "admin": {"listen": f"127.0.0.1:{free_port()}"},
        "upstream": {"url": url, "timeout": "30s"},
        "database": {"dsn": dsn, "table": table, "pool_size": 4},
        "log": {"format": "json"},
        "routes": [CORVEL],
    }
    for key, value in overrides.items():
        merge = isinstance(value, dict) and isinstance(settings.get(key), dict)
        settings[key] = {**settings[key], **value} if merge else value
    return settings


def _ports(config_file: Path) -> tuple[int, int]:
    """The ports of ``listen`` and ``admin.listen`` in a configuration file."""
    settings = yaml.safe_load(config_file.read_text())
    listen, admin = settings["listen"], settings["admin"]["listen"]
    return int(listen.rpartition(":")[2]), int(admin.rpartition(":")[2])


@dataclass
class Served:
    """A ``dedup-proxy serve`` process, its ports, and its log in a file."""

    process: asyncio.subprocess.Process
    config_file: Path
    port: int
    admin_port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def output(self) -> str:
        """Everything it printed so far."""
        return self.log.read_text() if self.log.exists() else ""

    def lines(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far."""
        return [json.loads(line) for line in self.output().splitlines() if line.startswith("{")]

    def workers(self) -> list[int]:
        """The process's live children (the workers of a supervisor)."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in path.read_text().split()] if path.exists() else []

    async def metrics(self) -> dict[str, float]:
        """Every sample on the admin listener's /metrics, keyed by its name and labels."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{self.admin_url}/metrics") as response,
        ):
            text = await response.text()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    async def kill(self) -> None:
        """SIGKILL the process and its workers, if still running."""
        if self.process.returncode is None:
            for pid in self.workers():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.kill()
            await self.process.wait()


Serve = Callable[..., Awaitable[Served]]  # conftest's ``serve`` fixture


def open_files_limit(nofile: tuple[int, int]) -> Callable[[], None]:
    """A ``preexec_fn`` that sets the child's RLIMIT_NOFILE to (soft, hard)."""
    return lambda: resource.setrlimit(
        resource.RLIMIT_NOFILE, nofile
    )  # conftest's ``serve`` fixture


async def start_serve(
    config_file: Path,
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> Served:
    """Start ``serve`` on ``config_file``, its output to ``log``; ``env`` is added to the
    environment. Returns once it accepts connections; fails the test (with its log) if it
    exits first, and kills it if it does not listen in time."""
    port, admin_port = _ports(config_file)
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(config_file),
            stdout=out, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **(env or {})},
            cwd=cwd, preexec_fn=preexec_fn,
        )  # fmt: skip
    served = Served(process, config_file, port, admin_port, log)

    async def listening() -> bool:
        if process.returncode is not None:
            pytest.fail(f"serve exited {process.returncode}:\n{served.output()}")
        return await accepts(served.port)

    try:
        await wait_until(listening, "serve to listen", within=30)
    except BaseException:
        await served.kill()
        raise
    return served


def accepted_by(pid: int, port: int) -> set[int]:
    """The client ports of the connections to ``port`` that process ``pid`` holds open."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, state, *_, inode = line.split()[:10]
        ours = f"socket:[{inode}]" in held
        if ours and state == "01" and int(local.rpartition(":")[2], 16) == port:
            ports.add(int(remote.rpartition(":")[2], 16))
    return ports


# --- raw HTTP/1.1 connections -------------------------------------------------------------

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
RawServer = Callable[[Handler], Awaitable[str]]  # conftest's ``raw_server`` fixture


def webhook_request(event_id: str, *headers: bytes) -> bytes:
    """A raw POST of ``{"id": event_id}`` to /webhooks/corvel, with ``headers`` (raw lines)."""
    body = json.dumps({"id": event_id}).encode()
    lines = b"".join(header + b"\r\n" for header in headers)
    head = b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\n" + lines
    return head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


def content_length(head: bytes) -> int:
    """The Content-Length a raw request head declares (0 without one)."""
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.partition(b":")[2])
    return 0


async def open_stream(port: int) -> Stream:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WITHIN)


@contextlib.asynccontextmanager
async def connection(client: TestClient[Any, Any]) -> AsyncIterator[Stream]:
    """A raw TCP connection to the proxy under test, closed afterwards."""
    assert client.server.port is not None
    reader, writer = await open_stream(client.server.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(writer.wait_closed(), WITHIN)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


async def read_answer(reader: asyncio.StreamReader, within: float = WITHIN) -> Answer | None:
    """The next answer on the connection, or None when the proxy closed (or reset) it without
    one. A truncated answer, or neither an answer nor a close within ``within``, fails."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), within)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            pytest.fail(f"truncated answer {exc.partial!r}")
        return None
    except ConnectionResetError:
        return None
    except TimeoutError:
        pytest.fail(f"the proxy neither answered nor closed the connection in {within:g}s")
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    match = re.fullmatch(r"HTTP/1\.[01] (\d{3})(?: .*)?", status_line)
    assert match, f"not an HTTP status line: {status_line!r}"
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(reader.readexactly(length), within)
    return Answer(int(match[1]), headers, body)


async def send(stream: Stream, data: bytes, within: float = WITHIN) -> Answer | None:
    """Write ``data`` and read the answer (None when the proxy closed instead)."""
    reader, writer = stream
    writer.write(data)
    try:
        await writer.drain()
    except (ConnectionResetError, BrokenPipeError):
        return None
    return await read_answer(reader, within)


async def status(stream: Stream, data: bytes) -> int | None:
    """The status of the answer to ``data``, or None when the proxy closed instead."""
    answer = await send(stream, data)
    return None if answer is None else answer.status


async def closed(stream: Stream, what: str, within: float = WITHIN) -> None:
    """Wait for the proxy to close the connection, sending nothing more; else fail the test."""
    try:
        rest = await asyncio.wait_for(stream[0].read(), within)
    except TimeoutError:
        pytest.fail(f"the proxy did not close {what} within {within:g}s")
    except ConnectionResetError:
        rest = b""
    assert rest == b"", f"{what} got {rest!r}"


async def reconcile_once(
    proxy: TestClient[Any, Any],
    *,
    open_log: reconciler.DeliveryLogFactory = reconciler.delivery_log,
    **kwargs: Any,
) -> reconciler.Report:
    """One reconcile run of the test proxy's first route, driven by the test (no pause between
    recoveries); ``kwargs`` go to ``Reconciler.reconcile``."""
    application = proxy.app
    assert application is not None
    runs = reconciler.Reconciler(
        application[app_keys.STORE],
        application[app_keys.CONFIG].routes,
        application[app_keys.METRICS],
        pace=1000.0,
        open_log=open_log,
    )
    return await runs.reconcile(application[app_keys.CONFIG].routes[0], **kwargs)


def npm_install(where: Path, *packages: str) -> Path:
    """``packages`` installed from npm under ``where`` (its ``node_modules``): for the tests that
    run a provider's or a framework's own JavaScript (its libraries, the node-postgres receipt
    app). Node and npm: without them the test fails in CI (``CI=true``, which installs them) and
    is skipped elsewhere, saying what to install."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        message = f"{' and '.join(missing)} not installed (apt-get install nodejs npm)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    npm = ["npm", "install", "--no-audit", "--no-fund", "--no-save", "--prefix", str(where),
           *packages]  # fmt: skip
    done = subprocess.run(npm, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(npm)} failed:\n{done.stderr}")
    return where / "node_modules"
