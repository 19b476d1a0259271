"""The inbox's operator commands: ``events pending``, ``dead``, ``blocked``, ``show``,
``redeliver`` and ``discard``, over the rows a route with ``redeliver`` keeps
(``proxy.database.inbox``); and ``events pause`` and ``resume``, which hold and release a
route's scope on every replica (``operations.pause_route``, as the console does).

Each opens a store of one connection (``operations.open_store``), as the other operator
commands do. None sends anything to the app: ``redeliver`` makes rows due now, and a running
proxy's redeliverer sends them. ``redeliver`` and ``discard`` of every row in a state count
first and change the rows in batches each committed on its own (``_bulk``); the listings and
``show`` print one JSON document with ``--json``. A row's state, times, headers and attempts
are worded as the console words them (``presenting``).
"""

from __future__ import annotations

import asyncio
import io
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, BinaryIO, NamedTuple, TextIO, TypeVar

from proxy import config, database, errors, logs, operations, presenting
from proxy.config import routes, values
from proxy.database import inbox

T = TypeVar("T")

# events pending's and dead's lines: a wider one narrows its last answer and event type ("…").
TABLE_WIDTH = 120
_DUE_NOW = "delivery(ies) due now; the redeliverer takes them within its poll interval"
# How many of the rows a dry run lists.
SAMPLE = 10
_LISTED = ("received_at", "scope", "event_id", "event_type", "attempts", "last")


async def listing(
    cfg: config.Config,
    route: str | None,
    state: inbox.InboxState,
    limit: int,
    *,
    as_json: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """The oldest ``limit`` rows in ``state``, pending or dead, of the route (all its scopes),
    or of every route when ``route`` is None."""
    scopes = _scopes(cfg, route)
    async with operations.open_store(cfg) as store:
        rows, total = await _each_scope(scopes, lambda scope: store.inbox.kept(scope, state, limit))
    rows = sorted(rows, key=lambda r: (r.received_at, r.scope, r.event_id))[:limit]
    if as_json:
        out.write(operations.json_document({
            "state": state.value, "scopes": scopes, "total": total,
            "deliveries": [_listed_json(r) for r in rows],
        }))  # fmt: skip
        return 0
    _table(rows, state == inbox.InboxState.PENDING, out)
    what = f"{state} delivery(ies) in scope {', '.join(scopes) if scopes else '-'}"
    if total > len(rows):
        out.write(f"showing the {len(rows)} oldest of {total} {what}\n")
    else:
        out.write(f"{len(rows)} {what}\n")
    return 0


def _scopes(cfg: config.Config, route: str | None) -> list[str]:
    """The route's scope, or every route's (each once, and none inside another's)."""
    if route is not None:
        return [operations.route_scope(cfg, route)]
    every = list(dict.fromkeys(r.scope for r in cfg.routes))
    return [s for s in every if not any(s != o and operations.in_scope(s, o) for o in every)]


async def _each_scope(
    scopes: Sequence[str], read: Callable[[str], Awaitable[tuple[list[T], int]]]
) -> tuple[list[T], int]:
    """``read`` of each scope (its rows, up to a limit, and how many there are), put together."""
    rows: list[T] = []
    total = 0
    for scope in scopes:
        found, count = await read(scope)
        rows += found
        total += count
    return rows, total


def _table(rows: Sequence[inbox.Listed], pending: bool, out: TextIO) -> None:
    """Kept rows as ``events pending``/``dead`` list them, a line each, the ID as the provider
    sent it (the commands take it; the claim's, bound to the body, is in ``events show`` and
    ``--json``), whole. Wider than ``TABLE_WIDTH`` (a GitHub ID, a long answer), the event
    type is cut ("…") and the last answer and next due time go on an indented line of their
    own under each row."""
    headers = (*_LISTED, *(("next_due",) if pending else ()), "body_bytes")
    cells = [
        (
            presenting.when(r.received_at), r.scope, database.unbound(r.event_id),
            r.event_type or "-", r.attempts, presenting.last(r.last_status, r.last_error),
            *((presenting.when(r.due),) if pending else ()),
            "-" if r.body_bytes is None else r.body_bytes,
        )
        for r in rows
    ]  # fmt: skip
    text = io.StringIO()
    operations.table(cells, headers, text, width=TABLE_WIDTH, shrink=("event_type",))
    if max(map(len, text.getvalue().splitlines())) <= TABLE_WIDTH:
        out.write(text.getvalue())
        return
    narrow = [i for i, name in enumerate(headers) if name not in ("last", "next_due")]
    text = io.StringIO()
    operations.table(
        [[row[i] for i in narrow] for row in cells],
        [headers[i] for i in narrow],
        text,
        width=TABLE_WIDTH,
        shrink=("event_type",),
    )
    lines = text.getvalue().splitlines()
    out.write(lines[0] + "\n")
    for line, row in zip(lines[1:], rows, strict=True):
        due = f"next due {presenting.when(row.due)}; " if pending else ""
        below = f"    {due}last: {logs.printable(presenting.last(row.last_status, row.last_error))}"
        cut = below if len(below) <= TABLE_WIDTH else below[: TABLE_WIDTH - 1] + "…"
        out.write(f"{line}\n{cut}\n")


def _listed_json(row: inbox.Listed) -> dict[str, Any]:
    return {
        "scope": row.scope, "event_id": row.event_id, "event_type": row.event_type,
        "received_at": operations.timestamp(row.received_at), "state": row.state,
        "attempts": row.attempts, "last_status": row.last_status, "last_error": row.last_error,
        "next_due": operations.timestamp(row.due), "body_bytes": row.body_bytes,
    }  # fmt: skip


async def blocked(
    cfg: config.Config,
    route: str | None,
    older_than: float,
    limit: int,
    *,
    as_json: bool = False,
    out: TextIO = sys.stdout,
) -> int:
    """The ``limit`` oldest blocked objects (``inbox.Blocked``) whose head has been pending
    at least ``older_than`` seconds, of the route, or of every route with ``order`` when
    ``route`` is None."""
    if route is not None and operations.route_of(cfg, route).order is None:
        raise errors.UsageError(f"route {route!r} has no order: its deliveries name no object")
    ordered = [r for r in cfg.routes if r.order is not None and route in (None, r.name)]
    scopes = [
        s for s in _scopes(cfg, None) if any(operations.in_scope(r.scope, s) for r in ordered)
    ]
    async with operations.open_store(cfg) as store:
        rows, total = await _each_scope(
            scopes, lambda scope: store.inbox.blocked(scope, older_than, limit)
        )
    rows = sorted(rows, key=lambda r: (r.since, r.scope, r.object))[:limit]
    if as_json:
        out.write(
            operations.json_document(
                {
                    "scopes": scopes,
                    "older_than_seconds": older_than,
                    "total": total,
                    "objects": [_blocked_json(r) for r in rows],
                }
            )
        )
        return 0
    operations.table(
        [
            (
                r.scope,
                r.object,
                database.unbound(r.head),
                r.event_type or "-",
                presenting.when(r.since),
                presenting.head_state(r, presenting.when),
                r.attempts,
                presenting.last(r.last_status, r.last_error),
                r.behind,
            )
            for r in rows
        ],
        (
            "scope",
            "object",
            "head",
            "event_type",
            "pending_since",
            "state",
            "attempts",
            "last",
            "behind",
        ),
        out,
    )
    what = f"blocked object(s) in scope {', '.join(scopes) if scopes else '-'}"
    if older_than:
        what += f", head pending for {values.format_duration(older_than)} or more"
    if total > len(rows):
        out.write(f"showing the {len(rows)} oldest of {total} {what}\n")
    else:
        out.write(f"{len(rows)} {what}\n")
    return 0


def _blocked_json(row: inbox.Blocked) -> dict[str, Any]:
    return {
        "scope": row.scope,
        "object": row.object,
        "head": database.unbound(row.head),
        "head_claim_id": row.head,
        "event_type": row.event_type,
        "pending_since": operations.timestamp(row.since),
        "at_app": row.at_app,
        "attempts": row.attempts,
        "last_status": row.last_status,
        "last_error": row.last_error,
        "next_due": operations.timestamp(row.due),
        "behind": row.behind,
    }


async def show(
    cfg: config.Config,
    route: str,
    event_id: str,
    *,
    scope: str | None = None,
    body: bool = False,
    as_json: bool = False,
    out: TextIO = sys.stdout,
    raw: BinaryIO | None = None,
) -> int:
    """Everything stored about one event (its ID as the provider sent it or as stored,
    ``operations.resolve``); with ``body``, only its kept body, as sent (to ``raw``, stdout's
    bytes by default). Exit 1 if there is no such event (or no body), or the ID is several
    (listed). With ``as_json``, the event as one JSON document (``shown_json``)."""
    if body and as_json:
        raise errors.UsageError("--body and --json: one of them")
    configured = operations.route_of(cfg, route)
    scope = operations.exact_scope(configured, scope)
    async with operations.open_store(cfg) as store:
        found = await operations.resolve(store, configured, scope, [event_id])
        stored = found.stored.get(event_id)
        shown = None if stored is None else await store.inbox.show(scope, stored)
    if shown is None:
        print(found.problems.get(event_id, f"not found: {scope} {event_id}"), file=sys.stderr)
        return 1
    now_to = None if shown.request is None else redelivered_to(cfg, shown.request)
    if as_json:
        out.write(operations.json_document(shown_json(shown, now_to)))
        return 0
    if not body:
        out.write(describe(shown, now_to))
        return 0
    if shown.request is None or shown.body_bytes is None:
        said = presenting.state(shown.state)
        print(f"no body kept: {scope} {event_id} ({said})", file=sys.stderr)
        return 1
    target = raw if raw is not None else sys.stdout.buffer
    target.write(shown.request.body)
    target.flush()
    return 0


def redelivered_to(cfg: config.Config, request: inbox.StoredRequest) -> str | None:
    """Where a redelivery of ``request`` goes now, as the redeliverer picks it: the upstream of
    its route in the configuration (which may have changed since it was first sent); None when
    the configuration has no route of that name (it goes to the upstream it was sent to)."""
    for route in cfg.routes:
        if route.name == request.route:
            return route.upstream
    return None


def describe(shown: inbox.Shown, now_to: str | None = None) -> str:
    """``events show``'s block: the event (its ID as the provider sent it, and the claim's as
    stored where that differs), its state and why it is so now (``Shown.reason``), the request
    kept (where it was sent, and where a redelivery goes now: ``now_to``, ``redelivered_to``)
    and every attempt with what the app answered. A dead row's schedule is over: no
    ``until``."""
    event_id = database.unbound(shown.event_id)
    why = shown.reason(presenting.when)
    fields = [
        ("event", event_id),
        *((("claim", shown.event_id),) if event_id != shown.event_id else ()),
        ("scope", shown.scope),
        ("type", shown.event_type or "-"),
        ("received_at", presenting.when(shown.received_at)),
        ("state", presenting.state(shown.state)),
        *((("why", why),) if why else ()),
        *((("next due", presenting.when(shown.due)),) if shown.due else ()),
        *(
            (("until", presenting.when(shown.until)),)
            if shown.until and shown.state != "dead"
            else ()
        ),
        *((("changed", presenting.when(shown.changed)),) if shown.changed else ()),
        *(_place(shown.place) if shown.place else ()),
    ]
    text = io.StringIO()
    for name, value in fields:
        text.write(f"{name + ':':<13}{logs.printable(value)}\n")
    if shown.request is not None:
        text.write(
            _request(shown.request, shown.body_bytes, shown.state, bool(shown.attempts), now_to)
        )
    elif shown.state is None:
        text.write(f"request:     not kept ({presenting.FIRST_TRY})\n")
    else:
        text.write(f"request:     dropped ({shown.state}), headers and body\n")
    text.write(_attempts(shown.attempts))
    return text.getvalue()


def _place(place: inbox.Place) -> list[tuple[str, str]]:
    """An ordered route's kept delivery: its object, and the delivery it is kept behind."""
    version = f"version {place.version or '-'}, accepted {place.accepted or '-'}"
    behind = (
        "none: first of its object (sent when its object is free)"
        if place.behind is None
        else f"{database.unbound(place.behind)}, pending since "
        f"{presenting.when(place.behind_since)}: sent first"
    )
    return [("object", f"{place.object} ({version})"), ("behind", behind)]


def shown_json(shown: inbox.Shown, now_to: str | None = None) -> dict[str, Any]:
    """``events show --json``: what ``describe`` shows, with stable keys (``upstream`` where the
    request was sent, ``redelivery_upstream`` where a redelivery goes now). The target and the
    header values are strings, or ``{"base64": …}`` for one holding bytes that are not UTF-8
    (as the inbox stores them); masked headers' values are ``null``, with their size."""
    request, place = shown.request, shown.place
    return {
        "event_id": database.unbound(shown.event_id), "claim_id": shown.event_id,
        "scope": shown.scope, "event_type": shown.event_type,
        "received_at": operations.timestamp(shown.received_at), "state": shown.state,
        "why": shown.reason(presenting.when),
        "next_due": operations.timestamp(shown.due), "until": operations.timestamp(shown.until),
        "changed": operations.timestamp(shown.changed),
        "request": None if request is None else {
            "method": request.method, "target": inbox.wire(request.target),
            "upstream": logs.mask(request.upstream),
            "redelivery_upstream": logs.mask(now_to or request.upstream),
            "route": request.route, "kept_for": request.kept_for,
            "headers": [_header_json(name, value) for name, value in request.headers],
            "body_bytes": shown.body_bytes,
        },
        "attempts": [_attempt_json(attempt) for attempt in shown.attempts],
        "object": None if place is None else {
            "key": place.object, "version": place.version, "accepted": place.accepted,
            "behind": None if place.behind is None else database.unbound(place.behind),
            "behind_since": operations.timestamp(place.behind_since),
        },
    }  # fmt: skip


def _header_json(name: str, value: str) -> dict[str, Any]:
    if presenting.masked(name):
        return {"name": name, "value": None, "redacted_bytes": presenting.size(value)}
    return {"name": name, "value": inbox.wire(value)}


def _attempt_json(attempt: dict[str, Any]) -> dict[str, Any]:
    """An attempt as kept, a masked header of the app's answer with its value ``null``."""
    if not attempt.get("headers"):
        return attempt
    headers = [[name, None if presenting.masked(name) else value]
               for name, value in attempt["headers"]]  # fmt: skip
    return {**attempt, "headers": headers}


def _request(
    delivery: inbox.StoredRequest,
    body_bytes: int | None,
    state: str | None,
    tried: bool,
    now_to: str | None,
) -> str:
    # An upstream's URL may carry a password (http://user:pass@app): masked, as check does.
    sent = logs.mask(delivery.upstream)
    if now_to is None:
        redelivery = f"{sent} (route {delivery.route} is not configured now)"
    elif now_to == delivery.upstream:
        redelivery = f"{sent} (the same: route {delivery.route}'s upstream now)"
    else:
        redelivery = f"{logs.mask(now_to)} (route {delivery.route}'s upstream now, changed since)"
    lines = [
        f"request:     {delivery.method} {logs.printable(delivery.target)}",
        f"upstream:    {sent} (where it was sent)",
        f"redelivery:  {redelivery}",
        f"route:       {delivery.route}",
    ]
    if (why := delivery.kept_because(tried)) is not None:  # kept before its attempt ended
        lines.append(f"kept for:    {logs.printable(why)}")
    lines.append("headers:")
    lines += (f"  {name}: {value}" for name, value in presenting.shown_headers(delivery.headers))
    kept = f"dropped ({state})" if body_bytes is None else f"{body_bytes} bytes"
    lines.append(f"body:        {kept}")
    return "\n".join(lines) + "\n"


def _attempts(kept: Sequence[dict[str, Any]]) -> str:
    """Every attempt kept, oldest first, in a table (its number, time, the app's status, how
    long it took, the proxy's error); then, for each that has one, what the app answered: its
    headers kept and its body's first bytes (``presenting.attempts``)."""
    if not kept:
        return "attempts:    none recorded\n"
    told = presenting.attempts(kept, presenting.when)
    rows = [
        (
            a.n,
            a.at,
            "-" if a.status is None else a.status,
            "-" if a.ms is None else a.ms,
            a.error or "-",
        )
        for a in told
    ]
    text = io.StringIO()
    operations.table(rows, ("#", "at", "status", "ms", "error"), text)
    indented = "".join(f"  {line}\n" for line in text.getvalue().splitlines())
    made = told[-1].n
    more = f" ({len(told)} kept: the first and the newest)" if made != len(told) else ""
    return f"attempts:    {made}{more}\n{indented}" + "".join(map(_answer, told))


def _answer(attempt: presenting.Attempt) -> str:
    """What the app answered at an attempt, as ``_attempts`` prints it ("" when nothing of it
    is kept)."""
    if not attempt.headers and attempt.body_bytes is None:
        return ""
    lines = [f"  answer #{attempt.n}: {attempt.words}"]
    lines += (f"    {name}: {value}" for name, value in attempt.headers)
    if attempt.body_bytes is not None:
        cut = f", the first {inbox.ATTEMPT_BODY} shown" if attempt.cut else ""
        lines.append(
            f"    body: {attempt.body_bytes} bytes{cut}" + (":" if attempt.body_lines else "")
        )
        lines += (f"    | {line}" for line in attempt.body_lines)
    return "\n".join(lines) + "\n"


class Verbs(NamedTuple):
    """How a bulk command says what it does: ``verb`` (a dry run's "would …"), ``did`` (each
    row's line on stdout) and ``progress`` (its progress lines on stderr)."""

    verb: str
    did: str
    progress: str


def _bulk_usage(
    event_ids: Sequence[str], every: inbox.InboxState | None, since: float | None, dry_run: bool
) -> None:
    if bool(event_ids) == (every is not None):
        raise errors.UsageError("give event IDs, --dead or --pending: one of them")
    if since is not None and every is None:
        raise errors.UsageError("--since goes with --dead or --pending only")
    if dry_run and every is None:
        raise errors.UsageError("--dry-run goes with --dead or --pending only")


def _selection(
    route: routes.RouteConfig,
    scope: str | None,
    state: inbox.InboxState,
    since: float | None,
    *,
    again: bool,
) -> inbox.Selection:
    after = datetime.now(UTC) - timedelta(seconds=since) if since is not None else None
    return inbox.Selection(operations.narrowed_scope(route, scope), state, after, again)


async def _bulk(
    store: database.Store,
    selection: inbox.Selection,
    act: Callable[[list[inbox.Key]], Awaitable[list[inbox.Key]]],
    verbs: Verbs,
    *,
    dry_run: bool,
    out: TextIO,
    err: TextIO,
) -> int:
    """``act`` over every row of ``selection``: counted first (with ``dry_run``, the count and
    the first rows, and nothing changed), then ``inbox.BATCH`` rows at a time, each batch committed
    on its own and followed by a progress line on stderr.

    Ctrl-C leaves each row changed or not (the batch in flight is rolled back whole), and the
    rows changed no longer match ``selection``: the same command again continues with the
    rest. Rows are paged by key, so a run ends even when it passes rows over (a row being
    redelivered right now)."""
    state, scope = selection.state, selection.scope
    total = await store.inbox.selected_count(selection)
    if dry_run:
        sample = await store.inbox.selected(selection, None, SAMPLE)
        if sample:
            _table(sample, state == inbox.InboxState.PENDING, out)
        shown = f" (the first {len(sample)} above)" if len(sample) < total else ""
        out.write(
            f"would {verbs.verb} {total} {state} delivery(ies) in scope {scope}{shown}; "
            "nothing changed (--dry-run)\n"
        )
        return 0
    if not total:
        out.write(f"no {state} deliveries in scope {scope}\n")
        return 0
    done = passed = 0
    after = None
    try:
        while page := await store.inbox.selected(selection, after, inbox.BATCH):
            keys = [inbox.Key(row.scope, row.event_id) for row in page]
            changed = await act(keys)
            for key in changed:
                out.write(
                    f"{verbs.did}: {logs.printable(key.scope)} {logs.printable(key.event_id)}\n"
                )
            out.flush()
            done += len(changed)
            passed += len(keys) - len(changed)
            err.write(f"{verbs.progress} {done} of {total}\n")
            err.flush()
            after = keys[-1]
    except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels the command
        err.write(
            f"interrupted: {verbs.progress} {done} of {total}, each batch committed whole; "
            "the rest are as they were: run the same command again to continue\n"
        )
        raise
    if passed:
        out.write(f"{passed} passed over: being redelivered at that moment, or no longer {state}\n")
    if verbs.verb == "redeliver":
        out.write(f"{done} {_DUE_NOW}\n")
    else:
        out.write(f"{done} {state} delivery(ies) discarded in scope {scope}\n")
    return 0


async def redeliver(
    cfg: config.Config,
    route: str,
    event_ids: Sequence[str],
    *,
    scope: str | None = None,
    every: inbox.InboxState | None = None,
    since: float | None = None,
    dry_run: bool = False,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Make these deliveries (or, with ``every`` "dead" or "pending", all of the route's in
    that state, changed at most ``since`` seconds ago: ``_bulk``) due now, with the route's
    whole ``for`` again. Exit 1 if an ID was not pending or dead (or its body is gone)."""
    found = operations.route_of(cfg, route)
    _bulk_usage(event_ids, every, since, dry_run)
    if found.redeliver is None:
        raise errors.UsageError(f"route {route!r} has no redeliver: nothing would redeliver it")
    for_ = found.redeliver.for_
    if every:
        selection = _selection(found, scope, every, since, again=True)
        async with operations.open_store(cfg) as store:
            return await _bulk(
                store, selection, lambda keys: store.inbox.redeliver_batch(selection, keys, for_),
                Verbs("redeliver", "redelivering", "made due"), dry_run=dry_run, out=out, err=err,
            )  # fmt: skip
    scope = operations.exact_scope(found, scope)
    async with operations.open_store(cfg) as store:
        named = await operations.resolve(store, found, scope, event_ids)
        changed = await store.inbox.redeliver(scope, list(named.stored.values()), None, for_)
        done = {key.event_id for key in changed}
        left = [stored for stored in named.stored.values() if stored not in done]
        at_app = await store.inbox.at_app(scope, left) if left else {}
    why = {stored: f"at the app now, not made due (handed off, its first attempt still going "
                   f"on; try again when it ends, by {presenting.when(lease)} at the latest)"
           for stored, lease in at_app.items()}  # fmt: skip
    named.report(event_ids, done, "redelivering", out, why)
    out.write(f"{len(changed)} {_DUE_NOW}\n")
    return 0 if named.all_done(done) else 1


async def discard(
    cfg: config.Config,
    route: str,
    event_ids: Sequence[str],
    *,
    scope: str | None = None,
    every: inbox.InboxState | None = None,
    since: float | None = None,
    dry_run: bool = False,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Drop these pending or dead deliveries (or, with ``every``, all of the route's in that
    state, changed at most ``since`` seconds ago: ``_bulk``) for good; their claims stay. Exit
    1 if some were not pending or dead (or an ID named several claims, listed)."""
    found = operations.route_of(cfg, route)
    _bulk_usage(event_ids, every, since, dry_run)
    if every:
        selection = _selection(found, scope, every, since, again=False)
        async with operations.open_store(cfg) as store:
            return await _bulk(
                store, selection, lambda keys: store.inbox.discard_batch(selection, keys),
                Verbs("discard", "discarded", "discarded"), dry_run=dry_run, out=out, err=err,
            )  # fmt: skip
    scope = operations.exact_scope(found, scope)
    async with operations.open_store(cfg) as store:
        named = await operations.resolve(store, found, scope, event_ids)
        discarded = await store.inbox.discard(scope, list(named.stored.values()))
    named.report(event_ids, discarded, "discarded", out)
    return 0 if named.all_done(discarded) else 1


async def pause(
    cfg: config.Config,
    route: str,
    *,
    for_: float | None = None,
    note: str | None = None,
    by: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """``operations.pause_route`` from the command line (by the OS user unless ``by`` says who)."""
    operations.route_of(cfg, route)
    async with operations.open_store(cfg) as store:
        lines = await operations.pause_route(
            store, cfg, route, for_=for_, note=note, by=by or operations.operator()
        )
    out.write("".join(f"{line}\n" for line in lines))
    return 0


async def resume(
    cfg: config.Config, route: str, *, by: str | None = None, out: TextIO = sys.stdout
) -> int:
    """``operations.resume_route`` from the command line. Exit 1 if it held none."""
    found = operations.route_of(cfg, route)
    async with operations.open_store(cfg) as store:
        said = await operations.resume_route(store, cfg, route, by=by or operations.operator())
    if said is None:
        print(f"not held: route {found.name} (scope {found.scope})", file=sys.stderr)
        return 1
    out.write(f"{said}\n")
    return 0
