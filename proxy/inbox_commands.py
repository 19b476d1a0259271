"""The inbox's operator commands: ``events pending``, ``dead``, ``show``, ``redeliver`` and
``discard``, over the rows a route with ``redeliver`` keeps (``proxy.database.inbox``); and
``events pause`` and ``resume``, which hold and release a route's scope on every replica
(``proxy.database.holds``).

Each opens a store of one connection (``operations.open_store``), as the other operator
commands do. None sends anything to the app: ``redeliver`` makes rows due now, and a running
proxy's redeliverer sends them.
"""

from __future__ import annotations

import getpass
import io
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, TextIO

from proxy import config, database, errors, logs, operations
from proxy.config import values
from proxy.database import inbox

# Their values are credentials of the sender's session, not of the event: masked in ``show``.
# Signature headers are printed: they are the event's, and useless without the secret.
MASKED_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
LAST_ERROR_WIDTH = 60
_LISTED = ("received_at", "scope", "event_id", "event_type", "attempts", "last")


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone(UTC).isoformat(timespec="seconds")


def _last(status: int | None, error: str | None) -> str:
    """The last attempt, in a column: the app's status, else what went wrong, shortened."""
    if status is not None:
        return str(status)
    if not error:
        return "-"
    text = " ".join(error.split())
    return text if len(text) <= LAST_ERROR_WIDTH else text[: LAST_ERROR_WIDTH - 1] + "…"


async def listing(
    cfg: config.Config,
    route: str,
    state: inbox.InboxState,
    limit: int,
    out: TextIO = sys.stdout,
) -> int:
    """The oldest ``limit`` rows of the route (all its scopes) in ``state``, pending or dead."""
    scope = operations.route_scope(cfg, route)
    async with operations.open_store(cfg) as store:
        rows, total = await store.inbox.kept(scope, state, limit)
    pending = state == inbox.InboxState.PENDING
    headers = (*_LISTED, *(("next_due",) if pending else ()), "body_bytes")
    operations.table(
        [
            (
                _when(r.received_at), r.scope, r.event_id, r.event_type or "-", r.attempts,
                _last(r.last_status, r.last_error), *((_when(r.due),) if pending else ()),
                "-" if r.body_bytes is None else r.body_bytes,
            )
            for r in rows
        ],
        headers,
        out,
    )  # fmt: skip
    what = f"{state} delivery(ies) in scope {scope}"
    if total > len(rows):
        out.write(f"showing the {len(rows)} oldest of {total} {what}\n")
    else:
        out.write(f"{len(rows)} {what}\n")
    return 0


async def show(
    cfg: config.Config,
    route: str,
    event_id: str,
    *,
    scope: str | None = None,
    body: bool = False,
    out: TextIO = sys.stdout,
    raw: BinaryIO | None = None,
) -> int:
    """Everything stored about one event (its ID as the provider sent it or as stored,
    ``operations.resolve``); with ``body``, only its kept body, as sent (to ``raw``, stdout's
    bytes by default). Exit 1 if there is no such event (or no body), or the ID is several
    (listed)."""
    scope = operations.exact_scope(operations.route_of(cfg, route), scope)
    async with operations.open_store(cfg) as store:
        found = await operations.resolve(store, scope, [event_id])
        stored = found.stored.get(event_id)
        shown = None if stored is None else await store.inbox.show(scope, stored)
    if shown is None:
        print(found.problems.get(event_id, f"not found: {scope} {event_id}"), file=sys.stderr)
        return 1
    if not body:
        out.write(describe(shown))
        return 0
    if shown.request is None or shown.body_bytes is None:
        print(f"no body kept: {scope} {event_id} ({_state(shown)})", file=sys.stderr)
        return 1
    target = raw if raw is not None else sys.stdout.buffer
    target.write(shown.request.body)
    target.flush()
    return 0


def _state(shown: inbox.Shown) -> str:
    return shown.state or "delivered at the first try"


def describe(shown: inbox.Shown) -> str:
    """``events show``'s block: the event (its ID as the provider sent it, and the claim's as
    stored where that differs), its state, the request kept and every attempt."""
    event_id = database.unbound(shown.event_id)
    fields = [
        ("event", event_id),
        *((("claim", shown.event_id),) if event_id != shown.event_id else ()),
        ("scope", shown.scope),
        ("type", shown.event_type or "-"),
        ("received_at", _when(shown.received_at)),
        ("state", _state(shown)),
        *((("next due", _when(shown.due)),) if shown.due else ()),
        *((("until", _when(shown.until)),) if shown.until else ()),
        *((("changed", _when(shown.changed)),) if shown.changed else ()),
    ]
    text = io.StringIO()
    for name, value in fields:
        text.write(f"{name + ':':<13}{value}\n")
    if shown.request is not None:
        text.write(_request(shown.request, shown.body_bytes, shown.state))
    elif shown.state is None:
        text.write("request:     not kept (delivered at the first try)\n")
    else:
        text.write(f"request:     dropped ({shown.state}), headers and body\n")
    text.write(_attempts(shown.attempts))
    return text.getvalue()


def _request(delivery: inbox.StoredRequest, body_bytes: int | None, state: str | None) -> str:
    lines = [
        f"request:     {delivery.method} {logs.printable(delivery.target)}",
        f"upstream:    {delivery.upstream}",
        f"route:       {delivery.route}",
        "headers:",
    ]
    # What a client sent, shown to an operator's terminal: escaped as the log lines are.
    for name, value in delivery.headers:
        if name.lower() in MASKED_HEADERS:
            shown = f"<redacted {len(value.encode('utf-8', 'surrogateescape'))} bytes>"
        else:
            shown = logs.printable(value)
        lines.append(f"  {logs.printable(name)}: {shown}")
    kept = f"dropped ({state})" if body_bytes is None else f"{body_bytes} bytes"
    lines.append(f"body:        {kept}")
    return "\n".join(lines) + "\n"


def _attempts(attempts: Sequence[dict[str, Any]]) -> str:
    if not attempts:
        return "attempts:    none recorded\n"
    rows = []
    for attempt in attempts:
        try:
            at = _when(datetime.fromisoformat(attempt["at"]))
        except (TypeError, ValueError):
            at = str(attempt.get("at"))
        status = attempt.get("status")
        error = logs.printable(str(attempt.get("error") or "-"))
        rows.append((at, "-" if status is None else status, error))
    text = io.StringIO()
    operations.table(rows, ("at", "status", "error"), text)
    indented = "".join(f"  {line}\n" for line in text.getvalue().splitlines())
    return f"attempts:    {len(attempts)}\n{indented}"


async def redeliver(
    cfg: config.Config,
    route: str,
    event_ids: Sequence[str],
    *,
    scope: str | None = None,
    every: inbox.InboxState | None = None,
    since: float | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Make these deliveries (or, with ``every`` "dead" or "pending", all of the route's in
    that state, changed at most ``since`` seconds ago) due now, with the route's whole ``for``
    again. Exit 1 if an ID was not pending or dead (or its body is gone)."""
    found = operations.route_of(cfg, route)
    if bool(event_ids) == (every is not None):
        raise errors.UsageError("give event IDs, --dead or --pending: one of them")
    if since is not None and every is None:
        raise errors.UsageError("--since goes with --dead or --pending only")
    if found.redeliver is None:
        raise errors.UsageError(f"route {route!r} has no redeliver: nothing would redeliver it")
    narrowed = operations.narrowed_scope if every else operations.exact_scope
    scope = narrowed(found, scope)
    after = datetime.now(UTC) - timedelta(seconds=since) if since is not None else None
    async with operations.open_store(cfg) as store:
        named = await operations.resolve(store, scope, event_ids)
        changed = await store.inbox.redeliver(
            scope, None if every else list(named.stored.values()), after,
            found.redeliver.for_, every or inbox.InboxState.DEAD,
        )  # fmt: skip
    done = set(changed)
    if every:
        for row in sorted(done):
            out.write(f"redelivering: {row[0]} {row[1]}\n")
        if not changed:
            out.write(f"no {every} deliveries in scope {scope}\n")
            return 0
    else:
        named.report(event_ids, {row[1] for row in done}, "redelivering", out)
    out.write(
        f"{len(changed)} delivery(ies) due now; the redeliverer takes them within its poll "
        "interval\n"
    )
    return 0 if every or named.all_done({row[1] for row in done}) else 1


async def discard(
    cfg: config.Config,
    route: str,
    event_ids: Sequence[str],
    *,
    scope: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Drop these pending or dead deliveries for good; their claims stay. Exit 1 if some were
    not pending or dead (or an ID named several claims, listed)."""
    scope = operations.exact_scope(operations.route_of(cfg, route), scope)
    async with operations.open_store(cfg) as store:
        named = await operations.resolve(store, scope, event_ids)
        discarded = await store.inbox.discard(scope, list(named.stored.values()))
    named.report(event_ids, discarded, "discarded", out)
    return 0 if named.all_done(discarded) else 1


def operator() -> str:
    """Who runs this command, as a hold records it: the OS user."""
    try:
        return getpass.getuser()
    except OSError:  # no USER and no passwd entry (a container's arbitrary UID)
        return f"uid {os.getuid()}"


async def pause(
    cfg: config.Config,
    route: str,
    *,
    for_: float | None = None,
    note: str | None = None,
    by: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Hold the route's scope on every replica, for ``for_`` seconds (None: until resumed),
    replacing any hold it had."""
    found = operations.route_of(cfg, route)
    who = by or operator()
    async with operations.open_store(cfg) as store:
        hold = await store.holds.hold(found.scope, for_, by=who, note=note)
    out.write(f"paused: {operations.describe_hold(found.scope, hold)}\n")
    sharing = [r.name for r in cfg.routes if r.scope == found.scope and r.name != found.name]
    if sharing:
        out.write(f"routes {', '.join(sharing)} share scope {found.scope}: held too\n")
    if found.redeliver is None:
        out.write(
            f"route {found.name} has no redeliver: while paused its webhooks are answered 503 "
            "with Retry-After, and the provider sends them again later\n"
        )
    wait = values.format_duration(cfg.redeliverer.poll)
    out.write(f"every running proxy holds it within {wait} (redeliverer.poll)\n")
    return 0


async def resume(
    cfg: config.Config, route: str, *, by: str | None = None, out: TextIO = sys.stdout
) -> int:
    """End the route scope's hold (a pause, or the app's Retry-After) on every replica. Exit 1
    if it held none."""
    found = operations.route_of(cfg, route)
    async with operations.open_store(cfg) as store:
        was = await store.holds.release(found.scope, by=by or operator())
    if was is None:
        print(f"not held: route {found.name} (scope {found.scope})", file=sys.stderr)
        return 1
    wait = values.format_duration(cfg.redeliverer.poll)
    out.write(
        f"resumed: route {found.name} (scope {found.scope}), {was} until now; every running "
        f"proxy redelivers its pending deliveries again within {wait}, at the limit at the app\n"
    )
    return 0
