"""An ordered route's object: which object a request is about, and its version.

A route with ``order`` (``config.order``) names where a request carries its object's key and,
optionally, its version; ``Orderer.object_of`` reads them as ``event_ids`` reads an event ID
(the same sources, the same refusals of ambiguous input). A request without a readable key is
delivered unordered, as any route's: ordering is per object, and it names none. A version is a
number (Stripe's ``created``, whole seconds) or an RFC 3339 time (Paddle's ``occurred_at``,
Shopify's ``X-Shopify-Triggered-At``); one that is neither is no version (the delivery is still
ordered by arrival, and never superseded). Versions are compared as exact decimals of seconds.
"""

from __future__ import annotations

import decimal
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from proxy import errors, event_ids
from proxy.config import order as ordering

log = logging.getLogger(__name__)

# Beyond this many characters a "version" is no number a provider sends: not one.
_MAX_DIGITS = 40


@dataclass(frozen=True, slots=True)
class Object:
    """The object a delivery is about: its key, its version as an exact decimal string (None:
    none given, or not one that reads as a number or a time), and whether this event's type is
    one the route supersedes."""

    key: str
    version: str | None = None
    supersedes: bool = False
    unparsed: str | None = None  # a version given that is neither a number nor a time


def parse_version(text: str) -> str | None:
    """A version as an exact decimal number of seconds (or of whatever unit the number is in),
    or None: an integer or decimal as it is; an RFC 3339 time as seconds since the epoch, to the
    microsecond."""
    text = text.strip()
    try:
        number = decimal.Decimal(text)
    except decimal.InvalidOperation:
        number = None
    if number is not None:
        exact = format(number, "f") if number.is_finite() else ""
        return exact if exact and len(exact) <= _MAX_DIGITS else None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None  # a time without an offset is a different instant to each reader
    delta = moment.astimezone(UTC) - datetime(1970, 1, 1, tzinfo=UTC)
    micros = (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds
    return format(decimal.Decimal(micros).scaleb(-6), "f")


class Orderer:
    """Reads one ordered route's object from its requests."""

    __slots__ = ("_extractor", "_supersede")

    def __init__(self, route: str, order: ordering.Order) -> None:
        # The key as an event ID is read (required), the version as an event type (optional).
        self._extractor = event_ids.Extractor(route, order.key, order.version)
        self._supersede = frozenset(order.supersede)

    def object_of(
        self, headers: event_ids.MultiMapping, query: str, body: bytes, event_type: str | None
    ) -> Object | None:
        """The request's object (None: it names none that can be read unambiguously)."""
        try:
            key, raw = self._extractor.extract(headers, query, body)
        except (errors.EventIdMissing, errors.EventIdInvalid):
            return None
        version = None if raw is None else parse_version(raw)
        return Object(
            key,
            version,
            supersedes=version is not None and event_type in self._supersede,
            unparsed=raw if raw is not None and version is None else None,
        )
