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

A request that finds the room full does not wait where it can be kept (``try_enter``: a route
with ``redeliver`` keeps it, due at once, and answers 202); the redeliverer's lanes and the
requests of other routes wait their turn in order (``enter``). While a lane waits, the room
counts as full to newcomers, so the oldest kept delivery goes first.

The requests of a route without ``verify`` (``behind``), which anyone can send, wait behind
the others: a place that frees goes to a lane or a signed request first, and they count as
full only to each other. A flood on such a route holds at most the places it has, and cannot
queue ahead of a provider's signed deliveries (docs/security.md, "A flood on an unsigned
route").
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

# The longest a redeliverer's lane waits for room before it looks again.
LANE_WAIT = 5.0


def reserve(pool_size: int) -> int:
    """The connections of a worker's pool that no request at the app may hold, on a worker with
    a route that redelivers (one in five, at least one)."""
    return max(1, pool_size // 5)


def room_for(pool_size: int, *, keeps: bool) -> int:
    """The most requests a worker's pool lets be at the app at once: every connection, less
    ``reserve`` when deliveries may be kept (``keeps``)."""
    return pool_size - (reserve(pool_size) if keeps else 0)


def share(concurrency: int | None, workers: int, pool_size: int, *, keeps: bool) -> int:
    """This worker's share of ``upstream.concurrency`` (None: as many as its pool allows)."""
    if concurrency is None:
        return room_for(pool_size, keeps=keeps)
    return concurrency // workers


class Room:
    """At most ``size`` requests at the app at once in this worker; the others wait in order
    of arrival (those ``behind`` after all others), or are kept without waiting
    (``try_enter``)."""

    __slots__ = ("_behind", "_waiters", "in_flight", "on_overflow", "size", "waited")

    def __init__(self, size: int) -> None:
        self.size = size
        self.in_flight = 0
        self.waited = 0  # how many entered after a wait (for the metrics)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # Those of routes without verify: handed a place only when no one above waits.
        self._behind: collections.deque[asyncio.Future[None]] = collections.deque()
        # Told when a delivery is kept for want of a place (the redeliverer's lanes wake).
        self.on_overflow: Callable[[], None] | None = None

    def overflowed(self) -> None:
        """A delivery was kept for want of a place: whoever sends kept ones should look now."""
        if self.on_overflow is not None:
            self.on_overflow()

    @property
    def waiting(self) -> int:
        """How many wait for a place."""
        return len(self._waiters) + len(self._behind)

    def full(self, *, behind: bool = False) -> bool:
        """No place now for a newcomer (every place taken, or someone it would pass waiting
        for one)."""
        return self.in_flight >= self.size or bool(self._waiters) or (behind and bool(self._behind))

    def try_enter(self, *, behind: bool = False) -> bool:
        """Take a place if one is free and no one waits for it; never waits."""
        if self.full(behind=behind):
            return False
        self.in_flight += 1
        return True

    async def enter(self, patience: float, *, behind: bool = False) -> bool:
        """Take a place, waiting at most ``patience`` seconds behind those who came first
        (and, ``behind``, behind everyone else): whether one was taken."""
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
                if waiter in queue:
                    queue.remove(waiter)
            if isinstance(exc, TimeoutError):
                return False
            raise
        self.waited += 1
        return True

    def leave(self) -> None:
        """Give the place back: to the first one waiting, if anyone is (one behind only if
        no one else is)."""
        for queue in (self._waiters, self._behind):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the place passes on: in_flight stays
                    return
        self.in_flight -= 1
