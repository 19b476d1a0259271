"""Receipts: what an app writes inside its own business transaction to say it took an event.

On a route with ``receipt``, the app is sent ``Dedup-Receipt: <key>`` (``Keys.key``: the
claim's table, scope and ID under an HMAC whose secret only the proxy knows) and writes it in
the same transaction as its effects, with one statement: ``SELECT dedup_receipt($1)`` (or
``INSERT INTO dedup_receipts (key) VALUES ($1)``). The key is the table's primary key and the
INSERT has no ``ON CONFLICT``: at most one transaction can ever commit a receipt for an event,
so the app's effects happen at most once, however often the event is sent. A second attempt's
INSERT fails (``unique_violation``), and so does its transaction.

When the proxy is in doubt (the app failed, answered late or not at all), it asks ``written``:
an ``INSERT … ON CONFLICT DO NOTHING`` of the key, always rolled back. PostgreSQL settles it the
way the claim itself is settled: a committed receipt conflicts (written), none lets the INSERT
through (not written), and an app transaction still open with the key makes the INSERT wait
for its end (bounded by ``lock_timeout``: undecided, None). So an app transaction in flight is
never taken for "not done".

The key is an HMAC so that nobody outside can compute it: an app writes whatever
``Dedup-Receipt`` it is sent, and a key anyone could compute would let whoever made the app
write it (a header a client slipped past the proxy, any other path to the app) squat the
receipt of an event still to come, which that event's delivery would then find written and
settle as processed, never applied. The secret is one row of the claim table, made by the
first replica to start with a route with ``receipt`` (``Store.receipt_keys``): every replica
and worker of a deployment reads the same, and the app, which needs only the key, never
reads it.

The receipts live in the claim database or in the app's own (``receipt.dsn``); either way in
the table ``dedup_receipts`` and the function ``dedup_receipt``, made by ``migrate``. A receipt
is kept for the longest retention of the routes that ask for receipts, then swept. The
connections are opened when first needed (a probe is made only when in doubt), one for each
look at once, so that a look waiting on an app's open transaction holds up no other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from proxy import errors
from proxy.database import pool, sql

log = logging.getLogger(__name__)

# The header the app reads its receipt's key from (a client's never reaches it: forwarder).
HEADER = "Dedup-Receipt"
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
# Looks at once per database and process: as many deliveries as can be in doubt at once
# (a replica's places at the app and its redeliverer's lanes, as configured by default).
MOST_AT_ONCE = 16
_MISSING = f"SELECT to_regclass('{TABLE}') IS NULL OR to_regprocedure('{FUNCTION}(text)') IS NULL"
# The privileges the proxy's role needs on the table that it lacks (docs/deployment.md).
_UNGRANTED = (
    "SELECT array_remove(ARRAY["
    + ", ".join(
        f"CASE WHEN has_table_privilege('{TABLE}', '{p}') THEN NULL ELSE '{p}' END"
        for p in ("SELECT", "INSERT", "DELETE")
    )
    + "], NULL)"
)
# How long ago the newest receipt was written (NULL: none is kept), by the written_at index.
_NEWEST = f"SELECT extract(epoch FROM now() - max(written_at))::float8 FROM {TABLE}"


# The secret's length in bytes: HMAC-SHA256's output.
SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class Keys:
    """The receipts' keys of one deployment, under the secret of its claim table's row
    (``Store.receipt_keys``)."""

    secret: bytes = field(repr=False)

    def key(self, table: str, scope: str, event_id: str) -> str:
        """The receipt's key for the claim of ``event_id`` in ``scope`` of the claim table
        ``table`` (two deployments may share the receipts' database): 64 hex digits, safe in
        a header and in any app's SQL, and computed by nobody without the secret."""
        message = f"{table}\n{scope}\n{event_id}".encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()


def described(written: bool | None) -> str:
    """What a look at a receipt (``Receipts.written``) found, as ``dedup_receipts_total``
    counts it."""
    return {True: "written", False: "absent", None: "undecided"}[written]


class Receipts:
    """The receipts of one database, over connections opened when first needed: one for each
    look at once, up to ``most`` (a look can wait ``wait`` on an app's open transaction, and
    the looks of other deliveries must not queue behind it), kept for the next ones."""

    def __init__(
        self, dsn: str, *, connect_timeout: float, op_timeout: float, most: int = MOST_AT_ONCE
    ) -> None:
        self._dsn = dsn
        self._connect_timeout = connect_timeout
        self._op_timeout = op_timeout
        self._idle: list[pool.Connection] = []
        self._slots = asyncio.Semaphore(most)  # one statement at a time on each connection

    @contextlib.asynccontextmanager
    async def _connection(self, what: str) -> AsyncIterator[pool.Connection]:
        """An idle connection, or a new one; ``what`` names a database error (translated). It
        is kept for the next statement unless an error left it in doubt."""
        async with self._slots:
            connection = None
            while self._idle and connection is None:
                idle = self._idle.pop()
                connection = None if idle.is_closed() else idle
            if connection is None:
                with pool.translated(
                    "cannot connect to the receipts' database", connecting=self._connect_timeout
                ):
                    connection = await pool.connect_one(self._dsn, timeout=self._connect_timeout)
            doubtful = functools.partial(pool.discard, connection)
            try:
                with pool.translated(what, doubtful):
                    yield connection
            except (errors.StoreUnavailable, _RollBack):
                raise  # closed by translated if in doubt; a refusal or a probe's end leaves it
            except BaseException:
                doubtful()  # cancelled or failed mid-statement: its session's state is unknown
                raise
            finally:
                if not connection.is_closed():
                    self._idle.append(connection)

    async def written(self, receipt: str, wait: float) -> bool | None:
        """Whether the app committed ``receipt``: True, False, or None when its transaction
        was still open after ``wait`` seconds (or the database did not answer: logged)."""
        try:
            async with (
                self._connection("reading a receipt failed") as connection,
                connection.transaction(),
            ):
                await connection.execute(sql.lock_timeout(wait))
                status = await connection.execute(_PROBE, receipt, timeout=wait + self._op_timeout)
                raise _RollBack(status)
        except _RollBack as done:
            return done.status.rpartition(" ")[2] == "0"
        except errors.LockTimeout:
            return None
        except errors.StoreUnavailable as exc:
            log.warning("a receipt could not be read: %s", exc.message)
            return None
        raise AssertionError("a probe ends with its ROLLBACK")  # pragma: no cover

    async def committed(self, receipt: str) -> bool:
        """Whether ``receipt`` is committed now (a plain read: for an app that answered 2xx,
        whose transaction has ended)."""
        async with self._connection("reading a receipt failed") as connection:
            found: bool = await connection.fetchval(_WRITTEN, receipt, timeout=self._op_timeout)
        return found

    async def missing(self) -> bool:
        """Whether the table or the function is missing."""
        async with self._connection("reading the receipts' schema failed") as connection:
            missing: bool = await connection.fetchval(_MISSING, timeout=self._op_timeout)
        return missing

    async def ungranted(self) -> tuple[str, list[str]]:
        """The proxy's role here (as a GRANT names it), and the privileges on the receipts'
        table that it needs and lacks: of SELECT, INSERT (the look, rolled back) and DELETE
        (the sweep)."""
        async with self._connection("reading the receipts' grants failed") as connection:
            role: str = await connection.fetchval("SELECT current_user", timeout=self._op_timeout)
            lacking: list[str] = await connection.fetchval(_UNGRANTED, timeout=self._op_timeout)
        return role, lacking

    async def newest_age(self) -> float | None:
        """Seconds since the newest receipt kept was written; None when none is kept."""
        async with self._connection("reading the receipts failed") as connection:
            age: float | None = await connection.fetchval(_NEWEST, timeout=self._op_timeout)
        return age

    async def migrate(self) -> None:
        """Make the table and the function (idempotent)."""
        async with (
            self._connection("making the receipts' table failed") as connection,
            connection.transaction(),
        ):
            for statement in DDL:
                await connection.execute(statement)

    async def sweep(self, retention: float, batch: int) -> int:
        """Delete up to ``batch`` receipts older than ``retention`` seconds: how many."""
        async with self._connection("sweeping receipts failed") as connection:
            status: str = await connection.execute(
                _SWEEP, retention, batch, timeout=self._op_timeout
            )
        return int(status.rpartition(" ")[2])

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            if not connection.is_closed():
                await connection.close(timeout=self._op_timeout)


class _RollBack(Exception):
    """Ends a probe's transaction with a ROLLBACK, carrying the INSERT's status."""

    def __init__(self, status: str) -> None:
        super().__init__(status)
        self.status = status
