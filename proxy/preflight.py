"""``dedup-proxy check --database`` and ``--upstream``: whether ``serve`` would work against
the database, and whether the apps it forwards to take connections.

One line per check, ``ok`` or ``FAIL``: the connection (as ``serve`` makes it), the USAGE on
the claim table's schema (without it nothing else about the table can be read), whether the
server takes writes and its COMMITs wait for a standby, the claim table and its columns, the
privileges the configured routes need (the ones ``serve`` verifies at start-up), on a Citus
coordinator how the table is distributed, and what can be told of a connection pooler in
between. The facts come from the
store; this module only judges and words them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import TextIO

from proxy import config, database, errors, logs, operations
from proxy.database import slots
from proxy.upstream import forwarder

Report = Callable[[bool, str], None]
# How long ``upstreams`` waits for each app's connection, at most (a connect, not a request).
UPSTREAM_CONNECT_WAIT = 5.0


async def preflight(cfg: config.Config, out: TextIO = sys.stdout) -> int:
    """Write the checks' lines to ``out``; 1 if any failed."""
    failed = False

    def report(ok: bool, line: str) -> None:
        nonlocal failed
        failed = failed or not ok
        # A line may quote the server's or a peer's words: escaped for the terminal.
        out.write(logs.mask(f"{'ok  ' if ok else 'FAIL'} {logs.printable(line)}\n"))

    async with contextlib.AsyncExitStack() as stack:
        try:
            store = await stack.enter_async_context(operations.open_store(cfg))
            user, version = await store.whoami()
        except errors.StoreUnavailable as exc:
            report(False, f"connect: {exc.message}")
            return 1
        dsn = cfg.database.dsn
        where = "embedded" if dsn is None else operations.server_of(dsn.reveal())
        report(True, f"connect: {where} as {user}, PostgreSQL {version}")
        if unusable := await store.missing_usage():
            # Every statement naming the table would be refused, or find no table.
            report(False, f"schema: {unusable}")
        else:
            await _check_writes(store, report)
            await _check_table(cfg, store, report)
            distribution = await store.distribution()
            if distribution is not None:
                report(*citus_line(cfg.database.table, distribution))
                if distribution.distributed and cfg.upstream.shared:
                    report(False, f"citus: {slots.NOT_ON_CITUS}")
                if not distribution.conforming:
                    report(False, CITUS_NOT_CONFORMING)
        await _check_pooler(store, report)
        await _check_receipts(cfg, store.dsn, report)
    return 1 if failed else 0


async def _check_receipts(cfg: config.Config, claim_dsn: str, report: Report) -> None:
    """Each receipts' database (``receipt``): its table and function, the role's grants on
    the table, and when its app last wrote a receipt. None written is said, not failed: a new
    app has written none yet, and ``serve`` warns at each 2xx that comes without one."""
    for place in operations.receipt_databases(cfg, claim_dsn):
        what = place.what
        receipts = place.open(cfg)
        try:
            if await receipts.missing():
                table, function = database.receipts.TABLE, database.receipts.FUNCTION
                report(False, f"{what}: {table} or {function}() is missing: run 'dedup-proxy "
                       "migrate'")  # fmt: skip
                continue
            role, lacking = await receipts.ungranted()
            if lacking:
                table = database.receipts.TABLE
                report(False, f"{what}: role {role} lacks {', '.join(lacking)} on {table}: "
                       f"GRANT SELECT, INSERT, DELETE ON {table} TO {role}")  # fmt: skip
                continue
            age = await receipts.newest_age()
        except errors.StoreUnavailable as exc:
            report(False, f"{what}: {exc.message}")
            continue
        finally:
            await receipts.close()
        report(True, f"{what}: " + (
            "none written yet: until the app writes SELECT dedup_receipt($1) in its "
            "transaction, each doubt is settled as not done (sent again)"
            if age is None else f"the newest written {_ago(age)} ago"
        ))  # fmt: skip


def _ago(seconds: float) -> str:
    seconds = max(0, round(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


async def _check_table(cfg: config.Config, store: database.Store, report: Report) -> None:
    table = cfg.database.table
    answers = any(route.replay for route in cfg.routes)
    kept = any(route.redeliver for route in cfg.routes)
    lacking = await store.missing_schema(answers=answers, kept=kept)
    if lacking == "does not exist" and cfg.database.create_schema:
        may = await store.may_create_table()
        report(
            may,
            f"table {table}: does not exist; serve creates it (create_schema: true)"
            if may
            else f"table {table}: does not exist, and the role may not CREATE it in "
            "its schema: run 'dedup-proxy migrate' as the table's owner",
        )
        return
    if lacking:
        report(
            False,
            f"table {table}: {lacking}: run 'dedup-proxy migrate' (or the DDL of "
            "'dedup-proxy schema') as the table's owner",
        )
    else:
        report(True, f"table {table}: columns and index present")
    if lacking == "does not exist":
        return
    problem = await store.missing_grants(answers=answers, kept=kept)
    needed = (
        ", ".join(database.PRIVILEGES)
        + (" and UPDATE of the answer columns (on_duplicate: replay)" if answers else "")
        + (" and UPDATE of the inbox columns (redeliver)" if kept else "")
    )
    report(not problem, f"privileges: {problem}" if problem else f"privileges: {needed}")


CITUS_NOT_CONFORMING = (
    "citus: standard_conforming_strings is off for this role: Citus passes values to its workers "
    "as literals written for it, which they read otherwise (an event ID with a backslash "
    "would not match its claim); ALTER ROLE … SET standard_conforming_strings = on"
)


def citus_line(table: str, distribution: database.Distribution) -> tuple[bool, str]:
    """The check of a claim table on a Citus coordinator: distributed by ``event_id``, each
    claim goes to one shard (docs/deployment.md, "Past one database")."""
    column, shards, _ = distribution
    if column == "event_id":
        return True, (
            f"citus: {table} is distributed by event_id over {shards} shards: each claim goes "
            "to one shard"
        )
    if not distribution.distributed:
        return True, (
            f"citus: {table} is a plain table on the coordinator, so the claims do not spread: "
            f"SELECT create_distributed_table('{table}', 'event_id') distributes it"
        )
    spread = f"by {column}" if column else "as a reference or local table"
    return False, (
        f"citus: {table} is distributed {spread}, not by event_id: distribute it by event_id "
        '(docs/deployment.md, "Past one database")'
    )


async def _check_writes(store: database.Store, report: Report) -> None:
    """Whether a claim can commit there, and whether its COMMIT waits for a standby: without,
    a failover can lose claims already acknowledged (docs/deployment.md, "High
    availability"). Not waiting is no failure (one server, or a choice), only said plainly."""
    read_only, replication = await store.facts()
    report(not read_only, f"writes: {read_only}" if read_only else "writes: taken")
    if replication.waits:
        report(True, f"commits wait for a standby: yes ({replication})")
    else:
        report(
            True,
            f"commits wait for a standby: no ({replication}): a failover to a standby can lose "
            'claims already acknowledged (docs/deployment.md, "High availability")',
        )


async def _check_pooler(store: database.Store, report: Report) -> None:
    """A pooler answers the startup with a process ID of its own; its pool mode it does not
    tell a client. Statement pooling refuses the claim's transaction, so one is tried."""
    try:
        between = await store.pooler()
    except errors.StoreUnavailable as exc:
        report(
            False,
            f"pooler: a transaction of two statements failed ({exc.__cause__}): statement "
            "pooling? The proxy needs session or transaction pooling",
        )
        return
    if not between:
        report(True, "pooler: none (a direct connection to PostgreSQL)")
    else:
        report(
            True,
            "pooler: one is in between (PgBouncer?); its pool mode can't be told from a "
            "client, but transactions work: transaction or session pooling, both fine",
        )


async def upstreams(cfg: config.Config, out: TextIO = sys.stdout) -> int:
    """One line per upstream URL: whether it takes a connection (and a TLS handshake), with
    the routes (and the pass-through traffic) sent there; 1 if one does not. A connect only:
    no request is sent, so nothing reaches the app's handlers."""
    sent: dict[str, list[str]] = {}
    for route in cfg.routes:
        sent.setdefault(route.upstream, []).append(route.name)
    if cfg.passthrough != ():
        sent.setdefault(cfg.upstream.url, []).append("pass-through")
    within = min(cfg.upstream.timeout, UPSTREAM_CONNECT_WAIT)
    failed = False
    for url, names in sent.items():
        problem = await forwarder.reach(url, within)
        failed = failed or bool(problem)
        what = logs.printable(problem) if problem else "takes connections"
        out.write(f"{'FAIL' if problem else 'ok  '} {url} ({', '.join(names)}): {what}\n")
    return 1 if failed else 0
