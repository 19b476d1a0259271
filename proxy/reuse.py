"""A signed body arriving under a new event ID, on routes whose signature does not cover the ID.

GitHub and Shopify sign the body only; the ID is a header beside it. A captured delivery can be
re-sent with a new ID header, still validly signed, and is then claimed and forwarded as a new
event. The proxy cannot refuse it (a redelivery by the provider looks the same, and GitHub sends
one body to every hook subscribed to an event), but it can say so: each worker remembers the
digests of the last bodies it claimed on such a route, and a new claim whose body it has seen
under another ID is logged at warning level and counted.
"""

from __future__ import annotations

from collections import OrderedDict

# About 100 bytes each (digest, ID, order): a megabyte per route and worker.
CAPACITY = 10_000


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
