"""The admin listener's connection bound and timeouts, and the ``Host`` names it answers to, on
``dedup-proxy serve``, over raw sockets.

Each process keeps at most ``admin.MAX_CONNECTIONS`` admin connections open: past that, a new one
makes room by closing the one that has waited longest for a request, as on the public port. So
idle admin connections neither lock out a probe nor take the descriptors webhooks need. An idle
admin connection, or one whose headers never finish, is closed after ``admin.KEEPALIVE``
seconds. A request for a ``Host`` that is not its own (DNS rebinding) is refused, but a probe.
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
    free_port,
    open_files_limit,
    open_stream,
    send,
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


async def ask(port: int, path: str, host: str | None) -> tuple[int, bytes]:
    """The status and body of a GET of ``path`` with ``Host: host`` (None: HTTP/1.0, no Host)."""
    head = (
        f"GET {path} HTTP/1.0\r\n" if host is None else f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
    )
    stream = await open_stream(port)
    try:
        answer = await send(stream, f"{head}Connection: close\r\n\r\n".encode())
    finally:
        stream[1].close()
    assert answer is not None
    return answer.status, answer.body


async def test_a_request_for_another_host_is_refused_against_dns_rebinding_but_a_probe(
    serve: Serve,
) -> None:
    served = await serve(admin={"allowed_hosts": ["dedup-proxy.shop.svc", ".monitoring.internal"]})
    port = served.admin_port
    # A page of the attacker's whose name now resolves to 127.0.0.1 (kubectl port-forward's end)
    # sends its own name; names that look like ours or resolve to loopback are as foreign.
    foreign = [
        f"rebind.attacker.example:{port}",
        "rebind.attacker.example",
        f"127.0.0.1.nip.io:{port}",
        f"localhost.attacker.example:{port}",
        f"dedup-proxy.shop.svc.attacker.example:{port}",
        f"monitoring.internal.attacker.example:{port}",
        f"127.0.0.1@rebind.attacker.example:{port}",
        "",
    ]
    for host in foreign:
        for path in ("/metrics", "/console/", "/console/events", "/nowhere"):
            code, body = await ask(port, path, host)
            assert code == 421, (host, path, body)
            assert b"admin.allowed_hosts" in body
        for path in ("/healthz", "/readyz"):  # the kubelet's, whatever Host it sends
            assert (await ask(port, path, host))[0] == 200, (host, path)
    ours = [
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        "localhost",
        f"LOCALHOST.:{port}",
        f"[::1]:{port}",
        f"10.244.3.17:{port}",  # Prometheus and the kubelet, by pod IP
        f"dedup-proxy.shop.svc:{port}",
        f"prometheus.monitoring.internal:{port}",
        None,  # no Host at all: no browser sends that
    ]
    for allowed in ours:
        for path in ("/metrics", "/console/"):
            code, body = await ask(port, path, allowed)
            assert code == 200, (allowed, path, body[:200])
    refusals = [x for x in served.lines() if "refused a request for Host" in x["msg"]]
    assert len(refusals) == 1, refusals
    assert refusals[0]["level"] == "warning"


async def test_the_console_beyond_loopback_without_credentials_is_said_at_start_up(
    serve: Serve,
) -> None:
    served = await serve(admin={"listen": f"0.0.0.0:{free_port()}",
                                "console": {"unauthenticated": True}})  # fmt: skip
    assert (await ask(served.admin_port, "/console/", "127.0.0.1"))[0] == 200
    warnings = [x for x in served.lines() if "asks for no credentials" in x["msg"]]
    assert len(warnings) == 1
    assert warnings[0]["level"] == "warning"
    assert "0.0.0.0" in warnings[0]["msg"]
