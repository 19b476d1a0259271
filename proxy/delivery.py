"""One attempt at the app, a first delivery or a redelivery: send it, trace it, classify what
came back into one ``Result``, and what it leads to: the inbox's policy for a failed one (kept
pending or dead, when it is due again), the app's receipt that settles a doubtful one, and the
hold its ``Retry-After`` puts on its scope. The pipeline (a first delivery, a hand-off) and the
redeliverer (a kept one) both attempt through this worker's ``Executor`` and keep or record
through ``keep`` and ``Executor.record``, so an answer is decided the same on every path
(river's job executor runs every attempt, first or retry; procrastinate keeps its retry
decision in ``retry.py``): only this module touches the receipts and the Retry-After holds.

What an attempt is wrapped in stays with its caller: the pipeline's claim, log line and HTTP
answer; the redeliverer's row lock, memory reservation and log record. A caller that keeps a
delivery the app was never sent (no ``Result``) keeps it with an ``Attempt`` of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from proxy import database, errors
from proxy.config import redeliver
from proxy.database import receipts
from proxy.upstream import http1, transports

if TYPE_CHECKING:
    from proxy import metrics, route_holds, tracing
    from proxy.config import routes
    from proxy.tracing.spans import RequestTrace
    from proxy.upstream import forwarder

    Trace = tracing.NotTraced | RequestTrace

# The app's answers that retrying the same request cannot change: the request itself is wrong
# (400, 422), too large (413, 414) or of a kind the app does not take (405, 411, 415). Anything
# else (404 and 401/403 included: a deploy or a rotated secret) is tried again on schedule.
UNFIXABLE = frozenset({400, 405, 411, 413, 414, 415, 422})
T = TypeVar("T")

# The app's own back-pressure: a 429 or 503 may say when to come back (RFC 9110, 10.2.3). Capped,
# since the wait holds the scope's redeliveries on every replica: a typo in the app's header
# must not stop them for a week.
BACK_OFF = frozenset({429, 503})
MAX_RETRY_AFTER = database.MAX_RETRY_AFTER

# Standard Webhooks senders disable an endpoint that answers 410: it is never relayed.
GONE = "upstream answered 410 Gone"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Result:
    """What one attempt came to: the app's answer read whole (None: none came through), and,
    when there is no answer to relay (none came through, or a 410), why (``failure``, what a
    first delivery raises to answer 502)."""

    answer: http1.Answer | None
    failure: errors.UpstreamFailed | None = None
    # What the app was sent, where it may be kept: the headers with the trace's, before the
    # transport took Host out (what a redelivery sends again, linking to this trace).
    sent: tuple[tuple[str, str], ...] = ()
    seconds: float | None = None  # how long the attempt took, to its answer or its failure

    @property
    def status(self) -> int | None:
        """The app's status (None: no status line arrived)."""
        if self.answer is not None:
            return self.answer.status
        return None if self.failure is None else self.failure.upstream_status

    @property
    def taken(self) -> bool:
        """The app took the delivery: it answered 2xx (even if its answer broke after the
        status line, and cannot be relayed)."""
        status = self.status
        return status is not None and 200 <= status < 300

    @property
    def attempt(self) -> database.Attempt:
        """As the inbox records it: the status, what went wrong (None when the app answered,
        or took it), how long it took and what the app answered (bounded)."""
        answer = self.answer
        error = None
        if not self.taken and self.failure is not None:
            error = GONE if answer is not None else self.failure.message
        if answer is None:
            return database.Attempt.answered(self.status, error, self.seconds)
        return database.Attempt.answered(
            self.status, error, self.seconds, answer.headers.items(), answer.body
        )

    def retry_after(self, now: float | None = None) -> float | None:
        """How long the app asked to be left alone: a 429 or 503 with ``Retry-After`` (seconds,
        or an HTTP-date), at most ``MAX_RETRY_AFTER``; None when it did not say."""
        answer = self.answer
        if answer is None or answer.status not in BACK_OFF:
            return None
        value = answer.headers.get("Retry-After", "").strip()
        if value.isascii() and value.isdigit():
            seconds = float(value)
        else:
            try:
                when = email.utils.parsedate_to_datetime(value)
            except (TypeError, ValueError, IndexError):
                return None
            if when.tzinfo is None:
                return None
            seconds = when.timestamp() - (time.time() if now is None else now)
        return max(0.0, min(seconds, MAX_RETRY_AFTER))

    def relayed(self) -> http1.Answer:
        """The answer to relay; raises the failure when there is none."""
        if self.failure is not None:
            raise self.failure
        assert self.answer is not None
        return self.answer


async def attempt(
    client: forwarder.Forwarder,
    upstream: str,
    outgoing: transports.Request,
    reserve: http1.Reserve,
    trace: Trace,
    *,
    keeps: bool = False,
) -> Result:
    """Send ``outgoing`` to the app at ``upstream`` (its answer held through ``reserve``),
    traced as ``trace``'s CLIENT span; what came back, classified, with, if the delivery
    ``keeps`` (it may be kept for redelivery), the headers it was sent. Only an
    ``UpstreamFailed`` is a result; anything else (a cancellation) is the caller's to end its
    trace with."""
    span = trace.forwarding(outgoing.method, upstream, outgoing.target, outgoing.headers)
    sent = tuple(outgoing.headers.items()) if keeps else ()
    started = time.monotonic()
    try:
        answer = await client.send(upstream, outgoing, reserve)
    except errors.UpstreamFailed as exc:
        trace.failed(span, exc.code, exc.message)
        return Result(None, exc, sent, time.monotonic() - started)
    took = time.monotonic() - started
    trace.answered(span, answer.status, answer.resend_count)
    if answer.status == 410:
        gone = errors.UpstreamUnavailable(f"{GONE}; relayed as 502", upstream_status=410)
        return Result(answer, gone, sent, took)
    return Result(answer, None, sent, took)


async def handing_off(
    attempting: Awaitable[Result],
    after: float,
    hand_off: Callable[[], Coroutine[Any, Any, T | None]],
) -> tuple[Result, T | None]:
    """Await ``attempting``; if it has not ended ``after`` seconds from now, run ``hand_off``
    meanwhile (the delivery kept and its sender answered, while the attempt goes on): the
    result, and what the hand-off returned (None: it did not happen, or did not keep it). A
    timer, not a task, until the hand-off is due: most attempts end well before it."""
    loop = asyncio.get_running_loop()
    handing: asyncio.Task[T | None] | None = None

    def start() -> None:
        nonlocal handing
        handing = loop.create_task(hand_off())

    timer = loop.call_later(after, start)
    try:
        result = await attempting
    except BaseException:
        timer.cancel()
        if handing is not None:  # cancelled (a drain past its timeout): the hand-off too
            handing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handing
        raise
    timer.cancel()
    return result, None if handing is None else await handing


def keep(
    route: routes.RouteConfig,
    settings: redeliver.Redeliver,
    attempt: database.Attempt,
    scope: str,
    signed: str | None = None,
    *,
    delay: float | None = None,
    attempted: bool = True,
) -> database.KeepPolicy:
    """How a delivery on ``route`` is kept for the redeliverer after ``attempt`` (its claim is
    in ``scope``; ``signed``: its claim ID's signed part, see ``database.KeepPolicy``): dead at once
    on an answer retrying cannot fix; due after ``delay`` (None: the schedule's first wait; 0 for
    one not sent, a lease for one handed off); ``attempted``: False for one kept before its
    attempt ended (``attempt`` is then not recorded)."""
    return database.KeepPolicy(
        delay=settings.schedule[0] if delay is None else delay,
        until=settings.for_,
        max_pending=settings.max_pending,
        max_pending_bytes=settings.max_pending_bytes,
        cap_scope=route.cap_scope(scope),
        dead=attempt.status in UNFIXABLE,
        signed=signed,
        attempted=attempted,
    )


class Recorded(Protocol):
    """A kept delivery whose attempt ``record`` writes: a redelivery (its row locked), or a
    delivery handed off (its row due only after its lease)."""

    failures: int  # the failed attempts so far, for the schedule

    async def delivered(self, attempt: database.Attempt) -> None: ...

    async def failed(
        self, attempt: database.Attempt, delay: float, *, dead: bool
    ) -> database.InboxState: ...


async def record(
    redelivery: Recorded,
    settings: redeliver.Redeliver | None,
    result: Result,
    written: Callable[[], Awaitable[bool | None]] | None = None,
) -> str:
    """``result`` in a kept delivery's row, committed: "delivered" (the app took it), else
    "failed" (due again on the route's schedule, ``settings``; None: the default one; never
    before the app's ``Retry-After``) or "dead" (past its ``for``, or an answer retrying
    cannot fix). On a route with ``receipt``, a failure is first settled by the app's receipt
    (``written``): written, the delivery is "delivered" (the app's effect committed)."""
    failed = result.attempt
    if result.taken and failed.status is not None:
        await redelivery.delivered(failed)
        return "delivered"
    if written is not None and await written():
        # The app committed its receipt: the effect is done, whatever its answer said.
        await redelivery.delivered(failed)
        return "delivered"
    settings = settings or redeliver.Redeliver()
    delay = max(settings.delay(redelivery.failures + 1), result.retry_after() or 0.0)
    state = await redelivery.failed(failed, delay, dead=failed.status in UNFIXABLE)
    return "dead" if state == database.InboxState.DEAD else "failed"


class Executor:
    """This worker's attempts at the app and what each leads to beyond its own row, for a first
    delivery, a hand-off and a redelivery alike: built once (``app``) with the forwarder, the
    route holds, the receipts' databases of the routes with ``receipt`` and the meters."""

    __slots__ = ("_client", "_meters", "_receipts", "_store", "holds")

    def __init__(
        self,
        store: database.Store,
        client: forwarder.Forwarder,
        *,
        holds: route_holds.Holds | None,
        receipts_: dict[str, database.Receipts],
        meters: metrics.Metrics,
    ) -> None:
        self._store = store
        self._client = client
        self._receipts = receipts_  # by route name: the routes with receipt
        self._meters = meters
        self.holds = holds  # None: no route is held (a worker without the holds' task)

    async def attempt(
        self,
        upstream: str,
        outgoing: transports.Request,
        reserve: http1.Reserve,
        trace: Trace,
        *,
        keeps: bool = False,
    ) -> Result:
        """One attempt at the app (``attempt``)."""
        return await attempt(self._client, upstream, outgoing, reserve, trace, keeps=keeps)

    async def prepare(self) -> None:
        """With a route with ``receipt``, the receipts' keys read (a round trip the first
        time only): before a row or a claim holds a connection."""
        if self._receipts:
            await self._store.receipt_keys()

    async def receipt_keys(self, route: routes.RouteConfig) -> receipts.Keys | None:
        """On a route with ``receipt``, what names its claims' receipts (read at start: a round
        trip only when it could not be then, a standby's start); else None."""
        if route.receipt is None or route.name not in self._receipts:
            return None
        return await self._store.receipt_keys()

    async def receipt_key(self, route: routes.RouteConfig, scope: str, event_id: str) -> str | None:
        """On a route with ``receipt``, the key a claim's app is sent (every attempt's the
        same: it names the claim), else None."""
        keys = await self.receipt_keys(route)
        return None if keys is None else keys.key(self._store.table, scope, event_id)

    @staticmethod
    def with_receipt(headers: MutableMapping[str, str], key: str | None) -> None:
        """The receipt's key in the headers the app is sent (``Dedup-Receipt``)."""
        if key is not None:
            headers[receipts.HEADER] = key

    async def receipt_written(self, route: routes.RouteConfig, key: str) -> tuple[bool | None, str]:
        """Whether the app committed the receipt ``key`` names (True, False, None: undecided,
        waited for ``receipt.wait`` at most), and that in words, counted."""
        assert route.receipt is not None
        found = await self._receipts[route.name].written(key, route.receipt.wait)
        described = receipts.described(found)
        self._meters.receipts.labels(route.name, described).inc()
        return found, described

    def receipt_probe(
        self, route: routes.RouteConfig | None, key: str | None
    ) -> Callable[[], Awaitable[bool | None]] | None:
        """On a route with ``receipt`` (``key`` its claim's): what settles a failed attempt
        by the app's receipt (``record``); else None."""
        if route is None or route.receipt is None or key is None:
            return None
        if route.name not in self._receipts:
            return None
        found_route = route

        async def written() -> bool | None:
            return (await self.receipt_written(found_route, key))[0]

        return written

    async def receipt_missing(self, route: routes.RouteConfig, key: str) -> bool:
        """After a 2xx on a route with ``receipt``: True if the app wrote no receipt (a
        warning, ``dedup_receipts_total{result="missing"}``): otherwise the doubt it was meant
        to settle would be settled as "not done", and the event sent again. False when it did,
        or the look failed (logged)."""
        try:
            committed = await self._receipts[route.name].committed(key)
        except errors.StoreUnavailable as exc:
            log.warning("checking a receipt failed: %s", exc.message)
            return False
        if committed:
            return False
        self._meters.receipts.labels(route.name, "missing").inc()
        return True

    async def back_off(self, scope: str, result: Result) -> float | None:
        """The app's ``Retry-After`` on a 429 or 503 (seconds, capped), and its scope held as
        long on every replica (on a templated route the tenant's, not the route's): the
        scope's redeliveries and new deliveries wait too. None when the app did not ask."""
        retry_after = result.retry_after()
        if retry_after is not None and self.holds is not None:
            await self.holds.hold_for_retry_after(scope, retry_after)
        return retry_after

    async def record(
        self,
        recorded: Recorded,
        route: routes.RouteConfig | None,
        result: Result,
        scope: str,
        receipt: str | None,
    ) -> str:
        """A kept delivery's attempt (a redelivery, or a hand-off's) in its row (``record``,
        settled by the app's receipt where the route has one), then the app's Retry-After
        on its scope (``back_off``): "delivered", "failed" or "dead"."""
        settings = None if route is None else route.redeliver
        try:
            return await record(recorded, settings, result, self.receipt_probe(route, receipt))
        finally:  # held even when the row could not be written: the app asked all the same
            await self.back_off(scope, result)
