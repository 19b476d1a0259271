"""The redeliverer: sends the deliveries the app failed (kept by ``Claim.keep``) again, until
the app takes them or the route's ``for`` runs out.

It runs in every replica and every worker, a few lanes each (``redeliverer.concurrency`` per
replica, shared out among its workers, at least one each; by default as many as the limit at the
app lets in). A lane first waits for a place at the app (``app_limit.Room``, shared with the
first deliveries: a lane takes only the places they leave, so a load the app can carry is
answered by the app itself, and a place given back wakes a waiting lane at once), then takes the
oldest due row no one else holds (``Inbox.take``: ``FOR UPDATE SKIP LOCKED``) and forwards it
*while holding the row lock*, as the first delivery was forwarded while holding its claim: no
two replicas send one event at once, and a replica killed mid- redelivery leaves the row as it
was, due, for the next lane anywhere. The attempt is ``delivery.attempt``, as a first delivery's
is, and the row's transaction ends with ``delivery.record``'s one step: ``delivered`` on a 2xx,
else ``failed`` (the next attempt after the route's schedule, or dead past its ``for`` or on an
answer retrying cannot fix: ``delivery.UNFIXABLE``). Starts may be paced at ``redeliverer.rate``
per second per replica; the limit at the app bounds them anyway. While nothing is due, one lane
per worker looks every ``poll`` and wakes the others when it finds work.

A lane looks at and takes no row of a scope held (``holds``: an operator's ``events pause`` of
a route, the app's Retry-After for the scope it answered, a tenant's on a templated route), on
any replica; once the hold ends, the looking lane finds its
rows due within ``poll``, and they go out at the limit at the app, oldest first.

On SIGTERM the lanes stop taking rows; a redelivery in flight finishes, or, past
``shutdown_timeout``, is cancelled, which rolls its row back: released, never lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from multidict import CIMultiDict

from proxy import app_limit, database, delivery, errors, memory, metrics, tracing
from proxy.config import redeliver, routes
from proxy.database import slots
from proxy.upstream import forwarder, transports

if TYPE_CHECKING:
    from proxy.tracing.spans import RequestTrace

    Trace = tracing.NotTraced | RequestTrace

log = logging.getLogger(__name__)

# The log level of a redelivery's result.
LEVELS = {"delivered": logging.INFO, "failed": logging.WARNING, "dead": logging.ERROR}
# How often each worker reads its routes' inbox levels for the metrics.
LEVEL_INTERVAL = 15.0


class Redeliverer:
    """This worker's lanes (see the module's docstring)."""

    def __init__(
        self,
        store: database.Store,
        executor: delivery.Executor,
        configured: tuple[routes.RouteConfig, ...],
        *,
        settings: redeliver.RedelivererConfig,
        meters: metrics.Metrics,
        budget: memory.Budget,
        room: app_limit.Room,
        workers: int = 1,
        traces: tracing.Tracing | None = None,
    ) -> None:
        self._store = store
        self._executor = executor  # the attempt, and what it leads to (receipts, holds)
        self._tracing = traces
        self._routes = {route.name: route for route in configured if route.redeliver}
        self._scopes = sorted({route.scope for route in self._routes.values()})
        self._settings = settings
        self._meters = meters
        for name in self._routes:  # at 0 from the start: increase() misses a series' first sample
            for result in ("delivered", "failed", "dead"):
                meters.redeliveries.labels(name, result)
        self._budget = budget
        self._room = room
        # Each lane holds a pool connection while it redelivers, and a place at the app.
        lanes = room.size if settings.concurrency is None else settings.concurrency // workers
        self.lanes = max(1, min(lanes, room.size))
        # Between two starts in this worker (0: unpaced).
        self._interval = 0.0 if settings.rate is None else workers / settings.rate
        self._next_start = 0.0
        self._found_work = asyncio.Event()  # pulsed when a lane redelivered: the others look
        self._look_now = asyncio.Event()  # set by ``wake``: the looking lane looks at once
        room.on_overflow = self.wake
        self._stopping = asyncio.Event()
        self._stopped_at: float | None = None  # monotonic, when ``stop`` was first called
        self._failed_since: float | None = None  # when redeliveries began to fail, if they do
        self.in_flight = 0

    @property
    def configured(self) -> bool:
        return bool(self._routes)

    def stop(self) -> float:
        """Take no more rows (SIGTERM); what is in flight goes on. When it was first called
        (monotonic): the drain's start."""
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()
        self._stopping.set()
        self._look_now.set()
        return self._stopped_at

    async def run(self) -> None:
        """The lanes and the metrics' reader, until ``stop`` and their redeliveries end; from
        the store's start (a proxy started during an outage waits for the database)."""
        started = asyncio.ensure_future(self._store.started.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([started, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
            stopping.cancel()
        if self._stopping.is_set():
            return
        async with asyncio.TaskGroup() as group:
            for lane in range(self.lanes):
                group.create_task(self._lane(lane == 0), name=f"redeliverer-{lane}")
            group.create_task(self._levels(), name="redeliverer-levels")

    async def _lane(self, looks: bool) -> None:
        """Redeliver while rows are due; when none is, the lane that ``looks`` looks again every
        ``poll``, and the others rest until a lane finds work. A lane takes its place at the app
        only once it knows a row is due: a place held to look would turn newcomers away."""
        busy: bool | None = False  # the last turn redelivered: likely more are due
        while not self._stopping.is_set():
            await self._paced()
            if self._stopping.is_set():
                return
            # (No yielding to the requests for a connection: a lane at the app holds a place
            # in the room, which leaves the pool's reserve to the requests' short work.)
            if busy or await self._due():
                busy = await self._in_turn()
            if busy is None:
                continue  # no place within LANE_WAIT: not a rest, look again at once
            if busy:
                self.wake()
            elif looks:
                await self._look_later()
            else:
                await self._rest()

    def wake(self) -> None:
        """Work is due (a lane redelivered, or a delivery was kept for want of room at the
        app): every lane resting looks now, and so does the looking one."""
        self._found_work.set()
        self._found_work.clear()  # set() woke every lane resting now
        self._look_now.set()

    async def _look_later(self) -> None:
        """The looking lane's wait: ``poll``, or less if woken."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._settings.poll):
                await self._look_now.wait()
        self._look_now.clear()

    async def _due(self) -> bool:
        """Whether a row of this worker's routes not held is due (a read that locks nothing;
        none when every one is held)."""
        scopes = self._unheld()
        if not scopes:
            return False
        try:
            return await self._store.inbox.due(scopes, self._held_paths(scopes))
        except errors.StoreUnavailable as exc:
            self._failing(exc.message)
            return False

    async def _in_turn(self) -> bool | None:
        """Redeliver one due row in a place at the app, waited for (``LANE_WAIT`` at most):
        whether one was sent; None when no place came (the app busy with first deliveries)."""
        if not await self._room.enter_lane(app_limit.LANE_WAIT):
            return None
        try:
            sent = await self._redeliver_safely()
        finally:
            self._room.leave_lane()
        if sent is None:
            # Every place of a shared limit held (by any replica): its row rolled back, due as
            # it was; a short backoff before the lane looks again, its room place given back.
            self._meters.app_place_waits.inc()
            await self._pause(slots.backoff())
        return sent

    async def _redeliver_safely(self) -> bool | None:
        """``redeliver_one``, a failure logged rather than ending the lane."""
        try:
            redelivered = await self.redeliver_one()
        except errors.StoreUnavailable as exc:
            self._failing(exc.message)
            return False
        except Exception:
            # A bug must not end the lane: the row is rolled back, and tried again later.
            log.exception("redelivery failed, trying again in %gs", self._settings.poll)
            return False
        if self._failed_since is not None:
            log.info("redeliveries resume: the database answers again")
            self._failed_since = None
        return redelivered

    async def _rest(self) -> None:
        """Until a lane redelivers something, or stop."""
        found = asyncio.ensure_future(self._found_work.wait())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([found, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            found.cancel()
            stopping.cancel()

    def _failing(self, message: str) -> None:
        """Warn once when redeliveries start failing (the database away), not at every poll."""
        if self._failed_since is None:
            self._failed_since = time.monotonic()
            log.warning("redeliveries fail, trying again every %gs: %s", self._settings.poll,
                        message)  # fmt: skip
        else:
            log.debug("redelivery failed: %s", message)

    async def _paced(self) -> None:
        """Wait for this lane's turn under ``rate`` (shared by the lanes: one event loop)."""
        if not self._interval:
            return
        now = time.monotonic()
        start = max(now, self._next_start)
        self._next_start = start + self._interval
        if start > now:
            await self._pause(start - now)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    def _unheld(self) -> list[str]:
        """This worker's route scopes not held now (``holds``: no database round trip)."""
        holds = self._executor.holds
        return self._scopes if holds is None else holds.unheld(self._scopes)

    def _held_paths(self, scopes: list[str]) -> list[str]:
        """Their per-path scopes held now (a tenant's Retry-After), passed over."""
        holds = self._executor.holds
        return [] if holds is None else holds.held_paths(scopes)

    async def redeliver_one(self) -> bool | None:
        """Redeliver the oldest due row of a scope not held (``holds``), if one is: whether one
        was sent; None when the limit is shared and every one of its places is held (the row
        taken then rolled back: ``database.slots``, the place taken in the row's transaction,
        after its row and its object's)."""
        scopes = self._unheld()
        if not scopes:
            return False
        await self._executor.prepare()
        async with self._store.inbox.take(scopes, self._held_paths(scopes)) as redelivery:
            if redelivery is None:
                return False
            places = self._store.slots
            if places is not None and not await redelivery.take_place(places):
                return None
            self.in_flight += 1
            try:
                return await self._redeliver(redelivery)
            finally:
                self.in_flight -= 1

    async def _redeliver(self, redelivery: database.Redelivery) -> bool:
        """Send it and record the attempt; False when it was postponed instead (rolled back:
        the lane pauses rather than take the same row again at once)."""
        stored = redelivery.request
        route = self._routes.get(stored.route)
        # A route renamed since (its scope kept): its upstream as stored, the default schedule.
        upstream = stored.upstream if route is None else route.upstream
        if redelivery.stale:
            await self._supersede(redelivery)
            return True
        started = time.perf_counter()
        receipt = None
        if route is not None:
            receipt = await self._executor.receipt_key(route, redelivery.scope, redelivery.event_id)
        sent = await self._send(upstream, redelivery, receipt)
        if sent is None:
            return False  # no room in this worker's memory budget now: due as it was
        result, trace = sent
        try:
            await self._record(redelivery, result, trace, started, receipt=receipt)
        except BaseException as exc:  # cancelled at shutdown_timeout: its spans end too
            trace.abort(exc)
            raise
        return True

    async def _supersede(self, redelivery: database.Redelivery) -> None:
        """Not sent: its object's app accepted a newer version while it was kept (a later
        delivery went ahead of it, guarantees.md, "Order (per object)")."""
        await redelivery.superseded()
        stored = redelivery.request
        self._meters.redeliveries.labels(stored.route, "superseded").inc()
        event_id = self.provider_id(redelivery)
        log.info("redelivery of %s %s: superseded", stored.route, event_id,
                 extra={"fields": {"route": stored.route, "scope": redelivery.scope,
                                   "event_id": event_id, "object": stored.object,
                                   "version": stored.version, "accepted": redelivery.accepted,
                                   "result": "superseded"}})  # fmt: skip

    async def _record(
        self,
        redelivery: database.Redelivery,
        attempted: delivery.Result,
        trace: Trace,
        started: float,
        *,
        receipt: str | None,
    ) -> None:
        """The attempt's outcome (``delivery.Executor.record``: on its route's schedule, or the
        default one for a route renamed since), in its row (committed), the metrics, the log
        and the trace; ``receipt``: the key it was sent with, on a route with receipt."""
        stored = redelivery.request
        status, error = attempted.attempt.status, attempted.attempt.error
        took = round((time.perf_counter() - started) * 1000, 2)
        event_id = self.provider_id(redelivery)
        fields = {"route": stored.route, "scope": redelivery.scope, "event_id": event_id,
                  **({} if event_id == redelivery.event_id else {"claim_id": redelivery.event_id}),
                  "attempt": redelivery.failures + 1, "upstream_status": status,
                  "upstream_ms": took}  # fmt: skip
        # The app asked to wait (Retry-After): the scope's other redeliveries (on a templated
        # route, the tenant's) wait as long, everywhere.
        result = await self._executor.record(
            redelivery, self._routes.get(stored.route), attempted, redelivery.scope, receipt
        )
        level = LEVELS[result]
        if error:
            fields["error"] = error
        self._meters.redeliveries.labels(stored.route, result).inc()
        fields["result"] = result
        trace.close(
            {"dedup.redelivery.result": result, "webhook.upstream_status": status or 0},
            None if result == "delivered" else error or f"the app answered {status}",
        )
        log.log(level, "redelivery of %s %s: %s", stored.route, event_id, result,
                extra={"fields": fields})  # fmt: skip

    def provider_id(self, redelivery: database.Redelivery) -> str:
        """The redelivered event's ID as the provider sent it: on a route whose claims are
        bound (or a route renamed since), without the digest its claim's ID carries."""
        route = self._routes.get(redelivery.request.route)
        if route is not None and not route.binds_claims:
            return redelivery.event_id
        return database.unbound(redelivery.event_id)

    async def _send(
        self, upstream: str, redelivery: database.Redelivery, receipt: str | None
    ) -> tuple[delivery.Result, Trace] | None:
        """The attempt (``delivery.attempt``) with the headers kept, less any ``Dedup-*``, and
        ``receipt``'s key where it has one, and the trace begun for it; None when the body
        does not fit the worker's memory budget now (not sent, not an attempt, not traced)."""
        stored = redelivery.request
        headers = forwarder.without_own(CIMultiDict(stored.headers))
        self._executor.with_receipt(headers, receipt)
        outgoing = transports.Request(stored.method, stored.target, headers, stored.body)
        with self._budget.reservation() as reservation:
            try:
                reservation.body(len(stored.body))
            except errors.Overloaded as exc:
                log.info("redelivery postponed: %s", exc.message)
                return None
            trace: Trace = tracing.NOT_TRACED
            if self._tracing is not None:
                event_id = self.provider_id(redelivery)
                trace = self._tracing.redelivery(
                    stored.route, event_id, redelivery.failures + 1, stored.headers,
                    None if event_id == redelivery.event_id else redelivery.event_id,
                )  # fmt: skip
            try:
                result = await self._executor.attempt(upstream, outgoing, reservation.answer, trace)
            except BaseException as exc:
                trace.abort(exc)
                raise
        return result, trace

    async def _levels(self) -> None:
        """Every LEVEL_INTERVAL, each route's inbox into the gauges, and the places of a shared
        limit held by every replica."""
        while not self._stopping.is_set():
            try:
                await self.read_places()
            except errors.StoreUnavailable as exc:
                log.debug("reading the places held at the app failed: %s", exc.message)
            for name, route in self._routes.items():
                try:
                    await self.read_level(name, route)
                except errors.StoreUnavailable as exc:
                    log.debug("reading the inbox level of %s failed: %s", name, exc.message)
                except Exception:  # the gauges go stale; the redeliveries go on
                    log.exception("reading the inbox level of %s failed", name)
            await self._pause(LEVEL_INTERVAL)

    async def read_places(self) -> None:
        """The places of a shared limit held by every replica, into their gauge."""
        held = await self._store.places_held()
        if held is not None:
            self._meters.app_places_held.set(held)

    async def read_level(self, name: str, route: routes.RouteConfig) -> None:
        """One route's inbox into the gauges (a route with ``order``: its blocked objects too)."""
        level = await self._store.inbox.level(route.scope)
        meters = self._meters
        meters.inbox_pending.labels(name).set(level.pending)
        meters.inbox_pending_bytes.labels(name).set(level.pending_bytes)
        meters.inbox_dead.labels(name).set(level.dead)
        meters.inbox_oldest_pending.labels(name).set(level.oldest_pending or 0)
        meters.inbox_overdue.labels(name).set(max(0.0, level.most_overdue or 0))
        meters.inbox_oldest_dead.labels(name).set(level.oldest_dead or 0)
        if route.order is not None:
            blocked = await self._store.inbox.blocked_level(route.scope)
            meters.ordering_blocked.labels(name).set(blocked.objects)
            meters.ordering_oldest_blocked.labels(name).set(blocked.oldest or 0)
        meters.inbox_level_read.labels(name).set_to_current_time()
