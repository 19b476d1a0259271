"""The campaign's checker: pure functions from what was recorded to a report and its violations.

The invariant, per event ID (docs/guarantees.md):

- **Nothing lost.** If the provider ever got a 2xx for the event, the app answered 2xx for it at
  least once, and the event's claim row is in the table (the row is excused when a replica
  logged an ambiguous COMMIT for the event). A relayed 2xx (not a duplicate answer) is the app's
  own answer to that very delivery. A committed claim whose event the app never took is a loss
  too (every later delivery would be swallowed as a duplicate), and so is an event the provider
  never got acknowledged, even after the settle phase.
- **At most once, outside the documented windows.** The app answers 2xx for an event at most
  once, unless every 2xx answer but the last one (in the order the calls started, which is the
  order the row lock let them through) is *exposed* to a window: the call answered after
  ``upstream.timeout`` (the proxy gave up and rolled back) or its delivery got a 504; or a
  replica kill, a database-link blackhole, reset or refusal on the replica that made the call,
  or a PostgreSQL restart, overlaps the time from the claim until its COMMIT must have ended
  (``commit_margin`` after the answer); or a replica logged an ambiguous COMMIT for the event.
  Such events are counted as *explained* double processing; any other is a violation.
- **Only documented answers.** A non-2xx answer is either the app's own answer to that very
  delivery or one of the proxy's own (502, 503, 504); anything else (a 500 from an unhandled
  exception, say) breaks the situation table in the README.

All times are seconds on one monotonic clock (the campaign's).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Nemesis actions during which a claim can be lost after the app acted.
WINDOW_KINDS = frozenset({"kill", "pg_restart", "blackhole", "reset", "refuse"})
# The action kind whose target is every replica.
GLOBAL_KINDS = frozenset({"pg_restart"})
# Log outcomes of a COMMIT whose result the proxy does not know (old and new spelling).
AMBIGUOUS_OUTCOMES = frozenset({"ambiguous_commit", "commit_failed"})
# The proxy's own error answers (README: 503 store unavailable, 502/504 upstream failed).
PROXY_ERRORS = frozenset({502, 503, 504})
# A fault this long before the app saw the request can still hit the claim made just before.
CLAIM_LEAD = 0.5
_EVIDENCE_LINES = 40


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

    @property
    def acted(self) -> bool:
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

    @property
    def explained(self) -> int:
        return sum(d.explained for d in self.double_processed)

    @property
    def unexplained(self) -> int:
        return sum(not d.explained for d in self.double_processed)


def _rel(records: Records, t: float) -> str:
    return f"t={t - records.origin:.3f}"


def _describe_call(records: Records, call: UpstreamCall) -> str:
    return (
        f"upstream call {_rel(records, call.start)}..{_rel(records, call.end)} "
        f"({call.end - call.start:.3f}s) via {call.replica} delivery {call.delivery_id} "
        f"-> {call.status}"
    )


def _describe_delivery(records: Records, d: Delivery) -> str:
    answer = d.status if d.status is not None else f"no answer ({d.error})"
    dup = " duplicate" if d.duplicate else ""
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
) -> tuple[str, ...]:
    lines = [_describe_call(records, c) for c in sorted(calls, key=lambda c: c.start)]
    lines += [_describe_delivery(records, d) for d in sorted(deliveries, key=lambda d: d.start)]
    lines += [_describe_action(records, a) for a in actions]
    lines += ["log " + json.dumps(dict(line), sort_keys=True, default=str) for line in logs]
    if len(lines) > _EVIDENCE_LINES:
        lines = [*lines[:_EVIDENCE_LINES], f"... {len(lines) - _EVIDENCE_LINES} more"]
    return (f"event {event_id}", *lines)


def _windows(records: Records, call: UpstreamCall) -> list[Action]:
    low = call.start - CLAIM_LEAD
    high = call.end + records.commit_margin
    return [
        a
        for a in records.actions
        if a.kind in WINDOW_KINDS
        and (a.kind in GLOBAL_KINDS or a.target == call.replica)
        and a.start <= high
        and a.end >= low
    ]


def _near(action: Action, calls: Sequence[UpstreamCall], within: float = 5.0) -> bool:
    return any(action.start <= c.end + within and action.end >= c.start - within for c in calls)


def exposures(
    records: Records, call: UpstreamCall, delivery: Delivery | None
) -> list[tuple[str, str]]:
    """Why the claim behind this 2xx answer may legitimately have been lost, as (cause,
    description) pairs; empty: no documented reason."""
    reasons: list[tuple[str, str]] = []
    took = call.end - call.start
    if took > records.upstream_timeout:
        reasons.append(("late", f"answered after {took:.3f}s > upstream.timeout"))
    if delivery is not None and delivery.status == 504:
        reasons.append(("504", f"delivery {delivery.delivery_id} got 504"))
    reasons += [(a.kind, _describe_action(records, a)) for a in _windows(records, call)]
    return reasons


@dataclass(slots=True)
class _Event:
    """One event's share of the records."""

    event_id: str
    deliveries: list[Delivery] = field(default_factory=list)
    calls: list[UpstreamCall] = field(default_factory=list)
    logs: list[Mapping[str, Any]] = field(default_factory=list)

    @property
    def ambiguous(self) -> bool:
        return any(line.get("outcome") in AMBIGUOUS_OUTCOMES for line in self.logs)

    def violation(
        self, records: Records, kind: str, message: str, actions: Iterable[Action] = ()
    ) -> Violation:
        evidence = _evidence(
            records, self.event_id, self.calls, self.deliveries, self.logs, actions
        )
        return Violation(kind, self.event_id, message, evidence)


def _check_event(
    records: Records, event: _Event, by_delivery: Mapping[str, Delivery]
) -> tuple[list[Violation], DoubleProcessed | None]:
    acted = sorted((c for c in event.calls if c.acted), key=lambda c: c.start)
    found = [*_loss_violations(records, event, acted), *_answer_violations(records, event)]
    if len(acted) < 2:
        return found, None
    unexplained, double = _double_processing(records, event, acted, by_delivery)
    if unexplained is not None:
        found.append(unexplained)
    return found, double


def _loss_violations(
    records: Records, event: _Event, acted: Sequence[UpstreamCall]
) -> Iterator[Violation]:
    """Nothing lost: a 2xx to the provider means the app acted and the claim row is there."""
    acked = [d for d in event.deliveries if d.outcome == "ok"]
    claimed = event.event_id in records.claimed
    if not acked:
        yield event.violation(records, "unacknowledged", "no delivery answered 2xx, even settled")
    if acked and not acted:
        yield event.violation(records, "lost", "the provider got a 2xx, the app never acted")
    if acked and not claimed and not event.ambiguous:
        yield event.violation(
            records, "unclaimed", "the provider got a 2xx but no claim row exists"
        )
    if claimed and not acted:
        yield event.violation(
            records, "claimed_not_processed", "claim row committed, the app never acted"
        )


def _answer_violations(records: Records, event: _Event) -> Iterator[Violation]:
    """Only documented answers: the app's own answer to that delivery, or the proxy's."""
    for d in event.deliveries:
        own = [c for c in event.calls if c.delivery_id == d.delivery_id]
        relayed = any(c.status == d.status for c in own)
        if d.outcome == "ok" and not d.duplicate and not relayed:
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


def _double_processing(
    records: Records,
    event: _Event,
    acted: Sequence[UpstreamCall],
    by_delivery: Mapping[str, Delivery],
) -> tuple[Violation | None, DoubleProcessed]:
    """An event the app acted on more than once, and the violation if no window explains it."""
    reasons = [("ambiguous", "a replica logged an ambiguous COMMIT")] if event.ambiguous else []
    unexposed = 0
    for call in acted[:-1]:
        why = exposures(records, call, by_delivery.get(call.delivery_id or ""))
        reasons += why
        unexposed += not why
    explained = event.ambiguous or not unexposed
    unexplained = None
    if not explained:
        message = (
            f"the app answered 2xx {len(acted)} times; {unexposed} earlier 2xx answer(s) "
            "exposed to no window"
        )
        shown = [a for a in records.actions if _near(a, acted)]
        unexplained = event.violation(records, "double_unexplained", message, shown)
    double = DoubleProcessed(
        event.event_id,
        len(acted),
        explained,
        tuple(text for _, text in reasons),
        frozenset(cause for cause, _ in reasons),
    )
    return unexplained, double


def check(records: Records) -> tuple[Report, list[Violation]]:
    """Check the invariant over everything recorded; return the report and the violations."""
    events = {event_id: _Event(event_id) for event_id in records.events}
    deliveries = [d for d in records.deliveries if d.event_id in events]
    calls = [c for c in records.calls if c.event_id in events]
    logs = [line for line in records.logs if line.get("event_id") in events]
    for d in deliveries:
        events[d.event_id].deliveries.append(d)
    for c in calls:
        events[c.event_id].calls.append(c)
    for line in logs:
        events[str(line["event_id"])].logs.append(line)
    by_delivery = {d.delivery_id: d for d in deliveries}

    violations: list[Violation] = []
    doubles: list[DoubleProcessed] = []
    for event in events.values():
        found, double = _check_event(records, event, by_delivery)
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
    return report, violations


def _report(
    records: Records,
    deliveries: Sequence[Delivery],
    calls: Sequence[UpstreamCall],
    logs: Sequence[Mapping[str, Any]],
    doubles: Sequence[DoubleProcessed],
    unacknowledged: int,
    violations: Sequence[Violation],
) -> Report:
    outcomes = Counter(str(line.get("outcome")) for line in logs)
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
        late_answers=sum(c.end - c.start > records.upstream_timeout for c in calls),
        double_processed=tuple(doubles),
        ambiguous_commits=sum(outcomes[o] for o in AMBIGUOUS_OUTCOMES),
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
            f"{report.upstream_calls} (2xx {report.upstream_acted}, "
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
            f"{report.ambiguous_commits} logged ambiguous (COMMIT in doubt and reconciled: "
            f"{report.reconciled})",
        ),
        ("proxy outcomes", _counts(report.outcomes)),
        ("nemesis actions", _counts(report.actions)),
        ("longest claim wait", f"{report.longest_wait_ms:.0f} ms ({report.longest_wait_at})"),
        (
            "longest delivery",
            f"{report.longest_delivery:.2f} s ({report.over_bound} over the configured bound)",
        ),
        ("unacknowledged", str(report.unacknowledged)),
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
