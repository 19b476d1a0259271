"""A bounded burst of large webhooks against one ``serve`` process with a small max_buffered:
its memory stays within the budget plus a stated overhead, and nothing is lost or doubled.
(bench/overload.py runs the scenario, here small and read as JSON; its full-size figures are in
bench/RESULTS.md.)"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_python

MIB = 1024 * 1024
COUNT, SIZE, BUDGET = 40, 4 * MIB, 16 * MIB
# Besides the budget: about 0.8 MiB per connection whose body is being read and discarded
# after its 503 (aiohttp's and the loop's read buffers), measured with bench/overload.py.
OVERHEAD = COUNT * MIB + 32 * MIB
SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "overload.py"


async def test_a_burst_of_large_webhooks_stays_within_the_budget(pg_dsn: str, table: str) -> None:
    code, out, err = await run_python(
        str(SCRIPT), "--dsn", pg_dsn, "--count", str(COUNT), "--size", str(SIZE),
        "--max-buffered", str(BUDGET), "--app-delay", "0.2", "--table", table,
        "--within", "60", "--json", within=110,
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(out)
    statuses, app_calls, claimed = result["statuses"], result["app_calls"], set(result["claimed"])

    # Every request answered: processed, or shed with Retry-After; none reset, none 413.
    assert set(statuses) <= {"200", "503 Retry-After"}, result
    assert sum(statuses.values()) == COUNT
    assert statuses["200"] >= 1
    # Each processed event reached the app once and is claimed; the shed ones left no claim.
    assert set(app_calls.values()) == {1}
    assert len(app_calls) == statuses["200"] == len(claimed)
    assert claimed == set(app_calls)
    assert result["rss_peak"] - result["rss_start"] <= BUDGET + OVERHEAD, result
