"""The claim store: one row per (scope, event_id) in PostgreSQL, claimed inside an open transaction.

The whole concurrency design rests on PostgreSQL's unique index. ``INSERT … ON CONFLICT DO
NOTHING`` in a READ COMMITTED transaction either inserts the row (this request owns the event
until it commits or rolls back), returns nothing because a committed row exists (a duplicate), or
*waits* on another transaction's uncommitted row and then does one of the two once that
transaction ends. No SELECT-before-INSERT, no advisory locks: the index is the lock, and it is
released exactly when the owner's transaction ends (commit, rollback, or its connection dying).

asyncpg and socket errors are translated into ``errors`` here and nowhere else: by
``translated``, which the operator commands and the sweeper use too. ``open_connection`` is the one
way to connect, and holds what PgBouncer asks of a connection; the statements are in ``sql``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import asyncpg

from proxy import errors, sql
from proxy.pool import Connection, Pool

if TYPE_CHECKING:
    from proxy import config

log = logging.getLogger(__name__)

# Errors meaning "the database is not usable right now"; anything else is a bug and propagates.
# InternalClientError: asyncpg's protocol is in a state it cannot leave (an error still being
# consumed when the connection broke): the connection is as unusable as a dead one.
DB_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)
APPLICATION_NAME = "dedup-proxy"
GRANT_ANSWER_HINT = f"needs GRANT UPDATE ({', '.join(sql.ANSWER_COLUMNS)})"
# What each privilege is for, as the refusal to start says it (docs/deployment.md, "The role").
PRIVILEGES = {
    "SELECT": "duplicates and readiness read the claims",
    "INSERT": "the claim itself",
    "DELETE": "the retention sweep and events forget",
}


def translated(what: str, on_error: Callable[[], object] | None = None) -> Translation:
    """A block whose database errors raise StoreUnavailable("<what>: <the error>"), after
    ``on_error`` (closing a connection left in doubt). Errors a caller means to tell apart (a
    lock wait exceeded, a missing table) it catches inside the block."""
    return Translation(what, on_error)


class Translation:
    """``translated``'s context manager; a class, not a generator, which would cost several
    times as much on every claim."""

    __slots__ = ("_on_error", "_what")

    def __init__(self, what: str, on_error: Callable[[], object] | None) -> None:
        self._what = what
        self._on_error = on_error

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, DB_ERRORS):
            if self._on_error is not None:
                self._on_error()
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            raise errors.StoreUnavailable(f"{self._what}: {detail}") from exc


def open_connection(
    dsn: str,
    settings: config.DatabaseConfig,
    *,
    application_name: str = APPLICATION_NAME,
    command_timeout: float | None = None,
) -> Awaitable[Connection]:
    """A connection that works through PgBouncer in transaction pooling mode.

    Nothing but ``application_name`` (which PgBouncer tracks) goes into the startup packet; the
    settings a claim relies on travel inside its transaction (``sql.begin``). No prepared
    statement outlives its round trip: asyncpg's statement cache would name statements on one
    server connection and use them on another.
    """
    connection: Awaitable[Connection] = asyncpg.connect(
        dsn,
        timeout=settings.connect_timeout,
        command_timeout=command_timeout,
        statement_cache_size=0,
        server_settings={"application_name": application_name},
    )
    return connection


def schema_sql(table: str) -> str:
    """The DDL for the claim table (idempotent)."""
    return sql.for_table(table).schema


# How long the DDL may wait for the claim table's lock. ALTER TABLE queues behind every claim in
# flight, and every new claim queues behind it: a short wait that fails bounds that stall.
DDL_LOCK_WAIT = 5.0


async def missing_schema(
    connection: Connection, queries: sql.Queries, *, answers: bool = True
) -> str:
    """What the claim table lacks ("" when nothing), read from the catalog without locks;
    the answer columns only with ``answers`` (some route replays)."""
    row = await connection.fetchrow(queries.schema_missing)
    if row is None or not row["table"]:
        return "does not exist"
    needed = ("digest", "answer", "index") if answers else ("digest", "index")
    lacking = [name for name in needed if not row[name]]
    names = {
        "digest": "column body_sha256",
        "answer": "the answer columns (on_duplicate: replay)",
        "index": "index on received_at",
    }
    return "lacks " + " and ".join(names[n] for n in lacking) if lacking else ""


async def missing_grants(
    connection: Connection, queries: sql.Queries, *, answers: bool = True, wait: float | None = None
) -> str:
    """The privileges on the claim table the role lacks, as the GRANTs that give them and why
    ("" when none, or when the table is missing: ``missing_schema`` says so); UPDATE on the
    answer columns only with ``answers``."""
    row = await connection.fetchrow(queries.privileges, timeout=wait)
    if row is None or not row["table"]:
        return ""
    return _lacking(row, queries, answers=answers)


def _lacking(row: asyncpg.Record, queries: sql.Queries, *, answers: bool) -> str:
    role, table = row["role"], queries.quoted
    lacking = [name for name in PRIVILEGES if not row[name.lower()]]
    grants = []
    if lacking:
        why = "; ".join(f"{name}: {PRIVILEGES[name]}" for name in lacking)
        grants.append(f"GRANT {', '.join(lacking)} ON {table} TO {role} ({why})")
    if answers and row["answer"] is False:
        columns = ", ".join(sql.ANSWER_COLUMNS)
        grants.append(
            f"GRANT UPDATE ({columns}) ON {table} TO {role} (on_duplicate: replay stores the "
            "app's answer)"
        )
    return f"role {role} lacks privileges: " + "; ".join(grants) if grants else ""


async def apply_schema(connection: Connection, queries: sql.Queries) -> None:
    """Create or upgrade the claim table; safe when several replicas start at once. Gives up
    (StoreUnavailable) rather than wait more than DDL_LOCK_WAIT for the table's lock."""
    try:
        async with connection.transaction():
            await connection.execute(queries.schema_lock)
            await connection.execute(sql.lock_timeout(DDL_LOCK_WAIT))
            await connection.execute(queries.schema)
    except asyncpg.LockNotAvailableError:
        raise errors.StoreUnavailable(
            f"table {queries.table}: the schema change could not lock the table within "
            f"{DDL_LOCK_WAIT:g}s (claims in flight hold it); run 'dedup-proxy migrate' at a "
            "quieter moment"
        ) from None


def discard(connection: Connection) -> None:
    """Close a connection in doubt so the pool never lends it again."""
    connection.terminate()


@dataclass(frozen=True, slots=True)
class Answer:
    """The app's 2xx answer as stored for replay: its status, end-to-end headers in order
    (repeated ones kept) and body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Key:
    """What is claimed: the event, and the facts stored with it."""

    scope: str
    event_id: str
    event_type: str | None
    body_sha256: bytes


class Claim:
    """This request's hold on one event; ``acquired`` is False for a duplicate, and then
    ``mismatch`` says whether the event was first claimed with a different body."""

    def __init__(self, store: ClaimStore, connection: Connection, key: Key) -> None:
        self._store = store
        self._connection = connection
        self.key = key
        self.acquired = False
        self.mismatch = False
        self.reconciled = False
        self.answer_refused: str | None = None
        self._open = True
        self._plain_rollback = False  # the mismatch is known already (stored_answer)

    async def commit(self, answer: Answer | None = None) -> None:
        """Make the claim permanent, with ``answer`` stored for replay in the same round trip;
        raise CommitFailed if that cannot be made certain.

        When COMMIT fails (the connection was lost, the server went away) the claim may or may
        not have been stored. ``reconcile`` then settles it on a fresh connection (re-claimed
        there without an answer: its duplicates then get the proxy's own acknowledgement).
        When the server refuses to store the answer (the role may not UPDATE it), the claim is
        committed without it on the same connection, and ``answer_refused`` says why.
        """
        self._open = False
        statement = "COMMIT"
        if answer is not None:
            key = self.key
            statement = self._store.queries.commit_answer(
                key.scope, key.event_id, answer.status, list(answer.headers), answer.body
            )
        try:
            try:
                await self._connection.execute(statement, timeout=self._store.op_timeout)
            except asyncpg.InsufficientPrivilegeError as exc:
                if answer is None:
                    raise
                self.answer_refused = f"{exc} (on_duplicate: replay {GRANT_ANSWER_HINT})"
                log.warning(
                    "the app's answer to %s %s was not stored for replay, its claim kept "
                    "without it (its duplicates get the proxy's acknowledgement): %s",
                    self.key.scope, self.key.event_id, self.answer_refused,
                )  # fmt: skip
                await self._connection.execute(
                    sql.COMMIT_WITHOUT_ANSWER, timeout=self._store.op_timeout
                )
        except DB_ERRORS as exc:
            discard(self._connection)
            if await self._store.reconcile(self.key):
                self.reconciled = True
                return
            raise errors.CommitFailed(
                f"COMMIT failed and could not be reconciled: {exc!r}"
            ) from exc

    async def stored_answer(self) -> Answer | None:
        """For a duplicate, inside its transaction (READ COMMITTED: this statement sees the row
        a concurrent owner committed while this copy waited): the answer stored with the claim,
        None if it has none. Also settles ``mismatch``, so the ROLLBACK that follows is plain."""
        key = self.key
        with translated("reading the stored answer failed", self.abandon):
            row = await self._connection.fetchrow(
                self._store.queries.answer, key.scope, key.event_id, key.body_sha256,
                timeout=self._store.op_timeout,
            )  # fmt: skip
        self.mismatch = bool(row and row["mismatch"])
        self._plain_rollback = True
        if row is None or row["answer_status"] is None:
            return None
        headers = tuple((name, value) for name, value in json.loads(row["answer_headers"]))
        return Answer(row["answer_status"], headers, row["answer_body"])

    async def release(self, rollback: str = "ROLLBACK") -> None:
        """Roll back unless committed, with ``rollback`` (a duplicate's also compares the
        bodies, see sql.Queries.duplicate); a connection in doubt is closed, never reused."""
        if self._open:
            self._open = False
            if self._plain_rollback:
                rollback = "ROLLBACK"
            try:
                status = await self._connection.execute(rollback, timeout=self._store.op_timeout)
                if rollback != "ROLLBACK":
                    self.mismatch = status == "SELECT 1"
            except DB_ERRORS as exc:
                log.warning("rollback failed, closing the connection: %r", exc)
                discard(self._connection)

    def abandon(self) -> None:
        """The connection failed mid-claim: close it rather than wait on it again."""
        self._open = False
        discard(self._connection)


class ClaimStore:
    """A pool of connections, each set up so that a stuck claim cannot outlive its bounds."""

    def __init__(
        self,
        pool: Pool,
        settings: config.DatabaseConfig,
        *,
        claim_wait: float,
        upstream_timeout: float,
        connect: Callable[[], Awaitable[Connection]],
    ) -> None:
        self._pool = pool
        self._connect = connect
        self._settings = settings
        self.queries = sql.for_table(settings.table)
        self.op_timeout = settings.connect_timeout
        self._claim_timeout = claim_wait + settings.connect_timeout
        # A copy waits on an in-flight claim at most claim_wait; and the claim stays open while
        # the upstream works, so past the upstream's timeout the server itself rolls back a
        # claim whose proxy vanished without closing its socket.
        self._claim_wait = claim_wait
        self._idle_limit = upstream_timeout + settings.connect_timeout
        self._begin = sql.begin(claim_wait, self._idle_limit)
        self._answers = False  # whether the routes need UPDATE (check_privileges)

    @classmethod
    async def open(
        cls,
        dsn: str,
        settings: config.DatabaseConfig,
        *,
        claim_wait: float,
        upstream_timeout: float,
    ) -> ClaimStore:
        """Connect the pool; raise StoreUnavailable if PostgreSQL cannot be reached.

        Nothing changes a session after connecting, so a connection needs no reset between
        requests (see pool.py), and any server connection PgBouncer hands over will do.
        """
        connect = functools.partial(open_connection, dsn, settings)
        with translated("cannot connect to PostgreSQL"):
            pool = await Pool.open(
                functools.partial(connect, command_timeout=claim_wait + settings.connect_timeout),
                settings.pool_size,
            )
        return cls(
            pool, settings, claim_wait=claim_wait, upstream_timeout=upstream_timeout,
            connect=connect,
        )  # fmt: skip

    async def close(self) -> None:
        await self._pool.close(self.op_timeout)

    async def ensure_schema(self, *, answers: bool = True) -> None:
        """Check the claim table; create or upgrade it only if something is missing.

        The check reads the catalog only. The DDL is never run needlessly: even with IF NOT
        EXISTS, CREATE INDEX and ALTER TABLE take table locks that queue behind every claim in
        flight and block every new one, so a replica restarting under traffic would stall all.
        """
        table = self._settings.table
        async with self.connection() as connection:
            with translated(f"cannot prepare table {table}"):
                missing = await missing_schema(connection, self.queries, answers=answers)
                if missing and self._settings.create_schema:
                    await apply_schema(connection, self.queries)
                    return
        if missing:
            raise errors.StoreUnavailable(
                f"table {table}: {missing}, and database.create_schema is false; run "
                "'dedup-proxy migrate' (or apply 'dedup-proxy schema') or set create_schema: true"
            )

    @contextlib.asynccontextmanager
    async def claim(self, key: Key, wait: float | None = None) -> AsyncIterator[Claim]:
        """Claim (scope, event_id); waits while another transaction holds it uncommitted, at
        most ``wait`` seconds (a route's own claim_wait; default the store's).

        Raises StoreUnavailable (no connection or the database failed) or ClaimWaitExceeded.
        On exit the transaction is rolled back unless ``Claim.commit()`` was called; for a
        duplicate, ``mismatch`` is only known then.
        """
        connection = await self._acquire()
        claim = Claim(self, connection, key)
        rollback = "ROLLBACK"
        begin, timeout = self._begin, self._claim_timeout
        if wait is not None and wait != self._claim_wait:
            begin = sql.begin(wait, self._idle_limit)
            timeout = wait + self.op_timeout
        try:
            with translated("claim failed", claim.abandon):
                try:
                    status = await connection.execute(
                        self.queries.claim(
                            begin, key.scope, key.event_id, key.event_type, key.body_sha256
                        ),
                        timeout=timeout,
                    )
                except asyncpg.LockNotAvailableError as exc:
                    raise errors.ClaimWaitExceeded() from exc
            claim.acquired = status.rpartition(" ")[2] == "1"
            if not claim.acquired:
                rollback = self.queries.duplicate(key.scope, key.event_id, key.body_sha256)
            yield claim
        finally:
            try:
                await claim.release(rollback)
            except BaseException:
                # Cancelled mid-ROLLBACK (a shutdown past its timeout): the session's state is
                # unknown, and asyncpg's in-transaction flag may be stale.
                discard(connection)
                raise
            finally:
                self._release(connection)

    def _claim_sql(self, key: Key, *, commit: bool = False) -> str:
        return self.queries.claim(
            self._begin, key.scope, key.event_id, key.event_type, key.body_sha256, commit=commit
        )

    async def reconcile(self, key: Key) -> bool:
        """After a COMMIT in doubt: is the claim stored now? Re-claims it if it is absent.

        On a fresh connection outside the pool (the pooled ones may sit behind the same broken
        link), the claim again, committed at once: a conflict means the row is there (our COMMIT
        went through, or the event was processed elsewhere); an insert means our COMMIT was lost
        and the claim is now stored. Anything else (the database still unreachable, our old
        transaction still holding the row past claim_wait) leaves it unknown: False.
        """
        try:
            connection = await self._connect()
            try:
                await connection.execute(
                    self._claim_sql(key, commit=True), timeout=self._claim_timeout
                )
            finally:
                connection.terminate()
        except DB_ERRORS as exc:
            log.warning("reconciling a COMMIT in doubt failed: %r", exc)
            return False
        return True

    async def _acquire(self) -> Connection:
        now = time.monotonic()
        if self._pool.ready(now):
            # The common case, without arming a timer: a free connection, lent at once.
            return await self._pool.acquire(now)
        with translated("cannot connect to PostgreSQL"):
            try:
                # asyncio.timeout, not acquire(timeout=): on Python 3.11 asyncpg's wait_for
                # makes a task per call.
                async with asyncio.timeout(self._settings.pool_timeout):
                    connection: Connection = await self._pool.acquire()
            except TimeoutError as exc:
                raise errors.PoolExhausted(
                    f"no free database connection within {self._settings.pool_timeout:g}s "
                    f"(pool_size {self._settings.pool_size})"
                ) from exc
        return connection

    def _release(self, connection: Connection) -> None:
        self._pool.release(connection)

    async def check_privileges(self, *, answers: bool) -> None:
        """Raise StoreUnavailable naming each grant the routes need that the role lacks
        (UPDATE on the answer columns with ``answers``); ``check`` verifies them from then on."""
        self._answers = answers
        async with self.connection() as connection:
            with translated("reading the role's privileges failed"):
                problem = await missing_grants(
                    connection, self.queries, answers=answers, wait=self.op_timeout
                )
        if problem:
            raise errors.StoreUnavailable(f"table {self._settings.table}: {problem}")

    async def check(self) -> None:
        """Raise StoreUnavailable unless the database answers, the claim table exists and the
        role still holds the privileges ``check_privileges`` verified; one statement."""
        async with self.connection() as connection:
            with translated("database check failed"):
                row = await connection.fetchrow(self.queries.privileges, timeout=self.op_timeout)
        if row is None or not row["table"]:
            raise errors.StoreUnavailable(f"table {self._settings.table} does not exist")
        if problem := _lacking(row, self.queries, answers=self._answers):
            raise errors.StoreUnavailable(f"table {self._settings.table}: {problem}")

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Connection]:
        """A pooled connection for work besides claims (the retention sweep); one that fails
        or is cancelled mid-statement is closed, never lent again."""
        connection = await self._acquire()
        try:
            yield connection
        except BaseException:
            discard(connection)
            raise
        finally:
            self._release(connection)

    def pool_stats(self) -> tuple[int, int]:
        """(connections open, connections idle)."""
        return self._pool.stats()
