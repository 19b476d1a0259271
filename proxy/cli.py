"""The ``dedup-proxy`` command: its parsers, each with its action attached, and the one path
every command takes (``execute_command``: the action, then the exit ladder).

Exit codes: 0 success; 1 the proxy could not start or failed (database unreachable…);
2 usage or configuration error; 130 Ctrl-C. Usage and configuration problems go to stderr,
without a traceback; ``serve`` logs its failures.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from proxy import (
    __version__,
    app_limit,
    config,
    database,
    demo,
    embedded,
    errors,
    inbox_commands,
    logs,
    operations,
    preflight,
    reconciler,
    server,
    supervisor,
    tracing,
)
from proxy.config import routes, values

log = logging.getLogger(__name__)
T = TypeVar("T")
# A command's action (``execute_command`` runs it), and an operator command's work.
Action = Callable[[argparse.Namespace], int]
Operation = Callable[[config.Config, argparse.Namespace], Coroutine[Any, Any, int]]

EXIT_FAILURE = 1
EXIT_USAGE = 2  # a usage or configuration error, as argparse's own
EXIT_INTERRUPTED = 130
CONFIG_ENV = "DEDUP_PROXY_CONFIG"


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        default=os.environ.get(CONFIG_ENV),
        help=f"YAML configuration file (default: ${CONFIG_ENV})",
    )


def _parser() -> argparse.ArgumentParser:
    """Every command's parser, each with its action attached (``func``: ``execute_command``
    runs it) and how it says a failure (``starts``: it runs the proxy, so a failure is that it
    cannot start; ``logged``: in the log it sets up, not on stderr)."""
    parser = argparse.ArgumentParser(
        prog="dedup-proxy",
        description="A sidecar reverse proxy that forwards each webhook event to your app once, "
        "using PostgreSQL as the lock.",
        epilog="Exit codes: 0 success, 1 failure (database unreachable, event not found), "
        "2 usage or configuration error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str,
        text: str,
        func: Action | None = None,  # none for events: each of its actions has its own
        *,
        starts: bool = False,
        logged: bool = False,
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=text, description=text)
        if func is not None:
            sub.set_defaults(func=func, starts=starts, logged=logged)
        if name != "demo":
            _config_option(sub)
        return sub

    command("serve", "run the proxy", _serve, starts=True, logged=True)
    check = command("check", "validate the configuration and print the resolved routes", _check)
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
    _json_option(
        command(
            "stats",
            "claims per route: rows, pending and dead deliveries, oldest, newest, retention",
            _operator(lambda cfg, args: operations.stats(cfg, as_json=args.json)),
        )
    )
    schema = command(
        "schema",
        "print the claim table's DDL (for create_schema: false deployments), and the "
        "receipts' where routes with receipt keep them in the claim database",
        _schema,
    )
    schema.add_argument(
        "--receipts",
        action="store_true",
        help="print only the receipts' table and function (for the database receipt.dsn names)",
    )
    command(
        "migrate",
        "create or upgrade the claim table, and the receipts' table in each receipts' database",
        # The one operator command that reads receipt.dsn: it makes the receipts' table there.
        lambda args: _operate(operations.migrate(_load(args, receipts=True))),
    )
    demo.add_arguments(
        command("demo", "see the proxy absorb duplicates, in one command", demo.main, starts=True)
    )
    events = command(
        "events",
        "list recent claims or forget some; inspect, redeliver or discard the deliveries "
        "a route with redeliver kept",
    )
    _event_actions(events.add_subparsers(dest="action", required=True, metavar="ACTION"))
    return parser


def _event_actions(actions: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The parsers of ``events``' actions, each with ``--route``, then its own arguments, then
    ``--config``, and its action attached."""
    built = []

    def action(
        name: str,
        text: str,
        func: Operation,
        description: str | None = None,
        *,
        every_route: bool = False,
    ) -> argparse.ArgumentParser:
        sub = actions.add_parser(name, help=text, description=description)
        sub.set_defaults(func=_operator(func), starts=False, logged=False)
        sub.add_argument(
            "--route",
            required=not every_route,
            help="route name from the configuration"
            + ("; without it, every route's" if every_route else ""),
        )
        built.append(sub)
        return sub

    _claim_actions(action)
    _kept_actions(action)
    _delivery_actions(action)
    _hold_actions(action)
    _reconcile_action(action)
    for sub in built:
        _config_option(sub)


_SCOPE_HELP = "the event's scope, for a route scoped by its path (events pending shows it)"


def _claim_actions(action: Callable[..., argparse.ArgumentParser]) -> None:
    """``events list`` and ``forget`` (``operations``): the claims themselves."""
    listing = action(
        "list",
        "recent claims of a route, newest first",
        lambda cfg, args: operations.list_events(
            cfg, args.route, args.since, args.limit, as_json=args.json
        ),
    )
    listing.add_argument(
        "--since", type=_duration, help="only claims newer than this (e.g. 1h, 30m, 2d)"
    )
    listing.add_argument(
        "--limit", type=_positive, default=50, help="at most this many (default 50)"
    )
    _json_option(listing)
    forgetting = action(
        "forget",
        "release claims so a manual redelivery from the provider goes through",
        lambda cfg, args: operations.forget(cfg, args.route, args.event_ids, scope=args.scope),
        "Delete the claims of these event IDs in the route's scope. The next "
        "delivery of each is forwarded to the app again.",
    )
    forgetting.add_argument(
        "--scope", help="the claims' scope, for a route scoped by its path (events list shows it)"
    )
    forgetting.add_argument("event_ids", nargs="+", metavar="EVENT_ID")


def _kept_actions(action: Callable[..., argparse.ArgumentParser]) -> None:
    """``events pending``, ``dead`` and ``blocked`` (``inbox_commands``): the deliveries a route
    with redeliver keeps, listed."""
    for state, text in (
        (
            database.InboxState.PENDING,
            "deliveries the app failed, waiting for a redelivery, oldest first",
        ),
        (
            database.InboxState.DEAD,
            "deliveries the redeliverer gave up on (or the app refused), oldest first",
        ),
    ):
        kept = action(
            state,
            text,
            lambda cfg, args: inbox_commands.listing(
                cfg, args.route, args.state, args.limit, as_json=args.json
            ),
            text,
            every_route=True,
        )
        kept.set_defaults(state=state)
        kept.add_argument(
            "--limit", type=_positive, default=50, help="at most this many (default 50)"
        )
        _json_option(kept)
    blocking = action(
        "blocked",
        "objects of a route with order held back by a pending delivery, oldest first",
        lambda cfg, args: inbox_commands.blocked(
            cfg, args.route, args.older_than, args.limit, as_json=args.json
        ),
        "Objects of a route with order whose oldest pending delivery (the head) holds later "
        "deliveries of the object behind it, oldest head first: the object, the head's event "
        "ID, since when it is pending, its state, attempts and last answer, and how many "
        "deliveries wait behind it. The head is sent, and the object freed, when the app takes "
        "it, or when it is discarded or dead.",
        every_route=True,
    )
    blocking.add_argument(
        "--older-than",
        type=_duration,
        default=0.0,
        help="only objects whose head has been pending this long (e.g. 10m; default: all)",
    )
    blocking.add_argument(
        "--limit", type=_positive, default=50, help="at most this many (default 50)"
    )
    _json_option(blocking)


def _delivery_actions(action: Callable[..., argparse.ArgumentParser]) -> None:
    """``events show``, ``redeliver`` and ``discard`` (``inbox_commands``): a kept delivery
    shown, or kept ones made due now or dropped."""
    showing = action(
        "show",
        "one event: its state, the request kept and every attempt",
        lambda cfg, args: inbox_commands.show(
            cfg, args.route, args.event_id, scope=args.scope, body=args.body, as_json=args.json
        ),
        "one event: its state, the request kept and every attempt",
    )
    showing.add_argument("--scope", help=_SCOPE_HELP)
    showing.add_argument(
        "--body", action="store_true", help="write only the kept body, as sent, to stdout"
    )
    _json_option(showing)
    showing.add_argument("event_id", metavar="EVENT_ID")
    redelivering = action(
        "redeliver",
        "make pending or dead deliveries due now, for a running proxy to redeliver",
        _bulk(inbox_commands.redeliver),
        "Make these pending or dead deliveries (or, with --dead or --pending, all of the "
        "route's in that state) due now, with the route's whole redeliver.for again. A running "
        "proxy's redeliverer sends them; this command sends nothing." + _BULK,
    )
    _bulk_options(redelivering, "now, not at its next due time (the app is back)")
    discarding = action(
        "discard",
        "drop pending or dead deliveries for good; their claims stay",
        _bulk(inbox_commands.discard),
        "Drop these pending or dead deliveries (or, with --dead or --pending, all of the "
        "route's in that state) and their bodies; they are not redelivered. Their claims stay, "
        "so the provider's copies are still answered as duplicates: to let a copy through to "
        "the app instead, use events forget." + _BULK,
    )
    _bulk_options(discarding, "")


def _reconcile_action(action: Callable[..., argparse.ArgumentParser]) -> None:
    """``events reconcile`` (``reconciler``): one run, with the route's API token read."""

    def reconcile(cfg: config.Config, args: argparse.Namespace) -> Coroutine[Any, Any, int]:
        return reconciler.command(cfg, args.route, since=args.since, dry_run=args.dry_run)

    reconciling = action(
        "reconcile",
        "read the provider's delivery log and recover what it failed and nothing claimed",
        reconcile,
        'One reconcile run over the route now (docs/how-it-works.md, "Reconcile"): the '
        "events the provider's log says were never delivered, each with its claim or none; "
        "those without one are recovered (GitHub: redelivered; Stripe: sent to the route, "
        "signed). Needs the route's API token.",
    )
    # The API token is a secret: this command reads the configuration with them.
    reconciling.set_defaults(
        func=lambda args: _operate(reconcile(_load(args, secrets=True, receipts=False), args))
    )
    reconciling.add_argument(
        "--since", type=_duration, help="look back this far (default: the route's since)"
    )
    reconciling.add_argument(
        "--dry-run", action="store_true", help="print what would be recovered; recover nothing"
    )


_BULK = (
    " With --dead or --pending, the rows are counted first (--dry-run: the count and the "
    "first rows, and nothing changed), then changed in batches, each committed on its own, "
    "with progress on stderr: Ctrl-C leaves each row changed or not, and the same command "
    "again continues with the rest."
)


def _bulk_options(sub: argparse.ArgumentParser, pending_help: str) -> None:
    """``events redeliver``'s and ``discard``'s: the IDs, or every row of the route in a state
    (``--dead``, ``--pending``, ``--since``, ``--dry-run``)."""
    sub.add_argument("--scope", help=_SCOPE_HELP + "; with --dead or --pending, narrows it")
    every = sub.add_mutually_exclusive_group()
    every.add_argument(
        "--dead",
        action="store_const",
        dest="every",
        const=database.InboxState.DEAD,
        help="every dead delivery of the route, not given IDs",
    )
    every.add_argument(
        "--pending",
        action="store_const",
        dest="every",
        const=database.InboxState.PENDING,
        help=f"every pending delivery of the route{' ' + pending_help if pending_help else ''}",
    )
    sub.add_argument(
        "--since",
        type=_duration,
        help="with --dead or --pending: only those that became so within this (e.g. 1h)",
    )
    sub.add_argument(
        "--dry-run",
        action="store_true",
        help="with --dead or --pending: print how many and the first of them; change nothing",
    )
    sub.add_argument("event_ids", nargs="*", metavar="EVENT_ID")


def _bulk(command: Callable[..., Coroutine[Any, Any, int]]) -> Callable[..., Any]:
    """``events redeliver`` or ``discard``'s action: these event IDs, or every one in a
    state (``_bulk_options``)."""
    return lambda cfg, args: command(
        cfg, args.route, args.event_ids, scope=args.scope, every=args.every, since=args.since,
        dry_run=args.dry_run,
    )  # fmt: skip


def _json_option(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--json", action="store_true", help="print one JSON document (docs/operations.md)"
    )


def _hold_actions(action: Callable[..., argparse.ArgumentParser]) -> None:
    """``events pause`` and ``resume`` (``inbox_commands``)."""
    pausing = action(
        "pause",
        "hold a route's redeliveries on every replica, until resumed or for a while",
        lambda cfg, args: inbox_commands.pause(
            cfg, args.route, for_=args.for_, note=args.reason, by=args.by
        ),
        "Hold the route's redeliveries on every running proxy (a maintenance window, a bad "
        "deploy). A route without redeliver answers its webhooks 503 with Retry-After "
        "meanwhile. dedup-proxy stats lists the routes held.",
    )
    pausing.add_argument(
        "--for", dest="for_", type=_duration, help="end the pause after this (e.g. 2h)"
    )
    pausing.add_argument("--reason", help="why, shown with the hold")
    pausing.add_argument("--by", help="who pauses (default: the OS user)")
    resuming = action(
        "resume",
        "end a route's hold (a pause, or the app's Retry-After) on every replica",
        lambda cfg, args: inbox_commands.resume(cfg, args.route, by=args.by),
        "End the route's hold: every running proxy redelivers its pending deliveries again, "
        "within the limit at the app (a route with redeliver), or forwards its webhooks again "
        "(a route without, which kept none). Exit status 1 if it was not held.",
    )
    resuming.add_argument("--by", help="who resumes (default: the OS user)")


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
        f"upstream:    {cfg.upstream.url} (timeout {cfg.upstream.timeout:g}s, {_limit(cfg)})",
        f"database:    {dsn}, table {db.table}, pool {db.pool_size}",
        f"claim_wait:  {cfg.claim_wait:g}s   shutdown_timeout: {cfg.shutdown_timeout:g}s",
        f"tracing:     {tracing.summary(os.environ)}",
        f"workers:     {cfg.workers}"
        + (
            f" (up to {cfg.workers * db.pool_size} database connections)" if cfg.workers > 1 else ""
        ),
        f"admin:       {_admin(cfg.admin)}",
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
            _reconciled(route),
            _receipted(route),
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


def _admin(admin: config.AdminConfig) -> str:
    """Where the admin listener answers, and the console on it, as ``check`` shows it."""
    console = admin.console
    if not console.enabled:
        shown = "console off"
    else:
        who = "credentials asked" if console.credentials else "no credentials"
        acts = "actions on" if console.actions else "read-only"
        shown = f"console at http://{admin.listen}/console/ ({acts}, {who})"
    return f"{admin.listen}: /metrics, /healthz, /readyz; {shown}"


def _limit(cfg: config.Config) -> str:
    """The limit at the app, as ``check`` shows it."""
    keeps = any(route.redeliver for route in cfg.routes)
    each = app_limit.share(
        cfg.upstream.concurrency, cfg.workers, cfg.database.pool_size, keeps=keeps,
        shared=cfg.upstream.shared,
    )  # fmt: skip
    if cfg.upstream.concurrency is None:
        return f"at most {each} at once per worker: what the pool allows"
    if cfg.upstream.shared:
        return (
            f"at most {cfg.upstream.concurrency} at once held by every replica together "
            f"(shared), {each} per worker at most"
        )
    return f"at most {cfg.upstream.concurrency} at once per replica, {each} per worker"


def _redelivered(route: routes.RouteConfig) -> str:
    """How a route's failed deliveries are kept and sent again ("" when they are not)."""
    if route.redeliver is None:
        return ""
    schedule = "/".join(values.format_duration(s) for s in route.redeliver.schedule)
    within = values.format_duration(route.redeliver.for_)
    hand_off = (
        f", handed off after {values.format_duration(route.hand_off)}" if route.hand_off else ""
    )
    return f"failures kept, redelivered after {schedule} for {within}{hand_off}"


def _receipted(route: routes.RouteConfig) -> str:
    """Where a route's app writes its receipts ("" without ``receipt``)."""
    if route.receipt is None:
        return ""
    where = "the claim database" if route.receipt.dsn is None else "receipt.dsn (masked)"
    return f"receipt: the app writes Dedup-Receipt in {where}"


def _reconciled(route: routes.RouteConfig) -> str:
    """Which provider log a route reconciles against, and with what credential: named, never
    shown ("" when it does not reconcile)."""
    settings = route.reconcile
    if settings is None:
        return ""
    every = (
        f"every {values.format_duration(settings.every)} over "
        f"{values.format_duration(settings.since)}"
    )
    if settings.provider == "stripe":
        return f"reconcile stripe events -> {settings.deliver_to} {every} (key (masked))"
    if settings.provider == "paddle":
        return (f"reconcile paddle notifications of {settings.notification_setting_id} {every} "
                "(API key (masked))")  # fmt: skip
    if settings.provider == "paypal":
        return (f"reconcile paypal events -> webhook {settings.webhook_id} {every} "
                f"(client {settings.client_id}, secret (masked))")  # fmt: skip
    credential = (
        "token (masked)" if settings.app is None else f"App {settings.app}'s JWT, key (masked)"
    )
    return f"reconcile {settings.hook} {every} ({credential})"


def main(argv: list[str] | None = None) -> int:
    return execute_command(_parser().parse_args(argv))


def execute_command(args: argparse.Namespace) -> int:
    """The one path of every command: the action attached to its parser (``args.func``), and
    the exit ladder for what it lets out."""
    return _exit_status(args, functools.partial(args.func, args))


def _exit_status(args: argparse.Namespace, action: Callable[[], int]) -> int:
    """The exit ladder: ``action``'s exit status, or the one of the error it raised, said once.

    A usage or configuration error is the operator's, on stderr: exit status 2. A failure
    while running is said as the command says failures (``_failed``): exit status 2 for an
    embedded server that cannot start, 1 for anything else, 130 for Ctrl-C."""
    try:
        return action()
    except errors.ConfigError as exc:
        print(exc, file=sys.stderr)  # names the file and lists its problems, a line each
        return EXIT_USAGE
    except errors.UsageError as exc:
        print(f"{_name(args)}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except errors.EmbeddedDatabaseError as exc:
        _failed(args, str(exc))
        return EXIT_USAGE
    except errors.ProxyError as exc:
        _failed(args, f"cannot start: {exc}" if args.starts else str(exc))
        return EXIT_FAILURE
    except KeyboardInterrupt:
        _failed(args, "interrupted")
        return EXIT_INTERRUPTED


def _failed(args: argparse.Namespace, text: str) -> None:
    """A failure said: in the log for ``serve`` (JSON where the logs are collected), else on
    stderr after the command's name."""
    if args.logged:
        log.error("%s", text)
    else:
        print(f"{_name(args)}: {text}", file=sys.stderr)


def _name(args: argparse.Namespace) -> str:
    return " ".join(filter(None, ("dedup-proxy", args.command, getattr(args, "action", None))))


def _load(
    args: argparse.Namespace, *, secrets: bool = False, receipts: bool | None = None
) -> config.Config:
    """The configuration ``--config`` names; with ``secrets`` (for serve, and check, which
    shows what it would verify with) the signing secrets and the ``OTEL_*`` variables too: the
    other commands run where those may not be set; with ``receipts`` (by default: as
    ``secrets``; migrate) the routes' ``receipt.dsn``, which only they use."""
    if not args.config:
        raise errors.UsageError(f"no configuration; pass --config FILE or set {CONFIG_ENV}")
    cfg = config.load(args.config, secrets=secrets, receipts=receipts)
    if secrets:
        tracing.summary(os.environ)  # the OTEL_* variables: refused before starting
    return cfg


def _schema(args: argparse.Namespace) -> int:
    """The DDL for the configured claim table (without a configuration, the default table's),
    then the receipts' where a route keeps them in the claim database; with ``--receipts``, the
    receipts' alone. A route whose receipts are in its ``receipt.dsn`` is named in a comment."""
    cfg = _load(args) if args.config else None
    receipted = [] if cfg is None else [r for r in cfg.routes if r.receipt is not None]
    here = [r.name for r in receipted if r.receipt is not None and r.receipt.dsn is None]
    elsewhere = [r.name for r in receipted if r.receipt is not None and r.receipt.dsn]
    if args.receipts:
        print(_receipts_sql(), end="")
        return 0
    print(database.schema_sql(cfg.database.table if cfg else config.DEFAULT_TABLE), end="")
    if here:
        print(f"-- The receipts (route {', '.join(here)}: receipt), in the claim database:")
        print(_receipts_sql(), end="")
    if elsewhere:
        where = "its receipt.dsn: apply 'dedup-proxy schema --receipts' there."
        print(f"-- Route {', '.join(elsewhere)} keeps its receipts in {where}")
    return 0


def _receipts_sql() -> str:
    """The receipts' table and function (``database.receipts``), with the grants they need as
    comments, the roles placeholders (docs/deployment.md, "The receipts' database")."""
    table, function = database.receipts.TABLE, database.receipts.FUNCTION
    return "".join(f"{statement};\n" for statement in database.receipts.DDL) + (
        "-- Then, <proxy_role> and <app_role> being the roles' names:\n"
        f"--   GRANT SELECT, INSERT, DELETE ON {table} TO <proxy_role>;\n"
        f"--   GRANT INSERT ON {table} TO <app_role>;\n"
        f"--   GRANT EXECUTE ON FUNCTION {function}(text) TO <app_role>;\n"
    )


def _check(args: argparse.Namespace) -> int:
    """The configuration as resolved; an embedded server that could not start is a
    configuration error here too, as for ``serve``; with ``--database``, the preflight (a
    failure there is said and the upstreams still checked), with ``--upstream`` each app's
    connection."""
    cfg = _load(args, secrets=True)
    print(logs.mask(_describe(cfg, args.config)))
    if cfg.database.dsn is None and (problem := embedded.missing()):
        raise errors.EmbeddedDatabaseError(problem)
    failed = 0
    if args.database:
        print("database:")
        failed = _exit_status(args, lambda: _operate(preflight.preflight(cfg)))
        if failed == EXIT_USAGE:
            return failed
    if args.upstream:
        print("upstream:")
        failed = max(failed, asyncio.run(preflight.upstreams(cfg)))
    return failed


def _operator(operation: Operation) -> Action:
    """An operator command's action: ``operation`` over the configuration loaded without the
    signing secrets."""
    return lambda args: _operate(operation(_load(args), args))


def _operate(operation: Coroutine[Any, Any, int]) -> int:
    """An operator command's work, on an event loop of its own."""
    # The embedded server's "one machine only" warning is for `serve`, not for every command.
    logging.getLogger("proxy.embedded").setLevel(logging.ERROR)
    return asyncio.run(operation)


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


def _serve(args: argparse.Namespace) -> int:
    cfg = _load(args, secrets=True)
    worker = supervisor.WorkerEnvironment.from_environ()  # None but in a supervisor's worker
    logs.setup(cfg.log, worker=None if worker is None else worker.number)
    if worker is None:
        if cfg.workers > 1:
            return _run(supervisor.supervise(cfg, args.config))
        _run(server.serve(cfg, config_path=args.config))
        return 0
    try:
        _run(
            server.serve(
                worker.config(cfg),
                worker=worker.number,
                handed=worker.listeners,
                on_listening=worker.report_listening,
                lifeline=worker.lifeline,
                config_path=args.config,
            )
        )
    except (errors.StartTimedOut, errors.NotPrepared) as exc:
        # Possibly after listening (a start during an outage): the supervisor stops every
        # worker on this status, rather than start another to wait again.
        log.error("cannot start: %s", exc)
        return supervisor.EXIT_START_FAILED
    return 0
