"""The campaign's checker: pure functions from what was recorded to a report and its violations.

The invariant, per event ID (docs/guarantees.md):

- **Nothing lost.** If the provider ever got a 2xx for the event, the app answered 2xx for it at
  least once, and the event's claim row is in the table (the row is excused when a replica
  logged a failed COMMIT for the event after the app's 2xx: ``ambiguous_commit``, or
  ``commit_not_sent``). With a synchronous standby this holds across failovers too: a COMMIT
  acknowledged before the primary's kill is on the standby that takes over. A relayed 2xx (not
  a duplicate answer) is the app's own answer to that very delivery. A committed claim whose
  event the app never took is a loss too (every later delivery would be swallowed as a
  duplicate), and so is an event the provider never got acknowledged, even after the settle
  phase.
- **At most once, outside the documented windows.** The app answers 2xx for an event at most
  once, unless every 2xx answer but the last one (in the order the calls started, which is the
  order the row lock let them through) is *exposed* to a window: the call answered after
  ``upstream.timeout`` (the proxy gave up and rolled back) or its delivery got a 504; or a
  replica kill, a database-link blackhole, reset or refusal on the replica that made the call,
  or a PostgreSQL restart, overlaps the time from the claim until its COMMIT must have ended
  (``commit_margin`` after the answer); or, under the failover nemesis, the primary's kill
  does (the call straddles the kill: its transaction died with the primary; the promotion and
  the rebuild of a standby that follow explain nothing); or a replica logged a failed COMMIT
  for the event (``ambiguous_commit``, ``commit_not_sent``). Such events are counted as
  *explained* double processing; any other is a violation. A call whose claim the proxy logged
  committed on its own connection (``processed``, not ``reconciled``) is exposed to nothing: it
  held the row lock until the database acknowledged the COMMIT, so a later forward of its event
  is ``forwarded_after_commit`` whatever the faults (under the failover nemesis: an
  acknowledged COMMIT the synchronous standby failed to keep).
- **Only documented answers.** A non-2xx answer is either the app's own answer to that very
  delivery or one of the proxy's own (502, 503, 504); anything else (a 500 from an unhandled
  exception, say) breaks the situation table in the README.
- **One send at a time.** A call of an event starts only once every earlier one ended (a
  forward holds the claim's row lock, a redelivery the kept row's), unless the earlier call is
  exposed to a window: its lock was released under it (a fault) or given up on (a timeout).

On a route that redelivers (``Records.inbox``; the provider never retries), further:

- **Accepted is delivered.** Every 2xx counts (202 ``queued`` and ``duplicate_queued`` too): the
  app answered 2xx for the event at least once (by the first forward or a redelivery). An event
  whose every send failed was *refused* (the provider was told to retry): not a loss, but each
  of its failed sends must be explained by a logged answer of the proxy's, or by the replica's
  kill. A failure of the app's the proxy relayed instead of keeping needs an inbox at its cap
  or a database fault on that replica (the keep could not be committed).
- **A kept event is never forwarded again** but by the redeliverer: no copy's first forward
  starts after a delivery of the event was answered ``queued``, ``dead_letter`` or
  ``duplicate_queued``. A ``queued`` answer is the app's failure (its status in the answer, or
  none: the app did not answer within ``upstream.timeout``), unless it says ``kept_for``:
  ``limit`` (the limit at the app was reached: never forwarded, so every call carrying its ID
  is a redelivery, even one that starts before the provider read the 202), or ``deadline``
  (the route's ``hand_off``: its forward was still at the app ``hand_off`` after the request
  arrived and went on after the 202; or, its line without ``handed_off``, it was never sent).
- **A hand-off is no excuse.** The forward of a delivery kept at its hand-off goes on at the
  app, and its result is recorded in the row, which no lane takes before its lease
  (``upstream.timeout`` + 5 s) ends. A second call of the event beside it or after it is
  exposed to the same windows as any forward (a fault on its replica, an answer after
  ``upstream.timeout``), and to ``no_answer`` only once the attempt ended without the app's
  answer (its line says ``handed_off: failed`` with no ``upstream_status``: the proxy's
  ``upstream.timeout``, timed from its send, fired before the app answered; the call closed,
  or the line written, before the app's answer shows it) and its row became due on the route's
  schedule;
  a kill of its replica during the wait, after
  which the row is sent again at the lease's end, is counted as ``hand_off_kill``, and a result
  the proxy could not record when the attempt ended (its line says ``handed_off: unrecorded``:
  no free pool connection in time, or the link lost), sent again at the lease's end too, as
  ``hand_off_unrecorded``.
- **Redeliveries are doubles only in the windows.** A call carrying a delivery's ID that is not
  that delivery's first forward (its first call while it was in flight, from the replica it
  was sent to) is a redelivery, made by the replica whose port it reached.
  The windows are the same (a fault on *that* replica, or a PostgreSQL restart, from the call
  until the COMMIT of ``delivered``; an answer after ``upstream.timeout``), and one more: the
  replica logged that attempt (``proxy.redeliverer``) with no answer from the app, or the first
  forward was kept with no answer (``no_answer``: the proxy timed out, the app acted after).
- **Nothing left behind.** After the settle phase no row is pending, and none is dead unless
  the app answered a status retrying cannot fix (the campaign's app never does).

On a route with ``order`` and ``supersede`` (``Records.objects``), an event the proxy
*superseded* (answered ``200 superseded``, or its row marked ``superseded`` by the
redeliverer) is taken, not lost: never forwarded, by design. ``order_rules`` judges whether it
was superseded rightly, and the ordering invariants.

In the receipt mode (``Records.ledger``: the app writes its effect and the receipt in one
transaction), the rule on processing twice is the ledger's (``receipt_rule``): no event has
two effects committed, whatever the faults, and every acknowledged event has its effect; a
call's ``acted`` is its effect committed.

The report counts every failed send by why (the proxy's logged answer and its ``shed``
reason, or ``claim_wait``), the refused ones apart, and among those the ones with no database
fault on their replica near them (refused although the database answered); the kept
deliveries by ``kept_for``; and per replica the most of its calls at the app at once.

A call's replica is the one whose port of the app's it reached; a log line's ``at`` is its
``ts`` on the campaign's clock. All times are seconds on one monotonic clock (the campaign's).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeGuard

from tests.faults import receipt_rule

# Nemesis actions during which a claim can be lost after the app acted. A failover's action is
# the primary's kill alone: its promotion and the rebuild of a standby (actions "promote" and
# "rebuild") end no transaction, and a COMMIT acknowledged before the kill was on the
# synchronous standby first.
WINDOW_KINDS = frozenset({"kill", "pg_restart", "failover", "blackhole", "reset", "refuse"})
# The action kinds whose target is every replica (the database itself).
GLOBAL_KINDS = frozenset({"pg_restart", "failover"})
# Log outcomes of a COMMIT after the app's 2xx that failed and could not be reconciled on a fresh
# connection (docs/guarantees.md): in doubt (ambiguous_commit; commit_failed its old spelling),
# or certainly not stored (commit_not_sent: the connection was closed before COMMIT could be
# sent, and storing the claim again failed too). Either way the provider got the app's 2xx,
# and a later copy is forwarded again.
AMBIGUOUS_OUTCOMES = frozenset({"ambiguous_commit", "commit_failed"})
UNSENT_OUTCOMES = frozenset({"commit_not_sent"})
COMMIT_FAILURES = AMBIGUOUS_OUTCOMES | UNSENT_OUTCOMES
# The violations that are a loss: acknowledged, and the app never took it or its claim is gone.
LOSSES = frozenset({"lost", "unclaimed"}) | receipt_rule.LOSSES
# The proxy's own error answers (README: 503 store unavailable, 502/504 upstream failed).
PROXY_ERRORS = frozenset({502, 503, 504})
# A fault this long before the app saw the request can still hit the claim made just before.
CLAIM_LEAD = 0.5
# The faults that leave a replica's database unanswering (its link, or the server itself), and
# how long before a request one can still refuse it (a pool reconnecting backs off up to 1 s).
DATABASE_FAULTS = frozenset({"pg_restart", "failover", "blackhole", "reset", "refuse"})
DATABASE_LEAD = 2.0
_EVIDENCE_LINES = 40
# Dedup-Status of a copy answered without being forwarded.
DUPLICATE_ANSWERS = frozenset({"duplicate", "duplicate_queued"})
# Dedup-Status saying the event is kept for redelivery (the proxy's own 202).
KEPT_ANSWERS = frozenset({"queued", "dead_letter", "duplicate_queued"})
# A ``queued`` answer's ``kept_for`` (none: the app failed it): kept before the app was sent it
# (the limit at the app, a paused route, the app's Retry-After, its object held or an older
# delivery of it kept: ``ordering``), or at the route's hand_off
# (``deadline``: while the attempt goes on, or unsent if the hand_off passed before it began).
UNSENT_KEEPS = frozenset({"limit", "paused", "retry_after", "ordering"})
HANDED_OFF = "deadline"
# The app's answers the inbox gives up on at once (proxy.delivery.UNFIXABLE).
UNFIXABLE = frozenset({400, 405, 411, 413, 414, 415, 422})
REDELIVERER = "proxy.redeliverer"  # the logger of the redeliverer's lines
# Dedup-Status and inbox_state of an event older than its object's accepted version: committed,
# never forwarded (a route with order and supersede).
SUPERSEDED = "superseded"
# An answer the proxy timed out on can measure this much shorter at the app (the request's
# transit to the app, a busy event loop).
TIMEOUT_SLACK = 0.5


@dataclass(frozen=True, slots=True)
class Delivery:
    """One HTTP attempt by the provider; ``status`` None: no answer (connection error, timeout)."""

    delivery_id: str
    event_id: str
    replica: str
    phase: str  # "nemesis" or "settle"
    start: float
    end: float
    status: int | None
    duplicate: bool = False  # answered by the proxy itself as a duplicate
    error: str | None = None
    dedup_status: str | None = None  # the answer's Dedup-Status
    upstream_status: int | None = None  # a kept delivery's: the app's status (None: no answer)
    kept_for: str | None = None  # kept not for the app's failure: why (limit, deadline, ...)

    @property
    def outcome(self) -> str:
        if self.status is None:
            return "indeterminate"
        return "ok" if 200 <= self.status < 300 else "failed"


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    """One request the app received, and what it answered (2xx: the app acted)."""

    event_id: str
    delivery_id: str | None
    replica: str | None
    start: float
    end: float
    status: int
    # The receipt mode's (``receipt_rule``): what the app's transaction did; None without it.
    effect: str | None = None
    # When the proxy's connection closed before the answer (None: it did not): the proxy no
    # longer waited on the call (its upstream.timeout, its replica killed); the app went on.
    dropped: float | None = None

    @property
    def waited_until(self) -> float:
        """Until when the proxy waited on the call: its end, or its connection's close."""
        return self.end if self.dropped is None else min(self.end, self.dropped)

    @property
    def acted(self) -> bool:
        """Whether the app acted: answered 2xx; in the receipt mode, committed its effect."""
        if self.effect is not None:
            return self.effect == "committed"
        return 200 <= self.status < 300


@dataclass(frozen=True, slots=True)
class Action:
    """One nemesis action, from its first effect until it was healed."""

    kind: str
    target: str
    start: float
    end: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PostCheck:
    """A check made once the campaign settled (no stuck transactions, no stuck pool slots)."""

    name: str
    ok: bool
    detail: str = ""
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Records:
    """Everything the campaign recorded."""

    events: Sequence[str]
    deliveries: Sequence[Delivery]
    calls: Sequence[UpstreamCall]
    actions: Sequence[Action]
    logs: Sequence[Mapping[str, Any]]  # replica log lines, each with a "replica" key
    claimed: frozenset[str]
    upstream_timeout: float
    commit_margin: float
    request_bound: float  # the longest a request should take, by the configured timeouts
    origin: float = 0.0  # shown as t=0 in evidence
    post_checks: Sequence[PostCheck] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    inbox: bool = False  # the route redelivers; the provider never retries
    inbox_states: Mapping[str, str] = field(default_factory=dict)  # claimed event -> its state
    hand_off: float | None = None  # the route's hand_off (None: none)
    # The receipt mode: the app's ledger rows per event, read at the end (None: not that mode).
    ledger: Mapping[str, int] | None = None
    # --ordering: each event's object and version (None: not that mode), and each object's
    # version at the app at the end (applied last-writer-wins).
    objects: Mapping[str, tuple[str, int]] | None = None
    final_versions: Mapping[str, int] = field(default_factory=dict)
    # --shared-limit: the limit at the app every replica shares (None: not that mode).
    shared_limit: int | None = None
    # When the campaign began stopping the replicas (SIGTERM: each drains for shutdown_timeout,
    # then gives up on what is still at the app).
    stopped: float = float("inf")


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    event_id: str | None
    message: str
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DoubleProcessed:
    event_id: str
    acted: int  # 2xx answers of the app
    explained: bool
    reasons: tuple[str, ...]
    causes: frozenset[str] = frozenset()  # "late", "504", "ambiguous" or nemesis action kinds


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxReport:
    """What happened to the events on a route that redelivers."""

    accepted: int  # events the provider got a 2xx for
    delivered: int  # accepted events the app answered 2xx for
    refused: int  # events whose every send failed: the provider was told to retry
    refused_reasons: Mapping[str, int]  # the failed sends of refused events, by why
    # Those with no database fault on their replica from DATABASE_LEAD before until the answer:
    # refused although the database answered.
    refused_healthy: Mapping[str, int]
    refused_reached_app: int  # refused events the app answered 2xx for all the same
    failed_reasons: Mapping[str, int]  # every failed send, of accepted events too, by why
    kept: int  # deliveries answered 202 queued (or dead_letter)
    kept_for: Mapping[str, int]  # those by why: failed (the app's failure), limit, deadline...
    handed_off: Mapping[str, int]  # the attempts after a hand-off, by what they came to
    duplicate_queued: int  # copies answered 202 duplicate_queued
    redeliveries: int  # calls at the app made by a redeliverer
    redeliveries_acted: int  # of which the app answered 2xx
    results: Mapping[str, int]  # the redeliverer's logged attempts, by result
    rows: Mapping[str, int]  # the claim rows at the end, by inbox_state ("none": at first try)
    peak_at_app: Mapping[str, int]  # per replica, the most of its calls at the app at once
    superseded: int = 0  # accepted events superseded, never at the app (a route with order)

    @property
    def lost(self) -> int:
        return self.accepted - self.delivered - self.superseded


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    settings: Mapping[str, Any]
    events: int
    deliveries: Mapping[str, int]  # ok / failed / indeterminate
    by_phase: Mapping[str, int]
    statuses: Mapping[str, int]
    duplicate_answers: int
    upstream_calls: int
    upstream_acted: int
    late_answers: int
    double_processed: tuple[DoubleProcessed, ...]
    ambiguous_commits: int
    reconciled: int
    outcomes: Mapping[str, int]
    actions: Mapping[str, int]
    longest_wait_ms: float
    longest_wait_at: str
    longest_delivery: float
    over_bound: int
    start_failures: int  # replica start attempts that gave up (logged "cannot start")
    unhandled: Mapping[str, int]  # unhandled exceptions in the proxy, by where they were raised
    unacknowledged: int
    post_checks: tuple[PostCheck, ...]
    violations: tuple[Violation, ...]
    inbox: InboxReport | None = None
    unsent_commits: int = 0  # logged commit_not_sent: the claim certainly not stored
    accepted: int = 0  # events the provider got a 2xx for
    delivered: int = 0  # accepted events the app answered 2xx for
    superseded: int = 0  # accepted events superseded, never at the app (a route with order)
    lost: int = 0  # accepted events the app never took, or whose claim row is missing unexcused
    receipts: receipt_rule.ReceiptReport | None = None  # the receipt mode's counts
    extra: tuple[tuple[str, str], ...] = ()  # a mode's own rows (reconcile_rules)

    @property
    def explained(self) -> int:
        return sum(d.explained for d in self.double_processed)

    @property
    def unexplained(self) -> int:
        return sum(not d.explained for d in self.double_processed)


def _rel(records: Records, t: float) -> str:
    return f"t={t - records.origin:.3f}"


def _describe_call(records: Records, call: UpstreamCall, again: bool = False) -> str:
    kind = "redelivery" if again else "upstream call"
    return (
        f"{kind} {_rel(records, call.start)}..{_rel(records, call.end)} "
        f"({call.end - call.start:.3f}s) via {call.replica} delivery {call.delivery_id} "
        f"-> {call.status}"
    )


def _describe_delivery(records: Records, d: Delivery) -> str:
    answer = d.status if d.status is not None else f"no answer ({d.error})"
    dup = f" {d.dedup_status}" if d.dedup_status else " duplicate" if d.duplicate else ""
    if d.dedup_status == "queued":
        dup += f" (app status {d.upstream_status})"
    return (
        f"delivery {d.delivery_id} [{d.phase}] to {d.replica} {_rel(records, d.start)}.."
        f"{_rel(records, d.end)} -> {answer}{dup}"
    )


def _describe_action(records: Records, a: Action) -> str:
    detail = f" ({a.detail})" if a.detail else ""
    return f"nemesis {a.kind} {a.target} {_rel(records, a.start)}..{_rel(records, a.end)}{detail}"


def _evidence(
    records: Records,
    event_id: str,
    calls: Sequence[UpstreamCall],
    deliveries: Sequence[Delivery],
    logs: Sequence[Mapping[str, Any]],
    actions: Iterable[Action] = (),
    again: Collection[UpstreamCall] = (),
) -> tuple[str, ...]:
    ordered = sorted(calls, key=lambda c: c.start)
    lines = [_describe_call(records, c, c in again) for c in ordered]
    lines += [_describe_delivery(records, d) for d in sorted(deliveries, key=lambda d: d.start)]
    lines += [_describe_action(records, a) for a in actions]
    lines += ["log " + json.dumps(dict(line), sort_keys=True, default=str) for line in logs]
    if len(lines) > _EVIDENCE_LINES:
        lines = [*lines[:_EVIDENCE_LINES], f"... {len(lines) - _EVIDENCE_LINES} more"]
    return (f"event {event_id}", *lines)


def _windows(records: Records, call: UpstreamCall) -> list[Action]:
    return _faults(records, call.replica, call.start, call.end)


def _faults(
    records: Records, replica: str | None, start: float, end: float, kinds: Collection[str] = ()
) -> list[Action]:
    """The faults (``kinds``, else every window kind) on ``replica`` or on every replica that
    overlap a claim held from ``start`` until its COMMIT, ``end`` plus ``commit_margin``."""
    low = start - CLAIM_LEAD
    high = end + records.commit_margin
    return [
        a
        for a in records.actions
        if a.kind in (kinds or WINDOW_KINDS)
        and (a.kind in GLOBAL_KINDS or a.target == replica)
        and a.start <= high
        and a.end >= low
    ]


# The app times a call from its handler's start to its return; the proxy's upstream.timeout
# runs from before the request is written to when the answer is read, so an answer the app
# timed just under the timeout can reach the proxy after it (seen: 1.999 s against 2 s on a
# loaded machine, the proxy logging "upstream did not answer within 2s"). Such a call is in the
# timeout's window as one the app timed over it is.
LATE_SLACK = 0.2


def _near(action: Action, calls: Sequence[UpstreamCall], within: float = 5.0) -> bool:
    return any(action.start <= c.end + within and action.end >= c.start - within for c in calls)


def exposures(
    records: Records, call: UpstreamCall, delivery: Delivery | None
) -> list[tuple[str, str]]:
    """Why the claim behind this 2xx answer may legitimately have been lost, as (cause,
    description) pairs; empty: no documented reason."""
    reasons: list[tuple[str, str]] = []
    took = call.end - call.start
    if took > records.upstream_timeout - LATE_SLACK:
        reasons.append(("late", f"answered after {took:.3f}s, at upstream.timeout or later"))
    if delivery is not None and delivery.status == 504:
        reasons.append(("504", f"delivery {delivery.delivery_id} got 504"))
    if _kept_unanswered(delivery):
        text = f"delivery {delivery.delivery_id} was kept with no answer from the app"
        reasons.append(("no_answer", text))
    handed_off = delivery is not None and delivery.kept_for == HANDED_OFF
    for action in _windows(records, call):
        text = _describe_action(records, action)
        if handed_off and action.kind == "kill":
            # The row, kept at the hand-off, is due when its lease ends unless the attempt's
            # result was recorded first (docs/guarantees.md, the hand-off's window 1).
            text += ": handed off, killed before the attempt's result was recorded"
            reasons.append(("hand_off_kill", text))
        else:
            reasons.append((action.kind, text))
    return reasons


def _kept_unanswered(delivery: Delivery | None) -> TypeGuard[Delivery]:
    """Whether ``delivery`` was kept for the app's failure with no answer from the app (the
    proxy timed out on it); not one kept at a hand-off or unsent, whose attempt's result is
    recorded or that was never sent."""
    return (
        delivery is not None
        and delivery.dedup_status == "queued"
        and delivery.kept_for is None
        and delivery.upstream_status is None
    )


def redelivery_exposures(
    records: Records, call: UpstreamCall, logs: Sequence[Mapping[str, Any]]
) -> list[tuple[str, str]]:
    """``exposures`` of a redelivery (no delivery of its own), and ``no_answer`` if its replica
    logged the attempt without an answer from the app."""
    reasons = exposures(records, call, None)
    line = _redelivery_line(records, call, logs)
    unanswered = line is not None and line.get("upstream_status") is None
    if line is not None and unanswered and line.get("result") != "delivered":
        text = (
            f"{call.replica}'s redelivery attempt {line.get('attempt')} logged no answer: "
            f"{line.get('error')}"
        )
        reasons.append(("no_answer", text))
    return reasons


def _redelivery_line(
    records: Records, call: UpstreamCall, logs: Sequence[Mapping[str, Any]]
) -> Mapping[str, Any] | None:
    """The redeliverer's line about ``call``: its replica's first about the event from the
    call's start on, within the time an attempt can take (None: it logged none, killed)."""
    until = call.start + records.upstream_timeout + records.request_bound
    mine = [
        line
        for line in logs
        if line.get("logger") == REDELIVERER
        and line.get("replica") == call.replica
        and isinstance(line.get("at"), float)
        and call.start <= line["at"] <= until
    ]
    return min(mine, key=lambda line: float(line["at"]), default=None)


@dataclass(slots=True)
class _Event:
    """One event's share of the records."""

    event_id: str
    deliveries: list[Delivery] = field(default_factory=list)
    calls: list[UpstreamCall] = field(default_factory=list)
    logs: list[Mapping[str, Any]] = field(default_factory=list)
    redeliveries: list[UpstreamCall] = field(default_factory=list)  # see split_calls

    @property
    def ambiguous(self) -> bool:
        """Whether a replica logged a failed COMMIT of the event after the app's 2xx."""
        return any(line.get("outcome") in COMMIT_FAILURES for line in self.logs)

    @property
    def settled_unstored(self) -> bool:
        """Whether a replica settled the event by its receipt but could not commit the claim
        (``commit_error``): its next copy is settled by the receipt again, nothing is lost."""
        return any(
            receipt_rule.settled_by_receipt(line) and "commit_error" in line for line in self.logs
        )

    @property
    def unsent(self) -> bool:
        return any(line.get("outcome") in UNSENT_OUTCOMES for line in self.logs)

    def superseded(self, records: Records) -> bool:
        """Whether the proxy superseded the event: answered a delivery ``superseded``, or its
        row says so (the redeliverer's)."""
        return records.inbox_states.get(self.event_id) == SUPERSEDED or any(
            d.dedup_status == SUPERSEDED for d in self.deliveries
        )

    def committed(self, delivery: Delivery) -> bool:
        """Whether the proxy logged ``delivery``'s claim committed on the connection that made
        it (``processed``, not ``reconciled`` on another): the claim then held its row lock
        until an acknowledged COMMIT, so no fault explains another forward of the event beside
        or after it. (Under the failover nemesis: the synchronous standby had the row before
        the primary acknowledged it, and a kill after that cannot take it.) Not a delivery
        settled by its receipt: its line says ``processed`` whether its claim was committed,
        stored again on a fresh connection (with no ``reconciled`` on that line), or not stored
        at all (``commit_error``)."""
        line = self.request_line(delivery)
        if line is None or line["outcome"] != "processed" or line.get("reconciled"):
            return False
        return not receipt_rule.settled_by_receipt(line)

    def kept_unsent(self, delivery: Delivery) -> bool:
        """Whether ``delivery`` was kept before the app was sent it: over the limit (or paused,
        or the app's Retry-After), or at a hand_off that passed before its attempt began (its
        line says ``kept_for: deadline`` with no ``handed_off``)."""
        if delivery.kept_for in UNSENT_KEEPS:
            return True
        if delivery.kept_for != HANDED_OFF:
            return False
        line = self.request_line(delivery)
        return line is not None and "handed_off" not in line

    @property
    def forwards(self) -> list[UpstreamCall]:
        """The calls that were a delivery's first forward (not a redelivery)."""
        return [c for c in self.calls if c not in self.redeliveries]

    @property
    def accepted(self) -> bool:
        return any(d.outcome == "ok" for d in self.deliveries)

    def request_line(self, delivery: Delivery) -> Mapping[str, Any] | None:
        """The proxy's line about this delivery (the provider sent its ID as X-Request-Id)."""
        return next(
            (
                line
                for line in self.logs
                if line.get("request_id") == delivery.delivery_id and "outcome" in line
            ),
            None,
        )

    def violation(
        self, records: Records, kind: str, message: str, actions: Iterable[Action] = ()
    ) -> Violation:
        evidence = _evidence(
            records,
            self.event_id,
            self.calls,
            self.deliveries,
            self.logs,
            actions,
            self.redeliveries,
        )
        return Violation(kind, self.event_id, message, evidence)


def split_calls(
    deliveries: Sequence[Delivery], calls: Sequence[UpstreamCall], unsent: Collection[str] = ()
) -> list[UpstreamCall]:
    """The redeliveries among one event's ``calls``: a delivery's first call while it was in
    flight, from the replica it was sent to, is its forward; any other call carrying its ID
    (the redeliverer sends the headers of the delivery it keeps) is a redelivery, and so is
    every call of a delivery kept ``unsent`` (the redeliverer may send it before its 202
    reached the provider). A keep can be committed while its replica still answers: one whose
    COMMIT failed in doubt answers 503, and another replica's lane may send the row first."""
    spans = {d.delivery_id: d for d in deliveries if d.delivery_id not in unsent}
    forwarded: set[str] = set()
    again: list[UpstreamCall] = []
    for call in sorted(calls, key=lambda c: c.start):
        delivery = spans.get(call.delivery_id or "")
        if delivery is None or delivery.delivery_id in forwarded:
            again.append(call)
        elif delivery.start <= call.start <= delivery.end and call.replica in (
            None,
            delivery.replica,
        ):
            forwarded.add(delivery.delivery_id)
        else:
            again.append(call)
    return again


def _check_event(records: Records, event: _Event) -> tuple[list[Violation], DoubleProcessed | None]:
    acted = sorted((c for c in event.calls if c.acted), key=lambda c: c.start)
    found = [
        *_loss_violations(records, event, acted),
        *_answer_violations(records, event),
        *_in_flight_twice(records, event),
    ]
    if records.inbox:
        found += _inbox_violations(records, event)
    if records.ledger is not None:  # the ledger's rule instead of counting 2xx answers
        problems = receipt_rule.event_problems(
            event.event_id, records.ledger, event.calls, event.accepted
        )
        found += [event.violation(records, kind, message) for kind, message in problems]
        found += _called_after_commit(records, event)
        return found, None
    if len(acted) < 2:
        return found, None
    unexplained, double = _double_processing(records, event, acted)
    if unexplained is not None:
        found.append(unexplained)
    return found, double


def _called_after_commit(records: Records, event: _Event) -> Iterator[Violation]:
    """The receipt mode's ``forwarded_after_commit``: no call of the event after one whose
    claim the proxy logged committed on its own connection (it held the row lock until an
    acknowledged COMMIT), whatever the later call's transaction did."""
    ordered = sorted(event.calls, key=lambda c: c.start)
    for call in ordered[:-1]:
        own = next((d for d in event.deliveries if d.delivery_id == call.delivery_id), None)
        if own is not None and call not in event.redeliveries and event.committed(own):
            message = (
                f"the app was called {len(ordered) - ordered.index(call) - 1} more time(s) "
                f"after delivery {own.delivery_id}'s claim had been committed (logged "
                "processed): a COMMIT the database acknowledged did not hold"
            )
            yield event.violation(records, "forwarded_after_commit", message)
            return


def _loss_violations(
    records: Records, event: _Event, acted: Sequence[UpstreamCall]
) -> Iterator[Violation]:
    """Nothing lost: a 2xx to the provider means the app acted (or the proxy superseded the
    event: ``order_rules`` judges that) and the claim row is there."""
    acked = [d for d in event.deliveries if d.outcome == "ok"]
    claimed = event.event_id in records.claimed
    taken = bool(acted) or event.superseded(records)
    if not acked and not records.inbox:  # with the inbox: refused (_refused_violations)
        yield event.violation(records, "unacknowledged", "no delivery answered 2xx, even settled")
    if acked and not taken:
        yield event.violation(records, "lost", "the provider got a 2xx, the app never acted")
    if acked and not claimed and not event.ambiguous and not event.settled_unstored:
        yield event.violation(
            records, "unclaimed", "the provider got a 2xx but no claim row exists"
        )
    if claimed and not taken:
        yield event.violation(
            records, "claimed_not_processed", "claim row committed, the app never acted"
        )


def _answer_violations(records: Records, event: _Event) -> Iterator[Violation]:
    """Only documented answers: the app's own answer to that delivery, or the proxy's."""
    forwards = event.forwards
    for d in event.deliveries:
        own = [c for c in forwards if c.delivery_id == d.delivery_id]
        relayed = any(c.status == d.status for c in own)
        own_answer = not d.duplicate and d.dedup_status not in (*KEPT_ANSWERS, SUPERSEDED)
        settled = receipt_rule.settled_by_receipt(event.request_line(d))
        if d.outcome == "ok" and own_answer and not relayed and not settled:
            message = f"delivery {d.delivery_id} got {d.status}, which no app call for it answered"
            yield event.violation(records, "ack_without_app", message)
        elif d.outcome == "failed" and d.status not in PROXY_ERRORS and not relayed:
            message = (
                f"delivery {d.delivery_id} got {d.status}: neither the app's answer nor one of "
                "the proxy's own (502, 503, 504)"
            )
            if any(c.acted for c in own):
                message += "; the app had acted on it (answered 2xx)"
            yield event.violation(records, "unexpected_answer", message)


def _inbox_violations(records: Records, event: _Event) -> Iterator[Violation]:
    """What a route that redelivers promises beyond the rest (see the module's docstring)."""
    yield from _forwarded_while_kept(records, event)
    yield from _kept_unexplained(records, event)
    yield from _not_kept(records, event)
    yield from _refused_violations(records, event)
    yield from _left_behind(records, event)


def _exposures_of(records: Records, event: _Event, call: UpstreamCall) -> list[tuple[str, str]]:
    if call in event.redeliveries:
        return redelivery_exposures(records, call, event.logs)
    own = next((d for d in event.deliveries if d.delivery_id == call.delivery_id), None)
    if own is not None and event.committed(own):
        return []  # its claim held its lock until an acknowledged COMMIT: no fault reached it
    reasons = exposures(records, call, own)
    if own is None or own.kept_for != HANDED_OFF:
        return reasons
    line = event.request_line(own)
    if _handed_off_unanswered(line, call):
        text = (
            f"delivery {own.delivery_id} handed off, its attempt ended with no answer from the "
            f"app, which answered {_rel(records, call.end)}"
        )
        reasons.append(("no_answer", text))
    if line is not None and line.get("handed_off") == "unrecorded":
        # The attempt's result could not be written when it ended (no free pool connection in
        # time, the link lost; the line says why): the row stays due at its lease's end and is
        # sent again then (docs/guarantees.md, the hand-off's window 1).
        why = line.get("commit_error", "")
        text = f"delivery {own.delivery_id} handed off, its result not recorded ({why})"
        reasons.append(("hand_off_unrecorded", text))
    return reasons


def _handed_off_unanswered(line: Mapping[str, Any] | None, call: UpstreamCall) -> bool:
    """Whether the proxy's ``line`` about a delivery it handed off says its attempt ended with
    no answer from the app (``handed_off: failed``, no ``upstream_status``) and ``call``'s
    answer came after the proxy had stopped waiting: the app saw the connection close first,
    or answered after the line was written. (The app times a call from its handler's start,
    which a busy harness can reach well after the proxy's send, so its own time under
    ``upstream.timeout`` does not show the proxy's timeout.)"""
    if line is None or line.get("handed_off") != "failed":
        return False
    if line.get("upstream_status") is not None:
        return False
    at = line.get("at")
    closed_first = call.dropped is not None and call.dropped < call.end
    return closed_first or (isinstance(at, float) and call.end >= at)


def _in_flight_twice(records: Records, event: _Event) -> Iterator[Violation]:
    """No call of the event starts while an earlier one is at the app, unless the earlier one's
    lock was lost or given up on (``exposures``)."""
    ordered = sorted(event.calls, key=lambda c: c.start)
    for n, later in enumerate(ordered):
        for earlier in ordered[:n]:
            if later.start < earlier.end and not _exposures_of(records, event, earlier):
                message = (
                    f"{_describe_call(records, later, later in event.redeliveries)} started "
                    f"while {_describe_call(records, earlier, earlier in event.redeliveries)} "
                    "was at the app, exposed to no window"
                )
                yield event.violation(records, "in_flight_twice", message)


def _forwarded_while_kept(records: Records, event: _Event) -> Iterator[Violation]:
    """No copy is forwarded once a delivery of the event was answered as kept."""
    kept = [d for d in event.deliveries if d.dedup_status in KEPT_ANSWERS]
    if not kept:
        return
    first = min(kept, key=lambda d: d.end)
    for call in event.forwards:
        if call.start > first.end:
            message = (
                f"a copy was forwarded ({_describe_call(records, call)}) after delivery "
                f"{first.delivery_id} had been answered {first.dedup_status}"
            )
            yield event.violation(records, "forwarded_while_kept", message)


def _kept_unexplained(records: Records, event: _Event) -> Iterator[Violation]:
    """A delivery answered ``queued`` (or ``dead_letter``) is one the app failed: the status in
    the answer is the app's own to it, or there was none within ``upstream.timeout``. One kept
    at the hand-off (``kept_for: deadline``) was still at the app ``hand_off`` after it
    arrived, and answered before the app's answer; one kept unsent was never forwarded (its
    calls are all redeliveries: ``split_calls``)."""
    forwards = event.forwards
    for d in event.deliveries:
        if d.dedup_status not in ("queued", "dead_letter"):
            continue
        own = [c for c in forwards if c.delivery_id == d.delivery_id]
        if d.kept_for == HANDED_OFF:
            # hand_off runs from the request's arrival: its claim may have waited on a copy's.
            # The app may answer while the keep commits: the 202 can come later than its answer.
            hand_off = records.hand_off
            failed = hand_off is not None and all(
                c.end >= d.start + hand_off - TIMEOUT_SLACK for c in own
            )
        elif d.kept_for is not None:
            failed = True
        elif d.upstream_status is None:
            slow = records.upstream_timeout - TIMEOUT_SLACK
            failed = all(c.end - c.start >= slow for c in own)
        else:
            failed = any(c.status == d.upstream_status and not c.acted for c in own)
        if not failed:
            answers = ", ".join(f"{c.status} in {c.end - c.start:.3f}s" for c in own) or "none"
            why = f" kept_for {d.kept_for}" if d.kept_for else ""
            message = (
                f"delivery {d.delivery_id} was answered {d.dedup_status}{why} with app status "
                f"{d.upstream_status}, the app's answers to it: {answers}"
            )
            yield event.violation(records, "kept_unexplained", message)


def _not_kept(records: Records, event: _Event) -> Iterator[Violation]:
    """The app's failure relayed instead of kept: only at the inbox's cap, or when keeping it
    could not be committed (a database fault on that replica). (An answer broken off after a
    2xx status line is relayed as 502 and its claim committed: the app took it.)"""
    for d in event.deliveries:
        line = event.request_line(d)
        if line is None or line.get("outcome") != "upstream_error" or line.get("inbox_full"):
            continue
        if str(line.get("upstream_status")).startswith("2"):
            continue
        if not _faults(records, d.replica, d.start, d.end):
            message = (
                f"delivery {d.delivery_id} got the app's failure ({d.status}) relayed, not "
                f"kept, with no database fault on {d.replica}"
            )
            yield event.violation(records, "not_kept", message)


def refusal(records: Records, event: _Event, delivery: Delivery) -> str | None:
    """Why the provider was told to retry ``delivery``: the proxy's logged answer, or the kill
    of its replica; None: no reason found."""
    answer = "no answer" if delivery.status is None else str(delivery.status)
    line = event.request_line(delivery)
    if line is not None:
        why = str(line.get("outcome"))
        if line.get("shed"):
            why += f" (shed: {line['shed']})"
        elif "still in flight" in str(line.get("error", "")):
            why += " (claim_wait)"
        return f"{answer} {why}"
    if _faults(records, delivery.replica, delivery.start, delivery.end, kinds=("kill",)):
        return f"{answer} (replica killed)"
    return None


def _refused_violations(records: Records, event: _Event) -> Iterator[Violation]:
    """An event the provider never got a 2xx for: each failed send explained."""
    if event.accepted:
        return
    if not event.deliveries:
        yield event.violation(records, "refused_unexplained", "never sent")
        return
    unexplained = [d.delivery_id for d in event.deliveries if refusal(records, event, d) is None]
    if unexplained:
        message = (
            f"refused, and {', '.join(unexplained)} failed with neither an answer the proxy "
            "logged nor its replica killed"
        )
        yield event.violation(records, "refused_unexplained", message)


def _left_behind(records: Records, event: _Event) -> Iterator[Violation]:
    """After the settle phase: no row pending; none dead but for an answer retrying cannot fix."""
    state = records.inbox_states.get(event.event_id)
    if state == "pending":
        yield event.violation(records, "still_pending", "its row is still pending after settling")
    elif state == "dead" and not any(c.status in UNFIXABLE for c in event.calls):
        message = "its row is dead, and the app never answered a status retrying cannot fix"
        yield event.violation(records, "dead", message)


def _double_processing(
    records: Records,
    event: _Event,
    acted: Sequence[UpstreamCall],
) -> tuple[Violation | None, DoubleProcessed]:
    """An event the app acted on more than once, and the violation if no window explains it."""
    reasons = []
    if event.unsent:
        reasons.append(
            ("unsent", "a replica logged that COMMIT could not be sent (commit_not_sent)")
        )
    elif event.ambiguous:
        reasons.append(("ambiguous", "a replica logged an ambiguous COMMIT"))
    unexposed = 0
    for call in acted[:-1]:
        why = _exposures_of(records, event, call)
        reasons += why
        unexposed += not why
    # A COMMIT acknowledged is final: a logged failure of another copy's COMMIT excuses nothing.
    committed = [
        d.delivery_id
        for call in acted[:-1]
        for d in event.deliveries
        if d.delivery_id == call.delivery_id and event.committed(d)
    ]
    explained = not committed and (event.ambiguous or not unexposed)
    unexplained = None
    shown = [a for a in records.actions if _near(a, acted)]
    if committed:
        message = (
            f"the app answered 2xx {len(acted)} times, though the claim of delivery "
            f"{', '.join(committed)} had been committed (logged processed): a COMMIT the "
            "database acknowledged did not hold"
        )
        unexplained = event.violation(records, "forwarded_after_commit", message, shown)
    elif not explained:
        message = (
            f"the app answered 2xx {len(acted)} times; {unexposed} earlier 2xx answer(s) "
            "exposed to no window"
        )
        unexplained = event.violation(records, "double_unexplained", message, shown)
    double = DoubleProcessed(
        event.event_id,
        len(acted),
        explained,
        tuple(text for _, text in reasons),
        frozenset(cause for cause, _ in reasons),
    )
    return unexplained, double


def events_of(records: Records) -> dict[str, _Event]:
    """Each event's share of the records (on a route that redelivers, its calls split)."""
    events = {event_id: _Event(event_id) for event_id in records.events}
    for d in records.deliveries:
        if d.event_id in events:
            events[d.event_id].deliveries.append(d)
    for c in records.calls:
        if c.event_id in events:
            events[c.event_id].calls.append(c)
    for line in records.logs:
        if line.get("event_id") in events:
            events[str(line["event_id"])].logs.append(line)
    if records.inbox:
        for event in events.values():
            unsent = {d.delivery_id for d in event.deliveries if event.kept_unsent(d)}
            event.redeliveries = split_calls(event.deliveries, event.calls, unsent)
    return events


def check(records: Records) -> tuple[Report, list[Violation]]:
    """Check the invariant over everything recorded; return the report and the violations."""
    events = events_of(records)
    deliveries = [d for d in records.deliveries if d.event_id in events]
    calls = [c for c in records.calls if c.event_id in events]
    logs = [line for line in records.logs if line.get("event_id") in events]

    violations: list[Violation] = []
    doubles: list[DoubleProcessed] = []
    for event in events.values():
        found, double = _check_event(records, event)
        violations += found
        if double is not None:
            doubles.append(double)
    violations += [
        Violation("post_check", None, f"{post.name}: {post.detail}", post.evidence)
        for post in records.post_checks
        if not post.ok
    ]
    unacknowledged = sum(v.kind == "unacknowledged" for v in violations)
    report = _report(records, deliveries, calls, logs, doubles, unacknowledged, violations)
    accepted = [e for e in events.values() if e.accepted]
    report = replace(
        report,
        accepted=len(accepted),
        delivered=sum(any(c.acted for c in e.calls) for e in accepted),
        superseded=sum(_superseded_only(records, e) for e in accepted),
        lost=len({v.event_id for v in violations if v.kind in LOSSES}),
    )
    if records.inbox:
        report = replace(report, inbox=_inbox_report(records, events.values()))
    if records.ledger is not None:
        receipts = receipt_rule.report(
            events, records.ledger, calls, deliveries, logs, records.upstream_timeout
        )
        report = replace(report, receipts=receipts)
    return report, violations


def _superseded_only(records: Records, event: _Event) -> bool:
    """Superseded, and never taken by the app."""
    return event.superseded(records) and not any(c.acted for c in event.calls)


def _inbox_report(records: Records, events: Collection[_Event]) -> InboxReport:
    accepted = [e for e in events if e.accepted]
    refused = [e for e in events if not e.accepted]
    reasons = Counter(
        refusal(records, e, d) or "unexplained" for e in refused for d in e.deliveries
    )
    healthy = Counter(
        refusal(records, e, d) or "unexplained"
        for e in refused
        for d in e.deliveries
        if not _faults(records, d.replica, d.start - DATABASE_LEAD, d.end, DATABASE_FAULTS)
    )
    failures = Counter(
        refusal(records, e, d) or "unexplained"
        for e in events
        for d in e.deliveries
        if d.outcome != "ok"
    )
    deliveries = [d for e in events for d in e.deliveries]
    kept = [d for d in deliveries if d.dedup_status in ("queued", "dead_letter")]
    again = [c for e in events for c in e.redeliveries]
    attempts = [line for e in events for line in e.logs if line.get("logger") == REDELIVERER]
    states = Counter(
        records.inbox_states.get(e.event_id, "none")
        for e in events
        if e.event_id in records.claimed
    )
    return InboxReport(
        accepted=len(accepted),
        delivered=sum(any(c.acted for c in e.calls) for e in accepted),
        refused=len(refused),
        refused_reasons=reasons,
        refused_healthy=healthy,
        refused_reached_app=sum(any(c.acted for c in e.calls) for e in refused),
        failed_reasons=failures,
        kept=len(kept),
        kept_for=Counter(d.kept_for or "failed" for d in kept),
        handed_off=Counter(
            str(line["handed_off"]) for e in events for line in e.logs if "handed_off" in line
        ),
        duplicate_queued=sum(d.dedup_status == "duplicate_queued" for d in deliveries),
        redeliveries=len(again),
        redeliveries_acted=sum(c.acted for c in again),
        results=Counter(str(line.get("result")) for line in attempts),
        rows=states,
        peak_at_app=peak_at_app([c for e in events for c in e.calls]),
        superseded=sum(_superseded_only(records, e) for e in accepted),
    )


def peak_at_app(calls: Iterable[UpstreamCall]) -> dict[str, int]:
    """Per replica, the most of its calls at the app at once (by the app's clock; a call the
    proxy gave up on, at upstream.timeout or killed, still counts while the app works on it)."""
    steps: dict[str, list[tuple[float, int]]] = {}
    for call in calls:
        mine = steps.setdefault(call.replica or "?", [])
        mine += [(call.start, 1), (call.end, -1)]
    peaks = {}
    for replica, edges in steps.items():
        level = peak = 0
        for _, step in sorted(edges):  # an end before a start at the same instant
            level += step
            peak = max(peak, level)
        peaks[replica] = peak
    return dict(sorted(peaks.items()))


def _report(
    records: Records,
    deliveries: Sequence[Delivery],
    calls: Sequence[UpstreamCall],
    logs: Sequence[Mapping[str, Any]],
    doubles: Sequence[DoubleProcessed],
    unacknowledged: int,
    violations: Sequence[Violation],
) -> Report:
    outcomes = Counter(str(line["outcome"]) for line in logs if "outcome" in line)
    waits = [
        (float(line["claim_ms"]), line)
        for line in logs
        if isinstance(line.get("claim_ms"), int | float)
    ]
    longest_ms, at = max(waits, key=lambda w: w[0], default=(0.0, {}))
    longest_at = f"{at.get('event_id')} on {at.get('replica')} ({at.get('outcome')})" if at else "-"
    durations = [d.end - d.start for d in deliveries]
    return Report(
        settings=dict(records.settings),
        events=len(records.events),
        deliveries={
            outcome: sum(d.outcome == outcome for d in deliveries)
            for outcome in ("ok", "failed", "indeterminate")
        },
        by_phase=Counter(d.phase for d in deliveries),
        statuses=Counter(str(d.status) if d.status is not None else "none" for d in deliveries),
        duplicate_answers=sum(d.duplicate for d in deliveries),
        upstream_calls=len(calls),
        upstream_acted=sum(c.acted for c in calls),
        late_answers=sum(c.end - c.start > records.upstream_timeout - LATE_SLACK for c in calls),
        double_processed=tuple(doubles),
        ambiguous_commits=sum(outcomes[o] for o in AMBIGUOUS_OUTCOMES),
        unsent_commits=sum(outcomes[o] for o in UNSENT_OUTCOMES),
        reconciled=sum(bool(line.get("reconciled")) for line in logs),
        outcomes=dict(outcomes),
        actions=Counter(a.kind for a in records.actions),
        longest_wait_ms=longest_ms,
        longest_wait_at=longest_at,
        longest_delivery=max(durations, default=0.0),
        over_bound=sum(t > records.request_bound for t in durations),
        start_failures=sum(
            str(line.get("msg", "")).startswith("cannot start") for line in records.logs
        ),
        unhandled=Counter(
            _raised_at(str(line.get("exc", "")))
            for line in records.logs
            if str(line.get("msg", "")).startswith("Error handling request")
        ),
        unacknowledged=unacknowledged,
        post_checks=tuple(records.post_checks),
        violations=tuple(violations),
    )


def _raised_at(traceback: str) -> str:
    """``file:line function: last line`` of a logged traceback's innermost proxy frame."""
    frames = [
        line.strip()
        for line in traceback.splitlines()
        if line.strip().startswith('File "') and "/proxy/" in line
    ]
    where = ""
    if frames:
        # File "/…/proxy/database/__init__.py", line 114, in release
        path, _, rest = frames[-1][6:].partition('", line ')
        number, _, function = rest.partition(", in ")
        where = f"{path.rpartition('/proxy/')[2]}:{number} {function}: "
    last = traceback.strip().splitlines()[-1] if traceback.strip() else "?"
    return where + last[:120]


def _causes(doubles: Sequence[DoubleProcessed]) -> str:
    counts = Counter(cause for d in doubles if d.explained for cause in d.causes)
    return _counts(counts)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _superseded_text(superseded: int) -> str:
    return f"superseded {superseded} (never at the app), " if superseded else ""


def _inbox_rows(inbox: InboxReport) -> list[tuple[str, str]]:
    results = _counts(inbox.results)
    return [
        (
            "inbox: accepted",
            f"{inbox.accepted} events (a 2xx to the provider); delivered {inbox.delivered} "
            f"(the app answered 2xx), {_superseded_text(inbox.superseded)}lost {inbox.lost}",
        ),
        (
            "  refused",
            f"{inbox.refused} events (every send failed: the provider was told to retry; "
            f"reached the app all the same {inbox.refused_reached_app})",
        ),
        ("  refused sends by", _counts(inbox.refused_reasons)),
        ("    with no database fault", _counts(inbox.refused_healthy)),
        ("  every failed send by", _counts(inbox.failed_reasons)),
        (
            "  kept",
            f"{inbox.kept} answered queued ({_counts(inbox.kept_for)}), "
            f"{inbox.duplicate_queued} duplicate_queued",
        ),
        ("  handed off, then", _counts(inbox.handed_off)),
        ("  peak at the app", _counts(inbox.peak_at_app)),
        (
            "  redeliveries",
            f"{inbox.redeliveries} calls at the app (2xx {inbox.redeliveries_acted}); "
            f"logged: {results}",
        ),
        ("  rows at the end", _counts(inbox.rows)),
    ]


def format_report(report: Report, *, evidence: int = 2, per_kind: int = 10) -> str:
    """The report as a table, then the violations: ``per_kind`` of each kind, the first
    ``evidence`` of each kind with their evidence."""
    deliveries = report.deliveries
    total = sum(deliveries.values())
    rows = [
        ("settings", " ".join(f"{k}={v}" for k, v in report.settings.items())),
        ("events", str(report.events)),
        (
            "deliveries",
            f"{total} (ok {deliveries['ok']}, failed {deliveries['failed']}, "
            f"indeterminate {deliveries['indeterminate']}; {_counts(report.by_phase)})",
        ),
        ("  answered", _counts(report.statuses)),
        ("  duplicate answers", str(report.duplicate_answers)),
        (
            "upstream calls",
            f"{report.upstream_calls} ({'committed' if report.receipts else '2xx'} "
            f"{report.upstream_acted}, "
            f"answered after upstream.timeout {report.late_answers})",
        ),
        (
            "double processed",
            f"{len(report.double_processed)} (explained {report.explained}, "
            f"unexplained {report.unexplained})",
        ),
        ("  explained by", _causes(report.double_processed)),
        (
            "ambiguous commits",
            f"{report.ambiguous_commits} logged ambiguous, {report.unsent_commits} not sent "
            f"and not stored again (COMMIT in doubt and reconciled: "
            f"{report.reconciled})",
        ),
        ("proxy outcomes", _counts(report.outcomes)),
        ("nemesis actions", _counts(report.actions)),
        ("longest claim wait", f"{report.longest_wait_ms:.0f} ms ({report.longest_wait_at})"),
        (
            "longest delivery",
            f"{report.longest_delivery:.2f} s ({report.over_bound} over the configured bound)",
        ),
        *(
            _inbox_rows(report.inbox)
            if report.inbox
            else [
                (
                    "accepted",
                    f"{report.accepted} events (a 2xx to the provider); delivered "
                    f"{report.delivered} (the app answered 2xx), "
                    f"{_superseded_text(report.superseded)}lost {report.lost}",
                ),
                ("unacknowledged", str(report.unacknowledged)),
            ]
        ),
        *(receipt_rule.rows(report.receipts) if report.receipts else []),
        *report.extra,
        ("replica start failures", str(report.start_failures)),
        ("unhandled proxy errors", str(sum(report.unhandled.values()))),
    ]
    rows += [(f"  {n} x", where) for where, n in Counter(report.unhandled).most_common()]
    rows += [
        (
            f"post-check {p.name}",
            ("ok" if p.ok else "FAILED") + (f": {p.detail}" if p.detail else ""),
        )
        for p in report.post_checks
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    if not report.violations:
        lines.append("violations: none")
        return "\n".join(lines)
    kinds = Counter(v.kind for v in report.violations)
    lines.append(f"VIOLATIONS: {len(report.violations)} ({_counts(kinds)})")
    shown: Counter[str] = Counter()
    for v in report.violations:
        shown[v.kind] += 1
        if shown[v.kind] <= per_kind:
            lines.append(f"- [{v.kind}] {v.event_id or ''} {v.message}")
        if shown[v.kind] <= evidence:
            lines += [f"    {e}" for e in v.evidence]
    lines += [f"- [{kind}] ... {n - per_kind} more" for kind, n in kinds.items() if n > per_kind]
    return "\n".join(lines)
