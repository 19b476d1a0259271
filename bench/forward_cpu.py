"""CPU per forwarded webhook, and per parsed answer: the cost of the upstream client alone.

    python bench/forward_cpu.py [--requests N] [--old-client FILE] [--parser-only]

Starts the bench upstream (bench/upstream.py, uvloop) in a process of its own and, in this
process on uvloop, sends it webhooks through ``forwarder.Forwarder.forward`` (header filtering,
the transport, the answer read whole), one at a time and 32 at once; the figure is this
process's CPU time (``time.process_time``) per call, so the upstream's own CPU is not in it and
other programs on the machine change it little. Without PostgreSQL or the proxy's server, it is
the part of a proxied webhook that the upstream client decides.

The parser figure is CPU per small answer parsed from bytes already received (no socket; the
best of five runs), for the current ``proxy.client`` and, with ``--old-client``, for another
copy of that module (``git show 1aba88f:proxy/http1.py > /tmp/old_client.py`` is the regex
parser before llhttp), side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvloop
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from bench import procs
from proxy.upstream import forwarder, http1

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 500
BODY = b'{"id":"evt_1","type":"payment.created","data":{"amount":1000,"currency":"eur"}}'
SMALL_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
    b"Content-Length: 11\r\nDate: Tue, 01 Dec 2026 00:00:00 GMT\r\n"
    b"Server: Python/3.11 aiohttp/3.14\r\n"
    b'\r\n{"ok":true}'
)


class _Peer:
    """The provider's end of the connection, as much of a transport as a Request asks of it."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("203.0.113.7", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False


def _request() -> Any:
    """One incoming webhook request (built once: mocked requests are slow to make)."""
    headers = CIMultiDict(
        {
            "Host": "hooks.example.com",
            "Content-Type": "application/json",
            "User-Agent": "Provider-Webhooks/1.0",
            "Webhook-Signature": "v1,Zm9vYmFyYmF6",
            "Content-Length": str(len(BODY)),
        }
    )
    return make_mocked_request("POST", "/webhooks/corvel", headers=headers, transport=_Peer())


async def _forward_cpu(base_url: str, requests: int, concurrency: int) -> float:
    """µs of this process's CPU per forwarded webhook."""
    proxy = forwarder.Forwarder(5.0, preserve_host=True, connections=64, keepalive=1.5)
    request = _request()
    try:

        async def run(count: int) -> None:
            sent = 0

            async def one() -> None:
                nonlocal sent
                while sent < count:
                    sent += 1
                    answer = await proxy.forward(
                        request, base_url, "/webhooks/corvel", BODY, "rid",
                        reserve=http1.unlimited,
                    )  # fmt: skip
                    assert answer.status == 200, answer.status

            await asyncio.gather(*(one() for _ in range(concurrency)))

        await run(WARMUP)
        started = time.process_time()
        await run(requests)
        return (time.process_time() - started) / requests * 1e6
    finally:
        await proxy.close()


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("old_client", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _parse_once(module: ModuleType) -> Callable[[], Any]:
    """A function that parses SMALL_ANSWER once with ``module``'s parser."""
    loop = asyncio.get_event_loop()
    if hasattr(module, "_answer"):  # the regex reader: step its coroutine over a buffer

        def regex() -> Any:
            connection = module._Connection(loop, "app")
            connection.buffer += SMALL_ANSWER
            reading = module._answer(connection, "POST")
            try:
                reading.send(None)
            except StopIteration as done:
                return done.value[0]
            raise AssertionError("incomplete")

        return regex

    def llhttp() -> Any:
        reader = module._Reader("POST", http1.unlimited)
        reader.feed(SMALL_ANSWER)
        assert reader.answer is not None
        return reader.answer

    return llhttp


def _parse_cpu(module: ModuleType, rounds: int) -> float:
    """µs per parse, the best of five runs (as timeit advises: the others measure the noise)."""
    parse = _parse_once(module)
    assert parse().status == 200
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        for _ in range(rounds):
            parse()
        best = min(best, time.process_time() - started)
    return best / rounds * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000)
    parser.add_argument("--old-client", type=Path, help="another copy of proxy/http1.py")
    parser.add_argument("--parser-only", action="store_true", help="no forwarding runs")
    args = parser.parse_args(argv)

    asyncio.set_event_loop(uvloop.new_event_loop())
    print(
        f"parser, current proxy.upstream.http1: {_parse_cpu(http1, 20000):.1f} µs per small answer"
    )
    if args.old_client:
        old = _load(args.old_client)
        print(f"parser, {args.old_client}: {_parse_cpu(old, 20000):.1f} µs per small answer")
    if args.parser_only:
        return 0

    port = procs.free_port()
    log = Path("/tmp") / f"forward-cpu-upstream-{port}.log"
    upstream = procs.Service(
        "upstream", [sys.executable, str(ROOT / "bench" / "upstream.py"), "--port", str(port)],
        log, port,
    )  # fmt: skip
    try:
        upstream.wait_listening()
        loop = asyncio.get_event_loop()
        # Credentials in the URL send it through aiohttp's client (the upstream ignores them).
        for via, base_url in (
            ("own", f"http://127.0.0.1:{port}"),
            ("aiohttp", f"http://u:p@127.0.0.1:{port}"),
        ):
            for concurrency in (1, 32):
                before = upstream.cpu()
                cpu = loop.run_until_complete(_forward_cpu(base_url, args.requests, concurrency))
                app = (upstream.cpu() - before) / (args.requests + WARMUP) * 1e6
                print(
                    f"forward via {via} client, c{concurrency}: {cpu:.0f} µs CPU per webhook in "
                    f"the proxy process (upstream {app:.0f} µs)"
                )
    finally:
        upstream.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
