"""``semantics: webhook`` (the default): a provider's delivery, claimed by the event ID it carries.

A copy of an event in flight waits for the first one's outcome (at most claim_wait) and is then
answered as a duplicate, with the stored answer where the route replays; a copy whose body
differs is still a duplicate, only logged and counted as a mismatch. Where the signature covers
the body but not the ID (GitHub, Shopify, Twilio), the claim is bound to what is signed
(``bound``), and a body seen under another ID is reported (``RecentBodies``).

A signed body under a new event ID: GitHub and Shopify sign the body only; the ID is a header
beside it. A captured delivery can be re-sent with a new ID header, still validly signed, and is
then claimed and forwarded as a new event. The proxy cannot refuse it (a redelivery by the provider
looks the same, and GitHub sends one body to every hook subscribed to an event), but it can say so:
each worker remembers the digests of the last bodies it claimed on such a route, and a new claim
whose body it has seen under another ID is logged at warning level and counted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

from proxy import database, errors
from proxy.config import routes

if TYPE_CHECKING:
    from proxy import flights, semantics


# About 100 bytes each (digest, ID, order): a megabyte per route and worker.
CAPACITY = 10_000
# Between the event ID and the digest of what is signed, in a bound claim's ID (``bound``).
BOUND = "~"


class RecentBodies:
    """The event IDs the last ``capacity`` claimed bodies were claimed under, by (scope, digest)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[tuple[str, bytes], str] = OrderedDict()

    def claimed(self, scope: str, digest: bytes, event_id: str) -> str | None:
        """Remember that this body was claimed under ``event_id``; the other ID it was last
        claimed under, if any."""
        key = (scope, digest)
        previous = self._ids.pop(key, None)
        self._ids[key] = event_id
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return previous if previous != event_id else None


class WebhookSemantics:
    """A webhook route's side of ``semantics.Semantics``."""

    problem = False

    def __init__(self, route: routes.RouteConfig) -> None:
        self.bind_to_body = route.binds_claims
        self.recent_bodies = RecentBodies() if self.bind_to_body else None

    def handles(self, method: str) -> bool:
        return True  # a method the route does not take is answered 405

    def key(self, cycle: semantics.Cycle, query: str) -> tuple[str, database.Key]:
        event_id, event_type, digest = cycle.inspect(query)
        if not self.bind_to_body:
            return event_id, database.Key(cycle.scope, event_id, event_type, digest)
        claimed = bound(event_id, query, digest)
        return event_id, database.Key(cycle.scope, claimed, event_type, digest, event_id)

    def refuse_in_flight(self, in_flight: flights.Flights, key: database.Key) -> None:
        pass  # a copy waits for its turn

    def lock_wait(self, left: float) -> float:
        return max(0.001, left)

    def wait_exceeded(self, exc: errors.ClaimWaitExceeded) -> errors.RequestError:
        return exc

    def claimed_as(self, key: database.Key, event_id: str) -> str | None:
        if self.recent_bodies is None:
            return None
        return self.recent_bodies.claimed(key.scope, key.body_sha256, event_id)

    def signed_part(self, key: database.Key) -> str | None:
        if not self.bind_to_body:
            return None
        return BOUND + key.event_id.rpartition(BOUND)[2]

    def duplicate(self, key: database.Key, mismatch: bool) -> None:
        pass  # answered as one, mismatch or not


def bound(event_id: str, query: str, body_sha256: bytes) -> str:
    """The claim's ID on a route whose signature does not cover the event ID: the ID bound to
    a digest of what is signed (the body, and the query for Twilio, which signs the URL).

    A captured, validly signed request re-sent under another ID is then another claim: it can
    neither take a victim's stored answer nor, sent first under a future ID, swallow the
    genuine delivery. A provider's own retry sends the same bytes under the same ID, so it is
    still a duplicate. 128 bits of digest: an attacker holds only bodies the provider signed.
    """
    material = hashlib.sha256(b"%s\n%s" % (query.encode("utf-8", "surrogateescape"), body_sha256))
    return f"{event_id}{BOUND}{material.hexdigest()[: database.BOUND_DIGITS]}"
