"""The inbox: deliveries the app failed, kept in their claim's row and redelivered through it.

A route with ``redeliver`` does not roll its claim back when the app fails: ``Claim.keep``
stores the delivery in the claim's row (state *pending*, or *dead* for an answer retrying cannot
fix) in the claim's own transaction, and commits it. The row is the claim, so every copy of the
event is a duplicate from then on. ``Inbox.take`` then hands a due row to the redeliverer
holding its row lock (``FOR UPDATE SKIP LOCKED``: never one row to two replicas at once), and
the redelivery ends with one named step, in the same transaction: ``delivered`` (state
*delivered*, the body dropped) or ``failed`` (the attempt recorded, the next one scheduled, or
*dead* past the route's ``for``). A redelivery whose process dies rolls back, so the row is due
again, as it was.

The states (``inbox_state``): NULL, delivered at the first try; ``pending``; ``dead``;
``delivered`` (by the redeliverer); ``discarded`` (by an operator). Pending and dead rows hold
their bodies and are never removed by the retention sweep; dead rows have their own retention,
counted from ``inbox_changed``. Delivered and discarded rows keep only their attempts: the
stored request (headers and body: a customer's data) is dropped as soon as it is not needed.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import decimal
import enum
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from proxy import errors
from proxy.database import inbox_sql, pool, slots, sql

log = logging.getLogger(__name__)


class InboxState(enum.StrEnum):
    """A kept delivery\'s state, as ``inbox_state`` holds it (NULL: delivered at the first try;
    see the module\'s docstring)."""

    PENDING = "pending"
    DEAD = "dead"
    DELIVERED = "delivered"
    DISCARDED = "discarded"
    SUPERSEDED = "superseded"  # older than its object's accepted version: never forwarded


COLUMNS = sql.INBOX_COLUMNS
GRANT_HINT = f"GRANT UPDATE ({', '.join(COLUMNS)})"
# An operator's redeliver or discard waits at most this for a row being redelivered now.
OPERATOR_LOCK_WAIT = 5.0
# How many of the oldest due rows a take reads at a time, to lock one of them (Inbox.take).
CANDIDATES = 32
# How many rows an operator's bulk command changes in one transaction (Inbox.redeliver_batch).
BATCH = 500


OUTDATED = (
    "the claim table does not exist yet, or an earlier release made it without some of the "
    "inbox's columns: run 'dedup-proxy migrate' "
    "(or start the proxy with a route that redelivers, with create_schema: true)"
)


@contextlib.contextmanager
def plainly(what: str, outdated: str = OUTDATED) -> Iterator[None]:
    """An operator's query on a table without the inbox's columns says what to do about it
    (``outdated``)."""
    try:
        with pool.translated(what):
            yield
    except errors.TableMissing as exc:
        raise errors.TableMissing(outdated) from exc.__cause__


class KeptFor(enum.StrEnum):
    """Why a delivery was kept: the app failed it, or it was kept before its attempt ended (the
    others). The one set of these words: ``dedup_inbox_kept_total``'s reasons
    (``metrics.KEPT_REASONS``: every one but ``HANDED_OFF``, counted as ``DEADLINE``) and a kept
    row's ``StoredRequest.kept_for`` (every one but ``FAILED``: a failed attempt is recorded)."""

    FAILED = "failed"
    LIMIT = "limit"
    DEADLINE = "deadline"
    PAUSED = "paused"
    RETRY_AFTER = "retry_after"
    ORDERING = "ordering"
    HANDED_OFF = "handed_off"


# Why a delivery was kept before its attempt at the app ended (``StoredRequest.kept_for``), in the
# words the refusal, ``events show`` and the console use. A delivery the app failed has its
# attempt recorded instead.
KEPT_UNSENT: dict[str, str] = {
    KeptFor.LIMIT: "not sent: the limit at the app was reached (upstream.concurrency)",
    KeptFor.DEADLINE: "not sent: the route's hand_off had passed before the app could be sent it",
    KeptFor.PAUSED: "not sent: the route is paused",
    KeptFor.RETRY_AFTER: "not sent: the app asked to wait (Retry-After)",
    KeptFor.HANDED_OFF: "handed off: the app had not answered by the route's hand_off, the "
    "provider was answered 202 and the attempt went on",
    KeptFor.ORDERING: "not sent: another delivery of its object was at the app, or kept before "
    "it (order)",
}


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """A delivery to keep: what the app is sent, as it was first sent (its headers filtered
    for the upstream already), and which route's settings redeliver it; ``kept_for``: why it
    was kept without being sent (a key of ``KEPT_UNSENT``), None when the app failed it.
    Stored in the request's JSON, where a release that does not know it passes over it."""

    route: str
    upstream: str
    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    kept_for: str | None = None
    # On a route with ``order``: the object it is about (its kept deliveries are sent one at a
    # time, oldest first), its version (None: none), and whether its type is one the route
    # supersedes (then it is not sent once older than its object's accepted version).
    object: str | None = None
    version: str | None = None
    supersedes: bool = False

    def kept_because(self, tried: bool) -> str | None:
        """Why it was kept before its attempt ended, in words (None: the app failed it);
        ``tried``: it has been sent since, so the words are as of when it was kept."""
        if self.kept_for is None:
            return None
        why = KEPT_UNSENT.get(self.kept_for, self.kept_for)
        return why + (" (when it was kept; tried since: the attempts below)" if tried else "")

    def encoded(self) -> str:
        """As JSON. The target and header values may hold bytes that are not UTF-8 (obs-text,
        decoded as surrogate escapes, and sent as those bytes): such a string is kept as its
        bytes in base64, since JSON (and jsonb) can hold no lone surrogate."""
        return json.dumps(
            {"route": self.route, "upstream": self.upstream, "method": self.method,
             "target": wire(self.target),
             "headers": [(name, wire(value)) for name, value in self.headers],
             **({} if self.kept_for is None else {"kept_for": self.kept_for}),
             **({} if self.object is None else {"object": self.object,
                                                "version": self.version}),
             **({"supersede": True} if self.supersedes else {})},
            ensure_ascii=False, separators=(",", ":"),
        )  # fmt: skip

    @classmethod
    def decoded(cls, request: str | dict[str, Any], body: bytes) -> StoredRequest:
        fields = json.loads(request) if isinstance(request, str) else request
        return cls(
            fields["route"], fields["upstream"], fields["method"], _unwire(fields["target"]),
            tuple((name, _unwire(value)) for name, value in fields["headers"]), body,
            fields.get("kept_for"), fields.get("object"), fields.get("version"),
            bool(fields.get("supersede")),
        )  # fmt: skip


def object_scope(scope: str) -> str:
    """The scope of the object rows of an ordered route's claims in ``scope``."""
    return f"{sql.ORDER}/{scope}"


def wire(text: str) -> str | dict[str, str]:
    """``text`` as JSON can hold it: itself, or ``{"base64": …}`` of its bytes when it holds
    bytes that are not UTF-8 (surrogate escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape")
        return {"base64": base64.b64encode(raw).decode("ascii")}
    return text


def _unwire(value: str | dict[str, str]) -> str:
    if isinstance(value, dict):
        return base64.b64decode(value["base64"]).decode("utf-8", "surrogateescape")
    return value


# What an attempt keeps of the app's answer, counted with its row in the inbox's byte cap
# (``max_pending_bytes``): the first ``ATTEMPT_BODY`` bytes of its body, as text; its
# Content-Type and Retry-After first, then its other headers, ``ATTEMPT_HEADERS`` at most in
# all, each value cut at ``ATTEMPT_HEADER_VALUE`` characters; never a cookie it sets.
ATTEMPT_BODY = 2048
ATTEMPT_HEADERS = 10
ATTEMPT_HEADER_VALUE = 256
_ATTEMPT_FIRST = ("content-type", "retry-after")
_ATTEMPT_UNKEPT = frozenset({"set-cookie", "set-cookie2"})
ATTEMPTS_KEPT = inbox_sql.ATTEMPTS_KEPT


@dataclass(frozen=True, slots=True)
class Attempt:
    """One failed or successful try: the app's status (None: no answer) and what went wrong
    (the proxy's own words: a timeout, a refused or reset connection); how long it took
    (``ms``), and what the app answered, bounded (``answered``)."""

    status: int | None
    error: str | None = None
    ms: float | None = None
    headers: tuple[tuple[str, str], ...] = ()
    body: str | None = None  # its first ATTEMPT_BODY bytes, decoded (U+FFFD for the others)
    body_bytes: int | None = None  # the whole body's length

    @classmethod
    def answered(
        cls,
        status: int | None,
        error: str | None,
        seconds: float | None,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes | None = None,
    ) -> Attempt:
        """An attempt with what it keeps of the app's answer (``headers``, ``body``: None
        when no answer came through)."""
        fields = [(name, value) for name, value in headers if name.lower() not in _ATTEMPT_UNKEPT]
        first = sorted(
            (f for f in fields if f[0].lower() in _ATTEMPT_FIRST),
            key=lambda f: _ATTEMPT_FIRST.index(f[0].lower()),
        )
        kept = first + [f for f in fields if f[0].lower() not in _ATTEMPT_FIRST]
        return cls(
            status,
            error,
            None if seconds is None else round(seconds * 1000, 1),
            tuple(
                (
                    _readable(name.encode("utf-8", "surrogateescape")[:ATTEMPT_HEADER_VALUE]),
                    _readable(value.encode("utf-8", "surrogateescape")[:ATTEMPT_HEADER_VALUE]),
                )
                for name, value in kept[:ATTEMPT_HEADERS]
            ),
            None if not body else _readable(body[:ATTEMPT_BODY]),
            None if body is None else len(body),
        )

    def answer(self) -> str | None:
        """What it keeps beside its status and error, as the JSON its record in the row is
        merged with (None: nothing)."""
        fields = {
            "ms": self.ms,
            "headers": [list(h) for h in self.headers] or None,
            "body": self.body,
            "body_bytes": self.body_bytes,
        }
        kept = {name: value for name, value in fields.items() if value is not None}
        return json.dumps(kept, ensure_ascii=False, separators=(",", ":")) if kept else None


def _readable(raw: bytes) -> str:
    """Bytes of the app's as text a row holds: UTF-8, each byte that is not as U+FFFD, and NUL
    too (jsonb holds none)."""
    return raw.decode("utf-8", "replace").replace("\x00", "\ufffd")


@dataclass(frozen=True, slots=True, kw_only=True)
class KeepPolicy:
    """How ``Claim.keep`` keeps a failed first delivery: the first wait, the deadline, the
    cap and the scope whose kept rows it counts (``cap_scope``, with its per-path ones: the
    route's, or on a route with per-tenant secrets the tenant's), whether the answer was one
    retrying cannot fix (dead at once), and, on a route whose claims are bound to what is
    signed, the claim ID's signed part (``signed``: a body kept once per cap, a replay of it
    under another ID is not kept again)."""

    delay: float
    until: float
    max_pending: int
    max_pending_bytes: int
    cap_scope: str
    dead: bool
    signed: str | None = None
    # False: kept before its attempt ended (not sent, or handed off): no attempt recorded.
    attempted: bool = True


class Listed(NamedTuple):
    """A pending or dead row, as ``events pending``/``dead`` list it."""

    scope: str
    event_id: str
    event_type: str | None
    received_at: datetime
    state: str
    attempts: int  # every try, the first delivery's included
    due: datetime | None
    body_bytes: int | None
    last_status: int | None
    last_error: str | None


class Key(NamedTuple):
    """A row's primary key."""

    scope: str
    event_id: str


@dataclass(frozen=True, slots=True)
class Selection:
    """The rows an operator's bulk command acts on (``events redeliver``/``discard`` with
    ``--dead`` or ``--pending``): ``scope``'s, its per-path ones included, in ``state``, changed
    at or after ``since``, with their bodies. For a redelivery (``again``), not the pending rows
    an operator made due and the redeliverer has not tried since: so the rows a run changed no
    longer match, and a rerun after an interrupted one continues with what is left."""

    scope: str
    state: InboxState
    since: datetime | None
    again: bool

    def arguments(self) -> tuple[object, ...]:
        return (self.scope, self.state.value, self.since, self.again)


class Shown(NamedTuple):
    """Everything stored about one event, for ``events show``."""

    scope: str
    event_id: str
    event_type: str | None
    received_at: datetime
    state: str | None
    request: StoredRequest | None  # None once dropped (delivered, discarded)
    body_bytes: int | None
    attempts: list[dict[str, Any]]
    due: datetime | None
    until: datetime | None
    changed: datetime | None
    place: Place | None = None  # on an ordered route: its object's queue

    def reason(self, when: Callable[[datetime | None], str]) -> str | None:
        """Why it is pending or dead now, in words (None in any other state), its times as
        ``when`` writes them: the last attempt's failure; for a dead row, what made it so; for
        one not tried yet, why it was kept (``StoredRequest.kept_because``)."""
        last = self.attempts[-1] if self.attempts else None
        if self.state == InboxState.DEAD:
            if last is None:
                return None
            if self.until is not None and self.changed is not None and self.changed >= self.until:
                return f"tried until {when(self.until)} (redeliver.for); the last attempt: " + (
                    attempt_words(last)
                )
            return f"{attempt_words(last)}: retrying cannot fix it"
        if self.state != InboxState.PENDING:
            return None
        if last is not None:
            return f"attempt {last.get('n') or len(self.attempts)} failed: {attempt_words(last)}"
        return None if self.request is None else self.request.kept_because(False)


def attempt_words(attempt: dict[str, Any]) -> str:
    """A recorded attempt in words: what the app answered, or the proxy's error where no answer
    came, and how long it took."""
    status, error, ms = attempt.get("status"), attempt.get("error"), attempt.get("ms")
    if status is None:
        words = "no answer" + (f": {error}" if error else "")
    else:
        words = f"the app answered {status}" + (f" ({error})" if error else "")
    return words + (f" after {ms:g} ms" if isinstance(ms, int | float) else "")


class Place(NamedTuple):
    """A kept delivery's object (an ordered route's): its version, the newest the app
    accepted, and the older pending delivery it is kept behind (None: it is its object's
    first), which holds the object in the queue."""

    object: str
    version: str | None
    accepted: str | None
    behind: str | None
    behind_since: datetime | None


class Level(NamedTuple):
    """A route's inbox, for the metrics."""

    pending: int
    pending_bytes: int
    dead: int
    oldest_pending: float | None  # seconds since the oldest pending event was received
    most_overdue: float | None  # seconds the most overdue pending row is past its due time
    oldest_dead: float | None  # seconds since the oldest dead row became dead


class Blocked(NamedTuple):
    """An ordered route's blocked object: its oldest pending delivery (its head) holds later
    ones of it behind (``events blocked``, the console's overview)."""

    scope: str
    object: str
    head: str  # the head's event ID, as stored
    event_type: str | None
    since: datetime  # when the head was received
    at_app: bool  # handed off, its first attempt still at the app
    attempts: int
    last_status: int | None
    last_error: str | None
    due: datetime | None  # the head's next attempt
    behind: int  # its object's pending deliveries after it


class BlockedLevel(NamedTuple):
    """A route's blocked objects, for the metrics: how many, and the oldest head's age."""

    objects: int
    oldest: float | None


class Hour(NamedTuple):
    """A route's claims received in the last hour, by what became of them (the console)."""

    received: int
    first_try: int  # delivered at the first try
    redelivered: int
    pending: int
    dead: int
    discarded: int


class Found(NamedTuple):
    """A claim of an ID as the provider sent it, on some route (the console's lookup)."""

    scope: str
    event_id: str
    event_type: str | None
    received_at: datetime
    state: str | None  # None: delivered at the first try


Criteria = inbox_sql.Criteria
# The console's body filter checks at most this many rows holding the value's bytes per page,
# each one's JSON path read by the server (``Statements.body_match``): past it, the page ends
# early and the next one goes on.
BROWSE_SCAN = 2000


def _not_json(exc: errors.StoreUnavailable) -> bool:
    """Whether the server refused a statement for a value it could not read (SQLSTATE class
    22, data exception: a body that is not JSON, or not UTF-8; 54, a program limit: JSON
    nested past the server's stack depth), not for its own trouble."""
    return str(getattr(exc.__cause__, "sqlstate", "") or "")[:2] in ("22", "54")


Acquire = Callable[[], AbstractAsyncContextManager[pool.Connection]]
# A row taken for redelivery, and the version its object's app accepted (an ordered route's).
Taken = tuple[pool.Record, str | None]


class Redelivery:
    """A due row, its lock held until one named step ends its transaction (or the ``async
    with`` of ``Inbox.take`` rolls it back)."""

    __slots__ = ("_connection", "_done", "_inbox", "_taken", "accepted", "event_id", "failures",
                 "request", "scope")  # fmt: skip

    def __init__(
        self,
        inbox: Inbox,
        connection: pool.Connection,
        row: pool.Record,
        accepted: str | None = None,
    ) -> None:
        self._inbox = inbox
        self._connection = connection
        self._done = False
        self.scope: str = row["scope"]
        self.event_id: str = row["event_id"]
        self.request = StoredRequest.decoded(row["inbox_request"], row["inbox_body"])
        self.failures: int = row["inbox_failures"]
        self._taken: datetime = row["taken"]  # now() in this transaction
        # On an ordered route: the newest version of its object the app accepted, read under
        # the object's lock (None: none recorded).
        self.accepted = accepted

    @property
    def stale(self) -> bool:
        """Whether it is of a type its route supersedes and older than the version its object's
        app accepted: a later delivery of the object went ahead of it (guarantees.md, "Order
        (per object)"), and sending it would overwrite the newer one."""
        request, accepted = self.request, self.accepted
        if not request.supersedes or request.version is None or accepted is None:
            return False
        return decimal.Decimal(accepted) > decimal.Decimal(request.version)

    async def superseded(self) -> None:
        """Not sent, its object's app having accepted a newer version: superseded, committed;
        its request and body kept, so that an operator can still send it."""
        await self._end(self._inbox.statements.superseded)

    async def delivered(self, attempt: Attempt) -> None:
        """The app answered 2xx: done, the body dropped, committed (on an ordered route, its
        version recorded as its object's accepted one, if newer)."""
        request = self.request
        if request.object is not None and request.version is not None:
            with pool.translated("recording the redelivery failed", self._discard):
                await self._connection.execute(
                    self._inbox.statements.accepted, object_scope(self.scope), request.object,
                    request.version, timeout=self._inbox.op_timeout,
                )  # fmt: skip
        await self._end(
            self._inbox.statements.delivered, attempt.status, attempt.error, attempt.answer()
        )

    async def failed(self, attempt: Attempt, delay: float, *, dead: bool) -> InboxState:
        """Record the attempt and schedule the next one ``delay`` from now (never past the
        deadline), or make the row dead (``dead``, or the deadline passed); the new state."""
        return await self._end(
            self._inbox.statements.failed, attempt.status, attempt.error,
            self._taken + timedelta(seconds=delay), dead, self._taken, attempt.answer(),
        )  # fmt: skip

    async def _end(self, statement: str, *args: object) -> InboxState:
        if self._done:
            raise RuntimeError(f"redelivery of {self.event_id!r} ended already")
        self._done = True
        timeout = self._inbox.op_timeout
        with pool.translated("recording the redelivery failed", self._discard):
            state: str | None = await self._connection.fetchval(
                statement, self.scope, self.event_id, *args, timeout=timeout
            )
            await self._connection.execute("COMMIT", timeout=timeout)
        return InboxState(state or InboxState.DELIVERED)

    async def take_place(self, places: slots.Slots) -> bool:
        """Hold one of the places at the app shared by every replica (``database.slots``) in
        the redelivery's transaction, after its row (and its object's): whether one was free."""
        with pool.translated("taking a place at the app failed", self._discard):
            return await places.take(self._connection)

    async def release(self) -> None:
        if self._done:
            return
        self._done = True
        with (
            contextlib.suppress(errors.StoreUnavailable),
            pool.translated("rollback failed", self._discard),
        ):
            await self._connection.execute("ROLLBACK", timeout=self._inbox.op_timeout)

    def _discard(self) -> None:
        pool.discard(self._connection)


class HandedOff:
    """A delivery kept at its hand-off (``Claim.keep`` with a lease for its delay) whose first
    attempt went on: its result, written in its row without a lock, since no lane takes the row
    before its lease ends, nor does an operator's redeliver make it due meanwhile. Its first
    attempt's failure is the schedule's first (``failures`` 0: the hand-off is no attempt of
    the app's)."""

    failures = 0

    def __init__(
        self,
        inbox: Inbox,
        scope: str,
        event_id: str,
        *,
        obj: str | None = None,
        version: str | None = None,
    ) -> None:
        self._inbox = inbox
        self.scope = scope
        self.event_id = event_id
        self._object = obj  # on an ordered route: its object's key, and its version
        self._version = version

    async def delivered(self, attempt: Attempt) -> None:
        """The app took it: delivered, the body dropped (on an ordered route, its version
        recorded as its object's accepted one, if newer, as a redelivery's is: an older
        version kept behind it is then superseded, not applied after it)."""
        statement = self._inbox.statements.delivered
        args = (attempt.status, attempt.error, attempt.answer())
        if self._object is None or self._version is None:
            await self._update(statement, *args)
            return
        inbox = self._inbox
        async with inbox._acquire() as connection:
            with pool.translated("recording the handed-off delivery's answer failed"):
                async with connection.transaction():
                    await connection.execute(
                        inbox.statements.accepted, object_scope(self.scope), self._object,
                        self._version, timeout=inbox.op_timeout,
                    )  # fmt: skip
                    await connection.fetchval(
                        statement, self.scope, self.event_id, *args, timeout=inbox.op_timeout
                    )

    async def failed(self, attempt: Attempt, delay: float, *, dead: bool) -> InboxState:
        """The app failed it: due ``delay`` from now (or dead)."""
        now = datetime.now(UTC)
        state = await self._update(
            self._inbox.statements.failed, attempt.status, attempt.error,
            now + timedelta(seconds=delay), dead, now, attempt.answer(),
        )  # fmt: skip
        return InboxState(state or InboxState.PENDING)

    async def _update(self, statement: str, *args: object) -> str | None:
        inbox = self._inbox
        async with inbox._acquire() as connection:
            with pool.translated("recording the handed-off delivery's answer failed"):
                state: str | None = await connection.fetchval(
                    statement, self.scope, self.event_id, *args, timeout=inbox.op_timeout
                )
        return state


class Inbox:
    """The inbox's operations over the store's connections (``Store.inbox``)."""

    def __init__(self, quoted: str, acquire: Acquire, begin: str, op_timeout: float) -> None:
        self.statements = inbox_sql.Statements(quoted)
        self._acquire = acquire
        self._begin = begin
        self.op_timeout = op_timeout
        self.distributed = False
        # Whether the table has the kept rows' counts, whole and readable (``Store``'s probe).
        self.counts = False

    @property
    def counted(self) -> bool:
        """Whether a keep reads its cap from the kept rows' counts (``keep_counted``): the table
        has them, and Citus does not distribute it (a distributed table has no triggers)."""
        return self.counts and not self.distributed

    def set_distributed(self, distributed: bool, begin: str) -> None:
        """As the store found the table (``Store.notice_distribution``): distributed by Citus or
        not, and the BEGIN (``sql.begin``) of a redelivery there."""
        self.distributed = distributed
        self._begin = begin

    async def due(self, scopes: list[str], held: Sequence[str] = ()) -> bool:
        """Whether a row of ``scopes`` is due, but of the per-path scopes ``held`` (one cheap
        indexed read, locking nothing)."""
        async with self._acquire() as connection:
            with pool.translated("looking for due redeliveries failed"):
                rows = await connection.fetch(
                    self.statements.due, scopes, 1, 0, list(held), timeout=self.op_timeout
                )
        return bool(rows)

    @contextlib.asynccontextmanager
    async def take(
        self, scopes: list[str], held: Sequence[str] = ()
    ) -> AsyncIterator[Redelivery | None]:
        """The oldest due row of ``scopes`` (routes' scopes; none of the per-path scopes
        ``held``) no one else holds, locked until its redelivery ends (None: none is due, or
        every due one is being redelivered). One cheap indexed read when none is; the
        transaction only when one is.

        The due rows' keys are read first, ``CANDIDATES`` at a time, oldest first and locking
        nothing. Then the oldest of them no other transaction holds is locked by one statement
        (``FOR UPDATE SKIP LOCKED`` over the page's keys); on Citus, which runs that only
        within one shard, one key at a time. The rows other lanes are redelivering are due, and
        the oldest, until they end: past a page of them, the next page. (Every lane trying the
        same page one round trip per key made a redelivery cost a round trip per lane busy:
        the burst bench's drain at 64 lanes.)"""
        held = list(held)
        async with self._acquire() as connection:
            with pool.translated("looking for due redeliveries failed"):
                due = await connection.fetch(
                    self.statements.due, scopes, CANDIDATES, 0, held, timeout=self.op_timeout
                )
                if not due:
                    yield None
                    return
                await connection.execute(self._begin, timeout=self.op_timeout)
            redelivery = None
            try:
                with pool.translated("taking a due redelivery failed"):
                    taken = await self._first_free(connection, scopes, held, due)
                if taken is not None:
                    redelivery = Redelivery(self, connection, *taken)
                yield redelivery
            finally:
                if redelivery is not None:
                    await redelivery.release()
                else:
                    with pool.translated("rollback failed"):
                        await connection.execute("ROLLBACK", timeout=self.op_timeout)

    async def _first_free(
        self,
        connection: pool.Connection,
        scopes: list[str],
        held: list[str],
        due: list[pool.Record],
    ) -> Taken | None:
        """The first of the due rows, page after page, that this transaction could lock."""
        offset = 0
        while True:
            row = await self._lock_first(connection, due)
            if row is not None:
                return row
            if len(due) < CANDIDATES:
                return None
            offset += CANDIDATES
            due = await connection.fetch(
                self.statements.due, scopes, CANDIDATES, offset, held, timeout=self.op_timeout
            )

    async def _lock_first(
        self, connection: pool.Connection, due: list[pool.Record]
    ) -> Taken | None:
        """The oldest of one page of due rows that this transaction could lock: by one
        statement, or on Citus by one per key."""
        if self.distributed:
            return await self._lock_each(connection, due)
        keys = [(c["scope"], c["event_id"]) for c in due]
        # Bounded: each row whose object is held is passed over, and the page shrinks.
        while keys:
            found: pool.Record | None = await connection.fetchrow(
                self.statements.take_first_free, [k[0] for k in keys],
                [k[1] for k in keys], timeout=self.op_timeout,
            )  # fmt: skip
            if found is None:
                return None
            taken, accepted = await self._object_taken(connection, found)
            if taken is None:
                return None
            if taken:
                return found, accepted
            # Its row stays locked by this transaction (no other lane needs it meanwhile).
            keys.remove((found["scope"], found["event_id"]))
        return None

    async def _lock_each(self, connection: pool.Connection, due: list[pool.Record]) -> Taken | None:
        """``_lock_first`` on Citus: each due row tried in turn, a statement each."""
        for candidate in due:
            row: pool.Record | None = await connection.fetchrow(
                self.statements.take, candidate["scope"], candidate["event_id"],
                timeout=self.op_timeout,
            )  # fmt: skip
            if row is None:
                continue
            taken, accepted = await self._object_taken(connection, row)
            if taken is None:
                return None
            if taken:
                return row, accepted
        return None

    async def _object_taken(
        self, connection: pool.Connection, row: pool.Record
    ) -> tuple[bool | None, str | None]:
        """Whether the object of a taken row (an ordered route's) is this redelivery's now,
        its row locked (True for a row of no object), and the newest version of it the app
        accepted; False: a delivery of it is at the app, its row held by that delivery's
        transaction. None: this transaction holds the object's row, but a delivery of it
        handed off after the take read its rows is still at the app: the take gives up (its
        transaction rolled back, so that the object's row, which that delivery's result is
        written to, is not held while another row is redelivered)."""
        request = row["inbox_request"]
        fields = json.loads(request) if isinstance(request, str) else request
        key = fields.get("object") if isinstance(fields, dict) else None
        if key is None:
            return True, None
        scope = object_scope(row["scope"])
        await connection.execute(self.statements.make_object, scope, key, timeout=self.op_timeout)
        taken = await connection.fetchrow(
            self.statements.take_object, scope, key, timeout=self.op_timeout
        )
        if taken is None:
            return False, None
        # The take read the object's rows before it held the object: a delivery of it handed
        # off meanwhile (its keep's COMMIT let go of the object's row) is still at the app.
        at_app = await connection.fetchval(
            self.statements.object_at_app,
            row["scope"],
            key,
            row["event_id"],
            timeout=self.op_timeout,
        )
        return (None, None) if at_app else (True, taken["accepted"])

    async def kept(self, scope: str, state: InboxState, limit: int) -> tuple[list[Listed], int]:
        """The oldest ``limit`` rows of ``scope`` in ``state``, and how many there are."""
        async with self._acquire() as connection:
            with plainly("query failed"):
                rows = await connection.fetch(self.statements.kept, scope, state, limit)
                total = len(rows)
                if total == limit:
                    total = await connection.fetchval(self.statements.kept_count, scope, state)
        return [Listed(*row) for row in rows], total

    async def show(self, scope: str, event_id: str, body_limit: int | None = None) -> Shown | None:
        """Everything stored about one event; with ``body_limit``, only that many of its body's
        first bytes are read (``body_bytes`` says how many it has)."""
        async with self._acquire() as connection:
            with plainly("query failed"):
                row = await connection.fetchrow(
                    self.statements.show, scope, event_id, body_limit, timeout=self.op_timeout
                )
                if row is None:
                    return None
            request, body = row["inbox_request"], row["inbox_body"] or b""
            stored = None if request is None else StoredRequest.decoded(request, body)
            place = None
            if stored is not None and stored.object is not None:
                ahead = await connection.fetchrow(
                    self.statements.place, scope, event_id, object_scope(scope), stored.object,
                    timeout=self.op_timeout,
                )  # fmt: skip
                place = Place(
                    stored.object, stored.version, ahead and ahead["accepted"],
                    ahead and ahead["behind"], ahead and ahead["since"],
                )  # fmt: skip
        attempts = row["inbox_attempts"]
        return Shown(
            row["scope"], row["event_id"], row["event_type"], row["received_at"],
            row["inbox_state"], stored, row["body_bytes"],
            [] if attempts is None else json.loads(attempts),
            row["inbox_due"], row["inbox_until"], row["inbox_changed"], place,
        )  # fmt: skip

    async def redeliver(
        self,
        scope: str,
        event_ids: list[str] | None,
        since: datetime | None,
        for_: float,
        state: InboxState = InboxState.DEAD,
    ) -> list[Key]:
        """Make these rows (or ``scope``'s rows in ``state``, changed since ``since``: every
        page of ``selected``, each by ``redeliver_batch``) pending and due now, with ``for_``
        seconds of the schedule again: the keys it changed. A row whose handed-off attempt is
        still at the app is passed over (``at_app`` says which): made due, it would be sent a
        second time while the app works on the first."""
        if event_ids is not None:
            rows = await self._operate(self.statements.redeliver, scope, event_ids, for_)
            return [Key(row["scope"], row["event_id"]) for row in rows]
        selection = Selection(scope, state, since, again=True)
        changed: list[Key] = []
        after = None
        while page := await self.selected(selection, after, BATCH):
            keys = [Key(row.scope, row.event_id) for row in page]
            changed += await self.redeliver_batch(selection, keys, for_)
            after = keys[-1]
        return changed

    async def at_app(self, scope: str, event_ids: list[str]) -> dict[str, datetime]:
        """Those of these rows whose handed-off attempt is still at the app (``redeliver``
        passes them over), each to the end of its lease: by then its attempt has ended."""
        async with self._acquire() as connection:
            with plainly("query failed"):
                rows = await connection.fetch(self.statements.at_app, scope, event_ids)
        return {row["event_id"]: row["inbox_due"] for row in rows}

    async def discard(self, scope: str, event_ids: list[str]) -> set[str]:
        """Drop these pending or dead deliveries, keeping their claims: the IDs it changed."""
        rows = await self._operate(self.statements.discard, scope, event_ids)
        return {row["event_id"] for row in rows}

    async def selected_count(self, selection: Selection) -> int:
        """How many rows ``selection`` holds now."""
        async with self._acquire() as connection:
            with plainly("query failed"):
                count: int = await connection.fetchval(
                    self.statements.selected_count, *selection.arguments()
                )
        return count

    async def selected(self, selection: Selection, after: Key | None, limit: int) -> list[Listed]:
        """The first ``limit`` rows of ``selection`` past ``after``, in key order; locks
        nothing."""
        last = after or (None, None)
        async with self._acquire() as connection:
            with plainly("query failed"):
                rows = await connection.fetch(
                    self.statements.selected, *selection.arguments(), *last, limit
                )
        return [Listed(*row) for row in rows]

    async def redeliver_batch(
        self, selection: Selection, keys: list[Key], for_: float
    ) -> list[Key]:
        """These rows of ``selection`` (a page of ``selected``), those still in it, made due
        now with ``for_`` seconds of the schedule again, in one transaction: the keys it
        changed. A row being redelivered right now is passed over."""
        return await self._batch(
            self.statements.redeliver_one, keys, selection.state.value, selection.since, for_
        )

    async def discard_batch(self, selection: Selection, keys: list[Key]) -> list[Key]:
        """These rows of ``selection``, those still in it, discarded in one transaction: the
        keys it changed. A row being redelivered right now is passed over."""
        return await self._batch(
            self.statements.discard_one, keys, selection.state.value, selection.since
        )

    async def _batch(self, statement: str, keys: list[Key], *args: object) -> list[Key]:
        """``statement`` on each row, one statement per row (on Citus, on its row's shard),
        all committed together or none: an interrupted batch changes nothing."""
        changed: list[Key] = []
        async with self._acquire() as connection:
            with plainly("query failed"):
                async with connection.transaction():
                    for key in keys:
                        rows = await connection.fetch(statement, *key, *args)
                        changed += (Key(row["scope"], row["event_id"]) for row in rows)
        return changed

    async def _operate(self, statement: str, *args: object) -> list[pool.Record]:
        async with self._acquire() as connection:
            try:
                with plainly("query failed"):
                    async with connection.transaction():
                        await connection.execute(
                            sql.wait_bound(OPERATOR_LOCK_WAIT, distributed=self.distributed)
                        )
                        rows: list[pool.Record] = await connection.fetch(statement, *args)
            except errors.waited(self.distributed) as exc:
                raise errors.StoreUnavailable(
                    "one of these events is being redelivered right now; try again in a moment"
                ) from exc
        return rows

    async def level(self, scope: str) -> Level:
        async with self._acquire() as connection:
            with pool.translated("reading the inbox's level failed"):
                row = await connection.fetchrow(
                    self.statements.level, scope, timeout=self.op_timeout
                )
        assert row is not None
        return Level(row["pending"], row["pending_bytes"], row["dead"], row["oldest"],
                     row["overdue"], row["oldest_dead"])  # fmt: skip

    async def blocked_level(self, scope: str) -> BlockedLevel:
        async with self._acquire() as connection:
            with pool.translated("reading the blocked objects failed"):
                row = await connection.fetchrow(
                    self.statements.blocked_level, scope, timeout=self.op_timeout
                )
        assert row is not None
        return BlockedLevel(row["objects"], row["oldest"])

    async def blocked(self, scope: str, older_than: float, limit: int) -> tuple[list[Blocked], int]:
        """The ``limit`` oldest objects of ``scope`` blocked by a head pending at least
        ``older_than`` seconds, and how many such objects there are."""
        async with self._acquire() as connection:
            with plainly("query failed"):
                rows = await connection.fetch(
                    self.statements.blocked, scope, older_than, limit, timeout=self.op_timeout
                )
        total = rows[0]["total"] if rows else 0
        return [Blocked(*row[:-1]) for row in rows], total

    async def sweep_dead(self, scope: str, retention: float, batch: int) -> int:
        async with self._acquire() as connection:
            with pool.translated("retention delete of dead deliveries failed"):
                status = await connection.execute(
                    self.statements.sweep_dead, scope, retention, batch, timeout=self.op_timeout
                )
        return int(status.split()[-1])

    async def sweep_objects(self, scope: str, retention: float, batch: int) -> int:
        """Delete one batch of the object rows of ``scope`` (``object_scope``) not held for
        ``retention`` seconds, whose object keeps no delivery."""
        async with self._acquire() as connection:
            with pool.translated("retention delete of object rows failed"):
                status = await connection.execute(
                    self.statements.sweep_objects, scope, retention, batch,
                    timeout=self.op_timeout,
                )  # fmt: skip
        return int(status.split()[-1])

    # The operator console (``proxy.console``)

    async def browse(
        self, criteria: Criteria, body_path: tuple[str, ...] = (), body_value: str = ""
    ) -> tuple[list[Listed], tuple[datetime, str] | None]:
        """A page of the kept rows ``criteria`` select, newest first, and the cursor of the next
        page (None: this was the last). With ``criteria.body_bytes``, only the rows whose body
        is JSON holding ``body_value`` at ``body_path``, checked by the server
        (``Statements.body_match``: no body is read here), in ``criteria.states``, among the
        newest ``BROWSE_SCAN`` rows at most: a page may then be short, or empty, with a next
        one."""
        rows: list[Listed] = []
        scanned = 0
        cursor = criteria
        states = set(criteria.states)  # with a body filter, checked here (``_kept_where``)
        async with self._acquire() as connection:
            with plainly("query failed"):
                while True:
                    statement, args = self.statements.browse(cursor)
                    batch = await connection.fetch(statement, *args, timeout=self.op_timeout)
                    if criteria.body_bytes is not None:
                        wanted = [r for r in batch if not states or r["inbox_state"] in states]
                        if wanted:
                            matched = await self._matching(
                                connection, wanted, body_path, body_value
                            )
                            rows += (Listed(*r) for r in wanted if (r[0], r[1]) in matched)
                    else:
                        rows += (Listed(*row) for row in batch)
                    if len(batch) < cursor.limit:
                        return rows[: criteria.limit], None
                    last = batch[-1]
                    scanned += len(batch)
                    if len(rows) >= criteria.limit or scanned >= BROWSE_SCAN:
                        break
                    cursor = dataclasses.replace(
                        cursor, after=(last["received_at"], last["event_id"])
                    )
        if len(rows) > criteria.limit:
            rows = rows[: criteria.limit]
            return rows, (rows[-1].received_at, rows[-1].event_id)
        return rows, (last["received_at"], last["event_id"])

    async def count(self, criteria: Criteria, most: int, within: float) -> int | None:
        """How many kept rows ``criteria`` select, up to ``most`` + 1 (more: ``most`` + 1),
        read through an index (the kept rows', or the inbox's for pending and dead); not with a
        body filter (``Statements.count``). None: not counted within ``within`` seconds (a
        filter the indexes do not answer, over many kept rows)."""
        statement, args = self.statements.count(criteria, most)
        async with self._acquire() as connection:
            try:
                with plainly("query failed"):
                    async with connection.transaction():
                        await connection.execute(sql.statement_timeout(within))
                        counted: int = await connection.fetchval(
                            statement, *args, timeout=self.op_timeout
                        )
            except errors.StatementCancelled:
                return None
        return counted

    async def _matching(
        self, connection: pool.Connection, batch: list[pool.Record], path: tuple[str, ...],
        value: str,
    ) -> set[tuple[str, str]]:  # fmt: skip
        """The keys of ``batch``'s rows whose body holds ``value`` at ``path``: one statement
        for the batch, or, when a body in it is not JSON the server can read, one per row."""
        keys = [(row["scope"], row["event_id"]) for row in batch]
        groups = [keys]
        found: set[tuple[str, str]] = set()
        while groups:
            group = groups.pop()
            try:
                with pool.translated("query failed"):
                    matched = await connection.fetch(
                        self.statements.body_match, sorted({k[0] for k in group}),
                        [k[1] for k in group], list(path), value, timeout=self.op_timeout,
                    )  # fmt: skip
            except errors.StoreUnavailable as exc:
                if not _not_json(exc):
                    raise
                if len(group) > 1:
                    groups += ([key] for key in group)
                continue
            found.update((row["scope"], row["event_id"]) for row in matched)
        return found.intersection(keys)

    async def hour(self, scope: str) -> Hour:
        async with self._acquire() as connection:
            with plainly("query failed"):
                row = await connection.fetchrow(
                    self.statements.hour, scope, timeout=self.op_timeout
                )
        assert row is not None
        return Hour(*row)

    async def lookup(
        self, scopes: list[str], scoped: list[str], composite: list[str], event_id: str
    ) -> list[Found]:
        """The claims of ``event_id`` (as the provider sent it, or as stored) in ``scopes``, and
        in the per-path scopes of ``scoped``, newest first; in the scopes of ``composite``
        (routes whose ID is composite), also the claims whose last part it is (GitHub's
        GUID without its hook ID)."""
        part = event_id.replace("%", "%25")  # as ``event_ids.join`` escapes a part
        composite = composite if ":" not in event_id else []
        async with self._acquire() as connection:
            with plainly("query failed"):
                rows = await connection.fetch(
                    self.statements.lookup, scopes, event_id, timeout=self.op_timeout
                )
                if composite:
                    rows += await connection.fetch(
                        self.statements.lookup_last_part, composite, part,
                        timeout=self.op_timeout,
                    )  # fmt: skip
                if scoped:
                    rows += await connection.fetch(
                        self.statements.lookup_scoped, scoped, event_id, composite, part,
                        timeout=self.op_timeout,
                    )  # fmt: skip
        found = {(row[0], row[1]): Found(*row) for row in rows}
        return sorted(found.values(), key=lambda f: f.received_at, reverse=True)
