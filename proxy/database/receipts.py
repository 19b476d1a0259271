"""Receipts: what an app writes inside its own business transaction to say it took an event.

On a route with ``receipt``, the app is sent ``Dedup-Receipt: <key>`` (``key``: the claim's
scope and ID, hashed) and writes it in the same transaction as its effects, with one statement:
``SELECT dedup_receipt($1)`` (or ``INSERT INTO dedup_receipts (key) VALUES ($1)``). The key is
the table's primary key and the INSERT has no ``ON CONFLICT``: at most one transaction can ever
commit a receipt for an event, so the app's effects happen at most once, however often the event
is sent. A second attempt's INSERT fails (``unique_violation``), and so does its transaction.

When the proxy is in doubt (the app failed, answered late or not at all), it asks ``written``:
an ``INSERT … ON CONFLICT DO NOTHING`` of the key, always rolled back. PostgreSQL settles it the
way the claim itself is settled: a committed receipt conflicts (written), none lets the INSERT
through (not written), and an app transaction still open with the key makes the INSERT wait
for its end (bounded by ``lock_timeout``: undecided, None). So an app transaction in flight is
never taken for "not done".

The receipts live in the claim database or in the app's own (``receipt.dsn``); either way in
the table ``dedup_receipts`` and the function ``dedup_receipt``, made by ``migrate``. A receipt
is kept for the longest retention of the routes that ask for receipts, then swept. The
connection is one per database, opened when first needed: a probe is made only when in doubt.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from proxy import errors
from proxy.database import pool, sql

log = logging.getLogger(__name__)

TABLE = "dedup_receipts"
FUNCTION = "dedup_receipt"
DDL = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} ("
    "key text PRIMARY KEY, written_at timestamptz NOT NULL DEFAULT now())",
    f"CREATE INDEX IF NOT EXISTS {TABLE}_written_at_idx ON {TABLE} (written_at)",
    # No ON CONFLICT: a second receipt for one event fails, and so does its transaction.
    f"CREATE OR REPLACE FUNCTION {FUNCTION}(receipt text) RETURNS void LANGUAGE sql AS "
    f"$$ INSERT INTO {TABLE} (key) VALUES (receipt) $$",
)
_PROBE = f"INSERT INTO {TABLE} (key) VALUES ($1) ON CONFLICT (key) DO NOTHING"
_WRITTEN = f"SELECT EXISTS (SELECT 1 FROM {TABLE} WHERE key = $1)"
_SWEEP = (
    f"DELETE FROM {TABLE} WHERE key IN (SELECT key FROM {TABLE} "
    "WHERE written_at < now() - make_interval(secs => $1) LIMIT $2)"
)
_MISSING = f"SELECT to_regclass('{TABLE}') IS NULL OR to_regprocedure('{FUNCTION}(text)') IS NULL"


def key(table: str, scope: str, event_id: str) -> str:
    """The receipt's key for the claim of ``event_id`` in ``scope`` of the claim table
    ``table`` (two deployments may share the receipts' database): 64 hex digits, safe in a
    header and in any app's SQL."""
    return hashlib.sha256(f"{table}\n{scope}\n{event_id}".encode()).hexdigest()


def described(written: bool | None) -> str:
    """What a look at a receipt (``Receipts.written``) found, as ``dedup_receipts_total``
    counts it."""
    return {True: "written", False: "absent", None: "undecided"}[written]


class Receipts:
    """The receipts of one database, over one connection opened when first needed."""

    def __init__(self, dsn: str, *, connect_timeout: float, op_timeout: float) -> None:
        self._dsn = dsn
        self._connect_timeout = connect_timeout
        self._op_timeout = op_timeout
        self._connection: pool.Connection | None = None
        self._lock = asyncio.Lock()  # one statement at a time on the one connection

    async def _connected(self) -> pool.Connection:
        if self._connection is None or self._connection.is_closed():
            with pool.translated(
                "cannot connect to the receipts' database", connecting=self._connect_timeout
            ):
                self._connection = await pool.connect_one(self._dsn, timeout=self._connect_timeout)
        return self._connection

    def _discard(self) -> None:
        if self._connection is not None:
            pool.discard(self._connection)
            self._connection = None

    async def written(self, receipt: str, wait: float) -> bool | None:
        """Whether the app committed ``receipt``: True, False, or None when its transaction
        was still open after ``wait`` seconds (or the database did not answer: logged)."""
        async with self._lock:
            try:
                connection = await self._connected()
                with pool.translated("reading a receipt failed", self._discard):
                    async with connection.transaction():
                        await connection.execute(sql.lock_timeout(wait))
                        status = await connection.execute(
                            _PROBE, receipt, timeout=wait + self._op_timeout
                        )
                        raise _RollBack(status)
            except _RollBack as done:
                return done.status.rpartition(" ")[2] == "0"
            except errors.LockTimeout:
                return None
            except errors.StoreUnavailable as exc:
                log.warning("a receipt could not be read: %s", exc.message)
                return None

    async def committed(self, receipt: str) -> bool:
        """Whether ``receipt`` is committed now (a plain read: for an app that answered 2xx,
        whose transaction has ended)."""
        async with self._lock:
            connection = await self._connected()
            with pool.translated("reading a receipt failed", self._discard):
                found: bool = await connection.fetchval(_WRITTEN, receipt, timeout=self._op_timeout)
        return found

    async def missing(self) -> bool:
        """Whether the table or the function is missing."""
        async with self._lock:
            connection = await self._connected()
            with pool.translated("reading the receipts' schema failed", self._discard):
                missing: bool = await connection.fetchval(_MISSING, timeout=self._op_timeout)
        return missing

    async def migrate(self) -> None:
        """Make the table and the function (idempotent)."""
        async with self._lock:
            connection = await self._connected()
            with pool.translated("making the receipts' table failed", self._discard):
                async with connection.transaction():
                    for statement in DDL:
                        await connection.execute(statement)

    async def sweep(self, retention: float, batch: int) -> int:
        """Delete up to ``batch`` receipts older than ``retention`` seconds: how many."""
        async with self._lock:
            connection = await self._connected()
            with pool.translated("sweeping receipts failed", self._discard):
                status: str = await connection.execute(
                    _SWEEP, retention, batch, timeout=self._op_timeout
                )
        return int(status.rpartition(" ")[2])

    async def close(self) -> None:
        if self._connection is not None and not self._connection.is_closed():
            await self._connection.close(timeout=self._op_timeout)
        self._connection = None


class _RollBack(Exception):
    """Ends a probe's transaction with a ROLLBACK, carrying the INSERT's status."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status
