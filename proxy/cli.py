"""The ``dedup-proxy`` command.

Exit codes: 0 success; 1 the proxy could not start or failed (database unreachable…);
2 usage or configuration error. Configuration problems go to stderr, without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from proxy import (
    __version__,
    config,
    database,
    demo,
    embedded,
    errors,
    inbox_commands,
    logs,
    operations,
    preflight,
    server,
    supervisor,
    tracing,
)
from proxy.config import routes, values

log = logging.getLogger(__name__)
T = TypeVar("T")

EXIT_FAILURE = 1
EXIT_CONFIG = 2
CONFIG_ENV = "DEDUP_PROXY_CONFIG"


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        default=os.environ.get(CONFIG_ENV),
        help=f"YAML configuration file (default: ${CONFIG_ENV})",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedup-proxy",
        description="A sidecar reverse proxy that forwards each webhook event to your app once, "
        "using PostgreSQL as the lock.",
        epilog="Exit codes: 0 success, 1 failure (database unreachable, event not found), "
        "2 usage or configuration error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        if name != "demo":
            _config_option(sub)
        return sub

    command("serve", "run the proxy")
    check = command("check", "validate the configuration and print the resolved routes")
    check.add_argument(
        "--database",
        action="store_true",
        help="also connect to the database and check the claim table, the role's privileges "
        "and any pooler in between (exit status 1 if a check fails): the step before a rollout",
    )
    check.add_argument(
        "--upstream",
        action="store_true",
        help="also connect to each route's app (exit status 1 if one takes no connection): "
        "where the app runs, as in the proxy's pod, not in a migrate Job",
    )
    command("stats", "claims per route: rows, oldest, newest, retention")
    command("schema", "print the claim table's DDL (for create_schema: false deployments)")
    command("migrate", "create or upgrade the claim table")
    demo.add_arguments(command("demo", "see the proxy absorb duplicates, in one command"))
    events = command(
        "events",
        "list recent claims or forget some; inspect, redeliver or discard the deliveries "
        "a route with redeliver kept",
    )
    actions = events.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="recent claims of a route, newest first")
    listing.add_argument("--route", required=True, help="route name from the configuration")
    listing.add_argument(
        "--since", type=_duration, help="only claims newer than this (e.g. 1h, 30m, 2d)"
    )
    listing.add_argument(
        "--limit", type=_positive, default=50, help="at most this many (default 50)"
    )
    forgetting = actions.add_parser(
        "forget",
        help="release claims so a manual redelivery from the provider goes through",
        description="Delete the claims of these event IDs in the route's scope. The next "
        "delivery of each is forwarded to the app again.",
    )
    forgetting.add_argument("--route", required=True, help="route name from the configuration")
    forgetting.add_argument(
        "--scope", help="the claims' scope, for a route scoped by its path (events list shows it)"
    )
    forgetting.add_argument("event_ids", nargs="+", metavar="EVENT_ID")
    for sub in (
        listing,
        forgetting,
        *inbox_commands.add_arguments(actions, positive=_positive, duration=_duration),
    ):
        _config_option(sub)
    return parser


def _positive(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number, 1 or more; got {text!r}")
    return number


def _duration(text: str) -> float:
    try:
        return values.parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _describe(cfg: config.Config, source: str) -> str:
    db = cfg.database
    dsn = (
        f"embedded (data in {db.data_dir})"
        if db.dsn is None
        else config.redact_dsn(db.dsn.reveal())
    )
    lines = [
        f"configuration OK: {source}",
        f"listen:      {cfg.listen}",
        f"upstream:    {cfg.upstream.url} (timeout {cfg.upstream.timeout:g}s)",
        f"database:    {dsn}, table {db.table}, pool {db.pool_size}",
        f"claim_wait:  {cfg.claim_wait:g}s   shutdown_timeout: {cfg.shutdown_timeout:g}s",
        f"tracing:     {tracing.summary(os.environ)}",
        f"workers:     {cfg.workers}"
        + (
            f" (up to {cfg.workers * db.pool_size} database connections)" if cfg.workers > 1 else ""
        ),
        "routes:",
    ]
    for route in cfg.routes:
        ids = route.event_id if isinstance(route.event_id, tuple) else (route.event_id,)
        verify = f"verify {route.verify.scheme}" if route.verify else "NOT VERIFIED"
        details = [
            f"id {' + '.join(map(str, ids))}",
            f"type {route.event_type}" if route.event_type else "",
            f"scope {route.scope}"
            + ("/{" + "}/{".join(route.pattern.params) + "}" if route.scoped_by_path else ""),
            verify,
            f"retention {values.format_duration(route.retention)}",
            f"max_body {values.format_size(route.max_body)}",
            f"preset {route.preset}" if route.preset else "",
            "no ID: forwarded unclaimed" if route.forward_missing_id else "",
            "idempotency-key" if route.idempotency else "",
            f"per client ({' + '.join(map(str, route.scope_from))}, hashed)"
            if route.scope_from
            else "",
            f"duplicates replayed (up to {values.format_size(route.replay_max_body)})"
            if route.replay
            else "",
            _redelivered(route),
        ]
        lines.append(
            f"  {','.join(route.methods)} {route.path} -> {route.upstream}  [{route.name}]"
        )
        lines.append(f"       {', '.join(d for d in details if d)}")
    if cfg.passthrough is None:
        lines.append(f"  *    (any other path) -> {cfg.upstream.url}  [pass-through, no claim]")
    else:
        for prefix in cfg.passthrough:
            lines.append(f"  *    {prefix} (and below) -> {cfg.upstream.url}  [pass-through]")
        lines.append("  *    (any other path) -> 404")
    return "\n".join(lines)


def _redelivered(route: routes.RouteConfig) -> str:
    """How a route's failed deliveries are kept and sent again ("" when they are not)."""
    if route.redeliver is None:
        return ""
    schedule = "/".join(values.format_duration(s) for s in route.redeliver.schedule)
    within = values.format_duration(route.redeliver.for_)
    return f"failures kept, redelivered after {schedule} for {within}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return demo.main(args)
    if args.command == "schema":
        return _schema(args)
    cfg = _load(args)
    if cfg is None:
        return EXIT_CONFIG
    if args.command == "check":
        return _check(cfg, args)
    if args.command == "serve":
        return _serve(cfg, args.config)
    return _operate_command(cfg, args)


def _load(args: argparse.Namespace) -> config.Config | None:
    """The configuration ``--config`` names; None once the reason it cannot be had is said."""
    if not args.config:
        print(
            f"dedup-proxy {args.command}: no configuration; pass --config FILE or set {CONFIG_ENV}",
            file=sys.stderr,
        )
        return None
    # Only serve verifies signatures, and check shows what it would verify with: the other
    # commands (stats, migrate, events) run where the signing secrets may not be set.
    verifies = args.command in ("serve", "check")
    try:
        cfg = config.load(args.config, secrets=verifies)
        if verifies:
            tracing.summary(os.environ)  # the OTEL_* variables: refused before starting
    except errors.ConfigError as exc:
        print(exc, file=sys.stderr)
        return None
    return cfg


def _schema(args: argparse.Namespace) -> int:
    """The DDL for the configured claim table; without a configuration, the default table's."""
    table = config.DEFAULT_TABLE
    if args.config:
        cfg = _load(args)
        if cfg is None:
            return EXIT_CONFIG
        table = cfg.database.table
    print(database.schema_sql(table), end="")
    return 0


def _name(args: argparse.Namespace) -> str:
    return " ".join(filter(None, ("dedup-proxy", args.command, getattr(args, "action", None))))


def _operate_command(cfg: config.Config, args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_operate(cfg, args))
    except errors.ConfigError as exc:
        if exc.source.startswith("--"):  # a command-line argument, not the file
            print(f"{_name(args)}: {'; '.join(exc.problems)}", file=sys.stderr)
        else:
            print(exc, file=sys.stderr)
        return EXIT_CONFIG
    except errors.EmbeddedDatabaseError as exc:
        print(f"{_name(args)}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except errors.ProxyError as exc:
        print(f"{_name(args)}: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def _check(cfg: config.Config, args: argparse.Namespace) -> int:
    """The configuration as resolved; an embedded server that could not start is a
    configuration error here too, as for ``serve``; with ``--database``, the preflight, with
    ``--upstream`` each app's connection."""
    print(logs.mask(_describe(cfg, args.config)))
    if cfg.database.dsn is None and (problem := embedded.missing()):
        print(f"dedup-proxy check: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    failed = 0
    if args.database:
        print("database:")
        failed = _operate_command(cfg, args)
        if failed == EXIT_CONFIG:
            return failed
    if args.upstream:
        print("upstream:")
        failed = max(failed, asyncio.run(preflight.upstreams(cfg)))
    return failed


async def _operate(cfg: config.Config, args: argparse.Namespace) -> int:
    # The embedded server's "one machine only" warning is for `serve`, not for every command.
    logging.getLogger("proxy.embedded").setLevel(logging.ERROR)
    if args.command == "check":
        return await preflight.preflight(cfg)
    if args.command == "stats":
        return await operations.stats(cfg)
    if args.command == "migrate":
        return await operations.migrate(cfg)
    return await _events(cfg, args)


async def _events(cfg: config.Config, args: argparse.Namespace) -> int:
    route, action = args.route, args.action
    if action == "list":
        return await operations.list_events(cfg, route, args.since, args.limit)
    if action == "forget":
        return await operations.forget(cfg, route, args.event_ids, scope=args.scope)
    if action in (database.InboxState.PENDING, database.InboxState.DEAD):
        return await inbox_commands.listing(cfg, route, database.InboxState(action), args.limit)
    if action == "show":
        return await inbox_commands.show(cfg, route, args.event_id, scope=args.scope,
                                         body=args.body)  # fmt: skip
    if action == "redeliver":
        return await inbox_commands.redeliver(
            cfg, route, args.event_ids, scope=args.scope, since=args.since,
            every=(database.InboxState.DEAD if args.dead else
                   database.InboxState.PENDING if args.pending else None),
        )  # fmt: skip
    return await inbox_commands.discard(cfg, route, args.event_ids, scope=args.scope)


def _run(main: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when it is installed (the ``fast`` extra), else on asyncio's own loop."""
    run: Callable[[Coroutine[Any, Any, T]], T]
    try:
        import uvloop
    except ImportError:
        # Not run inside this block: a failure while serving would print the ImportError
        # first, as its context.
        run = asyncio.run
    else:
        run = uvloop.run
    return run(main)


def _serve(cfg: config.Config, config_path: str) -> int:
    worker = supervisor.worker_number()
    logs.setup(cfg.log, worker=worker)
    try:
        if worker is None and cfg.workers > 1:
            return _run(supervisor.supervise(cfg, config_path))
        if worker is not None:
            cfg = supervisor.worker_config(cfg)
        _run(
            server.serve(
                cfg,
                worker=worker,
                on_listening=supervisor.report_listening,
                lifeline=supervisor.lifeline(),
                config_path=config_path,
            )
        )
    except errors.EmbeddedDatabaseError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    except (errors.StartTimedOut, errors.NotPrepared) as exc:
        # Possibly after listening (a start during an outage): a worker's supervisor stops
        # every worker on this code, rather than start another to wait again.
        log.error("cannot start: %s", exc)
        return EXIT_FAILURE if worker is None else supervisor.EXIT_START_FAILED
    except errors.ProxyError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_FAILURE
    return 0
