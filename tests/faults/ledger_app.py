"""The campaign's receipt mode (``--receipts``), on the app's side: a ledger in the app's own
database, credited with the receipt in one transaction.

The app's database is a PostgreSQL of its own (embedded), apart from the claim database, and
the nemesis never touches it: receipts in the app's own database survive a restart or a
failover of the claim database (docs/guarantees.md, "The receipt"). ``database.Receipts``'s
``migrate`` makes ``dedup_receipts`` and ``dedup_receipt`` there, as ``dedup-proxy migrate``
does, and the route's ``receipt: {dsn: …}`` points at it, directly (no fault relay).

Each call is one transaction, as docs/how-it-works.md's snippets write it: the receipt first
(``SELECT dedup_receipt($1)``: a second delivery's INSERT waits on an open first one, and fails
once that commits), then the ledger row; then the app's work (its latency, the transaction open
all the while, so the proxy's look at a receipt can find it in flight); then COMMIT, or, for the
app's 5xx, either a ROLLBACK (it failed before committing) or, for ``COMMITTED_FAILURE_SHARE``
of them, a COMMIT and then the 5xx (committed, then answered 5xx: the answer is wrong, the
effect is done). What each call did is its ``effect``, counted by the checker
(``receipt_rule``): ``committed``, ``rolled_back``, or ``refused`` (the event's receipt was
committed already: the app refused it, rolled back and answered 500).

The ledger has no unique key of its own: the receipt is the only thing that keeps an effect
from committing twice, and the checker counts the ledger's rows per event at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from proxy import embedded
from proxy.database import receipts

LEDGER = "camp_ledger"
DDL = (
    f"CREATE TABLE IF NOT EXISTS {LEDGER} (id bigserial PRIMARY KEY, event_id text NOT NULL, "
    "delivery text, replica text, amount int NOT NULL, at timestamptz NOT NULL DEFAULT now())"
)
# Of the app's 5xx answers, the share it gives after its COMMIT (the others roll back).
COMMITTED_FAILURE_SHARE = 0.3
# The app's pool: more than the calls that can be at the app at once (each replica's pool, a
# call the proxy gave up on still working, the redeliverers), so that it is never the
# bottleneck; the report shows its peak.
POOL_SIZE = 32
REFUSED_STATUS = 500  # the app's answer to a delivery whose receipt is committed already

EFFECTS = ("committed", "rolled_back", "refused")


@dataclass(frozen=True, slots=True)
class Credit:
    """What one call did in the app's database: its ``effect`` (one of EFFECTS) and the app's
    answer's status."""

    effect: str
    status: int


class Ledger:
    """The app's database and its pool; ``credit`` is one call's transaction."""

    def __init__(self, dsn: str, pool: asyncpg.Pool, rng: random.Random) -> None:
        self.dsn = dsn
        self._pool = pool
        self._rng = rng  # its own: the campaign's shared generator draws as without receipts
        self.in_use = 0
        self.peak_in_use = 0
        self.longest_acquire = 0.0

    async def credit(
        self,
        event_id: str,
        receipt: str | None,
        latency: float,
        status: int,
        *,
        delivery: str | None,
        replica: str | None,
    ) -> Credit:
        """One call: the receipt and the ledger row in one transaction, open for ``latency``;
        committed on a 2xx ``status``, and on a 5xx either rolled back or committed."""
        if receipt is None:
            raise RuntimeError("no Dedup-Receipt on a call: is the route's receipt on?")
        commit_anyway = status >= 300 and self._rng.random() < COMMITTED_FAILURE_SHARE
        asked = time.monotonic()
        async with self._pool.acquire() as connection:
            self.longest_acquire = max(self.longest_acquire, time.monotonic() - asked)
            self.in_use += 1
            self.peak_in_use = max(self.peak_in_use, self.in_use)
            try:
                return await self._transaction(
                    connection, event_id, receipt, latency, status, commit_anyway,
                    delivery=delivery, replica=replica,
                )  # fmt: skip
            finally:
                self.in_use -= 1

    async def _transaction(
        self,
        connection: asyncpg.pool.PoolConnectionProxy[asyncpg.Record],
        event_id: str,
        receipt: str,
        latency: float,
        status: int,
        commit_anyway: bool,
        *,
        delivery: str | None,
        replica: str | None,
    ) -> Credit:
        transaction = connection.transaction()
        await transaction.start()
        try:
            await connection.execute(f"SELECT {receipts.FUNCTION}($1)", receipt)
            await connection.execute(
                f"INSERT INTO {LEDGER} (event_id, delivery, replica, amount) "
                "VALUES ($1, $2, $3, 100)",
                event_id, delivery, replica,
            )  # fmt: skip
        except asyncpg.UniqueViolationError:
            await transaction.rollback()
            return Credit("refused", REFUSED_STATUS)
        except BaseException:
            await transaction.rollback()
            raise
        try:
            await asyncio.sleep(latency)  # the app's work, its transaction open
        except BaseException:
            await transaction.rollback()
            raise
        if status >= 300 and not commit_anyway:
            await transaction.rollback()
            return Credit("rolled_back", status)
        await transaction.commit()
        return Credit("committed", status)

    async def counts(self) -> dict[str, int]:
        """The ledger's rows per event."""
        rows = await self._pool.fetch(
            f"SELECT event_id, count(*) AS n FROM {LEDGER} GROUP BY event_id"
        )
        return {row["event_id"]: int(row["n"]) for row in rows}

    def described(self) -> str:
        """The pool's use, for the report's settings."""
        return (
            f"peak {self.peak_in_use} of {POOL_SIZE} connections, longest wait for one "
            f"{self.longest_acquire * 1000:.0f} ms"
        )


@contextlib.asynccontextmanager
async def ledger(workdir: Path, rng: random.Random) -> AsyncIterator[Ledger]:
    """The app's own database, running, with the receipts' table and function (``migrate``)
    and the ledger; stopped on exit. Its choices draw from a generator seeded from ``rng``'s
    state, which it leaves as it was (the campaign's traffic and faults draw as without
    receipts)."""
    fork = random.Random()
    fork.setstate(rng.getstate())
    pg = embedded.EmbeddedPostgres(workdir / "app-pg")
    dsn = await asyncio.to_thread(pg.start)
    try:
        made = receipts.Receipts(dsn, connect_timeout=10.0, op_timeout=10.0)
        try:
            await made.migrate()
        finally:
            await made.close()
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=POOL_SIZE)
        try:
            await pool.execute(DDL)
            yield Ledger(dsn, pool, random.Random(f"ledger-{fork.random()}"))
        finally:
            await pool.close()
    finally:
        await asyncio.to_thread(pg.stop)
