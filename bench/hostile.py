"""Unauthenticated clients against one ``dedup-proxy serve``: what they hold, and whether genuine
webhooks still get through (the hardening issue's items 1 and 2, before and after).

    python -m bench.hostile --dsn postgresql://... [--checkout /path/to/other/checkout]

``--checkout`` runs the proxy from another checkout (an older commit, say), so that both are
measured by the same probe. Four scenarios, each on a fresh proxy:

- heads: 3 request heads declaring 25 MiB on a GitHub route, held open, then 20 genuinely
  signed Stripe webhooks;
- passthrough: 104 clients that never read a 4 MiB pass-through answer from an https:// app,
  then 5 webhooks;
- pipelined: 50 connections each pipelining 10 copies of a replayed 1 MiB answer and never
  reading, on max_buffered: 8MiB: the proxy's RSS;
- held: how many of those connections the proxy still holds 15 s later.

Three more, each its own command (``--scenario``), the hardening issue's round three:

- bigheads: 120 connections each sending a head of 1 MiB (128 lines of 8,000 bytes, aiohttp's
  own limits), then one byte of a 1,000-byte body, held open: the proxy's RSS, and 5 signed
  webhooks;
- masking: 150 pass-through requests whose path and X-Request-Id are ``postgres://a:``
  repeated (what the log masking once backtracked on), while ``/healthz`` is polled: its
  slowest answer;
- uploads: 100 pass-through uploads trickling a byte every 2 s, then 10 other pass-through
  requests: how many are answered 200, and how fast.

Every loop is bounded; everything runs on 127.0.0.1 and is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import socket
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import trustme
import yaml
from aiohttp import web

from bench.procs import free_port

MIB = 1024 * 1024
STRIPE_SECRET = "whsec_probe"
GITHUB_SECRET = "github-probe"


def stripe_headers(body: bytes) -> dict[str, str]:
    stamp = str(int(time.time()))
    mac = hmac.new(STRIPE_SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256)
    return {"Stripe-Signature": f"t={stamp},v1={mac.hexdigest()}"}


async def start_app(tls: ssl.SSLContext | None) -> tuple[web.AppRunner, str]:
    big = b"x" * (4 * MIB)
    replayed = b"r" * MIB

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        if request.path.startswith("/replay"):
            return web.Response(body=replayed)
        if request.method == "GET":
            return web.Response(body=big)
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * MIB)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    return runner, f"{'https' if tls else 'http'}://127.0.0.1:{port}"


class Proxy:
    def __init__(
        self,
        checkout: Path,
        dsn: str,
        upstream: str,
        workdir: Path,
        ca: Path,
        *,
        level: str = "warning",
    ) -> None:
        self.port = free_port()
        self.admin_port = str(free_port())
        config = {
            "listen": f"127.0.0.1:{self.port}",
            "admin": {"listen": f"127.0.0.1:{self.admin_port}"},
            "upstream": {"url": upstream, "timeout": "20s"},
            "database": {"dsn": dsn, "table": f"probe_{os.getpid()}_{self.port}", "pool_size": 4},
            "max_buffered": "8MiB",
            "log": {"format": "json", "level": level},
            "routes": [
                {"name": "github", "path": "/github", "preset": "github",
                 "verify": {"secret": GITHUB_SECRET}},
                {"name": "stripe", "path": "/stripe", "preset": "stripe",
                 "verify": {"secret": STRIPE_SECRET}},
                {"name": "replay", "path": "/replay", "event_id": "body:/id",
                 "on_duplicate": "replay", "replay_max_body": "1MiB"},
            ],
        }  # fmt: skip
        path = workdir / f"config-{self.port}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.checkout, self.path, self.ca = checkout, path, ca

    async def __aenter__(self) -> Proxy:
        env = {**os.environ, "SSL_CERT_FILE": str(self.ca), "PYTHONPATH": str(self.checkout)}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(self.path),
            cwd=self.checkout, env=env, stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        for _ in range(300):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return self
            except OSError:
                await asyncio.sleep(0.1)
        raise RuntimeError("the proxy did not listen within 30 s")

    async def __aexit__(self, *exc: object) -> None:
        self.process.kill()
        await self.process.wait()

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def client_sockets(self) -> int:
        """Sockets connected to the proxy's public port, from the proxy's side."""
        port = f":{self.port:04X}"
        count = 0
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                count += local.endswith(port) and state == "01"  # ESTABLISHED
        return count


async def non_reader(port: int, request: bytes, sockets: list[socket.socket]) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    sockets.append(sock)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request)


async def statuses(port: int, path: str, bodies: list[bytes], signed: bool) -> list[int]:
    found = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for body in bodies:
            headers = stripe_headers(body) if signed else {}
            try:
                async with session.post(
                    f"http://127.0.0.1:{port}{path}", data=body, headers=headers
                ) as response:
                    await response.read()
                    found.append(response.status)
            except (aiohttp.ClientError, TimeoutError):
                found.append(0)
    return found


def stripe_events(prefix: str, count: int) -> list[bytes]:
    return [json.dumps({"id": f"evt_{prefix}_{n}", "type": "x"}).encode() for n in range(count)]


async def probe(args: argparse.Namespace) -> dict[str, Any]:
    if args.scenario != "first":
        return await SCENARIOS[args.scenario](args)
    ca = trustme.CA()
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_tls)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        ca_file = workdir / "ca.pem"
        ca.cert_pem.write_to_path(str(ca_file))
        http_app, http_url = await start_app(None)
        https_app, https_url = await start_app(server_tls)
        try:
            sockets: list[socket.socket] = []
            async with Proxy(args.checkout, args.dsn, http_url, workdir, ca_file) as proxy:
                head = b"POST /github HTTP/1.1\r\nHost: p\r\nContent-Length: %d\r\n\r\n" % (
                    25 * MIB
                )
                for _ in range(3):
                    await non_reader(proxy.port, head, sockets)
                await asyncio.sleep(0.5)  # the heads reach their handlers
                got = await statuses(proxy.port, "/stripe", stripe_events("h", 20), True)
                results["heads: signed Stripe webhooks answered 200"] = f"{got.count(200)} of 20"
            for sock in sockets:
                sock.close()
            sockets = []
            async with Proxy(args.checkout, args.dsn, https_url, workdir, ca_file) as proxy:
                for _ in range(104):
                    await non_reader(proxy.port, b"GET /big HTTP/1.1\r\nHost: p\r\n\r\n", sockets)
                await asyncio.sleep(2)  # pass-through takes its upstream connections
                started = time.monotonic()
                got = await statuses(proxy.port, "/stripe", stripe_events("p", 5), True)
                took = time.monotonic() - started
                results["passthrough: webhooks to the https app answered 200"] = (
                    f"{got.count(200)} of 5 ({got}, {took:.1f} s)"
                )
            for sock in sockets:
                sock.close()
            sockets = []
            async with Proxy(args.checkout, args.dsn, http_url, workdir, ca_file) as proxy:
                first = await statuses(proxy.port, "/replay", [b'{"id": "r1"}'], False)
                assert first == [200], first
                rss = proxy.rss_mib()
                copy = b"POST /replay HTTP/1.1\r\nHost: p\r\nContent-Length: 12\r\n\r\n"
                for _ in range(50):
                    await non_reader(proxy.port, (copy + b'{"id": "r1"}') * 10, sockets)
                await asyncio.sleep(3)
                results["pipelined: RSS before -> with 50 non-readers, MiB"] = (
                    f"{rss:.0f} -> {proxy.rss_mib():.0f}"
                )
                results["held: connections at 3 s"] = proxy.client_sockets()
                await asyncio.sleep(15)
                results["held: connections at 18 s"] = proxy.client_sockets()
                got = await statuses(proxy.port, "/stripe", stripe_events("after", 5), True)
                results["held: webhooks answered 200 after"] = f"{got.count(200)} of 5"
            for sock in sockets:
                sock.close()
        finally:
            await http_app.cleanup()
            await https_app.cleanup()
    return results


async def trickle(
    port: int, head: bytes, sockets: list[socket.socket], stop: asyncio.Event
) -> None:
    """Send ``head``, then a byte every 2 s until ``stop`` (or 60 bytes)."""
    own: list[socket.socket] = []
    await non_reader(port, head, own)
    (sock,), loop = own, asyncio.get_running_loop()
    sockets += own
    for _ in range(60):
        try:
            await loop.sock_sendall(sock, b"x")
            await asyncio.wait_for(stop.wait(), 2)
            return
        except TimeoutError:
            continue
        except OSError:
            return


async def answered(port: int, requests: int) -> tuple[list[int], float]:
    """``requests`` pass-through GETs, at once: their statuses (0: none), and the time taken."""
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

        async def one(n: int) -> int:
            try:
                async with session.get(f"http://127.0.0.1:{port}/page/{n}") as response:
                    await response.read()
                    return response.status
            except (aiohttp.ClientError, TimeoutError):
                return 0

        got = await asyncio.gather(*(one(n) for n in range(requests)))
    return list(got), time.monotonic() - started


class Setting:
    """A scenario's apps and files, for one proxy."""

    async def __aenter__(self) -> Setting:
        self.tmp = tempfile.TemporaryDirectory()
        self.workdir = Path(self.tmp.name)
        self.ca_file = self.workdir / "ca.pem"
        trustme.CA().cert_pem.write_to_path(str(self.ca_file))
        self.app, self.url = await start_app(None)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.app.cleanup()
        self.tmp.cleanup()


async def big_heads(args: argparse.Namespace) -> dict[str, Any]:
    head = b"POST /upload HTTP/1.1\r\nHost: p\r\nContent-Length: 1000\r\n"
    head += b"".join(b"X-Pad-%d: %s\r\n" % (n, b"p" * 8000) for n in range(126)) + b"\r\nx"
    results: dict[str, Any] = {}
    sockets: list[socket.socket] = []
    async with (
        Setting() as setting,
        Proxy(args.checkout, args.dsn, setting.url, setting.workdir, setting.ca_file) as proxy,
    ):
        before = proxy.rss_mib()
        await asyncio.gather(*(non_reader(proxy.port, head, sockets) for _ in range(120)))
        await asyncio.sleep(3)
        results["bigheads: RSS before -> with 120 heads of 1 MiB, MiB"] = (
            f"{before:.0f} -> {proxy.rss_mib():.0f}"
        )
        results["bigheads: connections held at 3 s"] = proxy.client_sockets()
        got = await statuses(proxy.port, "/stripe", stripe_events("b", 5), True)
        results["bigheads: signed Stripe webhooks answered 200"] = f"{got.count(200)} of 5"
    for sock in sockets:
        sock.close()
    return results


async def masking(args: argparse.Namespace) -> dict[str, Any]:
    trap = b"postgres://a:" * 550  # 7,150 bytes: each under aiohttp's 8,190 per line
    request = b"POST /%s HTTP/1.1\r\nHost: p\r\nX-Request-Id: %s\r\nContent-Length: 0\r\n\r\n" % (
        trap,
        trap,
    )
    async with (
        Setting() as setting,
        Proxy(
            args.checkout, args.dsn, setting.url, setting.workdir, setting.ca_file, level="info"
        ) as proxy,
    ):
        slowest = 0.0
        done = asyncio.Event()

        async def poll() -> None:
            nonlocal slowest
            async with aiohttp.ClientSession() as session:
                for _ in range(400):
                    started = time.monotonic()
                    async with session.get(
                        f"http://127.0.0.1:{proxy.admin_port}/healthz"
                    ) as response:
                        await response.read()
                    slowest = max(slowest, time.monotonic() - started)
                    if done.is_set():
                        return
                    await asyncio.sleep(0.05)

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.5)
        baseline = slowest
        sockets: list[socket.socket] = []
        await asyncio.gather(*(non_reader(proxy.port, request, sockets) for _ in range(150)))
        await asyncio.sleep(5)
        done.set()
        await poller
        for sock in sockets:
            sock.close()
    return {
        "masking: slowest /healthz before -> under 150 trap requests, ms": (
            f"{baseline * 1000:.0f} -> {slowest * 1000:.0f}"
        )
    }


async def uploads(args: argparse.Namespace) -> dict[str, Any]:
    head = b"POST /upload HTTP/1.1\r\nHost: p\r\nContent-Length: 1000\r\n\r\n"
    async with (
        Setting() as setting,
        Proxy(args.checkout, args.dsn, setting.url, setting.workdir, setting.ca_file) as proxy,
    ):
        sockets: list[socket.socket] = []
        stop = asyncio.Event()
        tricklers = [
            asyncio.create_task(trickle(proxy.port, head, sockets, stop)) for _ in range(100)
        ]
        await asyncio.sleep(3)
        got, took = await answered(proxy.port, 10)
        stop.set()
        await asyncio.gather(*tricklers)
        for sock in sockets:
            sock.close()
    return {
        "uploads: pass-through requests answered 200 under 100 trickling uploads": (
            f"{got.count(200)} of 10 ({sorted(set(got))}, {took:.1f} s)"
        )
    }


SCENARIOS = {"bigheads": big_heads, "masking": masking, "uploads": uploads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument(
        "--scenario", choices=["first", *SCENARIOS], default="first",
        help="first: heads, passthrough, pipelined and held (round two's); or one of the others",
    )  # fmt: skip
    args = parser.parse_args()
    for name, value in asyncio.run(probe(args)).items():
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
