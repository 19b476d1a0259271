"""The operator commands: look at the claims, release some, apply the schema, and the
preflight (``check --database``) that tells whether ``serve`` would work against the database.

Each command opens one plain connection from the same configuration file the proxy reads
(starting the embedded server if that is what it names, and stopping it), does its work and
closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO
from urllib.parse import parse_qs, urlsplit

import asyncpg

from proxy import claims, config, embedded, errors, logs, routes, sql


@contextlib.asynccontextmanager
async def connect(cfg: config.Config) -> AsyncIterator[asyncpg.Connection[Any]]:
    """A connection to the configured database; StoreUnavailable if there is none."""
    server = None
    if cfg.database.dsn is None:
        server = embedded.EmbeddedPostgres(cfg.database.data_dir)
        dsn = await asyncio.to_thread(server.start)
    else:
        dsn = cfg.database.dsn.reveal()
    try:
        timeout = cfg.database.connect_timeout
        with claims.translated(
            f"cannot connect to PostgreSQL at {server_of(dsn)} within {timeout:g}s "
            "(database.connect_timeout)"
        ):
            connection = await claims.open_connection(
                dsn, cfg.database, application_name="dedup-proxy-cli"
            )
        try:
            yield connection
        finally:
            await connection.close()
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)


def server_of(dsn: str) -> str:
    """Where a DSN points, for messages: host (or socket directory) and port, never its
    credentials."""
    try:
        parts = urlsplit(dsn)
        query = parse_qs(parts.query)
        host = query.get("host", [parts.hostname or "localhost"])[0]
        port = query.get("port", [str(parts.port or 5432)])[0]
    except ValueError:
        return "the server database.dsn names"
    return f"{host}:{port}"


def route_of(cfg: config.Config, name: str) -> routes.RouteConfig:
    for route in cfg.routes:
        if route.name == name:
            return route
    known = ", ".join(route.name for route in cfg.routes)
    raise errors.ConfigError("--route", [f"unknown route {name!r} (routes: {known})"])


def route_scope(cfg: config.Config, name: str) -> str:
    return route_of(cfg, name).scope


def _in_scope(scope: str, base: str) -> bool:
    return scope == base or scope.startswith(base + "/")


def table(rows: Sequence[Sequence[object]], headers: Sequence[str], out: TextIO) -> None:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers], *[["" if v is None else str(v) for v in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        out.write("  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)))
        out.write("\n")


async def list_events(
    cfg: config.Config, route: str, since: float | None, limit: int, out: TextIO = sys.stdout
) -> int:
    scope = route_scope(cfg, route)
    after = datetime.now(UTC) - timedelta(seconds=since) if since else None
    queries = sql.for_table(cfg.database.table)
    async with connect(cfg) as connection:
        rows = await _fetch(connection, queries.events, scope, after, limit)
        total = len(rows)
        if total == limit:
            total = (await _fetch(connection, queries.events_count, scope, after))[0]["n"]
    table(
        [
            (r["received_at"].isoformat(timespec="seconds"), r["scope"], r["event_id"],
             r["event_type"])
            for r in rows
        ],
        ("received_at", "scope", "event_id", "event_type"),
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
    """Delete claims so a manual redelivery goes through. Exit 1 if some were not there.

    A claim still in flight is an uncommitted row, invisible here: it is "not found" until its
    request has finished (and then it is either committed, so forgettable, or gone)."""
    found = route_of(cfg, route)
    if scope is None and found.scoped_by_path:
        raise errors.ConfigError(
            "--scope",
            [f"route {route!r} scopes claims by its path: give --scope (events list shows it)"],
        )
    if scope is not None and not _in_scope(scope, found.scope):
        raise errors.ConfigError("--scope", [f"{scope!r} is not a scope of route {route!r}"])
    scope = scope or found.scope
    async with connect(cfg) as connection:
        with claims.translated("forget failed"):
            try:
                async with connection.transaction():
                    # A forget must not queue for long behind a transaction holding the row.
                    await connection.execute(sql.lock_timeout(cfg.claim_wait))
                    rows = await connection.fetch(
                        sql.for_table(cfg.database.table).forget, scope, list(event_ids)
                    )
            except asyncpg.LockNotAvailableError as exc:
                raise errors.StoreUnavailable(
                    "one of these claims is locked by another transaction (the retention "
                    "sweeper or another forget); try again in a moment"
                ) from exc
    forgotten = {r["event_id"] for r in rows}
    for event_id in event_ids:
        state = "forgotten" if event_id in forgotten else "not found"
        out.write(f"{state}: {scope} {event_id}\n")
    return 0 if len(forgotten) == len(set(event_ids)) else 1


async def stats(cfg: config.Config, out: TextIO = sys.stdout) -> int:
    """Per route: rows, oldest and newest claim."""
    async with connect(cfg) as connection:
        rows = await _fetch(connection, sql.for_table(cfg.database.table).stats)

    def when(value: datetime | None) -> str:
        return value.isoformat(timespec="seconds") if value else "-"

    lines = []
    for route in cfg.routes:
        mine = [r for r in rows if _in_scope(r["scope"], route.scope)]
        lines.append(
            (
                route.name,
                route.scope + ("/…" if route.scoped_by_path else ""),
                sum(r["n"] for r in mine),
                when(min((r["oldest"] for r in mine), default=None)),
                when(max((r["newest"] for r in mine), default=None)),
                f"{route.retention / 86400:g}d",
            )
        )
    table(lines, ("route", "scope", "rows", "oldest", "newest", "retention"), out)
    return 0


async def migrate(cfg: config.Config, out: TextIO = sys.stdout) -> int:
    async with connect(cfg) as connection:
        with claims.translated("migrate failed"):
            await claims.apply_schema(connection, sql.for_table(cfg.database.table))
    out.write(f"schema applied: table {cfg.database.table}\n")
    return 0


async def _fetch(
    connection: asyncpg.Connection[Any], query: str, *args: object
) -> list[asyncpg.Record]:
    with claims.translated("query failed"):
        try:
            return await connection.fetch(query, *args)
        except asyncpg.UndefinedTableError as exc:
            raise errors.StoreUnavailable(
                "the claim table does not exist yet: start the proxy once or run "
                "'dedup-proxy migrate'"
            ) from exc


async def preflight(cfg: config.Config, out: TextIO = sys.stdout) -> int:
    """``check --database``: one line per check, ``ok`` or ``FAIL``; 1 if any failed.

    Connects as ``serve`` would, then checks the claim table and its columns, the privileges
    the configured routes need (the ones ``serve`` verifies at start-up) and what can be told
    of a connection pooler in between.
    """
    failed = False

    def report(ok: bool, line: str) -> None:
        nonlocal failed
        failed = failed or not ok
        out.write(logs.mask(f"{'ok  ' if ok else 'FAIL'} {line}\n"))

    async with contextlib.AsyncExitStack() as stack:
        try:
            connection = await stack.enter_async_context(connect(cfg))
            with claims.translated("query failed"):
                user = await connection.fetchval("SELECT current_user")
        except errors.StoreUnavailable as exc:
            report(False, f"connect: {exc.message}")
            return 1
        version = connection.get_settings().server_version
        where = "embedded" if cfg.database.dsn is None else server_of(cfg.database.dsn.reveal())
        report(True, f"connect: {where} as {user}, PostgreSQL {version}")
        with claims.translated("query failed"):
            await _check_table(cfg, connection, report)
            await _check_pooler(connection, report)
    return 1 if failed else 0


async def _check_table(
    cfg: config.Config,
    connection: asyncpg.Connection[Any],
    report: Callable[[bool, str], None],
) -> None:
    settings = cfg.database
    queries = sql.for_table(settings.table)
    answers = any(route.replay for route in cfg.routes)
    lacking = await claims.missing_schema(connection, queries, answers=answers)
    if lacking == "does not exist" and settings.create_schema:
        schema = settings.table.rpartition(".")[0] or None
        may = await connection.fetchval(
            "SELECT has_schema_privilege(coalesce($1, current_schema()), 'CREATE')", schema
        )
        report(
            bool(may),
            f"table {settings.table}: does not exist; serve creates it (create_schema: true)"
            if may
            else f"table {settings.table}: does not exist, and the role may not CREATE it in "
            "its schema: run 'dedup-proxy migrate' as the table's owner",
        )
        return
    if lacking:
        report(
            False,
            f"table {settings.table}: {lacking}: run 'dedup-proxy migrate' (or the DDL of "
            "'dedup-proxy schema') as the table's owner",
        )
    else:
        report(True, f"table {settings.table}: columns and index present")
    if lacking == "does not exist":
        return
    problem = await claims.missing_grants(connection, queries, answers=answers)
    needed = ", ".join(claims.PRIVILEGES) + (
        " and UPDATE of the answer columns (on_duplicate: replay)" if answers else ""
    )
    report(not problem, f"privileges: {problem}" if problem else f"privileges: {needed}")


async def _check_pooler(
    connection: asyncpg.Connection[Any], report: Callable[[bool, str], None]
) -> None:
    """A pooler (PgBouncer) answers the startup with a process ID of its own, so the server's
    differs; its pool mode it does not tell a client. Statement pooling refuses the claim's
    transaction, so a transaction is tried."""
    try:
        async with connection.transaction():
            backend = await connection.fetchval("SELECT pg_backend_pid()")
            await connection.fetchval("SELECT 1")
    except claims.DB_ERRORS as exc:
        report(False, f"pooler: a transaction of two statements failed ({exc}): statement "
                      "pooling? The proxy needs session or transaction pooling")  # fmt: skip
        return
    if backend == connection.get_server_pid():
        report(True, "pooler: none (a direct connection to PostgreSQL)")
    else:
        report(
            True,
            "pooler: one is in between (PgBouncer?); its pool mode can't be told from a "
            "client, but transactions work: transaction or session pooling, both fine",
        )
