"""The checker's rules for the campaign's ``--reconcile`` mode (``reconcile_sender``): pure
functions from what was recorded, over ``checker.check``'s own.

With a reconciler an event whose every send the proxy refused is no longer *refused*: GitHub's
log has it as failed, and the reconciler asks GitHub to redeliver it. So, per event:

- **Nothing lost.** Every event sent reaches the app at least once (an acted call). One whose
  every send of the provider's own failed and that reached the app was *recovered*; one that
  never reached it is ``not_recovered`` (evidence: the stand-in's log of the event, the
  reconciler's asks, and the replicas' reconcile lines), beside the checker's own ``lost`` for
  an event the provider got a 2xx for.
- **Never asked for with a claim.** The reconciler asks only for events without a claim: an ask
  after the app took the event (an acted call that ended before the ask) whose claim no window
  explains the loss of (``checker``'s exposures: a fault on its replica, an answer after
  ``upstream.timeout``, a failed COMMIT…), or after the proxy logged the event kept (a committed
  row), is ``reconciled_claimed``. A recovered event's later copies are duplicates by
  construction; a double the recovery makes is judged by the checker's windows as any other.

The report counts, by name: refused, recovered, not recovered, lost, the asks (and the asked
events that never reached the app after their ask), the reconcile runs the replicas logged, the
gaps they found, and their API and database errors.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tests.faults import checker

PHASE = "reconcile"  # a Delivery the reconciler asked for
RECONCILER = "proxy.reconciler"  # the logger of the reconciler's lines
RUN = "reconcile of route "  # how each line about a run begins
# A committed keep: the row exists, whatever became of the answer.
KEPT_OUTCOMES = frozenset({"queued", "dead_letter", "duplicate_queued"})
_SHOWN_RUNS = 6


@dataclass(frozen=True, slots=True)
class Ask:
    """The reconciler asked the stand-in to redeliver attempt ``ref`` of ``event_id``."""

    event_id: str
    ref: int
    at: float


@dataclass(frozen=True, slots=True)
class Logged:
    """An attempt in the stand-in's log (``status`` 0: no answer)."""

    event_id: str
    ref: int
    status: int
    redelivery: bool
    at: float

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovery:
    """What the stand-in of GitHub's API recorded."""

    asks: Sequence[Ask]
    logged: Sequence[Logged]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconcileReport:
    refused: int  # events every send of the provider's own failed
    recovered: int  # of those, the ones that reached the app
    lost: int  # events sent that never reached the app
    asks: int  # redeliveries the reconciler asked for
    asked_events: int
    asked_not_arrived: int  # asked-for events that did not reach the app after the ask
    runs: int  # reconcile runs the replicas logged
    gaps: int  # gaps found, summed over the runs (one left for the next run counts again)
    errors: Mapping[str, int]  # runs cut short: API errors (by message) and the database's

    @property
    def not_recovered(self) -> int:
        return self.refused - self.recovered

    def rows(self) -> tuple[tuple[str, str], ...]:
        return (
            (
                "reconcile: refused",
                f"{self.refused} events (every send of the provider's own failed); recovered "
                f"{self.recovered}, not recovered {self.not_recovered}; lost {self.lost}",
            ),
            (
                "  asked",
                f"{self.asks} redeliveries of {self.asked_events} events; asked but not arrived "
                f"{self.asked_not_arrived}",
            ),
            ("  runs", f"{self.runs} logged, {self.gaps} gaps found over them"),
            ("  errors", checker._counts(self.errors)),
        )


def runs(logs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The replicas' lines that end a reconcile run (one per run, with its ``gaps``)."""
    return [line for line in logs if line.get("logger") == RECONCILER and "gaps" in line]


def errors_of(logs: Iterable[Mapping[str, Any]]) -> Counter[str]:
    """The reconciler's warnings: a run stopped by the API, the database not answering."""
    counts: Counter[str] = Counter()
    for line in logs:
        message = str(line.get("msg", ""))
        if line.get("logger") != RECONCILER or line.get("level") not in ("warning", "error"):
            continue
        if " stopped: " in message:
            counts["api: " + message.partition(" stopped: ")[2].partition(" (the next")[0]] += 1
        elif "does not answer" in message:
            counts["database"] += 1
        elif "period ended" in message:
            counts["period ended with gaps left"] += 1
        else:
            counts[message[:60]] += 1
    return counts


def check(records: checker.Records, recovery: Recovery) -> tuple[checker.Report, ReconcileReport]:
    """``checker.check``'s report, with this mode's violations and rows; its counts apart."""
    report, _ = checker.check(records)
    events = checker.events_of(records)
    asks: dict[str, list[Ask]] = {}
    for ask in recovery.asks:
        asks.setdefault(ask.event_id, []).append(ask)
    found: list[checker.Violation] = []
    for event in events.values():
        found += _violations(records, recovery, event, asks.get(event.event_id, []))
    sent = [e for e in events.values() if e.deliveries]
    refused = [e for e in sent if _refused(e)]
    asked_not_arrived = sum(
        not any(c.acted and c.start >= min(a.at for a in mine) for c in events[event_id].calls)
        for event_id, mine in asks.items()
        if event_id in events
    )
    summary = ReconcileReport(
        refused=len(refused),
        recovered=sum(_reached(e) for e in refused),
        lost=sum(not _reached(e) for e in sent),
        asks=len(recovery.asks),
        asked_events=len(asks),
        asked_not_arrived=asked_not_arrived,
        runs=len(runs(records.logs)),
        gaps=sum(int(line.get("gaps") or 0) for line in runs(records.logs)),
        errors=errors_of(records.logs),
    )
    amended = replace(
        report,
        violations=(*report.violations, *found),
        lost=summary.lost,
        extra=(*report.extra, *summary.rows()),
    )
    return amended, summary


def _refused(event: Any) -> bool:
    own = [d for d in event.deliveries if d.phase != PHASE]
    return bool(own) and not any(d.outcome == "ok" for d in own)


def _reached(event: Any) -> bool:
    return any(c.acted for c in event.calls)


def _violations(
    records: checker.Records, recovery: Recovery, event: Any, asks: Sequence[Ask]
) -> Iterator[checker.Violation]:
    if event.deliveries and _refused(event) and not _reached(event):
        violation = event.violation(
            records,
            "not_recovered",
            f"every send was refused and the event never reached the app; the reconciler "
            f"asked for it {len(asks)} time(s)",
        )
        yield replace(violation, evidence=violation.evidence + _recovery_evidence(
            records, recovery, event.event_id, asks))  # fmt: skip
    for ask in asks:
        claimed = _claimed_before(records, event, ask.at)
        if claimed:
            message = (
                f"the reconciler asked for it at {checker._rel(records, ask.at)} (attempt "
                f"{ask.ref}), though it had a claim: {claimed}"
            )
            violation = event.violation(records, "reconciled_claimed", message)
            yield replace(violation, evidence=violation.evidence + _recovery_evidence(
                records, recovery, event.event_id, asks))  # fmt: skip
            return


def _claimed_before(records: checker.Records, event: Any, at: float) -> str:
    """Why the event had a claim at ``at`` that no documented window can have lost; "" if none:
    an app 2xx ended before it, its claim exposed to no window, or a keep the proxy logged."""
    for call in event.calls:
        if call.acted and call.end < at and not checker._exposures_of(records, event, call):
            taken = checker._describe_call(records, call)
            return f"the app took it ({taken}), exposed to no window"
    for line in event.logs:
        when = line.get("at")
        if line.get("outcome") in KEPT_OUTCOMES and isinstance(when, float) and when < at:
            kept = f"{line['outcome']} at {checker._rel(records, when)}"
            return f"{line.get('replica')} logged it {kept}"
    return ""


def _recovery_evidence(
    records: checker.Records, recovery: Recovery, event_id: str, asks: Sequence[Ask]
) -> tuple[str, ...]:
    lines = [
        f"github log: attempt {a.ref} {checker._rel(records, a.at)} status {a.status or 'none'}"
        f"{' (redelivery)' if a.redelivery else ''}"
        for a in recovery.logged
        if a.event_id == event_id
    ]
    lines += [f"github asked: redeliver {a.ref} at {checker._rel(records, a.at)}" for a in asks]
    shown = [
        line
        for line in records.logs
        if line.get("logger") == RECONCILER and isinstance(line.get("at"), float)
    ][-_SHOWN_RUNS:]
    lines += ["log " + json.dumps(dict(line), sort_keys=True, default=str) for line in shown]
    return tuple(lines)
