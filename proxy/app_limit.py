"""The limit at the app: at most so many requests at the app at once, per worker.

``upstream.concurrency`` is per replica, shared out among its workers (``share``), as the
redeliverer's lanes are: a sidecar's replica is one app instance, so its limit is what that one
instance can take, and it holds however many proxy replicas there are. First deliveries and
redeliveries take their turn at the same ``Room``; pass-through does not (it is the app's own
traffic, its pages and health checks, which the proxy cannot keep for later, and it is bounded by
its own connections).

The room is also what keeps the database pool from starving: a claim holds its connection for
as long as the app works on it, and only a request with a place in the room may claim for the
app. The room is at most the pool less ``reserve(pool_size)`` connections, so the short
transactions (a delivery kept because the room is full, a duplicate settled, the redeliverer's
reads) always find one.

A request that finds the room full waits its turn, in order of arrival (``enter``): on a
route with ``redeliver`` for ``KEEP_WAIT`` at most, then it is kept, due at once, and answered
202; on any other route up to ``pool_timeout``, then refused. The redeliverer's lanes wait too
(``enter_lane``), but behind the requests, and never so as to turn one away: a lane waiting
makes the room no fuller, a place given back goes to a waiting request first, and while
requests keep arriving (one within ``QUIET``) the lanes hold at most ``lane_share`` of the
places, the rest left free for them; once none has arrived for ``QUIET``, every place. So a
load the app can carry is answered by the app itself whatever is kept (a keep costs the
database several times a forward, and kept deliveries taking the places of newcomers, which
are kept in turn, is a loop the load alone would keep going), and kept deliveries go out in
the places the requests leave: a place given back wakes a waiting lane at once.

With ``shared`` (``upstream.concurrency: {limit: N, shared: true}``) the room stays in front,
each worker's as large as its pool allows (up to N): a worker never holds more claims at the app
than its connections. The bound is then the N places every replica holds together, rows locked
in the transaction of each delivery at the app (``database.slots``, taken by the pipeline and the
redeliverer once they have a place here).

The requests of a route without ``verify`` (``behind``), which anyone can send, wait behind
the others: a place that frees goes to a signed request first, then to a lane (within its
share), and to them last; they count as full only to each other and to signed requests. A flood
on such a route holds at most the places it has, and cannot queue ahead of a provider's signed
deliveries or the redeliveries of kept ones (docs/security.md, "A flood on an unsigned route").
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

# The longest a redeliverer's lane waits for room before it looks again.
LANE_WAIT = 5.0
# The longest a request of a route with ``redeliver`` waits for a place before it is kept: a
# sender waiting out a request at the app is answered by the app rather than kept.
KEEP_WAIT = 0.5
# Requests arriving this often (seconds) keep places from the redeliverer's lanes (``Room``).
QUIET = 1.0


def reserve(pool_size: int) -> int:
    """The connections of a worker's pool that no request at the app may hold, on a worker with
    a route that redelivers (one in five, at least one)."""
    return max(1, pool_size // 5)


def room_for(pool_size: int, *, keeps: bool) -> int:
    """The most requests a worker's pool lets be at the app at once: every connection, less
    ``reserve`` when deliveries may be kept (``keeps``)."""
    return pool_size - (reserve(pool_size) if keeps else 0)


def share(
    concurrency: int | None, workers: int, pool_size: int, *, keeps: bool, shared: bool = False
) -> int:
    """This worker's share of ``upstream.concurrency`` (None: as many as its pool allows);
    ``shared`` (held by every replica together, ``database.slots``): as many as its pool
    allows, up to the whole limit, the shared places being the bound."""
    if concurrency is None:
        return room_for(pool_size, keeps=keeps)
    if shared:
        return min(concurrency, room_for(pool_size, keeps=keeps))
    return concurrency // workers


def lane_share(size: int) -> int:
    """The most places of ``size`` the redeliverer's lanes hold while requests arrive: all but a
    quarter (at least one; all of a room of one, or kept deliveries would wait for a lull)."""
    return max(1, size - max(1, size // 4))


class Room:
    """At most ``size`` requests at the app at once in this worker; the others wait in order
    of arrival (``enter``); the redeliverer's lanes take what places the requests leave
    (``enter_lane``, see the module's docstring)."""

    __slots__ = ("_behind", "_lanes", "_last_arrival", "_waiters", "in_flight", "lanes_in",
                 "on_overflow", "quiet", "size", "waited")  # fmt: skip

    def __init__(self, size: int, *, quiet: float = QUIET) -> None:
        self.size = size
        self.quiet = quiet
        self.in_flight = 0  # places taken, by requests and lanes
        self.lanes_in = 0  # of them, by lanes
        self.waited = 0  # how many requests and lanes entered after a wait (for the metrics)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._lanes: collections.deque[asyncio.Future[None]] = collections.deque()
        # Requests of routes without verify: handed a place only when no signed request or
        # lane (within its share) waits.
        self._behind: collections.deque[asyncio.Future[None]] = collections.deque()
        self._last_arrival = -math.inf  # monotonic: when a request last asked for a place
        # Told when a delivery is kept for want of a place (the redeliverer's lanes wake).
        self.on_overflow: Callable[[], None] | None = None

    def overflowed(self) -> None:
        """A delivery was kept for want of a place: whoever sends kept ones should look now."""
        if self.on_overflow is not None:
            self.on_overflow()

    @property
    def waiting(self) -> int:
        """How many requests wait for a place."""
        return len(self._waiters) + len(self._behind)

    def full(self, *, behind: bool = False) -> bool:
        """No place now for a request (every place taken, or a request it would pass waiting
        for one; a lane waiting does not count)."""
        return self.in_flight >= self.size or bool(self._waiters) or (behind and bool(self._behind))

    def lanes_may_hold(self, now: float) -> int:
        """How many places the lanes may hold at ``now`` (monotonic): ``lane_share`` while
        requests arrive, else every one."""
        return lane_share(self.size) if now - self._last_arrival < self.quiet else self.size

    def try_enter(self, *, behind: bool = False) -> bool:
        """A request takes a place if one is free and no request it would pass waits for it;
        never waits."""
        self._last_arrival = time.monotonic()
        if self.full(behind=behind):
            return False
        self.in_flight += 1
        return True

    async def enter(self, patience: float, *, behind: bool = False) -> bool:
        """A request takes a place, waiting at most ``patience`` seconds behind the requests
        that came first (and, ``behind``, behind the signed ones and the lanes): whether one
        was taken."""
        if self.try_enter(behind=behind):
            return True
        waiter = asyncio.get_running_loop().create_future()
        queue = self._behind if behind else self._waiters
        queue.append(waiter)
        try:
            async with asyncio.timeout(patience):
                await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self.leave()  # handed a place just as the wait ended: pass it on
            else:
                waiter.cancel()
                self._forget(queue, waiter)
            if isinstance(exc, TimeoutError):
                return False
            raise
        self.waited += 1
        return True

    def _lane_may_enter(self, now: float) -> bool:
        return (
            self.in_flight < self.size
            and not self._waiters
            and self.lanes_in < self.lanes_may_hold(now)
        )

    async def enter_lane(self, patience: float) -> bool:
        """A redeliverer's lane takes a place the requests leave, waiting at most ``patience``
        seconds: whether one was taken (``leave_lane`` gives it back)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        waited = 0
        while True:
            now = time.monotonic()
            if self._lane_may_enter(now):
                self.in_flight += 1
                self.lanes_in += 1
                self.waited += waited
                return True
            waited = 1
            left = deadline - loop.time()
            if left <= 0:
                return False
            if self.in_flight < self.size and not self._waiters:
                # Only the lanes' share stands in the way: it lifts once requests stop, with
                # no place given back to say so; look again then.
                left = min(left, max(0.0, self._last_arrival + self.quiet - now) + 0.001)
            waiter = loop.create_future()
            self._lanes.append(waiter)
            try:
                async with asyncio.timeout(left):
                    await waiter
            except TimeoutError:
                if waiter.done() and not waiter.cancelled():
                    self.waited += 1
                    return True  # handed a place just as the wait ended: it is this lane's
                waiter.cancel()
                self._forget(self._lanes, waiter)
                continue
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self.leave_lane()  # handed a place, then cancelled: pass it on
                else:
                    waiter.cancel()
                    self._forget(self._lanes, waiter)
                raise
            self.waited += 1
            return True  # handed a place by ``leave`` (counted there)

    @staticmethod
    def _forget(
        queue: collections.deque[asyncio.Future[None]], waiter: asyncio.Future[None]
    ) -> None:
        if waiter in queue:
            queue.remove(waiter)

    def leave(self) -> None:
        """A request gives its place back: to the first signed request waiting, if one is,
        else to a lane waiting, if the lanes may hold one more, else to the first request of a
        route without verify."""
        self._pass_on()

    def leave_lane(self) -> None:
        """A lane gives its place back (as ``leave``)."""
        self.lanes_in -= 1
        self._pass_on()

    def _pass_on(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the place passes on: in_flight stays
                return
        if self.lanes_in < self.lanes_may_hold(time.monotonic()):
            while self._lanes:
                waiter = self._lanes.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    self.lanes_in += 1
                    return
        while self._behind:
            waiter = self._behind.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.in_flight -= 1
