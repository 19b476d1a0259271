"""Pass-through has a connection pool of its own: clients that never read a pass-through answer
cannot take the upstream connections webhooks need, over either transport."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from tests.conftest import FakeUpstream, MakeProxy, wait_until
from tests.test_transports import (  # noqa: F401 (fixtures: the app over TLS, its CA trusted)
    ca,
    client_tls,
    kind,
    server_tls,
    trust_the_test_ca,
    upstream,
)
from tests.test_unread_clients import MIB, WITHIN, non_readers  # noqa: F401


async def test_pass_through_clients_that_never_read_cannot_starve_webhooks(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,  # noqa: F811
    non_readers: Any,  # noqa: F811
    kind: str,  # noqa: F811
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
