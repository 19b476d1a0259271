"""The database door: every operation on PostgreSQL goes through ``Store`` (``store``), and
nothing outside this package imports the driver.

- ``store``: the operations, each a method, over a pool of connections.
- ``claim``: a claim and its named steps (commit, settle a duplicate, release), and what is
  claimed (``Key``) and stored (``Answer``).
- ``pool``: opening connections, lending them, and what the driver's errors mean (translated
  into ``errors`` once, here).
- ``sql``: every statement, built once per claim table.
"""

from __future__ import annotations

from proxy.database.claim import GRANT_ANSWER_HINT, Answer, Claim, Commit, Duplicate, Key
from proxy.database.pool import translated
from proxy.database.store import (
    DDL_LOCK_WAIT,
    PRIVILEGES,
    Event,
    ScopeStats,
    Store,
    apply_schema,
    missing_schema,
    schema_sql,
)

__all__ = [
    "DDL_LOCK_WAIT",
    "GRANT_ANSWER_HINT",
    "PRIVILEGES",
    "Answer",
    "Claim",
    "Commit",
    "Duplicate",
    "Event",
    "Key",
    "ScopeStats",
    "Store",
    "apply_schema",
    "missing_schema",
    "schema_sql",
    "translated",
]
