"""The operator console: server-rendered pages on the admin listener, under ``/console/``.

Four pages read the claim table through the proxy's own store: the overview (per route: the inbox's
pending and dead rows, the oldest pending one's age, and what became of the last hour's claims), the
kept deliveries (those that need attention, pending and dead, unless the filter asks for a state or
``all``; filtered by route, state, time (a time, or a time ago as the CLI's ``--since`` takes it:
``1h``), ID, event type or a key inside the JSON body; counted up to ``COUNT_MAX``; paged by
(received_at, event_id), so rows arriving meanwhile move no page), an event's page (its request,
headers masked where they carry credentials or signatures, its body's first ``BODY_CAP`` bytes,
pretty-printed when that is all of it, every attempt) and the lookup of a provider's event ID on
every route, among all claims. Only the configured routes' rows are shown: not another deployment's
on a shared table, nor the reserved scopes' (``~holds``). A row, a hold and a time are worded as
the CLI words them (``presenting``), in a page's time form. The overview also says which routes are
held (an operator's pause, or the app's Retry-After: ``database.holds``, read from the database, so
as every replica holds them), this replica's requests at the app against its limit (and a shared
limit's places held by every replica, read from their rows), and this
replica's requests since it started by outcome (``dedup_requests_total``, which also counts what
leaves no claim: a duplicate, a rejected signature, a refusal). With ``admin.console.actions`` an
operator redelivers or discards an event, redelivers what a filter shows (its count and its first
events, then a confirmation, answered by a redirect to a page saying how many it still shows
pending, linked to that list: a reload reads it again, redelivering nothing), or pauses and resumes
a route (``operations``' pause and resume, as ``events pause`` and ``resume`` do); each action
is logged with who did it.

Everything shown is what a sender sent, so it is escaped (Jinja2's autoescape), and the pages
hold no script; ``console_gate`` adds the policy that keeps it so, the credential and the
checks on each action.

What a page costs is bounded, since the admin listener may be reached without a credential: a
body is read up to ``BODY_CAP`` bytes by the server, a body filter is evaluated by the server
(``Inbox.browse``), and a worker serves one console request at a time (``_one_at_a_time``: the
next waits up to ``BUSY_WAIT``, then is answered 503). So the console holds at most one of the
claim pool's connections per worker, each statement bounded by ``connect_timeout``; a pool of
its own would be connections more to budget against the server's ``max_connections``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from proxy import app_keys, console_gate, database, errors, logs, metrics, operations, presenting
from proxy.config import routes as routes_module
from proxy.config import values
from proxy.database import inbox

log = logging.getLogger(__name__)

PAGE = 50
# The overview lists at most this many blocked objects per route with order, oldest first.
BLOCKED_SHOWN = 20
# An event's body is read and shown up to this many bytes (pretty-printed if it is JSON whole).
BODY_CAP = 64 * 1024
# How long a console request waits for this worker's one before it is answered 503.
BUSY_WAIT = 5.0
# A bulk redeliver acts on at most this many rows; a wider filter is refused, to be narrowed.
BULK_MAX = 10_000
_BULK_PAGE = 500
# A bulk redeliver's confirmation lists this many of the events it would redeliver.
BULK_SHOWN = 50
STATES = tuple(inbox.InboxState)
# The kept deliveries shown when the filter names no state: those that need an operator (a
# blocked object's head and those behind it are pending); ``state=all`` shows every state.
ATTENTION = (inbox.InboxState.PENDING.value, inbox.InboxState.DEAD.value)
ALL = "all"
# The kept deliveries' list counts the rows its filters select up to this many ("10,000+").
COUNT_MAX = 10_000
# ...and gives up counting after this many seconds (a filter no index answers, over many rows).
COUNT_TIME = 0.5
_STATIC = Path(__file__).with_name("console_static")
_DONE = {"redelivered": "Made due now: the redeliverer sends it within its poll interval.",
         "discarded": "Discarded: the body is dropped, the claim stays.",
         "unchanged": "Nothing changed: the event is not pending or dead (any more).",
         "at_app": "Not made due: it is at the app now (handed off, its first attempt still "
                   "going on); try again when its attempt ends."}  # fmt: skip
_HELD = {"paused": "Paused: every running proxy holds the route within redeliverer.poll.",
         "resumed": "Resumed: every running proxy redelivers the route's pending deliveries "
                    "again within redeliverer.poll, at the limit at the app.",
         "unchanged": "Nothing to resume: the route was not held."}  # fmt: skip
# A pause's reason is kept up to this many characters.
NOTE_MAX = 200


@dataclass(frozen=True, slots=True)
class Filters:
    """The kept deliveries' filters, as the page's query string gives them."""

    route: str = ""
    state: str = ""
    since: str = ""
    until: str = ""
    event_id: str = ""
    event_type: str = ""
    body: str = ""  # "data.object.customer=cus_123"

    @classmethod
    def of(cls, query: Mapping[str, str]) -> Filters:
        return cls(*(query.get(name, "").strip() for name in _FILTER_NAMES))

    def query(self, **extra: str) -> str:
        pairs = [(name, getattr(self, name)) for name in _FILTER_NAMES if getattr(self, name)]
        return urllib.parse.urlencode(pairs + list(extra.items()))

    def pairs(self) -> list[tuple[str, str]]:
        return [(name, getattr(self, name)) for name in _FILTER_NAMES if getattr(self, name)]

    def states(self) -> tuple[str, ...]:
        """The states shown: those that need attention unless the filter names one, or all."""
        if self.state == ALL:
            return ()
        return (self.state,) if self.state else ATTENTION


_FILTER_NAMES = ("route", "state", "since", "until", "event_id", "event_type", "body")


class BadFilter(ValueError):
    """A filter the console cannot read; its message says which and why."""


class BadForm(ValueError):
    """An action's form the console cannot act on; its message says which field and why."""


def _time(text: str, name: str) -> datetime | None:
    """A time filter: a time (UTC unless it says), or how long ago, as the CLI's ``--since``
    reads it (``1h``, ``30m``, ``2d``: ``values.parse_duration``), from now."""
    if not text:
        return None
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        try:
            return _now() - timedelta(seconds=values.parse_duration(text))
        except (ValueError, OverflowError):
            raise BadFilter(
                f"{name}: not a time like 2026-01-31T12:00 or a time ago like 1h, 30m or 2d, "
                f"got {text!r}"
            ) from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _body_filter(text: str) -> tuple[tuple[str, ...], str, bytes] | None:
    """``a.b.c=value``: the JSON path, the value, and the bytes a body holding it holds."""
    if not text:
        return None
    path, eq, value = text.partition("=")
    keys = tuple(path.strip().split("."))
    if not eq or not all(keys) or not value:
        raise BadFilter(f"body: must be key.path=value, got {text!r}")
    # A string's JSON spelling holds its escapes; the bytes searched are the value's own,
    # which a body spelling it with escapes (\u0041) does not hold: such a body is not found.
    return keys, value, value.encode("utf-8")


def _route_of(routes: tuple[routes_module.RouteConfig, ...], scope: str) -> Any:
    for route in routes:
        if scope == route.scope or scope.startswith(route.scope + "/"):
            return route
    return None


def _scopes(routes: tuple[routes_module.RouteConfig, ...]) -> tuple[str, ...]:
    return tuple(sorted({route.scope for route in routes}))


def _criteria(
    filters: Filters, routes: tuple[routes_module.RouteConfig, ...], limit: int
) -> tuple[inbox.Criteria, tuple[str, ...], str]:
    scope = None
    if filters.route:
        route = next((r for r in routes if r.name == filters.route), None)
        if route is None:
            raise BadFilter(f"route: no route named {filters.route!r}")
        scope = route.scope
    if filters.state and filters.state not in STATES and filters.state != ALL:
        raise BadFilter(f"state: {ALL} or one of {', '.join(STATES)}, got {filters.state!r}")
    body = _body_filter(filters.body)
    criteria = inbox.Criteria(
        scopes=_scopes(routes), scope=scope, states=filters.states(),
        since=_time(filters.since, "since"), until=_time(filters.until, "until"),
        event_id=filters.event_id or None,
        composite=tuple(sorted({r.scope for r in routes if r.composite_id})),
        event_type=filters.event_type or None, body_bytes=body[2] if body else None,
        limit=limit,
    )  # fmt: skip
    return criteria, body[0] if body else (), body[1] if body else ""


def _cursor(query: Mapping[str, str]) -> tuple[datetime, str] | None:
    at, event_id = query.get("after_at"), query.get("after_id")
    if not at or event_id is None:
        return None
    when = _time(at, "after_at")
    assert when is not None
    return when, event_id


def pretty_body(body: bytes, size: int | None = None) -> tuple[str, bool]:
    """The body as text, and whether it was cut at ``BODY_CAP`` bytes: ``body`` is its first
    bytes as read, ``size`` its whole length (default: ``body``'s). Indented if it is JSON, only
    when ``body`` is all of it and the indented text fits: a body is never parsed past the cap
    (a kept GitHub body can be 25 MB)."""
    size = len(body) if size is None else size
    cut = size > min(len(body), BODY_CAP)
    text = body[:BODY_CAP].decode("utf-8", "replace")
    if not cut:
        with contextlib.suppress(ValueError, RecursionError):
            pretty = json.dumps(json.loads(body), indent=2, ensure_ascii=False)
            if len(pretty) <= BODY_CAP:
                text = pretty
    return text, cut


def _render(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    settings = request.app[app_keys.CONSOLE]
    operator = request.get(console_gate.OPERATOR)
    template = request.app[app_keys.CONSOLE_TEMPLATES].get_template(name)
    html = template.render(
        actions=settings.actions and operator is not None,
        operator=operator.name if operator else "",
        csrf=console_gate.csrf_token(operator) if operator else "",
        csrf_field=console_gate.CSRF_FIELD,
        routes=request.app[app_keys.PROXY][app_keys.CONFIG].routes,
        states=STATES,
        **context,
    )
    return web.Response(text=html, status=status, content_type="text/html", charset="utf-8")


def _store(request: web.Request) -> database.Store:
    store = request.app[app_keys.PROXY].get(app_keys.STORE)
    if store is None or not store.started.is_set():
        raise errors.Starting("starting: the database is not connected yet")
    return store


def _one_at_a_time() -> Callable[..., Awaitable[web.StreamResponse]]:
    """One console request at a time in this worker (the stylesheet aside): the next waits up
    to ``BUSY_WAIT``, then is answered 503. Its reads are each bounded, but the next page's
    would add up: with this, the console takes at most one database connection and one
    page's memory per worker, whatever number of tabs or clients ask."""
    lock = asyncio.Lock()

    @web.middleware
    async def middleware(request: web.Request, handler: console_gate.Handler) -> web.StreamResponse:
        if request.path.endswith("/console.css"):
            return await handler(request)
        try:
            async with asyncio.timeout(BUSY_WAIT):
                await lock.acquire()
        except TimeoutError:
            response = _render(
                request, "message.html", 503, title="The console is busy",
                message="This worker is serving another console request; try again in a "
                "moment.",
            )  # fmt: skip
            response.headers["Retry-After"] = str(int(BUSY_WAIT))
            return response
        try:
            return await handler(request)
        finally:
            lock.release()

    return middleware


@web.middleware
async def _errors(request: web.Request, handler: console_gate.Handler) -> web.StreamResponse:
    """A filter the console cannot read (400) or a database that does not answer (503), as a
    page saying so."""
    try:
        return await handler(request)
    except BadFilter as exc:
        return _render(request, "message.html", 400, title="Bad filter", message=str(exc))
    except BadForm as exc:
        return _render(request, "message.html", 400, title="Not done", message=str(exc))
    except errors.ProxyError as exc:
        return _render(
            request, "message.html", 503, title="The database does not answer",
            message=exc.message,
        )  # fmt: skip


def held(hold: database.Hold | None, now: float) -> str:
    """A route's hold as the overview says it ("" when not held)."""
    if hold is None or not hold.held_at(now):
        return ""
    return presenting.hold(hold, now, presenting.page_when)


async def overview(request: web.Request) -> web.Response:
    store = _store(request)
    proxy = request.app[app_keys.PROXY]
    routes = proxy[app_keys.CONFIG].routes
    holds = await store.holds.active(sorted({route.scope for route in routes}))
    now = time.time()
    meters = proxy[app_keys.METRICS]
    since_start = meters.requests_by_route()
    rows = []
    for route in routes:
        level = await store.inbox.level(route.scope)
        hour = await store.inbox.hour(route.scope)
        outcomes = since_start.get(route.name, [])
        rows.append({"route": route, "level": level, "hour": hour,
                     "per_minute": f"{hour.received / 60:.1f}",
                     "oldest": presenting.age(level.oldest_pending),
                     "held": held(holds.get(route.scope), now),
                     "outcomes": outcomes, "requests": sum(n for _, n in outcomes)})  # fmt: skip
    in_flight, limit = meters.app_use()
    blocked = await _blocked(store, routes)
    return _render(
        request, "overview.html", title="Overview", rows=rows, now=presenting.page_when(_now()),
        in_flight=in_flight, limit=limit, done=_HELD.get(request.query.get("done", "")),
        note_max=NOTE_MAX, blocked=blocked, blocked_shown=BLOCKED_SHOWN,
        places=await _places(store, meters),
    )  # fmt: skip


async def _places(store: database.Store, meters: metrics.Metrics) -> dict[str, int] | None:
    """A limit shared by every replica (``upstream.concurrency: {shared: true}``): its places
    held now, read from their rows (``slots.Slots.held``: N rows by their key, never waiting
    on a lock) rather than the gauge the redeliverer last set, and this replica's waits for one
    (``dedup_app_place_waits_total``). None: the limit is not shared."""
    held = await store.places_held()
    if held is None or store.slots is None:
        return None
    waits = meters.exposition_registry().get_sample_value("dedup_app_place_waits_total")
    return {"held": held, "limit": store.slots.limit, "waits": int(waits or 0)}


async def _blocked(
    store: database.Store, routes: tuple[routes_module.RouteConfig, ...]
) -> list[dict[str, Any]] | None:
    """Per route with ``order`` and ``redeliver``: its ``BLOCKED_SHOWN`` oldest blocked objects
    and how many there are (None: no such route)."""
    ordered = [route for route in routes if route.order is not None and route.redeliver]
    if not ordered:
        return None
    shown, now = [], _now()
    for route in ordered:
        found, total = await store.inbox.blocked(route.scope, 0.0, BLOCKED_SHOWN)
        objects = [
            {
                "row": row,
                "since": presenting.page_when(row.since),
                "age": presenting.age((now - row.since).total_seconds()),
                "head": database.unbound(row.head),
                "link": urllib.parse.urlencode({"scope": row.scope, "id": row.head}),
                "state": presenting.head_state(row, presenting.page_when),
                "last": presenting.last(row.last_status, row.last_error),
            }
            for row in found
        ]
        shown.append({"route": route, "objects": objects, "total": total})
    return shown


def _now() -> datetime:
    return datetime.now(UTC)


async def events(request: web.Request) -> web.Response:
    store = _store(request)
    filters = Filters.of(request.query)
    routes = request.app[app_keys.PROXY][app_keys.CONFIG].routes
    criteria, path, value = _criteria(filters, routes, PAGE)
    total = None  # not counted with a body filter
    if criteria.body_bytes is None:
        total = _counted(await store.inbox.count(criteria, COUNT_MAX, COUNT_TIME))
    after = _cursor(request.query)
    if after is not None:
        criteria = inbox.Criteria(**{**_fields(criteria), "after": after})
    rows, cursor = await store.inbox.browse(criteria, path, value)
    next_page = None
    if cursor is not None:
        at, event_id = cursor
        next_page = filters.query(after_at=at.isoformat(), after_id=event_id)
    listed = [_listed(row) for row in rows]
    return _render(
        request, "events.html", title="Kept deliveries", filters=filters, listed=listed,
        next_page=next_page, first_page=filters.query() if after else None,
        bulk=filters.query(), total=total, count_time=COUNT_TIME,
        all_states=replace(filters, state=ALL),
        attention=replace(filters, state=""), showing=_showing(filters),
    )  # fmt: skip


def _listed(row: inbox.Listed) -> dict[str, Any]:
    """A kept row as a list shows it (the kept deliveries, a bulk redeliver's confirmation)."""
    return {"row": row, "received": presenting.page_when(row.received_at),
            "due": presenting.page_when(row.due), "event": database.unbound(row.event_id),
            "last": presenting.last(row.last_status, row.last_error),
            "link": urllib.parse.urlencode({"scope": row.scope, "id": row.event_id})}  # fmt: skip


def _counted(total: int | None) -> str:
    """A bounded count as the list says it: ``1,234``, ``10,000+`` past ``COUNT_MAX`` ("":
    not counted within ``COUNT_TIME``)."""
    if total is None:
        return ""
    return f"{COUNT_MAX:,}+" if total > COUNT_MAX else f"{total:,}"


def _showing(filters: Filters) -> str:
    if filters.state == ALL:
        return "in any state"
    if filters.state:
        return f"in state {filters.state}"
    return "that need attention (pending or dead)"


def _fields(criteria: inbox.Criteria) -> dict[str, Any]:
    return {name: getattr(criteria, name) for name in inbox.Criteria.__dataclass_fields__}


async def event(request: web.Request) -> web.Response:
    store = _store(request)
    scope, event_id = request.query.get("scope", ""), request.query.get("id", "")
    route = _route_of(request.app[app_keys.PROXY][app_keys.CONFIG].routes, scope)
    shown = None
    if route is not None and event_id:
        shown = await store.inbox.show(scope, event_id, BODY_CAP)
    if shown is None:
        return _render(
            request, "message.html", 404, title="No such event",
            message=f"No claim {event_id!r} in scope {scope!r}.",
        )  # fmt: skip
    delivery = shown.request
    body, cut = ("", False)
    if delivery is not None:
        body, cut = pretty_body(delivery.body, shown.body_bytes)
    headers = presenting.shown_headers(delivery.headers) if delivery else []
    attempts = presenting.attempts(shown.attempts, presenting.page_when)
    return _render(
        request, "event.html", title="Event", shown=shown, event=database.unbound(shown.event_id),
        state=presenting.state(shown.state), delivery=delivery, headers=headers, body=body, cut=cut,
        body_cap=BODY_CAP, attempts=attempts, route=route, when=presenting.page_when,
        why=shown.reason(presenting.page_when), attempt_body=inbox.ATTEMPT_BODY,
        # Why it was first kept, below the reason it is kept now: history, once it was tried.
        kept_for=None if delivery is None or not shown.attempts
        else delivery.kept_because(True),
        done=_DONE.get(request.query.get("done", "")),
        actionable=shown.state in ("pending", "dead") and route is not None
        and route.redeliver is not None and delivery is not None,
    )  # fmt: skip


async def lookup(request: web.Request) -> web.Response:
    given = request.query.get("id", "").strip()
    found: list[inbox.Found] = []
    tried: list[str] = []
    if given:
        store = _store(request)
        routes = request.app[app_keys.PROXY][app_keys.CONFIG].routes
        scopes = sorted({route.scope for route in routes})
        scoped = sorted({r.scope for r in routes if r.scoped_by_path or r.scope_from})
        composite = sorted({r.scope for r in routes if r.composite_id})
        found = await store.inbox.lookup(scopes, scoped, composite, given)
        tried = _tried(routes, given)
    rows = [
        {"found": f, "state": presenting.state(f.state),
         "received": presenting.page_when(f.received_at),
         "link": urllib.parse.urlencode({"scope": f.scope, "id": f.event_id})}
        for f in found
    ]  # fmt: skip
    return _render(request, "lookup.html", title="Was this event processed?", given=given,
                   rows=rows, tried=tried)  # fmt: skip


def _tried(routes: tuple[routes_module.RouteConfig, ...], given: str) -> list[str]:
    """The forms of ``given`` a lookup looked for, on some route: as given, bound to a body,
    and as the last part of a composite ID."""
    tried = [given]
    if any(route.binds_claims for route in routes):
        tried.append(f"{given}~<digest>")
    for route in routes:
        if route.composite_id and ":" not in given:
            assert isinstance(route.event_id, tuple)
            form = ":".join([*(f"<{s.name}>" for s in route.event_id[:-1]), given])
            tried.append(form + ("[~<digest>]" if route.binds_claims else ""))
    return list(dict.fromkeys(tried))


async def static(request: web.Request) -> web.StreamResponse:
    return web.Response(
        body=(_STATIC / "console.css").read_bytes(), content_type="text/css", charset="utf-8"
    )


# Actions


def _operator(request: web.Request) -> str:
    return request[console_gate.OPERATOR].name  # console_gate lets no action through without


async def _one(request: web.Request) -> tuple[database.Store, Any, str, str]:
    form = await request.post()
    scope, event_id = str(form.get("scope", "")), str(form.get("id", ""))
    route = _route_of(request.app[app_keys.PROXY][app_keys.CONFIG].routes, scope)
    if route is None or route.redeliver is None:
        raise web.HTTPBadRequest(text="no route that redelivers holds this scope\n")
    return _store(request), route, scope, event_id


def _back(scope: str, event_id: str, done: str) -> web.HTTPSeeOther:
    query = urllib.parse.urlencode({"scope": scope, "id": event_id, "done": done})
    return web.HTTPSeeOther(f"event?{query}")


async def redeliver(request: web.Request) -> web.Response:
    store, route, scope, event_id = await _one(request)
    changed = await store.inbox.redeliver(scope, [event_id], None, route.redeliver.for_)
    log.info(
        "console: %s redelivered %d event(s) in scope %s: %s", _operator(request), len(changed),
        scope, logs.printable(event_id),
    )  # fmt: skip
    if not changed and await store.inbox.at_app(scope, [event_id]):
        raise _back(scope, event_id, "at_app")
    raise _back(scope, event_id, "redelivered" if changed else "unchanged")


async def discard(request: web.Request) -> web.Response:
    store, _, scope, event_id = await _one(request)
    changed = await store.inbox.discard(scope, [event_id])
    log.info(
        "console: %s discarded %d event(s) in scope %s: %s", _operator(request), len(changed),
        scope, logs.printable(event_id),
    )  # fmt: skip
    raise _back(scope, event_id, "discarded" if changed else "unchanged")


async def _selected(request: web.Request, filters: Filters) -> list[inbox.Listed]:
    """The pending and dead rows (bodies kept) the filters show, all pages, up to BULK_MAX+1."""
    store = _store(request)
    routes = request.app[app_keys.PROXY][app_keys.CONFIG].routes
    criteria, path, value = _criteria(filters, routes, _BULK_PAGE)
    found: list[inbox.Listed] = []
    while len(found) <= BULK_MAX:
        rows, cursor = await store.inbox.browse(criteria, path, value)
        found += [r for r in rows if r.state in ("pending", "dead") and r.body_bytes is not None]
        if cursor is None:
            break
        criteria = inbox.Criteria(**{**_fields(criteria), "after": cursor})
    return [r for r in found if _route_of(routes, r.scope) is not None
            and _route_of(routes, r.scope).redeliver is not None]  # fmt: skip


def _confirm(
    request: web.Request,
    filters: Filters,
    selected: list[inbox.Listed],
    status: int = 200,
    **context: Any,
) -> web.Response:
    """The bulk redeliver's confirmation: how many the filter selects, and the first
    ``BULK_SHOWN`` of them."""
    shown = [_listed(row) for row in selected[:BULK_SHOWN]]
    return _render(
        request, "bulk.html", status, title="Redeliver what the filter shows", filters=filters,
        count=len(selected), too_many=len(selected) > BULK_MAX, bulk_max=BULK_MAX, shown=shown,
        **context,
    )  # fmt: skip


async def bulk_form(request: web.Request) -> web.Response:
    filters = Filters.of(request.query)
    return _confirm(request, filters, await _selected(request, filters))


async def bulk(request: web.Request) -> web.Response:
    form = await request.post()
    filters = Filters.of({name: str(form.get(name, "")) for name in _FILTER_NAMES})
    try:
        expected = int(str(form.get("expected", "")))
    except ValueError:
        raise web.HTTPBadRequest(text="the confirmed count is missing\n") from None
    selected = await _selected(request, filters)
    if len(selected) > min(expected, BULK_MAX):
        return _confirm(request, filters, selected, 409, changed_since=expected)
    store = _store(request)
    routes = request.app[app_keys.PROXY][app_keys.CONFIG].routes
    by_scope: dict[str, list[str]] = {}
    for row in selected:
        by_scope.setdefault(row.scope, []).append(row.event_id)
    changed: list[tuple[str, str]] = []
    for scope, event_ids in sorted(by_scope.items()):
        route = _route_of(routes, scope)
        changed += await store.inbox.redeliver(scope, event_ids, None, route.redeliver.for_)
    log.info(
        "console: %s redelivered %d event(s) by filter %s: %s", _operator(request), len(changed),
        logs.printable(filters.query()),
        logs.printable(", ".join(f"{scope} {event_id}" for scope, event_id in changed)),
    )  # fmt: skip
    # Post/Redirect/Get: the answer is a page of its own, which a reload reads again without
    # sending the redeliver again.
    done = filters.query(changed=str(len(changed)), of=str(len(selected)))
    raise web.HTTPSeeOther(f"redelivering?{done}")


async def redelivering(request: web.Request) -> web.Response:
    """What a bulk redeliver did (its counts, as its answer's URL carries them) and how many
    of what its filter shows are still pending, as of now: reloading it follows the progress."""
    filters = Filters.of(request.query)
    try:
        changed, count = int(request.query.get("changed", "")), int(request.query.get("of", ""))
    except ValueError:
        raise BadFilter("changed, of: the counts of a bulk redeliver, as numbers") from None
    pending = replace(filters, state="pending")
    still = len(await _selected(request, pending))
    return _render(
        request, "bulk_done.html", title="Redelivering", changed=changed, count=count,
        now=presenting.page_when(_now()), pending=pending.query(), still=still,
        too_many=still > BULK_MAX, bulk_max=BULK_MAX,
    )  # fmt: skip


async def _route_form(request: web.Request) -> tuple[routes_module.RouteConfig, Any]:
    form = await request.post()
    name = str(form.get("route", ""))
    route = next((r for r in request.app[app_keys.PROXY][app_keys.CONFIG].routes
                  if r.name == name), None)  # fmt: skip
    if route is None:
        raise BadForm(f"route: no route named {name!r}")
    return route, form


async def _refreshed(request: web.Request) -> None:
    """This worker's copy of the holds, read now rather than at its next poll."""
    copy = request.app[app_keys.PROXY].get(app_keys.HOLDS)
    if copy is not None:
        await copy.refresh()


async def pause(request: web.Request) -> web.Response:
    route, form = await _route_form(request)
    given = str(form.get("for", "")).strip()
    try:
        for_ = values.parse_duration(given) if given else None
    except ValueError as exc:
        raise BadForm(f"for: {exc}") from None
    note = " ".join(str(form.get("note", "")).split())[:NOTE_MAX] or None
    store = _store(request)
    said = await operations.pause_route(
        store, request.app[app_keys.PROXY][app_keys.CONFIG], route.name, for_=for_, note=note,
        by=_operator(request),
    )  # fmt: skip
    log.info("console: %s paused route %s: %s", _operator(request), route.name,
             logs.printable("; ".join(said)))  # fmt: skip
    await _refreshed(request)
    raise web.HTTPSeeOther("./?done=paused")


async def resume(request: web.Request) -> web.Response:
    route, _ = await _route_form(request)
    store = _store(request)
    said = await operations.resume_route(
        store, request.app[app_keys.PROXY][app_keys.CONFIG], route.name, by=_operator(request)
    )
    log.info("console: %s resumed route %s: %s", _operator(request), route.name,
             logs.printable(said or "it was not held"))  # fmt: skip
    await _refreshed(request)
    raise web.HTTPSeeOther(f"./?done={'resumed' if said else 'unchanged'}")


def templates() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).with_name("console_templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def create_console_app(proxy: web.Application) -> web.Application:
    """The console, mounted by the admin application under ``/console/``."""
    settings = proxy[app_keys.CONFIG].admin.console
    console = web.Application(middlewares=[console_gate.guard(settings), _errors, _one_at_a_time()])
    console[app_keys.PROXY] = proxy
    console[app_keys.CONSOLE] = settings
    console[app_keys.CONSOLE_TEMPLATES] = templates()
    console.router.add_get("/", overview)
    console.router.add_get("/events", events)
    console.router.add_get("/event", event)
    console.router.add_get("/lookup", lookup)
    console.router.add_get("/console.css", static)
    # Always routed, refused by console_gate unless actions are on and an operator signed in.
    console.router.add_post("/bulk", bulk)
    console.router.add_post("/redeliver", redeliver)
    console.router.add_post("/discard", discard)
    console.router.add_post("/pause", pause)
    console.router.add_post("/resume", resume)
    if settings.actions and settings.credentials:
        console.router.add_get("/bulk", bulk_form)
        console.router.add_get("/redelivering", redelivering)
    return console
