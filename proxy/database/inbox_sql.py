"""The inbox's statements (``database.inbox``), built once per claim table: keeping a failed
delivery in its claim's row under the route's cap, taking a due row ``FOR UPDATE SKIP LOCKED``,
the two ends of a redelivery, the operators' commands, the metrics' levels and the dead rows'
sweep. Every value is a parameter; the columns are added by the claim table's DDL (``sql``).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.database import sql

# $1: the scopes of the routes this proxy redelivers for; a route's per-path scopes are its
# own ("scope/acme"). Another deployment's rows in a shared table are not its to send.
_OURS = "split_part(scope, '/', 1) = ANY($1::text[])"
# Back to pending, due now, with the route's whole schedule and ``for`` again.
_AGAIN = (
    "inbox_state = 'pending', inbox_due = now(), inbox_until = now() + make_interval(secs => "
    "{until}), inbox_failures = 0, inbox_changed = now()"
)
_ATTEMPT = "jsonb_build_object('at', now(), 'status', {status}::int, 'error', {error}::text)"


@dataclass(frozen=True, slots=True)
class Statements:
    """The inbox's statements over one claim table (``quoted``)."""

    quoted: str

    @property
    def queue(self) -> str:
        # $1 scope, $2 event ID, $3 state, $4 request, $5 body, $6 status, $7 error, $8 delay,
        # $9 until, $10 base scope, $11 max count, $12 max bytes. Under the cap only: the kept
        # rows of the route (pending and dead: both hold bodies), this one's body counted.
        # Concurrent failures each see the others' uncommitted rows as absent, so the cap can
        # be passed by the deliveries failing at that moment (at most the pool's size).
        return (
            f"UPDATE {self.quoted} SET inbox_state = $3, inbox_request = $4::jsonb, "
            "inbox_body = $5::bytea, inbox_attempts = jsonb_build_array("
            + _ATTEMPT.format(status="$6", error="$7")
            + "), inbox_failures = 1, "
            "inbox_due = CASE WHEN $3 = 'pending' THEN now() + make_interval(secs => $8) END, "
            "inbox_until = now() + make_interval(secs => $9), inbox_changed = now() "
            "WHERE scope = $1 AND event_id = $2 AND (SELECT count(*) < $11 AND "
            "coalesce(sum(octet_length(inbox_body)), 0) + octet_length($5::bytea) <= $12 "
            f"FROM {self.quoted} WHERE {sql.IN_SCOPE.replace('$1', '$10')} "
            "AND inbox_state IN ('pending', 'dead'))"
        )

    @property
    def due(self) -> str:
        return (
            f"SELECT FROM {self.quoted} WHERE inbox_state = 'pending' AND inbox_due <= now() "
            f"AND {_OURS} LIMIT 1"
        )

    @property
    def take(self) -> str:
        # Oldest first; a row another replica is redelivering is passed over, not waited on.
        return (
            f"SELECT scope, event_id, inbox_request, inbox_body, inbox_failures "
            f"FROM {self.quoted} WHERE inbox_state = 'pending' AND inbox_due <= now() "
            f"AND {_OURS} ORDER BY received_at LIMIT 1 FOR UPDATE SKIP LOCKED"
        )

    @property
    def delivered(self) -> str:
        # $1 scope, $2 event ID, $3 status.
        return (
            f"UPDATE {self.quoted} SET inbox_state = 'delivered', inbox_body = NULL, "
            "inbox_request = NULL, inbox_due = NULL, inbox_changed = now(), "
            "inbox_attempts = inbox_attempts || "
            + _ATTEMPT.format(status="$3", error="NULL")
            + " WHERE scope = $1 AND event_id = $2"
        )

    @property
    def failed(self) -> str:
        # $1 scope, $2 event ID, $3 status, $4 error, $5 delay, $6 dead now (an unfixable
        # answer). Dead once a failed attempt is at or past the deadline; the next attempt is
        # never later than the deadline, so the last one is made at it.
        dead = "($6 OR inbox_until <= now())"
        return (
            f"UPDATE {self.quoted} SET inbox_attempts = inbox_attempts || "
            + _ATTEMPT.format(status="$3", error="$4")
            + ", inbox_failures = inbox_failures + 1, "
            f"inbox_state = CASE WHEN {dead} THEN 'dead' ELSE 'pending' END, "
            f"inbox_due = CASE WHEN {dead} THEN NULL "
            "ELSE least(now() + make_interval(secs => $5), inbox_until) END, "
            f"inbox_changed = CASE WHEN {dead} THEN now() ELSE inbox_changed END "
            "WHERE scope = $1 AND event_id = $2 RETURNING inbox_state"
        )

    @property
    def kept(self) -> str:
        # $1 scope, $2 state, $3 limit.
        return (
            "SELECT scope, event_id, event_type, received_at, inbox_state, "
            "jsonb_array_length(inbox_attempts), inbox_due, octet_length(inbox_body), "
            "(inbox_attempts -> -1 ->> 'status')::int, "
            f"inbox_attempts -> -1 ->> 'error' FROM {self.quoted} "
            f"WHERE {sql.IN_SCOPE} AND inbox_state = $2 ORDER BY received_at LIMIT $3"
        )

    @property
    def kept_count(self) -> str:
        return f"SELECT count(*) FROM {self.quoted} WHERE {sql.IN_SCOPE} AND inbox_state = $2"

    @property
    def show(self) -> str:
        # $1 scope, $2 event ID.
        return (
            "SELECT scope, event_id, event_type, received_at, inbox_state, inbox_request, "
            "inbox_body, octet_length(inbox_body) AS body_bytes, inbox_attempts, inbox_due, "
            f"inbox_until, inbox_changed FROM {self.quoted} WHERE scope = $1 AND event_id = $2"
        )

    @property
    def redeliver(self) -> str:
        # $1 scope, $2 event IDs, $3 for (seconds): pending, due now, with the route's full
        # schedule again. Waits for a row being redelivered right now (OPERATOR_LOCK_WAIT).
        return (
            f"UPDATE {self.quoted} SET {_AGAIN.format(until='$3')} "
            "WHERE scope = $1 AND event_id = ANY($2) AND inbox_state IN ('pending', 'dead') "
            "AND inbox_body IS NOT NULL RETURNING scope, event_id"
        )

    @property
    def redeliver_all(self) -> str:
        # $1 scope, $2 state ('dead' or 'pending'), $3 changed since or NULL, $4 for (seconds).
        # A row being redelivered right now is passed over: it needs no making due.
        rows = (
            f"{sql.IN_SCOPE} AND inbox_state = $2::text AND inbox_body IS NOT NULL "
            "AND ($3::timestamptz IS NULL OR inbox_changed >= $3)"
        )
        return (
            f"UPDATE {self.quoted} SET {_AGAIN.format(until='$4')} WHERE (scope, event_id) IN "
            f"(SELECT scope, event_id FROM {self.quoted} WHERE {rows} FOR UPDATE SKIP LOCKED) "
            f"AND inbox_state = $2::text RETURNING scope, event_id"
        )

    @property
    def discard(self) -> str:
        # $1 scope, $2 event IDs. The claim stays (its copies are still duplicates).
        return (
            f"UPDATE {self.quoted} SET inbox_state = 'discarded', inbox_body = NULL, "
            "inbox_request = NULL, inbox_due = NULL, inbox_changed = now() "
            "WHERE scope = $1 AND event_id = ANY($2) AND inbox_state IN ('pending', 'dead') "
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
            f"::float8 AS overdue FROM {self.quoted} "
            f"WHERE {sql.IN_SCOPE} AND inbox_state IN ('pending', 'dead')"
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
