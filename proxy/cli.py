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

from proxy import __version__, config, errors, logs, server

log = logging.getLogger(__name__)

EXIT_FAILURE = 1
EXIT_CONFIG = 2
CONFIG_ENV = "DEDUP_PROXY_CONFIG"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dedup-proxy",
        description="A sidecar reverse proxy that forwards each webhook event to your app once, "
        "using PostgreSQL as the lock.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (
        ("serve", "run the proxy"),
        ("check", "validate the configuration and print the resolved routes"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument(
            "--config",
            "-c",
            default=os.environ.get(CONFIG_ENV),
            help=f"YAML configuration file (default: ${CONFIG_ENV})",
        )
    return parser


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
        "routes:",
    ]
    for route in cfg.routes:
        ids = route.event_id if isinstance(route.event_id, tuple) else (route.event_id,)
        verify = f"verify {route.verify.scheme}" if route.verify else "NOT VERIFIED"
        details = [
            f"id {' + '.join(map(str, ids))}",
            f"type {route.event_type}" if route.event_type else "",
            f"scope {route.scope}",
            verify,
            f"retention {route.retention / 86400:g}d",
            f"max_body {route.max_body}",
            f"preset {route.preset}" if route.preset else "",
            "no ID: forwarded unclaimed" if route.forward_missing_id else "",
        ]
        lines.append(f"  POST {route.path} -> {route.upstream}  [{route.name}]")
        lines.append(f"       {', '.join(d for d in details if d)}")
    lines.append(f"  *    (any other path) -> {cfg.upstream.url}  [pass-through, no claim]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.config:
        print(
            f"dedup-proxy {args.command}: no configuration; pass --config FILE or set {CONFIG_ENV}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        cfg = config.load(args.config)
    except errors.ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "check":
        print(_describe(cfg, args.config))
        return 0
    logs.setup(cfg.log)
    try:
        asyncio.run(server.serve(cfg))
    except errors.EmbeddedDatabaseError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    except errors.ProxyError as exc:
        log.error("cannot start: %s", exc)
        return EXIT_FAILURE
    return 0
