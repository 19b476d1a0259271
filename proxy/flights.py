"""In-process single-flight: copies of one event in flight in this process wait here.

PostgreSQL's row lock already serialises copies, but a copy waiting there holds a pool
connection; a storm of 500 copies would drain the pool and turn into 503s. Here, only one
request per (scope, event_id) at a time goes on to the database; the others wait on an asyncio
lock, holding nothing. When the owner commits, the waiting copies are answered as duplicates
without a database round trip; when it fails, the next copy takes its turn and claims in the
database as usual. Copies on other replicas still meet at the row lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proxy import errors

if TYPE_CHECKING:
    from proxy import database

Key = tuple[str, str]


@dataclass(slots=True)
class Flight:
    """The local state of one event while requests for it are in this process."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    # Set once the event is known to be committed (this process's owner committed it, or a copy
    # found it committed in the database): a body digest equal to the stored one, for the
    # mismatch check of the copies still queued here.
    committed_sha256: bytes | None = None
    # And, on a route that replays, the answer stored with the claim (None: the acknowledgement).
    answer: database.Answer | None = None


class Flights:
    """The events with requests in flight in this process."""

    def __init__(self) -> None:
        self._flights: dict[Key, Flight] = {}

    def waiting(self, key: Key) -> int:
        """Requests for ``key`` in this process (the one holding the turn included)."""
        flight = self._flights.get(key)
        return flight.users if flight else 0

    @contextlib.asynccontextmanager
    async def turn(self, key: Key, within: float) -> AsyncIterator[Flight]:
        """Wait (at most ``within`` seconds) until no other local request holds ``key``."""
        flight = self._flights.setdefault(key, Flight())
        flight.users += 1
        try:
            if flight.lock.locked():
                try:
                    async with asyncio.timeout(within):
                        await flight.lock.acquire()
                except TimeoutError as exc:
                    raise errors.ClaimWaitExceeded() from exc
            else:
                await flight.lock.acquire()  # free: returns at once, no timer needed
            try:
                yield flight
            finally:
                flight.lock.release()
        finally:
            flight.users -= 1
            if flight.users == 0:
                del self._flights[key]
