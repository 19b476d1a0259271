"""Prometheus metrics: what an operator graphs and alerts on.

Each application gets its own registry (so several apps in one process, as in the tests, do not
collide); the admin listener serves it at ``/metrics``. With ``workers: N`` every worker writes
its values to files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus-client's multiprocess mode, set
up by the supervisor) and ``/metrics``, answered by any worker, adds them all up.

What every request touches (its outcome's counter, its phase histograms, the in-flight gauge,
the buffered bytes) is added up in plain Python first (``Tally``, ``Timings``, ``Level``) and
written to prometheus-client's metrics by ``flush``: before every scrape, and every second with
workers (each worker's own files). prometheus-client takes a lock per write and, in
multiprocess mode, a ``getpid()`` and a write to a memory-mapped file: eleven of them per
webhook cost about 9 % of a worker's CPU (docs/benchmarks.md). So a scrape answered by one
worker sees the others' values as of their last second; a worker killed with SIGKILL loses at
most its last second of them.
"""

from __future__ import annotations

import bisect
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

import proxy
from proxy import app_limit, database, errors

if TYPE_CHECKING:
    from proxy.config import routes

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# No ``*_created`` samples: each counter's and histogram's creation time, which Prometheus
# stores from the text format as series of their own (nearly doubling a single process's; the
# multiprocess mode of workers: N has none), and which no dashboard or rule here reads.
# prometheus-client's switch is the process's, and the proxy owns its process.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# Every outcome (``errors.Outcome``), each request counted under one.
OUTCOMES: tuple[errors.Outcome, ...] = get_args(errors.Outcome)
# Why a delivery was kept (``database.KeptFor``), as dedup_inbox_kept_total counts it: a hand-off
# is counted as the deadline it answered before.
KEPT_REASONS = tuple(str(r) for r in database.KeptFor if r is not database.KeptFor.HANDED_OFF)
# What a look at a receipt found (dedup_receipts_total's result).
RECEIPT_RESULTS = ("written", "absent", "undecided", "missing")
# From a fast local app (milliseconds) to a provider's patience (tens of seconds).
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Tally:
    """A counter's increments, held until ``flush``."""

    __slots__ = ("_child", "count")

    def __init__(self, child: Any) -> None:
        self._child = child
        self.count = 0

    def inc(self) -> None:
        self.count += 1

    def flush(self) -> None:
        # Taken before writing, in every class here: a write that fails loses its values
        # rather than counting them twice at the next flush.
        if self.count:
            count, self.count = self.count, 0
            self._child.inc(count)


class Timings:
    """A histogram's observations, held until ``flush``: a count per bucket and the sum, as
    prometheus-client's ``Histogram.observe`` keeps them (the first bucket whose upper bound is
    not below the value), written into the same values in one go."""

    __slots__ = ("_bounds", "_child", "_counts", "_sum")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._bounds: list[float] = child._upper_bounds  # ends with +Inf
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._sum += seconds

    def flush(self) -> None:
        if not any(self._counts):
            return
        counts, total = self._counts, self._sum
        self._counts, self._sum = [0] * len(self._bounds), 0.0
        self._child._sum.inc(total)
        for bucket, count in zip(self._child._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


class Level:
    """A gauge's level, kept here, written by ``flush`` when it changed."""

    __slots__ = ("_child", "_written", "value")

    def __init__(self, child: Any) -> None:
        self._child = child
        self.value = 0
        self._written: int | None = None

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1

    def flush(self) -> None:
        if self.value != self._written:
            self._written = self.value
            self._child.set(self.value)  # a level: writing it again later repairs a failure


class Durations:
    """A histogram's ``Timings`` per outcome (one of ``OUTCOMES``), each made at the outcome's
    first observation: an outcome a route never has adds no series."""

    __slots__ = ("_by_outcome", "_histogram", "_route")

    def __init__(self, histogram: Histogram, route: str) -> None:
        self._histogram = histogram
        self._route = route
        self._by_outcome: dict[str, Timings] = {}

    def __getitem__(self, outcome: str) -> Timings:
        timings = self._by_outcome.get(outcome)
        if timings is None:
            timings = Timings(self._histogram.labels(self._route, outcome))
            self._by_outcome[outcome] = timings
        return timings

    def flush(self) -> None:
        for timings in self._by_outcome.values():
            timings.flush()


class _Off:
    """The counter of a feature a route does not have: counts nothing, exports no series (a
    series that can never move is noise in every query over it)."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        pass


_OFF = _Off()


@dataclass(frozen=True, slots=True)
class RouteMeters:
    """One route's metric children, bound once: ``labels()`` costs a lock and a lookup. The
    ones every request touches are held in plain Python until ``Metrics.flush``."""

    requests: dict[str, Tally]  # outcome -> counter
    mismatches: Any
    oversized: Any
    replays: Any
    replay_skipped: Any
    reused_bodies: Any
    ambiguous_commits: Any
    unsent_commits: Any
    answer_store_failures: Any
    inbox_full: Any
    inbox_replays: Any
    inbox_keep_failures: Any
    kept: dict[str, Any]  # why (KEPT_REASONS) -> counter
    receipts: dict[str, Any]  # RECEIPT_RESULTS -> counter
    upstream_duration: Timings
    claim_wait: Timings
    commit_duration: Timings
    duration: Durations  # by outcome
    in_flight: Level


class Metrics:
    """The proxy's metrics in a registry of their own."""

    def __init__(self) -> None:
        # prometheus-client picks file-backed values at import when this is set (workers: N).
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV))
        self.registry = CollectorRegistry()
        self._pool_stats: Callable[[], Sequence[int]] | None = None
        self._connects_counted = (0, 0, 0)
        self._replication: Callable[[], bool | None] | None = None
        self._buffered: Callable[[], int] | None = None
        self._room: app_limit.Room | None = None  # read at every flush (and its waits so far)
        self._grants: Sequence[str] = ()
        self._missing_grants: Callable[[], Sequence[str]] | None = None
        self._held: list[Tally | Timings | Durations | Level] = []
        self.build_info = Gauge(
            "dedup_build_info",
            "Always 1: the proxy's release (version) and the Python it runs on (python).",
            ["version", "python"],
            registry=self.registry,
            # Every worker runs the supervisor's code: one series, not one per worker.
            multiprocess_mode="livemax",
        )
        self.build_info.labels(proxy.__version__, platform.python_version()).set(1)
        self._request_counters()
        self._commit_counters()
        self._keep_counters()
        self._flow_meters()
        self._inbox_counts()
        self._inbox_ages()
        self._request_timings()
        self._database_meters()
        self._background_meters()
        self._load_meters()
        self._grant_gauges()

    def _request_counters(self) -> None:
        """Requests by outcome, and what else became of them: a mismatched, reused or oversized
        body, a duplicate answered with the stored answer or without it."""
        self.requests = Counter(
            "dedup_requests",
            "Requests by route and outcome (route is empty for pass-through).",
            ["route", "outcome"],
            registry=self.registry,
        )
        self.mismatches = Counter(
            "dedup_payload_mismatches",
            "Duplicates whose body differs from the body first claimed with that event ID.",
            ["route"],
            registry=self.registry,
        )
        self.reused_bodies = Counter(
            "dedup_reused_bodies",
            "New events whose body this worker recently claimed under another event ID, on "
            "routes whose signature does not cover the ID (GitHub, Shopify): a replay?",
            ["route"],
            registry=self.registry,
        )
        self.replays = Counter(
            "dedup_replays",
            "Duplicates answered with the app's stored first answer (on_duplicate: replay).",
            ["route"],
            registry=self.registry,
        )
        self.replay_skipped = Counter(
            "dedup_replay_skipped",
            "2xx answers not stored for replay (over replay_max_body): their duplicates get "
            "the proxy's acknowledgement.",
            ["route"],
            registry=self.registry,
        )
        self.oversized = Counter(
            "dedup_oversized_bodies",
            "Webhooks refused with 413 because the body is over the route's max_body.",
            ["route"],
            registry=self.registry,
        )

    def _commit_counters(self) -> None:
        """The COMMITs after an upstream 2xx that went wrong, and the answers not stored."""
        self.ambiguous_commits = Counter(
            "dedup_ambiguous_commits",
            "COMMITs after an upstream 2xx that failed and could not be reconciled: whether "
            "the claim was stored is unknown.",
            ["route"],
            registry=self.registry,
        )
        self.unsent_commits = Counter(
            "dedup_unsent_commits",
            "COMMITs after an upstream 2xx never sent (the connection was closed before) and "
            "not stored again on a fresh one: the claim is certainly absent, and the event's "
            "next copy is forwarded again.",
            ["route"],
            registry=self.registry,
        )
        self.answer_store_failures = Counter(
            "dedup_answer_store_failures",
            "2xx answers (on_duplicate: replay) PostgreSQL refused to store (the role may not "
            "UPDATE the answer columns): the claims were kept without them, so their duplicates "
            "get the proxy's acknowledgement.",
            ["route"],
            registry=self.registry,
        )

    def _keep_counters(self) -> None:
        """The failed deliveries the inbox did not keep (a route with redeliver)."""
        self.inbox_full = Counter(
            "dedup_inbox_full",
            "Failed deliveries not kept for redelivery because the inbox was at its cap "
            "(max_pending, max_pending_bytes: the route's, or with tenant_secrets the "
            "tenant's): their failure was relayed, the claim released.",
            ["route"],
            registry=self.registry,
        )
        self.inbox_replays = Counter(
            "dedup_inbox_replays",
            "Failed deliveries not kept for redelivery because their signed body is kept "
            "already under another event ID (routes whose signature does not cover the ID: "
            "GitHub, Shopify, Twilio): a captured body re-sent under a fresh ID, or one body "
            "sent as two events. Their failure was relayed, the claim released.",
            ["route"],
            registry=self.registry,
        )
        self.inbox_keep_failures = Counter(
            "dedup_inbox_keep_failures",
            "Failed deliveries that could not be kept for redelivery because the database "
            "failed or refused while keeping them (or the COMMIT was in doubt): their failure "
            "was relayed.",
            ["route"],
            registry=self.registry,
        )

    def _inbox_counts(self) -> None:
        """The redeliveries by result, and the deliveries the inbox holds, pending or dead."""
        self.redeliveries = Counter(
            "dedup_redeliveries",
            "Redeliveries of kept deliveries by result: delivered (a 2xx), failed (tried "
            "again later), dead (given up on: past the route's 'for', or an answer retrying "
            "cannot fix), superseded (not sent: older than the version of its object the app "
            "accepted, on a route with order).",
            ["route", "result"],
            registry=self.registry,
        )
        self.inbox_pending = Gauge(
            "dedup_inbox_pending",
            "Deliveries kept for redelivery, not yet delivered (read from the database).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.inbox_pending_bytes = Gauge(
            "dedup_inbox_pending_bytes",
            "Bytes of the bodies kept for redelivery.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.inbox_dead = Gauge(
            "dedup_inbox_dead",
            "Dead deliveries, kept for an operator (events dead, events redeliver).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )

    def _inbox_ages(self) -> None:
        """How long the inbox's oldest deliveries have waited, and when its levels were read."""
        self.inbox_oldest_pending = Gauge(
            "dedup_inbox_oldest_pending_seconds",
            "Age of the oldest pending delivery (0: none).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.inbox_oldest_dead = Gauge(
            "dedup_inbox_oldest_dead_seconds",
            "How long the oldest dead delivery has waited for an operator since it became dead "
            "(0: none); read from the database, so a restart of Prometheus does not reset it.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.inbox_overdue = Gauge(
            "dedup_inbox_overdue_seconds",
            "How long the most overdue pending delivery has been due without being redelivered "
            "(0: none is due; one being redelivered counts until its attempt is recorded, at "
            "most upstream.timeout): above a few poll intervals, redelivery is stuck.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.inbox_level_read = Gauge(
            "dedup_inbox_level_timestamp_seconds",
            "When the inbox gauges of this route were last read from the database: they keep "
            "their last value while it cannot be read.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="max",
        )

    def _request_timings(self) -> None:
        """The phases of a request (the app, the claim, the COMMIT, the whole), and the requests
        in flight."""
        self.upstream_duration = Histogram(
            "dedup_upstream_duration_seconds",
            "Time for the upstream to answer a webhook.",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.claim_wait = Histogram(
            "dedup_claim_wait_seconds",
            "Time to obtain the claim, including waiting for a copy of the event in flight.",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.commit_duration = Histogram(
            "dedup_commit_duration_seconds",
            "Time for PostgreSQL to COMMIT a claim after the upstream's 2xx (a disk flush, "
            "unless synchronous_commit is off).",
            ["route"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.duration = Histogram(
            "dedup_request_duration_seconds",
            "Time from the request's headers to the proxy's answer, by route (empty: "
            "pass-through) and outcome (as dedup_requests_total); the body's arrival included.",
            ["route", "outcome"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "dedup_in_flight_requests",
            "Webhook requests being processed.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )

    def _database_meters(self) -> None:
        """The pool's connections, its connects by result, whether COMMITs wait for a standby."""
        self.pool_size = Gauge(
            "dedup_database_connections",
            "Database connections open.",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.pool_in_use = Gauge(
            "dedup_database_connections_in_use",
            "Database connections lent out (claims held, copies waiting in PostgreSQL).",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.connects = Counter(
            "dedup_database_connects",
            "Connections to PostgreSQL by result: opened; failed (a connect refused or timed "
            "out); backed_off (not tried: connects failed just before, and the request was "
            "answered 503 at once instead).",
            ["result"],
            registry=self.registry,
        )
        for result in ("opened", "failed", "backed_off"):
            self.connects.labels(result)
        self.commits_replicated = Gauge(
            "dedup_database_commits_replicated",
            "1 when the database's COMMITs wait for a standby (synchronous_standby_names set, "
            "synchronous_commit on, remote_write or remote_apply), 0 when a failover can lose "
            "acknowledged claims (also until it is read: at start and at every readiness "
            "check).",
            registry=self.registry,
            # Every worker reads the same server; one still starting has not read it yet.
            multiprocess_mode="livemax",
        )

    def _background_meters(self) -> None:
        """The tracer's spans and the retention sweeper's deletions."""
        self.trace_spans = Counter(
            "dedup_trace_spans",
            "Spans by what became of them, with tracing on: exported; failed (the collector "
            "refused them or could not be reached: the batch is lost); dropped (the export "
            "queue was full: the collector is slower than the traffic, or down).",
            ["result"],
            registry=self.registry,
        )
        self.retention_deleted = Counter(
            "dedup_retention_deleted_rows",
            "Claims removed by the retention sweeper.",
            ["scope"],
            registry=self.registry,
        )
        self.retention_last_run = Gauge(
            "dedup_retention_last_run_timestamp_seconds",
            "When this replica last completed a retention sweep.",
            registry=self.registry,
            multiprocess_mode="max",
        )

    def _load_meters(self) -> None:
        """Load and shutdown: requests shed, bytes held against max_buffered, draining."""
        self.shed = Counter(
            "dedup_shed_requests",
            "Requests answered 503 (or connections refused) to shed load, by reason: memory "
            "(max_buffered), connections (max_connections: idle connections closed to make "
            "room, and new ones refused), pool (no database connection).",
            ["reason"],
            registry=self.registry,
        )
        self.buffered = Gauge(
            "dedup_buffered_bytes",
            "Bytes of request bodies and app answers held in memory (reserved against "
            "max_buffered).",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.draining = Gauge(
            "dedup_draining",
            "1 while shutting down after SIGTERM.",
            registry=self.registry,
            multiprocess_mode="livemax",
        )

    def _grant_gauges(self) -> None:
        # The grants besides the claim's (database.DEGRADED): read at start and at every
        # readiness check, which they do not fail.
        self.grant_missing = Gauge(
            "dedup_database_grant_missing",
            "1 while the role lacks a grant the routes need besides the claim's own (delete: "
            "the retention sweep and events forget; update_answers: on_duplicate: replay; "
            "update_inbox: redeliver), as of the last readiness check: /readyz stays 200, and "
            "only that part fails.",
            ["grant"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )

    def _ordering_gauges(self) -> None:
        # The routes with order, as the redeliverer's level reader reads them (redeliverer).
        self.ordering_blocked = Gauge(
            "dedup_ordering_blocked_objects",
            "Objects of a route with order whose oldest pending delivery holds later ones of "
            "it behind (events blocked).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.ordering_oldest_blocked = Gauge(
            "dedup_ordering_oldest_blocked_seconds",
            "Age of the oldest blocked object's head, the pending delivery that holds later "
            "ones of its object behind, from its first delivery (0: none).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )

    def _hold_gauges(self) -> None:
        # The route holds (proxy.route_holds), as this worker's copy of them sees them: the largest
        # over the workers (a worker that has not read a new hold yet reports the old one).
        self.route_held = Gauge(
            "dedup_route_held",
            "1 while the route's redeliveries are held (events pause: reason paused; the app's "
            "429/503 with Retry-After: reason retry_after), else 0.",
            ["route", "reason"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.route_held_seconds = Gauge(
            "dedup_route_held_seconds",
            "How long the route has been held (0: not held).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.route_hold_end = Gauge(
            "dedup_route_hold_end_timestamp_seconds",
            "When the route's hold ends, as asked for (0: not held, or held until resumed).",
            ["route"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )

    def _flow_meters(self) -> None:
        """The inbox's keeps by why, the limit at the app, the route holds and the blocked
        objects of the routes with order."""
        self.inbox_kept = Counter(
            "dedup_inbox_kept",
            "Deliveries kept for the redeliverer (answered 202), by why: failed (the app "
            "failed it), limit (the limit at the app was reached: upstream.concurrency), pool "
            "(no database connection for a claim held at the app), deadline (the app had not "
            "answered by the route's hand_off), paused (the route is paused), retry_after "
            "(the app asked to wait, with Retry-After).",
            ["route", "reason"],
            registry=self.registry,
        )
        self.receipts = Counter(
            "dedup_receipts",
            "Looks at the app's receipts (routes with receipt), by what they found: written (in "
            "doubt, the app had committed: settled as processed, not sent again), absent (in "
            "doubt, it had not and will not), undecided (its transaction still open after "
            "receipt.wait, or the receipts' database did not answer), missing (a 2xx without "
            "a receipt: the app does not write them; checked at most every 10 s per worker).",
            ["route", "result"],
            registry=self.registry,
        )
        self.app_in_flight = Gauge(
            "dedup_app_in_flight",
            "Requests at the app now, first deliveries and redeliveries (not pass-through): "
            "at most dedup_app_limit.",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.app_limit = Gauge(
            "dedup_app_limit",
            "The limit at the app: upstream.concurrency (per replica, as the sum of its "
            "workers' shares), or what the pool allows when it is not set.",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.app_waits = Counter(
            "dedup_app_waits",
            "Requests and redeliveries that waited for room at the app (the limit reached; a "
            "request of a redeliver route waits KEEP_WAIT at most, then it is kept).",
            registry=self.registry,
        )
        self.app_places_held = Gauge(
            "dedup_app_places_held",
            "The places at the app held by every replica together (upstream.concurrency with "
            "shared: true), as the redeliverer's level reader last read them.",
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.app_place_waits = Counter(
            "dedup_app_place_waits",
            "Deliveries and redeliveries that found every shared place at the app held "
            "(upstream.concurrency with shared: true) and waited for one.",
            registry=self.registry,
        )
        self._hold_gauges()
        self._ordering_gauges()
        self._reconcile_meters()

    def _reconcile_meters(self) -> None:
        """The reconciler's (``reconcile:`` routes): gaps found, recovered, errors, last run."""
        self.reconcile_gaps = Counter(
            "dedup_reconcile_gaps",
            "Events the provider reports it failed to deliver and that have no claim, found "
            "by the reconciler (each run counts what it finds again until it is recovered).",
            ["route"],
            registry=self.registry,
        )
        self.reconcile_recovered = Counter(
            "dedup_reconcile_recovered",
            "Gaps recovered by the reconciler (GitHub: a redelivery; Stripe: sent to the route, "
            "signed).",
            ["route"],
            registry=self.registry,
        )
        self.reconcile_errors = Counter(
            "dedup_reconcile_errors",
            "Reconcile runs cut short or slowed by the provider's API or the database, by "
            "kind: rate_limited, unauthorized, unavailable, refused, recovery_refused, database, "
            "page_bound (the log read only to the run's page bound), crashed (anything else).",
            ["route", "kind"],
            registry=self.registry,
        )
        self.reconcile_last_success = Gauge(
            "dedup_reconcile_last_success_timestamp_seconds",
            "When a reconcile run of the route last completed on this replica.",
            ["route"],
            registry=self.registry,
            multiprocess_mode="max",
        )

    def route(self, name: str, config: routes.RouteConfig | None = None) -> RouteMeters:
        """The metric children of one route (``""``: pass-through); with its ``config``, the
        series of a feature it does not have (receipts, replays, the inbox's) are not made,
        nor for pass-through, which has none of them."""
        every = config is None and name != ""
        stores = every or (config is not None and (config.replay or config.idempotency))
        keeps = every or (config is not None and config.redeliver is not None)
        receipted = every or (config is not None and config.receipt is not None)
        meters = RouteMeters(
            requests={outcome: Tally(self.requests.labels(name, outcome)) for outcome in OUTCOMES},
            mismatches=self.mismatches.labels(name),
            oversized=self.oversized.labels(name),
            replays=self.replays.labels(name) if stores else _OFF,
            replay_skipped=self.replay_skipped.labels(name) if stores else _OFF,
            reused_bodies=self.reused_bodies.labels(name),
            ambiguous_commits=self.ambiguous_commits.labels(name),
            unsent_commits=self.unsent_commits.labels(name),
            answer_store_failures=self.answer_store_failures.labels(name) if stores else _OFF,
            inbox_full=self.inbox_full.labels(name) if keeps else _OFF,
            inbox_replays=self.inbox_replays.labels(name) if keeps else _OFF,
            inbox_keep_failures=self.inbox_keep_failures.labels(name) if keeps else _OFF,
            kept={
                reason: self.inbox_kept.labels(name, reason) if keeps else _OFF
                for reason in KEPT_REASONS
            },
            receipts={
                result: self.receipts.labels(name, result) if receipted else _OFF
                for result in RECEIPT_RESULTS
            },
            upstream_duration=Timings(self.upstream_duration.labels(name)),
            claim_wait=Timings(self.claim_wait.labels(name)),
            commit_duration=Timings(self.commit_duration.labels(name)),
            duration=Durations(self.duration, name),
            in_flight=Level(self.in_flight.labels(name)),
        )
        self._held += [*meters.requests.values(), meters.upstream_duration, meters.claim_wait,
                       meters.commit_duration, meters.duration, meters.in_flight]  # fmt: skip
        return meters

    def count_spans(self, result: str, spans: int) -> None:
        """Spans exported, failed or dropped (from the SDK's batch thread too: the counter
        locks); told 0 of each when tracing starts, so that every series exists from then."""
        child = self.trace_spans.labels(result)
        if spans:
            child.inc(spans)

    def watch_pool(
        self,
        stats: Callable[[], Sequence[int]],
        replicated: Callable[[], bool | None] | None = None,
    ) -> None:
        """Read the pool's levels at every ``flush``: (open, idle), then the connections opened,
        the connects failed and the ones not tried (back-off) since it was made; and whether
        COMMITs wait for a standby (None: not known yet)."""
        self._pool_stats = stats
        self._replication = replicated

    def watch_room(self, room: app_limit.Room) -> None:
        """Read the limit at the app at every ``flush``."""
        self._room = room
        self._room_waited = room.waited
        self.app_limit.set(room.size)

    def watch_grants(self, grants: Sequence[str], missing: Callable[[], Sequence[str]]) -> None:
        """Read which of ``grants`` the role lacks at every ``flush``."""
        for grant in grants:
            self.grant_missing.labels(grant).set(0)
        self._grants = grants
        self._missing_grants = missing

    def watch_buffered(self, held: Callable[[], int]) -> None:
        """Read the bytes held against max_buffered at every ``flush``."""
        self._buffered = held

    def flush(self) -> None:
        """Write what was held in plain Python, and the pool's and the budget's levels, to
        prometheus-client's metrics (with workers: this worker's files)."""
        for held in self._held:
            held.flush()
        if self._pool_stats is not None:
            self._flush_pool(self._pool_stats())
        if self._replication is not None and (waits := self._replication()) is not None:
            self.commits_replicated.set(1 if waits else 0)
        if self._buffered is not None:
            self.buffered.set(self._buffered())
        if self._room is not None:
            self._flush_room(self._room)
        if self._missing_grants is not None:
            missing = self._missing_grants()
            for grant in self._grants:
                self.grant_missing.labels(grant).set(1 if grant in missing else 0)

    def _flush_pool(self, stats: Sequence[int]) -> None:
        size, idle, *counted = stats
        self.pool_size.set(size)
        self.pool_in_use.set(size - idle)
        if counted:
            for result, now, before in zip(
                ("opened", "failed", "backed_off"), counted, self._connects_counted, strict=True
            ):
                if now > before:
                    self.connects.labels(result).inc(now - before)
            self._connects_counted = (counted[0], counted[1], counted[2])

    def _flush_room(self, room: app_limit.Room) -> None:
        self.app_in_flight.set(room.in_flight)
        if room.waited > self._room_waited:
            self.app_waits.inc(room.waited - self._room_waited)
            self._room_waited = room.waited

    def app_use(self) -> tuple[int, int]:
        """This replica's requests at the app now and its limit at the app
        (``dedup_app_in_flight``, ``dedup_app_limit``): this worker's as of now, the other
        workers' as of their last second, added up."""
        if self._room is not None:
            self._flush_room(self._room)
        registry = self.exposition_registry()
        in_flight = registry.get_sample_value("dedup_app_in_flight") or 0
        limit = registry.get_sample_value("dedup_app_limit") or 0
        return int(in_flight), int(limit)

    def requests_by_route(self) -> dict[str, list[tuple[errors.Outcome, int]]]:
        """This replica's requests since it started, by route and outcome
        (``dedup_requests_total`` as ``/metrics`` serves it: this worker's as of now, written
        first as a scrape writes it, the other workers' as of their last second, added up); the
        outcomes counted at least once, in the order of ``OUTCOMES``."""
        self.flush()
        counted: dict[str, dict[str, int]] = {}
        for family in self.exposition_registry().collect():
            for sample in family.samples:
                if sample.name == "dedup_requests_total" and sample.value:
                    by_outcome = counted.setdefault(sample.labels["route"], {})
                    by_outcome[sample.labels["outcome"]] = int(sample.value)
        return {
            route: [(outcome, by_outcome[outcome]) for outcome in OUTCOMES if outcome in by_outcome]
            for route, by_outcome in counted.items()
        }

    def exposition_registry(self) -> CollectorRegistry:
        """What ``/metrics`` serves: this registry, or every worker's values added up."""
        if not self.multiprocess:
            return self.registry
        combined = CollectorRegistry()
        MultiProcessCollector(combined)  # type: ignore[no-untyped-call]
        return combined
