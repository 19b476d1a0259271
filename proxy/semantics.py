"""What a route's ``semantics`` decides, and what it sees of a request: the one interface the
two semantics (``webhooks``, ``idempotency``) implement and ``pipeline`` calls, in a module of
its own so that neither implementation imports the pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from proxy import database, errors, flights


class Cycle(Protocol):
    """One request as a route's semantics see it (``pipeline.Cycle`` is one)."""

    request: web.Request
    scope: str  # the route's scope for this request's path
    target: str  # the path and query forwarded

    def inspect(self, query: str) -> tuple[str, str | None, bytes]:
        """Verify the signature; the event ID and type, and the body's digest."""


class Semantics(Protocol):
    """What a route's ``semantics`` decides, behind one interface as uvicorn's two HTTP
    implementations are: ``webhooks.WebhookSemantics`` or
    ``idempotency.IdempotencyKeySemantics``. The claim itself is the same for both."""

    problem: bool  # errors answered as RFC 9457 problem details

    def handles(self, method: str) -> bool:
        """Whether a request with ``method`` is the route's to claim (else pass-through)."""

    def key(self, cycle: Cycle, query: str) -> tuple[str, database.Key]:
        """The event ID as the log line and the acknowledgement show it, and what the request
        claims; EventIdMissing (or a subclass) when it carries none."""

    def refuse_in_flight(self, in_flight: flights.Flights, key: database.Key) -> None:
        """Before its turn: raise if a copy of ``key`` in this process is not waited for."""

    def lock_wait(self, left: float) -> float:
        """How long to wait on the row lock of a copy, ``left`` seconds of claim_wait left."""

    def wait_exceeded(self, exc: errors.ClaimWaitExceeded) -> errors.RequestError:
        """What to answer when that wait ran out."""

    def claimed_as(self, key: database.Key, event_id: str) -> str | None:
        """Once claimed: the other ID this body was last claimed under, worth a warning."""

    def signed_part(self, key: database.Key) -> str | None:
        """On a route whose claims are bound to what is signed (the signature does not cover
        the ID): the claim ID's part bound to the signed body, which the inbox keeps once
        (a replay of the body under another ID is not kept again); else None."""

    def duplicate(self, key: database.Key, mismatch: bool) -> None:
        """Raise if a duplicate (``mismatch``: of another body) is not answered as one."""
