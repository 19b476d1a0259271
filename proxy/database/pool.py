"""The connections to PostgreSQL: how one is opened, what its errors mean, and the pool that
lends them one request at a time. The one module that imports asyncpg.

Errors: a driver or socket error becomes ``errors.StoreUnavailable`` exactly once, here
(``translated``, as procrastinate's connector ``wrap_exceptions`` does). The server's refusals a
caller tells apart (a lock wait past ``lock_timeout``, a missing table, a missing privilege)
become subclasses of it, and leave the connection usable; anything else leaves it in doubt, and
``translated``'s ``on_error`` closes it.

Connecting: ``open_connection`` holds what PgBouncer in transaction pooling mode asks of a
connection.

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
from types import TracebackType
from typing import TYPE_CHECKING, Any

import asyncpg

from proxy import errors

if TYPE_CHECKING:
    from proxy import config

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    Connection = asyncpg.Connection[Any]  # generic in the stubs only
    Record = asyncpg.Record
else:
    Connection = asyncpg.Connection
    Record = asyncpg.Record
MAX_IDLE = 300.0
APPLICATION_NAME = "dedup-proxy"

# Errors meaning "the database is not usable right now"; anything else is a bug and propagates.
# InternalClientError: asyncpg's protocol is in a state it cannot leave (an error still being
# consumed when the connection broke): the connection is as unusable as a dead one.
DB_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    OSError,
    TimeoutError,
)


# The server's refusals a caller tells apart; the connection stays usable (its transaction, if
# any, is aborted and is rolled back as usual).
_REFUSALS: tuple[tuple[type[Exception], type[errors.StoreUnavailable]], ...] = (
    (asyncpg.LockNotAvailableError, errors.LockTimeout),
    (asyncpg.UndefinedTableError, errors.TableMissing),
    (asyncpg.UndefinedColumnError, errors.TableMissing),
    (asyncpg.InsufficientPrivilegeError, errors.PermissionDenied),
)


def translated(what: str, on_error: Callable[[], object] | None = None) -> Translation:
    """A block whose database errors raise StoreUnavailable("<what>: <the error>"), or the
    subclass naming a refusal (LockTimeout, TableMissing, PermissionDenied); for any other
    error, after ``on_error`` (closing a connection left in doubt)."""
    return Translation(what, on_error)


class Translation:
    """``translated``'s context manager; a class, not a generator, which would cost several
    times as much on every claim."""

    __slots__ = ("_on_error", "_what")

    def __init__(self, what: str, on_error: Callable[[], object] | None) -> None:
        self._what = what
        self._on_error = on_error

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, DB_ERRORS):
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            for refusal, mapped in _REFUSALS:
                if isinstance(exc, refusal):
                    raise mapped(f"{self._what}: {detail}") from exc
            if self._on_error is not None:
                self._on_error()
            raise errors.StoreUnavailable(f"{self._what}: {detail}") from exc


def open_connection(
    dsn: str,
    settings: config.DatabaseConfig,
    *,
    application_name: str = APPLICATION_NAME,
    command_timeout: float | None = None,
) -> Awaitable[Connection]:
    """A connection that works through PgBouncer in transaction pooling mode.

    Nothing but ``application_name`` (which PgBouncer tracks) goes into the startup packet; the
    settings a claim relies on travel inside its transaction (``sql.begin``). No prepared
    statement outlives its round trip: asyncpg's statement cache would name statements on one
    server connection and use them on another.
    """
    connection: Awaitable[Connection] = asyncpg.connect(
        dsn,
        timeout=settings.connect_timeout,
        command_timeout=command_timeout,
        statement_cache_size=0,
        server_settings={"application_name": application_name},
    )
    return connection


def discard(connection: Connection) -> None:
    """Close a connection in doubt so the pool never lends it again."""
    connection.terminate()


def server_version(connection: Connection) -> str:
    """The server's version as it announced it (major.minor)."""
    version = connection.get_settings().server_version
    return str(version)


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

    def exhausted(self) -> bool:
        """Whether every slot is lent out: an ``acquire`` now would wait."""
        return self._slots.locked()

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
