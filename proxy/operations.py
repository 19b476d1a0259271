"""The operator commands: look at the claims, release some, hold a route and release it, apply
the schema.

Each command opens a store of one connection (``open_store``) from the same configuration file
the proxy reads (starting the embedded server if that is what it names, and stopping it), does
its work through the store's methods and closes it. A route's pause and resume
(``pause_route``, ``resume_route``) are the CLI's ``events pause`` and ``resume`` and the
console's alike, which give them a store of their own. The preflight (``check --database``) is in
``preflight``.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import NamedTuple, TextIO

from proxy import config, database, embedded, errors, logs, presenting
from proxy.config import routes, values


@contextlib.asynccontextmanager
async def open_store(cfg: config.Config) -> AsyncIterator[database.Store]:
    """A store of one connection to the configured database; StoreUnavailable if there is
    none."""
    server = None
    if cfg.database.dsn is None:
        server = embedded.EmbeddedPostgres(
            cfg.database.data_dir, before=cfg.database.data_dir_before
        )
        dsn = await asyncio.to_thread(server.start)
    else:
        dsn = cfg.database.dsn.reveal()
    try:
        store = await database.Store.open(
            dsn,
            cfg.database,
            claim_wait=cfg.claim_wait,
            upstream_timeout=cfg.upstream.timeout,
            operator=True,
            unreachable=f"cannot connect to PostgreSQL at {server_of(dsn)}",
        )
        try:
            yield store
        finally:
            await store.close()
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)


def server_of(dsn: str) -> str:
    """Where a DSN points, for messages: each host (or socket directory) and port, never its
    credentials."""
    try:
        hosts = database.dsn_hosts(dsn)
    except ValueError:
        return "the server database.dsn names"
    return ",".join(map(database.host_named, hosts))


def route_of(cfg: config.Config, name: str) -> routes.RouteConfig:
    for route in cfg.routes:
        if route.name == name:
            return route
    known = ", ".join(route.name for route in cfg.routes)
    raise errors.UsageError(f"unknown route {name!r} (routes: {known})")


def route_scope(cfg: config.Config, name: str) -> str:
    return route_of(cfg, name).scope


def in_scope(scope: str, base: str) -> bool:
    return scope == base or scope.startswith(base + "/")


def narrowed_scope(route: routes.RouteConfig, scope: str | None) -> str:
    """``--scope`` if it is one of the route's, else the route's own (which holds them all)."""
    if scope is not None and not in_scope(scope, route.scope):
        raise errors.UsageError(f"{scope!r} is not a scope of route {route.name!r}")
    return scope or route.scope


def exact_scope(route: routes.RouteConfig, scope: str | None) -> str:
    """The one scope a command on single events works in: ``--scope``, which a route scoped
    by its path needs (its own scope holds no events, only its per-path ones)."""
    if scope is None and route.scoped_by_path:
        raise errors.UsageError(
            f"route {route.name!r} scopes claims by its path: give --scope (events list shows it)"
        )
    return narrowed_scope(route, scope)


class Named(NamedTuple):
    """The IDs an operator gave, resolved in one scope (``resolve``)."""

    scope: str
    stored: dict[str, str]  # each ID found, to its claim's ID as stored
    problems: dict[str, str]  # each of the others, to its line: not found, or its candidates

    def report(
        self,
        event_ids: Sequence[str],
        done: Collection[str],
        did: str,
        out: TextIO,
        why: Mapping[str, str] | None = None,
    ) -> None:
        """A line for each ID given: ``did`` to the claim (``done`` holds the stored IDs the
        command changed), else why not (``why``: by stored ID, else "not found")."""
        for event_id in dict.fromkeys(event_ids):
            stored = self.stored.get(event_id)
            if stored is None:
                out.write(f"{self.problems[event_id]}\n")
                continue
            shown = event_id if stored == event_id else f"{event_id} (claim {stored})"
            said = did if stored in done else (why or {}).get(stored, "not found")
            out.write(f"{said}: {self.scope} {shown}\n")

    def all_done(self, done: Collection[str]) -> bool:
        """Whether every ID given named one claim, and the command changed each."""
        return not self.problems and all(stored in done for stored in self.stored.values())


async def resolve(
    store: database.Store, route: routes.RouteConfig, scope: str, event_ids: Sequence[str]
) -> Named:
    """What these IDs name in ``scope``: an ID as the provider sent it names its claim bound
    to a body (``<id>~<digest>``, on GitHub, Shopify and Twilio routes with ``verify``) as
    well as the claim stored under it as given, and on a route whose ID is composite, the
    claims whose last part it is (GitHub's GUID without its hook ID); several claims bound
    to different bodies, or under several hooks, are listed for the operator to pick from."""
    resolved = await store.resolve(scope, event_ids, last_part=route.composite_id)
    stored, problems = {}, {}
    for event_id, found in resolved.items():
        if found.stored:
            stored[event_id] = found.stored
        elif found.candidates:
            problems[event_id] = (
                f"ambiguous: {scope} {event_id} is {len(found.candidates)} claims (bound to "
                f"different bodies); give one of: {' '.join(found.candidates)}"
            )
        else:
            problems[event_id] = f"not found: {scope} {event_id}{tried(route, event_id)}"
    return Named(scope, stored, problems)


def tried(route: routes.RouteConfig, event_id: str) -> str:
    """The forms of ``event_id`` a lookup on ``route`` looked for, to follow "not found"."""
    forms = [event_id]
    if route.binds_claims:
        forms.append(f"{event_id}~<digest>")
    if route.composite_id and ":" not in event_id:
        assert isinstance(route.event_id, tuple)
        parts = [f"<{source.name}>" for source in route.event_id[:-1]]
        forms.append(":".join([*parts, event_id]) + ("[~<digest>]" if route.binds_claims else ""))
    return f" (looked for {', '.join(forms)})" if len(forms) > 1 else ""


def json_document(document: object) -> str:
    """A command's ``--json`` output: one JSON document, ASCII only (every other character
    escaped, so nothing in it reaches a terminal as a control)."""
    return json.dumps(document, ensure_ascii=True, indent=2) + "\n"


def timestamp(value: datetime | None) -> str | None:
    """A time in ``--json`` output: ISO 8601 in UTC, to the microsecond; None stays None."""
    return None if value is None else value.astimezone(UTC).isoformat()


def table(
    rows: Sequence[Sequence[object]],
    headers: Sequence[str],
    out: TextIO,
    *,
    width: int | None = None,
    shrink: Sequence[str] = (),
) -> None:
    """A plain aligned text table, each cell escaped for the terminal (``logs.printable``).
    With ``width``, a table wider than that narrows the ``shrink`` columns, in that order, down
    to their header's width at least, their longer cells cut with "…"."""
    cells = [
        [str(h) for h in headers],
        *[["" if v is None else logs.printable(str(v)) for v in r] for r in rows],
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    over = 0 if width is None else sum(widths) + 2 * (len(widths) - 1) - width
    for name in shrink:
        column = list(headers).index(name)
        cut = min(max(over, 0), widths[column] - max(len(name), 2))
        if cut > 0:
            widths[column] -= cut
            over -= cut
            for row in cells[1:]:
                if len(row[column]) > widths[column]:
                    row[column] = row[column][: widths[column] - 1] + "…"
    for row in cells:
        line = "  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True))
        out.write(line.rstrip() + "\n")


async def list_events(
    cfg: config.Config,
    route: str,
    since: float | None,
    limit: int,
    out: TextIO = sys.stdout,
    *,
    as_json: bool = False,
) -> int:
    scope = route_scope(cfg, route)
    after = datetime.now(UTC) - timedelta(seconds=since) if since else None
    async with open_store(cfg) as store:
        rows, total = await store.events(scope, after, limit)
    if as_json:
        out.write(json_document({
            "route": route, "scope": scope, "total": total,
            "events": [
                {"scope": r.scope, "event_id": r.event_id, "event_type": r.event_type,
                 "received_at": timestamp(r.received_at), "state": r.state}
                for r in rows
            ],
        }))  # fmt: skip
        return 0
    table(
        [
            (presenting.when(r.received_at), r.scope, r.event_id,
             r.event_type or "-", r.state or "-")
            for r in rows
        ],
        ("received_at", "scope", "event_id", "event_type", "state"),
        out,
    )  # fmt: skip
    if total > len(rows):
        out.write(f"showing the {len(rows)} newest of {total} claim(s) in scope {scope}\n")
    else:
        out.write(f"{len(rows)} claim(s) in scope {scope}\n")
    return 0


async def forget(
    cfg: config.Config,
    route: str,
    event_ids: Sequence[str],
    out: TextIO = sys.stdout,
    scope: str | None = None,
) -> int:
    """Delete claims so a manual redelivery goes through. Exit 1 if some were not there (or
    an ID named several claims, listed).

    An ID is taken as the provider sent it or as stored (``resolve``); a bound claim is
    forgotten with its legacy form, which the upgrade window claims with it. A claim still in
    flight is an uncommitted row, invisible here: it is "not found" until its request has
    finished (and then it is either committed, so forgettable, or gone)."""
    configured = route_of(cfg, route)
    scope = exact_scope(configured, scope)
    async with open_store(cfg) as store:
        found = await resolve(store, configured, scope, event_ids)
        rows = {row for stored in found.stored.values()
                for row in (stored, database.unbound(stored))}  # fmt: skip
        forgotten = await store.forget(scope, sorted(rows), lock_wait=cfg.claim_wait)
    found.report(event_ids, forgotten, "forgotten", out)
    return 0 if found.all_done(forgotten) else 1


class RouteStats(NamedTuple):
    """A route's line of ``stats``: its claims, how many are pending and dead, the oldest and
    newest, its retention."""

    route: str
    scope: str
    rows: int
    pending: int
    dead: int
    oldest: datetime | None
    newest: datetime | None
    retention: float


async def stats(cfg: config.Config, out: TextIO = sys.stdout, *, as_json: bool = False) -> int:
    """Per route: rows, pending and dead deliveries, oldest and newest claim, retention; then
    a line per route scope held (``events pause``, the app's Retry-After)."""
    async with open_store(cfg) as store:
        rows = await store.stats()
        held = await _holds(store)
    summary = []
    for route in cfg.routes:
        mine = [r for r in rows if in_scope(r.scope, route.scope)]
        summary.append(
            RouteStats(
                route.name,
                route.scope + ("/…" if route.scoped_by_path else ""),
                sum(r.rows for r in mine),
                sum(r.pending for r in mine),
                sum(r.dead for r in mine),
                min((r.oldest for r in mine), default=None),
                max((r.newest for r in mine), default=None),
                route.retention,
            )
        )
    if as_json:
        out.write(json_document({"routes": [
            {"route": r.route, "scope": r.scope, "rows": r.rows, "pending": r.pending,
             "dead": r.dead, "oldest": timestamp(r.oldest), "newest": timestamp(r.newest),
             "retention_seconds": r.retention}
            for r in summary
        ], "held": [
            {"scope": scope, "reason": hold.reason, "by": hold.by,
             "since": timestamp(datetime.fromtimestamp(hold.since, UTC)),
             "until": None if hold.until is None
                      else timestamp(datetime.fromtimestamp(hold.until, UTC)),
             "note": hold.note}
            for scope, hold in sorted(held.items())
        ]}))  # fmt: skip
        return 0

    when = presenting.when
    table(
        [
            (r.route, r.scope, r.rows, r.pending, r.dead, when(r.oldest), when(r.newest),
             values.format_duration(r.retention))
            for r in summary
        ],
        ("route", "scope", "rows", "pending", "dead", "oldest", "newest", "retention"),
        out,
    )  # fmt: skip
    now = time.time()
    for scope, hold in sorted(held.items()):
        out.write(f"held: {presenting.hold(hold, now, presenting.when, scope)}\n")
    return 0


async def _holds(store: database.Store) -> dict[str, database.Hold]:
    """The holds in force, for ``stats``: none on a table that predates the inbox."""
    try:
        return await store.holds.active()
    except errors.TableMissing:
        return {}


def operator() -> str:
    """Who runs this command, as a hold records it: the OS user."""
    try:
        return getpass.getuser()
    except OSError:  # no USER and no passwd entry (a container's arbitrary UID)
        return f"uid {os.getuid()}"


async def pause_route(
    store: database.Store,
    cfg: config.Config,
    route: str,
    *,
    for_: float | None,
    note: str | None,
    by: str,
) -> list[str]:
    """Hold the route's scope on every replica, for ``for_`` seconds (None: until resumed),
    replacing any hold it had: ``events pause``'s and the console's. What it says, a line each:
    the hold, the routes held with it, what becomes of webhooks of a route that does not
    redeliver, and when the running proxies hold it."""
    found = route_of(cfg, route)
    hold = await store.holds.hold(found.scope, for_, by=by, note=note)
    lines = [f"paused: {presenting.hold(hold, time.time(), presenting.when, found.scope)}"]
    sharing = [r.name for r in cfg.routes if r.scope == found.scope and r.name != found.name]
    if sharing:
        lines.append(f"routes {', '.join(sharing)} share scope {found.scope}: held too")
    if found.redeliver is None:
        lines.append(
            f"route {found.name} has no redeliver: while paused its webhooks are answered 503 "
            "with Retry-After, and the provider sends them again later"
        )
    wait = values.format_duration(cfg.redeliverer.poll)
    lines.append(f"every running proxy holds it within {wait} (redeliverer.poll)")
    return lines


async def resume_route(
    store: database.Store, cfg: config.Config, route: str, *, by: str
) -> str | None:
    """End the route scope's hold (a pause, or the app's Retry-After) on every replica: what it
    says (None: it held none)."""
    found = route_of(cfg, route)
    was = await store.holds.release(found.scope, by=by)
    if was is None:
        return None
    wait = values.format_duration(cfg.redeliverer.poll)
    if any(r.redeliver for r in cfg.routes if r.scope == found.scope):
        then = f"redelivers its pending deliveries again within {wait}, at the limit at the app"
    else:  # it kept nothing: its webhooks were refused, and the provider's retries come through
        then = f"forwards its webhooks again within {wait} (it keeps none to redeliver)"
    return (
        f"resumed: route {found.name} (scope {found.scope}), {was} until now; every running "
        f"proxy {then}"
    )


async def migrate(cfg: config.Config, out: TextIO = sys.stdout) -> int:
    """The claim table; and, with a route that has ``receipt``, the receipts' table and
    function in each receipts' database. A failure names the database it happened in."""
    async with open_store(cfg) as store:
        try:
            await store.migrate()
        except errors.StoreUnavailable as exc:
            raise errors.StoreUnavailable(
                f"table {cfg.database.table} in the claim database ({server_of(store.dsn)}): "
                f"{exc.message}"
            ) from exc
        out.write(f"schema applied: table {cfg.database.table}\n")
        claim_dsn = store.dsn
    for place in receipt_databases(cfg, claim_dsn):
        receipts = place.open(cfg)
        try:
            await receipts.migrate()
        except errors.StoreUnavailable as exc:
            raise errors.StoreUnavailable(f"{place.what}: {exc.message}") from exc
        finally:
            await receipts.close()
        out.write(f"schema applied: receipts ({database.receipts.TABLE}) in {place.where}\n")
    return 0


class ReceiptDatabase(NamedTuple):
    """A receipts' database (``receipt``) and the routes whose apps write their receipts there."""

    dsn: str
    where: str  # "the claim database", or the DSN with its password masked
    routes: tuple[str, ...]

    @property
    def what(self) -> str:
        """As a problem with it is named: the database and its routes."""
        return f"receipts in {self.where} (route {', '.join(self.routes)})"

    def open(self, cfg: config.Config) -> database.Receipts:
        """Its connection, opened when first asked, on the claim database's timeouts."""
        timeout = cfg.database.connect_timeout
        return database.Receipts(self.dsn, connect_timeout=timeout, op_timeout=timeout)


def receipt_databases(cfg: config.Config, claim_dsn: str) -> list[ReceiptDatabase]:
    """The receipts' databases of the routes with ``receipt``, each once, in the order of their
    DSNs: the claim database's (``claim_dsn``) where a route names none."""
    places: dict[str, list[str]] = {}
    for route in cfg.routes:
        if route.receipt is not None:
            places.setdefault(route.receipt.dsn or claim_dsn, []).append(route.name)
    return [
        ReceiptDatabase(
            dsn, "the claim database" if dsn == claim_dsn else config.redact_dsn(dsn), tuple(names)
        )
        for dsn, names in sorted(places.items())
    ]
