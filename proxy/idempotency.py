"""``semantics: idempotency-key``: an API route keyed by the client's ``Idempotency-Key``.

What differs from a webhook route is how the request maps onto a claim; the claim itself is the
same. The key is an RFC 8941 string or the same characters bare; its scope is the route's plus
a hash of the client's ``scope_from`` headers, so clients have key spaces of their own; and the
claim's digest is the request's fingerprint (method, target and body), so a key sent again with
another request is told apart (422) from a retry (the stored answer). A key in flight is
answered 409 at once, in this process and at another proxy's row lock, never waited for.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

from proxy import database, errors, event_ids
from proxy.config import routes

if TYPE_CHECKING:
    from proxy import flights, semantics

# RFC 8941 sf-string characters (printable ASCII; '"' and '\' only escaped).
_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_BARE_KEY = re.compile(r"[\x20\x21\x23-\x5b\x5d-\x7e]+")
_ESCAPE = re.compile(r"\\(.)")


class IdempotencyKeySemantics:
    """An idempotency-key route's side of ``semantics.Semantics``."""

    problem = True  # API clients parse RFC 9457 problem details

    def __init__(self, route: routes.RouteConfig) -> None:
        self.route = route

    def handles(self, method: str) -> bool:
        # The route's other methods are pass-through traffic, unclaimed whatever they carry.
        return method in self.route.methods

    def key(self, cycle: semantics.Cycle, query: str) -> tuple[str, database.Key]:
        """The key, in the client's own scope, with the request's fingerprint as its digest;
        the event ID's errors named as the key's."""
        route = self.route
        try:
            sent, event_type, digest = cycle.inspect(query)
        except errors.EventIdMissing as exc:
            raise errors.KeyMissing(exc.message) from None
        except errors.EventIdInvalid as event_id_invalid:
            if type(event_id_invalid) is errors.EventIdInvalid:
                raise errors.KeyInvalid(event_id_invalid.message) from None
            raise
        request = cycle.request
        event_id = key(sent, route.name)
        scope = client_scope(cycle.scope, route.scope_from, request.headers, route.name)
        digest = fingerprint(request.method, cycle.target, digest)
        return event_id, database.Key(scope, event_id, event_type, digest)

    def refuse_in_flight(self, in_flight: flights.Flights, key: database.Key) -> None:
        # Answered at once, here and (a lock wait of 0) at the row lock.
        if in_flight.waiting((key.scope, key.event_id)):
            raise errors.KeyInProgress(f"route {self.route.name!r}: key in flight here")

    def lock_wait(self, left: float) -> float:
        return 0.0

    def wait_exceeded(self, exc: errors.ClaimWaitExceeded) -> errors.RequestError:
        return errors.KeyInProgress(f"route {self.route.name!r}: key in flight at another proxy")

    def claimed_as(self, key: database.Key, event_id: str) -> str | None:
        return None  # the fingerprint binds the key to its body already

    def signed_part(self, key: database.Key) -> str | None:
        return None  # a route with this semantics redelivers nothing

    def duplicate(self, key: database.Key, mismatch: bool) -> None:
        if mismatch:
            # The key names another request (method, target or body): never its answer.
            raise errors.KeyReused(f"route {self.route.name!r}: key {key.event_id!r} reused")


def key(value: str, route: str) -> str:
    """An ``Idempotency-Key`` as the key it names: an RFC 8941 string (``"abc"``) or the same
    characters bare (``abc``), one key either way; KeyInvalid for anything else."""
    quoted = _SF_STRING.fullmatch(value)
    if quoted is not None:
        parsed = _ESCAPE.sub(r"\1", quoted.group(1))
    elif _BARE_KEY.fullmatch(value):
        parsed = value
    else:
        raise errors.KeyInvalid(
            f"route {route!r}: Idempotency-Key must be an RFC 8941 string of printable ASCII"
        )
    if not parsed or len(parsed) > event_ids.MAX_ID_BYTES:
        raise errors.KeyInvalid(
            f"route {route!r}: Idempotency-Key must be 1 to {event_ids.MAX_ID_BYTES} characters"
        )
    return parsed


def client_scope(
    scope: str, sources: tuple[event_ids.Source, ...], headers: event_ids.MultiMapping, route: str
) -> str:
    """The scope of one client's keys: its ``scope_from`` headers as sent (any length: a JWT
    runs to kilobytes), hashed, so no client can replay or block another's keys. The claim's
    scope holds the hash; logs show the route's scope only. ClientUnidentified if one is
    absent, repeated, or named by Connection (the app would not receive it)."""
    try:
        event_ids.refuse_connection_naming(headers, (source.name for source in sources), route)
    except errors.EventIdInvalid as exc:
        raise errors.ClientUnidentified(exc.message) from None
    values = []
    for source in sources:
        sent = headers.getall(source.name, [])
        if len(sent) != 1:
            problem = "absent" if not sent else "repeated"
            raise errors.ClientUnidentified(f"route {route!r}: {source} {problem}")
        values.append(sent[0])
    identity = "\n".join(values).encode("utf-8", "surrogateescape")
    return f"{scope}/~{hashlib.sha256(identity).hexdigest()[:32]}"


def fingerprint(method: str, target: str, body_sha256: bytes) -> bytes:
    """What a key stands for: the method, the path and query, and the body."""
    return hashlib.sha256(b"%s %s\n%s" % (method.encode(), target.encode(), body_sha256)).digest()
