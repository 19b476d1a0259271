"""Route holds: "this route scope's redeliveries are held until T", for every replica at once.

A hold is a row of the claim table, in the reserved scope ``sql.HOLDS`` (no route's: routes'
scopes are letters, digits, '_', '.' and '-'), keyed by the scope it holds (a route's; for the
app's Retry-After, the claim's, which on a templated route is the tenant's: "hooks/acme"; the
rows of a route's per-path holds are deleted once ended, when the next is set), as the upgrade
window's rows are in ``sql.ID_FORMS``: no new table, and no grant beyond the documented ones
(a pause and a resume delete the row and insert it anew: SELECT, INSERT, DELETE; a hold for the
app's Retry-After changes it, with the inbox's UPDATE). Its kind, end, start, and who and why
are in the inbox's columns. Every statement that reads routes' rows names their scopes, so the
retention sweep, the listings, the counts and the redeliverer never see it; on Citus the row
is one row of the table like any other (distributed by ``event_id``, the route scope), written
by its whole key.

Two kinds: ``paused`` (an operator's ``events pause``, with an end or none) and
``retry_after`` (the app answered 429 or 503 with ``Retry-After``, for at most
``MAX_RETRY_AFTER``). ``hold`` sets a hold, whatever held before; ``hold_at_least`` never
shortens a hold and never turns a pause into another kind; ``release`` ends a route's now, its
per-path ones with it (deletes the rows). A hold is in force while its end is ahead (or it has
none); the row of one that ended stays until the next hold replaces it.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from proxy import errors
from proxy.database import inbox, inbox_sql, pool, sql

log = logging.getLogger(__name__)

Acquire = Callable[[], AbstractAsyncContextManager[pool.Connection]]

OUTDATED = (
    "the claim table does not exist yet, or predates the inbox whose columns hold a hold: run "
    "'dedup-proxy migrate'"
)
# The longest the app's Retry-After holds a scope, from the answer that asked: a typo in the
# app's header must not stop a route's redeliveries for a week.
MAX_RETRY_AFTER = 3600.0
GRANT_HINT = (
    "a pause and a resume need SELECT, INSERT and DELETE on the table, and a hold for the "
    f"app's Retry-After also GRANT UPDATE ({', '.join(sql.INBOX_COLUMNS)}), as redeliver does"
)


class HoldKind(enum.StrEnum):
    """Why a route scope is held (``inbox_state`` of its row)."""

    PAUSED = "paused"  # an operator's events pause
    RETRY_AFTER = "retry_after"  # the app answered 429/503 with Retry-After


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """A hold in force: its kind (``reason``), its end (``until``, time.time(); None: until
    released), since when it holds (time.time()), who set it, the end asked for, and the
    operator's words (``note``)."""

    reason: HoldKind
    until: float | None
    since: float
    by: str
    asked_until: float | None
    note: str | None = None

    def held_at(self, now: float) -> bool:
        """Whether it is still in force at ``now`` (time.time())."""
        return self.until is None or now < self.until


class RouteHolds:
    """The holds' operations over the store's connections (``Store.holds``)."""

    def __init__(self, quoted: str, acquire: Acquire, op_timeout: float) -> None:
        self.statements = inbox_sql.Statements(quoted)
        self._acquire = acquire
        self._op_timeout = op_timeout

    async def hold(
        self,
        scope: str,
        until: float | None,
        *,
        by: str,
        note: str | None = None,
        kind: HoldKind = HoldKind.PAUSED,
    ) -> Hold:
        """Hold ``scope`` for ``until`` seconds from now (None: until released), replacing any
        hold it had: an operator's pause. The hold as stored."""
        request = _request(by, note)
        statements = self.statements
        args = (scope, kind, until, request)
        async with self._acquire() as connection:
            with _writing("holding the route failed"):
                async with connection.transaction():
                    await connection.execute(statements.unhold_one, scope)
                    await connection.execute(statements.hold_row, *args)
        return await self._read(scope)

    async def hold_at_least(self, scope: str, seconds: float, *, by: str, note: str) -> Hold:
        """Hold ``scope`` for at least ``seconds`` from now (at most ``MAX_RETRY_AFTER``), as
        the app asked (Retry-After): a longer hold stays as it is, and a pause stays a pause.
        The hold in force after. A per-path scope's ("hooks/acme") first deletes its route's
        per-path holds that ended."""
        request = _request(by, note)
        statements = self.statements
        args = (scope, HoldKind.RETRY_AFTER, min(max(0.0, seconds), MAX_RETRY_AFTER), request)
        route, _, path = scope.partition("/")
        async with self._acquire() as connection:
            with _writing("holding the route failed"):
                async with connection.transaction():
                    if path:
                        await connection.execute(statements.sweep_path_holds, route)
                    status = await connection.execute(statements.hold_row, *args)
                    if status != "INSERT 0 1":
                        renewed = await connection.execute(statements.renew_hold_one, *args)
                        if renewed == "UPDATE 0":
                            await connection.execute(statements.extend_hold_one, *args)
        return await self._read(scope)

    async def release(self, scope: str, *, by: str) -> HoldKind | None:
        """End route scope ``scope``'s hold now, and its per-path scopes' (the app's
        Retry-After for one tenant); the kind it was (None: none held; ``RETRY_AFTER`` when only
        per-path ones did)."""
        async with self._acquire() as connection:
            with _writing("releasing the route failed"):
                async with connection.transaction():
                    row = await connection.fetchrow(self.statements.unhold_one, scope)
                    paths = await connection.fetch(self.statements.unhold_paths, scope)
        held_paths = sorted(path["event_id"] for path in paths if path["held"])
        if held_paths:
            log.info("the holds of %s released by %s (the app's Retry-After)",
                     ", ".join(held_paths), by)  # fmt: skip
        if row is None or not row["held"]:
            return HoldKind.RETRY_AFTER if held_paths else None
        log.info("route scope %s released by %s (it was %s)", scope, by, row["inbox_state"])
        return HoldKind(row["inbox_state"])

    async def active(self, scopes: Sequence[str] | None = None) -> dict[str, Hold]:
        """The holds in force of these route scopes and of their per-path ones (None: of all),
        by scope."""
        async with self._acquire() as connection:
            with inbox.plainly("reading the route holds failed", OUTDATED):
                rows = await connection.fetch(
                    self.statements.holds, None if scopes is None else list(scopes),
                    timeout=self._op_timeout,
                )  # fmt: skip
        now = time.time()
        return {row["scope"]: _hold(row, now) for row in rows}

    async def _read(self, scope: str) -> Hold:
        held = await self.active([scope])
        if scope not in held:  # ended between the write and the read: a hold of no time
            raise errors.StoreUnavailable(f"the hold of {scope} ended as soon as it was set")
        return held[scope]


def _request(by: str, note: str | None) -> str:
    return json.dumps({"by": by, "note": note}, ensure_ascii=False, separators=(",", ":"))


def _hold(row: pool.Record, now: float) -> Hold:
    request: dict[str, Any] = json.loads(row["request"] or "{}")
    ends_in, asked_in = row["ends_in"], row["asked_in"]
    return Hold(
        reason=HoldKind(row["kind"]),
        until=None if ends_in is None else now + ends_in,
        since=now - row["held_for"],
        by=str(request.get("by") or "-"),
        asked_until=None if asked_in is None else now + asked_in,
        note=request.get("note"),
    )


@contextlib.contextmanager
def _writing(what: str) -> Iterator[None]:
    """As ``inbox.plainly``; a refused write names the grants a hold needs."""
    try:
        with inbox.plainly(what, OUTDATED):
            yield
    except errors.PermissionDenied as exc:
        raise errors.PermissionDenied(f"{exc.message}; {GRANT_HINT}") from exc.__cause__
