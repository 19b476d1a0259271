"""One attempt at the app, a first delivery or a redelivery: send it, trace it, classify what
came back into one ``Result``, and the inbox's policy for a failed one (kept pending or dead,
when it is due again). The pipeline (a first delivery) and the redeliverer (a kept one) both
attempt through ``attempt`` and keep or record through ``keep`` and ``record``, so an answer is
decided the same on both paths (river's job executor runs every attempt, first or retry;
procrastinate keeps its retry decision in ``retry.py``).

What an attempt is wrapped in stays with its caller: the pipeline's claim, log line and HTTP
answer; the redeliverer's row lock, memory reservation and log record. A caller that keeps a
delivery the app was never sent (no ``Result``) keeps it with an ``Attempt`` of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from proxy import database, errors
from proxy.config import redeliver
from proxy.upstream import http1, transports

if TYPE_CHECKING:
    from proxy import tracing
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
