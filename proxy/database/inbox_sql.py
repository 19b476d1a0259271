"""The inbox's statements (``database.inbox``), built once per claim table: keeping a failed
delivery in its claim's row under its cap (a signed body once), taking a due row ``FOR UPDATE
SKIP LOCKED``, the two ends of a redelivery, the operators' commands, the metrics' levels,
the dead rows' sweep and the operator console's reads; and the route holds' rows
(``database.holds``: in scope ``sql.HOLDS``, one per route scope, in the inbox's columns).
Every value is a parameter; the columns are added by the claim table's DDL (``sql``).

Shaped for a table distributed by ``event_id`` on Citus too (tests/test_sql_shapes.py pins
it): a statement that locks rows names the one row it locks by its whole key, so that it runs on
one shard (Citus runs no ``FOR UPDATE`` across shards); rows are found first by a statement
that locks nothing (``due``, ``selected``). An UPDATE's ``CASE`` reads the time as a
parameter, not ``now()`` (Citus evaluates no such function inside ``CASE`` in a modification).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from proxy.database import sql

# $1: the scopes of the routes this proxy redelivers for; a route's per-path scopes are its
# own ("scope/acme"). Another deployment's rows in a shared table are not its to send.
_OURS = "split_part(scope, '/', 1) = ANY($1::text[])"
# Back to pending, due now, with the route's whole schedule and ``for`` again.
_AGAIN = (
    "inbox_state = 'pending', inbox_due = now(), inbox_until = now() + make_interval(secs => "
    "{until}), inbox_failures = 0, inbox_changed = now()"
)
# A row an operator's bulk command acts on (``Inbox.selected``): in ``state``, changed since
# ``since``; and, when it redelivers (``again``), not a row an operator made due already and the
# redeliverer has not tried since (no failure counted): a rerun after an interrupted run
# continues with the rows that run left.
_SELECTED = (
    "inbox_state = {state}::text AND inbox_body IS NOT NULL "
    "AND ({since}::timestamptz IS NULL OR inbox_changed >= {since}) "
    "AND NOT ({again}::bool AND inbox_failures = 0)"
)
# The attempts a row keeps (``inbox.ATTEMPTS_KEPT``): the first, and the newest ones, each
# numbered (``n``). A row redelivered for a year on a short schedule makes thousands.
ATTEMPTS_KEPT = 20
# The attempts made: the newest one's number (``n``; a row keeps ATTEMPTS_KEPT of them), or
# for a row recorded before attempts were numbered, how many it holds.
_MADE = "coalesce((inbox_attempts -> -1 ->> 'n')::int, jsonb_array_length(inbox_attempts))"
# A kept row as ``events pending``/``dead`` list it (``inbox.Listed``).
_LISTED = (
    "scope, event_id, event_type, received_at, inbox_state, "
    f"{_MADE}, inbox_due, octet_length(inbox_body), "
    "(inbox_attempts -> -1 ->> 'status')::int, inbox_attempts -> -1 ->> 'error'"
)
# A delivery handed off whose first attempt is still at the app: kept at its hand-off, no
# attempt recorded yet, and its lease (inbox_due, upstream.timeout + 5 s after the hand-off)
# not over. Its attempt's end records one (``HandedOff``), or the lease ends (its proxy died).
_AT_APP = (
    "(inbox_state = 'pending' AND inbox_request ->> 'kept_for' = 'handed_off' "
    "AND jsonb_array_length(inbox_attempts) = 0 AND inbox_due > now())"
)
# Discarded: the request and body dropped, the claim and its attempts kept.
_DISCARDED = (
    "inbox_state = 'discarded', inbox_body = NULL, inbox_request = NULL, inbox_size = NULL, "
    "inbox_due = NULL, inbox_changed = now()"
)
# What a kept row stores of its request and its attempts, counted against max_pending_bytes.
_STORED = sql.stored()
# The rows a route's cap counts: the kept rows of the cap's scope and its per-path ones.
_CAPPED = sql.IN_SCOPE.replace("$1", "{scope}") + " AND inbox_state IN ('pending', 'dead')"
# A claim bound to what is signed (webhooks.bound) ends with its signed part, "~" and 32 hex
# digits: a row whose ID ends with this claim's holds the same signed body (and query).
_SIGNED = "right(event_id, length({part})) = {part}"
# A kept row of an ordered route (``inbox_request`` names its object) waits for the older kept
# rows of its object, due or not: a failed head holds back its own object only. And for one of
# its object handed off whose attempt is still at the app (``_AT_APP``), older or not: the keep
# at the hand-off committed, and with it let go of the object's row lock, while the app still
# has that delivery.
_FIRST_OF_OBJECT = (
    "(t.inbox_request ->> 'object' IS NULL OR NOT EXISTS (SELECT FROM {quoted} AS o "
    "WHERE o.scope = t.scope AND o.inbox_state = 'pending' "
    "AND o.inbox_request ->> 'object' = t.inbox_request ->> 'object' "
    "AND ((o.received_at, o.event_id) < (t.received_at, t.event_id) "
    "OR (o.event_id <> t.event_id AND o.inbox_request ->> 'kept_for' = 'handed_off' "
    "AND jsonb_array_length(o.inbox_attempts) = 0 AND o.inbox_due > now()))))"
)
# One attempt's record: its number, when, the app's status, the proxy's error, and what the app
# answered (``inbox.Attempt.answer``: JSON text, or NULL).
_ATTEMPT = (
    "(jsonb_build_object('at', now(), 'n', {n}, 'status', {status}::int, 'error', "
    "{error}::text) || coalesce({answer}::jsonb, '{{}}'::jsonb))"
)
# The row's attempts with one more: past ATTEMPTS_KEPT, the oldest but the first is dropped.
_FULL = f"jsonb_array_length(inbox_attempts) >= {ATTEMPTS_KEPT}"
_APPENDED = "CASE WHEN " + _FULL + " THEN inbox_attempts - 1 ELSE inbox_attempts END || {attempt}"
# What that changes of the row's stored bytes (inbox_size, counted against max_pending_bytes):
# its text's length, to the byte (", " between two attempts).
_GROWN = (
    "inbox_size + octet_length({attempt}::text) + CASE WHEN "
    + _FULL
    + " THEN -octet_length((inbox_attempts -> 1)::text) "
    "WHEN jsonb_array_length(inbox_attempts) > 0 THEN 2 ELSE 0 END"
)
# An ordered route's blocked objects: each object whose oldest pending delivery (its head)
# holds later ones of it behind, with the head's arrival and how many wait behind it. One pass
# over the pending rows (the inbox index), grouped by object: what a route's caps bound.
_BLOCKED = (
    "SELECT scope, inbox_request ->> 'object' AS object, min(received_at) AS since, "
    "count(*) - 1 AS behind FROM {quoted} WHERE {in_scope} AND inbox_state = 'pending' "
    "AND inbox_request ->> 'object' IS NOT NULL GROUP BY scope, inbox_request ->> 'object' "
    "HAVING count(*) > 1"
)


@dataclass(frozen=True, slots=True)
class Statements:
    """The inbox's statements over one claim table (``quoted``)."""

    quoted: str

    def _kept(self) -> tuple[str, str]:
        """``keep``'s UPDATE but its cap, and the bytes it keeps."""
        # $1 scope, $2 event ID, $3 state, $4 request, $5 body, $6 status, $7 error, $8
        # delay, $9 until, $14 the attempts made (1; 0 for a delivery kept before its attempt
        # ended: the array's element $14 is removed, so the attempt is recorded only if made),
        # $15 what the app answered (``_ATTEMPT``). inbox_size: what the row stores, from the
        # parameters (no row's jsonb converted), its attempt's answer included, so that the
        # next keep's cap reads a number.
        attempts = (
            "(jsonb_build_array("
            + _ATTEMPT.format(n="1", status="$6", error="$7", answer="$15")
            + ") - $14::int)"
        )
        size = (
            "octet_length($4::jsonb::text) + octet_length($5::bytea) "
            f"+ octet_length({attempts}::text)"
        )
        return (
            f"UPDATE {self.quoted} SET inbox_state = $3, inbox_request = $4::jsonb, "
            f"inbox_body = $5::bytea, inbox_size = {size}, inbox_attempts = {attempts}"
            ", inbox_failures = $14::int, "
            # No due time for a dead row; the CASE reads no function (Citus runs none in one).
            "inbox_due = now() + make_interval(secs => "
            "CASE WHEN $3 = 'pending' THEN $8::float8 END), "
            "inbox_until = now() + make_interval(secs => $9), inbox_changed = now() "
            "WHERE scope = $1 AND event_id = $2"
        ), size

    @property
    def keep(self) -> str:
        # ``_kept``'s parameters, $10 the cap's scope, $11 max count, $12 max bytes, $13 the
        # claim's signed part or NULL. Under the cap only: the kept rows of the cap's scope and
        # its per-path ones (pending and dead: both hold requests), this one counted, each by
        # what it stores (its headers as well as its body: the headers alone can be 1 MiB; its
        # attempts' answers). And, on a route whose claims are bound to what is signed, only
        # if none of those rows holds this signed body already under another ID (a replay:
        # ``KEPT_AS``; ``keep_signed`` first, so that concurrent replays see the one kept).
        # Concurrent failures each see the others' uncommitted rows as absent, so the cap
        # can be passed by the deliveries failing at that moment (at most the pool's size).
        # The rows counted here, one by one: ``keep_counted`` reads their counts instead.
        update, size = self._kept()
        return (
            f"{update} AND (SELECT count(*) < $11 AND "
            f"coalesce(sum({_STORED}), 0) + {size} <= $12 AND NOT "
            f"coalesce(bool_or({_SIGNED.format(part='$13::text')}), false) "
            f"FROM {self.quoted} WHERE {_CAPPED.format(scope='$10')})"
        )

    @property
    def keep_counted(self) -> str:
        # ``keep``, its cap read from the kept rows' counts (``sql._kept_counts``): the rows of
        # the cap's scopes' buckets, a range of the counts' key (their scope is in the "C"
        # collation: "scope" up to "scope0", '0' the character after '/'), whatever the
        # backlog; committed counts, as ``keep`` sees committed rows. The signed body's look
        # reads the kept rows as ``keep`` does, only on a route bound to what is signed ($13).
        # Never on Citus, which has no counts (``Inbox.counted``).
        update, size = self._kept()
        return (
            f"{update} AND (SELECT coalesce(sum(rows), 0) < $11 AND "
            f'coalesce(sum(bytes), 0) + {size} <= $12 FROM {self.quoted[:-1]}{sql.KEPT_COUNTS}" '
            "WHERE scope >= $10::text AND scope < $10::text || '0' "
            f"AND {sql.IN_SCOPE.replace('$1', '$10::text')}) "
            f"AND NOT EXISTS (SELECT FROM {self.quoted} WHERE $13::text IS NOT NULL "
            f"AND {_CAPPED.format(scope='$10')} AND {_SIGNED.format(part='$13::text')})"
        )

    @property
    def keep_signed(self) -> str:
        # $1 the cap's scope, $2 a claim's signed part: before ``keep``, in its own statement,
        # a lock on that body in that cap until the transaction ends. A concurrent keep of the
        # same body (a replay under another ID) waits for this one's COMMIT, then its ``keep``,
        # a statement begun after that, sees the row kept (READ COMMITTED): kept once, not
        # once per delivery failing at that moment. Touches no table (Citus: the coordinator).
        return (
            f"SELECT pg_advisory_xact_lock({sql.KEEP_SIGNED_LOCK_KEY}, "
            "hashtext($1::text || ' ' || $2::text))"
        )

    @property
    def kept_as(self) -> str:
        # $1 the cap's scope, $2 a claim's signed part: the ID a kept row of that cap holds
        # this signed body under (why ``keep`` did not keep it). Locks nothing.
        return (
            f"SELECT event_id FROM {self.quoted} WHERE {_CAPPED.format(scope='$1')} "
            f"AND {_SIGNED.format(part='$2::text')} LIMIT 1"
        )

    @property
    def due(self) -> str:
        # $1 the scopes, $2 how many, $3 past how many, $4 the per-path scopes held (a
        # tenant's Retry-After, ``holds``): the oldest due rows of the others, locking none
        # (``take`` locks one).
        return (
            f"SELECT scope, event_id FROM {self.quoted} WHERE inbox_state = 'pending' "
            f"AND inbox_due <= now() AND {_OURS} AND scope <> ALL($4::text[]) "
            "ORDER BY received_at, event_id LIMIT $2 OFFSET $3"
        )

    @property
    def take_first_free(self) -> str:
        # $1 scopes, $2 event IDs: a page of due rows' keys (``due``, oldest first). The oldest
        # of them no other transaction holds, if it is still due, locked, in one statement:
        # the rows other lanes are redelivering are skipped inside the server, where ``take``
        # is a round trip per row tried. The sort is of the page's rows only. Never on Citus,
        # which runs no FOR UPDATE across shards (``Inbox.take`` uses ``take`` there);
        # tests/test_sql_shapes.py knows.
        return (
            "SELECT scope, event_id, inbox_request, inbox_body, inbox_failures, now() AS taken "
            f"FROM {self.quoted} AS t WHERE (scope, event_id) IN "
            "(SELECT * FROM unnest($1::text[], $2::text[])) "
            "AND inbox_state = 'pending' AND inbox_due <= now() "
            f"AND {_FIRST_OF_OBJECT.format(quoted=self.quoted)} "
            "ORDER BY received_at, event_id LIMIT 1 FOR UPDATE OF t SKIP LOCKED"
        )

    @property
    def take(self) -> str:
        # $1 scope, $2 event ID: the row, locked, if it is still due; a row another lane is
        # redelivering is passed over, not waited on. The transaction's time goes with it, for
        # ``failed``.
        return (
            "SELECT scope, event_id, inbox_request, inbox_body, inbox_failures, now() AS taken "
            f"FROM {self.quoted} AS t WHERE scope = $1 AND event_id = $2 "
            "AND inbox_state = 'pending' AND inbox_due <= now() "
            f"AND {_FIRST_OF_OBJECT.format(quoted=self.quoted)} FOR UPDATE OF t SKIP LOCKED"
        )

    @property
    def make_object(self) -> str:
        # $1 the object's scope (sql.ORDER, "/", the claim's), $2 its key: its row, if it is
        # missing (forgotten); never waits on a committed one.
        return (
            f"INSERT INTO {self.quoted} (scope, event_id, event_type, inbox_changed) "
            "VALUES ($1, $2, 'object', now()) ON CONFLICT (scope, event_id) DO NOTHING"
        )

    @property
    def take_object(self) -> str:
        # The same parameters: the object's row locked for the redelivery; held by a delivery
        # at the app, passed over, not waited on (no row).
        # With the newest version the app accepted (NULL: none).
        return (
            f"SELECT inbox_request ->> 'v' AS accepted FROM {self.quoted} "
            "WHERE scope = $1 AND event_id = $2 FOR UPDATE SKIP LOCKED"
        )

    @property
    def object_at_app(self) -> str:
        # $1 a row's scope, $2 its object's key, $3 its event ID: whether another delivery of
        # that object, handed off, is still at the app (``_AT_APP``). Read after the object's
        # row was locked (``take_object``), in a statement of its own: a hand-off whose keep
        # committed after the take's snapshot, letting go of that lock, is seen here.
        return (
            f"SELECT EXISTS (SELECT FROM {self.quoted} WHERE scope = $1 "
            "AND inbox_state = 'pending' AND inbox_request ->> 'object' = $2 "
            f"AND event_id <> $3 AND {_AT_APP})"
        )

    @property
    def superseded(self) -> str:
        # $1 scope, $2 event ID: a kept delivery older than its object's accepted version, not
        # sent; its request and body stay (an operator may still send it), and its bytes leave
        # the cap (which counts pending and dead rows only).
        return (
            f"UPDATE {self.quoted} SET inbox_state = 'superseded', inbox_due = NULL, "
            "inbox_changed = now() WHERE scope = $1 AND event_id = $2 RETURNING inbox_state"
        )

    @property
    def accepted(self) -> str:
        # $1 the object's scope, $2 its key, $3 the version the app accepted (numeric text).
        return (
            f"UPDATE {self.quoted} SET inbox_request = jsonb_build_object('v', $3::numeric) "
            "WHERE scope = $1 AND event_id = $2 "
            "AND coalesce((inbox_request ->> 'v')::numeric < $3::numeric, true)"
        )

    @property
    def delivered(self) -> str:
        # $1 scope, $2 event ID, $3 status, $4 error (a failure the app's receipt settled), $5
        # what the app answered.
        attempt = _ATTEMPT.format(n=f"{_MADE} + 1", status="$3", error="$4", answer="$5")
        return (
            f"UPDATE {self.quoted} SET inbox_state = 'delivered', inbox_body = NULL, "
            "inbox_request = NULL, inbox_size = NULL, inbox_due = NULL, inbox_changed = now(), "
            f"inbox_attempts = {_APPENDED.format(attempt=attempt)} "
            "WHERE scope = $1 AND event_id = $2"
        )

    @property
    def failed(self) -> str:
        # $1 scope, $2 event ID, $3 status, $4 error, $5 the next attempt's time, $6 dead now
        # (an unfixable answer), $7 the transaction's time (``take``'s ``taken``: now() in this
        # transaction). Dead once a failed attempt is at or past the deadline; the next attempt
        # is never later than the deadline, so the last one is made at it. The times are
        # parameters: Citus runs no function that is not immutable (now(), timestamptz +
        # interval) inside a CASE of an UPDATE. $8 what the app answered, its bytes counted in
        # the row's inbox_size.
        dead = "($6 OR inbox_until <= $7::timestamptz)"
        attempt = _ATTEMPT.format(n=f"{_MADE} + 1", status="$3", error="$4", answer="$8")
        return (
            f"UPDATE {self.quoted} SET inbox_attempts = {_APPENDED.format(attempt=attempt)}, "
            f"inbox_size = {_GROWN.format(attempt=attempt)}, "
            "inbox_failures = inbox_failures + 1, "
            f"inbox_state = CASE WHEN {dead} THEN 'dead' ELSE 'pending' END, "
            f"inbox_due = CASE WHEN {dead} THEN NULL "
            "ELSE least($5::timestamptz, inbox_until) END, "
            f"inbox_changed = CASE WHEN {dead} THEN $7::timestamptz ELSE inbox_changed END "
            "WHERE scope = $1 AND event_id = $2 RETURNING inbox_state"
        )

    @property
    def kept(self) -> str:
        # $1 scope, $2 state, $3 limit.
        return (
            f"SELECT {_LISTED} FROM {self.quoted} "
            f"WHERE {sql.IN_SCOPE} AND inbox_state = $2 ORDER BY received_at LIMIT $3"
        )

    @property
    def kept_count(self) -> str:
        return f"SELECT count(*) FROM {self.quoted} WHERE {sql.IN_SCOPE} AND inbox_state = $2"

    @property
    def show(self) -> str:
        # $1 scope, $2 event ID, $3 how many of the body's first bytes, or NULL for all: a
        # slice is read from its TOAST chunks without the rest (the console's event page reads
        # 64 KiB of a body of 20 MiB), and its whole length beside it.
        return (
            "SELECT scope, event_id, event_type, received_at, inbox_state, inbox_request, "
            "CASE WHEN $3::int IS NULL THEN inbox_body "
            "ELSE substring(inbox_body FROM 1 FOR $3::int) END AS inbox_body, "
            "octet_length(inbox_body) AS body_bytes, inbox_attempts, inbox_due, "
            f"inbox_until, inbox_changed FROM {self.quoted} WHERE scope = $1 AND event_id = $2"
        )

    @property
    def place(self) -> str:
        # $1 scope, $2 event ID, $3 its object's scope, $4 its object: the version the app
        # accepted, and the oldest pending delivery of the object older than this one (the one
        # it is kept behind), with since when. Reads only: never waits on a lock.
        return (
            f"SELECT (SELECT inbox_request ->> 'v' FROM {self.quoted} WHERE scope = $3 "
            "AND event_id = $4) AS accepted, o.event_id AS behind, o.received_at AS since "
            f"FROM (SELECT 1) AS one LEFT JOIN LATERAL (SELECT o.event_id, o.received_at FROM "
            f"{self.quoted} AS o, {self.quoted} AS t WHERE t.scope = $1 AND t.event_id = $2 "
            "AND o.scope = t.scope AND o.inbox_state = 'pending' "
            "AND o.inbox_request ->> 'object' = $4 "
            "AND (o.received_at, o.event_id) < (t.received_at, t.event_id) "
            "ORDER BY o.received_at, o.event_id LIMIT 1) AS o ON true"
        )

    @property
    def redeliver(self) -> str:
        # $1 scope, $2 event IDs, $3 for (seconds): pending, due now, with the route's full
        # schedule again. Waits for a row being redelivered right now (OPERATOR_LOCK_WAIT);
        # passes over a row whose handed-off attempt is still at the app (``_AT_APP``).
        return (
            f"UPDATE {self.quoted} SET {_AGAIN.format(until='$3')} "
            "WHERE scope = $1 AND event_id = ANY($2) AND inbox_state IN ('pending', 'dead') "
            f"AND inbox_body IS NOT NULL AND NOT {_AT_APP} RETURNING scope, event_id"
        )

    @property
    def at_app(self) -> str:
        # $1 scope, $2 event IDs: those whose handed-off attempt is still at the app, and the
        # end of its lease. Locks nothing (why ``redeliver`` passed them over, in words).
        return (
            f"SELECT event_id, inbox_due FROM {self.quoted} "
            f"WHERE scope = $1 AND event_id = ANY($2) AND {_AT_APP}"
        )

    @property
    def selected(self) -> str:
        # $1 scope, $2 state ('dead' or 'pending'), $3 changed since or NULL, $4 again (a
        # redelivery), $5 and $6 the key of the last row of the page before or NULL, $7 how
        # many: a page of the rows a bulk command acts on, in key order (on the primary key,
        # so that a run ends however many rows it passes over). Locks nothing.
        return (
            f"SELECT {_LISTED} FROM {self.quoted} WHERE {sql.IN_SCOPE} "
            f"AND {_SELECTED.format(state='$2', since='$3', again='$4')} "
            "AND ($5::text IS NULL OR (scope, event_id) > ($5::text, $6::text)) "
            "ORDER BY scope, event_id LIMIT $7"
        )

    @property
    def selected_count(self) -> str:
        # $1 scope, $2 state, $3 changed since or NULL, $4 again: how many ``selected`` holds.
        return (
            f"SELECT count(*) FROM {self.quoted} WHERE {sql.IN_SCOPE} "
            f"AND {_SELECTED.format(state='$2', since='$3', again='$4')}"
        )

    @property
    def redeliver_one(self) -> str:
        # $1 scope, $2 event ID, $3 state, $4 changed since or NULL, $5 for (seconds): one row
        # of ``selected``, if it still is. A row being redelivered right now, or whose handed-off
        # attempt is at the app, is passed over: it needs no making due.
        key = "scope = $1 AND event_id = $2"
        return (
            f"UPDATE {self.quoted} SET {_AGAIN.format(until='$5')} WHERE {key} "
            f"AND {_SELECTED.format(state='$3', since='$4', again='true')} AND NOT {_AT_APP} "
            f"AND EXISTS (SELECT FROM {self.quoted} WHERE {key} FOR UPDATE SKIP LOCKED) "
            "RETURNING scope, event_id"
        )

    @property
    def discard_one(self) -> str:
        # $1 scope, $2 event ID, $3 state, $4 changed since or NULL: one row of ``selected``
        # discarded, if it still is. A row being redelivered right now is passed over (a
        # rerun takes it if it is still pending then).
        key = "scope = $1 AND event_id = $2"
        return (
            f"UPDATE {self.quoted} SET {_DISCARDED} WHERE {key} "
            f"AND {_SELECTED.format(state='$3', since='$4', again='false')} AND EXISTS (SELECT "
            f"FROM {self.quoted} WHERE {key} FOR UPDATE SKIP LOCKED) RETURNING scope, event_id"
        )

    @property
    def discard(self) -> str:
        # $1 scope, $2 event IDs. The claim stays (its copies are still duplicates).
        return (
            f"UPDATE {self.quoted} SET {_DISCARDED} WHERE scope = $1 AND event_id = ANY($2) "
            "AND inbox_state IN ('pending', 'dead') "
            "RETURNING event_id"
        )

    @property
    def level(self) -> str:
        # $1 scope.
        return (
            "SELECT count(*) FILTER (WHERE inbox_state = 'pending') AS pending, "
            "coalesce(sum(octet_length(inbox_body)) FILTER (WHERE inbox_state = 'pending'), 0) "
            "AS pending_bytes, count(*) FILTER (WHERE inbox_state = 'dead') AS dead, "
            "extract(epoch FROM now() - min(received_at) FILTER (WHERE inbox_state = 'pending'))"
            "::float8 AS oldest, "
            "extract(epoch FROM now() - min(inbox_due) FILTER (WHERE inbox_state = 'pending'))"
            "::float8 AS overdue, "
            # A dead row's inbox_changed is when it died (until an operator acts on it).
            "extract(epoch FROM now() - min(inbox_changed) FILTER (WHERE inbox_state = 'dead'))"
            f"::float8 AS oldest_dead FROM {self.quoted} "
            f"WHERE {sql.IN_SCOPE} AND inbox_state IN ('pending', 'dead')"
        )

    @property
    def blocked_level(self) -> str:
        # $1 scope: how many objects are blocked, and the age of the oldest head.
        blocked = _BLOCKED.format(quoted=self.quoted, in_scope=sql.IN_SCOPE)
        return (
            "SELECT count(*) AS objects, "
            f"extract(epoch FROM now() - min(since))::float8 AS oldest FROM ({blocked}) AS b"
        )

    @property
    def blocked(self) -> str:
        # $1 scope, $2 a head pending at least this long (seconds), $3 how many: the oldest
        # blocked objects, how many there are in all, and each head's row, found by the
        # received_at index (a head is its object's pending row received at ``since``; of two
        # received at once, the one first in event_id order, as the redeliverer takes them).
        blocked = _BLOCKED.format(quoted=self.quoted, in_scope=sql.IN_SCOPE)
        return (
            "SELECT b.scope, b.object, h.event_id, h.event_type, b.since, "
            f"{_AT_APP} AS at_app, jsonb_array_length(h.inbox_attempts) AS attempts, "
            "(h.inbox_attempts -> -1 ->> 'status')::int AS last_status, "
            "h.inbox_attempts -> -1 ->> 'error' AS last_error, h.inbox_due, b.behind, b.total "
            f"FROM (SELECT *, count(*) OVER () AS total FROM ({blocked}) AS g "
            "WHERE since <= now() - make_interval(secs => $2) "
            "ORDER BY since, scope, object LIMIT $3) AS b "
            f"CROSS JOIN LATERAL (SELECT * FROM {self.quoted} AS h WHERE h.received_at = b.since "
            "AND h.scope = b.scope AND h.inbox_state = 'pending' "
            "AND h.inbox_request ->> 'object' = b.object ORDER BY h.event_id LIMIT 1) AS h "
            "ORDER BY b.since, b.scope, b.object"
        )

    @property
    def sweep_dead(self) -> str:
        # $1 scope, $2 dead retention (seconds), $3 batch. The conditions again on the DELETE
        # itself: under READ COMMITTED a row that changed while the DELETE waited for it (an
        # operator's redeliver) is checked again only against those, not the subquery's.
        dead = "inbox_state = 'dead' AND inbox_changed < now() - make_interval(secs => $2)"
        return (
            f"DELETE FROM {self.quoted} WHERE (scope, event_id) IN ("
            f"  SELECT scope, event_id FROM {self.quoted} WHERE {sql.IN_SCOPE} AND {dead} "
            f"   LIMIT $3) AND {dead}"
        )

    @property
    def sweep_objects(self) -> str:
        # $1 an object scope (sql.ORDER, "/", a route's scope), $2 the route's retention
        # (seconds), $3 batch: the object rows not held since, whose object has no pending or
        # dead delivery (those still need its accepted version, and its turn). A row held now
        # (a delivery at the app, or a redelivery's take) is locked: passed over, not waited
        # on. The age again on the DELETE, as ``sweep_dead``'s.
        idle = "inbox_changed < now() - make_interval(secs => $2)"
        return (
            f"DELETE FROM {self.quoted} WHERE (scope, event_id) IN ("
            f"  SELECT scope, event_id FROM {self.quoted} AS o WHERE {sql.IN_SCOPE} "
            f"   AND event_type = 'object' AND {idle} AND NOT EXISTS (SELECT FROM {self.quoted} "
            f"   AS k WHERE k.scope = substr(o.scope, {len(sql.ORDER) + 2}) "
            "    AND k.inbox_state IN ('pending', 'dead') "
            "    AND k.inbox_request ->> 'object' = o.event_id) "
            f"   LIMIT $3 FOR UPDATE OF o SKIP LOCKED) AND {idle}"
        )

    # The route holds (``database.holds``): a row in scope sql.HOLDS keyed by the scope it
    # holds ($1: a route's, or for the app's Retry-After a per-path one, "route/acme"), its
    # kind in inbox_state, its end in inbox_until (NULL: none), the end asked for in
    # inbox_due, since when in inbox_changed and who and why in inbox_request. The INSERT makes
    # the row (DO NOTHING, as Citus needs); a pause or a resume deletes it first, and the app's
    # Retry-After changes it by an UPDATE on its whole key. Every end is now() + $3 seconds
    # (NULL: no end), outside any CASE.

    @property
    def hold_row(self) -> str:
        # $1 route scope, $2 kind, $3 seconds or NULL, $4 who and why (jsonb): the hold, if the
        # scope has no row yet; "INSERT 0 1" if it had none.
        end = "now() + make_interval(secs => $3::float8)"
        return (
            f"INSERT INTO {self.quoted} (scope, event_id, event_type, inbox_state, inbox_until, "
            f"inbox_due, inbox_changed, inbox_request) VALUES ('{sql.HOLDS}', $1, 'hold', $2, "
            f"{end}, {end}, now(), $4::jsonb) ON CONFLICT (scope, event_id) DO NOTHING"
        )

    @property
    def unhold_one(self) -> str:
        # $1 route scope: the row gone (an operator's pause replaces it, a resume ends it, with
        # the grants every role has: no UPDATE); its kind, and whether it held still.
        return (
            f"DELETE FROM {self.quoted} WHERE scope = '{sql.HOLDS}' AND event_id = $1 "
            "RETURNING inbox_state, (inbox_until IS NULL OR inbox_until > now()) AS held"
        )

    @property
    def renew_hold_one(self) -> str:
        # The same parameters, $3 never NULL: the hold, from now, if the row's has ended.
        end = "now() + make_interval(secs => $3::float8)"
        return (
            f"UPDATE {self.quoted} SET inbox_state = $2, inbox_until = {end}, inbox_due = {end}, "
            f"inbox_changed = now(), inbox_request = $4::jsonb WHERE scope = '{sql.HOLDS}' "
            "AND event_id = $1 AND inbox_until <= now()"
        )

    @property
    def extend_hold_one(self) -> str:
        # The same parameters: a hold of the same kind ($2) that ends sooner ends then instead,
        # since when it holds unchanged. A pause is never made shorter nor another kind.
        end = "now() + make_interval(secs => $3::float8)"
        return (
            f"UPDATE {self.quoted} SET inbox_until = {end}, inbox_due = {end}, "
            f"inbox_request = $4::jsonb WHERE scope = '{sql.HOLDS}' AND event_id = $1 "
            f"AND inbox_state = $2 AND inbox_until < {end}"
        )

    @property
    def holds(self) -> str:
        # $1 scopes, or NULL for all: the holds in force of these and of their per-path scopes
        # (a route's: "hooks/acme" of "hooks"), their times as seconds from now
        # (the database's clock: each proxy adds them to its own).
        return (
            "SELECT event_id AS scope, inbox_state AS kind, inbox_request AS request, "
            "extract(epoch FROM inbox_until - now())::float8 AS ends_in, "
            "extract(epoch FROM inbox_due - now())::float8 AS asked_in, "
            "extract(epoch FROM now() - inbox_changed)::float8 AS held_for "
            f"FROM {self.quoted} WHERE scope = '{sql.HOLDS}' "
            "AND ($1::text[] IS NULL OR event_id = ANY($1::text[]) "
            "OR split_part(event_id, '/', 1) = ANY($1::text[])) "
            "AND (inbox_until IS NULL OR inbox_until > now())"
        )

    @property
    def sweep_path_holds(self) -> str:
        # $1 route scope: the rows of its per-path scopes' holds (a tenant's Retry-After) that
        # ended, deleted: a tenant's row stays only while it holds, so that the rows any path
        # value the app answered with Retry-After leaves behind do not pile up.
        return (
            f"DELETE FROM {self.quoted} WHERE scope = '{sql.HOLDS}' "
            "AND split_part(event_id, '/', 1) = $1 AND position('/' in event_id) > 0 "
            "AND inbox_until <= now()"
        )

    @property
    def unhold_paths(self) -> str:
        # $1 route scope: the holds of its per-path scopes gone (an operator's resume).
        return (
            f"DELETE FROM {self.quoted} WHERE scope = '{sql.HOLDS}' "
            "AND split_part(event_id, '/', 1) = $1 AND position('/' in event_id) > 0 "
            "RETURNING event_id, (inbox_until IS NULL OR inbox_until > now()) AS held"
        )

    # The operator console's reads (``Inbox.browse``, ``hour``, ``lookup``). Lock nothing.

    @property
    def hour(self) -> str:
        # $1 scope: the claims received in the last hour, by what became of them (the
        # received_at index's range).
        return (
            "SELECT count(*) AS received, "
            "count(*) FILTER (WHERE inbox_state IS NULL) AS first_try, "
            "count(*) FILTER (WHERE inbox_state = 'delivered') AS redelivered, "
            "count(*) FILTER (WHERE inbox_state = 'pending') AS pending, "
            "count(*) FILTER (WHERE inbox_state = 'dead') AS dead, "
            "count(*) FILTER (WHERE inbox_state = 'discarded') AS discarded "
            f"FROM {self.quoted} WHERE {sql.IN_SCOPE} "
            "AND received_at > now() - interval '1 hour'"
        )

    def browse(self, criteria: Criteria) -> tuple[str, list[object]]:
        """The kept rows ``criteria`` select, newest first, past its cursor (keyset paging
        on (received_at, event_id)): the statement and its parameters. Only the conditions
        asked for are in it, so that each shape gets a plan of its own."""
        args: list[object] = []

        def param(value: object, cast: str = "") -> str:
            args.append(value)
            return f"${len(args)}{cast}"

        where = _kept_where(criteria, param)
        if criteria.after is not None:
            at, event_id = criteria.after
            where.append(
                f"(received_at, event_id) < ({param(at, '::timestamptz')}, "
                f"{param(event_id, '::text')})"
            )
        statement = (
            "SELECT scope, event_id, event_type, received_at, inbox_state, "
            f"coalesce({_MADE}, 0), inbox_due, "
            "octet_length(inbox_body), (inbox_attempts -> -1 ->> 'status')::int, "
            f"inbox_attempts -> -1 ->> 'error' FROM {self.quoted} "
            f"WHERE {' AND '.join(where)} ORDER BY received_at DESC, event_id DESC "
            f"LIMIT {param(criteria.limit, '::int')}"
        )
        return statement, args

    def count(self, criteria: Criteria, most: int) -> tuple[str, list[object]]:
        """How many kept rows ``criteria`` select (its cursor and limit aside), counted up to
        ``most`` + 1 at most: the statement and its parameters. Not with a body filter, whose
        JSON path only ``body_match`` checks, row by row."""
        assert criteria.body_bytes is None
        args: list[object] = []

        def param(value: object, cast: str = "") -> str:
            args.append(value)
            return f"${len(args)}{cast}"

        where = " AND ".join(_kept_where(criteria, param))
        statement = (
            f"SELECT count(*) FROM (SELECT FROM {self.quoted} WHERE {where} "
            f"LIMIT {param(most + 1, '::int')}) AS counted"
        )
        return statement, args

    @property
    def body_match(self) -> str:
        # $1 scopes, $2 event IDs (rows ``browse`` found holding the value's bytes), $3 a JSON
        # path (object keys, or list indexes in digits), $4 the value: the keys of those rows
        # whose body is JSON with a string equal to the value at the path, or a number,
        # boolean or null spelled as it. Parsed by the server: no body reaches the proxy. A
        # body that does not start as JSON does ('{' or '[' past whitespace) is passed over
        # unparsed; one that starts so but is not JSON, or not UTF-8, fails the statement
        # (SQLSTATE class 22: ``Inbox.browse`` then asks row by row). Only keys of these scopes
        # and IDs are read (``event_id = ANY``: on Citus, the shards of these IDs).
        node = "convert_from(inbox_body, 'UTF8')::jsonb #> $3::text[]"
        start = (
            "substring(ltrim(substring(inbox_body FROM 1 FOR 4096), decode('20090a0d', 'hex')) "
            "FROM 1 FOR 1) IN (decode('7b', 'hex'), decode('5b', 'hex'))"
        )
        return (
            f"SELECT scope, event_id FROM {self.quoted} WHERE event_id = ANY($2::text[]) "
            f"AND scope = ANY($1::text[]) AND CASE WHEN {start} THEN (SELECT coalesce("
            "CASE jsonb_typeof(node) WHEN 'string' THEN node #>> '{}' = $4::text "
            "WHEN 'object' THEN false WHEN 'array' THEN false ELSE node::text = $4::text END, "
            f"false) FROM (SELECT {node} AS node) AS found) ELSE false END"
        )

    @property
    def lookup(self) -> str:
        # $1 the routes' scopes, $2 an ID as the provider sent it: its claims in those scopes,
        # as stored or bound to a body ("$2~" and the digest), by the primary key.
        return (
            "SELECT scope, event_id, event_type, received_at, inbox_state "
            f"FROM {self.quoted} WHERE scope = ANY($1::text[]) AND {_NAMED} "
            "ORDER BY received_at DESC LIMIT 50"
        )

    @property
    def lookup_last_part(self) -> str:
        # $1 the scopes of routes whose ID is composite, $2 the last part of such an ID as the
        # provider shows it (GitHub's GUID without its hook ID): its claims in those scopes,
        # by the last part's index (sql's last_part_idx).
        return (
            "SELECT scope, event_id, event_type, received_at, inbox_state "
            f"FROM {self.quoted} WHERE scope = ANY($1::text[]) AND {sql.last_part_named('$2')} "
            "ORDER BY received_at DESC LIMIT 50"
        )

    @property
    def lookup_scoped(self) -> str:
        # $1 the scopes of routes with per-path (or per-client) scopes, $2 an ID: its claims in
        # their per-path scopes. Their names are not known ahead, so this reads the table.
        return (
            "SELECT scope, event_id, event_type, received_at, inbox_state "
            f"FROM {self.quoted} WHERE split_part(scope, '/', 1) = ANY($1::text[]) "
            f"AND position('/' in scope) > 0 AND ({_NAMED} OR (split_part(scope, '/', 1) = "
            f"ANY($3::text[]) AND {sql.last_part_named('$4')})) ORDER BY received_at DESC LIMIT 50"
        )


def _kept_where(criteria: Criteria, param: Callable[[object, str], str]) -> list[str]:
    """The conditions of ``criteria`` (its cursor aside) on the kept rows, for ``browse`` and
    ``count`` alike."""
    # Read by the kept rows' own index (sql's kept index), as its predicate says.
    where = ["inbox_state IS NOT NULL"]
    # Only the configured routes' rows: not another deployment's on a shared table, nor the
    # reserved scopes' ("~holds").
    where.append(f"split_part(scope, '/', 1) = ANY({param(list(criteria.scopes), '::text[]')})")
    if criteria.scope is not None:
        where.append(sql.IN_SCOPE.replace("$1", param(criteria.scope, "::text")))
    if criteria.states and criteria.body_bytes is None:
        # With a body filter, ``Inbox.browse`` checks the state of the rows it walks: a state
        # here steers the plan to every pending and dead row's body at each batch (the inbox's
        # index), not the newest ``BROWSE_SCAN`` rows' by the kept index.
        where.append(f"inbox_state = ANY({param(list(criteria.states), '::text[]')})")
    if criteria.since is not None:
        where.append(f"received_at >= {param(criteria.since, '::timestamptz')}")
    if criteria.until is not None:
        where.append(f"received_at < {param(criteria.until, '::timestamptz')}")
    if criteria.event_id is not None:
        where.append(_named_by(criteria.event_id, criteria.composite, param))
    if criteria.event_type is not None:
        where.append(f"event_type = {param(criteria.event_type, '::text')}")
    if criteria.body_bytes is not None:
        # The value's bytes somewhere in the body: the JSON path is checked on the rows
        # this finds by ``body_match``, in the server too (``Inbox.browse``).
        where.append(f"position({param(criteria.body_bytes, '::bytea')} in inbox_body) > 0")
    return where


# $2 an ID as an operator gave it: that row, and its rows bound to a body (``sql``'s resolve).
_NAMED = (
    f"(event_id = $2 OR (event_id >= $2 || '~' AND event_id <= $2 || '~{'f' * sql.BOUND_DIGITS}' "
    "AND left(event_id, length($2) + 1) = $2 || '~'))"
)


def _named_by(given: str, composite: tuple[str, ...], param: Callable[[object, str], str]) -> str:
    """``browse``'s condition that a row is the claim of ``given``: as stored or bound to a
    body, and in the scopes of ``composite``, as the last part of a composite ID."""
    value = param(given, "::text")
    named = (
        f"event_id = {value} OR (left(event_id, length({value}) + 1) = {value} || '~' "
        f"AND length(event_id) = length({value}) + {1 + sql.BOUND_DIGITS})"
    )
    if composite and ":" not in given:
        # The last part of a composite ID, as the provider shows it (GitHub's GUID).
        part = param(given.replace("%", "%25"), "::text")
        scopes = param(list(composite), "::text[]")
        named += f" OR (split_part(scope, '/', 1) = ANY({scopes}) AND {sql.last_part_named(part)})"
    return f"({named})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Criteria:
    """What the console's kept deliveries are filtered by (None: any), its page size and
    cursor: the (received_at, event_id) of the last row of the page before."""

    scope: str | None = None
    states: tuple[str, ...] = ()  # any of these (none: any state)
    since: datetime | None = None
    until: datetime | None = None
    event_id: str | None = None
    event_type: str | None = None
    # The configured routes' scopes: only their rows (and their per-path ones) are shown.
    scopes: tuple[str, ...] = ()
    # The scopes of routes whose ID is composite: there, event_id may be its last part alone.
    composite: tuple[str, ...] = ()
    body_bytes: bytes | None = None  # the body holds these bytes (``Inbox.browse``)
    after: tuple[datetime, str] | None = None
    limit: int = 50
