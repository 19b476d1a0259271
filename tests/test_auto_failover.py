"""A failover that nobody scripted: a pg_auto_failover formation (``tests/auto_failover.py``)
under one ``dedup-proxy serve`` on a multi-host DSN, a steady stream of events each sent twice,
and the primary node killed with SIGKILL, its ``pg_autoctl`` with it. The monitor notices on its
own and promotes the synchronous standby; the proxy has to find it without a restart.

Where ``test_failover.py`` promotes the standby itself a second after the kill, here the time
to promotion is pg_auto_failover's (its health checks, then its wait for the dead primary to
demote), and the proxy answers 503 all that while. Each copy is retried on ``503`` until it is
answered 2xx, faster than the ``Retry-After`` a provider would honour, so that the moment the
proxy reaches the new primary shows. pg_auto_failover replicates synchronously, so no event
acknowledged before the kill reaches the app again, but for the documented window: its app
call straddled the kill (the app answered, and the COMMIT died with the primary).

The test prints its figures (``pytest -s``) and appends them as a JSON line to
``/tmp/failover/figures.jsonl``, beside ``test_failover.py``'s.
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

from tests import auto_failover
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

RATE = 10  # events per second
BEFORE_KILL = 3.0
AFTER_KILL = 12.0  # events keep coming this long after the kill, through and past the promotion
COPY_AFTER = 2.5
GIVE_UP = 60.0  # a copy not acknowledged this long after its first send
PROVIDER = Provider(rate=RATE, copy_after=COPY_AFTER, give_up=GIVE_UP)
PROMOTE_WITHIN = 50.0  # from the kill to a new primary: pg_auto_failover's own liveness bound
REACH_WITHIN = 60.0  # from the kill to the proxy's first 2xx: a liveness bound, not a benchmark
TABLE = "auto_failover_events"


@dataclass
class Timeline:
    """When the primary was killed and when the monitor had promoted the standby
    (time.monotonic()), and which nodes those were."""

    kill_start: float = 0.0
    kill_end: float = 0.0
    promoted: float = 0.0
    killed: str = ""
    new_primary: str = ""


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[App, str]]:
    """The recording app and its URL; stopped at the test's end."""
    async with recording_app() as recording:
        yield recording


async def nemesis(formation: auto_failover.Formation, t0: float) -> Timeline:
    """Kill the primary at ``BEFORE_KILL``, then only watch the monitor promote the standby.
    The formation's calls block: they run in a thread, the sender goes on."""
    timeline = Timeline()
    await asyncio.sleep(max(0.0, t0 + BEFORE_KILL - time.monotonic()))
    timeline.kill_start = time.monotonic()
    killed = await asyncio.to_thread(formation.kill_primary)
    timeline.kill_end = time.monotonic()
    new = await asyncio.to_thread(formation.wait_for_new_primary, PROMOTE_WITHIN)
    timeline.promoted = time.monotonic()
    timeline.killed, timeline.new_primary = killed.name, new.name
    return timeline


def figures(outcome: Outcome[Timeline], events: int) -> dict[str, Any]:
    """What the test prints and records."""
    t = outcome.timeline
    first_2xx = outcome.first_2xx(t.kill_end)

    def to_first_2xx(since: float) -> float | None:
        return None if first_2xx is None else round(first_2xx - since, 2)

    outside, inside = outcome.reforwarded()
    statuses = Counter(str(a.status or a.error) for a in outcome.answers)
    return {
        "test": "auto_failover",
        "engine": "pg_auto_failover",
        "synchronous": True,
        "events": events,
        "sends": len(outcome.answers),
        "answers": dict(sorted(statuses.items())),
        "answers_503": sum(a.status == 503 for a in outcome.answers),
        "kill_to_promoted_s": round(t.promoted - t.kill_start, 2),
        "kill_to_first_2xx_s": to_first_2xx(t.kill_start),
        "promoted_to_first_2xx_s": to_first_2xx(t.promoted),
        "reforwarded_acknowledged": len(outside),
        "reforwarded_straddling_the_kill": len(inside),
        "app_calls": len(outcome.calls),
        "claims_on_new_primary": outcome.rows,
        "killed": t.killed,
        "new_primary": t.new_primary,
        "proxy_log_outcomes": dict(sorted(outcome.log_outcomes.items())),
        "monitor_settings": auto_failover.MONITOR_SETTINGS,
        "keeper_settings": auto_failover.KEEPER_SETTINGS,
        "at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


async def run_failover(tmp_path: Path, recorder: tuple[App, str], events: int) -> Outcome[Timeline]:
    """The formation, the proxy on it, the provider and the nemesis; the formation removed."""
    app, app_url = recorder
    with auto_failover.formation(tmp_path / "formation") as formation:
        primary = formation.primary()
        assert primary is not None
        # pg_auto_failover's default, which the no-re-forwarding assertion rests on.
        assert primary.sql("SHOW synchronous_standby_names") != ""
        settings = serve_settings(
            app_url,
            formation.dsn(),
            TABLE,
            upstream={"timeout": "5s"},
            claim_wait="2s",
            database={"connect_timeout": "1s", "pool_timeout": "1s", "pool_size": 4},
        )
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(settings))
        served = await start_serve(config_file, tmp_path / "serve.log")
        try:
            # What an operator alerts on: the proxy's COMMITs wait for the standby.
            assert (await served.metrics())["dedup_database_commits_replicated"] == 1
            t0 = time.monotonic() + 0.5
            async with asyncio.TaskGroup() as running:
                sending = running.create_task(PROVIDER.send(served.url + PATH, events, t0))
                failing = running.create_task(nemesis(formation, t0))
            exited = served.process.returncode is not None
            log_outcomes = Counter(line["outcome"] for line in served.lines() if "outcome" in line)
        finally:
            await served.kill()
        new = formation.primary()
        assert new is not None
        rows = int(new.sql(f"SELECT count(*) FROM {TABLE}", database="dedup"))
    return Outcome(sending.result(), app.calls, failing.result(), rows, log_outcomes, exited)


@pytest.mark.slow
async def test_pg_auto_failover_promotes_the_standby_and_the_proxy_follows_without_reforwarding(
    tmp_path: Path, recorder: tuple[App, str]
) -> None:
    events = int((BEFORE_KILL + AFTER_KILL) * RATE)
    outcome = await run_failover(tmp_path, recorder, events)
    measured = figures(outcome, events)
    record(measured)

    assert outcome.timeline.new_primary != outcome.timeline.killed
    assert not outcome.proxy_exited
    assert_answered_as_documented(outcome.answers, events)
    reached = measured["kill_to_first_2xx_s"]
    assert reached is not None, "no 2xx after the kill"
    assert reached <= REACH_WITHIN
    outside, _ = outcome.reforwarded()
    assert outside == [], f"acknowledged before the kill, forwarded again: {outside}"
    assert outcome.rows == events  # every claim committed survived on the new primary
