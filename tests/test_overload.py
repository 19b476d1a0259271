"""A bounded burst of large webhooks against one ``serve`` process with a small max_buffered:
its memory stays within the budget plus a stated overhead, and nothing is lost or doubled.
(bench/overload.py runs the same scenario at full size; its figures are in bench/RESULTS.md.)"""

from __future__ import annotations

from bench import overload

MIB = 1024 * 1024
COUNT, SIZE, BUDGET = 40, 4 * MIB, 16 * MIB
# Besides the budget: about 0.8 MiB per connection whose body is being read and discarded
# after its 503 (aiohttp's and the loop's read buffers), measured with bench/overload.py.
OVERHEAD = COUNT * MIB + 32 * MIB


async def test_a_burst_of_large_webhooks_stays_within_the_budget(pg_dsn: str, table: str) -> None:
    result = await overload.run(
        pg_dsn, COUNT, SIZE, max_buffered=BUDGET, app_delay=0.2, table=table, within=60
    )

    # Every request answered: processed, or shed with Retry-After; none reset, none 413.
    assert set(result.statuses) <= {"200", "503 Retry-After"}, result.report()
    assert sum(result.statuses.values()) == COUNT
    assert result.statuses["200"] >= 1
    # Each processed event reached the app once and is claimed; the shed ones left no claim.
    assert set(result.app_calls.values()) == {1}
    assert len(result.app_calls) == result.statuses["200"] == len(result.claimed)
    assert result.claimed == set(result.app_calls)
    assert result.rss_peak - result.rss_start <= BUDGET + OVERHEAD, result.report()
