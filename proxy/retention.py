"""The retention sweeper: removes claims older than their route's ``retention``.

One replica sweeps at a time, in small batches, each its own short transaction holding a
transaction-level advisory lock (a replica that finds it taken skips the round; a session-level
lock would be lost, or leaked to another client, behind PgBouncer in transaction mode). It needs
only SELECT and DELETE: no ``FOR UPDATE SKIP LOCKED``, which needs UPDATE. Claims in flight are
rows its snapshot does not see, so it never waits on them; it can wait on a row another
transaction is deleting (an operator's ``events forget``) or locking, for at most
``SWEEP_ROW_LOCK_WAIT`` (``database.store``), after which the round fails, is logged and is
retried at the next interval. The batches themselves are the store's (``Store.sweep_batch``).

Deliveries kept for redelivery (``redeliver``) are never removed while pending or dead; dead
ones go after the route's ``dead_retention``, counted from when they died. An ordered route's
object rows (``order``) go after the route's ``retention`` since their object was last held, but
while one is held or its object keeps a pending or dead delivery. Each round also folds the
kept rows' counts left by database backends gone (``Store.fold_kept_counts``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from proxy import config, database, errors, metrics
from proxy.config import routes

log = logging.getLogger(__name__)


def scope_retention(routes: tuple[routes.RouteConfig, ...]) -> dict[str, float]:
    """Each scope's retention; routes sharing a scope keep the longest of theirs."""
    return _longest((route.scope, route.retention) for route in routes)


def _longest(retentions: Iterable[tuple[str, float]]) -> dict[str, float]:
    longest: dict[str, float] = {}
    for scope, retention in retentions:
        longest[scope] = max(longest.get(scope, 0.0), retention)
    return longest


class Sweeper:
    def __init__(
        self,
        store: database.Store,
        routes: tuple[routes.RouteConfig, ...],
        settings: config.SweeperConfig,
        meters: metrics.Metrics,
    ) -> None:
        self._store = store
        self._retention = scope_retention(routes)
        # Dead deliveries (redeliver) are kept for their own retention, from when they died.
        self._dead_retention = _longest(
            (route.scope, route.redeliver.dead_retention) for route in routes if route.redeliver
        )
        # An ordered route's object rows (``order``), for its retention since last held.
        self._objects = _longest(
            (database.object_scope(route.scope), route.retention) for route in routes if route.order
        )
        self._settings = settings
        self._metrics = meters

    async def run(self) -> None:
        """Sweep every ``interval`` until cancelled, from the store's start; a failed round is
        logged and retried."""
        await self._store.started.wait()
        while True:
            await asyncio.sleep(self._settings.interval)
            try:
                await self.sweep()
            except errors.StoreUnavailable as exc:
                log.warning("retention sweep failed: %s", exc)

    async def sweep(self) -> dict[str, int] | None:
        """One round; the rows removed per scope, or None if another replica is sweeping."""
        started = time.perf_counter()
        # Before the batches: kept rows must be passed over once the table can hold them.
        await self._store.notice_inbox_columns()
        removed: dict[str, int] = {}
        for scope, retention in self._retention.items():
            swept = await self._batches(scope, self._store.sweep_batch, retention)
            if swept is None:
                return None
            removed[scope] = swept
        for scope, kept in self._dead_retention.items():
            dead = await self._batches(scope, self._store.inbox.sweep_dead, kept)
            removed[scope] = removed.get(scope, 0) + (dead or 0)
        for scope, idle in self._objects.items():
            objects = await self._batches(scope, self._store.inbox.sweep_objects, idle)
            removed[scope] = objects or 0
        # The kept rows' counts of backends gone, folded (a batch a round: each backend that
        # wrote any leaves one row per scope it counted in, until then).
        await self._store.fold_kept_counts(self._settings.batch)
        self._metrics.retention_last_run.set_to_current_time()
        if any(removed.values()):
            log.info(
                "retention removed %d claim(s) in %.1f s",
                sum(removed.values()),
                time.perf_counter() - started,
                extra={"fields": {"removed": removed}},
            )
        return removed

    async def _batches(
        self, scope: str, batch: Callable[[str, float, int], Awaitable[int | None]], age: float
    ) -> int | None:
        """``batch`` (rows of ``scope`` older than ``age`` seconds) until one comes back short:
        the rows removed, or None when another replica holds the sweeper's lock."""
        size, total = self._settings.batch, 0
        while True:
            count = await batch(scope, age, size)
            if count is None:
                return None
            total += count
            self._metrics.retention_deleted.labels(scope).inc(count)
            if count < size:
                return total
