"""The checker's rules for the campaign's ``--ordering`` mode: pure functions from what was
recorded, over ``checker.check``'s own.

The events are versions of objects (``Records.objects``: each event's object and version), on a
route with ``order`` whose ``supersede`` lists their type; the app applies each version
last-writer-wins as its 2xx call ends (the calls' ends are the order of application), and
``Records.final_versions`` is each object's version at the app at the end. Per object
(docs/guarantees.md, "Order (per object)"):

- **One at the app at a time.** No call of an object's event starts while a call of another of
  its events is at the app, unless the earlier call's hold on the object was lost or given up
  on: ``checker``'s exposures (a fault on its replica or the database around it, an answer after
  ``upstream.timeout``, a delivery kept with no answer), the same windows as for one event's
  calls (``object_in_flight_twice``).
- **Never applied backwards.** No 2xx call applies a version older than one applied before it,
  unless the older call or the newer one is exposed: the older's hold lost under it (the newer
  went beside it), or the newer's claim, with the version its object accepted, lost after the
  app's 2xx (``applied_backwards``).
- **The newest at the end.** Each object's version at the app at the end is the newest the app
  applied (``stale_at_end``, explained when the application that left it stale was).
- **Superseded only by a newer version.** An event the proxy superseded (answered ``200
  superseded``, or its row marked so by the redeliverer) is older than a version of its object
  the app applied before then (``superseded_wrongly``). With ``checker``'s rules (nothing lost,
  a superseded event taken; processed twice only in the windows) every event is applied once or
  superseded.

The report counts the objects and versions, the versions first sent after a newer one of their
object (the sender's reordering), the superseded events (by the proxy's answer, by the
redeliverer), the deliveries kept for ordering, the pairs of one object's calls at the app at
once and the versions applied backwards (explained, by cause, and not), and the objects at
their newest at the end.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

from tests.faults import checker

KEPT_FOR = "ordering"  # a ``queued`` answer's kept_for: its object held, or an older one kept
# A superseding decision's time is a log line's (milliseconds, converted to the campaign's
# clock) or an answer's end: the app's 2xx it rests on ended before it, within this.
DECISION_SLACK = 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class OrderReport:
    objects: int
    versions: int  # events
    out_of_order: int  # events first sent after a newer version of their object
    superseded_answered: int  # events answered 200 superseded
    superseded_kept: int  # events kept, then superseded by the redeliverer
    superseded_wrongly: int
    kept_for_ordering: int  # deliveries answered 202 queued, kept_for: ordering
    overlaps: int  # pairs of calls of one object's events at the app at once
    overlap_causes: Mapping[str, int]  # of the explained ones, by cause
    overlaps_unexplained: int
    backwards: int  # 2xx calls that applied a version older than one applied before
    backwards_causes: Mapping[str, int]
    backwards_unexplained: int
    at_newest: int  # objects at the newest version the app applied, at the end
    stale: int  # objects left at an older one
    stale_unexplained: int

    def rows(self) -> tuple[tuple[str, str], ...]:
        overlaps_explained = self.overlaps - self.overlaps_unexplained
        backwards_explained = self.backwards - self.backwards_unexplained
        return (
            (
                "ordering: objects",
                f"{self.objects} objects, {self.versions} versions; sent before an older "
                f"version of their object {self.out_of_order}",
            ),
            (
                "  superseded",
                f"{self.superseded_answered + self.superseded_kept} events (answered superseded "
                f"{self.superseded_answered}, by the redeliverer {self.superseded_kept}); "
                f"wrongly {self.superseded_wrongly}",
            ),
            ("  kept for ordering", f"{self.kept_for_ordering} deliveries (202, kept_for)"),
            (
                "  one object twice at the app",
                f"{self.overlaps} pairs of calls (explained {overlaps_explained}: "
                f"{checker._counts(self.overlap_causes)}; unexplained {self.overlaps_unexplained})",
            ),
            (
                "  applied backwards",
                f"{self.backwards} calls (explained {backwards_explained}: "
                f"{checker._counts(self.backwards_causes)}; "
                f"unexplained {self.backwards_unexplained})",
            ),
            (
                "  at the end",
                f"{self.at_newest} of {self.objects} objects at the newest version applied; "
                f"stale {self.stale} (unexplained {self.stale_unexplained})",
            ),
        )


@dataclass(slots=True)
class _Object:
    key: str
    events: list[checker._Event]

    def calls(self) -> list[checker.UpstreamCall]:
        return [c for e in self.events for c in e.calls]


def check(records: checker.Records) -> tuple[checker.Report, OrderReport]:
    """``checker.check``'s report, with this mode's violations and rows; its counts apart."""
    if records.objects is None:
        raise ValueError("the ordering rules need each event's object (Records.objects)")
    report, _ = checker.check(records)
    events = checker.events_of(records)
    versions = records.objects
    objects: dict[str, _Object] = {}
    for event in events.values():
        key = versions[event.event_id][0]
        objects.setdefault(key, _Object(key, [])).events.append(event)
    by_call = {id(c): e for e in events.values() for c in e.calls}
    found: list[checker.Violation] = []
    overlaps: list[tuple[str, ...]] = []  # each pair's causes (empty: unexplained)
    backwards: list[tuple[str, ...]] = []
    stale: list[bool] = []  # per stale object: explained
    for obj in objects.values():
        found += _overlaps(records, obj, by_call, overlaps)
        found += _backwards(records, obj, by_call, backwards, stale)
        found += _superseded(records, obj)
    superseded = [e for e in events.values() if e.superseded(records)]
    answered = [
        e for e in superseded if any(d.dedup_status == checker.SUPERSEDED for d in e.deliveries)
    ]
    summary = OrderReport(
        objects=len(objects),
        versions=len(versions),
        out_of_order=sum(_out_of_order(obj, versions) for obj in objects.values()),
        superseded_answered=len(answered),
        superseded_kept=len(superseded) - len(answered),
        superseded_wrongly=sum(v.kind == "superseded_wrongly" for v in found),
        kept_for_ordering=sum(
            d.kept_for == KEPT_FOR for e in events.values() for d in e.deliveries
        ),
        overlaps=len(overlaps),
        overlap_causes=Counter(c for causes in overlaps for c in set(causes)),
        overlaps_unexplained=sum(not causes for causes in overlaps),
        backwards=len(backwards),
        backwards_causes=Counter(c for causes in backwards for c in set(causes)),
        backwards_unexplained=sum(not causes for causes in backwards),
        at_newest=len(objects) - len(stale),
        stale=len(stale),
        stale_unexplained=sum(not explained for explained in stale),
    )
    amended = replace(
        report, violations=(*report.violations, *found), extra=(*report.extra, *summary.rows())
    )
    return amended, summary


def _version(records: checker.Records, event_id: str) -> int:
    assert records.objects is not None
    return records.objects[event_id][1]


def _named(records: checker.Records, call: checker.UpstreamCall, event: checker._Event) -> str:
    again = call in event.redeliveries
    return (
        f"{event.event_id} (created {_version(records, event.event_id)}): "
        f"{checker._describe_call(records, call, again)}"
    )


def _causes(
    records: checker.Records, event: checker._Event, call: checker.UpstreamCall
) -> tuple[str, ...]:
    return tuple(cause for cause, _ in checker._exposures_of(records, event, call))


def _overlaps(
    records: checker.Records,
    obj: _Object,
    by_call: Mapping[int, checker._Event],
    counted: list[tuple[str, ...]],
) -> Iterator[checker.Violation]:
    """No call of the object starts while one of another of its events is at the app, unless
    the earlier one's hold was lost or given up on."""
    ordered = sorted(obj.calls(), key=lambda c: c.start)
    for n, later in enumerate(ordered):
        for earlier in ordered[:n]:
            if earlier.event_id == later.event_id or later.start >= earlier.end:
                continue  # one event's calls: checker's in_flight_twice
            first, second = by_call[id(earlier)], by_call[id(later)]
            causes = _causes(records, first, earlier)
            counted.append(causes)
            if not causes:
                message = (
                    f"object {obj.key}: {_named(records, later, second)} started while "
                    f"{_named(records, earlier, first)} was at the app, exposed to no window"
                )
                yield _violation(
                    records, "object_in_flight_twice", obj, message, (first, second),
                    (earlier, later),
                )  # fmt: skip


def _backwards(
    records: checker.Records,
    obj: _Object,
    by_call: Mapping[int, checker._Event],
    counted: list[tuple[str, ...]],
    stale: list[bool],
) -> Iterator[checker.Violation]:
    """No 2xx call applies a version older than one applied before it (by the calls' ends),
    unless either is exposed; and the object ends at the newest version applied."""
    applied = sorted((c for c in obj.calls() if c.acted), key=lambda c: c.end)
    newest: checker.UpstreamCall | None = None
    last_explained = True  # whether the last application that left the object stale was
    for call in applied:
        event = by_call[id(call)]
        version = _version(records, call.event_id)
        if newest is None or version >= _version(records, newest.event_id):
            newest, last_explained = call, True
            continue
        ahead = by_call[id(newest)]
        causes = _causes(records, event, call) + _causes(records, ahead, newest)
        counted.append(causes)
        last_explained = bool(causes)
        if not causes:
            message = (
                f"object {obj.key}: {_named(records, call, event)} applied its version after "
                f"{_named(records, newest, ahead)} had applied a newer one; neither exposed to "
                "a window"
            )
            yield _violation(
                records, "applied_backwards", obj, message, (ahead, event), (newest, call)
            )
    if newest is None:
        return
    top = _version(records, newest.event_id)
    final = records.final_versions.get(obj.key)
    if final == top:
        return
    stale.append(last_explained)
    if not last_explained:
        message = (
            f"object {obj.key} ended at created {final}, though the app had applied "
            f"created {top} ({newest.event_id})"
        )
        last = by_call[id(applied[-1])]
        yield _violation(
            records, "stale_at_end", obj, message, (by_call[id(newest)], last),
            (newest, applied[-1]),
        )  # fmt: skip


def _superseded(records: checker.Records, obj: _Object) -> Iterator[checker.Violation]:
    """An event superseded is older than a version of its object the app applied before the
    proxy decided so."""
    for event in obj.events:
        if not event.superseded(records):
            continue
        version = _version(records, event.event_id)
        when = _decided(event)
        newer = [
            c
            for e in obj.events
            if _version(records, e.event_id) > version
            for c in e.calls
            if c.acted and c.end <= when + DECISION_SLACK
        ]
        if newer:
            continue
        at = "at the end" if when == float("inf") else checker._rel(records, when)
        message = (
            f"object {obj.key}: {event.event_id} (created {version}) was superseded "
            f"({at}) though the app had applied no newer version of the object by then"
        )
        later = [e for e in obj.events if _version(records, e.event_id) > version]
        calls = [c for e in (event, *later) for c in e.calls]
        yield _violation(records, "superseded_wrongly", obj, message, (event, *later[:2]), calls)


def _decided(event: checker._Event) -> float:
    """When the proxy superseded the event: its first ``superseded`` answer's end, or its
    first redeliverer's line saying so; else not known (infinity)."""
    moments = [d.end for d in event.deliveries if d.dedup_status == checker.SUPERSEDED]
    moments += [
        float(line["at"])
        for line in event.logs
        if line.get("result") == checker.SUPERSEDED and isinstance(line.get("at"), float)
    ]
    return min(moments, default=float("inf"))


def _out_of_order(obj: _Object, versions: Mapping[str, tuple[str, int]]) -> int:
    """The object's events first sent after the first send of a newer version."""
    first = {e.event_id: min((d.start for d in e.deliveries), default=None) for e in obj.events}
    sent = sorted(((at, versions[event_id][1]) for event_id, at in first.items() if at is not None))
    newest = None
    late = 0
    for _, version in sent:
        if newest is not None and version < newest:
            late += 1
        newest = version if newest is None else max(newest, version)
    return late


def _violation(
    records: checker.Records,
    kind: str,
    obj: _Object,
    message: str,
    involved: Sequence[checker._Event],
    calls: Iterable[checker.UpstreamCall],
) -> checker.Violation:
    """A violation about one object, with the evidence of each event involved and the nemesis
    actions near the calls."""
    near = list(calls)
    shown = [a for a in records.actions if checker._near(a, near)]
    evidence = [
        f"object {obj.key}: "
        + ", ".join(f"{e.event_id} created {_version(records, e.event_id)}" for e in involved)
    ]
    for event in involved:
        evidence += checker._evidence(
            records, event.event_id, event.calls, event.deliveries, event.logs, (),
            event.redeliveries,
        )  # fmt: skip
    evidence += [checker._describe_action(records, a) for a in shown]
    return checker.Violation(kind, involved[-1].event_id, message, tuple(evidence))
