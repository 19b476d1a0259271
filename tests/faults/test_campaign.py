"""The fault campaign, short enough for CI (a provider that retries, one that never does in
front of a route that redelivers, PostgreSQL behind PgBouncer, and a primary with a synchronous
standby failed over by the nemesis), and proof that its tools can tell good from bad.

The campaign's seed is random and printed first (``campaign seed=…``); rerun a failure with
``DEDUP_CAMPAIGN_SEED=<seed>``, or run longer with ``python -m tests.faults.campaign``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.faults import campaign, checker, limit_rules, order_rules, reconcile_rules
from tests.faults.relay import Relay


@dataclass(frozen=True)
class Short:
    """A campaign short enough for CI, and what shows that its nemesis really hurt: every kind
    of action in ``kinds`` taken at least once, and deliveries counted under each of ``hurt``
    (``Report.deliveries``); on a route that redelivers (``inbox``), deliveries kept and then
    redelivered to the app; with ``receipts``, a doubt settled by a receipt."""

    minutes: float
    events: int
    database: str = "plain"
    inbox: bool = False
    receipts: bool = False
    reconcile: bool = False  # with inbox: GitHub's sender, and a reconciler recovering refusals
    ordering: bool = False  # versions of objects, on a route with order and supersede
    shared_limit: int | None = None  # with inbox: the limit at the app every replica shares
    kinds: tuple[str, ...] = campaign.KINDS
    hurt: tuple[str, ...] = ("failed", "indeterminate")


@pytest.mark.slow
@pytest.mark.parametrize(
    "short",
    [
        pytest.param(
            Short(minutes=0.6, events=500), marks=pytest.mark.timeout(170), id="every-kind-of-fault"
        ),
        # A provider that never retries, in front of a route that redelivers: nothing is lost.
        pytest.param(
            Short(minutes=0.4, events=300, inbox=True, hurt=()),
            marks=pytest.mark.timeout(120),
            id="inbox",
        ),
        # The same, the sender GitHub: every refused event recovered by the reconciler.
        pytest.param(
            Short(minutes=0.4, events=300, inbox=True, reconcile=True, hurt=("failed",)),
            marks=pytest.mark.timeout(180),
            id="inbox-reconcile",
        ),
        # Link faults between the replicas and PgBouncer, PostgreSQL restarting behind it.
        pytest.param(
            Short(minutes=0.4, events=300, database="pgbouncer"),
            marks=pytest.mark.timeout(120),
            id="pgbouncer",
        ),
        # A failover in the first seconds, its standby rebuilt, and every other kind of fault:
        # no acknowledged event is lost.
        pytest.param(
            Short(
                minutes=0.5,
                events=300,
                database="failover",
                kinds=(*campaign.kinds_of("failover"), "promote", "rebuild"),
                hurt=("failed",),
            ),
            marks=pytest.mark.timeout(150),
            id="failovers",
        ),
        # The app writes a ledger row and the receipt in one transaction in its own database:
        # no effect committed twice, none lost, whatever the nemesis did.
        pytest.param(
            Short(minutes=0.5, events=300, receipts=True),
            marks=pytest.mark.timeout(150),
            id="receipts",
        ),
        # Versions of objects, some sent out of order, on a route that orders them by object
        # and supersedes stale ones, in front of a route that redelivers: never two of one
        # object at the app at once, never applied backwards, each at its newest at the end.
        pytest.param(
            Short(minutes=0.4, events=300, inbox=True, ordering=True, hurt=()),
            marks=pytest.mark.timeout(120),
            id="ordering-inbox",
        ),
        # Every replica shares a limit of 4 at the app, in front of a route that redelivers:
        # never more than 4 at the app that a proxy still waits on (but for places a database
        # fault freed under them), nothing lost, every double explained.
        pytest.param(
            Short(minutes=0.4, events=300, inbox=True, shared_limit=4, hurt=()),
            marks=pytest.mark.timeout(120),
            id="shared-limit-inbox",
        ),
    ],
)
async def test_a_short_campaign_keeps_the_invariant_under_every_kind_of_fault(
    tmp_path: Path, short: Short
) -> None:
    seed = os.environ.get("DEDUP_CAMPAIGN_SEED")
    report = await campaign.run_campaign(
        minutes=short.minutes,
        replicas=3,
        seed=int(seed) if seed else None,
        events=short.events,
        workdir=tmp_path,
        inbox=short.inbox,
        database=short.database,
        receipts=short.receipts,
        reconcile=short.reconcile,
        ordering=short.ordering,
        shared_limit=short.shared_limit,
        say=print,
    )
    table = checker.format_report(report)
    print(table)

    # The campaign proves something only if the nemesis really hurt.
    assert all(report.actions.get(kind, 0) >= 1 for kind in short.kinds), table
    assert all(report.deliveries[counted] > 0 for counted in short.hurt), table
    if short.inbox:
        assert report.inbox is not None
        assert report.inbox.kept > 0, table
        assert report.inbox.redeliveries_acted > 0, table
        assert report.inbox.lost == 0, table
    if short.receipts:
        assert report.receipts is not None
        assert report.receipts.looks.get("written", 0) > 0, table  # a doubt the receipt settled
        assert (report.receipts.effects_twice, report.receipts.effects_lost) == (0, 0), table
    if short.reconcile:
        assert report.by_phase.get(reconcile_rules.PHASE, 0) > 0, table  # the reconciler asked
        assert report.lost == 0, table
    if short.ordering:
        rows = dict(report.extra)
        assert report.lost == 0, table
        # The sender reordered, and the proxy superseded or kept for ordering.
        assert not rows["ordering: objects"].endswith(" 0"), table
        assert report.superseded + (report.inbox.superseded if report.inbox else 0) >= 0
    if short.shared_limit is not None:
        assert report.inbox is not None
        # The places were all taken (each replica's own room is the whole limit here), and
        # the proxy gave up on calls the app went on with: the two ways of counting differ.
        assert report.inbox.kept_for.get("limit", 0) > 0, table
        assert "shared limit" in dict(report.extra), table
        assert report.lost == report.inbox.lost == 0, table
    assert not report.violations, table


# --- the relay ----------------------------------------------------------------------------


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


@pytest.fixture
async def relay() -> AsyncIterator[Relay]:
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with Relay(("127.0.0.1", port)) as fault:
            yield fault
    finally:
        server.close()
        await server.wait_closed()


async def _silent(reader: asyncio.StreamReader, within: float = 0.3) -> bool:
    try:
        await asyncio.wait_for(reader.read(1), within)
    except TimeoutError:
        return True
    return False


async def test_relay_blackhole_holds_bytes_and_connections_until_healed(relay: Relay) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    try:
        writer.write(b"ping")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"ping"

        await relay.set_mode("blackhole")
        writer.write(b"lost?")
        late_reader, late_writer = await asyncio.open_connection("127.0.0.1", relay.port)
        late_writer.write(b"new")
        assert await _silent(reader)
        assert await _silent(late_reader)  # a new connection is held, not refused
        assert relay.connections == 2

        await relay.set_mode("pass")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"lost?"
        assert await asyncio.wait_for(late_reader.readexactly(3), 5) == b"new"
        # Bounded buffers still carry a large transfer through.
        payload = os.urandom(3 * 1024 * 1024)
        writer.write(payload)
        assert await asyncio.wait_for(reader.readexactly(len(payload)), 10) == payload
        late_writer.close()
    finally:
        writer.close()


async def test_relay_reset_and_refuse(relay: Relay) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    try:
        await relay.set_mode("reset")
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), 5)
    finally:
        writer.close()

    await relay.set_mode("pass")
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    try:
        await relay.set_mode("refuse")
        assert await asyncio.wait_for(reader.read(1), 5) == b""  # closed, in order
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", relay.port)
    finally:
        writer.close()

    await relay.set_mode("pass")  # listening again, on the same port
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    try:
        writer.write(b"back")
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"back"
    finally:
        writer.close()


async def test_relay_closes_the_targets_side_when_the_client_leaves_as_it_connects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ended = asyncio.Event()

    async def target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read()  # until the relay closes its side
        except ConnectionError:
            pass
        finally:
            ended.set()
            writer.close()

    server = await asyncio.start_server(target, "127.0.0.1", 0)
    address = server.sockets[0].getsockname()[:2]
    loop = asyncio.get_running_loop()
    connect = loop.create_connection

    async def made_then_client_gone(factory: Any, host: str, port: int, **kwargs: Any) -> Any:
        made = await connect(factory, host, port, **kwargs)
        if (host, port) == address:  # the relay's connection to the target, not the client's
            for link in list(fault._links):  # the client hangs up now: the task is cancelled
                link.close()
            await asyncio.sleep(0)  # where that cancellation lands, the connection made
        return made

    monkeypatch.setattr(loop, "create_connection", made_then_client_gone)
    try:
        async with Relay(address) as fault:
            _, writer = await asyncio.open_connection("127.0.0.1", fault.port)
            await asyncio.wait_for(ended.wait(), 5)
            writer.close()
    finally:
        server.close()
        await server.wait_closed()


# --- the checker --------------------------------------------------------------------------

TIMEOUT = 2.0


def _records(
    calls: list[checker.UpstreamCall],
    deliveries: list[checker.Delivery],
    *,
    actions: tuple[checker.Action, ...] = (),
    logs: tuple[Mapping[str, object], ...] = (),
    claimed: frozenset[str] = frozenset({"e"}),
) -> checker.Records:
    return checker.Records(
        events=["e"],
        deliveries=deliveries,
        calls=calls,
        actions=actions,
        logs=logs,
        claimed=claimed,
        upstream_timeout=TIMEOUT,
        commit_margin=1.5,
        request_bound=9.0,
    )


def _call(delivery: str, replica: str, start: float, took: float = 0.01) -> checker.UpstreamCall:
    return checker.UpstreamCall("e", delivery, replica, start, start + took, 200)


def _delivery(delivery: str, replica: str, start: float, status: int | None) -> checker.Delivery:
    return checker.Delivery(delivery, "e", replica, "nemesis", start, start + 0.02, status)


def test_checker_accepts_one_processing_and_duplicates() -> None:
    report, violations = checker.check(
        _records(
            [_call("d1", "r1", 1.0)],
            [
                _delivery("d1", "r1", 1.0, 200),
                checker.Delivery("d2", "e", "r2", "nemesis", 1.1, 1.2, 200, duplicate=True),
                _delivery("d3", "r3", 1.1, 503),
            ],
        )
    )
    assert violations == []
    assert report.double_processed == ()
    assert report.deliveries == {"ok": 2, "failed": 1, "indeterminate": 0}
    assert (report.accepted, report.delivered, report.lost) == (1, 1, 0)


def test_checker_flags_double_processing_outside_every_window() -> None:
    calls = [_call("d1", "r1", 1.0), _call("d2", "r2", 5.0)]
    deliveries = [_delivery("d1", "r1", 1.0, None), _delivery("d2", "r2", 5.0, 200)]
    kill_elsewhere = checker.Action("kill", "r2", 1.0, 2.0)
    _, violations = checker.check(_records(calls, deliveries, actions=(kill_elsewhere,)))
    assert [v.kind for v in violations] == ["double_unexplained"]


def test_checker_flags_copies_forwarded_while_an_earlier_one_holds_the_claim() -> None:
    calls = [_call("d1", "r1", 1.0, took=1.0), _call("d2", "r2", 1.5)]
    deliveries = [_delivery("d1", "r1", 1.0, 200), _delivery("d2", "r2", 1.5, 200)]
    _, violations = checker.check(_records(calls, deliveries))
    assert [v.kind for v in violations] == ["in_flight_twice", "double_unexplained"]


def test_checker_flags_a_500_for_an_app_2xx_and_the_double_processing_it_caused() -> None:
    calls = [_call("d1", "r1", 1.0), _call("d2", "r2", 5.0)]
    deliveries = [_delivery("d1", "r1", 1.0, 500), _delivery("d2", "r2", 5.0, 200)]
    report, violations = checker.check(_records(calls, deliveries))
    assert [v.kind for v in violations] == ["unexpected_answer", "double_unexplained"]
    assert "the app had acted on it" in violations[0].message
    assert report.unexplained == 1


@pytest.mark.parametrize(
    ("first_took", "action", "log_outcome", "cause"),
    [
        (TIMEOUT + 0.5, None, None, "late"),
        (0.01, checker.Action("kill", "r1", 1.5, 3.0), None, "kill"),
        (0.01, checker.Action("pg_restart", "postgres", 0.9, 1.2), None, "pg_restart"),
        (0.01, checker.Action("blackhole", "r1", 0.5, 4.0), None, "blackhole"),
        (0.01, None, "ambiguous_commit", "ambiguous"),
    ],
)
def test_checker_explains_double_processing_in_the_documented_windows(
    first_took: float, action: checker.Action | None, log_outcome: str | None, cause: str
) -> None:
    calls = [_call("d1", "r1", 1.0, first_took), _call("d2", "r2", 5.0)]
    deliveries = [_delivery("d1", "r1", 1.0, None), _delivery("d2", "r2", 5.0, 200)]
    logs = ({"event_id": "e", "outcome": log_outcome, "replica": "r1"},) if log_outcome else ()
    report, violations = checker.check(
        _records(calls, deliveries, actions=(action,) if action else (), logs=logs)
    )
    assert violations == []
    (double,) = report.double_processed
    assert double.explained
    assert cause in double.causes


# A failover: the primary killed at t=3, the standby writable at 3.3, a new standby from 4.5.
FAILOVER = (
    checker.Action("failover", "postgres", 3.0, 3.07, "primary pid 1 killed"),
    checker.Action("promote", "postgres", 3.07, 3.3),
    checker.Action("rebuild", "postgres", 4.5, 7.5),
)


@pytest.mark.parametrize(
    ("first", "took"),
    [
        (2.0, 0.01),  # answered; its COMMIT due after the kill
        (2.5, 1.5),  # still at the app at the kill; the copy forwarded after the promotion
    ],
)
def test_checker_explains_a_double_under_failover_when_the_call_straddles_the_kill(
    first: float, took: float
) -> None:
    calls = [_call("d1", "r1", first, took), _call("d2", "r2", 3.5)]
    deliveries = [_delivery("d1", "r1", first, None), _delivery("d2", "r2", 3.5, 200)]
    report, violations = checker.check(_records(calls, deliveries, actions=FAILOVER))
    assert violations == []
    (double,) = report.double_processed
    assert double.explained
    assert double.causes == {"failover"}


@pytest.mark.parametrize(
    "first",
    [
        0.5,  # committed before the kill: the synchronous standby had it
        4.0,  # claimed on the new primary, once promoted
        5.0,  # while a standby was rebuilt: that ends no transaction
    ],
)
def test_checker_flags_a_double_under_failover_when_the_call_missed_the_kill(
    first: float,
) -> None:
    calls = [_call("d1", "r1", first), _call("d2", "r2", 9.0)]
    deliveries = [_delivery("d1", "r1", first, 200), _delivery("d2", "r2", 9.0, 200)]
    report, violations = checker.check(_records(calls, deliveries, actions=FAILOVER))
    assert [v.kind for v in violations] == ["double_unexplained"]
    assert report.unexplained == 1


def test_checker_flags_a_second_forward_of_a_claim_committed_before_the_failover() -> None:
    # Straddling the kill by its COMMIT's margin, but the proxy logged the COMMIT acknowledged:
    # the synchronous standby had the row, so the copy after the promotion must be a duplicate.
    calls = [_call("d1", "r1", 2.0), _call("d2", "r2", 3.5)]
    deliveries = [_delivery("d1", "r1", 2.0, 200), _delivery("d2", "r2", 3.5, 200)]
    processed = {"event_id": "e", "request_id": "d1", "outcome": "processed", "replica": "r1"}
    report, violations = checker.check(
        _records(calls, deliveries, actions=FAILOVER, logs=(processed,))
    )
    assert [v.kind for v in violations] == ["forwarded_after_commit"]
    assert report.unexplained == 1

    # Committed only by the reconciliation on a fresh connection: the kill may have come first.
    reconciled = {**processed, "reconciled": True}
    _, violations = checker.check(_records(calls, deliveries, actions=FAILOVER, logs=(reconciled,)))
    assert violations == []


def test_checker_excuses_a_claim_logged_as_not_stored_after_the_apps_2xx() -> None:
    # COMMIT could not be sent (the link was gone) and storing the claim again failed: the
    # provider got the app's 2xx, no row exists, and the next copy is forwarded again.
    calls = [_call("d1", "r1", 1.0), _call("d2", "r2", 5.0)]
    deliveries = [_delivery("d1", "r1", 1.0, 200), _delivery("d2", "r2", 5.0, 200)]
    unsent = {"event_id": "e", "request_id": "d1", "outcome": "commit_not_sent", "replica": "r1"}
    report, violations = checker.check(
        _records(calls, deliveries, logs=(unsent,), claimed=frozenset())
    )
    assert violations == []
    (double,) = report.double_processed
    assert double.causes == {"unsent"}
    assert report.unsent_commits == 1

    # Unlogged, the same is a lost claim and an unexplained double.
    _, violations = checker.check(_records(calls, deliveries, claimed=frozenset()))
    assert [v.kind for v in violations] == ["unclaimed", "double_unexplained"]


def test_checker_flags_lost_events_and_undocumented_answers() -> None:
    # The provider got a 2xx, the app never acted and no claim row exists.
    report, violations = checker.check(
        _records([], [_delivery("d1", "r1", 1.0, 200)], claimed=frozenset())
    )
    assert {v.kind for v in violations} == {"lost", "unclaimed", "ack_without_app"}
    assert (report.accepted, report.delivered, report.lost) == (1, 0, 1)

    # A committed claim the app never acted on; a 500 the app did not send.
    _, violations = checker.check(_records([], [_delivery("d1", "r1", 1.0, 500)]))
    assert {v.kind for v in violations} == {
        "claimed_not_processed",
        "unacknowledged",
        "unexpected_answer",
    }


# --- the checker, on a route that redelivers ----------------------------------------------


def _inbox(
    calls: list[checker.UpstreamCall],
    deliveries: list[checker.Delivery],
    *,
    actions: tuple[checker.Action, ...] = (),
    logs: tuple[Mapping[str, object], ...] = (),
    states: Mapping[str, str] | None = None,
    claimed: frozenset[str] = frozenset({"e"}),
) -> checker.Records:
    records = _records(calls, deliveries, actions=actions, logs=logs, claimed=claimed)
    return replace(
        records, inbox=True, inbox_states={"e": "delivered"} if states is None else states
    )


def _kept(delivery: str, replica: str, start: float, app_status: int | None) -> checker.Delivery:
    return checker.Delivery(
        delivery,
        "e",
        replica,
        "nemesis",
        start,
        start + 0.02,
        202,
        dedup_status="queued",
        upstream_status=app_status,
    )


def _answered(
    call: checker.UpstreamCall, status: int, took: float | None = None
) -> checker.UpstreamCall:
    end = call.end if took is None else call.start + took
    return replace(call, status=status, end=end)


def test_checker_inbox_accepts_a_kept_event_redelivered_once_and_its_queued_copies() -> None:
    calls = [_answered(_call("d1", "r1", 1.0), 503), _call("d1", "r2", 2.0)]
    copy = checker.Delivery(
        "d2",
        "e",
        "r3",
        "nemesis",
        1.1,
        1.12,
        202,
        duplicate=True,
        dedup_status="duplicate_queued",
    )
    report, violations = checker.check(_inbox(calls, [_kept("d1", "r1", 1.0, 503), copy]))
    assert violations == []
    assert report.inbox is not None
    assert (report.inbox.accepted, report.inbox.lost, report.inbox.refused) == (1, 0, 0)
    assert (report.inbox.redeliveries, report.inbox.redeliveries_acted) == (1, 1)
    assert (report.inbox.kept, report.inbox.duplicate_queued) == (1, 1)


def test_checker_inbox_flags_a_copy_forwarded_while_its_event_is_kept() -> None:
    calls = [_answered(_call("d1", "r1", 1.0), 503), _call("d2", "r2", 1.5)]
    deliveries = [_kept("d1", "r1", 1.0, 503), _delivery("d2", "r2", 1.5, 200)]
    _, violations = checker.check(_inbox(calls, deliveries))
    assert [v.kind for v in violations] == ["forwarded_while_kept"]


def test_checker_inbox_takes_a_call_from_another_replica_for_a_redelivery_not_a_forward() -> None:
    # d1 went to r3, whose keep was committed though r3 took it as failed (503, the keep's
    # COMMIT in doubt under a failover); the copy d2 found the row kept; r2's redeliverer sent
    # it with d1's headers while d1 was still in flight. Seen in the --failover --inbox
    # --shared-limit 4 campaign (seed 5402): not a forward of d1's, which r3 alone could make.
    calls = [_call("d1", "r2", 2.0)]
    deliveries = [
        checker.Delivery("d1", "e", "r3", "nemesis", 1.0, 3.0, 503),
        checker.Delivery(
            "d2", "e", "r1", "nemesis", 1.5, 1.6, 202, duplicate=True,
            dedup_status="duplicate_queued",
        ),
    ]  # fmt: skip
    report, violations = checker.check(_inbox(calls, deliveries))
    assert violations == []
    assert report.inbox is not None
    assert (report.inbox.redeliveries, report.inbox.lost) == (1, 0)


def test_checker_inbox_flags_a_queued_answer_to_a_delivery_the_app_took() -> None:
    calls = [_call("d1", "r1", 1.0)]  # answered 200 in 0.01 s
    _, violations = checker.check(_inbox(calls, [_kept("d1", "r1", 1.0, None)]))
    assert [v.kind for v in violations] == ["kept_unexplained"]


@pytest.mark.parametrize(
    ("action", "explained"),
    [
        (checker.Action("kill", "r2", 2.5, 3.0), True),  # the replica that redelivered
        (checker.Action("reset", "r2", 2.0, 2.1), True),
        (checker.Action("kill", "r1", 2.5, 3.0), False),  # the one the provider reached
        (None, False),
    ],
)
def test_checker_inbox_explains_a_double_redelivery_by_a_fault_on_the_redelivering_replica(
    action: checker.Action | None, explained: bool
) -> None:
    calls = [
        _answered(_call("d1", "r1", 1.0), 503),
        _call("d1", "r2", 2.0),  # delivered, its COMMIT lost?
        _call("d1", "r3", 6.0),
    ]
    records = _inbox(calls, [_kept("d1", "r1", 1.0, 503)], actions=(action,) if action else ())
    report, violations = checker.check(records)
    (double,) = report.double_processed
    assert double.explained is explained
    assert [v.kind for v in violations] == ([] if explained else ["double_unexplained"])


def test_checker_inbox_explains_a_redelivery_the_proxy_logged_unanswered() -> None:
    # The app took 1.8 s by its clock; the redeliverer of r2 gave up at upstream.timeout.
    calls = [
        _answered(_call("d1", "r1", 1.0), 503),
        _answered(_call("d1", "r2", 2.0), 200, took=1.8),
        _call("d1", "r3", 6.0),
    ]
    attempt = {
        "logger": checker.REDELIVERER,
        "event_id": "e",
        "replica": "r2",
        "at": 4.05,
        "attempt": 2,
        "upstream_status": None,
        "result": "failed",
        "error": "timed out",
    }
    report, violations = checker.check(
        _inbox(calls, [_kept("d1", "r1", 1.0, 503)], logs=(attempt,))
    )
    assert violations == []
    (double,) = report.double_processed
    assert double.causes == {"no_answer"}


def test_checker_inbox_counts_refusals_and_flags_the_unexplained() -> None:
    refused = {"event_id": "e", "request_id": "d1", "outcome": "unavailable", "replica": "r1"}
    report, violations = checker.check(
        _inbox(
            [], [_delivery("d1", "r1", 1.0, 503)], logs=(refused,), states={}, claimed=frozenset()
        )
    )
    assert violations == []
    assert report.inbox is not None
    assert report.inbox.refused == 1
    assert report.inbox.refused_reasons == {"503 unavailable": 1}

    # No answer, and the replica was not killed: the proxy's fault until shown otherwise.
    _, violations = checker.check(
        _inbox([], [_delivery("d1", "r1", 1.0, None)], states={}, claimed=frozenset())
    )
    assert [v.kind for v in violations] == ["refused_unexplained"]


def test_checker_inbox_flags_rows_left_pending_or_dead_and_failures_not_kept() -> None:
    calls = [_answered(_call("d1", "r1", 1.0), 503)]
    for state, kind in (("pending", "still_pending"), ("dead", "dead")):
        _, violations = checker.check(
            _inbox(calls, [_kept("d1", "r1", 1.0, 503)], states={"e": state})
        )
        assert {v.kind for v in violations} == {"claimed_not_processed", "lost", kind}

    relayed = {"event_id": "e", "request_id": "d1", "outcome": "upstream_error", "replica": "r1"}
    _, violations = checker.check(
        _inbox(
            calls,
            [_delivery("d1", "r1", 1.0, 503)],
            logs=(relayed,),
            states={},
            claimed=frozenset(),
        )
    )
    assert [v.kind for v in violations] == ["not_kept"]


@pytest.mark.parametrize("action", [None, checker.Action("reset", "r2", 2.2, 2.3)])
def test_checker_inbox_flags_an_event_in_flight_twice_unless_the_first_lost_its_lock(
    action: checker.Action | None,
) -> None:
    calls = [
        _answered(_call("d1", "r1", 1.0), 503),
        _answered(_call("d1", "r2", 2.0), 503, took=1.0),
        _answered(_call("d1", "r3", 2.5), 200),  # while r2's redelivery is at the app
    ]
    records = _inbox(calls, [_kept("d1", "r1", 1.0, 503)], actions=(action,) if action else ())
    _, violations = checker.check(records)
    assert [v.kind for v in violations] == ([] if action else ["in_flight_twice"])


# --- the checker, with flow control (the limit at the app, the hand-off) --------------------

HAND_OFF = 1.4


def _kept_for(delivery: str, replica: str, start: float, reason: str) -> checker.Delivery:
    return replace(
        _kept(delivery, replica, start, None), end=start + HAND_OFF + 0.02, kept_for=reason
    )


def _flow(
    calls: list[checker.UpstreamCall],
    deliveries: list[checker.Delivery],
    *,
    actions: tuple[checker.Action, ...] = (),
    logs: tuple[Mapping[str, object], ...] = (),
) -> checker.Records:
    return replace(_inbox(calls, deliveries, actions=actions, logs=logs), hand_off=HAND_OFF)


def test_checker_inbox_accepts_deliveries_kept_over_the_limit_and_at_the_hand_off() -> None:
    # Over the limit: kept unsent, and redelivered before the provider had read its 202.
    limit = replace(_kept("d1", "r1", 1.0, None), end=1.5, kept_for="limit")
    over = [_call("d1", "r2", 1.2)]
    # At the hand-off: answered 202 at 1.4 s while the app went on until 1.45 s, then 200.
    handed = _kept_for("d1", "r1", 1.0, "deadline")
    slow = [_answered(_call("d1", "r1", 1.0), 200, took=1.45)]
    # At the hand-off too, its claim having waited 1.3 s on a copy's: the app had 0.1 s.
    late = [_answered(_call("d1", "r1", 2.3), 200, took=0.1)]
    cases = ((over, limit, "limit"), (slow, handed, "deadline"), (late, handed, "deadline"))
    for calls, delivery, reason in cases:
        report, violations = checker.check(_flow(calls, [delivery]))
        assert violations == []
        assert report.inbox is not None
        assert report.inbox.kept_for == {reason: 1}
        assert report.inbox.redeliveries == (1 if reason == "limit" else 0)
        assert (report.inbox.accepted, report.inbox.lost) == (1, 0)


def test_checker_inbox_flags_a_hand_off_the_app_had_answered_before() -> None:
    calls = [_answered(_call("d1", "r1", 1.0), 200, took=0.3)]
    _, violations = checker.check(_flow(calls, [_kept_for("d1", "r1", 1.0, "deadline")]))
    assert [v.kind for v in violations] == ["kept_unexplained"]
    assert "kept_for deadline" in violations[0].message


def test_checker_inbox_accepts_an_app_answer_that_came_while_the_hand_offs_keep_committed() -> None:
    # The hand-off began keeping at HAND_OFF; the app answered just after, and the keep's
    # COMMIT took a second more: the 202 comes a second after the app's answer.
    calls = [_answered(_call("d1", "r1", 1.01), 200, took=HAND_OFF + 0.02)]
    kept = replace(_kept_for("d1", "r1", 1.0, "deadline"), end=1.0 + HAND_OFF + 1.0)
    _, violations = checker.check(_flow(calls, [kept]))
    assert violations == []


@pytest.mark.parametrize(
    ("action", "causes"),
    [
        (checker.Action("kill", "r1", 2.0, 3.0), {"hand_off_kill"}),  # during the wait
        (checker.Action("kill", "r2", 2.0, 3.0), None),  # another replica
        (None, None),
    ],
)
def test_checker_inbox_explains_a_handed_off_event_sent_again_only_by_a_kill(
    action: checker.Action | None, causes: set[str] | None
) -> None:
    # Handed off at 2.4 s, the app answered 200 at 2.6 s; its row sent again after the lease.
    calls = [_answered(_call("d1", "r1", 1.0), 200, took=1.6), _call("d1", "r3", 9.0)]
    records = _flow(
        calls, [_kept_for("d1", "r1", 1.0, "deadline")], actions=(action,) if action else ()
    )
    report, violations = checker.check(records)
    (double,) = report.double_processed
    assert [v.kind for v in violations] == ([] if causes else ["double_unexplained"])
    assert double.explained is bool(causes)
    if causes:
        assert double.causes == causes


@pytest.mark.parametrize(
    ("line", "dropped", "explained"),
    [
        ({"handed_off": "failed", "at": 3.0}, None, True),  # logged before the app's answer
        ({"handed_off": "failed", "at": 3.3}, 3.0, True),  # the call closed before it
        ({"handed_off": "failed", "at": 3.3}, None, False),  # the proxy might have had it
        ({"handed_off": "failed", "at": 3.0, "upstream_status": 503}, None, False),
        ({"handed_off": "delivered", "at": 3.0}, None, False),
    ],
)
def test_checker_inbox_explains_a_handed_off_attempt_the_proxy_timed_out_before_the_app_answered(
    line: dict[str, object], dropped: float | None, explained: bool
) -> None:
    # Sent at 1.0 s; the app's handler started at 1.5 s on a busy harness, answered 200 at
    # 3.2 s (1.7 s by its own clock, under upstream.timeout); the proxy's timeout, from its
    # send, had fired at 3.0 s: its row was due again, and redelivered at 3.5 s (CI, seed
    # 1654724799).
    first = replace(_answered(_call("d1", "r1", 1.5), 200, took=1.7), dropped=dropped)
    calls = [first, _call("d1", "r1", 3.5)]
    logged = {"event_id": "e", "request_id": "d1", "outcome": "queued", "replica": "r1",
              "kept_for": "deadline", **line}  # fmt: skip
    records = _flow(calls, [_kept_for("d1", "r1", 1.0, "deadline")], logs=(logged,))
    report, violations = checker.check(records)
    (double,) = report.double_processed
    assert [v.kind for v in violations] == ([] if explained else ["double_unexplained"])
    assert double.causes == ({"no_answer"} if explained else set())


@pytest.mark.parametrize("action", [None, checker.Action("reset", "r1", 2.0, 2.1)])
def test_checker_inbox_flags_a_handed_off_event_at_the_app_twice_unless_a_fault_explains_it(
    action: checker.Action | None,
) -> None:
    calls = [
        _answered(_call("d1", "r1", 1.0), 503, took=1.6),  # handed off at 2.4 s
        _call("d1", "r2", 2.5),  # while the first is still at the app
    ]
    records = _flow(
        calls, [_kept_for("d1", "r1", 1.0, "deadline")], actions=(action,) if action else ()
    )
    _, violations = checker.check(records)
    assert [v.kind for v in violations] == ([] if action else ["in_flight_twice"])


def test_checker_inbox_counts_every_failed_send_by_reason_and_the_peak_at_the_app() -> None:
    shed = {"event_id": "e", "request_id": "d2", "outcome": "unavailable", "shed": "pool"}
    calls = [_call("d1", "r1", 1.0, took=1.0), _call("d3", "r1", 1.5), _call("d4", "r2", 1.6)]
    deliveries = [
        _delivery("d1", "r1", 1.0, 200),
        _delivery("d2", "r1", 1.2, 503),  # a copy shed: the event was accepted all the same
    ]
    report, _ = checker.check(_flow(calls, deliveries, logs=({**shed, "replica": "r1"},)))
    assert report.inbox is not None
    assert report.inbox.refused_reasons == {}
    assert report.inbox.failed_reasons == {"503 unavailable (shed: pool)": 1}
    assert report.inbox.peak_at_app == {"r1": 2, "r2": 1}
    (row,) = [line for line in checker.format_report(report).splitlines() if "failed send" in line]
    assert row.endswith("503 unavailable (shed: pool) 1")


@pytest.mark.parametrize(
    ("action", "healthy"),
    [
        (None, {"503 unavailable (shed: pool)": 1}),
        (checker.Action("blackhole", "r1", 0.0, 0.5), {}),  # its pool still reconnecting
        (checker.Action("pg_restart", "postgres", 1.0, 1.1), {}),
        (checker.Action("blackhole", "r2", 0.0, 2.0), {"503 unavailable (shed: pool)": 1}),
    ],
)
def test_checker_inbox_tells_refusals_with_the_database_away_from_the_others(
    action: checker.Action | None, healthy: Mapping[str, int]
) -> None:
    shed = {"event_id": "e", "request_id": "d1", "outcome": "unavailable", "shed": "pool"}
    records = replace(
        _flow([], [_delivery("d1", "r1", 2.0, 503)], actions=(action,) if action else ()),
        logs=({**shed, "replica": "r1"},),
        inbox_states={},
        claimed=frozenset(),
    )
    report, violations = checker.check(records)
    assert violations == []
    assert report.inbox is not None
    assert report.inbox.refused_reasons == {"503 unavailable (shed: pool)": 1}
    assert report.inbox.refused_healthy == healthy


# --- the checker, in the receipt mode ------------------------------------------------------


def _receipts(
    calls: list[checker.UpstreamCall],
    deliveries: list[checker.Delivery],
    ledger: Mapping[str, int],
    **more: Any,
) -> checker.Records:
    return replace(_records(calls, deliveries, **more), ledger=ledger)


def _credit(
    delivery: str, replica: str, start: float, effect: str, took: float = 0.01, status: int = 200
) -> checker.UpstreamCall:
    return checker.UpstreamCall("e", delivery, replica, start, start + took, status, effect)


def _settled(delivery: str, replica: str, **more: object) -> Mapping[str, object]:
    """The proxy's line for a delivery it answered processed by the event's receipt."""
    return {"event_id": "e", "request_id": delivery, "replica": replica, "outcome": "processed",
            "receipt": "written", "status": 200, **more}  # fmt: skip


def test_checker_receipts_flag_an_effect_committed_twice_whatever_the_windows() -> None:
    # Without receipts an answer after upstream.timeout and a kill explain a second 2xx; with
    # them, two ledger rows for one event are a violation, excused by nothing.
    calls = [_credit("d1", "r1", 1.0, "committed", took=3.0), _credit("d2", "r2", 5.0, "committed")]
    deliveries = [_delivery("d1", "r1", 1.0, 504), _delivery("d2", "r2", 5.0, 200)]
    kill = checker.Action("kill", "r1", 1.5, 2.0)
    report, violations = checker.check(_receipts(calls, deliveries, {"e": 2}, actions=(kill,)))
    assert [v.kind for v in violations] == ["effect_twice"]
    assert report.receipts is not None
    assert (report.receipts.effects_twice, report.receipts.effects_lost) == (1, 0)
    assert report.double_processed == ()  # the ledger's rule replaces counting 2xx answers


def test_checker_receipts_accept_an_event_sent_twice_and_settled_by_its_receipt() -> None:
    # The app committed, then answered after upstream.timeout (504); the next copy's
    # transaction failed on the receipt (500), and the proxy answered 200 by the receipt.
    calls = [
        _credit("d1", "r1", 1.0, "committed", took=2.5),
        _credit("d2", "r2", 4.0, "refused", status=500),
    ]
    deliveries = [_delivery("d1", "r1", 1.0, 504), _delivery("d2", "r2", 4.0, 200)]
    report, violations = checker.check(
        _receipts(calls, deliveries, {"e": 1}, logs=(_settled("d2", "r2"),))
    )
    assert violations == []
    assert report.receipts is not None
    assert (report.receipts.sent_twice, report.receipts.settled) == (1, 1)
    assert report.receipts.committed_late == 1
    assert (report.accepted, report.delivered, report.lost) == (1, 1, 0)


def test_checker_receipts_flag_an_acknowledged_event_with_no_ledger_row() -> None:
    calls = [_credit("d1", "r1", 1.0, "committed")]
    report, violations = checker.check(_receipts(calls, [_delivery("d1", "r1", 1.0, 200)], {}))
    assert [v.kind for v in violations] == ["effect_lost"]
    assert report.lost == 1


@pytest.mark.parametrize(
    ("stored", "claimed"),
    [
        # The claim's COMMIT failed: logged processed, with a commit_error, and no row is no loss.
        ({"commit_error": "connection is closed"}, frozenset()),
        # Stored again on a fresh connection: logged processed, with no "reconciled" on it.
        ({}, frozenset({"e"})),
    ],
    ids=["not-stored", "stored-again"],
)
def test_checker_receipts_take_a_claim_settled_by_its_receipt_as_exposed(
    stored: Mapping[str, object], claimed: frozenset[str]
) -> None:
    # d1's claim was reset under its call, and d2's call came beside it (refused by the
    # receipt); the proxy then found d1's receipt: its line says processed, but its claim did
    # not hold its lock until an acknowledged COMMIT.
    calls = [
        _credit("d1", "r1", 1.0, "committed", took=1.5),
        _credit("d2", "r2", 1.5, "refused", status=500),
    ]
    deliveries = [_delivery("d1", "r1", 1.0, 200), _delivery("d2", "r2", 1.4, 200)]
    reset = checker.Action("reset", "r1", 1.2, 1.3)
    logs = (_settled("d1", "r1", **stored), _settled("d2", "r2"))
    _, violations = checker.check(
        _receipts(calls, deliveries, {"e": 1}, actions=(reset,), logs=logs, claimed=claimed)
    )
    assert violations == []


def test_checker_receipts_flag_a_call_after_a_claim_logged_committed() -> None:
    # d1's claim held its lock until an acknowledged COMMIT: d2's call after it, even one the
    # receipt refused, is a COMMIT that did not hold.
    calls = [_credit("d1", "r1", 1.0, "committed"), _credit("d2", "r2", 5.0, "refused", status=500)]
    deliveries = [_delivery("d1", "r1", 1.0, 200), _delivery("d2", "r2", 5.0, 200)]
    processed = {"event_id": "e", "request_id": "d1", "outcome": "processed", "status": 200}
    logs = (processed, _settled("d2", "r2"))
    _, violations = checker.check(_receipts(calls, deliveries, {"e": 1}, logs=logs))
    assert [v.kind for v in violations] == ["forwarded_after_commit"]


# --- the checker, with a shared limit (--shared-limit) ------------------------------------


def _at_app(
    event: str, replica: str, start: float, end: float, dropped: float | None = None
) -> checker.UpstreamCall:
    return checker.UpstreamCall(event, f"d-{event}", replica, start, end, 200, dropped=dropped)


def _limited(
    calls: list[checker.UpstreamCall],
    actions: tuple[checker.Action, ...] = (),
    *,
    deliveries: tuple[checker.Delivery, ...] = (),
    logs: tuple[Mapping[str, object], ...] = (),
) -> tuple[checker.Report, limit_rules.LimitReport]:
    events = [d.event_id for d in deliveries]  # the others' calls count at the app all the same
    records = checker.Records(
        events=events,
        deliveries=deliveries,
        calls=calls,
        actions=actions,
        logs=logs,
        claimed=frozenset(events),
        upstream_timeout=TIMEOUT,
        commit_margin=1.5,
        request_bound=9.0,
        shared_limit=2,
    )
    return limit_rules.check(records, checker.check(records)[0])


def test_shared_limit_counts_a_call_the_proxy_gave_up_on_only_while_it_waited() -> None:
    # e1's upstream.timeout fired at 3.0 (the proxy closed the connection; the app went on until
    # 4.0); e2 and e3 at the app from 3.5 are the limit of 2, counted the strict way.
    calls = [
        _at_app("e1", "r1", 1.0, 4.0, dropped=3.0),
        _at_app("e2", "r2", 2.0, 5.0),
        _at_app("e3", "r3", 3.5, 4.5),
        _at_app("e4", "r1", 6.0, 6.5, dropped=6.2),  # its replica killed at 6.2
    ]
    kill = checker.Action("kill", "r1", 6.2, 7.0)
    report, summary = _limited(calls, (kill,))
    assert report.violations == ()
    assert (summary.peak_strict, summary.peak_loose, summary.peak_held) == (2, 3, 2)
    assert summary.dropped == {"late": 1, "kill": 1}
    assert (summary.over, summary.over_unexplained) == (0, 0)
    assert "2 waited on (strict), 3 with the abandoned (loose)" in checker.format_report(report)


@pytest.mark.parametrize(
    ("fault", "explained"),
    [
        (None, False),
        # A reset of r1's database link closes its connections: PostgreSQL rolls e1's
        # transaction back and its place goes to e3 while r1 still waits on the app.
        (checker.Action("reset", "r1", 2.5, 2.6), True),
        (checker.Action("pg_restart", "postgres", 2.5, 3.2), True),
        # A blackhole ends no transaction; a reset of another replica's link not e1's or e2's.
        (checker.Action("blackhole", "r1", 2.5, 4.0), False),
        (checker.Action("reset", "r2", 1.0, 1.1), False),  # before e2's claim
        # Between e3's claim and its call: its own place was lost, e3 went to the app anyway.
        (checker.Action("reset", "r3", 2.6, 2.7), True),
        # The fault came after e3 started: the places were over the limit before it.
        (checker.Action("reset", "r1", 3.2, 3.3), False),
    ],
)
def test_shared_limit_flags_more_waited_on_than_the_limit_unless_a_fault_freed_a_place(
    fault: checker.Action | None, explained: bool
) -> None:
    calls = [
        _at_app("e1", "r1", 1.0, 4.0),
        _at_app("e2", "r2", 2.0, 5.0),
        _at_app("e3", "r3", 3.0, 3.5),
    ]
    report, summary = _limited(calls, (fault,) if fault else ())
    assert (summary.peak_strict, summary.over) == (3, 1)
    assert summary.over_unexplained == (0 if explained else 1)
    assert [v.kind for v in report.violations] == ([] if explained else ["over_shared_limit"])
    if not explained:
        evidence = report.violations[0].evidence
        assert evidence[0].startswith("upstream call t=1.000..t=4.000")


def test_shared_limit_takes_no_fault_as_freeing_the_place_of_a_claim_committed_on_its_own() -> None:
    # e1's claim was committed on the connection that made it (logged processed): the reset
    # of r1's link came before its claim, or after its COMMIT; its place was held throughout.
    calls = [
        _at_app("e1", "r1", 1.0, 4.0),
        _at_app("e2", "r2", 2.0, 5.0),
        _at_app("e3", "r3", 3.0, 3.5),
    ]
    sent = checker.Delivery("d-e1", "e1", "r1", "nemesis", 0.9, 4.1, 200)
    line = {"event_id": "e1", "request_id": "d-e1", "outcome": "processed", "replica": "r1"}
    reset = checker.Action("reset", "r1", 2.5, 2.6)
    report, summary = _limited(calls, (reset,), deliveries=(sent,), logs=(line,))
    assert summary.over_unexplained == 1
    assert [v.kind for v in report.violations] == ["over_shared_limit"]
    # Without the line (the claim's COMMIT failed, say) the reset explains it.
    _, summary = _limited(calls, (reset,), deliveries=(sent,))
    assert (summary.over_unexplained, summary.over_causes) == (0, {"reset": 1})


# --- the checker, with ordering (--ordering) ----------------------------------------------

# Three versions of one object: v1, v2 and v3 (created 1, 2, 3).
VERSIONS = {"v1": ("cus_1", 1), "v2": ("cus_1", 2), "v3": ("cus_1", 3)}


def _version_call(
    event: str, start: float, took: float = 0.1, replica: str = "r1", status: int = 200
) -> checker.UpstreamCall:
    return checker.UpstreamCall(event, f"d-{event}", replica, start, start + took, status)


def _version_sent(
    event: str, start: float, status: int = 200, dedup: str | None = None
) -> checker.Delivery:
    return checker.Delivery(
        f"d-{event}", event, "r1", "nemesis", start, start + 0.2, status, dedup_status=dedup
    )


def _ordered(
    calls: list[checker.UpstreamCall],
    deliveries: list[checker.Delivery],
    final: int,
    *,
    actions: tuple[checker.Action, ...] = (),
    states: Mapping[str, str] | None = None,
) -> checker.Records:
    return checker.Records(
        events=list(VERSIONS),
        deliveries=deliveries,
        calls=calls,
        actions=actions,
        logs=(),
        claimed=frozenset(VERSIONS),
        upstream_timeout=TIMEOUT,
        commit_margin=1.5,
        request_bound=9.0,
        inbox_states=states or {},
        objects=VERSIONS,
        final_versions={"cus_1": final},
    )


def test_ordering_accepts_versions_one_at_a_time_and_a_stale_one_superseded() -> None:
    # v1 and v3 applied in turn; v2, sent last, answered superseded and never forwarded.
    calls = [_version_call("v1", 1.0), _version_call("v3", 1.2)]
    deliveries = [
        _version_sent("v1", 0.95),
        _version_sent("v3", 1.0),
        _version_sent("v2", 1.4, dedup="superseded"),
    ]
    records = _ordered(calls, deliveries, 3, states={"v2": "superseded"})
    report, summary = order_rules.check(records)
    assert report.violations == ()
    assert (report.accepted, report.delivered, report.superseded, report.lost) == (3, 2, 1, 0)
    assert (summary.out_of_order, summary.superseded_answered, summary.overlaps) == (1, 1, 0)
    assert (summary.backwards, summary.at_newest, summary.stale) == (0, 1, 0)
    table = checker.format_report(report)
    assert "superseded 1 (never at the app)" in table
    assert "1 of 1 objects at the newest version applied" in table


@pytest.mark.parametrize("kill", [None, checker.Action("kill", "r1", 1.05, 1.3)])
def test_ordering_flags_two_versions_of_an_object_at_the_app_at_once_unless_a_window_explains_it(
    kill: checker.Action | None,
) -> None:
    calls = [_version_call("v1", 1.0, took=0.5), _version_call("v2", 1.2, replica="r2")]
    deliveries = [_version_sent("v1", 0.95), _version_sent("v2", 1.1), _version_sent("v3", 5.0)]
    calls.append(_version_call("v3", 5.0))
    records = _ordered(calls, deliveries, 3, actions=(kill,) if kill else ())
    report, summary = order_rules.check(records)
    # v1 applied after v2 as well: its call ended last.
    kinds = [v.kind for v in report.violations]
    assert kinds == ([] if kill else ["object_in_flight_twice", "applied_backwards"])
    assert (summary.overlaps, summary.backwards) == (1, 1)
    if kill:
        assert summary.overlap_causes == {"kill": 1}
    else:
        evidence = report.violations[0].evidence
        assert evidence[0] == "object cus_1: v1 created 1, v2 created 2"
        assert {"event v1", "event v2"} <= set(evidence)


def test_ordering_flags_an_object_left_at_an_older_version_and_a_wrong_supersede() -> None:
    # v3 applied, then v2 forwarded and applied after it: backwards, and the object ends at 2;
    # v1 superseded before any newer version was applied.
    calls = [_version_call("v3", 1.0), _version_call("v2", 3.0)]
    deliveries = [
        _version_sent("v1", 0.1, dedup="superseded"),
        _version_sent("v3", 0.95),
        _version_sent("v2", 2.9),
    ]
    records = _ordered(calls, deliveries, 2, states={"v1": "superseded"})
    report, summary = order_rules.check(records)
    kinds = sorted(v.kind for v in report.violations)
    assert kinds == ["applied_backwards", "stale_at_end", "superseded_wrongly"]
    assert (summary.stale, summary.stale_unexplained, summary.superseded_wrongly) == (1, 1, 1)
    assert report.lost == 0  # a superseded event is taken, rightly or not


# --- the checker, with the reconciler (--reconcile) ---------------------------------------


def _asked(delivery: str, replica: str, start: float, status: int | None) -> checker.Delivery:
    """A redelivery the reconciler asked GitHub for."""
    return replace(_delivery(delivery, replica, start, status), phase=reconcile_rules.PHASE)


RUN_LINE = {"logger": reconcile_rules.RECONCILER, "level": "info", "gaps": 1, "recovered": 1,
            "msg": "reconcile of route camp: 1 event(s) in the log", "at": 9.9}  # fmt: skip
REFUSED_LINE = {"event_id": "e", "request_id": "d1", "outcome": "unavailable", "replica": "r1"}


def test_reconcile_counts_a_refused_event_recovered_by_the_reconciler() -> None:
    records = _inbox(
        [_call("d2", "r2", 10.005)],
        [_delivery("d1", "r1", 1.0, 503), _asked("d2", "r2", 10.0, 200)],
        logs=(REFUSED_LINE, RUN_LINE),
        states={},
    )
    recovery = reconcile_rules.Recovery(
        asks=[reconcile_rules.Ask("e", 7, 9.95)],
        logged=[reconcile_rules.Logged("e", 7, 503, False, 1.02),
                reconcile_rules.Logged("e", 8, 200, True, 10.1)],
    )  # fmt: skip

    report, summary = reconcile_rules.check(records, recovery)

    assert report.violations == ()
    assert (summary.refused, summary.recovered, summary.not_recovered, summary.lost) == (1, 1, 0, 0)
    assert (summary.asks, summary.asked_not_arrived, summary.runs) == (1, 0, 1)
    assert "recovered 1, not recovered 0; lost 0" in checker.format_report(report)


def test_reconcile_flags_a_refused_event_never_recovered_with_the_stand_ins_log() -> None:
    database_away = {"logger": reconcile_rules.RECONCILER, "level": "warning", "at": 9.0,
                     "msg": "reconcile of route camp: the database does not answer: x"}  # fmt: skip
    records = _inbox(
        [],
        [_delivery("d1", "r1", 1.0, 503)],
        logs=(REFUSED_LINE, database_away),
        states={},
        claimed=frozenset(),
    )
    recovery = reconcile_rules.Recovery(
        asks=[], logged=[reconcile_rules.Logged("e", 7, 503, False, 1.02)]
    )

    report, summary = reconcile_rules.check(records, recovery)

    assert [v.kind for v in report.violations] == ["not_recovered"]
    assert "github log: attempt 7 t=1.020 status 503" in report.violations[0].evidence
    assert (summary.refused, summary.recovered, summary.lost) == (1, 0, 1)
    assert summary.errors == {"database": 1}


@pytest.mark.parametrize("killed", [False, True])
def test_reconcile_flags_an_ask_for_an_event_with_a_claim_unless_a_window_lost_it(
    killed: bool,
) -> None:
    """The app took the event, the provider's connection was cut: GitHub logs it failed. Its
    claim was committed unless the replica's kill took it: only then may the reconciler ask."""
    kill = checker.Action("kill", "r1", 1.0, 1.5)
    records = _inbox(
        [_call("d1", "r1", 1.001), _call("d2", "r2", 10.005)],
        [_delivery("d1", "r1", 1.0, None), _asked("d2", "r2", 10.0, 200)],
        actions=(kill,) if killed else (),
        states={},
    )
    recovery = reconcile_rules.Recovery(
        asks=[reconcile_rules.Ask("e", 7, 9.95)],
        logged=[reconcile_rules.Logged("e", 7, 0, False, 1.02),
                reconcile_rules.Logged("e", 8, 200, True, 10.1)],
    )  # fmt: skip

    report, summary = reconcile_rules.check(records, recovery)

    kinds = sorted(v.kind for v in report.violations)
    if killed:
        assert kinds == []
        assert [d.explained for d in report.double_processed] == [True]
    else:
        assert kinds == ["double_unexplained", "reconciled_claimed"]
    assert (summary.refused, summary.recovered) == (1, 1)
