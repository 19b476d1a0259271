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
import os
from pathlib import Path

from proxy import admin
from tests.helpers import (
    WITHIN,
    Serve,
    Served,
    Stream,
    closed,
    open_files_limit,
    open_stream,
    status,
    webhook_request,
)

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: proxy.test\r\n\r\n"
READYZ = b"GET /readyz HTTP/1.1\r\nHost: proxy.test\r\n\r\n"


def open_files(served: Served) -> int:
    return len(os.listdir(f"/proc/{served.process.pid}/fd"))


def admin_connections(served: Served) -> int:
    """The connections to the admin port the process holds open (established)."""
    pid = served.process.pid
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        _, local, _, state, *_, inode = line.split()[:10]
        port = int(local.rpartition(":")[2], 16)
        if state == "01" and port == served.admin_port and f"socket:[{inode}]" in held:
            count += 1
    return count


async def test_idle_admin_connections_past_the_bound_make_room_for_a_probe_the_oldest_first(
    serve: Serve, streams: list[Stream]
) -> None:
    served = await serve()
    # Each answer proves the connections before it were accepted: the first waits longest.
    for _ in range(admin.MAX_CONNECTIONS + 10):
        streams.append(stream := await open_stream(served.admin_port))
        assert await status(stream, HEALTHZ) == 200

    streams.append(probe := await open_stream(served.admin_port))
    assert await status(probe, READYZ) == 200
    await closed(streams[0], "the longest-idle admin connection")
    assert admin_connections(served) <= admin.MAX_CONNECTIONS
    reports = [x for x in served.lines() if x["msg"].startswith("the admin listener's bound")]
    assert reports
    assert reports[0]["level"] == "warning"


async def test_admin_requests_that_declare_a_body_and_never_send_it_cannot_crowd_out_a_probe(
    serve: Serve, streams: list[Stream]
) -> None:
    served = await serve()
    declared = b"GET /healthz HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 1000\r\n\r\n"
    # Each is answered and its connection closed at once: none holds the bound while aiohttp
    # would wait (lingering, 10 s) for a body that never comes.
    for _ in range(admin.MAX_CONNECTIONS + 4):
        streams.append(stream := await open_stream(served.admin_port))
        assert await status(stream, declared) == 200
        await closed(stream, "an admin connection whose request body never came")

    streams.append(probe := await open_stream(served.admin_port))
    assert await status(probe, HEALTHZ) == 200


async def _attempt(port: int) -> Stream | None:
    """A connection, or None when it was refused or not accepted in time."""
    try:
        stream = await open_stream(port)
    except (OSError, TimeoutError):
        return None
    stream[1].write(b"GET /metrics HTTP/1.1\r\n")  # headers that never finish
    return stream


async def test_admin_connections_cannot_take_the_descriptors_webhooks_need(
    serve: Serve, streams: list[Stream]
) -> None:
    # A hard limit the proxy cannot raise, below what the admin connections below would take.
    served = await serve(preexec_fn=open_files_limit((256, 256)))
    before = open_files(served)
    attempts = await asyncio.gather(*(_attempt(served.admin_port) for _ in range(400)))
    streams += [stream for stream in attempts if stream is not None]

    streams.append(webhook_stream := await open_stream(served.port))
    assert await status(webhook_stream, webhook_request("evt_real")) == 200
    streams.append(probe := await open_stream(served.admin_port))
    assert await status(probe, READYZ) == 200
    assert admin_connections(served) <= admin.MAX_CONNECTIONS
    # The admin connections, the webhook's and its upstream connection: nowhere near the limit.
    assert open_files(served) <= before + 2 * admin.MAX_CONNECTIONS


async def test_an_idle_or_slow_admin_connection_is_closed_after_the_short_keep_alive(
    serve: Serve, streams: list[Stream]
) -> None:
    served = await serve()
    streams.append(idle := await open_stream(served.admin_port))
    assert await status(idle, HEALTHZ) == 200
    streams.append(slow := await open_stream(served.admin_port))
    slow[1].write(b"GET /metrics HTTP/1.1\r\nHost: proxy.test\r\n")  # never finished
    streams.append(silent := await open_stream(served.admin_port))  # never sends a byte

    within = admin.KEEPALIVE + WITHIN
    await closed(idle, "an idle keep-alive admin connection", within)
    await closed(slow, "an admin connection whose headers never finish", within)
    await closed(silent, "an admin connection that never sent a byte", within)
