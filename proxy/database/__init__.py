"""The database door: every operation on PostgreSQL goes through ``Store`` (``store``), and
nothing outside this package imports the driver.

- ``store``: the operations, each a method, over a pool of connections.
- ``claim``: a claim and its named steps (commit, settle a duplicate, release), and what is
  claimed (``Key``) and stored (``Answer``).
- ``inbox``: deliveries the app failed, kept in their claim's row for the redeliverer, and
  the redelivery's own named steps (delivered, failed); its statements in ``inbox_sql``.
- ``holds``: the route holds (an operator's pause, the app's Retry-After), a row per route
  scope in the claim table, read by every replica.
- ``pool``: opening connections, lending them, and what the driver's errors mean (translated
  into ``errors`` once, here).
- ``sql``: every statement, built once per claim table.
"""

from __future__ import annotations

from proxy.database.claim import (
    GRANT_ANSWER_HINT,
    Answer,
    Claim,
    ClaimState,
    Commit,
    Duplicate,
    Held,
    Kept,
    Key,
    NotKept,
    Turn,
    is_bound,
    unbound,
)
from proxy.database.holds import MAX_RETRY_AFTER, Hold, HoldKind, RouteHolds
from proxy.database.inbox import (
    ATTEMPT_BODY,
    ATTEMPT_HEADER_VALUE,
    ATTEMPT_HEADERS,
    ATTEMPTS_KEPT,
    Attempt,
    HandedOff,
    InboxState,
    KeepPolicy,
    KeptFor,
    Listed,
    Redelivery,
    Shown,
    StoredRequest,
    object_scope,
)
from proxy.database.pool import dsn_hosts, host_named, translated
from proxy.database.receipts import Receipts
from proxy.database.sql import BOUND_DIGITS
from proxy.database.store import (
    DDL_LOCK_WAIT,
    DEGRADED,
    PRIVILEGES,
    Distribution,
    Event,
    Resolved,
    ScopeStats,
    Store,
    apply_schema,
    missing_schema,
    schema_sql,
)

__all__ = [
    "ATTEMPTS_KEPT",
    "ATTEMPT_BODY",
    "ATTEMPT_HEADERS",
    "ATTEMPT_HEADER_VALUE",
    "BOUND_DIGITS",
    "DDL_LOCK_WAIT",
    "DEGRADED",
    "GRANT_ANSWER_HINT",
    "MAX_RETRY_AFTER",
    "PRIVILEGES",
    "Answer",
    "Attempt",
    "Claim",
    "ClaimState",
    "Commit",
    "Distribution",
    "Duplicate",
    "Event",
    "HandedOff",
    "Held",
    "Hold",
    "HoldKind",
    "InboxState",
    "KeepPolicy",
    "Kept",
    "KeptFor",
    "Key",
    "Listed",
    "NotKept",
    "Receipts",
    "Redelivery",
    "Resolved",
    "RouteHolds",
    "ScopeStats",
    "Shown",
    "Store",
    "StoredRequest",
    "Turn",
    "apply_schema",
    "dsn_hosts",
    "host_named",
    "is_bound",
    "missing_schema",
    "object_scope",
    "schema_sql",
    "translated",
    "unbound",
]
