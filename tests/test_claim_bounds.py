"""A claim's wait is bounded by claim_wait on a table distributed by Citus, where lock_timeout
does not see it, and nothing else changes: on a real PostgreSQL, with triggers that sleep
where the wait would be.

On Citus the row a copy waits on is on a worker, which the coordinator's lock_timeout does not
reach (docs/deployment.md, "Past one database"), so on a distributed table the claim's INSERT
is also bounded by statement_timeout. A BEFORE INSERT trigger that sleeps is such a wait on one
PostgreSQL: no lock is waited for. The store is told the table is distributed
(``Store.set_distributed``: there is no Citus in CI). On a plain table the same slow INSERT is
not cut short. The statement bound must not reach the claim's UPDATEs (its answer, the inbox's)
nor its COMMIT (a synchronous standby's wait, Citus's two-phase commit): an UPDATE trigger
sleeps in the UPDATE, and a deferred trigger in the COMMIT.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from proxy import config, database, errors
from tests.helpers import claimed, fetch

CLAIM_WAIT = 0.3
SLEEP = 1.0  # longer than CLAIM_WAIT + the statement margin, shorter than the client's timeouts


@pytest.fixture
async def store(pg_dsn: str, table: str) -> AsyncIterator[database.Store]:
    settings = config.DatabaseConfig(dsn=None, table=table, pool_size=2, connect_timeout=5.0)
    store = await database.Store.open(
        pg_dsn, settings, claim_wait=CLAIM_WAIT, upstream_timeout=30.0
    )
    try:
        await store.ensure_schema(answers=True, kept=True)
        await store.notice_distribution()
        assert not store.distributed  # one PostgreSQL: nothing is distributed
        yield store
    finally:
        await store.close()


async def _sleep_in(pg_dsn: str, table: str, trigger: str) -> None:
    """A trigger on ``table`` that sleeps SLEEP seconds: ``trigger`` is what follows
    CREATE [CONSTRAINT] TRIGGER name."""
    await fetch(
        pg_dsn,
        f"CREATE OR REPLACE FUNCTION {table}_sleep() RETURNS trigger LANGUAGE plpgsql AS "
        f"$$BEGIN PERFORM pg_sleep({SLEEP}); RETURN NEW; END$$",
    )
    await fetch(pg_dsn, trigger.format(t=table, f=f"{table}_sleep"))


SLOW_INSERT = 'CREATE TRIGGER slow BEFORE INSERT ON "{t}" FOR EACH ROW EXECUTE FUNCTION {f}()'


async def test_on_a_distributed_table_a_wait_lock_timeout_does_not_see_ends_at_claim_wait(
    store: database.Store, pg_dsn: str, table: str
) -> None:
    store.set_distributed(True)
    await _sleep_in(pg_dsn, table, SLOW_INSERT)
    opened = store.pool_stats().opened

    with pytest.raises(errors.ClaimWaitExceeded):
        async with store.claim(database.Key("s", "e1", None, b"\x01" * 32)):
            pass

    assert await claimed(pg_dsn, table) == []  # the INSERT was cancelled, then rolled back
    # The connection was rolled back and kept: the next claim (no trigger now) holds on it.
    await fetch(pg_dsn, f'DROP TRIGGER slow ON "{table}"')
    async with store.claim(database.Key("s", "e2", None, b"\x02" * 32)) as claim:
        assert claim.acquired
        await claim.commit()
    assert await claimed(pg_dsn, table) == [("s", "e2", None)]
    assert store.pool_stats().opened == opened


async def test_on_a_plain_table_a_slow_insert_is_not_cut_short(
    store: database.Store, pg_dsn: str, table: str
) -> None:
    await _sleep_in(pg_dsn, table, SLOW_INSERT)

    async with store.claim(database.Key("s", "e1", None, b"\x01" * 32), wait=0.0) as claim:
        assert claim.acquired  # wait=0 (an idempotency key's copy): still no statement bound
        await claim.commit()

    assert await claimed(pg_dsn, table) == [("s", "e1", None)]


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "plain"])
@pytest.mark.parametrize("step", ["commit", "commit with answer", "queue"])
async def test_nothing_after_the_claims_insert_is_bounded_by_claim_wait(
    store: database.Store, pg_dsn: str, table: str, step: str, distributed: bool
) -> None:
    store.set_distributed(distributed)
    await _sleep_in(
        pg_dsn,
        table,
        "CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON {t} DEFERRABLE INITIALLY "
        "DEFERRED FOR EACH ROW EXECUTE FUNCTION {f}()",
    )
    await fetch(
        pg_dsn,
        f'CREATE TRIGGER slow_update AFTER UPDATE ON "{table}" FOR EACH ROW '
        f"EXECUTE FUNCTION {table}_sleep()",
    )

    async with store.claim(database.Key("s", "e1", "t", b"\x01" * 32)) as claim:
        assert claim.acquired
        if step == "queue":
            delivery = database.StoredRequest("r", "http://127.0.0.1:9", "POST", "/", (), b"body")
            keep = database.KeepPolicy(
                delay=60,
                until=3600,
                max_pending=10,
                max_pending_bytes=10**6,
                cap_scope="s",
                dead=False,
            )
            queued = await claim.keep(delivery, database.Attempt(500), keep)
            assert queued.state == database.InboxState.PENDING
        else:
            answer = database.Answer(200, (("x", "y"),), b"ok") if "answer" in step else None
            done = await claim.commit(answer)
            assert done.stored(answer) == answer  # committed as asked, not reconciled

    rows = await fetch(pg_dsn, f'SELECT event_id, answer_status, inbox_state FROM "{table}"')
    expected = {
        "commit": ("e1", None, None),
        "commit with answer": ("e1", 200, None),
        "queue": ("e1", None, "pending"),
    }
    assert [tuple(row) for row in rows] == [expected[step]]
