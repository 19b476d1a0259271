"""Pass-through has a connection pool of its own: clients that never read a pass-through answer
cannot take the upstream connections webhooks need, over either transport."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.helpers import MIB, FakeUpstream, MakeProxy, wait_until

# Over either transport (conftest's ``kind``), with the proxy trusting the test CA.
pytestmark = pytest.mark.usefixtures("kind", "trust_the_test_ca")
WITHIN = 15.0  # bound on every wait for the proxy


async def test_pass_through_clients_that_never_read_cannot_starve_webhooks(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    non_readers: Any,
) -> None:
    # Both transports: pass-through to an https:// app once shared one connection pool with
    # its webhooks, and 104 such clients made every webhook wait for a slot until it was 504.
    upstream.respond = lambda n: web.Response(body=b"x" * (4 * MIB))
    client = await make_proxy(upstream={"timeout": "5s"})
    for _ in range(104):
        await non_readers(client.server.port, b"GET /big HTTP/1.1\r\nHost: proxy.test\r\n\r\n")
    await wait_until(
        lambda: asyncio.sleep(0, result=len(upstream.requests) >= 100),
        "pass-through to hold its upstream connections",
        WITHIN,
    )

    answer = await client.post(
        "/webhooks/corvel", data=b'{"id": "evt_webhook"}', timeout=aiohttp.ClientTimeout(WITHIN)
    )

    assert answer.status == 200
    assert json.loads(upstream.requests[-1].body) == {"id": "evt_webhook"}
