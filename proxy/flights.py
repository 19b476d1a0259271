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

    def turn(self, key: Key, within: float) -> Turn:
        """Wait (at most ``within`` seconds) until no other local request holds ``key``, as
        ``async with flights.turn(key, within) as flight``."""
        return Turn(self._flights, key, within)


class Turn:
    """``Flights.turn``'s context. A class rather than a generator-based context manager: it
    is on every webhook's path (bench/RESULTS.md)."""

    __slots__ = ("_flight", "_flights", "_key", "_let_go", "_within")

    def __init__(self, flights: dict[Key, Flight], key: Key, within: float) -> None:
        self._flights = flights
        self._key = key
        self._within = within
        self._flight: Flight | None = None
        self._let_go = False

    async def __aenter__(self) -> Flight:
        flight = self._flights.setdefault(self._key, Flight())
        flight.users += 1
        try:
            if flight.lock.locked():
                try:
                    async with asyncio.timeout(self._within):
                        await flight.lock.acquire()
                except TimeoutError as exc:
                    raise errors.ClaimWaitExceeded() from exc
            else:
                await flight.lock.acquire()  # free: returns at once, no timer needed
        except BaseException:
            self._leave(flight, locked=False)
            raise
        self._flight = flight
        return flight

    async def __aexit__(self, *exc_info: object) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:
            self._leave(flight, locked=not self._let_go)

    def let_go(self) -> None:
        """Let the next local copy take its turn now, before this block ends: the event is
        committed (kept at its hand-off), and the copies find it so in the database."""
        if self._flight is not None and not self._let_go:
            self._let_go = True
            self._flight.lock.release()

    def _leave(self, flight: Flight, *, locked: bool) -> None:
        if locked:
            flight.lock.release()
        flight.users -= 1
        if flight.users == 0:
            del self._flights[self._key]
