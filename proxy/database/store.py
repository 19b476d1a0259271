"""The store: every database operation the proxy makes, each a method (procrastinate's
``manager.py`` is the model), over a pool of connections set up so that a stuck claim cannot
outlive its bounds.

Serving: ``claim`` (see ``claim``), ``reconcile`` after a COMMIT in doubt, the start-up checks
(``ensure_schema``, ``check_privileges``) and readiness (``check``), the upgrade window of the
routes whose claims are bound (``notice_id_forms``, ``legacy_form``), a batch of the retention
sweep, the route holds (``holds``), a route's turn to reconcile (``reconcile_turn``).
Operating (the CLI's commands, over a pool of one):
``events``, ``resolve`` (an ID as the provider sent it), ``forget``, ``stats``, ``migrate`` and
the facts the preflight reports. The statements are in ``sql``; what the driver's errors mean,
in ``pool``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import UTC, datetime
from typing import TYPE_CHECKING, NamedTuple

from proxy import errors
from proxy.database import holds, inbox, pool, receipts, slots, sql
from proxy.database.claim import Claim, Key, is_bound, unbound
from proxy.database.pool import Connection, Pool, translated

if TYPE_CHECKING:
    from proxy import config

log = logging.getLogger(__name__)

# What each privilege is for, as the refusal to start says it
# (docs/deployment.md, "Database role and grants").
PRIVILEGES = {
    "SELECT": "duplicates and readiness read the claims",
    "INSERT": "the claim itself",
    "DELETE": "the retention sweep and events forget",
}
# What a claim cannot be made without, which readiness requires (``Store.check``); the other
# grants the routes need (DELETE for the sweep and forget, UPDATE for a replayed answer or a
# kept delivery) failing only their own part, their absence is reported (``degraded``), not
# made an outage.
CLAIM_PATH = ("SELECT", "INSERT")
# The grants besides CLAIM_PATH, as ``Store.degraded`` and dedup_database_grant_missing name them.
DEGRADED = ("delete", "update_answers", "update_inbox")
# How long the DDL may wait for the claim table's lock. ALTER TABLE queues behind every claim in
# flight, and every new claim queues behind it: a short wait that fails bounds that stall.
DDL_LOCK_WAIT = 5.0
# The sweep: a forget holds its rows for one short statement; longer means a transaction left
# open on a claim, and the sweep's own deleted rows (which a redelivery of their events would
# wait on) must not stay locked while it waits.
SWEEP_ROW_LOCK_WAIT = 1.0
TABLE_MISSING = (
    "the claim table does not exist yet: start the proxy once or run 'dedup-proxy migrate'"
)


@contextlib.contextmanager
def _plainly_missing() -> Iterator[None]:
    """An operator's query on a missing table says what to do about it."""
    try:
        yield
    except errors.TableMissing as exc:
        raise errors.TableMissing(TABLE_MISSING) from exc.__cause__


class Replication(NamedTuple):
    """Whether this session's COMMITs wait for a standby: ``synchronous_commit`` (on,
    remote_write and remote_apply wait; local and off do not) and the server's
    ``synchronous_standby_names`` (empty: no standby is waited for, whatever the former)."""

    synchronous_commit: str
    standby_names: str

    @property
    def waits(self) -> bool:
        return bool(self.standby_names.strip()) and self.synchronous_commit in (
            "on", "remote_write", "remote_apply",
        )  # fmt: skip

    def __str__(self) -> str:
        return (
            f"synchronous_commit {self.synchronous_commit}, synchronous_standby_names "
            f"{self.standby_names!r}" if self.standby_names.strip()
            else f"synchronous_commit {self.synchronous_commit}, synchronous_standby_names empty"
        )  # fmt: skip


def _writable(row: pool.Record) -> str:
    """Why a claim cannot commit on the server a row of ``queries.privileges`` came from ("" if
    it can)."""
    if row["in_recovery"]:
        return "the database is read-only: in recovery (a standby)"
    if row["read_only"]:
        return "the database is read-only: default_transaction_read_only is on"
    return ""


class Event(NamedTuple):
    """One claim as ``events list`` shows it."""

    scope: str
    event_id: str
    event_type: str | None
    received_at: datetime
    state: str | None  # the inbox's (inbox.InboxState); None: not kept, delivered at once


class Distribution(NamedTuple):
    """How Citus distributes the claim table: by ``column`` (None: not distributed, a plain
    table on the coordinator or a reference table) over ``shards`` (0: a plain table); and
    whether the role's sessions have standard_conforming_strings on (``sql._CONFORMING``)."""

    column: str | None
    shards: int
    conforming: bool = True

    @property
    def distributed(self) -> bool:
        """Whether Citus has the table in its catalog (not a plain table on the coordinator)."""
        return (self.column, self.shards) != (None, 0)


class Resolved(NamedTuple):
    """What an ID an operator gave names in one scope (``Store.resolve``): ``stored``, the
    one claim's ID ("" none); else ``candidates``, its claims bound to different bodies."""

    stored: str
    candidates: tuple[str, ...] = ()


def _resolved(given: str, rows: list[str]) -> Resolved:
    bound = sorted(row for row in rows if is_bound(row, given))
    if len(bound) > 1:
        return Resolved("", tuple(bound))
    if bound:
        return Resolved(bound[0])  # the given ID's own row is its legacy form, if any
    return Resolved(given if given in rows else "")


def _resolved_by_last_part(given: str, rows: list[str]) -> Resolved:
    """What ``given``, the last part of composite IDs (GitHub's GUID without its hook ID),
    names among ``rows``, the claims whose last part it is: one claim, else the candidates
    (one GUID under several hooks, or bound to several bodies)."""
    by_id: dict[str, list[str]] = {}
    for row in rows:
        last = row.rpartition(":")[2]
        if last != given and not is_bound(last, given):
            continue  # an ID with a '~' of its own, not bound to a body
        by_id.setdefault(unbound(row), []).append(row)
    found = [_resolved(event_id, ids) for event_id, ids in sorted(by_id.items())]
    found = [f for f in found if f.stored or f.candidates]
    if len(found) == 1:
        return found[0]
    return Resolved("", tuple(sorted(c for f in found for c in (f.stored, *f.candidates) if c)))


class ScopeStats(NamedTuple):
    """The claims of one scope: how many, the oldest and the newest; how many the inbox holds
    pending and dead."""

    scope: str
    rows: int
    oldest: datetime
    newest: datetime
    pending: int
    dead: int


def schema_sql(table: str) -> str:
    """The DDL for the claim table (idempotent)."""
    return sql.for_table(table).schema


async def missing_schema(
    connection: Connection, queries: sql.Queries, *, answers: bool = True, kept: bool = False
) -> str:
    """What the claim table lacks ("" when nothing), read from the catalog without locks;
    the answer columns only with ``answers`` (some route replays), the inbox's only with
    ``kept`` (some route redelivers)."""
    return _lacking_schema(
        await connection.fetchrow(queries.schema_missing), answers=answers, kept=kept
    )


def _lacking_schema(row: pool.Record | None, *, answers: bool, kept: bool) -> str:
    """What a row of ``queries.schema_missing`` says the table lacks ("" when nothing)."""
    if row is None or not row["table"]:
        return "does not exist"
    needed = ["digest", *(["answer"] if answers else []), "index",
              *(["inbox", "inbox_size", "inbox_index"] if kept else [])]  # fmt: skip
    lacking = [name for name in needed if not row[name]]
    if "inbox" in lacking:  # a table from before the inbox: inbox_size is one of its columns
        lacking.remove("inbox_size")
    names = {
        "digest": "column body_sha256",
        "answer": "the answer columns (on_duplicate: replay)",
        "inbox": "the inbox columns (redeliver)",
        "inbox_size": "column inbox_size (redeliver's cap)",
        "inbox_index": "the inbox's index (redeliver)",
        "index": "index on received_at",
    }
    return "lacks " + " and ".join(names[n] for n in lacking) if lacking else ""


async def apply_schema(
    connection: Connection, queries: sql.Queries, what: str = "the schema change failed"
) -> None:
    """Create or upgrade the claim table; safe when several replicas start at once. Gives up
    (StoreUnavailable) rather than wait more than DDL_LOCK_WAIT for the table's lock; other
    errors raise StoreUnavailable("<what>: <the error>")."""
    try:
        with translated(what):
            async with connection.transaction():
                await connection.execute(queries.schema_lock)
                await connection.execute(sql.lock_timeout(DDL_LOCK_WAIT))
                for step in queries.schema_steps:
                    await connection.execute(step)
    except errors.LockTimeout:
        raise errors.StoreUnavailable(
            f"table {queries.table}: the schema change could not lock the table within "
            f"{DDL_LOCK_WAIT:g}s (claims in flight hold it); run 'dedup-proxy migrate' at a "
            "quieter moment"
        ) from None


def _unusable(row: pool.Record | None) -> str:
    """The GRANT a row of ``queries.schema_usage`` says the role lacks on the claim table's
    schema ("" if none)."""
    if row is None or row["usage"]:
        return ""
    schema, role = row["schema"], row["role"]
    return (
        f"role {role} lacks USAGE on schema {schema}, without which it can reach no table "
        f"there: GRANT USAGE ON SCHEMA {schema} TO {role}"
    )


def _lacking(
    row: pool.Record,
    queries: sql.Queries,
    *,
    answers: bool,
    kept: bool = False,
    needed: Sequence[str] = tuple(PRIVILEGES),
) -> str:
    """The GRANTs a row of ``queries.privileges`` says the role lacks, and why ("" if none):
    of ``needed`` on the table, UPDATE of the answer columns with ``answers``, of the inbox's
    with ``kept``."""
    role, table = row["role"], queries.quoted
    lacking = [name for name in needed if not row[name.lower()]]
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
    if kept and row["inbox"] is False:
        grants.append(
            f"{inbox.GRANT_HINT} ON {table} TO {role} (redeliver keeps failed deliveries and "
            "locks them while redelivering: FOR UPDATE needs it; order locks an object's row "
            "by INSERT ... ON CONFLICT DO UPDATE and records its accepted version)"
        )
    if kept and row["kept_counts"] is False:
        grants.append(
            f"GRANT SELECT ON {queries.quoted[:-1]}{sql.KEPT_COUNTS}\" TO {role} (redeliver's cap "
            "reads the kept rows' counts there instead of counting the rows at each keep)"
        )
    return f"role {role} lacks privileges: " + "; ".join(grants) if grants else ""


class Store:
    """A pool of connections, each set up so that a stuck claim cannot outlive its bounds."""

    def __init__(
        self,
        connections: Pool,
        settings: config.DatabaseConfig,
        *,
        claim_wait: float,
        upstream_timeout: float,
        connect: Callable[[], Awaitable[Connection]],
    ) -> None:
        self._pool = connections
        self._connect = connect
        self.dsn = ""  # the DSN it was opened with (``open``: an operator's command's store)
        self.table = settings.table
        self._settings = settings
        self.queries = sql.for_table(settings.table)
        self.op_timeout = settings.connect_timeout
        self.pool_size = settings.pool_size
        self._claim_timeout = claim_wait + settings.connect_timeout
        # A copy waits on an in-flight claim at most claim_wait; and the claim stays open while
        # the upstream works, so past the upstream's timeout the server itself rolls back a
        # claim whose proxy vanished without closing its socket.
        self._claim_wait = claim_wait
        self._idle_limit = upstream_timeout + settings.connect_timeout
        self._begin = sql.begin(claim_wait, self._idle_limit)
        # Whether the claim table is distributed (Citus): see ``notice_distribution``.
        self.distributed = False
        self._answers = False  # whether the routes need UPDATE (check_privileges)
        self._kept = False  # whether a route redelivers (check_privileges)
        # Whether the table has the inbox's columns: then the sweep passes over what it keeps.
        self._inbox_columns = False
        # Per route scope whose claims are bound: until when (time.time()) a claim is also
        # made in the legacy form, the upgrade window (``notice_id_forms``).
        self.windows: dict[str, float] = {}
        # The receipts' key, once read (``receipt_keys``).
        self._receipt_keys: receipts.Keys | None = None
        # Set once start succeeded: the pool filled, the table and the grants checked.
        self.started = asyncio.Event()
        self.start_problem = "connecting to PostgreSQL"
        self.replication: Replication | None = None  # read by every check
        # The grants of DEGRADED the role lacks, as of the last check.
        self.degraded: tuple[str, ...] = ()
        # A redelivery's transaction has a claim's bounds.
        self.inbox = inbox.Inbox(self.queries.quoted, self._connection, self._begin,
                                 settings.connect_timeout)  # fmt: skip
        # The places at the app held by every replica together (``start``'s ``shared``).
        self.slots: slots.Slots | None = None
        # The route holds (``events pause``, the app's Retry-After), in rows of scope sql.HOLDS.
        self.holds = holds.RouteHolds(self.queries.quoted, self._connection,
                                      settings.connect_timeout)  # fmt: skip

    @classmethod
    async def open(
        cls,
        dsn: str,
        settings: config.DatabaseConfig,
        *,
        claim_wait: float,
        upstream_timeout: float,
        operator: bool = False,
        unreachable: str = "cannot connect to PostgreSQL",
    ) -> Store:
        """Connect the pool (``pool_size`` connections); raise
        StoreUnavailable("<unreachable>: <why>") if PostgreSQL cannot be reached. With
        ``operator``, the store of an operator's command: one connection, named
        ``dedup-proxy-cli``, whose statements may take as long as they need (a migrate's
        CREATE INDEX, a count over a large table).

        Nothing changes a session after connecting, so a connection needs no reset between
        requests (see ``pool``), and any server connection PgBouncer hands over will do.
        """
        store = cls.create(
            dsn, settings, claim_wait=claim_wait, upstream_timeout=upstream_timeout,
            operator=operator,
        )  # fmt: skip
        store.dsn = dsn
        with translated(unreachable, connecting=settings.connect_timeout):
            await store._pool.fill()
        await store.notice_distribution()
        store.started.set()
        return store

    @classmethod
    def create(
        cls,
        dsn: str,
        settings: config.DatabaseConfig,
        *,
        claim_wait: float,
        upstream_timeout: float,
        operator: bool = False,
    ) -> Store:
        """The store, not connected yet: ``start`` connects it (see ``open``)."""
        name = "dedup-proxy-cli" if operator else pool.APPLICATION_NAME
        connect = pool.Connector(dsn, settings, name)
        bound = None if operator else claim_wait + settings.connect_timeout
        connections = Pool(
            functools.partial(connect, command_timeout=bound), 1 if operator else settings.pool_size
        )
        return cls(
            connections, settings, claim_wait=claim_wait, upstream_timeout=upstream_timeout,
            connect=connect,
        )  # fmt: skip

    async def start(
        self,
        *,
        answers: bool,
        kept: bool,
        bound: Mapping[str, float] | None = None,
        unbound: Collection[str] = (),
        receipted: bool = False,
        shared: int | None = None,
    ) -> None:
        """Fill the pool, check the claim table (creating or upgrading it if allowed) and the
        role's grants, read the upgrade windows of the ``bound`` route scopes (to their
        retention) and record the ``unbound`` ones' (``notice_id_forms``), the receipts' key if
        a route is ``receipted`` (``receipt_keys``), make the rows of the ``shared`` places at
        the app (``database.slots``) and what readiness reports; then ``started`` is set.

        Raises NotPrepared when the database answers but the table or the grants are not what
        the routes need (retrying does not fix that), StoreUnavailable when it does not answer
        (retrying may)."""
        try:
            with translated("cannot connect to PostgreSQL", connecting=self.op_timeout):
                await self._pool.fill()
            try:
                await self.ensure_schema(answers=answers, kept=kept)
                await self.check_privileges(answers=answers, kept=kept)
                await self.notice_distribution()
                await self.notice_id_forms(bound or {}, unbound)
                if receipted:
                    await self._first_receipt_keys()
                if shared is not None:
                    await self._make_slots(shared)
            except errors.StoreUnavailable as exc:
                if pool.refused_for_good(exc.__cause__):
                    # The server answered, and refused (a privilege, a schema): not an outage.
                    raise errors.NotPrepared(exc.message) from exc.__cause__
                raise
        except errors.StoreUnavailable as exc:
            self.start_problem = exc.message
            raise
        self.started.set()
        with contextlib.suppress(errors.StoreUnavailable):
            await self.check()  # readiness's facts, now: a read-only server does not stop it

    async def close(self) -> None:
        await self._pool.close(self.op_timeout)

    async def _make_slots(self, limit: int) -> None:
        """The rows of ``limit`` places at the app shared by every replica (those missing).
        NotPrepared on a table Citus distributes (``slots.NOT_ON_CITUS``)."""
        if self.distributed:
            raise errors.NotPrepared(slots.NOT_ON_CITUS)
        places = slots.Slots(self.queries.quoted, limit, self.op_timeout)
        async with self._connection() as connection:
            with translated("cannot make the places at the app"):
                await places.make(connection)
        self.slots = places

    async def places_held(self) -> int | None:
        """How many shared places at the app are held now, by every replica (None: the limit
        is not shared)."""
        if self.slots is None:
            return None
        return await self.slots.held(self._connection)

    def place_keeper(self) -> contextlib.AbstractAsyncContextManager[bool] | None:
        """A place at the app held in a transaction of its own on a connection free now (a
        hand-off's, while its claim commits: ``slots.Slots.kept``); None when the limit is not
        shared or no connection is free at once (the hand-off does not happen)."""
        if self.slots is None or not self._pool.ready(time.monotonic()):
            return None
        return self._kept_place(self.slots)

    @contextlib.asynccontextmanager
    async def _kept_place(self, places: slots.Slots) -> AsyncIterator[bool]:
        async with self._connection() as connection, places.kept(connection, self._begin) as held:
            yield held

    # Serving

    def claim(self, key: Key, wait: float | None = None) -> Claiming:
        """Claim (scope, event_id), as ``async with store.claim(key) as claim``; waits while
        another transaction holds it uncommitted, at most ``wait`` seconds (a route's own
        claim_wait; default the store's).

        Raises StoreUnavailable (no connection or the database failed; ``Starting`` before
        ``start`` succeeded, so that no claim is made on a table or with grants not checked
        yet) or ClaimWaitExceeded. On exit the transaction is rolled back unless a step of the
        claim ended it.
        """
        return Claiming(self, key, wait)

    def legacy_form(self, key: Key) -> str | None:
        """The legacy form of ``key``'s ID to claim with it, inside its route's upgrade window
        (else None): a claim in either form is then a duplicate of the other."""
        if key.legacy_id is None or not self.windows:
            return None
        until = self.windows.get(key.scope.partition("/")[0])
        return key.legacy_id if until is not None and time.time() < until else None

    async def notice_id_forms(
        self, bound: Mapping[str, float], unbound: Collection[str] = ()
    ) -> None:
        """Read since when each of the ``bound`` route scopes (to their retention) stores its
        claims bound to what is signed, recording it first if none did: now, when the scope
        holds claims in the other form (an upgrade from 0.1.0, a route given ``verify``, or
        given it back with claims made without it meanwhile), else never (a new route). For
        one retention from then, the upgrade window, its claims are also made in the legacy
        form (``legacy_form``), so that the claims an earlier release made or still makes, in
        that form, and these are duplicates of each other. An ``unbound`` scope (a route
        whose ``verify`` was removed) records since when it is not, so that giving ``verify``
        back opens a window again."""
        windows = {}
        async with self._connection() as connection:
            with translated("reading since when claims are bound failed"):
                for scope, retention in bound.items():
                    since = await self._bound_since(connection, scope)
                    if since is not None and time.time() < since + retention:
                        windows[scope] = since + retention
                for scope in unbound:
                    await self._unbound(connection, scope)
        for scope, until in windows.items():
            log.info(
                "scope %s: claims are also made in the legacy form (0.1.0's, the event ID "
                "alone) until %s, one retention after the bound form's first claim, so that "
                "either form is a duplicate of the other (docs/deployment.md, 'Upgrades')",
                scope, datetime.fromtimestamp(until, UTC).isoformat(timespec="seconds"),
            )  # fmt: skip
        self.windows = windows

    async def _bound_since(self, connection: Connection, scope: str) -> float | None:
        """Since when ``scope``'s claims are bound (time.time()), recorded by the first
        replica to start with the route bound, or bound again; None: since its first claim."""
        queries = self.queries
        row = await connection.fetchrow(queries.id_form_since, scope)
        if row is not None and row["form"] == sql.FORM_BOUND:
            return float(row["since"]) if row["since"] is not None else None
        # The route's first start bound, or its first since starts without verify: the claims
        # in the other form, all of them or those made since then, read once.
        claims = await connection.fetchval(queries.id_form_claims, scope)
        try:
            with translated("recording since when claims are bound failed"):
                if row is not None:
                    await connection.execute(queries.id_form_forget, scope, sql.FORM_UNBOUND)
                await connection.execute(queries.id_form, scope, claims)
        except errors.ReadOnly:
            # A standby (a failover): the primary's first replica records it; this one counts
            # from now if the route holds claims.
            return time.time() if claims else None
        row = await connection.fetchrow(queries.id_form_since, scope)
        return None if row is None or row["since"] is None else float(row["since"])

    async def receipt_keys(self) -> receipts.Keys:
        """The receipts' keys (``database.receipts``), under the secret in the claim table's
        row of scope ``sql.RECEIPT_KEY``: made with a new random secret by the first replica
        that finds none, so that every replica and worker of the deployment reads the same. Read
        once (at start, with a route with receipt), then kept."""
        if self._receipt_keys is not None:
            return self._receipt_keys
        queries = self.queries
        async with self._connection() as connection:
            with translated("reading the receipts' key failed"):
                secret = await connection.fetchval(queries.receipt_key)
                if secret is None:
                    made = secrets.token_bytes(receipts.SECRET_BYTES)
                    await connection.execute(queries.receipt_key_make, made)
                    secret = await connection.fetchval(queries.receipt_key)
        if secret is None:  # pragma: no cover - removed between its INSERT and the read
            raise errors.StoreUnavailable("the receipts' key was removed as it was made")
        self._receipt_keys = receipts.Keys(bytes(secret))
        return self._receipt_keys

    async def _first_receipt_keys(self) -> None:
        """``receipt_keys`` at start. A standby cannot make it: then the first delivery that
        needs it does, once a primary answers."""
        try:
            await self.receipt_keys()
        except errors.ReadOnly as exc:
            log.warning("the receipts' key is not made yet: %s", exc.message)

    async def _unbound(self, connection: Connection, scope: str) -> None:
        """Record that ``scope``'s claims are not bound since now, if they were (a route whose
        ``verify`` was removed): its row of the bound form replaced."""
        queries = self.queries
        try:
            with translated("recording since when claims are not bound failed"):
                forgot = await connection.execute(queries.id_form_forget, scope, sql.FORM_BOUND)
                if forgot == "DELETE 1":
                    await connection.execute(queries.id_form_unbound, scope)
        except errors.ReadOnly:
            pass  # a standby: the primary's first replica records it

    async def resolve(
        self, scope: str, event_ids: Sequence[str], *, last_part: bool = False
    ) -> dict[str, Resolved]:
        """What each of these IDs (as an operator gave them: the provider's, or as stored)
        names in ``scope``: the stored row itself, else its one row bound to a body, else
        the candidates when several are. With ``last_part`` (a route whose ID is composite),
        an ID found neither way is also looked for as the last part of the stored IDs: a
        GitHub delivery's GUID without its hook ID."""
        found = {}
        async with self._connection() as connection:
            with _plainly_missing(), translated("query failed"):
                for event_id in dict.fromkeys(event_ids):
                    rows = await connection.fetch(self.queries.resolve, scope, event_id)
                    found[event_id] = _resolved(event_id, [row["event_id"] for row in rows])
                    if found[event_id] != Resolved("") or not last_part or ":" in event_id:
                        continue
                    part = event_id.replace("%", "%25")  # as ``event_ids.join`` escapes it
                    rows = await connection.fetch(self.queries.resolve_last_part, scope, part)
                    found[event_id] = _resolved_by_last_part(
                        part, [row["event_id"] for row in rows]
                    )
        return found

    async def confirm_commit(self, key: Key) -> bool:
        """After a COMMIT in doubt: is the claim stored now? Re-claims it if it is absent.

        On a fresh connection outside the pool (the pooled ones may sit behind the same broken
        link), the claim again, committed at once: a conflict means the row is there (our COMMIT
        went through, or the event was processed elsewhere); an insert means our COMMIT was lost
        and the claim is now stored. Anything else (the database still unreachable, our old
        transaction still holding the row past claim_wait) leaves it unknown: False.
        """
        statement = self.queries.claim(
            self._begin, key.scope, key.event_id, key.event_type, key.body_sha256, commit=True,
            also=self.legacy_form(key),
        )  # fmt: skip
        try:
            with translated("reconciling"):
                connection = await self._connect()
                try:
                    await connection.execute(statement, timeout=self._claim_timeout)
                finally:
                    connection.terminate()
        except errors.StoreUnavailable as exc:
            log.warning("reconciling a COMMIT in doubt failed: %r", exc.__cause__)
            return False
        return True

    async def ensure_schema(self, *, answers: bool = True, kept: bool = False) -> None:
        """Check the claim table; create or upgrade it only if something is missing.

        The check reads the catalog only. The DDL is never run needlessly: even with IF NOT
        EXISTS, CREATE INDEX and ALTER TABLE take table locks that queue behind every claim in
        flight and block every new one, so a replica restarting under traffic would stall all.
        """
        table = self._settings.table
        if unusable := await self.missing_usage():
            raise errors.NotPrepared(f"table {table}: {unusable}")
        async with self._connection() as connection:
            with translated(f"cannot prepare table {table}"):
                row = await connection.fetchrow(self.queries.schema_missing)
                missing = _lacking_schema(row, answers=answers, kept=kept)
                self._inbox_columns = bool(row and row["inbox"])
                if missing and self._settings.create_schema:
                    await apply_schema(connection, self.queries, f"cannot prepare table {table}")
                    self._inbox_columns = True  # the whole DDL, the inbox's columns included
                    missing = ""
                    # What the DDL made of the kept rows' counts (nothing on Citus).
                    row = await connection.fetchrow(self.queries.schema_missing)
                self.inbox.counts = bool(row and row["kept_counts"])
        if missing:
            raise errors.NotPrepared(
                f"table {table}: {missing}, and database.create_schema is false; run "
                "'dedup-proxy migrate' (or apply 'dedup-proxy schema') or set create_schema: true"
            )

    async def check_privileges(self, *, answers: bool, kept: bool = False) -> None:
        """Raise StoreUnavailable naming each grant the routes need that the role lacks
        (UPDATE on the answer columns with ``answers``, on the inbox's with ``kept``);
        ``check`` verifies them from then on."""
        self._answers = answers
        self._kept = kept
        problem = await self.missing_grants(answers=answers, kept=kept)
        if problem:
            raise errors.NotPrepared(f"table {self._settings.table}: {problem}")

    async def check(self) -> None:
        """Raise StoreUnavailable unless a claim can commit: the database answers and takes
        writes (``ReadOnly``: a standby, or read-only), the claim table exists and the role
        still holds what a claim needs (CLAIM_PATH); one statement, which also reads whether
        COMMITs wait for a standby (``replication``) and which other grants ``check_privileges``
        verified the role lacks now (``degraded``). ``Starting`` until ``start`` has
        succeeded."""
        if not self.started.is_set():
            raise errors.Starting(f"starting: {self.start_problem}")
        async with self._connection() as connection:
            with translated("database check failed"):
                row = await connection.fetchrow(self.queries.privileges, timeout=self.op_timeout)
            if row is not None and (read_only := _writable(row)):
                # Raised inside the block, so the connection is closed, not lent again: a new
                # one (a multi-host DSN's target_session_attrs) may find the server that
                # takes writes.
                raise errors.ReadOnly(read_only)
        if row is not None:
            self.replication = Replication(row["synchronous_commit"], row["standby_names"])
        if row is None or not row["table"]:
            raise errors.StoreUnavailable(f"table {self._settings.table} does not exist")
        if problem := _lacking(row, self.queries, answers=False, needed=CLAIM_PATH):
            raise errors.StoreUnavailable(f"table {self._settings.table}: {problem}")
        self._notice_degraded(row)

    def _notice_degraded(self, row: pool.Record) -> None:
        """Read which grants besides the claim's the role lacks now (``degraded``), and log a
        change: a warning naming the GRANTs when one went missing, info when all are back."""
        missing = (
            not row["delete"],
            self._answers and row["answer"] is False,
            self._kept and row["inbox"] is False,
        )
        degraded = tuple(name for name, lacks in zip(DEGRADED, missing, strict=True) if lacks)
        if degraded == self.degraded:
            return
        self.degraded = degraded
        table = self._settings.table
        if degraded:
            problem = _lacking(row, self.queries, answers=self._answers, kept=self._kept,
                               needed=("DELETE",))  # fmt: skip
            log.warning(
                "table %s: %s; claims go on, and only what needs it fails until it is granted "
                "(dedup_database_grant_missing)", table, problem,
            )  # fmt: skip
        else:
            log.info("table %s: the role holds every grant the routes need again", table)

    async def facts(self) -> tuple[str, Replication]:
        """(why a claim cannot commit here, "" if it can; whether COMMITs wait for a standby),
        for ``check --database``."""
        async with self._connection() as connection:
            with translated("query failed"):
                row = await connection.fetchrow(self.queries.privileges, timeout=self.op_timeout)
        assert row is not None  # a SELECT without FROM: one row
        return _writable(row), Replication(row["synchronous_commit"], row["standby_names"])

    async def notice_inbox_columns(self) -> None:
        """Read again whether the table has the inbox's columns and the kept rows' counts,
        until it has: a migrate run after this replica started adds them (one catalog read per
        sweep round until then; on Citus, which has no counts, every round)."""
        if self._inbox_columns and self.inbox.counts:
            return
        async with self._connection() as connection:
            with translated("reading the claim table's columns failed"):
                row = await connection.fetchrow(self.queries.schema_missing)
        self._inbox_columns = bool(row and row["inbox"])
        self.inbox.counts = bool(row and row["kept_counts"])

    async def fold_kept_counts(self, batch: int) -> int | None:
        """Fold the kept rows' counts of at most ``batch`` backends gone into one row per scope
        (``sql._kept_counts``), in a short transaction under the sweeper's lock: how many
        were; None when another replica holds the lock, or the table has no counts."""
        if not self.inbox.counted:
            return None
        async with self._connection() as connection:
            with translated("folding the kept rows' counts failed"):
                async with connection.transaction():
                    locked = await connection.fetchval(
                        self.queries.sweep_lock, timeout=self.op_timeout
                    )
                    if not locked:
                        return None
                    folded = await connection.fetchval(
                        self.queries.kept_fold, batch, timeout=self.op_timeout
                    )
        return int(folded)

    async def sweep_batch(self, scope: str, retention: float, batch: int) -> int | None:
        """Delete one batch of ``scope``'s claims older than ``retention`` seconds, in a short
        transaction of its own; None when another replica holds the sweeper's lock."""
        async with self._connection() as connection:
            with translated("retention delete failed"):
                async with connection.transaction():
                    locked = await connection.fetchval(
                        self.queries.sweep_lock, timeout=self.op_timeout
                    )
                    if not locked:
                        return None
                    await connection.execute(sql.lock_timeout(SWEEP_ROW_LOCK_WAIT))
                    queries = self.queries
                    sweep = queries.sweep_not_kept if self._inbox_columns else queries.sweep
                    status = await connection.execute(
                        sweep, scope, retention, batch, timeout=self.op_timeout
                    )
        return int(status.split()[-1])

    async def reconcile_turn(self, route: str, every: float) -> bool | None:
        """Whether this replica runs ``route``'s reconcile now: no replica has for ``every``
        seconds, and none is deciding at this moment (the reconciler's advisory lock, held for
        one short transaction). None when another replica holds the lock."""
        queries = self.queries
        async with self._connection() as connection:
            with translated("taking the reconciler's turn failed"):
                async with connection.transaction():
                    locked = await connection.fetchval(
                        queries.reconcile_lock, timeout=self.op_timeout
                    )
                    if not locked:
                        return None
                    await connection.execute(queries.reconcile_expire, route, float(every))
                    status = await connection.execute(queries.reconcile_take, route)
        return bool(status == "INSERT 0 1")

    def pool_exhausted(self) -> bool:
        """Whether every connection of the pool is lent out (the redeliverer then yields to
        the requests)."""
        return self._pool.exhausted()

    def pool_stats(self) -> pool.Counts:
        """The pool's levels and counts."""
        return self._pool.counts()

    # Operating

    async def events(
        self, scope: str, after: datetime | None, limit: int
    ) -> tuple[list[Event], int]:
        """The newest ``limit`` claims of ``scope`` (received at or after ``after``), and how
        many there are in all."""
        async with self._connection() as connection:
            with _plainly_missing(), translated("query failed"):
                rows = await connection.fetch(self.queries.events, scope, after, limit)
                total = len(rows)
                if total == limit:
                    total = await connection.fetchval(self.queries.events_count, scope, after)
        return [Event(*row) for row in rows], total

    async def forget(self, scope: str, event_ids: Sequence[str], lock_wait: float) -> set[str]:
        """Delete these claims of ``scope``; the IDs that were there. Waits at most
        ``lock_wait`` for a row another transaction holds."""
        async with self._connection() as connection:
            try:
                with translated("forget failed"):
                    async with connection.transaction():
                        # A forget must not queue for long behind a transaction holding a row.
                        await connection.execute(
                            sql.wait_bound(lock_wait, distributed=self.distributed)
                        )
                        rows = await connection.fetch(self.queries.forget, scope, list(event_ids))
            except errors.waited(self.distributed) as exc:
                raise errors.StoreUnavailable(
                    "one of these claims is locked by another transaction (the retention "
                    "sweeper or another forget); try again in a moment"
                ) from exc
        return {row["event_id"] for row in rows}

    async def stats(self) -> list[ScopeStats]:
        """Per scope: how many claims, the oldest and the newest, how many pending and dead."""
        async with self._connection() as connection:
            with _plainly_missing(), translated("query failed"):
                rows = await connection.fetch(self.queries.stats)
        return [ScopeStats(*row) for row in rows]

    async def migrate(self) -> None:
        """Create or upgrade the claim table (``dedup-proxy migrate``)."""
        async with self._connection() as connection:
            await apply_schema(connection, self.queries, "migrate failed")

    async def notice_distribution(self) -> None:
        """Read whether the claim table is distributed (Citus; read once, at start: distribute
        the table before the proxies start). Then the rows a claim or an operator's command
        waits on are on the workers, which the coordinator's ``lock_timeout`` does not reach,
        so those waits are also bounded by ``statement_timeout`` (``sql.wait_bound``). On one
        PostgreSQL, and for a plain table on a Citus coordinator, nothing changes."""
        distribution = await self.distribution()
        distributed = distribution is not None and distribution.distributed
        if distribution is not None and distributed and not self.distributed:
            log.info(
                "table %s is distributed by Citus (by %s): claim waits are bounded by "
                "statement_timeout too", self._settings.table, distribution.column or "none",
            )  # fmt: skip
            if not distribution.conforming:
                log.warning(
                    "standard_conforming_strings is off for this role: on Citus, reads outside "
                    "a claim's transaction (a duplicate's check, a replayed answer, the "
                    "operators' lists) miss event IDs with a backslash; set it on for the role"
                )
        self.set_distributed(distributed)

    def set_distributed(self, distributed: bool) -> None:
        """Bound the waits as on a distributed table, or not (``notice_distribution``; the
        tests run Citus's bounds on one PostgreSQL with it)."""
        self.distributed = distributed
        self._begin = sql.begin(self._claim_wait, self._idle_limit, distributed=distributed)
        self.inbox.set_distributed(distributed, self._begin)

    async def distribution(self) -> Distribution | None:
        """How Citus distributes the claim table (None: no Citus here), for ``check
        --database``."""
        async with self._connection() as connection:
            with translated("reading Citus's catalog failed"):
                citus = await connection.fetchrow(self.queries.citus)
                if citus is None or not citus["citus"]:
                    return None
                row = await connection.fetchrow(self.queries.distribution)
        conforming = bool(citus["conforming"])
        if row is None:
            return Distribution(None, 0, conforming)
        return Distribution(row["column"], row["shards"], conforming)

    async def whoami(self) -> tuple[str, str]:
        """(the role the server sees, the server's version)."""
        async with self._connection() as connection:
            with translated("query failed"):
                user = await connection.fetchval("SELECT current_user")
            return user, pool.server_version(connection)

    async def missing_usage(self) -> str:
        """The USAGE on the claim table's schema the role lacks, as the GRANT that gives it
        ("" when it has it, or there is no such schema)."""
        async with self._connection() as connection:
            with translated("reading the role's privileges failed"):
                return _unusable(await connection.fetchrow(self.queries.schema_usage))

    async def missing_schema(self, *, answers: bool, kept: bool = False) -> str:
        """What the claim table lacks ("" when nothing), see ``missing_schema``."""
        async with self._connection() as connection:
            with translated("query failed"):
                return await missing_schema(connection, self.queries, answers=answers, kept=kept)

    async def may_create_table(self) -> bool:
        """Whether the role may CREATE in the claim table's schema."""
        schema = self._settings.table.rpartition(".")[0] or None
        async with self._connection() as connection:
            with translated("query failed"):
                may = await connection.fetchval(
                    "SELECT has_schema_privilege(coalesce($1, current_schema()), 'CREATE')",
                    schema,
                )
        return bool(may)

    async def missing_grants(self, *, answers: bool, kept: bool = False) -> str:
        """The privileges on the claim table the role lacks, as the GRANTs that give them and
        why ("" when none, or when the table is missing: ``missing_schema`` says so); UPDATE on
        the answer columns only with ``answers``."""
        async with self._connection() as connection:
            with translated("reading the role's privileges failed"):
                row = await connection.fetchrow(self.queries.privileges, timeout=self.op_timeout)
        if row is None or not row["table"]:
            return ""
        return _lacking(row, self.queries, answers=answers, kept=kept)

    async def pooler(self) -> bool:
        """Whether a pooler (PgBouncer) stands between the proxy and the server: it answers
        the startup with a process ID of its own. A transaction of two statements is tried on
        the way (statement pooling refuses it: StoreUnavailable)."""
        async with self._connection() as connection:
            with translated("a transaction of two statements failed"):
                async with connection.transaction():
                    backend = await connection.fetchval("SELECT pg_backend_pid()")
                    await connection.fetchval("SELECT 1")
            return bool(backend != connection.get_server_pid())

    # The pool

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Connection]:
        """A pooled connection for work besides claims; one that fails or is cancelled
        mid-statement is closed, never lent again."""
        connection = await self._acquire()
        try:
            yield connection
        except BaseException:
            pool.discard(connection)
            raise
        finally:
            self._pool.release(connection)

    async def _acquire(self) -> Connection:
        now = time.monotonic()
        if self._pool.ready(now):
            # The common case, without arming a timer: a free connection, lent at once.
            return await self._pool.acquire(now)
        try:
            # pool_timeout bounds the wait for a free slot only: a connect has its own bounds
            # (connect_timeout, per host), and cutting it short would keep a multi-host DSN
            # from ever reaching the host after one that drops packets. asyncio.timeout, not
            # wait_for: on Python 3.11 that makes a task per call.
            async with asyncio.timeout(self._settings.pool_timeout):
                await self._pool.slot()
        except TimeoutError as exc:
            raise errors.PoolExhausted(
                f"no free database connection within {self._settings.pool_timeout:g}s "
                f"(pool_size {self._settings.pool_size})"
            ) from exc
        with translated("cannot connect to PostgreSQL", connecting=self.op_timeout):
            connection: Connection = await self._pool.take()
        return connection


class Claiming:
    """``Store.claim``'s context: the connection taken and the claim sent on entry, the claim
    released and the connection given back on exit, however the block ends. A class rather
    than a generator-based context manager: it is on every webhook's path (bench/RESULTS.md)."""

    __slots__ = ("_claim", "_connection", "_key", "_store", "_wait")

    def __init__(self, store: Store, key: Key, wait: float | None) -> None:
        self._store = store
        self._key = key
        self._wait = wait
        self._claim: Claim | None = None
        self._connection: Connection | None = None

    async def __aenter__(self) -> Claim:
        store, key, wait = self._store, self._key, self._wait
        if not store.started.is_set():
            raise errors.Starting(f"starting: {store.start_problem}")
        connection = self._connection = await store._acquire()
        begin, timeout = store._begin, store._claim_timeout
        if wait is not None and wait != store._claim_wait:
            begin = sql.begin(wait, store._idle_limit, distributed=store.distributed)
            timeout = wait + store.op_timeout
        legacy = store.legacy_form(key)
        claim = self._claim = Claim(store, connection, key, acquired=False, legacy=legacy)
        try:
            try:
                with translated("claim failed", claim.abandon):
                    status = await connection.execute(
                        store.queries.claim(
                            begin, key.scope, key.event_id, key.event_type, key.body_sha256,
                            also=legacy,
                        ),
                        timeout=timeout,
                    )  # fmt: skip
            except errors.waited(store.distributed) as exc:
                raise errors.ClaimWaitExceeded() from exc.__cause__
        except BaseException:
            await self._release()
            raise
        claim.acquired = status.rpartition(" ")[2] == ("1" if legacy is None else "2")
        return claim

    async def __aexit__(self, *exc_info: object) -> None:
        await self._release()

    async def _release(self) -> None:
        claim, connection = self._claim, self._connection
        if claim is None or connection is None:
            return
        self._claim = self._connection = None
        try:
            await claim.release()
        except BaseException:
            # Cancelled mid-ROLLBACK (a shutdown past its timeout): the session's state is
            # unknown, and asyncpg's in-transaction flag may be stale.
            pool.discard(connection)
            raise
        finally:
            self._store._pool.release(connection)
