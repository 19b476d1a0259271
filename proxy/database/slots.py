"""The places at the app held by every replica together (``upstream.concurrency: {limit: N,
shared: true}``): N rows of the claim table, each a place, held by a row lock.

The rows are of scope ``sql.SLOTS`` ("~slots/app": no route's, so never swept, listed or
counted), event IDs 0 to N-1 written with ``WIDTH`` digits ("0000000000" …), made at start
(``make``: INSERT ... ON CONFLICT DO NOTHING, so every replica may, and rows of a larger N
before are left, never taken: only IDs below N are). Of one width, the IDs sort as their
numbers, so "from 0 to below N" is one range of the primary key's index, planned as cheaply
whatever N (a list of N IDs costs its planning at each call: twice the take's, at N = 64), and
no ID of another width falls inside it ("0" sorts before "0000000000", "1" after "0000000064").

A place is taken by ``take``, one statement (``FOR UPDATE SKIP LOCKED LIMIT 1``, one round
trip: ``sql.take_place``) in the transaction that holds the delivery at the app: a first
delivery's claim (after its claim row, and its object's row on an ordered route: always in that
order, and SKIP LOCKED never waits, so no two transactions wait on each other), a redelivery's
take. It is freed with that transaction: COMMIT, ROLLBACK, or its connection dying with a
replica killed, so a place cannot leak, with no lease, no heartbeat and no second store. None
free: the caller looks again after a short backoff (``backoff``), or keeps or refuses the
delivery.

FOR UPDATE needs the UPDATE privilege on a column of the table: the inbox's grant (its columns,
``inbox.GRANT_HINT``) is the one asked for, as the redeliverer's takes need it too.

Not on a table Citus distributes: it spreads the rows by ``event_id``, so the N places are on
up to N shards, and it locks no rows across shards ("could not run distributed query with
FOR UPDATE/SHARE commands"); ``NOT_ON_CITUS`` is why the start is refused there.

``held`` counts the places held cluster-wide for the metrics: the rows it cannot lock with SKIP
LOCKED, in a transaction of its own that holds the free ones for an instant (a take then finds
none, and looks again after its backoff).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from proxy.database import pool, sql

# The digits of a place's ID: every replica writes them alike, whatever its limit.
WIDTH = 10

# What ``take``'s statement answers when it locked a place (``sql.take_place``).
TAKEN = "SELECT 1"

NOT_ON_CITUS = (
    "upstream.concurrency: shared needs one PostgreSQL, and the claim table is distributed by "
    "Citus: its places would be rows on many shards, which Citus does not lock in one statement "
    "(FOR UPDATE across shards); set the limit per replica on Citus (upstream.concurrency: N)"
)

# The first wait between two looks for a free place, doubled after each up to BACKOFF_MAX.
BACKOFF = 0.01
BACKOFF_MAX = 0.1


def backoff(tries: int | None = None) -> float:
    """How long to wait before the look after ``tries`` failed ones (None: the longest; a
    redeliverer's lane, behind the requests), jittered: the replicas looking at once do not
    look again at once."""
    longest = BACKOFF_MAX if tries is None else min(BACKOFF_MAX, BACKOFF * 2**tries)
    return longest * random.uniform(0.5, 1.0)


def place_id(number: int) -> str:
    """The event ID of place ``number`` (``WIDTH`` digits)."""
    return str(number).zfill(WIDTH)


Acquire = Callable[[], AbstractAsyncContextManager[pool.Connection]]


class Slots:
    """The ``limit`` shared places over one claim table (``name``: whose; "app")."""

    def __init__(self, quoted: str, limit: int, op_timeout: float, name: str = "app") -> None:
        self.limit = limit
        self.scope = f"{sql.SLOTS}/{name}"
        self.below = place_id(limit)  # the first ID not a place here
        self.op_timeout = op_timeout
        self._make = (
            f"INSERT INTO {quoted} (scope, event_id, event_type) "
            f"SELECT $1, lpad(g::text, {WIDTH}, '0'), 'slot' FROM generate_series(0, $2 - 1) AS g "
            "ON CONFLICT (scope, event_id) DO NOTHING"
        )
        # Among the IDs below the limit, the rows held passed over inside the server; no ORDER
        # BY: which free place does not matter.
        self.take_statement = sql.take_place(quoted, self.scope, place_id(0), self.below)
        self._free = (
            f"SELECT count(*) FROM (SELECT FROM {quoted} WHERE scope = $1 "
            "AND event_id >= $2 AND event_id < $3 FOR UPDATE SKIP LOCKED) AS free"
        )

    async def make(self, connection: pool.Connection) -> None:
        """The rows of the places, those missing made (every replica's start)."""
        await connection.execute(self._make, self.scope, self.limit, timeout=self.op_timeout)

    async def take(self, connection: pool.Connection) -> bool:
        """Hold a free place in ``connection``'s open transaction, until it ends: whether one
        was free (False: every one is held). Never waits on a lock."""
        status: str = await connection.execute(self.take_statement, timeout=self.op_timeout)
        return status == TAKEN

    async def held(self, acquire: Acquire) -> int:
        """How many places are held now, by every replica (see the module's docstring)."""
        async with acquire() as connection:
            with pool.translated("reading the places held at the app failed"):
                async with connection.transaction():
                    free: int = await connection.fetchval(
                        self._free,
                        self.scope,
                        place_id(0),
                        self.below,
                        timeout=self.op_timeout,
                    )
        return self.limit - free

    @contextlib.asynccontextmanager
    async def kept(self, connection: pool.Connection, begin: str) -> AsyncIterator[bool]:
        """A place held on ``connection`` in a transaction of its own (a hand-off's: its claim
        commits while the app still works), until the block ends: whether one was free (the
        transaction ended at once if not)."""
        with pool.translated("taking a place at the app failed"):
            await connection.execute(begin, timeout=self.op_timeout)
            taken = await self.take(connection)
        try:
            yield taken
        finally:
            with contextlib.suppress(Exception), pool.translated("rollback failed"):
                await connection.execute("ROLLBACK", timeout=self.op_timeout)
