"""What a duplicate costs at the claim store: round trips and time, ack against replay.

    python bench/duplicate_cost.py --dsn postgresql://... [--count 2000]

Claims and commits ``--count`` events (with a 1 KiB answer stored, as ``on_duplicate:
replay`` does), then claims each again as a duplicate, alternating the two ways a route answers
one: ``ack`` (the claim, then ROLLBACK with the body comparison) and ``replay`` (the claim, the
stored answer read in the transaction, then ROLLBACK). Reports the median and p99 time of each
and the round trips each makes, counted as the messages written to the database's socket.
Uses its own table, dropped first. Talks to the given DSN only.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import time

from proxy import config, database

TABLE = "bench_duplicate_cost"


class _Counting:
    """Counts the round trips on one asyncpg connection: the writes asyncpg then waits on, a
    simple Query ('Q'), or extended-protocol messages ending in a Sync ('S') or, when it
    prepares a statement to learn its types, a Flush ('H')."""

    def __init__(self, connection: object) -> None:
        transport = connection._transport  # type: ignore[attr-defined]
        self.writes = 0
        original = transport.write

        def write(data: bytes) -> None:
            data = bytes(data)
            self.writes += data[:1] == b"Q" or data.endswith((b"S\0\0\0\x04", b"H\0\0\0\x04"))
            original(data)

        transport.write = write


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args()
    settings = config.DatabaseConfig(dsn=config.Secret(args.dsn), table=TABLE, pool_size=1)
    store = await database.Store.open(args.dsn, settings, claim_wait=5.0, upstream_timeout=30.0)
    try:
        # The bench reaches into the store's pool (a private door): to drop its own table, and
        # below to count the socket writes of the one connection every claim uses.
        async with store._connection() as connection:
            await connection.execute(f'DROP TABLE IF EXISTS "{TABLE}"')
        await store.ensure_schema()
        answer = database.Answer(200, (("Content-Type", "text/xml"),), b"x" * 1024)
        keys = [
            database.Key("bench", f"evt-{n}", None, hashlib.sha256(str(n).encode()).digest())
            for n in range(args.count)
        ]
        for key in keys:
            async with store.claim(key) as claim:
                await claim.commit(answer)
        timings: dict[str, list[float]] = {"ack": [], "replay": []}
        writes = dict.fromkeys(timings, 0)
        async with store._connection() as connection:
            counter = _Counting(connection)  # pool_size 1: every claim below uses it
        for n, key in enumerate(keys):
            mode = "ack" if n % 2 == 0 else "replay"
            before = counter.writes
            started = time.perf_counter()
            async with store.claim(key) as claim:
                assert not claim.acquired
                duplicate = await claim.settle_duplicate(read_answer=mode == "replay")
                assert duplicate.answer == (answer if mode == "replay" else None)
            timings[mode].append((time.perf_counter() - started) * 1e6)
            writes[mode] += counter.writes - before
    finally:
        await store.close()
    for mode, values in timings.items():
        values.sort()
        print(
            f"{mode:6}  n={len(values)}  median {statistics.median(values):7.0f} µs  "
            f"p99 {values[int(len(values) * 0.99)]:7.0f} µs  "
            f"round trips: {writes[mode] / len(values):.2f}"
        )


if __name__ == "__main__":
    asyncio.run(main())
