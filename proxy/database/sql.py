"""Every SQL statement the proxy sends, built once per configured claim table.

``for_table`` quotes the table name once and returns the statements as a frozen ``Queries``:
the DDL and its catalog check, the sweep, the operator commands. The claim itself cannot be
built ahead: it names the event, and goes as one simple-protocol query (several statements in
one round trip take no parameters), so ``Queries.claim`` and ``Queries.duplicate`` inline their
values as literals that read the same whatever the session's settings, which PgBouncer in
transaction mode may hand over from another client.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

# Any constants will do: they only serialise schema creation, and sweeps, across replicas.
SCHEMA_LOCK_KEY = 0x64656475
SWEEP_LOCK_KEY = 0x64656476
RECONCILE_LOCK_KEY = 0x64656477
# With a hash of a cap's scope and a signed part (two int4 keys: a space apart from the above),
# serialises the keeps of one signed body (``inbox_sql.Statements.keep_signed``).
KEEP_SIGNED_LOCK_KEY = 0x64656478

# The columns on_duplicate: replay writes: the one UPDATE the proxy makes.
ANSWER_COLUMNS = ("answer_status", "answer_headers", "answer_body")
_ANSWER_SAVEPOINT = "answer"
# A statement bound (``begin(bound=True)``, ``wait_bound``) lifted: the server's own setting
# again (the role's, the database's) for the rest of the transaction, so that a claim's UPDATE
# after its INSERT is not cut short. (A COMMIT never is: PostgreSQL ends the statement's timer
# before it commits, so a synchronous standby's wait, or Citus's two-phase commit, is not.)
UNBOUND = "SET LOCAL statement_timeout TO DEFAULT; "
# After the savepoint of ``Queries.commit_answer``, which lifted the bound before it.
COMMIT_WITHOUT_ANSWER = f"ROLLBACK TO SAVEPOINT {_ANSWER_SAVEPOINT}; COMMIT"

# The scope of the rows that record since when a route's claims are bound (``Store.start``):
# no route's scope (names are letters, digits, '_', '.', '-'), so never swept nor listed.
ID_FORMS = "~id-forms"
# What a row of ID_FORMS records (its event_type): since when (received_at) the scope's claims
# are bound, or, once a start without ``verify`` followed, since when they are not.
FORM_BOUND = "bound"
FORM_UNBOUND = "unbound"
# The scope of the rows that hold a route scope's redeliveries (``database.holds``): one row per
# route scope held or once held, likewise never a route's, so never swept, listed or counted.
HOLDS = "~holds"
# The scope of the rows that record each reconciling route's last run (``Store.reconcile_turn``),
# keyed by route name: likewise never a route's.
RECONCILE_RUNS = "~reconcile"
# The scope of the one row that holds the receipts' key (``database.receipts``): the secret in
# body_sha256, made by the first replica to start with a route with receipt; likewise never a
# route's, and its digest column is shown nowhere.
RECEIPT_KEY = "~receipt-key"
# The scope of an ordered route's object rows (``Claim.hold_object``): ORDER, "/" and the claim's
# scope, keyed by the object's key; never a route's, so never swept by a route's sweep nor listed.
# inbox_changed: since when the object is held (or was last); inbox_request: {"v": the newest
# version the app accepted}. Locked by an INSERT ... ON CONFLICT DO UPDATE in the claim's
# transaction: held while the app works, freed with the transaction.
ORDER = "~order"
# The scope of the places at the app held by every replica together (``database.slots``): SLOTS,
# "/" and whose ("app"), keyed 0 to N-1 in ``slots.WIDTH`` digits; never a route's. Locked FOR
# UPDATE SKIP LOCKED in the transaction of a delivery at the app, after its claim row and its
# object's row.
SLOTS = "~slots"
ORDER_SAVEPOINT = "ordered"
# What ``Queries.hold_object``'s status says: the event is older than the version accepted; an
# older delivery of the object is kept (pending).
OBJECT_STALE = 1
OBJECT_BEHIND = 2
# A claim bound to what is signed (``webhooks.bound``): the event ID, '~' and this many
# lower-case hex digits of a digest of the query and body.
BOUND_DIGITS = 32
# A composite ID's last part (``event_ids.join``: its parts hold no ':'), for a row whose ID is
# composite (or holds a ':' as sent): GitHub's delivery GUID in ``<hook ID>:<GUID>[~digest]``.
COMPOSITE = "position(':' in event_id) > 0"
LAST_PART = "substring(event_id FROM '[^:]*$')"
# A route's scope ($1) and, for a templated path, its per-path scopes ("scope/acme").
IN_SCOPE = "(scope = $1 OR left(scope, length($1) + 1) = $1 || '/')"
# redeliver: the columns that keep a failed delivery in its claim's row (database.inbox).
INBOX_TYPES = {"inbox_state": "text", "inbox_request": "jsonb", "inbox_body": "bytea",
               "inbox_attempts": "jsonb", "inbox_failures": "integer",
               "inbox_due": "timestamptz", "inbox_until": "timestamptz",
               "inbox_changed": "timestamptz", "inbox_size": "integer"}  # fmt: skip
INBOX_COLUMNS = tuple(INBOX_TYPES)
# The inbox's states whose rows hold a body: never removed by the retention sweep.
_NOT_KEPT = "(inbox_state IS NULL OR inbox_state NOT IN ('pending', 'dead'))"
# The kept rows' counts (``_kept_counts``): the table beside the claim table, its name the claim
# table's and this; the triggers on the claim table that keep it, by their names.
KEPT_COUNTS = "_kept"
KEPT_TRIGGERS = tuple(f"dedup_kept_{op}" for op in ("insert", "update", "delete", "truncate"))


def stored(row: str = "") -> str:
    """What a kept ``row`` (a table alias, or "NEW."/"OLD." in a trigger; "" the row itself)
    stores of its request and its attempts, counted against max_pending_bytes: its inbox_size,
    written by every keep and failed attempt; for a row kept without it (before the upgrade, or
    by a replica of 0.2.0 on the same table), the same bytes read from the row, converting its
    jsonb to text."""
    return (
        f"coalesce({row}inbox_size, coalesce(octet_length({row}inbox_request::text), 0) "
        f"+ coalesce(octet_length({row}inbox_body), 0) "
        f"+ coalesce(octet_length({row}inbox_attempts::text), 0))"
    )


def _quote(table: str) -> str:
    return ".".join(f'"{part}"' for part in table.split("."))


def _literal(value: str | None) -> str:
    """A SQL string literal that reads the same whatever the session's
    standard_conforming_strings (an escape string: ``E'…'``, backslashes doubled), so the claim
    depends on no session setting. ``event_ids`` refuses control characters, NUL included, in
    IDs and types; scopes are configuration names."""
    if value is None:
        return "NULL"
    return "E'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _digest(value: bytes) -> str:
    return f"decode('{value.hex()}', 'hex')"


def _millis(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def lock_timeout(seconds: float) -> str:
    """Bound this transaction's waits on row locks (55P03 past it)."""
    return f"SET LOCAL lock_timeout = '{_millis(seconds)}'"


def statement_timeout(seconds: float) -> str:
    """Bound this transaction's statements to ``seconds`` each (57014 past it)."""
    return f"SET LOCAL statement_timeout = '{_millis(seconds)}'"


# What a bounded statement may take beyond its lock wait for its own work: on Citus, the
# coordinator's round trip to a worker, or a new connection to one.
STATEMENT_MARGIN = 0.25


# On Citus the coordinator writes a statement's values into the text it sends a worker as
# literals for its own session's standard_conforming_strings; the worker's session, to which
# Citus does not pass the setting, reads them with its own (on). With it off, a backslash in an
# event ID would be stored doubled, and the body's digest mangled. On for the transaction,
# whatever the role's default.
_CONFORMING = "SET LOCAL standard_conforming_strings = on"


def take_place(quoted: str, scope: str, first: str, below: str) -> str:
    """Lock one free row of ``scope`` whose ID is from ``first`` and below ``below``
    (``database.slots``' places), its values literals: one round trip, where a statement with
    parameters is two without a statement cache (Parse and Describe, then Bind). Its status is
    ``SELECT 1`` when it locked one."""
    return (
        f"SELECT FROM {quoted} WHERE scope = {_literal(scope)} AND event_id >= {_literal(first)} "
        f"AND event_id < {_literal(below)} LIMIT 1 FOR UPDATE SKIP LOCKED"
    )


def wait_bound(seconds: float, *, distributed: bool) -> str:
    """Bound this transaction's next statements' waits on row locks to ``seconds`` with
    ``lock_timeout`` (55P03 past it); on a table ``distributed`` by Citus, each statement to
    ``seconds`` + ``STATEMENT_MARGIN`` with ``statement_timeout`` (57014); and write its values
    as the workers read them (``_CONFORMING``).

    Both bounds, because the row lock a statement waits for is on a worker, which the
    coordinator's ``lock_timeout`` does not reach: the coordinator's ``statement_timeout``
    cancels the statement there too. The margin keeps a bound of a millisecond (a key's copy
    that must not wait) from cutting short the statement's own work. ``UNBOUND`` lifts the
    statement bound. (On one PostgreSQL, ``lock_timeout`` alone.)"""
    if not distributed:
        return lock_timeout(seconds)
    return _wait_bound(_millis(seconds), _millis(seconds + STATEMENT_MARGIN))


@functools.lru_cache(maxsize=512)
def _wait_bound(wait: str, statement: str) -> str:
    return (
        f"SET LOCAL lock_timeout = '{wait}'; SET LOCAL statement_timeout = '{statement}'; "
        f"{_CONFORMING}"
    )


def begin(lock_wait: float, idle_limit: float, *, distributed: bool = False) -> str:
    """BEGIN with a transaction's own bounds, to go in front of its first statement in one
    round trip: its waits on row locks end past ``lock_wait``; on a table ``distributed`` by
    Citus, each of its statements past it too (``wait_bound``), until ``UNBOUND``, and its
    values written as the workers read them (``_CONFORMING``).

    Set inside the transaction: never in the startup packet, which PgBouncer refuses; never per
    session, which PgBouncer would hand to other clients. Pinned to READ COMMITTED: under
    REPEATABLE READ a copy waiting on a row would fail with a serialization error after the
    owner's COMMIT instead of seeing the duplicate.

    A claim's lock wait is what its route's claim_wait has left, different for each request by
    a fraction of a millisecond: the text, in whole milliseconds, is made once per value.
    """
    statement = _millis(lock_wait + STATEMENT_MARGIN) if distributed else None
    return _begin(_millis(lock_wait), _millis(idle_limit), statement)


@functools.lru_cache(maxsize=512)
def _begin(lock_wait: str, idle_limit: str, statement: str | None) -> str:
    statements = (
        f"SET LOCAL statement_timeout = '{statement}'; {_CONFORMING}; " if statement else ""
    )
    return (
        f"BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '{lock_wait}'; "
        f"{statements}SET LOCAL idle_in_transaction_session_timeout = '{idle_limit}'; "
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Queries:
    """The statements over one claim table; build with ``for_table``."""

    table: str
    quoted: str
    # The DDL, one statement each: sent one at a time, as Citus propagates a distributed
    # table's ALTER TABLE and CREATE INDEX only from a query string of one statement.
    schema_steps: tuple[str, ...]
    schema_lock: str
    schema_missing: str
    schema_usage: str
    privileges: str
    insert: str
    duplicate_of: str
    kept_duplicate_of: str
    answer: str
    sweep_lock: str
    sweep: str
    sweep_not_kept: str
    citus: str
    distribution: str
    events: str
    events_count: str
    forget: str
    resolve: str
    resolve_last_part: str
    stats: str
    id_form_claims: str
    id_form: str
    id_form_unbound: str
    id_form_forget: str
    id_form_since: str
    receipt_key_make: str
    receipt_key: str
    reconcile_lock: str
    reconcile_expire: str
    reconcile_take: str
    kept_fold: str

    @property
    def schema(self) -> str:
        """The DDL as a script (``dedup-proxy schema``)."""
        return "".join(f"{step};\n" for step in self.schema_steps)

    def claim(
        self,
        begin: str,
        scope: str,
        event_id: str,
        event_type: str | None,
        body_sha256: bytes,
        *,
        commit: bool = False,
        also: str | None = None,
    ) -> str:
        """``begin`` and the claim in one round trip: "INSERT 0 1" claimed, "INSERT 0 0" a
        duplicate; with ``commit``, committed in the same round trip.

        With ``also`` (the upgrade window: the ID's legacy form), both rows in one INSERT, the
        legacy one first (the order every replica locks them in, an earlier release's taking
        only that one): "INSERT 0 2" claimed, fewer a duplicate of either."""
        values = f"{_literal(event_type)}, {_digest(body_sha256)})"
        rows = f"({_literal(scope)}, {_literal(event_id)}, {values}"
        if also is not None:
            rows = f"({_literal(scope)}, {_literal(also)}, {values}, {rows}"
        return (
            f"{begin}{self.insert}{rows} "
            f"ON CONFLICT (scope, event_id) DO NOTHING{'; COMMIT' if commit else ''}"
        )

    def hold_object(
        self, wait: str, scope: str, key: str, version: str | None, *, behind: bool
    ) -> str:
        """After the claim, in one round trip: ``wait`` (``wait_bound``), a savepoint, then the
        object's row inserted or locked (a delivery of it at the app holds it: this waits, at
        most ``wait``, 55P03 past it); then, in a statement of its own (READ COMMITTED: a fresh
        snapshot, which sees what the holder committed while this one waited), "SELECT n" of
        the flags: OBJECT_STALE (``version`` older than the one accepted), and, with
        ``behind``, OBJECT_BEHIND (a delivery of the object is kept pending in ``scope``).
        The lock's UPDATE writes inbox_changed, a column the inbox's grant covers."""
        obj = f"scope = {_literal(ORDER + '/' + scope)} AND event_id = {_literal(key)}"
        stale = (
            "0"
            if version is None
            else f"coalesce((SELECT ((inbox_request ->> 'v')::numeric > {version})::int "
            f"FROM {self.quoted} WHERE {obj}), 0)"
        )
        kept = (
            f" + 2 * (EXISTS (SELECT FROM {self.quoted} WHERE scope = {_literal(scope)} "
            f"AND inbox_state = 'pending' AND inbox_request ->> 'object' = {_literal(key)}))::int"
            if behind
            else ""
        )
        return (
            f"{wait}; SAVEPOINT {ORDER_SAVEPOINT}; INSERT INTO {self.quoted} "
            "(scope, event_id, event_type, inbox_changed) VALUES "
            f"({_literal(ORDER + '/' + scope)}, {_literal(key)}, 'object', now()) "
            "ON CONFLICT (scope, event_id) DO UPDATE SET inbox_changed = now(); "
            f"SELECT FROM generate_series(1, {stale}{kept})"
        )

    def accepted(self, scope: str, key: str, version: str) -> str:
        """The object's newest accepted version, raised to ``version`` (the app's 2xx), to go
        in front of the claim's COMMIT; its row is this transaction's already."""
        return (
            f"{UNBOUND}UPDATE {self.quoted} SET inbox_request = jsonb_build_object('v', "
            f"{version}::numeric) WHERE scope = {_literal(ORDER + '/' + scope)} AND event_id = "
            f"{_literal(key)} AND coalesce((inbox_request ->> 'v')::numeric < {version}, true); "
        )

    def superseded(self, scope: str, event_id: str) -> str:
        """The claim committed as superseded: never forwarded, a duplicate from now on."""
        return (
            f"{UNBOUND}UPDATE {self.quoted} SET inbox_state = 'superseded', inbox_changed = now() "
            f"WHERE scope = {_literal(scope)} AND event_id = {_literal(event_id)}; COMMIT"
        )

    def commit_answer(
        self,
        scope: str,
        event_id: str,
        status: int,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        also: str | None = None,
    ) -> str:
        """Store the app's answer in the claim row and COMMIT, in one round trip: a committed
        claim has its answer, a failed one has none. Behind a savepoint: if the UPDATE is
        refused, ``COMMIT_WITHOUT_ANSWER`` still commits the claim, its row lock held throughout.
        With ``also`` (claimed with it in the upgrade window), in that row too: an earlier
        release's replica replays it from there."""
        encoded = json.dumps(headers, ensure_ascii=False, separators=(",", ":"))
        answer = (
            f"UPDATE {self.quoted} SET answer_status = {int(status)}, "
            f"answer_headers = {_literal(encoded)}::jsonb, answer_body = {_digest(body)} "
            f"WHERE scope = {_literal(scope)} AND event_id = "
        )
        rows = "".join(f"{answer}{_literal(row)}; " for row in (also, event_id) if row is not None)
        return f"{UNBOUND}SAVEPOINT {_ANSWER_SAVEPOINT}; {rows}COMMIT"

    def duplicate(
        self,
        scope: str,
        event_id: str,
        body_sha256: bytes,
        *,
        inbox: bool = False,
        legacy: str | None = None,
    ) -> str:
        """For a duplicate: ROLLBACK, then whether the stored body digest differs from this one
        ("SELECT 1"), in one round trip. Outside the transaction, so it also sees the row of a
        concurrent owner the copy waited for.

        With ``inbox`` (a route that redelivers), the status also says whether the event is
        kept for redelivery: the row is selected as many times as the sum of 1 for a mismatch,
        2 for pending and 4 for dead ("SELECT 0" to "SELECT 5"; see ``duplicate_flags``). A
        simple-protocol query returns only its status, and that keeps it one round trip.

        With ``legacy`` (the upgrade window), the mismatch is read from the legacy row, which
        every claim of the event has then, and the inbox's state from ``event_id``'s row, the
        only one that keeps a delivery."""
        where = f"scope = {_literal(scope)} AND event_id = {_literal(event_id)}"
        if legacy is not None:
            first = f"scope = {_literal(scope)} AND event_id = {_literal(legacy)}"
            if not inbox:
                return f"{self.duplicate_of}{first} AND body_sha256 <> {_digest(body_sha256)}"
            flags = (
                f"coalesce((SELECT (body_sha256 <> {_digest(body_sha256)})::int "
                f"FROM {self.quoted} WHERE {first}), 0) + coalesce((SELECT 0{KEPT_FLAGS} "
                f"FROM {self.quoted} WHERE {where}), 0)"
            )
            return f"ROLLBACK; SELECT FROM generate_series(1, {flags})"
        if inbox:
            mismatch = f"(coalesce(body_sha256 <> {_digest(body_sha256)}, false))::int"
            return f"{self.kept_duplicate_of}{mismatch}{KEPT_FLAGS}) WHERE {where}"
        return f"{self.duplicate_of}{where} AND body_sha256 <> {_digest(body_sha256)}"


KEPT_FLAGS = " + CASE inbox_state WHEN 'pending' THEN 2 WHEN 'dead' THEN 4 ELSE 0 END"


def duplicate_flags(status: str | None) -> tuple[bool, str | None]:
    """What the status of ``Queries.duplicate(..., inbox=True)`` says: (mismatch, the inbox
    state: "pending", "dead" or None)."""
    flags = int(status.rpartition(" ")[2]) if status else 0
    state = "dead" if flags & 4 else "pending" if flags & 2 else None
    return bool(flags & 1), state


def last_part_named(given: str) -> str:
    """The condition that a row's ID is composite and its last part is ``given`` (a
    parameter), as stored or bound to a body: the last part's index serves it."""
    return (
        f"({COMPOSITE} AND ({LAST_PART} = {given} OR ({LAST_PART} >= {given} || '~' "
        f"AND {LAST_PART} <= {given} || '~{'f' * BOUND_DIGITS}' "
        f"AND left({LAST_PART}, length({given}) + 1) = {given} || '~')))"
    )


def _kept_counts(table: str) -> str:
    """The kept rows' counts beside ``table`` (``KEPT_COUNTS``), in one statement: its table,
    the triggers' function and the sweeper's fold, in the claim table's schema; then, when
    the triggers are not there yet, the counts seeded from the rows and the triggers made, in
    the same transaction under a lock that holds the table's writes (the claims in flight
    finish first, new ones wait): no write falls between the seed and the triggers.

    Each row entering or leaving the kept states (pending, dead), or changing what it stores
    while kept, adds its difference to its scope's row of the backend making the change
    (bucket ``pg_backend_pid()``). A backend runs one transaction at a time, so no two
    transactions ever update one counter row: no row every keep waits on, no lock order
    between them, no deadlock; the cap's read sums the buckets of its scopes. The sweeper
    folds the buckets of backends gone into bucket 0 (``kept_fold``), rows it locks skipped.

    The functions run as their owner (SECURITY DEFINER, with a search_path of pg_catalog
    only): every role writing the claim table counts, none needs a grant on the counts to do
    so, and a proxy running while a migrate adds them goes on as before. Not on Citus: a
    distributed table takes no such triggers (``Inbox.counted``); nor for a table whose name
    is too long for the functions' (PostgreSQL would cut them to the claim table's own)."""
    name = table.rpartition(".")[2]
    insert, update, delete, truncate = KEPT_TRIGGERS
    names = {
        "<table>": _literal(table),
        "<counts>": _literal(name + KEPT_COUNTS),
        "<delta>": _literal(name + KEPT_COUNTS + "_delta"),
        "<fold>": _literal(name + KEPT_COUNTS + "_fold"),
        "<triggers>": ", ".join(map(_literal, KEPT_TRIGGERS)),
        "<insert>": insert,
        "<update>": update,
        "<delete>": delete,
        "<truncate>": truncate,
        "<stored>": stored(),
        "<stored OLD>": stored("OLD."),
        "<stored NEW>": stored("NEW."),
        "<add>": "ON CONFLICT (scope, bucket)\n"
        "            DO UPDATE SET rows = k.rows + excluded.rows, bytes = k.bytes + excluded.bytes",
    }
    text = _KEPT_COUNTS
    for marker, value in names.items():
        text = text.replace(marker, value)
    return text


# ``_kept_counts``'s statement; its <markers> are replaced by names and expressions.
_KEPT_COUNTS = """DO $do$
DECLARE
    claims regclass := to_regclass(<table>);
    place text;
    target text;
    counts text;
    delta text;
BEGIN
    IF claims IS NULL OR octet_length(<delta>) > 63
        OR EXISTS (SELECT FROM pg_extension WHERE extname = 'citus') THEN
        RETURN;
    END IF;
    SELECT quote_ident(n.nspname), quote_ident(n.nspname) || '.' || quote_ident(c.relname)
        INTO place, target
        FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE c.oid = claims;
    counts := place || '.' || quote_ident(<counts>);
    delta := place || '.' || quote_ident(<delta>);
    EXECUTE 'CREATE TABLE IF NOT EXISTS ' || counts || ' (
    scope  text COLLATE "C" NOT NULL,
    bucket integer NOT NULL,
    rows   bigint NOT NULL,
    bytes  bigint NOT NULL,
    PRIMARY KEY (scope, bucket)
)';
    EXECUTE format($f$CREATE OR REPLACE FUNCTION %2$s() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    gone text;
    gone_bytes bigint;
    kept_bytes bigint;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM %1$s;
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' THEN
        IF OLD.inbox_state IN ('pending', 'dead') AND left(OLD.scope, 1) <> '~' THEN
            gone := OLD.scope;
            gone_bytes := <stored OLD>;
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        IF NEW.inbox_state IN ('pending', 'dead') AND left(NEW.scope, 1) <> '~' THEN
            kept_bytes := <stored NEW>;
            IF gone IS NOT DISTINCT FROM NEW.scope THEN
                IF kept_bytes <> gone_bytes THEN
                    INSERT INTO %1$s AS k VALUES
                        (NEW.scope, pg_backend_pid(), 0, kept_bytes - gone_bytes) <add>;
                END IF;
                RETURN NULL;
            END IF;
            INSERT INTO %1$s AS k VALUES (NEW.scope, pg_backend_pid(), 1, kept_bytes) <add>;
        END IF;
    END IF;
    IF gone IS NOT NULL THEN
        INSERT INTO %1$s AS k VALUES (gone, pg_backend_pid(), -1, -gone_bytes) <add>;
    END IF;
    RETURN NULL;
END
$fn$$f$, counts, delta);
    EXECUTE format($f$CREATE OR REPLACE FUNCTION %2$s(batch integer) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
    folded bigint;
BEGIN
    WITH gone AS (
        DELETE FROM %1$s WHERE (scope, bucket) IN (
            SELECT scope, bucket FROM %1$s AS c WHERE bucket <> 0
            AND NOT EXISTS (SELECT FROM pg_stat_activity AS a WHERE a.pid = c.bucket)
            LIMIT batch FOR UPDATE SKIP LOCKED)
        RETURNING scope, rows, bytes
    ), added AS (
        INSERT INTO %1$s AS k
        SELECT scope, 0, sum(rows), sum(bytes) FROM gone GROUP BY scope <add>
    )
    SELECT count(*) INTO folded FROM gone;
    DELETE FROM %1$s WHERE bucket = 0 AND rows = 0 AND bytes = 0;
    RETURN folded;
END
$fn$$f$, counts, place || '.' || quote_ident(<fold>));
    IF (SELECT count(*) FROM pg_trigger WHERE tgrelid = claims AND tgname IN (<triggers>)) < 4
    THEN
        EXECUTE 'LOCK TABLE ' || target || ' IN SHARE ROW EXCLUSIVE MODE';
        EXECUTE format('DROP TRIGGER IF EXISTS <insert> ON %1$s; '
            'DROP TRIGGER IF EXISTS <update> ON %1$s; DROP TRIGGER IF EXISTS <delete> ON %1$s; '
            'DROP TRIGGER IF EXISTS <truncate> ON %1$s', target);
        EXECUTE 'DELETE FROM ' || counts;
        EXECUTE format($f$INSERT INTO %1$s
    SELECT scope, 0, count(*), sum(<stored>)
    FROM %2$s WHERE inbox_state IN ('pending', 'dead') AND left(scope, 1) <> '~'
    GROUP BY scope$f$, counts, target);
        EXECUTE format($f$CREATE TRIGGER <insert> AFTER INSERT ON %1$s FOR EACH ROW
    WHEN (NEW.inbox_state IN ('pending', 'dead')) EXECUTE FUNCTION %2$s()$f$, target, delta);
        EXECUTE format($f$CREATE TRIGGER <update>
    AFTER UPDATE OF scope, inbox_state, inbox_size, inbox_request, inbox_body, inbox_attempts
    ON %1$s FOR EACH ROW
    WHEN (OLD.inbox_state IN ('pending', 'dead') OR NEW.inbox_state IN ('pending', 'dead'))
    EXECUTE FUNCTION %2$s()$f$, target, delta);
        EXECUTE format($f$CREATE TRIGGER <delete> AFTER DELETE ON %1$s FOR EACH ROW
    WHEN (OLD.inbox_state IN ('pending', 'dead')) EXECUTE FUNCTION %2$s()$f$, target, delta);
        EXECUTE format($f$CREATE TRIGGER <truncate> AFTER TRUNCATE ON %1$s
    FOR EACH STATEMENT EXECUTE FUNCTION %2$s()$f$, target, delta);
    END IF;
END
$do$"""


@functools.cache
def for_table(table: str) -> Queries:
    """The statements over ``table`` (a validated ``[schema.]name``)."""
    quoted = _quote(table)
    schema, dot, name = table.rpartition(".")
    index = f"{name}_received_at_idx"
    inbox_index = f"{name}_inbox_idx"
    kept_index = f"{name}_kept_idx"
    last_part_index = f"{name}_last_part_idx"
    object_index = f"{name}_object_idx"
    inbox_columns = ",\n".join(
        f"    ADD COLUMN IF NOT EXISTS {name} {kind}" for name, kind in INBOX_TYPES.items()
    )
    return Queries(
        table=table,
        quoted=quoted,
        schema_steps=(
            f"CREATE TABLE IF NOT EXISTS {quoted} (\n"
            "    scope       text        NOT NULL,\n"
            "    event_id    text        NOT NULL,\n"
            "    event_type  text,\n"
            "    received_at timestamptz NOT NULL DEFAULT now(),\n"
            "    body_sha256 bytea,\n"
            # on_duplicate: replay — the app's 2xx answer, stored before COMMIT.
            "    answer_status  smallint,\n"
            "    answer_headers jsonb,\n"
            "    answer_body    bytea,\n"
            "    PRIMARY KEY (scope, event_id)\n"
            ")",
            f'CREATE INDEX IF NOT EXISTS "{index}" ON {quoted} (received_at)',
            f"ALTER TABLE {quoted} ADD COLUMN IF NOT EXISTS body_sha256 bytea,\n"
            "    ADD COLUMN IF NOT EXISTS answer_status smallint,\n"
            "    ADD COLUMN IF NOT EXISTS answer_headers jsonb,\n"
            "    ADD COLUMN IF NOT EXISTS answer_body bytea,\n"
            # redeliver — a failed delivery kept for redelivery (database.inbox).
            f"{inbox_columns}",
            f'CREATE INDEX IF NOT EXISTS "{inbox_index}" ON {quoted} (inbox_state, inbox_due)\n'
            "    WHERE inbox_state IN ('pending', 'dead')",
            # The console's kept deliveries, newest first (``inbox_sql.Statements.browse``):
            # only the rows the inbox ever kept, so a claim delivered at the first try, the
            # common case, writes nothing to it. Not required: a table without it (made before
            # it, and not migrated since) has its console's list read by a scan.
            f'CREATE INDEX IF NOT EXISTS "{kept_index}" ON {quoted} (received_at, event_id)\n'
            "    WHERE inbox_state IS NOT NULL",
            # An ID as the provider shows it, the last part of a composite one (GitHub's GUID
            # without its hook ID: ``resolve_last_part``, the console's lookup): only the rows
            # of composite IDs. Not required: without it (a table made before it, not migrated
            # since) such a lookup reads the scope's rows.
            f'CREATE INDEX IF NOT EXISTS "{last_part_index}" ON {quoted} (scope, {LAST_PART})\n'
            f"    WHERE {COMPOSITE}",
            # An ordered route's pending deliveries by object (``order``: is one of this
            # object's kept? the redeliverer's oldest of an object first, the sweep, blocked
            # objects): only the pending rows, written on the keep path alone. Not required:
            # without it those reads scan the scope's pending rows.
            f'CREATE INDEX IF NOT EXISTS "{object_index}" ON {quoted} '
            "(scope, (inbox_request ->> 'object'))\n    WHERE inbox_state = 'pending'",
            # The kept rows' counts, which redeliver's cap reads instead of counting the rows.
            # Not required: without them (not migrated since, or on Citus) each keep counts.
            _kept_counts(table),
        ),
        # Concurrent CREATE TABLE IF NOT EXISTS can still collide in the catalog.
        schema_lock=f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK_KEY})",
        # Reads the catalog only: no lock that would queue behind the claims in flight.
        schema_missing=(
            f"SELECT to_regclass({_literal(table)}) IS NOT NULL AS table,"
            f" EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass({_literal(table)})"
            "         AND attname = 'body_sha256' AND NOT attisdropped) AS digest,"
            f" EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass({_literal(table)})"
            "         AND attname = 'answer_body' AND NOT attisdropped) AS answer,"
            f" EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass({_literal(table)})"
            "         AND attname = 'inbox_changed' AND NOT attisdropped) AS inbox,"
            # Added after 0.2.0: a table its inbox used may lack this one alone.
            f" EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass({_literal(table)})"
            "         AND attname = 'inbox_size' AND NOT attisdropped) AS inbox_size,"
            f" to_regclass({_literal(schema + dot + inbox_index)}) IS NOT NULL AS inbox_index,"
            f" to_regclass({_literal(schema + dot + index)}) IS NOT NULL AS index,"
            # The kept rows' counts (``_kept_counts``), whole and readable: their four
            # triggers, enabled, and their table, in the claim table's schema, which the role
            # may read. False: each keep counts the rows.
            " (SELECT count(*) = 4 FROM pg_trigger WHERE tgrelid = "
            f"to_regclass({_literal(table)}) AND tgname IN "
            f"({', '.join(map(_literal, KEPT_TRIGGERS))}) AND tgenabled <> 'D')"
            " AND coalesce((SELECT c.relnamespace = k.relnamespace"
            " AND has_table_privilege(k.oid, 'SELECT') FROM pg_class AS c, pg_class AS k"
            f" WHERE c.oid = to_regclass({_literal(table)})"
            f" AND k.oid = to_regclass({_literal(table + KEPT_COUNTS)})), false) AS kept_counts"
        ),
        # The claim table's schema and whether the role may use it (USAGE): without, every
        # statement naming the table fails ('permission denied for schema'), and a name looked
        # up through search_path skips the schema, so that the table seems missing. The
        # catalogs are readable all the same: the schema named, or else the first schema on
        # search_path holding a relation of that name. No row: neither is there.
        schema_usage=(
            "SELECT quote_ident(n.nspname) AS schema, quote_ident(current_user) AS role,"
            " has_schema_privilege(n.oid, 'USAGE') AS usage FROM "
            + (
                f"pg_namespace AS n WHERE n.nspname = {_literal(schema)}"
                if schema
                else "unnest(string_to_array(current_setting('search_path'), ','))"
                " WITH ORDINALITY AS p(entry, position) JOIN pg_namespace AS n"
                " ON n.nspname = replace(btrim(btrim(p.entry), '\"'), '$user', current_user)"
                " WHERE EXISTS (SELECT FROM pg_class AS c WHERE c.relnamespace = n.oid"
                f" AND c.relname = {_literal(name)}) ORDER BY p.position LIMIT 1"
            )
        ),
        # What the role (through PgBouncer: the server's) may do with the table, in one
        # statement that takes no lock; NULLs when the table or the answer columns are missing.
        privileges=(
            f"SELECT to_regclass({_literal(table)}) IS NOT NULL AS table,"
            " quote_ident(current_user) AS role,"
            + "".join(
                f" has_table_privilege(to_regclass({_literal(table)}), '{p}') AS {p.lower()},"
                for p in ("SELECT", "INSERT", "DELETE")
            )
            + " (SELECT bool_and(has_column_privilege(attrelid, attnum, 'UPDATE'))"
            f"    FROM pg_attribute WHERE attrelid = to_regclass({_literal(table)})"
            f"    AND attname IN ({', '.join(map(_literal, ANSWER_COLUMNS))}) AND NOT attisdropped)"
            " AS answer,"
            " (SELECT bool_and(has_column_privilege(attrelid, attnum, 'UPDATE'))"
            f"    FROM pg_attribute WHERE attrelid = to_regclass({_literal(table)})"
            f"    AND attname IN ({', '.join(map(_literal, INBOX_COLUMNS))})"
            "    AND NOT attisdropped)"
            " AS inbox,"
            # NULL without the kept rows' counts (``_kept_counts``).
            f" has_table_privilege(to_regclass({_literal(table + KEPT_COUNTS)}), 'SELECT')"
            " AS kept_counts,"
            # Whether a claim can commit here, as target_session_attrs=read-write judges it,
            # and whether its COMMIT waits for a standby (docs/deployment.md, "High
            # availability").
            " pg_is_in_recovery() AS in_recovery,"
            " current_setting('transaction_read_only') = 'on' AS read_only,"
            " current_setting('synchronous_commit') AS synchronous_commit,"
            " current_setting('synchronous_standby_names') AS standby_names"
        ),
        insert=f"INSERT INTO {quoted} (scope, event_id, event_type, body_sha256) VALUES ",
        duplicate_of=f"ROLLBACK; SELECT FROM {quoted} WHERE ",
        kept_duplicate_of=f"ROLLBACK; SELECT FROM {quoted}, generate_series(1, ",
        # $1 scope, $2 event ID, $3 this copy's body digest: a duplicate's stored answer.
        answer=(
            "SELECT coalesce(body_sha256 <> $3, false) AS mismatch, answer_status, answer_headers, "
            f"answer_body FROM {quoted} WHERE scope = $1 AND event_id = $2"
        ),
        sweep_lock=f"SELECT pg_try_advisory_xact_lock({SWEEP_LOCK_KEY})",
        # $1 scope, $2 retention in seconds, $3 batch size. No FOR UPDATE SKIP LOCKED, which
        # needs the UPDATE privilege: the DELETE waits only on a row another transaction is
        # deleting (an operator's forget, one short statement), and then passes over it. A
        # claim in flight is an uncommitted row this snapshot does not see.
        sweep=(
            f"DELETE FROM {quoted} WHERE (scope, event_id) IN ("
            f"  SELECT scope, event_id FROM {quoted}"
            f"   WHERE {IN_SCOPE} AND received_at < now() - make_interval(secs => $2)"
            "   LIMIT $3)"
        ),
        # The same, on a table with the inbox's columns: what it keeps is never swept.
        # (The state again on the DELETE: a row an operator's redeliver changed while the
        # DELETE waited for it is checked again only against the DELETE's own conditions.)
        sweep_not_kept=(
            f"DELETE FROM {quoted} WHERE (scope, event_id) IN ("
            f"  SELECT scope, event_id FROM {quoted}"
            f"   WHERE {IN_SCOPE} AND received_at < now() - make_interval(secs => $2)"
            f"   AND {_NOT_KEPT} LIMIT $3) AND {_NOT_KEPT}"
        ),
        # Whether Citus is installed here (its catalog), and then how the table is distributed:
        # its distribution column (NULL: a reference or local table) and shards; no row: a
        # plain table on the coordinator.
        citus=(
            "SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL AS citus, "
            "current_setting('standard_conforming_strings') = 'on' AS conforming"
        ),
        distribution=(
            "SELECT column_to_column_name(logicalrelid, partkey) AS column, "
            "(SELECT count(*) FROM pg_dist_shard AS s WHERE s.logicalrelid = p.logicalrelid) "
            "AS shards FROM pg_dist_partition AS p "
            f"WHERE logicalrelid = to_regclass({_literal(table)})"
        ),
        # $1 scope, $2 oldest received_at or NULL, $3 limit.
        events=(
            "SELECT scope, event_id, event_type, received_at, inbox_state "
            f"FROM {quoted} WHERE {IN_SCOPE} "
            "AND ($2::timestamptz IS NULL OR received_at >= $2) "
            "ORDER BY received_at DESC LIMIT $3"
        ),
        events_count=(
            f"SELECT count(*) AS n FROM {quoted} WHERE {IN_SCOPE} "
            "AND ($2::timestamptz IS NULL OR received_at >= $2)"
        ),
        # $1 scope, $2 event IDs.
        forget=(
            f"DELETE FROM {quoted} WHERE scope = $1 AND event_id = ANY($2::text[]) "
            "RETURNING event_id"
        ),
        # $1 scope, $2 an ID as an operator gave it: that row, and the rows of that ID bound
        # to a body ("$2~" and 32 hex digits), found by a range on the primary key that holds
        # them whatever the column's collation (a prefix sorts first, and no hex digit after
        # 'f'); the exact prefix checked again, without LIKE, which would read '%', '_' and
        # '\' in an ID as patterns.
        resolve=(
            f"SELECT event_id FROM {quoted} WHERE scope = $1 AND (event_id = $2 OR "
            f"(event_id >= $2 || '~' AND event_id <= $2 || '~{'f' * BOUND_DIGITS}' "
            "AND left(event_id, length($2) + 1) = $2 || '~'))"
        ),
        # $2 the last part of a composite ID, as the provider shows it (GitHub's GUID): the
        # claims whose last part it is, as stored or bound to a body, by the last part's index.
        resolve_last_part=(
            f"SELECT event_id FROM {quoted} WHERE scope = $1 AND {last_part_named('$2')}"
        ),
        stats=(
            "SELECT scope, count(*) AS n, min(received_at) AS oldest, max(received_at) AS newest, "
            "count(*) FILTER (WHERE inbox_state = 'pending') AS pending, "
            "count(*) FILTER (WHERE inbox_state = 'dead') AS dead "
            f"FROM {quoted} GROUP BY scope"
        ),
        # The bound form's start, per route scope ($1): a row of ID_FORMS (docs/deployment.md,
        # "Upgrades"). -infinity: bound from the scope's first claim, no window. The claims
        # that need one: all of the scope's, or those since its row of the unbound form.
        id_form_claims=(
            f"SELECT EXISTS (SELECT FROM {quoted} WHERE {IN_SCOPE} AND received_at >= "
            f"coalesce((SELECT received_at FROM {quoted} WHERE scope = '{ID_FORMS}' "
            f"AND event_id = $1 AND event_type = '{FORM_UNBOUND}'), '-infinity'))"
        ),
        id_form=(
            f"INSERT INTO {quoted} (scope, event_id, event_type, received_at) VALUES "
            f"('{ID_FORMS}', $1, '{FORM_BOUND}', "
            "CASE WHEN $2 THEN now() ELSE '-infinity' END) "
            "ON CONFLICT (scope, event_id) DO NOTHING"
        ),
        id_form_unbound=(
            f"INSERT INTO {quoted} (scope, event_id, event_type, received_at) VALUES "
            f"('{ID_FORMS}', $1, '{FORM_UNBOUND}', now()) "
            "ON CONFLICT (scope, event_id) DO NOTHING"
        ),
        # A scope's row ($1) if it records the form $2: "DELETE 1" when it did.
        id_form_forget=(
            f"DELETE FROM {quoted} WHERE scope = '{ID_FORMS}' AND event_id = $1 AND event_type = $2"
        ),
        id_form_since=(
            "SELECT event_type AS form, CASE WHEN received_at = '-infinity' THEN NULL "
            "ELSE extract(epoch FROM received_at)::float8 END AS since "
            f"FROM {quoted} WHERE scope = '{ID_FORMS}' AND event_id = $1"
        ),
        # The receipts' key ($1 the secret): the first row made stays (``Store.receipt_keys``).
        receipt_key_make=(
            f"INSERT INTO {quoted} (scope, event_id, body_sha256) VALUES "
            f"('{RECEIPT_KEY}', 'hmac-sha256', $1) ON CONFLICT (scope, event_id) DO NOTHING"
        ),
        receipt_key=(
            f"SELECT body_sha256 FROM {quoted} "
            f"WHERE scope = '{RECEIPT_KEY}' AND event_id = 'hmac-sha256'"
        ),
        # A route's turn to reconcile ($1 its name, $2 its period in seconds): the last run's
        # row removed once the period has passed, then a new one inserted ("INSERT 0 1": this
        # replica's turn). SELECT, INSERT and DELETE only, as the sweep and the holds.
        reconcile_lock=f"SELECT pg_try_advisory_xact_lock({RECONCILE_LOCK_KEY})",
        reconcile_expire=(
            f"DELETE FROM {quoted} WHERE scope = '{RECONCILE_RUNS}' AND event_id = $1 "
            "AND received_at <= now() - make_interval(secs => $2)"
        ),
        reconcile_take=(
            f"INSERT INTO {quoted} (scope, event_id, event_type) VALUES "
            f"('{RECONCILE_RUNS}', $1, 'run') ON CONFLICT (scope, event_id) DO NOTHING"
        ),
        # $1 batch: the kept rows' counts of at most that many backends gone folded into
        # bucket 0 (``_kept_counts``); how many were.
        kept_fold=f'SELECT {quoted[:-1]}{KEPT_COUNTS}_fold"($1::int)',
    )
