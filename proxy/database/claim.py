"""A claim: one request's hold on one event, from its INSERT to the end of its transaction.

The concurrency design rests on PostgreSQL's unique index. ``INSERT … ON CONFLICT DO NOTHING``
in a READ COMMITTED transaction either inserts the row (this request owns the event until it
commits or rolls back), returns nothing because a committed row exists (a duplicate), or
*waits* on another transaction's uncommitted row and then does one of the two once that
transaction ends. No SELECT-before-INSERT, no advisory locks: the index is the lock, and it is
released exactly when the owner's transaction ends (commit, rollback, or its connection dying).

A copy's wait is bounded by what its route's claim_wait has left: ``lock_timeout``, and on a
table distributed by Citus (``Store.notice_distribution``), where the row it waits on is on a
worker that the coordinator's ``lock_timeout`` does not reach, ``statement_timeout`` too (the
same, plus ``sql.STATEMENT_MARGIN`` for the statement's own work; ``sql.begin``).
Both end as ``ClaimWaitExceeded``. The statement bound is lifted (``sql.UNBOUND``) before the
claim's UPDATEs (its answer, or the inbox's); a duplicate reads after its ROLLBACK. (A COMMIT
is never cut short by it: PostgreSQL ends a statement's timer before committing.)

``Store.claim`` makes the claim (the INSERT) and ends whatever is left open on the way out of
its ``async with``. In between, one named step ends the transaction, each one round trip as
before there were names (procrastinate's job transitions are the model):

- ``commit(answer)``: an acquired claim becomes permanent, with the app's answer if the route
  replays it. Returns a ``Commit`` saying what was stored.
- ``settle_duplicate(read_answer)``: a duplicate learns whether the event was first claimed with
  another body (a mismatch) and, with ``read_answer``, the answer stored with it; its
  transaction ends with the same round trip (or, reading the answer, the one before).
- ``keep(request, attempt, policy)``: on a route that redelivers, the app failed: keep the
  delivery in the claim's row (pending, or dead) and commit, so the redeliverer takes it from
  there (``inbox``). Refused over the route's cap, or for a signed body kept already under
  another ID (a replay): the claim stays open, to be released.
- ``release()``: roll back (a failed delivery, or what the ``async with`` does when no step ran).
- ``abandon()``: the connection failed mid-claim; close it instead of waiting on it again.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from proxy import errors
from proxy.database import inbox, pool, slots, sql

log = logging.getLogger(__name__)

GRANT_ANSWER_HINT = f"needs GRANT UPDATE ({', '.join(sql.ANSWER_COLUMNS)})"


class ClaimState(enum.StrEnum):
    """A claim's states; each transition moves ``OPEN`` to one of the others, once."""

    OPEN = "open"
    COMMITTED = "committed"
    SETTLED = "settled"
    RELEASED = "released"
    KEPT = "kept"
    ABANDONED = "abandoned"


# Stateless, so shared by every claim: no object made per COMMIT or ROLLBACK.
_COMMIT_FAILED = pool.translated("COMMIT failed")
_ROLLBACK_FAILED = pool.translated("rollback failed")


@dataclass(frozen=True, slots=True)
class Answer:
    """The app's 2xx answer as stored for replay: its status, end-to-end headers in order
    (repeated ones kept) and body."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Key:
    """What is claimed: the event, and the facts stored with it. ``legacy_id``: on a route
    whose claims are bound to what is signed (``event_id`` then ends in ``~`` and a digest,
    ``webhooks.bound``), the ID as the provider sent it, the form 0.1.0 stored; claimed with
    ``event_id`` inside the upgrade window (``Store.legacy_form``)."""

    scope: str
    event_id: str
    event_type: str | None
    body_sha256: bytes
    legacy_id: str | None = None


_HEX = frozenset("0123456789abcdef")


def is_bound(stored: str, event_id: str) -> bool:
    """Whether ``stored`` is ``event_id`` bound to a body (``event_id~`` and the digest)."""
    return (
        len(stored) == len(event_id) + 1 + sql.BOUND_DIGITS
        and stored.startswith(event_id)
        and stored[len(event_id)] == "~"
        and _HEX.issuperset(stored[-sql.BOUND_DIGITS :])
    )


def unbound(stored: str) -> str:
    """The event ID as the provider sent it, of a stored claim ID: without the ``~`` and the
    digest of a bound claim (any other ID as it is)."""
    event_id = stored[: -sql.BOUND_DIGITS - 1]
    return event_id if event_id and is_bound(stored, event_id) else stored


@dataclass(frozen=True, slots=True)
class Commit:
    """What ``Claim.commit`` stored. ``reconciled``: the COMMIT was in doubt and the claim was
    settled on a fresh connection, without an answer. ``answer_refused``: why the server
    refused to store the answer (the claim was committed without it)."""

    reconciled: bool = False
    answer_refused: str | None = None

    def stored(self, answer: Answer | None) -> Answer | None:
        """The answer the claim holds now, of the one given to ``commit``."""
        return None if self.reconciled or self.answer_refused is not None else answer


COMMITTED_AS_ASKED = Commit()


class Duplicate(NamedTuple):
    """What ``Claim.settle_duplicate`` found: whether the event was first claimed with another
    body, the answer stored with it (None: none, or not asked for) and, asked with ``inbox``,
    whether it is kept for redelivery ("pending", "dead"; None: it is not)."""

    mismatch: bool
    answer: Answer | None
    kept: inbox.InboxState | None = None


class NotKept(enum.StrEnum):
    """Why ``Claim.keep`` did not keep a delivery (the claim is still open): over the route's
    cap, its signed body kept already under another ID, or the server refused or failed."""

    FULL = "full"
    KEPT_AS = "kept_as"
    FAILED = "not_kept"


class Kept(NamedTuple):
    """What ``Claim.keep`` did (``state``: the inbox's state it was kept in, or why it
    was not) and, ``NotKept.KEPT_AS``, the ID of the kept row that holds this signed body."""

    state: inbox.InboxState | NotKept
    kept_as: str | None = None


class Turn(enum.StrEnum):
    """What ``Claim.hold_object`` found: the object is this delivery's (``HELD``); held, but
    this event is older than the version the app accepted (``STALE``); held, but an older
    delivery of it is kept (``BEHIND``); or not this delivery's within its wait (``BUSY``: its
    claim still open, the object not held)."""

    HELD = "held"
    STALE = "stale"
    BEHIND = "behind"
    BUSY = "busy"


@dataclass(frozen=True, slots=True)
class Held:
    """The object a claim holds (``Claim.hold_object``): its scope, key and this event's
    version, recorded as the accepted one if it is newer when the claim commits."""

    scope: str
    key: str
    version: str | None


class Store(Protocol):
    """What a claim needs of the store that made it (``store.Store`` is one)."""

    queries: sql.Queries
    inbox: inbox.Inbox
    op_timeout: float
    distributed: bool  # Citus: the claim's INSERT bounded by statement_timeout too

    async def confirm_commit(self, key: Key) -> bool:
        """After a COMMIT in doubt: whether the claim is stored now (see ``store.Store``)."""


class Claim:
    """This request's hold on one event; ``acquired`` is False for a duplicate. Made by
    ``Store.claim``, which ends it on the way out unless a named step did."""

    __slots__ = ("_connection", "_store", "acquired", "held", "key", "legacy", "state")

    def __init__(
        self,
        store: Store,
        connection: pool.Connection,
        key: Key,
        acquired: bool,
        legacy: str | None = None,
    ) -> None:
        self._store = store
        self._connection = connection
        self.key = key
        self.acquired = acquired
        # The legacy form claimed with ``key.event_id`` (the upgrade window), or None.
        self.legacy = legacy
        self.state = ClaimState.OPEN
        self.held: Held | None = None  # the object this claim holds (an ordered route)

    @property
    def open(self) -> bool:
        """No step has ended the claim yet (its transaction is still open)."""
        return self.state is ClaimState.OPEN

    def _end(self, state: ClaimState) -> None:
        if self.state is not ClaimState.OPEN:
            raise RuntimeError(f"claim of {self.key.event_id!r} is {self.state} already")
        self.state = state

    async def commit(self, answer: Answer | None = None) -> Commit:
        """Make the claim permanent, with ``answer`` stored for replay in the same round trip;
        raise CommitFailed if that cannot be made certain.

        When COMMIT fails (the connection was lost, the server went away) the claim may or may
        not have been stored. ``Store.confirm_commit`` then settles it on a fresh connection
        (re-claimed there without an answer: its duplicates then get the proxy's own
        acknowledgement). When the server refuses to store the answer (the role may not UPDATE
        it), the claim is committed without it on the same connection.
        """
        if not self.acquired:
            raise RuntimeError("a duplicate's claim cannot be committed")
        if self.state is ClaimState.ABANDONED:
            return await self._store_again()
        self._end(ClaimState.COMMITTED)
        store, key = self._store, self.key
        statement = self._commit_statement(answer)
        refused = None
        # Closed already: COMMIT would not be sent, so the claim certainly ended with its
        # connection (asyncpg refuses at once with "connection is closed"); past this point a
        # COMMIT that fails was sent, and may have gone through.
        unsent = self._connection.is_closed()
        try:
            try:
                with _COMMIT_FAILED:
                    await self._connection.execute(statement, timeout=store.op_timeout)
            except errors.PermissionDenied as exc:
                if answer is None:
                    raise
                refused = f"{exc.__cause__} (on_duplicate: replay {GRANT_ANSWER_HINT})"
                log.warning(
                    "the app's answer to %s %s was not stored for replay, its claim kept "
                    "without it (its duplicates get the proxy's acknowledgement): %s",
                    key.scope, key.event_id, refused,
                )  # fmt: skip
                with _COMMIT_FAILED:
                    await self._connection.execute(
                        sql.COMMIT_WITHOUT_ANSWER, timeout=store.op_timeout
                    )
                return Commit(answer_refused=refused)
        except errors.StoreUnavailable as unavailable:
            self._discard()
            if await store.confirm_commit(key):
                return Commit(reconciled=True, answer_refused=refused)
            cause = unavailable.__cause__ if unavailable.__cause__ is not None else unavailable
            if unsent:
                raise errors.CommitNotSent(
                    "the connection was closed before COMMIT could be sent, so the claim is "
                    f"not stored, and storing it again failed: {cause!r}"
                ) from cause
            raise errors.CommitFailed(
                f"COMMIT failed and could not be reconciled: {cause!r}"
            ) from cause
        except asyncio.CancelledError:
            self._discard()  # cancelled mid-COMMIT: the session's state is unknown
            raise
        return COMMITTED_AS_ASKED

    def _commit_statement(self, answer: Answer | None) -> str:
        """The COMMIT, with ``answer`` stored in the same round trip, and the held object's
        version recorded as accepted."""
        store, key = self._store, self.key
        statement = "COMMIT"
        if answer is not None:
            statement = store.queries.commit_answer(
                key.scope, key.event_id, answer.status, list(answer.headers), answer.body,
                also=self.legacy,
            )  # fmt: skip
        held = self.held
        if held is not None and held.version is not None:
            statement = store.queries.accepted(held.scope, held.key, held.version) + statement
        return statement

    async def hold_object(self, held: Held, wait: float, *, behind: bool) -> Turn:
        """Take the object ``held`` names for this delivery, in the claim's transaction, after
        its claim row (always in that order, one object per claim: no two claims wait on each
        other's rows in a cycle), waiting at most ``wait`` for a delivery of it at the app;
        with ``behind`` (a route that redelivers), tell whether an older delivery of it is
        kept. One round trip; one more (back to the savepoint) when the wait runs out.
        StoreUnavailable when the database fails (the claim abandoned)."""
        if not self.acquired or self.state is not ClaimState.OPEN:
            raise RuntimeError(f"claim of {self.key.event_id!r} holds no object")
        store = self._store
        bound = sql.wait_bound(max(wait, 0.001), distributed=store.distributed)
        statement = store.queries.hold_object(
            bound, held.scope, held.key, held.version, behind=behind
        )
        try:
            try:
                with pool.translated("taking the object failed", self.abandon):
                    status = await self._connection.execute(
                        statement, timeout=wait + store.op_timeout
                    )
            except errors.waited(store.distributed):
                with pool.translated("taking the object failed", self.abandon):
                    await self._connection.execute(
                        f"ROLLBACK TO SAVEPOINT {sql.ORDER_SAVEPOINT}", timeout=store.op_timeout
                    )
                return Turn.BUSY
        except asyncio.CancelledError:
            self._discard()
            raise
        self.held = held
        flags = int(status.rpartition(" ")[2]) if status else 0
        if flags & sql.OBJECT_BEHIND:
            return Turn.BEHIND
        return Turn.STALE if flags & sql.OBJECT_STALE else Turn.HELD

    async def take_place(self, places: slots.Slots) -> bool:
        """Hold one of the places at the app shared by every replica (``database.slots``) in
        the claim's transaction, after its claim row and its object's: whether one was free.
        Never waits. StoreUnavailable when the database fails (the claim abandoned)."""
        if not self.acquired or self.state is not ClaimState.OPEN:
            raise RuntimeError(f"claim of {self.key.event_id!r} takes no place")
        try:
            with pool.translated("taking a place at the app failed", self.abandon):
                return await places.take(self._connection)
        except asyncio.CancelledError:
            self._discard()
            raise

    async def supersede(self) -> None:
        """Commit the claim as superseded (never forwarded): its copies are duplicates."""
        self._end(ClaimState.COMMITTED)
        store, key = self._store, self.key
        try:
            with pool.translated("committing the superseded event failed", self._discard):
                await self._connection.execute(
                    store.queries.superseded(key.scope, key.event_id), timeout=store.op_timeout
                )
        except asyncio.CancelledError:
            self._discard()
            raise

    async def keep(
        self, request: inbox.StoredRequest, attempt: inbox.Attempt, policy: inbox.KeepPolicy
    ) -> Kept:
        """Keep a delivery the app failed in the claim's row and COMMIT: pending (or dead,
        ``policy.dead``) once committed. ``NotKept``: ``FULL`` (the cap is reached), ``KEPT_AS``
        (a kept row under the cap holds this signed body already, under the ID it names: a
        replay) or ``FAILED`` (the server refused, or failed; logged) leave the claim open, so the
        failure is relayed and the claim released, as on a route that does not redeliver.

        A COMMIT in doubt is ``NotKept.FAILED``: the provider is told the failure, and its retry is
        either a duplicate of the kept event (the COMMIT went through) or a new claim.
        """
        if not self.acquired:
            raise RuntimeError("a duplicate's claim cannot be kept")
        if self.state is ClaimState.ABANDONED:
            # An earlier keep failed (a hand-off's): the transaction is gone with its connection.
            log.warning(
                "the failed delivery of %s %s could not be kept for redelivery (its claim's "
                "connection failed already): relaying the failure", self.key.scope,
                self.key.event_id,
            )  # fmt: skip
            return Kept(NotKept.FAILED)
        if self.state is not ClaimState.OPEN:
            raise RuntimeError(f"claim of {self.key.event_id!r} is {self.state} already")
        key, store = self.key, self._store
        state = inbox.InboxState.DEAD if policy.dead else inbox.InboxState.PENDING
        try:
            with pool.translated("keeping the delivery failed", self.abandon):
                if store.distributed:  # the claim's statement bound was for its INSERT only
                    await self._connection.execute(sql.UNBOUND, timeout=store.op_timeout)
                kept, kept_as = await self._keep_row(request, attempt, policy, state)
        except errors.StoreUnavailable as exc:
            log.warning(
                "the failed delivery of %s %s could not be kept for redelivery (%s): relaying "
                "the failure", key.scope, key.event_id, exc.message,
            )  # fmt: skip
            return Kept(NotKept.FAILED)
        if not kept:
            return Kept(NotKept.FULL) if kept_as is None else Kept(NotKept.KEPT_AS, kept_as)
        self._end(ClaimState.KEPT)
        try:
            with _COMMIT_FAILED:
                await self._connection.execute("COMMIT", timeout=store.op_timeout)
        except errors.StoreUnavailable as exc:
            # The transaction ended with its connection, as when the keep itself fails: an
            # attempt still at the app (a hand-off's) ends the claim as an abandoned one.
            self.state = ClaimState.ABANDONED
            self._discard()
            log.warning(
                "the COMMIT keeping %s %s for redelivery failed, so it may not be kept: "
                "relaying the failure (%r)", key.scope, key.event_id, exc.__cause__,
            )  # fmt: skip
            return Kept(NotKept.FAILED)
        except asyncio.CancelledError:
            self._discard()
            raise
        return Kept(state)

    async def _keep_row(
        self,
        request: inbox.StoredRequest,
        attempt: inbox.Attempt,
        policy: inbox.KeepPolicy,
        state: inbox.InboxState,
    ) -> tuple[bool, str | None]:
        """``keep``'s statements: whether the row was kept, else the ID its signed body is kept
        under already (None: over the cap)."""
        key, store = self.key, self._store
        statements = store.inbox.statements
        if policy.signed is not None:  # a replay of it waits for this one (``keep_signed``)
            await self._connection.execute(
                statements.keep_signed, policy.cap_scope, policy.signed, timeout=store.op_timeout
            )
        keep = statements.keep_counted if store.inbox.counted else statements.keep
        status = await self._connection.execute(
            keep, key.scope, key.event_id, state, request.encoded(),
            request.body, attempt.status, attempt.error, policy.delay, policy.until,
            policy.cap_scope, policy.max_pending, policy.max_pending_bytes, policy.signed,
            1 if policy.attempted else 0, attempt.answer(), timeout=store.op_timeout,
        )  # fmt: skip
        if status.rpartition(" ")[2] == "1":
            return True, None
        if policy.signed is None:
            return False, None
        # Not kept: over the cap, or a replay? A second read only when refused.
        kept_as: str | None = await self._connection.fetchval(
            statements.kept_as, policy.cap_scope, policy.signed, timeout=store.op_timeout
        )
        return False, kept_as

    async def settle_duplicate(
        self, *, read_answer: bool = False, inbox: bool = False
    ) -> Duplicate:
        """End a duplicate's transaction, and tell whether its body differs from the one first
        claimed; with ``read_answer``, also the answer stored with the claim.

        READ COMMITTED: either statement sees the row a concurrent owner committed while this
        copy waited. Without ``read_answer``, one round trip (the ROLLBACK and the comparison
        together, see sql.Queries.duplicate); a failure there is logged, the connection closed,
        and no mismatch reported. With it, the ROLLBACK then the read (its failure raises
        StoreUnavailable), outside the claim's transaction and its statement bound.
        """
        if self.acquired:
            raise RuntimeError("an acquired claim is no duplicate")
        key, store = self.key, self._store
        # Inside the upgrade window, the legacy row is the one every claim of the event has
        # (an earlier release's, or one made with both forms): it holds the digest and answer.
        first = self.legacy or key.event_id
        if not read_answer:
            self._end(ClaimState.SETTLED)
            status = await self._roll_back(
                store.queries.duplicate(
                    key.scope, key.event_id, key.body_sha256, inbox=inbox, legacy=self.legacy
                )
            )
            if inbox:
                mismatch, kept = sql.duplicate_flags(status)
                return Duplicate(mismatch, None, _inbox_state(kept))
            return Duplicate(status == "SELECT 1", None)
        self._end(ClaimState.SETTLED)
        if await self._roll_back("ROLLBACK") is None:
            raise errors.StoreUnavailable("reading the stored answer failed: rollback failed")
        try:
            with pool.translated("reading the stored answer failed", self._discard):
                row = await self._connection.fetchrow(
                    store.queries.answer, key.scope, first, key.body_sha256,
                    timeout=store.op_timeout,
                )  # fmt: skip
        except asyncio.CancelledError:
            self._discard()  # cancelled mid-read: the session's state is unknown
            raise
        mismatch = bool(row and row["mismatch"])
        if row is None or row["answer_status"] is None:
            return Duplicate(mismatch, None)
        headers = tuple((name, value) for name, value in json.loads(row["answer_headers"]))
        return Duplicate(mismatch, Answer(row["answer_status"], headers, row["answer_body"]))

    async def release(self) -> None:
        """Roll back, unless a step ended the claim already."""
        if self.state is ClaimState.OPEN:
            self.state = ClaimState.RELEASED
            await self._roll_back("ROLLBACK")

    async def _roll_back(self, statement: str) -> str | None:
        """Send ``statement`` (a ROLLBACK, alone or with the duplicate's comparison): its
        status, or None when it failed; a connection in doubt is closed, never reused."""
        try:
            with _ROLLBACK_FAILED:
                status: str = await self._connection.execute(
                    statement, timeout=self._store.op_timeout
                )
        except errors.StoreUnavailable as exc:
            log.warning("rollback failed, closing the connection: %r", exc.__cause__)
            self._discard()
            return None
        except asyncio.CancelledError:
            self._discard()  # cancelled mid-ROLLBACK: the session's state is unknown
            raise
        return status

    async def _store_again(self) -> Commit:
        """COMMIT of a claim whose connection failed already (an earlier step abandoned it: a
        hand-off that could not keep the delivery): the claim ended with it, so it is stored
        again on a fresh connection, as after a COMMIT that could not be sent."""
        self.state = ClaimState.COMMITTED
        if await self._store.confirm_commit(self.key):
            return Commit(reconciled=True)
        raise errors.CommitNotSent(
            "the connection was closed before COMMIT could be sent, so the claim is not "
            "stored, and storing it again failed: its connection had failed already"
        )

    def abandon(self) -> None:
        """The connection failed mid-claim: close it rather than wait on it again."""
        if self.state is ClaimState.OPEN:
            self.state = ClaimState.ABANDONED
        self._discard()

    def _discard(self) -> None:
        pool.discard(self._connection)


def _inbox_state(state: str | None) -> inbox.InboxState | None:
    return None if state is None else inbox.InboxState(state)
