"""The connection bound (``max_connections``) and the open-file limit, on ``dedup-proxy serve``.

Idle keep-alive connections and connections whose headers never finish make room for new ones,
the one waiting longest first; a connection in the middle of a request is never cut; past the
bound, a new connection gets a 503 with Retry-After (or is closed), never a hang. Connections are
raw sockets, so that which one is idle, and since when, is up to the test.
"""

from __future__ import annotations

import asyncio
import json
import resource
from pathlib import Path

import pytest

from tests.helpers import (
    FakeUpstream,
    Serve,
    Served,
    Stream,
    closed,
    open_files_limit,
    open_stream,
    read_answer,
    send,
    status,
    wait_until,
    webhook_request,
)

SHED = 'dedup_shed_requests_total{reason="connections"}'
HEAD = b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\n"  # unfinished headers


async def shed_so_far(served: Served) -> float:
    """Connections shed so far: closed to make room, or refused."""
    return (await served.metrics()).get(SHED, 0.0)


async def test_idle_connections_make_room_for_a_webhook_the_longest_waiting_first(
    serve: Serve, streams: list[Stream], upstream: FakeUpstream
) -> None:
    served = await serve(max_connections=6)
    # Alternately: half-sent headers, and a keep-alive connection idle after one request. Each
    # answer proves the connections before it were accepted, so each waits longer than the next.
    for n in range(3):
        streams.append(half := await open_stream(served.port))
        half[1].write(HEAD)
        streams.append(kept := await open_stream(served.port))
        assert await status(kept, webhook_request(f"evt_kept_{n}")) == 200
    half_0, kept_0, half_1, _, _, kept_2 = streams
    # Not always zero: the start-up probe's connection may have been shed before its close was
    # seen (on asyncio's loop).
    shed = await shed_so_far(served)

    streams.append(first := await open_stream(served.port))
    assert await status(first, webhook_request("evt_first")) == 200
    await closed(half_0, "the longest-waiting connection (half-sent headers)")
    streams.append(second := await open_stream(served.port))
    assert await status(second, webhook_request("evt_second")) == 200
    await closed(kept_0, "the next longest-waiting connection (idle keep-alive)")

    # The others were left alone: each still takes a request.
    assert await status(half_1, webhook_request("evt_half_1").removeprefix(HEAD)) == 200
    assert await status(kept_2, webhook_request("evt_kept_2_again")) == 200
    assert [json.loads(r.body)["id"] for r in upstream.requests][3:] == [
        "evt_first",
        "evt_second",
        "evt_half_1",
        "evt_kept_2_again",
    ]
    assert await shed_so_far(served) == shed + 2
    reports = [x for x in served.lines() if x["msg"].startswith("max_connections (6) reached")]
    assert reports
    assert reports[0]["level"] == "warning"


async def test_past_the_bound_of_busy_connections_a_new_one_is_refused_not_left_hanging(
    serve: Serve, streams: list[Stream], upstream: FakeUpstream
) -> None:
    served = await serve(max_connections=3)
    upstream.gate = asyncio.Event()
    held = []
    for n in range(3):
        streams.append(stream := await open_stream(served.port))
        stream[1].write(webhook_request(f"evt_held_{n}"))
        held.append(asyncio.create_task(read_answer(stream[0])))
    await wait_until(lambda: _count(upstream, 3), "three webhooks held at the upstream")
    shed = await shed_so_far(served)

    streams.append(extra := await open_stream(served.port))
    refused = await send(extra, webhook_request("evt_extra"))
    assert refused is not None, "closed without the 503"
    assert (refused.status, refused.headers["retry-after"]) == (503, "5")
    await closed(extra, "the refused connection")
    assert len(upstream.requests) == 3

    upstream.gate.set()
    assert [a and a.status for a in await asyncio.gather(*held)] == [200, 200, 200]
    assert await shed_so_far(served) == shed + 1
    # Once they idle, the bound no longer turns anyone away.
    streams.append(later := await open_stream(served.port))
    assert await status(later, webhook_request("evt_extra")) == 200


async def _count(upstream: FakeUpstream, n: int) -> bool:
    return len(upstream.requests) >= n


async def test_more_idle_connections_than_open_files_do_not_lock_out_a_webhook(
    serve: Serve, streams: list[Stream]
) -> None:
    # A hard limit the proxy cannot raise: the bound comes down below it.
    served = await serve(max_connections=1000, preexec_fn=open_files_limit((256, 256)))
    for _ in range(300):  # more than the proxy can hold open
        streams.append(stream := await open_stream(served.port))
        stream[1].write(HEAD)

    streams.append(webhook_stream := await open_stream(served.port))
    assert await status(webhook_stream, webhook_request("evt_real")) == 200
    await closed(streams[0], "the longest-waiting connection")
    (lowered,) = [x for x in served.lines() if x["msg"].startswith("max_connections lowered")]
    assert lowered["level"] == "warning"
    assert "open-file limit is 256" in lowered["msg"]


async def test_serve_raises_the_soft_open_file_limit_to_the_hard_one(serve: Serve) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    served = await serve(max_connections=10, preexec_fn=open_files_limit((512, hard)))

    soft_now, hard_now = _open_files(served.process.pid)
    assert soft_now == hard_now != "512"
    assert any(x["msg"].startswith("open-file limit raised from 512") for x in served.lines())


def _open_files(pid: int) -> tuple[str, str]:
    """The soft and hard RLIMIT_NOFILE of a process, as /proc shows them."""
    limits = Path(f"/proc/{pid}/limits").read_text()
    (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
    soft, hard = line.split()[3:5]
    return soft, hard


# --- the head bound (max_head) ----------------------------------------------------------------


def _padded(lines: int, size: int) -> bytes:
    """``lines`` header fields of ``size`` bytes each, every one under aiohttp's own limits."""
    return b"".join(b"X-Pad-%d: %s\r\n" % (n, b"p" * size) for n in range(lines))


async def test_a_whole_head_over_max_head_is_answered_431_and_its_connection_closed(
    serve: Serve, streams: list[Stream], upstream: FakeUpstream
) -> None:
    served = await serve(max_head="16KiB")
    streams.append(stream := await open_stream(served.port))
    # 24 lines of 1,000 bytes: a head aiohttp alone parses and holds, body trickling or not.
    head = HEAD + _padded(24, 1000) + b"Content-Length: 1000\r\n\r\n{"

    answer = await send(stream, head)

    assert answer is not None
    assert answer.status == 431
    await closed(stream, "the connection whose head was refused")
    streams.append(other := await open_stream(served.port))
    assert await status(other, webhook_request("evt_after")) == 200
    assert [json.loads(r.body)["id"] for r in upstream.requests] == ["evt_after"]


async def test_a_head_that_never_finishes_is_answered_431_once_past_max_head(
    serve: Serve, streams: list[Stream], upstream: FakeUpstream
) -> None:
    served = await serve(max_head="16KiB")
    streams.append(stream := await open_stream(served.port))

    answer = await send(stream, HEAD + _padded(20, 1000))  # no blank line: never finished

    assert answer is not None
    assert answer.status == 431
    await closed(stream, "the connection whose head was refused")
    assert upstream.requests == []


async def test_max_head_counts_each_request_of_a_kept_alive_connection_afresh(
    serve: Serve, streams: list[Stream], upstream: FakeUpstream
) -> None:
    served = await serve(max_head="16KiB")
    streams.append(stream := await open_stream(served.port))
    # Three requests with 12 KB heads on one connection: 36 KB in all, each under 16 KiB.
    padding = _padded(12, 1000).split(b"\r\n")[:-1]
    for n in range(3):
        assert await status(stream, webhook_request(f"evt_{n}", *padding)) == 200
    assert await status(stream, HEAD + _padded(20, 1000) + b"\r\n") == 431
    assert [json.loads(r.body)["id"] for r in upstream.requests] == ["evt_0", "evt_1", "evt_2"]
