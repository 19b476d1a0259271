"""The connection pool, against the real PostgreSQL: bounds, replacement and refusal."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from proxy import errors
from proxy.database import pool


@pytest.fixture
async def opened(pg_dsn: str) -> AsyncIterator[pool.Pool]:
    connections = pool.Pool.open(functools.partial(asyncpg.connect, pg_dsn), 2)
    opened = await connections
    yield opened
    await opened.close(5)


async def backend(connection: pool.Connection) -> int:
    pid: int = await connection.fetchval("SELECT pg_backend_pid()")
    return pid


async def test_opens_every_connection_at_once(opened: pool.Pool) -> None:
    assert opened.stats() == (2, 2)
    first = await opened.acquire()
    assert opened.stats() == (2, 1)
    opened.release(first)
    assert opened.stats() == (2, 2)


async def test_lends_at_most_its_size_and_the_next_waits_for_a_release(
    opened: pool.Pool,
) -> None:
    a, b = await opened.acquire(), await opened.acquire()
    third = asyncio.create_task(opened.acquire())
    await asyncio.sleep(0)  # the task runs until it waits for a slot
    assert not third.done()
    opened.release(a)
    assert await asyncio.wait_for(third, 5) is a
    opened.release(b)
    opened.release(a)


async def test_a_connection_given_back_in_a_transaction_is_never_lent_again(
    opened: pool.Pool,
) -> None:
    connection = await opened.acquire()
    await connection.execute("BEGIN")
    opened.release(connection)
    assert connection.is_closed()
    again = await opened.acquire()
    assert again is not connection
    assert not again.is_in_transaction()
    opened.release(again)
    assert opened.stats()[0] == 2


async def test_after_a_closed_connection_the_next_request_opens_a_fresh_one(
    opened: pool.Pool,
) -> None:
    older, newer = await opened.acquire(), await opened.acquire()
    older_pid = await backend(older)
    opened.release(older)
    newer.terminate()  # e.g. discarded after a failed COMMIT
    opened.release(newer)
    fresh = await opened.acquire()
    # Not the older idle one, which may sit behind the same broken link.
    assert fresh is not older
    assert fresh is not newer
    assert await backend(fresh) != older_pid
    opened.release(fresh)


async def test_a_connection_idle_too_long_is_replaced(
    opened: pool.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    connection = await opened.acquire()
    opened.release(connection)
    monkeypatch.setattr(pool, "MAX_IDLE", 0.0)
    replaced = await opened.acquire()
    assert replaced is not connection
    assert connection.is_closed()
    opened.release(replaced)


class SecondConnectFails:
    """A connect function whose second call is refused; it keeps what it opened."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.calls = 0
        self.made: list[pool.Connection] = []

    async def __call__(self) -> pool.Connection:
        self.calls += 1
        if self.calls == 2:
            raise OSError("refused")
        self.made.append(await asyncpg.connect(self.dsn))
        return self.made[-1]


async def test_a_failed_connect_frees_the_slot(pg_dsn: str) -> None:
    lender = pool.Pool(SecondConnectFails(pg_dsn), 1)  # not opened: the first acquire connects
    first = await lender.acquire()
    first.terminate()
    lender.release(first)
    with pytest.raises(OSError, match="refused"):
        await lender.acquire()
    # Two failures in a row (the closed connection, the refused connect): a back-off of at
    # most BACKOFF_BASE, during which a request is refused without connecting.
    with pytest.raises(errors.Reconnecting, match=r"after 2 failure\(s\) in a row; the last: "):
        await lender.acquire()
    # uvloop's timers count whole milliseconds from a clock read once per turn of the loop, so
    # a sleep can end up to a millisecond before time.monotonic() says it should: sleep past it.
    await asyncio.sleep(pool.BACKOFF_BASE + 0.01)
    third = await asyncio.wait_for(lender.acquire(), 5)  # the slot came back
    assert await third.fetchval("SELECT 1") == 1
    lender.release(third)
    await lender.close(5)


async def test_a_failed_connection_fails_the_open_and_leaves_nothing_open(pg_dsn: str) -> None:
    connect = SecondConnectFails(pg_dsn)
    with pytest.raises(OSError, match="refused"):
        await pool.Pool.open(connect, 3)
    assert len(connect.made) == 2
    assert all(c.is_closed() for c in connect.made)


async def test_a_closed_pool_refuses_to_lend(opened: pool.Pool) -> None:
    await opened.close(5)
    with pytest.raises(asyncpg.InterfaceError, match="closed"):
        await opened.acquire()


async def test_a_request_waiting_when_the_pool_closes_opens_nothing(opened: pool.Pool) -> None:
    a, b = await opened.acquire(), await opened.acquire()
    waiting = asyncio.create_task(opened.acquire())
    await asyncio.sleep(0)  # the task runs until it waits for a slot
    assert not waiting.done()
    await opened.close(5)
    assert not waiting.done()  # still waiting: the close gave it no slot
    opened.release(a)  # a request finishing during shutdown
    with pytest.raises(asyncpg.InterfaceError, match="closed"):
        await asyncio.wait_for(waiting, 5)
    opened.release(b)
    assert opened.stats() == (0, 0)


async def test_releasing_twice_is_refused(opened: pool.Pool) -> None:
    connection = await opened.acquire()
    opened.release(connection)
    with pytest.raises(RuntimeError, match="did not lend"):
        opened.release(connection)


def lend_now(lender: pool.Pool, now: float) -> pool.Connection:
    """``acquire(now)`` run to its end without an event loop turn: fails if it would suspend."""
    coroutine = lender.acquire(now)
    try:
        coroutine.send(None)
    except StopIteration as done:
        connection: pool.Connection = done.value
        return connection
    coroutine.close()
    raise AssertionError("acquire suspended although ready() said it would not")


async def test_ready_says_exactly_when_acquire_lends_without_waiting_or_connecting(
    opened: pool.Pool,
) -> None:
    now = time.monotonic()
    assert opened.ready(now)
    a = lend_now(opened, now)
    assert opened.ready(now)
    b = lend_now(opened, now)
    assert not opened.ready(now)  # every slot lent: acquire would wait
    opened.release(a)
    assert opened.ready(time.monotonic())
    b.terminate()
    opened.release(b)  # on top now: a slot whose connection must be opened again
    assert not opened.ready(time.monotonic())
    fresh = await opened.acquire()
    opened.release(fresh)
    later = time.monotonic() + pool.MAX_IDLE
    assert not opened.ready(later)  # idle too long by then: acquire(later) would replace it
    replaced = await opened.acquire(later)
    assert replaced is not fresh
    assert fresh.is_closed()
    opened.release(replaced)
    await opened.close(5)
    assert not opened.ready(time.monotonic())
