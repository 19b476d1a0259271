"""How long /healthz and a small webhook wait while one client sends bodies of small JSON objects.

    python bench/loop_stall.py --proxy http://127.0.0.1:8080 --admin http://127.0.0.1:9901

Against a running proxy whose configuration has a route at ``--path`` keyed by ``body:/id``
(no ``verify``: the attack needs no secret). One client sends ``--attackers`` concurrent
streams of ``--size`` bodies made of small nested objects, for ``--seconds``; meanwhile
/healthz and a 40-byte webhook are sent every 50 ms. Prints the median and worst latency of
each, and the same with no attack first. Talks to the given URLs only (use 127.0.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import aiohttp


def nested_body(size: int) -> bytes:
    """``{"id": …, "x": [{"a":{}}, …]}`` of about ``size`` bytes: one Python hook per object in
    a parser that checks for duplicate keys."""
    item = b'{"a":{}},'
    count = max(1, (size - 64) // len(item))
    return b'{"id": "%s", "x": [' % uuid.uuid4().hex.encode() + item * count + b"{}]}"


async def probe(session: aiohttp.ClientSession, url: str, data: bytes | None) -> float:
    started = time.perf_counter()
    async with session.request("POST" if data else "GET", url, data=data) as response:
        await response.read()
    return (time.perf_counter() - started) * 1000


async def measure(args: argparse.Namespace, attack: bool) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"healthz": [], "webhook": []}
    stop = time.monotonic() + args.seconds
    async with aiohttp.ClientSession() as session:

        async def attacker() -> None:
            while time.monotonic() < stop:
                async with session.post(args.proxy + args.path, data=nested_body(args.size)) as r:
                    await r.read()

        async def prober() -> None:
            while time.monotonic() < stop:
                timings["healthz"].append(await probe(session, args.admin + "/healthz", None))
                small = b'{"id": "%s"}' % uuid.uuid4().hex.encode()
                timings["webhook"].append(await probe(session, args.proxy + args.path, small))
                await asyncio.sleep(0.05)

        tasks = [prober()] + ([attacker() for _ in range(args.attackers)] if attack else [])
        await asyncio.gather(*tasks)
    return timings


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", default="http://127.0.0.1:8080")
    parser.add_argument("--admin", default="http://127.0.0.1:9901")
    parser.add_argument("--path", default="/webhooks/corvel")
    parser.add_argument("--size", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--attackers", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    for attack in (False, True):
        timings = await measure(args, attack)
        label = f"{args.attackers} x {args.size / 2**20:g} MiB nested JSON" if attack else "idle"
        for name, values in timings.items():
            print(
                f"{label:28} {name:8} n={len(values):4}  median {statistics.median(values):8.1f} ms"
                f"  worst {max(values):8.1f} ms"
            )


if __name__ == "__main__":
    asyncio.run(main())
