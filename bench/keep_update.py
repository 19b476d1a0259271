"""What one keep UPDATE costs as a route's kept backlog grows: the statement alone, timed.

    DEDUP_PROXY_TEST_DSN=$(bash .ci/postgres15) python bench/keep_update.py
        [--kept 0,1000,5000,10000] [--claims 100000] [--times 7] [--explain] [--index SQL]

A table of its own (``keep_update_bench``, dropped at the end) with ``--claims`` claims of
one route's scope, ``--kept`` of them kept (pending, a 1 KiB body and a request's headers, as
``Claim.keep`` stores them); for each level, one more claim's keep (``inbox_sql.Statements.
keep``, the cap's check included) run in a transaction that is rolled back, ``--times``
times: the median. ``--explain`` also prints EXPLAIN (ANALYZE, BUFFERS) at each level;
``--index`` creates an index first (its text with {table} for the table's name), to see
whether the cap's count uses it. The statement is this checkout's, the one its store sends: on
a table with the kept rows' counts (``sql._kept_counts``), ``keep_counted``. Run another
checkout's with ``PYTHONPATH`` pointing at it. Without ``DEDUP_PROXY_TEST_DSN``, on an embedded
PostgreSQL of its own, stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import asyncpg

from proxy import embedded
from proxy.database import inbox, inbox_sql, sql

TABLE = "keep_update_bench"
SCOPE = "bench"
BODY = b'{"id":"evt","pad":"' + b"x" * 1000 + b'"}'
REQUEST = inbox.StoredRequest(
    "bench", "http://127.0.0.1:8000", "POST", "/hook",
    (("content-type", "application/json"), ("user-agent", "Stripe/1.0 (+https://stripe.com)"),
     ("stripe-signature", "t=1733300000,v1=" + "ab" * 32), ("x-request-id", "r" * 36)),
    BODY,
)  # fmt: skip


async def fill(connection: asyncpg.Connection, claims: int, kept: int) -> None:
    """The table afresh: ``claims`` claims of the scope, the first ``kept`` of them kept."""
    queries = sql.for_table(TABLE)
    await drop(connection)
    for step in queries.schema_steps:
        await connection.execute(step)
    await connection.execute(
        f"INSERT INTO {queries.quoted} (scope, event_id, event_type, body_sha256) "
        "SELECT $1, 'evt_' || i, 'test', sha256(i::text::bytea) FROM generate_series(1, $2) i",
        SCOPE, claims,
    )  # fmt: skip
    # Kept as ``keep`` keeps them, in one statement (a keep per row would be the O(n²) this
    # measures): their size too where the table has the column (this checkout's schema).
    size = (
        ", inbox_size = octet_length($1::jsonb::text) + octet_length($2::bytea)"
        if any("inbox_size" in step for step in queries.schema_steps)
        else ""
    )
    await connection.execute(
        f"UPDATE {queries.quoted} SET inbox_state = 'pending', inbox_request = $1::jsonb, "
        "inbox_body = $2::bytea, inbox_attempts = '[]', inbox_failures = 1, inbox_due = now(), "
        f"inbox_until = now() + interval '1 day', inbox_changed = now(){size} "
        "WHERE scope = $3 AND event_id = ANY($4::text[])",
        REQUEST.encoded(), BODY, SCOPE, [f"evt_{i}" for i in range(1, kept + 1)],
    )  # fmt: skip
    await connection.execute(f"VACUUM ANALYZE {queries.quoted}")


async def drop(connection: asyncpg.Connection) -> None:
    """The table gone, and the kept rows' counts beside it (a checkout that makes them)."""
    await connection.execute(
        f"DROP TABLE IF EXISTS {TABLE}; DROP TABLE IF EXISTS {TABLE}_kept; "
        f"DROP FUNCTION IF EXISTS {TABLE}_kept_delta(); "
        f"DROP FUNCTION IF EXISTS {TABLE}_kept_fold(integer)"
    )


async def keep_statement(connection: asyncpg.Connection) -> str:
    """The keep this checkout's store sends on the table (``Inbox.counted``)."""
    statements = inbox_sql.Statements(sql.for_table(TABLE).quoted)
    row = await connection.fetchrow(sql.for_table(TABLE).schema_missing)
    counted = row is not None and "kept_counts" in row and row["kept_counts"]
    return str(statements.keep_counted) if counted else str(statements.keep)


async def timed(connection: asyncpg.Connection, times: int, explain: bool) -> float:
    """The median of ``times`` keeps of one more claim, each rolled back, in milliseconds."""
    keep = await keep_statement(connection)
    args = (SCOPE, "evt_new", "pending", REQUEST.encoded(), BODY, 503, None, 60.0, 86_400.0,
            SCOPE, 1_000_000, 1 << 40, None, 1, None)  # fmt: skip
    await connection.execute(
        f"INSERT INTO {sql.for_table(TABLE).quoted} (scope, event_id) VALUES ($1, 'evt_new')",
        SCOPE,
    )
    elapsed = []
    for _ in range(times):
        transaction = connection.transaction()
        await transaction.start()
        try:
            start = time.perf_counter()
            status = await connection.execute(keep, *args)
            elapsed.append((time.perf_counter() - start) * 1000)
            assert status == "UPDATE 1", status
        finally:
            await transaction.rollback()
    if explain:
        transaction = connection.transaction()
        await transaction.start()
        try:
            plan = await connection.fetch(f"EXPLAIN (ANALYZE, BUFFERS) {keep}", *args)
            print("\n".join(row[0] for row in plan))
        finally:
            await transaction.rollback()
    return statistics.median(elapsed)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kept", default="0,1000,5000,10000")
    parser.add_argument("--claims", type=int, default=100_000)
    parser.add_argument("--times", type=int, default=7)
    parser.add_argument("--explain", action="store_true")
    parser.add_argument("--index", help="an index to create first, {table} for the table")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        dsn = os.environ.get("DEDUP_PROXY_TEST_DSN")
        if dsn is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="keep-")))
            database = embedded.EmbeddedPostgres(workdir / "pg")
            dsn = database.start()
            stack.callback(database.stop)
        await measure(dsn, args)


async def measure(dsn: str, args: argparse.Namespace) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        print("| kept rows of the route | the keep UPDATE, median of", args.times, "|")
        print("|---|---|")
        for kept in map(int, args.kept.split(",")):
            await fill(connection, args.claims, kept)
            if args.index:
                await connection.execute(args.index.format(table=TABLE))
                await connection.execute(f"ANALYZE {TABLE}")
            median = await timed(connection, args.times, args.explain)
            print(f"| {kept:,} | {median:.2f} ms |", flush=True)
    finally:
        await drop(connection)
        await connection.close()


if __name__ == "__main__":
    asyncio.run(main())
