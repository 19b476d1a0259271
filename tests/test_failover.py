"""A failover of PostgreSQL under the proxy: two PostgreSQL 15 servers under streaming
replication (``tests/replication.py``), one ``dedup-proxy serve`` on a multi-host DSN, a
steady stream of events each sent twice, and the primary killed with SIGKILL and its standby
promoted a second later, as a failover manager would.

Each copy is retried on ``503`` until it is answered 2xx, faster than the ``Retry-After: 5`` a
provider would honour, so that the moment the proxy reaches the new primary shows. The second
copy of an event comes 2.5 s after the first: longer than the asynchronous test's cut, so that
every claim that cut loses is met again by a copy after the failover.

With synchronous replication no acknowledged event reaches the app again, but for the one
documented window: its app call straddled the kill (the app answered, and the COMMIT died with
the primary). With asynchronous replication cut 2 s before the kill, the claims committed in
those 2 s are lost with the primary, and their copies are forwarded again; the test counts them.

Each test prints its figures (``pytest -s``) and appends them as a JSON line to
``/tmp/failover/figures.jsonl``.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import replication
from tests.failover_traffic import (
    PATH,
    App,
    Outcome,
    Provider,
    assert_answered_as_documented,
    record,
    recording_app,
)
from tests.helpers import serve_settings, start_serve

RATE = 20  # events per second
BEFORE_KILL = 4.0
AFTER_KILL = 6.0
COPY_AFTER = 2.5
CUT_BEFORE_KILL = 2.0  # the asynchronous test: the WAL stream cut this long before the kill
DETECTION = 1.0  # from the kill to promote(): a failover manager noticing the dead primary
GIVE_UP = 40.0  # a copy not acknowledged this long after its first send
PROVIDER = Provider(rate=RATE, copy_after=COPY_AFTER, give_up=GIVE_UP)
REACH_WITHIN = 20.0  # from promote() to the first 2xx: a liveness bound, not a benchmark
TABLE = "failover_events"
SYNC_STATE = "SELECT string_agg(sync_state, ',') FROM pg_stat_replication"
LISTED = "SELECT string_agg(n::text, ',' ORDER BY n) FROM t"  # the pair test's table, as text


@dataclass
class Timeline:
    """When the nemesis acted (time.monotonic())."""

    cut: float | None = None
    kill_start: float = 0.0
    kill_end: float = 0.0
    promote_start: float = 0.0
    promote_end: float = 0.0


@pytest.fixture
async def app() -> AsyncIterator[tuple[App, str]]:
    """The recording app and its URL; stopped at the test's end."""
    async with recording_app() as recorder:
        yield recorder


async def nemesis(pair: replication.Pair, t0: float, *, cut: bool) -> Timeline:
    """Cut the WAL stream (``cut``), kill the primary at ``BEFORE_KILL``, promote the standby
    ``DETECTION`` later. The pair's calls block: they run in a thread, the sender goes on."""
    timeline = Timeline()
    if cut:
        await asyncio.sleep(max(0.0, t0 + BEFORE_KILL - CUT_BEFORE_KILL - time.monotonic()))
        timeline.cut = time.monotonic()
        await asyncio.to_thread(pair.cut_replication)
    await asyncio.sleep(max(0.0, t0 + BEFORE_KILL - time.monotonic()))
    timeline.kill_start = time.monotonic()
    await asyncio.to_thread(pair.kill_primary)
    timeline.kill_end = time.monotonic()
    await asyncio.sleep(DETECTION)
    timeline.promote_start = time.monotonic()
    await asyncio.to_thread(pair.promote)
    timeline.promote_end = time.monotonic()
    return timeline


def figures(outcome: Outcome[Timeline], *, synchronous: bool, events: int) -> dict[str, Any]:
    """What a test prints and records."""
    t = outcome.timeline
    first_2xx = outcome.first_2xx(t.promote_start)

    def to_first_2xx(since: float) -> float | None:
        return None if first_2xx is None else round(first_2xx - since, 2)

    outside, inside = outcome.reforwarded()
    statuses = Counter(str(a.status or a.error) for a in outcome.answers)
    return {
        "test": "failover",
        "synchronous": synchronous,
        "cut_before_kill_s": None if t.cut is None else round(t.kill_start - t.cut, 2),
        "events": events,
        "sends": len(outcome.answers),
        "answers": dict(sorted(statuses.items())),
        "answers_503": sum(a.status == 503 for a in outcome.answers),
        "promote_s": round(t.promote_end - t.promote_start, 2),
        "promote_to_first_2xx_s": to_first_2xx(t.promote_start),
        "kill_to_first_2xx_s": to_first_2xx(t.kill_start),
        "reforwarded_acknowledged": len(outside),
        "reforwarded_straddling_the_kill": len(inside),
        "app_calls": len(outcome.calls),
        "claims_on_new_primary": outcome.rows,
        "proxy_log_outcomes": dict(sorted(outcome.log_outcomes.items())),
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


async def fail_over(
    tmp_path: Path, app: tuple[App, str], *, synchronous: bool, cut: bool
) -> tuple[Outcome[Timeline], dict[str, Any]]:
    """One run: the pair, the proxy on it, the provider and the nemesis; the figures recorded."""
    recorder, app_url = app
    events = int((BEFORE_KILL + AFTER_KILL) * RATE)
    with replication.pair(tmp_path / "pg", synchronous=synchronous) as pair:
        settings = serve_settings(
            app_url,
            pair.dsn(),
            TABLE,
            upstream={"timeout": "5s"},
            claim_wait="2s",
            database={"connect_timeout": "1s", "pool_timeout": "1s", "pool_size": 4},
        )
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(settings))
        served = await start_serve(config_file, tmp_path / "serve.log")
        try:
            # What an operator alerts on: whether the proxy's COMMITs wait for the standby.
            replicated = (await served.metrics())["dedup_database_commits_replicated"]
            assert replicated == (1 if synchronous else 0)
            t0 = time.monotonic() + 0.5
            answers, timeline = await asyncio.gather(
                PROVIDER.send(served.url + PATH, events, t0), nemesis(pair, t0, cut=cut)
            )
            exited = served.process.returncode is not None
            log_outcomes = Counter(line["outcome"] for line in served.lines() if "outcome" in line)
        finally:
            await served.kill()
        rows = int(pair.primary.sql(f"SELECT count(*) FROM {TABLE}", database="dedup"))
    outcome = Outcome(answers, recorder.calls, timeline, rows, log_outcomes, exited)
    measured = figures(outcome, synchronous=synchronous, events=events)
    record(measured)
    return outcome, measured


def assert_the_proxy_rode_it_out(
    outcome: Outcome[Timeline], figures: dict[str, Any], events: int
) -> None:
    """No restart; only 2xx, or 503 with Retry-After; every copy acknowledged in the end; the
    new primary reached within the bound."""
    assert not outcome.proxy_exited
    assert_answered_as_documented(outcome.answers, events)
    reached = figures["promote_to_first_2xx_s"]
    assert reached is not None, "no 2xx after the promotion"
    assert reached <= REACH_WITHIN
    assert {c.event for c in outcome.calls} == {a.event for a in outcome.answers}


@pytest.mark.slow
async def test_with_synchronous_replication_no_acknowledged_event_reaches_the_app_after_failover(
    tmp_path: Path, app: tuple[App, str]
) -> None:
    outcome, figures = await fail_over(tmp_path, app, synchronous=True, cut=False)
    events = figures["events"]
    assert_the_proxy_rode_it_out(outcome, figures, events)
    outside, _ = outcome.reforwarded()
    assert outside == [], f"acknowledged before the kill, forwarded again: {outside}"
    assert outcome.rows == events  # every claim committed survived on the new primary


@pytest.mark.slow
async def test_with_asynchronous_replication_cut_before_the_kill_the_proxy_follows_the_promotion(
    tmp_path: Path, app: tuple[App, str]
) -> None:
    """The claims committed after the cut are lost with the primary (the documented window of
    asynchronous replication): only the proxy's recovery and its answers are asserted; the
    number forwarded again is printed."""
    outcome, figures = await fail_over(tmp_path, app, synchronous=False, cut=True)
    assert_the_proxy_rode_it_out(outcome, figures, figures["events"])


@pytest.mark.slow
async def test_the_pair_keeps_synchronous_commits_over_a_failover_and_loses_what_a_cut_held_back(
    tmp_path: Path,
) -> None:
    """``tests/replication.py`` itself: a synchronous pair keeps a row through a kill and a
    promotion, fails over again after ``rebuild_standby``; an asynchronous one cut off from its
    standby loses what was written after the cut."""

    def run() -> tuple[str, str]:
        with replication.pair(tmp_path / "sync", synchronous=True) as pair:
            assert pair.primary.sql(SYNC_STATE) == "sync"
            first = pair.primary
            pair.primary.sql("CREATE TABLE t (n int); INSERT INTO t VALUES (1)", database="dedup")
            pair.kill_primary()
            pair.promote()
            assert pair.primary is not first
            assert not first.running
            pair.primary.sql("INSERT INTO t VALUES (2)", database="dedup")
            pair.rebuild_standby()
            pair.primary.sql("INSERT INTO t VALUES (3)", database="dedup")
            pair.kill_primary()
            pair.promote()
            assert pair.primary is first
            assert pair.primary.sql(SYNC_STATE) == ""  # no standby since the promotion
            kept = pair.primary.sql(LISTED, database="dedup")
        with replication.pair(tmp_path / "async", synchronous=False) as pair:
            assert pair.primary.sql(SYNC_STATE) == "async"
            pair.primary.sql("CREATE TABLE t (n int); INSERT INTO t VALUES (1)", database="dedup")
            pair.cut_replication()
            pair.primary.sql("INSERT INTO t VALUES (2)", database="dedup")
            pair.kill_primary()
            pair.promote()
            left = pair.primary.sql(LISTED, database="dedup")
        return kept, left

    kept, left = await asyncio.to_thread(run)
    assert kept == "1,2,3"
    assert left == "1"
