"""``on_duplicate: replay``: the app's first 2xx answer, as stored with the claim and replayed.

The answer is taken here from what the app sent (its end-to-end headers, in order, repeated
ones kept, and its body), stored by the claim store in the COMMIT's round trip, and turned back
into a response for each duplicate. What is never replayed: ``Date`` (a new response),
``Content-Length`` (recomputed), the proxy's own headers, and ``Set-Cookie`` unless the route
allows it (a cookie set for the first request is not for whoever sends a copy). Hop-by-hop
headers never reach here (forwarder.response_headers drops them).
"""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from proxy import database
from proxy.config import routes
from proxy.upstream import http1

_NOT_REPLAYED = frozenset({"date", "content-length", "dedup-status", "idempotent-replayed"})
_NOT_REPLAYED_COOKIE = _NOT_REPLAYED | {"set-cookie"}


def storable(value: str) -> bool:
    """Whether a header value can be stored as (jsonb) text: UTF-8, no NUL."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # surrogate escapes of bytes that were not UTF-8
        return False
    return "\x00" not in value


def answer_to_store(
    route: routes.RouteConfig, upstream: http1.Answer
) -> tuple[database.Answer | None, str | None]:
    """The answer to store with the claim, or None and why not (None, None: no replay)."""
    if not route.replay:
        return None, None
    if len(upstream.body) > route.replay_max_body:
        # Relayed and committed all the same; its duplicates get the acknowledgement.
        return None, f"answer of {len(upstream.body)} bytes over replay_max_body"
    dropped = _NOT_REPLAYED if route.replay_set_cookie else _NOT_REPLAYED_COOKIE
    headers = tuple(
        (name, value) for name, value in upstream.headers.items() if name.lower() not in dropped
    )
    if not all(storable(value) for _, value in headers):
        # Stored as text: a value that is not UTF-8 would fail the COMMIT's round trip after
        # the app did the work.
        return None, "an answer header that is not UTF-8 text"
    return database.Answer(upstream.status, headers, upstream.body), None


def response(stored: database.Answer) -> web.Response:
    """A duplicate's answer: the first one, byte for byte; Content-Length is aiohttp's to set."""
    headers = CIMultiDict(stored.headers)
    headers["Dedup-Status"] = "duplicate"
    headers["Idempotent-Replayed"] = "true"
    return web.Response(status=stored.status, headers=headers, body=stored.body)
