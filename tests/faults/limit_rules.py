"""The checker's rules for the campaign's ``--shared-limit`` mode: pure functions from what was
recorded, over the report of the mode's other rules.

Every replica has ``upstream.concurrency: {limit: N, shared: true}`` on the one claim table
(``Records.shared_limit``): a place is a row locked in the transaction that holds the delivery
at the app (a first delivery's claim, a redelivery's take, a hand-off's second transaction), so
it is freed by that transaction's COMMIT or ROLLBACK, or by its connection dying. The app
records when each call started and ended, and when the proxy's connection closed before the
answer (``UpstreamCall.dropped``): the proxy stopped waiting on it (its ``upstream.timeout``
fired, its replica was killed) and rolled its transaction back, or the transaction died with
the replica's connections; the app works on, but the call holds no place any more. So a call
counts *strictly* while the proxy still waits on it (``UpstreamCall.waited_until``), *loosely*
until the app answers; only the strict count is bounded (docs/guarantees.md, "A limit shared
by every replica").

- **At most N at the app.** At no instant are more than N calls at the app that a proxy still
  waits on, unless the surplus lost its places under it: a call is *exposed* from the moment a
  fault that ends its transaction while the call is at the app begins (``PLACE_LOSSES``: a
  PostgreSQL restart or the primary's kill, which end every transaction; a reset or refusal of
  its replica's database link, which closes its connections, so PostgreSQL rolls back; the
  fault may begin up to ``checker.CLAIM_LEAD`` before the call, between its take and its
  start). The proxy does not learn of it until its COMMIT, so it still waits, and another
  replica may take the place meanwhile. At every instant the calls waited on and not exposed
  are at most N (``over_shared_limit``). A call that was a delivery's first forward whose
  claim the proxy logged committed on its own connection (``processed``, not ``reconciled``)
  is exposed to nothing: its transaction lived until after the answer. A blackhole ends no
  transaction (every socket stays open, no byte moves), nor does a replica's kill leave a call
  waited on (its connections to the app and the database close together), so neither is an
  excuse.

The report counts the calls, those the proxy stopped waiting on (by why: ``late``, its answer
after ``upstream.timeout``; ``kill``, its replica killed; ``stop``, a redelivery of the last
post-check's given up on by the replicas' drain at the end; ``other``), the most at the app at
once counted both ways and counted strictly without the exposed ones, and the instants over N
(explained, unexplained).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from tests.faults import checker

# The faults that end the transaction of a call at the app on the replica they hit (or on
# every replica: the database's own): its place freed while the proxy still waits.
PLACE_LOSSES = frozenset({"pg_restart", "failover", "reset", "refuse"})
# A drop this close to upstream.timeout after the call's start is the proxy's timeout (the
# app's clock starts after the proxy's: checker.LATE_SLACK).
_LATE_DROP = checker.LATE_SLACK


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitReport:
    limit: int
    calls: int  # every call at the app, the post-checks' too
    dropped: Mapping[str, int]  # calls the proxy stopped waiting on before the answer, by why
    peak_strict: int  # the most at the app at once that a proxy still waited on
    peak_loose: int  # the most at the app at once, abandoned ones until the app answered
    peak_held: int  # the most waited on and not exposed: holding their places for sure
    over: int  # instants (starts) at which more than the limit were waited on
    over_causes: Mapping[str, int]  # of the explained ones, by the faults that exposed calls
    over_unexplained: int  # of which more than the limit not exposed

    def rows(self) -> tuple[tuple[str, str], ...]:
        return (
            (
                "shared limit",
                f"{self.limit} at the app from every replica; {self.calls} calls, the proxy "
                f"stopped waiting on {sum(self.dropped.values())} "
                f"({checker._counts(self.dropped)})",
            ),
            (
                "  peak at the app",
                f"{self.peak_strict} waited on (strict), {self.peak_loose} with the abandoned "
                f"(loose), {self.peak_held} waited on and not exposed",
            ),
            (
                "  over the limit",
                f"{self.over} times (explained {self.over - self.over_unexplained}, places lost "
                f"to {checker._counts(self.over_causes)}; unexplained {self.over_unexplained})",
            ),
        )


_NEVER = (float("inf"), "")


def exposed_from(records: checker.Records, call: checker.UpstreamCall) -> tuple[float, str]:
    """From when ``call``'s place may have been freed under it, and by what: the start of the
    first fault in ``PLACE_LOSSES`` on its replica (or the database) that overlaps it, from its
    claim on (infinity: none did)."""
    low = call.start - checker.CLAIM_LEAD
    return min(
        (
            (max(call.start, a.start), a.kind)
            for a in records.actions
            if a.kind in PLACE_LOSSES
            and (a.kind in checker.GLOBAL_KINDS or a.target == call.replica)
            and a.start <= call.waited_until
            and a.end >= low
        ),
        default=_NEVER,
    )


def _held_throughout(records: checker.Records) -> set[int]:
    """The calls (ids) that were a delivery's first forward whose claim the proxy logged
    committed on its own connection (``checker._Event.committed``): its transaction, and the
    place in it, lived until after the answer, whatever the faults around it."""
    held = set()
    for event in checker.events_of(records).values():
        for call in event.forwards:
            own = next((d for d in event.deliveries if d.delivery_id == call.delivery_id), None)
            if own is not None and event.committed(own):
                held.add(id(call))
    return held


def _why_dropped(records: checker.Records, call: checker.UpstreamCall) -> str:
    assert call.dropped is not None
    if call.dropped >= records.stopped:
        return "stop"
    if call.dropped - call.start >= records.upstream_timeout - _LATE_DROP:
        return "late"
    killed = any(
        a.kind == "kill" and a.target == call.replica and a.start <= call.dropped <= a.end + 0.5
        for a in records.actions
    )
    return "kill" if killed else "other"


def _peak(spans: Sequence[tuple[float, float]]) -> int:
    edges = sorted(
        [(start, 1) for start, end in spans if end > start]
        + [(end, -1) for start, end in spans if end > start]
    )  # an end before a start at the same instant
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def check(records: checker.Records, report: checker.Report) -> tuple[checker.Report, LimitReport]:
    """``report`` (of the mode's other rules) with this mode's violations and rows; its counts
    apart."""
    limit = records.shared_limit
    if limit is None:
        raise ValueError("the shared limit's rules need the limit (Records.shared_limit)")
    calls = list(records.calls)
    throughout = _held_throughout(records)
    exposure = {id(c): _NEVER if id(c) in throughout else exposed_from(records, c) for c in calls}
    strict = [(c.start, c.waited_until) for c in calls]
    held = [(c.start, min(c.waited_until, exposure[id(c)][0])) for c in calls]
    found: list[checker.Violation] = []
    over = unexplained = 0
    causes: Counter[str] = Counter()
    waited: list[checker.UpstreamCall] = []
    # The count only grows when a call starts: looking at each start is looking at every instant.
    for call in sorted(calls, key=lambda c: c.start):
        t = call.start
        waited = [c for c in (*waited, call) if t < c.waited_until]
        if len(waited) <= limit:
            continue
        over += 1
        holding = [c for c in waited if t < exposure[id(c)][0]]
        if len(holding) <= limit:
            causes.update({exposure[id(c)][1] for c in waited if c not in holding})
            continue
        unexplained += 1
        found.append(_violation(records, limit, t, waited, exposure))
    summary = LimitReport(
        limit=limit,
        calls=len(calls),
        dropped=Counter(_why_dropped(records, c) for c in calls if c.dropped is not None),
        peak_strict=_peak(strict),
        peak_loose=_peak([(c.start, c.end) for c in calls]),
        peak_held=_peak(held),
        over=over,
        over_causes=causes,
        over_unexplained=unexplained,
    )
    amended = replace(
        report, violations=(*report.violations, *found), extra=(*report.extra, *summary.rows())
    )
    return amended, summary


def _violation(
    records: checker.Records,
    limit: int,
    t: float,
    waited: Sequence[checker.UpstreamCall],
    exposure: Mapping[int, tuple[float, str]],
) -> checker.Violation:
    holding = [c for c in waited if t < exposure[id(c)][0]]
    message = (
        f"{len(waited)} calls at the app at {checker._rel(records, t)} that a proxy still waited "
        f"on, {len(holding)} of them exposed to no fault that frees a place: over the shared "
        f"limit of {limit}"
    )
    evidence = [
        checker._describe_call(records, c)
        + (f", dropped {checker._rel(records, c.dropped)}" if c.dropped is not None else "")
        + ("" if c in holding else ", exposed")
        for c in sorted(waited, key=lambda c: c.start)
    ]
    evidence += [
        checker._describe_action(records, a)
        for a in records.actions
        if checker._near(a, waited, within=2.0)
    ]
    return checker.Violation("over_shared_limit", waited[-1].event_id, message, tuple(evidence))
