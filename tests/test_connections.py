"""The connection bound (``max_connections``) and the open-file limit, on ``dedup-proxy serve``.

Idle keep-alive connections and connections whose headers never finish make room for new ones,
the one waiting longest first; a connection in the middle of a request is never cut; past the
bound, a new connection gets a 503 with Retry-After (or is closed), never a hang. Connections are
raw sockets, so that which one is idle, and since when, is up to the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import FakeUpstream, wait_until
from tests.ports import accepts, free_port

WITHIN = 10.0  # bound on every wait for the proxy (an answer, a close)
SHED = 'dedup_shed_requests_total{reason="connections"}'
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Served:
    """A ``dedup-proxy serve`` process and its JSON log."""

    process: asyncio.subprocess.Process
    port: int
    admin_port: int
    log: Path

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.startswith("{")]

    async def shed(self) -> float:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.admin_port}/metrics") as response,
        ):
            text = await response.text()
        values = [line.rpartition(" ")[2] for line in text.splitlines() if line.startswith(SHED)]
        return float(values[0]) if values else 0.0


Start = Callable[..., Awaitable[Served]]


@pytest.fixture
async def start(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> AsyncIterator[Start]:
    """Start ``serve`` with ``max_connections``; ``nofile`` sets its RLIMIT_NOFILE."""
    processes: list[asyncio.subprocess.Process] = []

    async def run(*, max_connections: int, nofile: tuple[int, int] | None = None) -> Served:
        port, admin_port = free_port(), free_port()
        config_file = tmp_path / "config.yaml"
        config_file.write_text(
            yaml.safe_dump(
                {
                    "listen": f"127.0.0.1:{port}",
                    "admin": {"listen": f"127.0.0.1:{admin_port}"},
                    "upstream": {"url": upstream.url, "timeout": "30s"},
                    "database": {"dsn": pg_dsn, "table": table, "pool_size": 4},
                    "max_connections": max_connections,
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


HEAD = b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\n"  # unfinished headers


def webhook(event_id: str) -> bytes:
    body = json.dumps({"id": event_id}).encode()
    return HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


async def connect(served: Served) -> Stream:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", served.port), WITHIN)


async def answer(stream: Stream) -> tuple[int, dict[str, str]] | None:
    """The status and headers of the next answer, or None when the proxy closed (or reset)."""
    reader, _ = stream
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WITHIN)
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None
    except TimeoutError:
        pytest.fail(f"the proxy neither answered nor closed the connection in {WITHIN:g}s")
    status_line, *fields = head.decode("latin-1").split("\r\n")
    headers = dict(f.lower().split(": ", 1) for f in fields if f)
    await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers


async def send(stream: Stream, data: bytes) -> tuple[int, dict[str, str]] | None:
    stream[1].write(data)
    await stream[1].drain()
    return await answer(stream)


async def status(stream: Stream, data: bytes) -> int | None:
    """The status of the answer to ``data``, or None when the proxy closed instead."""
    got = await send(stream, data)
    return None if got is None else got[0]


async def closed(stream: Stream, what: str) -> None:
    """Wait for the proxy to close the connection; fail the test if it does not."""
    try:
        rest = await asyncio.wait_for(stream[0].read(), WITHIN)
    except TimeoutError:
        pytest.fail(f"the proxy did not close {what}")
    except ConnectionResetError:
        rest = b""
    assert rest == b"", f"{what} got {rest!r}"


@pytest.fixture
async def streams() -> AsyncIterator[list[Stream]]:
    """Connections the test opens, closed at its end."""
    opened: list[Stream] = []
    yield opened
    for _, writer in opened:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def test_idle_connections_make_room_for_a_webhook_the_longest_waiting_first(
    start: Start, streams: list[Stream], upstream: FakeUpstream
) -> None:
    served = await start(max_connections=6)
    # Alternately: half-sent headers, and a keep-alive connection idle after one request. Each
    # answer proves the connections before it were accepted, so each waits longer than the next.
    for n in range(3):
        streams.append(half := await connect(served))
        half[1].write(HEAD)
        streams.append(kept := await connect(served))
        assert await status(kept, webhook(f"evt_kept_{n}")) == 200
    half_0, kept_0, half_1, _, _, kept_2 = streams
    # Not always zero: the start-up probe's connection may have been shed before its close was
    # seen (on asyncio's loop).
    shed = await served.shed()

    streams.append(first := await connect(served))
    assert await status(first, webhook("evt_first")) == 200
    await closed(half_0, "the longest-waiting connection (half-sent headers)")
    streams.append(second := await connect(served))
    assert await status(second, webhook("evt_second")) == 200
    await closed(kept_0, "the next longest-waiting connection (idle keep-alive)")

    # The others were left alone: each still takes a request.
    assert await status(half_1, webhook("evt_half_1").removeprefix(HEAD)) == 200
    assert await status(kept_2, webhook("evt_kept_2_again")) == 200
    assert [json.loads(r.body)["id"] for r in upstream.requests][3:] == [
        "evt_first", "evt_second", "evt_half_1", "evt_kept_2_again"
    ]  # fmt: skip
    assert await served.shed() == shed + 2
    reports = [x for x in served.lines() if x["msg"].startswith("max_connections (6) reached")]
    assert reports
    assert reports[0]["level"] == "warning"


async def test_past_the_bound_of_busy_connections_a_new_one_is_refused_not_left_hanging(
    start: Start, streams: list[Stream], upstream: FakeUpstream
) -> None:
    served = await start(max_connections=3)
    upstream.gate = asyncio.Event()
    held = []
    for n in range(3):
        streams.append(stream := await connect(served))
        stream[1].write(webhook(f"evt_held_{n}"))
        held.append(asyncio.create_task(answer(stream)))
    await wait_until(lambda: _count(upstream, 3), "three webhooks held at the upstream")
    shed = await served.shed()

    streams.append(extra := await connect(served))
    refused = await send(extra, webhook("evt_extra"))
    assert refused is None or (refused[0], refused[1].get("retry-after")) == (503, "5")
    assert len(upstream.requests) == 3

    upstream.gate.set()
    assert [a and a[0] for a in await asyncio.gather(*held)] == [200, 200, 200]
    assert await served.shed() == shed + 1
    # Once they idle, the bound no longer turns anyone away.
    streams.append(later := await connect(served))
    assert await status(later, webhook("evt_extra")) == 200


async def _count(upstream: FakeUpstream, n: int) -> bool:
    return len(upstream.requests) >= n


async def test_more_idle_connections_than_open_files_do_not_lock_out_a_webhook(
    start: Start, streams: list[Stream]
) -> None:
    # A hard limit the proxy cannot raise: the bound comes down below it.
    served = await start(max_connections=1000, nofile=(256, 256))
    for _ in range(300):  # more than the proxy can hold open
        streams.append(stream := await connect(served))
        stream[1].write(HEAD)

    streams.append(webhook_stream := await connect(served))
    assert await status(webhook_stream, webhook("evt_real")) == 200
    await closed(streams[0], "the longest-waiting connection")
    (lowered,) = [x for x in served.lines() if x["msg"].startswith("max_connections lowered")]
    assert lowered["level"] == "warning"
    assert "open-file limit is 256" in lowered["msg"]


async def test_serve_raises_the_soft_open_file_limit_to_the_hard_one(start: Start) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    served = await start(max_connections=10, nofile=(512, hard))

    soft_now, hard_now = _open_files(served.process.pid)
    assert soft_now == hard_now != "512"
    assert any(x["msg"].startswith("open-file limit raised from 512") for x in served.lines())


def _open_files(pid: int) -> tuple[str, str]:
    """The soft and hard RLIMIT_NOFILE of a process, as /proc shows them."""
    limits = Path(f"/proc/{pid}/limits").read_text()
    (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
    soft, hard = line.split()[3:5]
    return soft, hard
