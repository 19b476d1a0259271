"""Pass-through uploads whose bytes pause: answered 408 at client_body_timeout, as webhooks are.

A trickling upload must not hold one of the pass-through connections (and an app worker) for
as long as it trickles. Connections are raw sockets, as an attacker's would be.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from tests.helpers import FakeUpstream, MakeProxy, connection, held, read_answer, wait_until


async def test_a_pass_through_body_that_pauses_is_answered_408_at_client_body_timeout(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    client = await make_proxy(client_timeout="60s", client_body_timeout="500ms")
    async with connection(client) as (reader, writer):
        writer.write(
            b"POST /uploads HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 100\r\n\r\nfirst"
        )
        await writer.drain()

        answer = await read_answer(reader)

    assert answer is not None
    assert answer.status == 408
    assert json.loads(answer.body)["error"] == "request_timeout"
    assert upstream.requests == []


async def test_a_pass_through_body_sent_whole_still_reaches_the_app(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    client = await make_proxy(client_body_timeout="500ms")
    async with connection(client) as (reader, writer):
        writer.write(
            b"POST /uploads HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 5\r\n\r\nwhole"
        )
        await writer.drain()

        answer = await read_answer(reader)

    assert answer is not None
    assert answer.status == 200
    assert [r.body for r in upstream.requests] == [b"whole"]


async def test_a_trickling_pass_through_upload_reaches_the_app_only_once_its_first_bytes_have(
    make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    client = await make_proxy(client_body_timeout="500ms")
    async with connection(client) as (_, writer):
        # A byte at a time, each within client_body_timeout: 100 such uploads took every
        # pass-through connection (and 100 of the app's workers) while they trickled.
        writer.write(
            b"POST /uploads HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: 100000\r\n\r\n"
        )
        for _ in range(5):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.2)

        assert upstream.started == []

    await wait_until(lambda: _no_body_held(client), "the upload's bytes given back")


async def _no_body_held(client: TestClient[Any, Any]) -> bool:
    return held(client) == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_pass_through_body_past_the_buffered_bytes_reaches_the_app_whole(
    make_proxy: MakeProxy, upstream: FakeUpstream, chunked: bool
) -> None:
    client = await make_proxy(client_body_timeout="2s")
    body = bytes(range(256)) * 1200  # 300 KiB: buffered in part, then streamed
    if chunked:
        framing = b"Transfer-Encoding: chunked\r\n\r\n"
        parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:70_000], body[70_000:])] + [
            b"0\r\n\r\n"
        ]
    else:
        framing = b"Content-Length: %d\r\n\r\n" % len(body)
        parts = [body[:70_000], body[70_000:]]
    async with connection(client) as (reader, writer):
        writer.write(b"POST /uploads HTTP/1.1\r\nHost: proxy.test\r\n" + framing)
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.1)

        answer = await read_answer(reader)

    assert answer is not None
    assert answer.status == 200
    assert [r.body for r in upstream.requests] == [body]
