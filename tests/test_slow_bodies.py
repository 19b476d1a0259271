"""Request heads without their bodies, and bodies that pause: neither can pin the memory budget.

A request reserves its body's bytes as they arrive, never its declared Content-Length ahead of
them; and a body whose bytes pause longer than ``client_body_timeout`` is answered 408 at once,
not after ``client_timeout``. Connections are raw sockets, as an attacker's would be.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from typing import Any

from aiohttp.test_utils import TestClient

from tests.helpers import (
    MIB,
    WITHIN,
    FakeUpstream,
    MakeProxy,
    claimed,
    connection,
    held,
    read_answer,
    wait_until,
)

GITHUB_SECRET = "It's a Secret to Everybody"


async def heads_read(client: TestClient[Any, Any], count: int) -> bool:
    """Whether ``count`` connections have had a request head parsed (their handler runs)."""
    runner = client.server.runner
    assert runner is not None
    server = runner.server
    assert server is not None
    return sum(handler._request_count > 0 for handler in server.connections) >= count


def signed(event_id: str) -> tuple[bytes, dict[str, str]]:
    body = json.dumps({"id": event_id}).encode()
    digest = hmac.new(GITHUB_SECRET.encode(), body, hashlib.sha256).hexdigest()
    return body, {
        "X-GitHub-Hook-ID": "42",
        "X-GitHub-Delivery": event_id,
        "X-Hub-Signature-256": f"sha256={digest}",
    }


async def test_heads_that_declare_large_bodies_hold_none_of_the_budget(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    # Three heads declaring 25 MiB each, on a 64 MiB budget (or one declaring 1 MiB on a
    # 1 MiB budget), once shed every genuine webhook for as long as they held their sockets.
    client = await make_proxy(
        max_buffered="1MiB",
        routes=[
            {
                "name": "github",
                "path": "/webhooks/github",
                "preset": "github",
                "max_body": "25MiB",
                "verify": {"secret": GITHUB_SECRET},
            }
        ],
    )
    head = b"POST /webhooks/github HTTP/1.1\r\nHost: proxy.test\r\nContent-Length: %d\r\n\r\n" % (
        25 * MIB
    )
    async with connection(client) as (_, first), connection(client) as (_, second):
        for writer in (first, second):
            writer.write(head)
            await writer.drain()
        await wait_until(lambda: heads_read(client, 2), "the two heads to be read")

        answers = []
        for n in range(5):
            body, headers = signed(f"genuine-{n}")
            response = await client.post("/webhooks/github", data=body, headers=headers)
            answers.append(response.status)

        assert answers == [200] * 5
        assert held(client) == 0
    assert len(await claimed(pg_dsn, table)) == 5


async def test_a_body_that_pauses_is_cut_off_at_client_body_timeout(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(client_timeout="60s", client_body_timeout="500ms")
    body = b'{"id": "evt_paused"}'
    async with connection(client) as (reader, writer):
        writer.write(
            b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body[:5])
        )
        await writer.drain()
        started = time.monotonic()

        answer = await read_answer(reader)

        # Well before client_timeout: WITHIN bounds the wait.
        assert time.monotonic() - started < WITHIN
    assert answer is not None
    assert answer.status == 408
    assert json.loads(answer.body)["error"] == "request_timeout"
    assert upstream.requests == []
    assert await claimed(pg_dsn, table) == []
    assert held(client) == 0


async def test_a_body_that_keeps_arriving_is_not_cut_off_by_client_body_timeout(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    client = await make_proxy(client_timeout="60s", client_body_timeout="500ms")
    body = json.dumps({"id": "evt_slow", "pad": "x" * 40}).encode()
    async with connection(client) as (reader, writer):
        writer.write(
            b"POST /webhooks/corvel HTTP/1.1\r\nHost: proxy.test\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)
        )
        for start in range(0, len(body), 10):
            writer.write(body[start : start + 10])
            await writer.drain()
            await asyncio.sleep(0.2)  # pacing the slow client (under the pause allowed)

        answer = await read_answer(reader)

    assert answer is not None
    assert answer.status == 200
    assert upstream.bodies() == [body]
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_slow"]
