"""The connections to PostgreSQL: how one is opened, what its errors mean, and the pool that
lends them one request at a time. The one module that imports asyncpg.

Errors: a driver or socket error becomes ``errors.StoreUnavailable`` exactly once, here
(``translated``, as procrastinate's connector ``wrap_exceptions`` does). The server's refusals a
caller tells apart (a lock wait past ``lock_timeout``, a statement cancelled, a missing
table, a missing privilege)
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
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import parse_qs, unquote

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
    # statement_timeout (sql.wait_bound), or pg_cancel_backend; never asyncpg's own timeout,
    # which raises TimeoutError.
    (asyncpg.QueryCanceledError, errors.StatementCancelled),
    (asyncpg.UndefinedTableError, errors.TableMissing),
    (asyncpg.UndefinedColumnError, errors.TableMissing),
    (asyncpg.InsufficientPrivilegeError, errors.PermissionDenied),
)
# A refusal whose connection is closed all the same: one that reached a server taking no writes
# (a standby, a demoted primary) must not be lent again; a new one, through a multi-host DSN's
# target_session_attrs=read-write, finds the server that takes them.
_READ_ONLY = asyncpg.ReadOnlySQLTransactionError
# asyncpg's words when a connection broke while one of its operations was still under way.
_STATE_CLASH = "cannot switch to state"


def translated(
    what: str, on_error: Callable[[], object] | None = None, *, connecting: float | None = None
) -> Translation:
    """A block whose database errors raise StoreUnavailable("<what>: <the error>"), or the
    subclass naming a refusal (LockTimeout, TableMissing, PermissionDenied); for any other
    error, after ``on_error`` (closing a connection left in doubt). A block ``connecting``
    (its ``connect_timeout``) says what failed in words: timed out, refused, authentication,
    no such database."""
    return Translation(what, on_error, connecting)


class Translation:
    """``translated``'s context manager; a class, not a generator, which would cost several
    times as much on every claim."""

    __slots__ = ("_connecting", "_on_error", "_what")

    def __init__(
        self, what: str, on_error: Callable[[], object] | None, connecting: float | None = None
    ) -> None:
        self._what = what
        self._on_error = on_error
        self._connecting = connecting

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, DB_ERRORS):
            timeout = self._connecting
            detail = _described(exc) if timeout is None else _refusal(exc, timeout)
            for refusal, mapped in _REFUSALS:
                if isinstance(exc, refusal):
                    raise mapped(f"{self._what}: {detail}") from exc
            if self._on_error is not None:
                self._on_error()
            if isinstance(exc, _READ_ONLY):
                raise errors.ReadOnly(
                    f"{self._what}: the database is read-only (a standby, or a primary demoted "
                    f"or set read-only): {detail}"
                ) from exc
            raise errors.StoreUnavailable(f"{self._what}: {detail}") from exc


# SQLSTATE classes of a server in trouble, not of a refusal: connection exception, insufficient
# resources, operator intervention (shutting down, starting up), system error.
_TROUBLE_CLASSES = ("08", "53", "57", "58")


def refused_for_good(exc: BaseException | None) -> bool:
    """Whether a database error is a refusal waiting does not end (a missing privilege or
    schema, a bad name), rather than a server in trouble (down, starting, read-only during a
    failover, a lock held)."""
    if not isinstance(exc, asyncpg.PostgresError):
        return False
    state = str(getattr(exc, "sqlstate", "") or "")
    transient = state[:2] in _TROUBLE_CLASSES or isinstance(
        exc, _READ_ONLY | asyncpg.LockNotAvailableError
    )
    return not transient


def _described(exc: BaseException) -> str:
    """An error as the messages name it: its type and text, asyncpg's state clash in words."""
    if isinstance(exc, asyncpg.InternalClientError) and _STATE_CLASH in str(exc):
        return (
            "the connection broke while an earlier operation on it was still under way "
            f"(asyncpg: {exc}); it is closed, and the next request opens a fresh one"
        )
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def open_connection(
    dsn: str,
    settings: config.DatabaseConfig,
    *,
    application_name: str = APPLICATION_NAME,
    command_timeout: float | None = None,
    host: tuple[str, int] | None = None,
) -> Awaitable[Connection]:
    """A connection that works through PgBouncer in transaction pooling mode (to ``host``
    alone, of the DSN's, if given).

    Nothing but ``application_name`` (which PgBouncer tracks) goes into the startup packet; the
    settings a claim relies on travel inside its transaction (``sql.begin``). No prepared
    statement outlives its round trip: asyncpg's statement cache would name statements on one
    server connection and use them on another.
    """
    where: dict[str, Any] = {} if host is None else {"host": host[0], "port": host[1]}
    connection: Awaitable[Connection] = asyncpg.connect(
        dsn,
        timeout=settings.connect_timeout,
        command_timeout=command_timeout,
        statement_cache_size=0,
        server_settings={"application_name": application_name},
        **where,
    )
    return connection


def connect_one(dsn: str, *, timeout: float) -> Awaitable[Connection]:
    """One connection outside any pool (the receipts' database, asked only when in doubt),
    set up as ``open_connection``'s: nothing but ``application_name`` in the startup packet, no
    statement cache (PgBouncer)."""
    connection: Awaitable[Connection] = asyncpg.connect(
        dsn,
        timeout=timeout,
        statement_cache_size=0,
        server_settings={"application_name": APPLICATION_NAME},
    )
    return connection


def dsn_hosts(dsn: str) -> list[tuple[str, int]]:
    """The (host, port) pairs a DSN names, in order, as asyncpg and libpq read them: the URL's
    ``host1:port1,host2:port2`` (a host without a port takes ``?port=``, else PGPORT, else 5432),
    or ``?host=a,b&port=p1,p2`` when the URL names none. ValueError for a port list that does
    not match the hosts."""
    rest = dsn.partition("://")[2]
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    query = parse_qs(tail.partition("?")[2]) if "?" in tail else {}
    specs = authority.rpartition("@")[2]
    default = os.environ.get("PGPORT", "") or "5432"
    ports = query.get("port", [default])[-1].split(",")
    if specs:
        names: list[str] = []
        written: list[str] = []
        for spec in specs.split(","):
            host, colon, port = spec.rpartition(":") if not spec.endswith("]") else ("", "", "")
            if not colon:
                host, port = spec, ""
            names.append(unquote(host.strip("[]")))
            written.append(port)
    else:
        names = query.get("host", ["localhost"])[-1].split(",")
        written = [""] * len(names)
    if len(ports) == 1:
        ports = ports * len(names)
    if len(ports) != len(names):
        raise ValueError(f"{len(ports)} port numbers for {len(names)} hosts")
    return [(name, int(port or fallback or "5432"))
            for name, port, fallback in zip(names, written, ports, strict=True)]  # fmt: skip


class HostsRefused(OSError):
    """No host of a multi-host DSN gave a usable connection; the message names each one and
    why."""


class Connector:
    """What opens the connections to ``dsn``; called with the connection's ``command_timeout``.

    A DSN of one host: asyncpg's connect. Of several (a primary and its standbys): each host in
    turn, the one that last gave a connection first, each with ``connect_timeout`` of its own,
    as libpq does. asyncpg's timeout covers every host together, so a dead primary whose address
    drops packets would take all of it, and the promoted standby after it would never be tried;
    and it names only the last host's error, where this names every host's. The pool and the
    reconciling connections share one, so both learn which host answers.
    """

    def __init__(
        self, dsn: str, settings: config.DatabaseConfig, application_name: str = APPLICATION_NAME
    ) -> None:
        self._dsn = dsn
        self._settings = settings
        self._name = application_name
        try:
            self._order = dsn_hosts(dsn)
        except ValueError:
            self._order = []  # asyncpg says what is wrong with it, at the first connect

    async def __call__(self, command_timeout: float | None = None) -> Connection:
        if len(self._order) < 2:
            return await open_connection(
                self._dsn, self._settings, application_name=self._name,
                command_timeout=command_timeout,
            )  # fmt: skip
        refusals = []
        for host in list(self._order):
            try:
                connection = await open_connection(
                    self._dsn, self._settings, application_name=self._name,
                    command_timeout=command_timeout, host=host,
                )  # fmt: skip
            except DB_ERRORS as exc:
                why = _refusal(exc, self._settings.connect_timeout)
                refusals.append(f"{host_named(host)}: {why}")
                continue
            if self._order[0] != host:
                self._order.remove(host)
                self._order.insert(0, host)
            return connection
        raise HostsRefused("; ".join(refusals))


def host_named(host: tuple[str, int]) -> str:
    """``host:port`` as messages name it (an IPv6 address in brackets)."""
    name, port = host
    return f"[{name}]:{port}" if ":" in name else f"{name}:{port}"


# What a connect's failure means, in the words the operator acts on (a firewall, a port, a
# password, a name), the first match of each; "{exc}" is the error's own text.
_CONNECT_FAILURES: tuple[tuple[type[BaseException], str], ...] = (
    (asyncpg.TargetServerAttributeNotMatched,
     "takes no writes (a standby, or read-only), and target_session_attrs asks for them"),
    (asyncpg.InvalidPasswordError, "authentication failed: {exc}"),
    # pg_hba.conf, or a role that may not log in
    (asyncpg.InvalidAuthorizationSpecificationError, "login refused: {exc}"),
    (asyncpg.InvalidCatalogNameError, "no such database: {exc}"),
    (ConnectionRefusedError, "connection refused: nothing listens on that port"),
    (socket.gaierror, "host not found: {exc}"),
    (FileNotFoundError, "no server socket there: {exc}"),
)  # fmt: skip


def _refusal(exc: BaseException, timeout: float) -> str:
    """Why a connect failed (each host of a multi-host DSN for itself), in words."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g}s (database.connect_timeout)"
    if isinstance(exc, HostsRefused):
        return str(exc)  # each host's reason, worded here already
    for kind, words in _CONNECT_FAILURES:
        if isinstance(exc, kind):
            return words.format(exc=exc)
    return _described(exc)


def discard(connection: Connection) -> None:
    """Close a connection in doubt so the pool never lends it again."""
    connection.terminate()


def server_version(connection: Connection) -> str:
    """The server's version as it announced it (major.minor)."""
    version = connection.get_settings().server_version
    return str(version)


class Counts(NamedTuple):
    """A pool's levels, and what it counted since it was made."""

    open: int
    idle: int
    opened: int  # connections opened
    failed: int  # connects that failed
    backed_off: int  # connects not tried: the back-off after failures was running


# The back-off after failures, as gRPC's connection back-off: the first reconnect at once (a
# restart leaves every pooled connection dead at once, and the database may be back already),
# then waits doubling from BACKOFF_BASE up to BACKOFF_MAX, each a random part of it (jitter), so
# that the workers and replicas of a fleet do not reconnect in step.
BACKOFF_BASE = 0.05
BACKOFF_MAX = 1.0


def backoff(failures: int) -> float:
    """How long to wait before connecting again after ``failures`` failures in a row."""
    if failures < 2:
        return 0.0
    ceiling = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (failures - 2))
    return random.uniform(ceiling / 2, ceiling)


class Pool:
    """``size`` connections made by ``connect``; at most ``size`` lent at once.

    Each free slot is on a stack, most recently returned on top: a connection, or None where
    one was closed and a new one is to be opened (so the next request opens a fresh connection
    rather than trying an older one that may sit behind the same broken link).

    Failures back off: a connect that fails, or a connection opened since the last success that
    comes back closed (its server failed it: read-only, gone), counts one; a connection given
    back open and idle resets the count. While the back-off runs, a request that would need a
    new connection is refused at once (``errors.Reconnecting``) instead of logging in again: a
    database in trouble is not met with a new session per webhook. Connections opened before
    the last success and found dead afterwards (a restart) do not count: they only say the past.
    """

    def __init__(self, connect: Callable[[], Awaitable[Connection]], size: int) -> None:
        self._connect = connect
        self._slots = asyncio.Semaphore(size)
        self._free: list[tuple[Connection | None, float]] = [(None, 0.0)] * size
        self._open: dict[Connection, float] = {}  # when each was opened
        self._lent: set[Connection] = set()
        self._closed = False
        self._failures = 0
        self._retry_at = 0.0
        self._last_failure = ""
        self._succeeded_at = 0.0
        self._failed_at = 0.0
        self._opened = self._failed = self._backed_off = 0

    @classmethod
    async def open(cls, connect: Callable[[], Awaitable[Connection]], size: int) -> Pool:
        """A pool with every connection opened now (see ``fill``)."""
        pool = cls(connect, size)
        await pool.fill()
        return pool

    async def fill(self) -> None:
        """Open every connection not open yet, together; if any fails, close the ones opened
        and raise its error (so that a bad DSN fails the start, not a webhook)."""
        wanted = sum(1 for connection, _ in self._free if connection is None)
        connects = [asyncio.ensure_future(self._connect()) for _ in range(wanted)]
        try:
            results = await asyncio.gather(*connects, return_exceptions=True)
        except asyncio.CancelledError:
            for connect in connects:  # those that finished are in no slot: close them
                if connect.done() and not connect.cancelled() and connect.exception() is None:
                    connect.result().terminate()
            raise
        opened = [r for r in results if isinstance(r, asyncpg.Connection)]
        failed = [r for r in results if isinstance(r, BaseException)]
        self._opened += len(opened)
        if failed:
            for connection in opened:
                connection.terminate()
            self._count_failure(failed[0], len(failed))
            raise failed[0]
        # Requests may have taken and given back slots meanwhile: the empty ones are found
        # again, with no await in between, and a connection with no empty slot left is closed.
        now = time.monotonic()
        empty = [i for i, (connection, _) in enumerate(self._free) if connection is None]
        for connection in opened[len(empty) :]:
            connection.terminate()
        for index, connection in zip(empty, opened, strict=False):
            self._free[index] = (connection, now)
            self._open[connection] = now

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
        """A connection, waiting for a free slot (bound the wait with a timeout): ``slot`` then
        ``take``."""
        await self._slots.acquire()
        return await self.take(now)

    async def slot(self) -> None:
        """Wait for a free slot; ``take`` must follow (it gives the slot back if it fails)."""
        await self._slots.acquire()

    async def take(self, now: float | None = None) -> Connection:
        """The connection of the slot ``slot`` gave: the one on top of the stack, or a new one
        in place of one closed or idle for ``MAX_IDLE`` at ``now`` (default: now). While a
        back-off forbids opening one, an open connection lower in the stack is lent instead,
        and ``errors.Reconnecting`` raised if there is none."""
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
                if now < self._retry_at:
                    if (usable := self._usable(now)) is not None:
                        self._free.insert(0, (None, 0.0))  # the empty slot, tried last
                        self._lent.add(usable)
                        return usable
                    self._backed_off += 1
                    raise errors.Reconnecting(
                        f"reconnecting to PostgreSQL in {self._retry_at - now:.2f}s, after "
                        f"{self._failures} failure(s) in a row; the last: {self._last_failure}"
                    )
                try:
                    connection = await self._connect()
                except DB_ERRORS as exc:
                    self._count_failure(exc)
                    raise
            except BaseException:
                self._free.append((None, 0.0))
                self._slots.release()
                raise
            self._opened += 1
            self._open[connection] = time.monotonic()
        self._lent.add(connection)
        return connection

    def _usable(self, now: float) -> Connection | None:
        """Take the topmost open connection, not idle for MAX_IDLE, off the stack (None if
        there is none)."""
        for index in range(len(self._free) - 1, -1, -1):
            connection, since = self._free[index]
            if connection is not None and not connection.is_closed() and now - since < MAX_IDLE:
                del self._free[index]
                return connection
        return None

    def release(self, connection: Connection) -> None:
        """Take a connection back; it must be outside any transaction to be lent again."""
        if connection not in self._lent:
            raise RuntimeError("released a connection this pool did not lend (twice?)")
        self._lent.discard(connection)
        opened = self._open.get(connection, 0.0)
        if self._closed or connection.is_closed() or connection.is_in_transaction():
            if opened > self._succeeded_at and not self._closed:
                self._count_failure(None)
            self._forget(connection)
            self._free.append((None, 0.0))
        else:
            now = time.monotonic()
            self._succeeded_at = now
            if opened > self._failed_at:
                # A connection made since the last failure did its work: connecting works.
                self._failures = 0
                self._retry_at = 0.0
            self._free.append((connection, now))
        self._slots.release()

    def _count_failure(self, exc: BaseException | None, count: int = 1) -> None:
        self._failures += 1
        self._failed_at = time.monotonic()
        if exc is not None:
            self._failed += count
            self._last_failure = _described(exc)
        elif not self._last_failure:
            self._last_failure = "a new connection failed its statement"
        self._retry_at = self._failed_at + backoff(self._failures)

    def _forget(self, connection: Connection) -> None:
        self._open.pop(connection, None)
        connection.terminate()

    def stats(self) -> tuple[int, int]:
        """(connections open, connections idle)."""
        return len(self._open), sum(1 for connection, _ in self._free if connection is not None)

    def counts(self) -> Counts:
        open_, idle = self.stats()
        return Counts(open_, idle, self._opened, self._failed, self._backed_off)

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
