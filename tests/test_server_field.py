"""The ``Server`` field on the wire: the proxy's own answers name the product without versions
(``dedup-proxy``, as nginx's ``server_tokens off``), the app's answers carry the app's own field
or none, as the app sent them."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import admin
from tests.helpers import FakeUpstream, MakeProxy, RawServer, content_length


async def exchange(proxy: TestClient[Any, Any], request: bytes) -> bytes:
    """The proxy's answer to ``request`` on a connection of its own, as the bytes on the wire."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    try:
        writer.write(request)
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


def webhook(event_id: str, path: str = "/webhooks/corvel") -> bytes:
    body = json.dumps({"id": event_id}).encode()
    return (
        b"POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
    )


def servers(answer: bytes) -> list[bytes]:
    """The Server fields of an answer's head."""
    head = answer.partition(b"\r\n\r\n")[0]
    return re.findall(rb"\r\nServer: ([^\r]*)", head, flags=re.IGNORECASE)


async def test_the_proxys_own_answers_name_it_without_versions(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_client: Any
) -> None:
    upstream.respond = lambda n: web.Response(text="ok", headers={"Server": "app/2.1"})
    proxy = await make_proxy()

    relayed = await exchange(proxy, webhook("evt_1"))
    duplicate = await exchange(proxy, webhook("evt_1"))
    refused = await exchange(
        proxy,
        b"POST /webhooks/corvel HTTP/1.1\r\nHost: p\r\nConnection: close\r\n"
        b"Content-Length: 2\r\n\r\n{}",
    )
    probe = await aiohttp_client(admin.create_admin_app(proxy.app))
    health = await probe.get("/healthz")

    assert relayed.startswith(b"HTTP/1.1 200 ")
    assert servers(relayed) == [b"app/2.1"]  # the app's, as it sent it
    assert b"\r\nDedup-Status: duplicate\r\n" in duplicate
    assert servers(duplicate) == [b"dedup-proxy"]
    assert refused.startswith(b"HTTP/1.1 400 ")
    assert servers(refused) == [b"dedup-proxy"]
    assert health.headers.getall("Server") == ["dedup-proxy"]


async def test_an_app_answer_without_a_server_field_gets_none(
    make_proxy: MakeProxy, raw_server: RawServer, trust_the_test_ca: None
) -> None:
    """aiohttp adds its own to every answer that has none; the app's answer is relayed as the
    app sent it, on the webhook path and on the pass-through path alike."""

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(content_length(head))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    url = await raw_server(app)
    proxy = await make_proxy(upstream={"url": url})

    relayed = await exchange(proxy, webhook("evt_2"))
    passed = await exchange(proxy, b"GET /status HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n")

    assert relayed.startswith(b"HTTP/1.1 200 OK\r\n")
    assert relayed.endswith(b"\r\n\r\nok")
    assert servers(relayed) == []
    assert passed.startswith(b"HTTP/1.1 200 OK\r\n")
    assert servers(passed) == []
