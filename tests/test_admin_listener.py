"""The admin listener's connection bound and timeouts, on ``dedup-proxy serve``, over raw sockets.

Each process keeps at most ``admin.MAX_CONNECTIONS`` admin connections open: past that, a new one
makes room by closing the one that has waited longest for a request, as on the public port. So
idle admin connections neither lock out a probe nor take the descriptors webhooks need. An idle
admin connection, or one whose headers never finish, is closed after ``admin.KEEPALIVE``
seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy import admin
from tests.conftest import FakeUpstream, wait_until
from tests.ports import accepts, free_port

WITHIN = 10.0  # bound on every wait for the proxy (an answer, a close)
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: proxy.test\r\n\r\n"
READYZ = b"GET /readyz HTTP/1.1\r\nHost: proxy.test\r\n\r\n"


@dataclass
class Served:
    """A ``dedup-proxy serve`` process."""

    process: asyncio.subprocess.Process
    port: int
    admin_port: int
    log: Path

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.startswith("{")]

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def admin_connections(self) -> int:
        """The connections to the admin port this process holds open (established)."""
        held = set()
        for fd in os.listdir(f"/proc/{self.process.pid}/fd"):
            with contextlib.suppress(FileNotFoundError):
                held.add(os.readlink(f"/proc/{self.process.pid}/fd/{fd}"))
        count = 0
        for line in Path(f"/proc/{self.process.pid}/net/tcp").read_text().splitlines()[1:]:
            _, local, _, state, *_, inode = line.split()[:10]
            port = int(local.rpartition(":")[2], 16)
            if state == "01" and port == self.admin_port and f"socket:[{inode}]" in held:
                count += 1
        return count


Start = Callable[..., Awaitable[Served]]


@pytest.fixture
async def start(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> AsyncIterator[Start]:
    """Start ``serve``; ``nofile`` sets its RLIMIT_NOFILE."""
    processes: list[asyncio.subprocess.Process] = []

    async def run(*, nofile: tuple[int, int] | None = None) -> Served:
        port, admin_port = free_port(), free_port()
        config_file = tmp_path / "config.yaml"
        config_file.write_text(
            yaml.safe_dump(
                {
                    "listen": f"127.0.0.1:{port}",
                    "admin": {"listen": f"127.0.0.1:{admin_port}"},
                    "upstream": {"url": upstream.url, "timeout": "30s"},
                    "database": {"dsn": pg_dsn, "table": table, "pool_size": 4},
                    "log": {"format": "json"},
                    "routes": [
                        {"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}
                    ],
                }
            )
        )

        def limit_open_files() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        log = tmp_path / "proxy.log"
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy", "serve", "--config", str(config_file),
                stdout=out, stderr=asyncio.subprocess.STDOUT, preexec_fn=limit_open_files,
            )  # fmt: skip
        processes.append(process)
        await wait_until(lambda: accepts(port), "the proxy to listen", within=30)
        return Served(process, port, admin_port, log)

    try:
        yield run
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
                await process.wait()


@pytest.fixture
async def streams() -> AsyncIterator[list[Stream]]:
    """Connections the test opens, closed at its end."""
    opened: list[Stream] = []
    yield opened
    for _, writer in opened:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def connect(port: int) -> Stream:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WITHIN)


async def status(stream: Stream, data: bytes) -> int | None:
    """The status of the answer to ``data``, or None when the proxy closed instead."""
    reader, writer = stream
    writer.write(data)
    try:
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WITHIN)
    except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
        return None
    except TimeoutError:
        pytest.fail(f"the proxy neither answered nor closed the connection in {WITHIN:g}s")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = dict(f.lower().split(": ", 1) for f in fields if f)
    await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1])


async def closed(stream: Stream, what: str, within: float = WITHIN) -> None:
    """Wait for the proxy to close the connection; fail the test if it does not."""
    try:
        rest = await asyncio.wait_for(stream[0].read(), within)
    except TimeoutError:
        pytest.fail(f"the proxy did not close {what} within {within:g}s")
    except ConnectionResetError:
        rest = b""
    assert rest == b"", f"{what} got {rest!r}"


def webhook(event_id: str) -> bytes:
    body = json.dumps({"id": event_id}).encode()
    return b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def test_idle_admin_connections_past_the_bound_make_room_for_a_probe_the_oldest_first(
    start: Start, streams: list[Stream]
) -> None:
    served = await start()
    # Each answer proves the connections before it were accepted: the first waits longest.
    for _ in range(admin.MAX_CONNECTIONS + 10):
        streams.append(stream := await connect(served.admin_port))
        assert await status(stream, HEALTHZ) == 200

    streams.append(probe := await connect(served.admin_port))
    assert await status(probe, READYZ) == 200
    await closed(streams[0], "the longest-idle admin connection")
    assert served.admin_connections() <= admin.MAX_CONNECTIONS
    reports = [x for x in served.lines() if x["msg"].startswith("the admin listener's bound")]
    assert reports
    assert reports[0]["level"] == "warning"


async def _attempt(port: int) -> Stream | None:
    """A connection, or None when it was refused or not accepted in time."""
    try:
        stream = await connect(port)
    except (OSError, TimeoutError):
        return None
    stream[1].write(b"GET /metrics HTTP/1.1\r\n")  # headers that never finish
    return stream


async def test_admin_connections_cannot_take_the_descriptors_webhooks_need(
    start: Start, streams: list[Stream]
) -> None:
    # A hard limit the proxy cannot raise, below what the admin connections below would take.
    served = await start(nofile=(256, 256))
    before = served.open_files()
    attempts = await asyncio.gather(*(_attempt(served.admin_port) for _ in range(400)))
    streams += [stream for stream in attempts if stream is not None]

    streams.append(webhook_stream := await connect(served.port))
    assert await status(webhook_stream, webhook("evt_real")) == 200
    streams.append(probe := await connect(served.admin_port))
    assert await status(probe, READYZ) == 200
    assert served.admin_connections() <= admin.MAX_CONNECTIONS
    # The admin connections, the webhook's and its upstream connection: nowhere near the limit.
    assert served.open_files() <= before + 2 * admin.MAX_CONNECTIONS


async def test_an_idle_or_slow_admin_connection_is_closed_after_the_short_keep_alive(
    start: Start, streams: list[Stream]
) -> None:
    served = await start()
    streams.append(idle := await connect(served.admin_port))
    assert await status(idle, HEALTHZ) == 200
    streams.append(slow := await connect(served.admin_port))
    slow[1].write(b"GET /metrics HTTP/1.1\r\nHost: proxy.test\r\n")  # never finished
    streams.append(silent := await connect(served.admin_port))  # never sends a byte

    within = admin.KEEPALIVE + WITHIN
    await closed(idle, "an idle keep-alive admin connection", within)
    await closed(slow, "an admin connection whose headers never finish", within)
    await closed(silent, "an admin connection that never sent a byte", within)
