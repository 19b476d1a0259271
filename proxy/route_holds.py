"""This worker's copy of the route holds (``database.holds``): which route scopes are held, and
which per-path ones, read without a round trip to the database, so that the redeliverer (and the
pipeline, per webhook) may ask at any moment.

An operator's pause holds a route scope, every path of it. The app's Retry-After holds the
scope of the claim it answered: on a templated route the tenant's ("hooks/acme"), so that one
tenant's back-pressure holds neither the others' first deliveries nor their redeliveries. At
most ``MAX_PATH_HOLDS`` per-path scopes of one route are held at once (any path value the app
answers with Retry-After would otherwise be a row read by every worker every poll); past
them, a tenant's Retry-After delays only the delivery it answered (its row is due no earlier).

The copy is read again every ``redeliverer.poll`` seconds, so a hold set anywhere (another
replica, ``dedup-proxy events pause``) is seen here within that; a hold this worker sets itself
(the app's Retry-After, ``hold_for_retry_after``) is in the copy at once. A hold ends on its own
at its end, by this worker's clock: its end is read as seconds from the database's now, so the
clocks of the database and of the replicas need not agree. While the database does not answer,
the copy keeps the holds it last read, each until its end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from proxy import database, errors, metrics
from proxy.config import routes
from proxy.database import Hold, HoldKind

log = logging.getLogger(__name__)

# Who a hold this proxy sets for the app's Retry-After is by.
RETRY_AFTER_BY = "proxy"
# A Retry-After the copy shows a hold for within this much is not written again: an app that
# answers 503 with Retry-After to every webhook costs one write per second or so, not one each.
SLACK = 1.0
# A read of the holds waits for a free pool connection, rather than yield to the requests, once
# this many polls passed without one: a pause must reach a worker that is always busy.
YIELD_POLLS = 5
# The most per-path scopes of one route held at once for the app's Retry-After (module docstring).
MAX_PATH_HOLDS = 1000

__all__ = ["MAX_PATH_HOLDS", "RETRY_AFTER_BY", "SLACK", "YIELD_POLLS", "Hold", "HoldKind", "Holds"]


class Holds:
    """The route holds of this worker's routes, read every ``poll`` seconds (see the module's
    docstring); ``held`` answers from memory."""

    def __init__(
        self,
        store: database.Store,
        configured: Iterable[routes.RouteConfig],
        *,
        poll: float,
        meters: metrics.Metrics | None = None,
    ) -> None:
        self._store = store
        self._routes = tuple(configured)
        self._scopes = sorted({route.scope for route in self._routes})  # their paths' with them
        self._poll = poll
        self._meters = meters
        self._holds: dict[str, Hold] = {}
        self._unwritten: dict[str, Hold] = {}  # Retry-After holds the database did not take
        self._failing = False
        self._read_at = time.monotonic()  # the last read that succeeded
        self.read = asyncio.Event()  # set once the holds were read
        if meters is not None:  # at 0 from the start
            for route in self._routes:
                for kind in HoldKind:
                    meters.route_held.labels(route.name, kind).set(0)

    def held(self, scope: str) -> Hold | None:
        """``scope``'s hold in force now, or None: a per-path scope ("github/acme") is held with
        its route's scope, or by a hold of its own (the app's Retry-After for that tenant)."""
        if not self._holds:  # the common case, on every webhook
            return None
        now = time.time()
        route = scope.partition("/")[0]
        for held in (route, scope) if route != scope else (scope,):
            hold = self._holds.get(held)
            if hold is not None and hold.held_at(now):
                return hold
        return None

    def unheld(self, scopes: Iterable[str]) -> list[str]:
        """Those of ``scopes`` not held now."""
        return [scope for scope in scopes if self.held(scope) is None]

    def held_paths(self, scopes: Iterable[str]) -> list[str]:
        """The per-path scopes of these route scopes held now by holds of their own."""
        if not self._holds:
            return []
        now, routes_ = time.time(), set(scopes)
        return sorted(
            scope for scope, hold in self._holds.items()
            if "/" in scope and scope.partition("/")[0] in routes_ and hold.held_at(now)
        )  # fmt: skip

    async def hold_for_retry_after(self, scope: str, seconds: float) -> Hold | None:
        """Hold ``scope`` (the claim's: on a templated route the tenant's) for at least
        ``seconds`` from now, at most ``MAX_RETRY_AFTER``, on every replica: the app answered
        429 or 503 with Retry-After. A longer hold stays, and a pause stays a pause. The hold
        in force after; if the database does not answer, this worker's alone, until the copy is
        next read (None: nothing held, the database did not answer and ``seconds`` is not more
        than 0, or ``MAX_PATH_HOLDS`` of the route's paths are held already)."""
        seconds = min(seconds, database.MAX_RETRY_AFTER)
        now = time.time()
        current = self.held(scope)
        if current is not None and (
            current.until is None or current.until + SLACK >= now + seconds
        ):
            return current
        route = scope.partition("/")[0]
        full = route != scope and len(self.held_paths([route])) >= MAX_PATH_HOLDS
        if full and scope not in self._holds:
            log.warning("not holding %s for the app's Retry-After: %d paths of route scope %s "
                        "are held already", scope, MAX_PATH_HOLDS, route)  # fmt: skip
            return current
        try:
            hold = await self._store.holds.hold_at_least(
                scope, seconds, by=RETRY_AFTER_BY, note=f"the app answered Retry-After: {seconds:g}"
            )
        except errors.StoreUnavailable as exc:
            log.warning("holding %s for the app's Retry-After failed, this worker alone holds "
                        "it: %s", scope, exc.message)  # fmt: skip
            if seconds <= 0:
                return current
            hold = Hold(reason=HoldKind.RETRY_AFTER, until=now + seconds, since=now,
                        by=RETRY_AFTER_BY, asked_until=now + seconds)  # fmt: skip
            self._unwritten[scope] = hold
        self._holds = {**self._holds, scope: hold}
        self._measure()
        return hold

    async def run(self) -> None:
        """Read the holds every ``poll`` seconds, from the store's start, until cancelled."""
        await self._store.started.wait()
        while True:
            try:
                await self.refresh()
            except Exception:  # a bug must not end the reads: the copy goes stale, not wrong
                log.exception("reading the route holds failed")
            await asyncio.sleep(self._poll)

    async def refresh(self) -> None:
        """Read the holds now; the gauges with them. A database that does not answer leaves
        the copy as it was (each hold ending at its end), and so does a pool with no connection
        free: the requests come first, as for the redeliverer, for up to ``YIELD_POLLS`` polls."""
        yielding = time.monotonic() - self._read_at < YIELD_POLLS * self._poll
        if yielding and self._store.pool_exhausted():
            self._measure()
            return
        try:
            read = await self._store.holds.active(self._scopes)
        except errors.StoreUnavailable as exc:
            if not self._failing:
                log.warning("reading the route holds failed, keeping the last read: %s",
                            exc.message)  # fmt: skip
            self._failing = True
        else:
            if self._failing:
                log.info("the route holds are read again")
            self._failing = False
            self._read_at = time.monotonic()
            self._holds = self._with_unwritten(read)
            self.read.set()
        self._measure()

    def _with_unwritten(self, read: dict[str, Hold]) -> dict[str, Hold]:
        """``read``, and the holds this worker could not write that end later, until their
        end."""
        now = time.time()
        self._unwritten = {s: h for s, h in self._unwritten.items() if h.held_at(now)}
        for scope, hold in self._unwritten.items():
            other = read.get(scope)
            if other is None or (other.until is not None and other.until < (hold.until or 0)):
                read[scope] = hold
        return read

    def _measure(self) -> None:
        meters = self._meters
        if meters is None:
            return
        now = time.time()
        for route in self._routes:
            hold = self.held(route.scope)
            for kind in HoldKind:
                meters.route_held.labels(route.name, kind).set(
                    int(hold is not None and hold.reason == kind)
                )
            meters.route_held_seconds.labels(route.name).set(
                0 if hold is None else max(0.0, now - hold.since)
            )
            end = None if hold is None else hold.asked_until
            meters.route_hold_end.labels(route.name).set(end or 0)
