"""A request's canonical log line (Stripe's "canonical log lines"): its keys typed, and how it
ends, counted in the metrics and written at its outcome's level.

The pipeline fills one in per request; the formatters (``logs``) turn its keys into JSON keys
or logfmt pairs. Its logger keeps the name it was born with, ``proxy.pipeline``: log queries
and alerts select the lines by it (docs/operations.md).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Literal, Required, TypedDict

from aiohttp import hdrs, web

from proxy import errors, logs, metrics

log = logging.getLogger("proxy.pipeline")


class LogLine(TypedDict, total=False):
    """Every key the pipeline writes on a request's line."""

    route: Required[str | None]  # None: pass-through, or no route
    scope: Required[str | None]  # the route's (a client's own key space is never shown)
    method: Required[str]
    path: Required[str]  # without the query
    # The provider's (or an ingress's) X-Request-Id, else a new one; also sent to the app.
    request_id: Required[str]
    # With tracing on: the request's trace and its SERVER span (W3C hex), to find the trace.
    trace_id: str
    span_id: str
    event_id: str  # as the request carried it (an Idempotency-Key as parsed)
    claim_id: str  # the claim's ID as stored, where it is not event_id (bound to the body)
    event_type: str | None
    body_claimed_as: str  # the other event ID this signed body was last claimed under
    claim_ms: float  # the wait for the claim, in this process and at the row lock
    upstream_status: int | None  # the app's status line, also when its answer then failed
    upstream_ms: float
    commit_ms: float
    commit_error: str  # the COMMIT keeping a 2xx whose answer failed did not go through
    replay_skipped: str  # why the app's answer was not stored for replay
    answer_store_error: str  # why the claim was committed without its answer
    reconciled: bool  # the COMMIT was in doubt, and was settled on another connection
    mismatch: bool  # a duplicate whose body differs from the first one's
    replayed: bool  # a duplicate answered with the stored answer
    kept: str  # redeliver: kept for redelivery as "pending" or "dead" (or a copy of one)
    object: str  # order: the object the request is about
    version_unparsed: str  # order: a version that reads as neither a number nor a time
    kept_for: str  # redeliver: kept without being sent, why (limit, paused, retry_after...)
    place_waited: int  # a shared limit: the looks again for a free place (all held)
    place_not_carried: str  # a shared limit: why a hand-off could not carry its place
    handed_off: str  # hand_off: what the app's answer came to after it (delivered, failed...)
    receipt: str  # receipt: what a look at the app's receipt found (written, absent, ...)
    inbox_full: bool  # redeliver: not kept, the route's inbox at its cap
    inbox_kept_as: str  # redeliver: not kept, its signed body kept already under this ID
    inbox_not_kept: bool  # redeliver: not kept, the database failed or refused to keep it
    outcome: errors.Outcome
    code: str  # the proxy's own answer's code, when it refused (app_busy, route_paused...)
    error: str  # why the request was not carried through (the RequestError's message)
    shed: str  # "memory" or "pool": shed to protect the worker
    client_gone: bool  # the client went away before its answer was written
    status: int  # the proxy's answer
    total_ms: float  # from the request's headers to its answer written


Phase = Literal["claim_ms", "upstream_ms", "commit_ms", "total_ms"]

# A duplicate absorbed is the proxy's product, and its line the one record that the copy came
# and was not forwarded (the claim's row holds the first delivery only): info, as a processed
# webhook (docs/operations.md, "Logs").
_LEVELS = {
    # The app failed; the delivery is kept, for the redeliverer (or, dead, for an operator).
    "queued": logging.WARNING,
    "dead_letter": logging.ERROR,
    "unavailable": logging.ERROR,
    "ambiguous_commit": logging.ERROR,
    # Certainly not stored: the app processed it, and a retry will be forwarded again.
    "commit_not_sent": logging.ERROR,
    "rejected": logging.WARNING,
    "mismatch": logging.WARNING,
    # The app failed (answered 5xx or 4xx, refused, reset, timed out): an alert on warning and
    # above must see an app outage.
    "upstream_error": logging.WARNING,
}
# Kept before the app was sent it, as flow control meant to (over the limit, the route paused,
# the app's Retry-After holding it): counted by reason in dedup_inbox_kept_total; at warning, a
# burst would be a wall of warnings. A delivery handed off ("deadline") stays a warning: the app
# was slower than the provider's deadline.
_HELD_BACK = ("limit", "paused", "retry_after")
# A 503 refused by design, not for a fault (errors are for faults): the limit at the app or the
# memory budget full at warning (the provider must retry: it is delayed), a route held by an
# operator's pause or the app's Retry-After at info, as a delivery kept for those is.
_BACK_PRESSURE = {
    "app_busy": logging.WARNING,
    "overloaded": logging.WARNING,
    "route_paused": logging.INFO,
    "app_retry_after": logging.INFO,
}


class _RequestIds:
    """New request IDs, 128 random bits in hex each (as uuid4().hex looks), drawn from the
    kernel 256 at a time: a getrandom call per webhook was the one system call the proxy made
    that the naive proxy does not (bench/meter.py). A forked child forgets its parent's."""

    def __init__(self) -> None:
        self._ready: list[str] = []

    def next(self) -> str:
        if not self._ready:
            drawn = os.urandom(16 * 256).hex()
            self._ready = [drawn[i : i + 32] for i in range(0, len(drawn), 32)]
        return self._ready.pop()

    def forget(self) -> None:
        self._ready = []


_request_ids = _RequestIds()
# Two workers forked with the same IDs ready would log (and send the app) the same ones.
os.register_at_fork(after_in_child=_request_ids.forget)


# Refusals of a path no route takes (404) or of a method a route does not (405): scanners and
# browsers, not a provider's webhooks; at warning, alerting would see mostly noise.
_UNROUTED = (404, 405)


def start(request: web.Request, route: str | None, scope: str | None) -> LogLine:
    """The start of the request's line."""
    return {
        "route": route,
        "scope": scope,
        "method": request.method,
        "path": request.raw_path.partition("?")[0],
        # The provider's (or an ingress's) ID if it sent one, so the lines can be joined.
        # Else a new one (``_RequestIds``).
        "request_id": request.headers.get(hdrs.X_REQUEST_ID) or _request_ids.next(),
    }


def phase(line: LogLine, name: Phase, timings: metrics.Timings, started: float) -> None:
    """The time since ``started``: in milliseconds on the line as ``name``, in seconds in the
    phase's histogram."""
    took = time.perf_counter() - started
    line[name] = round(took * 1000, 2)
    timings.observe(took)


def finish(
    meters: metrics.RouteMeters, line: LogLine, started: float, response: web.StreamResponse
) -> None:
    """Count the request and write its line, at the level of its outcome (a line that reports
    something wrong with a duplicate or a stored answer at warning level)."""
    line["status"] = response.status
    outcome: str = line["outcome"]
    phase(line, "total_ms", meters.duration[outcome], started)
    meters.requests[outcome].inc()
    if line.get("mismatch"):
        meters.mismatches.inc()
    if line.get("body_claimed_as"):
        meters.reused_bodies.inc()
    if outcome == "ambiguous_commit":
        meters.ambiguous_commits.inc()
    elif outcome == "commit_not_sent":
        meters.unsent_commits.inc()
    if (
        line.get("mismatch")
        or line.get("body_claimed_as")
        or line.get("replay_skipped")
        or line.get("answer_store_error")
    ):
        outcome = "mismatch"
    level = _LEVELS.get(outcome, logging.INFO)
    unrouted = outcome == "rejected" and line["status"] in _UNROUTED
    if unrouted or (outcome == "queued" and line.get("kept_for") in _HELD_BACK):
        level = logging.INFO
    elif outcome == "unavailable" and line.get("code") in _BACK_PRESSURE:
        level = _BACK_PRESSURE[line["code"]]
    logs.line(log, level, f"{line['method']} {line['path']} -> {outcome}", line)
