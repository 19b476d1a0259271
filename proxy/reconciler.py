"""The reconciler: recovers the events a provider reports it failed to deliver, and that the
proxy never claimed (docs/how-it-works.md, "Reconcile").

While the database does not answer, the proxy refuses webhooks (503) and keeps nothing; a
provider that never retries (GitHub) then has the only record of them, in its own delivery
log. For each route with ``reconcile:``, every ``every`` the reconciler reads that log
(``providers_api``) over the last ``since``, takes each event whose attempts all failed,
and looks its claim up in the route's scope (``Store.resolve``: the ID as the provider sent it,
or its form bound to the body). An event with a claim was processed (or is in flight) and is
never sent again; one without is a gap, recovered the way the provider allows (GitHub: a
redelivery, which arrives signed like any delivery and is claimed like any other; Paddle: a
replay of the notification; PayPal: a resend to the route's webhook; Stripe: the event object,
signed with the route's endpoint secret and POSTed to the route by the reconciler itself; a copy
of any is a duplicate by construction).

Bounded and polite: one replica runs a route's reconcile per period (``Store.reconcile_turn``);
a run recovers at most ``max_per_run`` gaps, no faster than ``pace`` a second (the limit at the
app), until its period ends or, when reading the log took longer, half a period after; a
rate-limit answer is waited out within the run when it asks for at most ``MAX_WAIT_IN_RUN``, else
it ends the run and the next one waits for it. Any other API error ends the run: logged, counted
by kind, retried at the next period. A run never sends what has a claim, so a run cut short and
run again sends nothing twice. A log longer than the provider's page bound is read to the bound
(its newest events) and said: logged, counted (``page_bound``), and ``events reconcile`` exits
``EXIT_TRUNCATED``. Whatever else a run raises is logged on one line with its route and counted
(``crashed``); the other routes' runs and the route's next turn go on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TextIO, TypeVar

import proxy
from proxy import config, database, errors, logs, metrics, operations, providers_api
from proxy.config import reconcile as reconciling
from proxy.config import routes, values
from proxy.providers_api import github, paddle, paypal, stripe

log = logging.getLogger(__name__)
T = TypeVar("T")

# The longest Retry-After a run waits out before it goes on; a longer one ends the run.
MAX_WAIT_IN_RUN = 60.0
# Tries of one request that the provider rate-limits, within a run.
RATE_LIMIT_TRIES = 3
# Before a route's first run after the start: the store's start, and a moment more.
FIRST_RUN_DELAY = 1.0
# ``events reconcile``'s exit status when the run read the provider's log only to its page
# bound (otherwise complete); 1 when the API stopped the run.
EXIT_TRUNCATED = 3
# ``events reconcile``'s progress on stderr: a line every this many events read from the
# provider's log, and every this many gaps recovered (a run is paced: minutes for thousands).
PROGRESS_READ = 1000
PROGRESS_RECOVERED = 25

DeliveryLogFactory = Callable[[reconciling.Reconcile], providers_api.DeliveryLog]


def delivery_log(settings: reconciling.Reconcile) -> providers_api.DeliveryLog:
    """The provider's delivery log for ``settings`` (its ``provider``)."""
    user_agent = f"dedup-proxy/{proxy.__version__}"
    if settings.provider == "stripe":
        return stripe.UndeliveredEvents(settings, user_agent=user_agent)
    if settings.provider == "paddle":
        return paddle.FailedNotifications(settings, user_agent=user_agent)
    if settings.provider == "paypal":
        return paypal.WebhookEvents(settings, user_agent=user_agent)
    return github.HookDeliveries(settings, user_agent=user_agent)


@dataclass(slots=True, kw_only=True)
class Report:
    """One run over one route: what the provider says, and what became of its failures."""

    route: str
    since: float
    deliveries: list[providers_api.Delivery] = field(default_factory=list)
    failed: list[providers_api.Delivery] = field(default_factory=list)
    claimed: list[providers_api.Delivery] = field(default_factory=list)
    gaps: list[providers_api.Delivery] = field(default_factory=list)
    recovered: list[providers_api.Delivery] = field(default_factory=list)
    # Gaps the route refused when recovered, each for a reason of its own (the app's answer):
    # the run went on to the next; each is tried again the next run.
    refused: dict[str, errors.RecoveryRefused] = field(default_factory=dict)
    # Why the run ended early (an API error), if it did; the gaps left are the next run's.
    stopped: errors.ProviderAPIError | None = None
    # Whether the provider's log had more pages over the window than a run reads: the older
    # events were not looked at.
    truncated: bool = False


class Reconciler:
    """The reconcile runs of every route with ``reconcile:``, from the store's start."""

    def __init__(
        self,
        store: database.Store,
        configured: tuple[routes.RouteConfig, ...],
        meters: metrics.Metrics,
        *,
        pace: float,
        open_log: DeliveryLogFactory = delivery_log,
        progress: TextIO | None = None,
    ) -> None:
        """``progress``: a one-off run's (``events reconcile``): its progress is written there,
        and its messages promise no next run."""
        self._store = store
        self._routes = tuple(route for route in configured if route.reconcile is not None)
        self._metrics = meters
        self._pace = pace
        self._open_log = open_log
        self._progress = progress
        # A route's next run not before this (time.monotonic()): a long Retry-After.
        self._not_before: dict[str, float] = {}

    @property
    def configured(self) -> bool:
        return bool(self._routes)

    async def run(self) -> None:
        """Each route's runs, every ``every``, until cancelled."""
        await self._store.started.wait()
        async with asyncio.TaskGroup() as group:
            for route in self._routes:
                group.create_task(self._periodically(route), name=f"reconcile-{route.name}")

    async def _periodically(self, route: routes.RouteConfig) -> None:
        settings = _settings(route)
        await asyncio.sleep(FIRST_RUN_DELAY)
        while True:
            wait = self._not_before.get(route.name, 0.0) - time.monotonic()
            if wait <= 0:
                try:
                    await self._turn(route, settings)
                except Exception as exc:  # one route's run must not end the others', nor its next
                    self._metrics.reconcile_errors.labels(route.name, "crashed").inc()
                    log.error("reconcile of route %s failed: %s: %.300s (the next run in %s)",
                              route.name, type(exc).__name__, exc,
                              values.format_duration(settings.every))  # fmt: skip
            # A quarter period: a replica takes over within that of the last run's period.
            await asyncio.sleep(max(wait, min(settings.every / 4, _RECHECK)))

    async def _turn(self, route: routes.RouteConfig, settings: reconciling.Reconcile) -> None:
        """A run if it is this replica's turn (none has run the route for ``every``)."""
        try:
            turn = await self._store.reconcile_turn(route.name, settings.every)
        except errors.StoreUnavailable as exc:
            self._metrics.reconcile_errors.labels(route.name, "database").inc()
            log.warning("reconcile of route %s: the database does not answer: %s",
                        route.name, exc.message)  # fmt: skip
            return
        if not turn:
            return
        try:
            await self.reconcile(route)
        except errors.StoreUnavailable as exc:  # counted by the run
            log.warning("reconcile of route %s: the database does not answer: %s",
                        route.name, exc.message)  # fmt: skip

    async def reconcile(
        self, route: routes.RouteConfig, *, since: float | None = None, dry_run: bool = False
    ) -> Report:
        """One run over ``route``'s provider log, the last ``since`` seconds (the route's own by
        default); with ``dry_run``, only what it would recover. An API error ends it (logged,
        counted, in the report's ``stopped``); the database's is raised."""
        settings = _settings(route)
        report = Report(route=route.name, since=settings.since if since is None else since)
        deadline = time.monotonic() + settings.every
        provider_log = self._open_log(settings)
        try:
            await self._read(route, provider_log, report, deadline)
            if not dry_run:
                # A log read in longer than the period would leave no time to recover, run
                # after run: half a period at least, after which the next turn's replica is
                # still reading its own.
                deadline = max(deadline, time.monotonic() + settings.every / 2)
                await self._recover(route, settings, provider_log, report, deadline)
        except errors.ProviderAPIError as exc:
            report.stopped = exc
            self._metrics.reconcile_errors.labels(route.name, exc.kind).inc()
            if isinstance(exc, errors.ProviderRateLimited):
                self._not_before[route.name] = time.monotonic() + exc.retry_after
            log.warning("reconcile of route %s stopped: %s%s", route.name, exc.message,
                        self._next_run(settings))  # fmt: skip
        except errors.StoreUnavailable:
            self._metrics.reconcile_errors.labels(route.name, "database").inc()
            raise
        finally:
            await provider_log.close()
        if report.stopped is None:
            self._metrics.reconcile_last_success.labels(route.name).set_to_current_time()
        log.info(
            "reconcile of route %s: %d event(s) in the provider's log, %d failed, %d of them "
            "claimed, %d gap(s), %d recovered%s",
            route.name, len(report.deliveries), len(report.failed), len(report.claimed),
            len(report.gaps), len(report.recovered), " (dry run)" if dry_run else "",
            extra={"fields": {"route": route.name, "gaps": len(report.gaps),
                              "recovered": len(report.recovered)}},
        )  # fmt: skip
        return report

    async def _read(
        self,
        route: routes.RouteConfig,
        provider_log: providers_api.DeliveryLog,
        report: Report,
        deadline: float,
    ) -> None:
        """The provider's log over the window, and the claims of the events it failed."""
        since = time.time() - report.since

        async def read() -> list[providers_api.Delivery]:
            read: list[providers_api.Delivery] = []
            async for delivery in provider_log.deliveries(since):
                read.append(delivery)
                if len(read) % PROGRESS_READ == 0:
                    self._say(f"read {len(read)} event(s) of the provider's log so far")
            return read

        report.deliveries = await self._politely(route, read, deadline)
        report.truncated = provider_log.truncated
        if report.truncated:
            self._metrics.reconcile_errors.labels(route.name, "page_bound").inc()
            log.warning("reconcile of route %s: the provider's log over the last %s is longer "
                        "than a run reads; only its newest events were looked at (a shorter "
                        "since, or a shorter every)", route.name,
                        values.format_duration(report.since))  # fmt: skip
        report.failed = [delivery for delivery in report.deliveries if not delivery.delivered]
        if not report.failed:
            return
        found = await self._store.resolve(route.scope, [d.event_id for d in report.failed])
        for delivery in report.failed:
            resolved = found[delivery.event_id]
            claimed = bool(resolved.stored or resolved.candidates)
            (report.claimed if claimed else report.gaps).append(delivery)
        self._metrics.reconcile_gaps.labels(route.name).inc(len(report.gaps))

    async def _recover(
        self,
        route: routes.RouteConfig,
        settings: reconciling.Reconcile,
        provider_log: providers_api.DeliveryLog,
        report: Report,
        deadline: float,
    ) -> None:
        """The gaps, oldest first, at most ``max_per_run``, ``pace`` a second at most."""
        todo = sorted(report.gaps, key=lambda d: d.at)[: settings.max_per_run]
        if todo:
            pace = f"at most {self._pace:g} a second"
            self._say(f"{len(report.gaps)} gap(s); recovering {len(todo)}, {pace}")
        for done, delivery in enumerate(todo):
            if done and done % PROGRESS_RECOVERED == 0:
                recovered = len(report.recovered)
                self._say(f"{done} of {len(todo)} gap(s) done, {recovered} recovered")
            if time.monotonic() >= deadline:
                log.warning("reconcile of route %s: the period ended with %d gap(s) left for "
                            "the next run", route.name,
                            len(report.gaps) - len(report.recovered))  # fmt: skip
                return
            if await self._claimed_since(route, delivery):
                # A copy arrived while the gaps ahead of it were recovered (the recoveries are
                # paced): never sent again, as any event with a claim.
                report.gaps.remove(delivery)
                report.claimed.append(delivery)
                continue
            try:
                await self._politely(
                    route, functools.partial(provider_log.recover, delivery), deadline
                )
            except errors.RecoveryRefused as exc:
                if not exc.about_the_event:
                    raise
                # One event the app refuses must not hold back the gaps behind it.
                report.refused[delivery.event_id] = exc
                self._metrics.reconcile_errors.labels(route.name, exc.kind).inc()
                log.warning("reconcile of route %s: %s; going on to the next gap", route.name,
                            exc.message)  # fmt: skip
            else:
                report.recovered.append(delivery)
                self._metrics.reconcile_recovered.labels(route.name).inc()
            await asyncio.sleep(1.0 / self._pace)

    def _next_run(self, settings: reconciling.Reconcile) -> str:
        """When the route's next run is, as a message ends: nothing for a one-off run."""
        if self._progress is not None:
            return ""
        return f" (the next run in {values.format_duration(settings.every)})"

    def _say(self, text: str) -> None:
        """A one-off run's progress line (none for the proxy's own runs: they log)."""
        if self._progress is not None:
            self._progress.write(f"{text}\n")
            self._progress.flush()

    async def _claimed_since(
        self, route: routes.RouteConfig, delivery: providers_api.Delivery
    ) -> bool:
        """Whether the gap has a claim now: the log was read, and the claims looked up, up to
        a period before its turn came."""
        found = await self._store.resolve(route.scope, [delivery.event_id])
        resolved = found[delivery.event_id]
        return bool(resolved.stored or resolved.candidates)

    async def _politely(
        self, route: routes.RouteConfig, call: Callable[[], Awaitable[T]], deadline: float
    ) -> T:
        """``call``, tried again after a rate-limit answer's wait when the wait is short and
        fits before ``deadline``; the rate-limit error itself otherwise."""
        for attempt in range(1, RATE_LIMIT_TRIES + 1):
            try:
                return await call()
            except errors.ProviderRateLimited as exc:
                fits = exc.retry_after <= min(MAX_WAIT_IN_RUN, deadline - time.monotonic())
                if attempt == RATE_LIMIT_TRIES or not fits:
                    raise
                self._metrics.reconcile_errors.labels(route.name, exc.kind).inc()
                log.info("reconcile of route %s: %s; waiting", route.name, exc.message)
                await asyncio.sleep(exc.retry_after)
        raise AssertionError("unreachable")  # pragma: no cover


# How often a route whose run was put off (a long Retry-After) looks again.
_RECHECK = 30.0


def _settings(route: routes.RouteConfig) -> reconciling.Reconcile:
    assert route.reconcile is not None
    return route.reconcile


async def command(
    cfg: config.Config,
    route_name: str,
    *,
    since: float | None,
    dry_run: bool,
    out: TextIO = sys.stdout,
    progress: TextIO = sys.stderr,
    open_log: DeliveryLogFactory = delivery_log,
) -> int:
    """``events reconcile``: one run over the route now, whatever replica's turn it is (a
    recovery is a duplicate at worst); what the provider says, and what was (or, with
    ``dry_run``, would be) recovered, its progress on ``progress`` meanwhile. Exit status 1 if
    the provider's API stopped the run, ``EXIT_TRUNCATED`` if it read the provider's log only to
    its page bound."""
    route = operations.route_of(cfg, route_name)
    if route.reconcile is None:
        raise errors.UsageError(f"route {route.name!r} has no reconcile section")
    window = route.reconcile.since if since is None else since
    async with operations.open_store(cfg) as store:
        runs = Reconciler(
            store, cfg.routes, metrics.Metrics(), pace=float(cfg.upstream.concurrency or 10),
            open_log=open_log, progress=progress,
        )  # fmt: skip
        report = await runs.reconcile(route, since=window, dry_run=dry_run)
    out.write(describe(report, dry_run=dry_run))
    if report.stopped is not None:
        return 1
    return EXIT_TRUNCATED if report.truncated else 0


def describe(report: Report, *, dry_run: bool) -> str:
    """The run's report as ``events reconcile`` prints it: the provider's failed events, each
    with what became of it, then the counts. What the provider's API said is escaped for the
    terminal (``logs.printable``)."""
    gaps = {delivery.event_id for delivery in report.gaps}
    recovered = {delivery.event_id for delivery in report.recovered}
    lines = [
        f"route {report.route}: the provider's log over the last "
        f"{values.format_duration(report.since)}: {len(report.deliveries)} event(s), "
        f"{len(report.failed)} never delivered"
    ]
    for delivery in sorted(report.failed, key=lambda d: d.at):
        if delivery.event_id not in gaps:
            fate = "claimed: not sent again"
        elif delivery.event_id in recovered:
            fate = "recovered"
        elif delivery.event_id in report.refused:
            status = report.refused[delivery.event_id].status
            fate = f"refused by the route ({status}), left for the next run"
        else:
            fate = "would be recovered" if dry_run else "a gap, left for the next run"
        when = datetime.fromtimestamp(delivery.at, UTC).isoformat(timespec="seconds")
        lines.append(
            f"  {logs.printable(delivery.event_id)}  {logs.printable(delivery.event or '-')}  "
            f"{when}  last {logs.printable(delivery.status)}, {delivery.attempts} attempt(s): "
            f"{fate}"
        )
    verb = "would recover" if dry_run else "recovered"
    count = len(report.gaps) if dry_run else len(report.recovered)
    lines.append(
        f"{len(report.gaps)} gap(s) (no claim), {len(report.claimed)} claimed; {verb} {count}"
    )
    if report.truncated:
        lines.append(
            "warning: the provider's log over the window is longer than a run reads; only its "
            "newest events were looked at (give a shorter --since)"
        )
    if report.stopped is not None:
        lines.append(f"stopped: {logs.printable(report.stopped.message)}")
    return "\n".join(lines) + "\n"
