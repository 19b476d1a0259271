"""A fixed number of PostgreSQL connections, lent to one request at a time.

Why not ``asyncpg.Pool``: per request it costs a task for ``acquire(timeout=)`` (Python 3.11's
``wait_for``), another for the ``shield`` in ``release``, a reset round trip unless told
otherwise, and a proxy object wrapping every call; about 47 µs of CPU per acquire and release
on the benchmark machine, a twentieth of a proxied webhook. The proxy needs much less: a
connection ends every request outside a transaction (or is closed), no session state is ever
changed after connecting, and the caller bounds waiting with its own timeout.

A connection found closed is replaced on the next acquire; one idle longer than
``MAX_IDLE`` is replaced too (as asyncpg's pool does after 300 s), so that a connection a
firewall or NAT silently forgot is not the one a webhook meets. A connection given back inside
a transaction, or closed, is terminated, never lent again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import asyncpg

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    Connection = asyncpg.Connection[Any]  # generic in the stubs only
else:
    Connection = asyncpg.Connection
MAX_IDLE = 300.0


class Pool:
    """``size`` connections made by ``connect``; at most ``size`` lent at once.

    Each free slot is on a stack, most recently returned on top: a connection, or None where
    one was closed and a new one is to be opened (so the next request opens a fresh connection
    rather than trying an older one that may sit behind the same broken link).
    """

    def __init__(self, connect: Callable[[], Awaitable[Connection]], size: int) -> None:
        self._connect = connect
        self._slots = asyncio.Semaphore(size)
        self._free: list[tuple[Connection | None, float]] = [(None, 0.0)] * size
        self._open: set[Connection] = set()
        self._lent: set[Connection] = set()
        self._closed = False

    @classmethod
    async def open(cls, connect: Callable[[], Awaitable[Connection]], size: int) -> Pool:
        """Open every connection now, so that a bad DSN fails the start, not a webhook."""
        pool = cls(connect, size)
        results = await asyncio.gather(*(connect() for _ in range(size)), return_exceptions=True)
        opened = [r for r in results if isinstance(r, asyncpg.Connection)]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for connection in opened:
                connection.terminate()
            raise failed[0]
        now = time.monotonic()
        pool._free = [(connection, now) for connection in opened]
        pool._open.update(opened)
        return pool

    def ready(self, now: float) -> bool:
        """Whether ``acquire(now)`` would return at once: a free slot, and on top of the stack
        an open connection not idle for ``MAX_IDLE`` at ``now`` (so nothing to wait for or to
        open). Judge both by the same ``now``: a second clock reading could cross MAX_IDLE."""
        if self._slots.locked() or self._closed or not self._free:
            return False
        connection, since = self._free[-1]
        return connection is not None and not connection.is_closed() and now - since < MAX_IDLE

    async def acquire(self, now: float | None = None) -> Connection:
        """A connection, waiting for a free slot (bound the wait with a timeout); a connection
        idle for ``MAX_IDLE`` at ``now`` (default: when the slot is free) is replaced."""
        await self._slots.acquire()
        if self._closed:
            self._slots.release()
            raise asyncpg.InterfaceError("the pool is closed")
        connection, since = self._free.pop()
        if now is None:
            now = time.monotonic()
        if connection is None or connection.is_closed() or now - since >= MAX_IDLE:
            if connection is not None:
                self._forget(connection)
            try:
                connection = await self._connect()
            except BaseException:
                self._free.append((None, 0.0))
                self._slots.release()
                raise
            self._open.add(connection)
        self._lent.add(connection)
        return connection

    def release(self, connection: Connection) -> None:
        """Take a connection back; it must be outside any transaction to be lent again."""
        if connection not in self._lent:
            raise RuntimeError("released a connection this pool did not lend (twice?)")
        self._lent.discard(connection)
        if self._closed or connection.is_closed() or connection.is_in_transaction():
            self._forget(connection)
            self._free.append((None, 0.0))
        else:
            self._free.append((connection, time.monotonic()))
        self._slots.release()

    def _forget(self, connection: Connection) -> None:
        self._open.discard(connection)
        connection.terminate()

    def stats(self) -> tuple[int, int]:
        """(connections open, connections idle)."""
        return len(self._open), sum(1 for connection, _ in self._free if connection is not None)

    async def close(self, within: float) -> None:
        """Close every connection: politely within ``within`` seconds, then by force."""
        self._closed = True
        connections = list(self._open)
        self._open.clear()
        self._free.clear()
        results = await asyncio.gather(
            *(connection.close(timeout=within) for connection in connections),
            return_exceptions=True,
        )
        for connection, result in zip(connections, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("closing a database connection failed: %r", result)
                connection.terminate()
