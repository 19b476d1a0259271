"""The checker's rule in the receipt mode (``--receipts``; ``ledger_app``): the app's effects,
read from its own database, commit once per event, with no window to excuse a second.

On a route with ``receipt`` whose app writes its effect and the receipt in one transaction,
"processed twice" is no longer the app answering 2xx twice but **an effect committed twice**:
an event with more than one row in the app's ledger. That is a violation whatever the nemesis
did (``effect_twice``): the receipt is a primary key, so no fault can make a second transaction
commit. And nothing acknowledged is lost: every event the provider got a 2xx for has its ledger
row (``effect_lost``).

A call of an event at the app after its effect was committed is no violation: the app's
transaction fails on the receipt (the call's effect is ``refused``), and the proxy settles the
event by the receipt. Such events are counted as *sent twice, settled by the receipt*: each is
one the campaign without receipts would have counted as processed twice. The report counts the
calls by effect (a ``committed`` one answered 5xx, or after ``upstream.timeout``, apart), the
proxy's looks at a receipt by what they found (its log lines' ``receipt``), and the provider's
answers settled by a receipt.

The rest of the checker's rules hold as they are, with a call's ``acted`` meaning its effect
committed (``checker.UpstreamCall.effect``), whatever the app answered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.faults.checker import Delivery, UpstreamCall

EFFECT_TWICE = "effect_twice"
EFFECT_LOST = "effect_lost"
LOSSES = frozenset({EFFECT_LOST})


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiptReport:
    """What the receipts did, over the campaign's events."""

    effects_twice: int  # events with more than one ledger row: each a violation
    effects_lost: int  # acknowledged events with no ledger row: each a violation
    sent_twice: int  # events sent to the app again after their effect committed (refused)
    called_twice: int  # events the app was called for more than once, for whatever reason
    calls: Mapping[str, int]  # the app's calls by effect
    committed_failed: int  # committed, then answered 5xx
    committed_late: int  # committed, answered after upstream.timeout
    looks: Mapping[str, int]  # the proxy's looks at a receipt, by what they found
    settled: int  # deliveries answered 200 by a receipt (the app's own answer was not 2xx)
    ledger_rows: int  # the ledger's rows for the campaign's events


def settled_by_receipt(line: Mapping[str, Any] | None) -> bool:
    """Whether the proxy's log line says it answered processed by the receipt (the app's
    answer, if any, was not 2xx)."""
    return (
        line is not None
        and line.get("outcome") == "processed"
        and line.get("receipt") == ("written")
    )


def event_problems(
    event_id: str,
    ledger: Mapping[str, int],
    calls: Sequence[UpstreamCall],
    acknowledged: bool,
) -> list[tuple[str, str]]:
    """The event's violations of the rule, as (kind, message)."""
    rows = ledger.get(event_id, 0)
    problems = []
    if rows > 1:
        committed = sum(c.effect == "committed" for c in calls)
        problems.append(
            (
                EFFECT_TWICE,
                f"the app's ledger holds {rows} rows for the event (its calls report "
                f"{committed} committed): an effect committed twice despite the receipt",
            )
        )
    if acknowledged and rows == 0:
        problems.append(
            (EFFECT_LOST, "the provider got a 2xx, and the app's ledger has no row for the event")
        )
    return problems


def report(
    events: Collection[str],
    ledger: Mapping[str, int],
    calls: Sequence[UpstreamCall],
    deliveries: Sequence[Delivery],
    logs: Sequence[Mapping[str, Any]],
    upstream_timeout: float,
) -> ReceiptReport:
    """The receipt mode's counts (``calls``, ``deliveries`` and ``logs`` of the campaign's
    events only)."""
    acknowledged = {d.event_id for d in deliveries if d.outcome == "ok"}
    per_event = Counter(c.event_id for c in calls)
    committed = [c for c in calls if c.effect == "committed"]
    by_request = {str(line.get("request_id")): line for line in logs if "outcome" in line}
    return ReceiptReport(
        effects_twice=sum(ledger.get(e, 0) > 1 for e in events),
        effects_lost=sum(ledger.get(e, 0) == 0 for e in events if e in acknowledged),
        sent_twice=len({c.event_id for c in calls if c.effect == "refused"}),
        called_twice=sum(n > 1 for n in per_event.values()),
        calls=Counter(str(c.effect) for c in calls),
        committed_failed=sum(c.status >= 300 for c in committed),
        committed_late=sum(c.end - c.start > upstream_timeout for c in committed),
        looks=Counter(str(line["receipt"]) for line in logs if "receipt" in line),
        settled=sum(
            d.status == 200 and settled_by_receipt(by_request.get(d.delivery_id))
            for d in deliveries
        ),
        ledger_rows=sum(ledger.get(e, 0) for e in events),
    )


def rows(receipts: ReceiptReport) -> list[tuple[str, str]]:
    """The report's lines for the receipt mode."""
    calls = ", ".join(f"{k} {v}" for k, v in sorted(receipts.calls.items())) or "none"
    looks = ", ".join(f"{k} {v}" for k, v in sorted(receipts.looks.items())) or "none"
    return [
        (
            "receipts: effects twice",
            f"{receipts.effects_twice} events with more than one ledger row (must be 0); "
            f"acknowledged with no ledger row {receipts.effects_lost} (must be 0); "
            f"ledger rows {receipts.ledger_rows}",
        ),
        (
            "  sent twice, settled",
            f"{receipts.sent_twice} events sent to the app after their effect committed "
            f"(refused by the receipt); called more than once {receipts.called_twice}",
        ),
        (
            "  app calls by effect",
            f"{calls} (committed, then answered 5xx {receipts.committed_failed}; "
            f"committed, answered after upstream.timeout {receipts.committed_late})",
        ),
        ("  proxy's looks", looks),
        ("  settled by a receipt", f"{receipts.settled} deliveries answered 200 processed"),
    ]
