"""Pass-through uploads whose bytes pause: answered 408 at client_body_timeout, as webhooks are.

A trickling upload must not hold one of the pass-through connections (and an app worker) for
as long as it trickles. Connections are raw sockets, as an attacker's would be.
"""

from __future__ import annotations

import json

from tests.helpers import FakeUpstream, MakeProxy, connection, read_answer


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
