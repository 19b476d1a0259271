"""The metrics held in plain Python until flushed read exactly as prometheus-client's own would."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxy import metrics
from tests.helpers import MakeProxy, metrics_text

BUCKETS = metrics._BUCKETS
# Seconds, the bucket bounds themselves included (a value on a bound is in that bucket).
SECONDS = st.one_of(
    st.sampled_from(BUCKETS),
    st.floats(min_value=0, max_value=100, allow_nan=False),
)


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    found = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.startswith(name) and not sample.name.endswith("_created"):
                found[(sample.name, sample.labels.get("le", ""))] = sample.value
    return found


@given(batches=st.lists(st.lists(SECONDS, max_size=20), max_size=5))
def test_timings_flushed_read_as_the_same_observations_made_one_by_one(
    batches: list[list[float]],
) -> None:
    held, direct = CollectorRegistry(), CollectorRegistry()
    timings = metrics.Timings(
        Histogram("t", "", ["route"], buckets=BUCKETS, registry=held).labels("r")
    )
    reference = Histogram("t", "", ["route"], buckets=BUCKETS, registry=direct).labels("r")
    for batch in batches:
        for value in batch:
            timings.observe(value)
            reference.observe(value)
        timings.flush()
        got, want = samples(held, "t"), samples(direct, "t")
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-9), key


def test_nothing_is_written_before_a_flush_and_everything_after() -> None:
    registry = CollectorRegistry()
    tally = metrics.Tally(Counter("c", "", registry=registry))
    level = metrics.Level(Gauge("g", "", registry=registry))
    for _ in range(3):
        tally.inc()
    level.inc()
    level.inc()
    level.dec()
    assert registry.get_sample_value("c_total") == 0
    assert registry.get_sample_value("g") == 0
    tally.flush()
    level.flush()
    assert registry.get_sample_value("c_total") == 3
    assert registry.get_sample_value("g") == 1
    tally.inc()
    level.dec()
    tally.flush()
    level.flush()
    assert registry.get_sample_value("c_total") == 4
    assert registry.get_sample_value("g") == 0


def test_a_flush_writes_the_pool_and_the_budget_levels() -> None:
    meters = metrics.Metrics()
    held = {"bytes": 0}
    meters.watch_pool(lambda: (4, 1))
    meters.watch_buffered(lambda: held["bytes"])
    held["bytes"] = 1024
    meters.flush()
    registry = meters.registry
    assert registry.get_sample_value("dedup_database_connections") == 4
    assert registry.get_sample_value("dedup_database_connections_in_use") == 3
    assert registry.get_sample_value("dedup_buffered_bytes") == 1024


class FailingOnce:
    """A prometheus-client value whose first write fails."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.value, name)

    def inc(self, amount: float) -> None:
        if not self.failed:
            self.failed = True
            raise OSError("disk full")
        self.value.inc(amount)


def test_a_flush_that_fails_midway_never_counts_twice() -> None:
    registry = CollectorRegistry()
    child = Histogram("t", "", ["route"], buckets=BUCKETS, registry=registry).labels("r")
    child._buckets[0] = FailingOnce(child._buckets[0])
    timings = metrics.Timings(child)
    timings.observe(0.0005)
    timings.observe(0.5)
    with pytest.raises(OSError, match="disk full"):
        timings.flush()
    timings.observe(0.5)
    timings.flush()
    # At most what was observed; the failed flush's values may be lost, never written twice.
    count = registry.get_sample_value("t_count", {"route": "r"})
    total = registry.get_sample_value("t_sum", {"route": "r"})
    assert count is not None
    assert total is not None
    assert count <= 3
    assert total <= 0.0005 + 0.5 + 0.5 + 1e-9


async def test_metrics_carry_no_created_series_and_none_of_a_feature_a_route_lacks(
    make_proxy: MakeProxy,
) -> None:
    kept = {"name": "kept", "path": "/kept", "event_id": "body:/id",
            "redeliver": {"schedule": ["1h"], "for": "1d"}}  # fmt: skip
    plain = {"name": "plain", "path": "/plain", "event_id": "body:/id"}
    proxy = await make_proxy(routes=[kept, plain])
    assert (await proxy.post("/plain", data=b'{"id": "c1"}')).status == 200

    text = metrics_text(proxy)
    lines = text.splitlines()

    assert 'dedup_requests_total{outcome="processed",route="plain"} 1.0' in text
    # Before: dedup_requests_created, dedup_upstream_duration_seconds_created, … a series each.
    assert [line for line in lines if "_created" in line] == []
    # Before: route plain had dedup_inbox_kept_total (6 reasons), dedup_receipts_total (4
    # results), dedup_replays_total… all 0 for ever; pass-through (route "") likewise.
    for family in ("dedup_inbox_kept_total", "dedup_inbox_full_total", "dedup_receipts_total",
                   "dedup_replays_total", "dedup_answer_store_failures_total"):  # fmt: skip
        for route in ("plain", ""):
            assert not [x for x in lines if x.startswith(f"{family}{{") and f'route="{route}"' in x]
    assert 'dedup_inbox_kept_total{reason="limit",route="kept"} 0.0' in text
    assert not [x for x in lines if x.startswith("dedup_receipts_total{")]  # no route has one
