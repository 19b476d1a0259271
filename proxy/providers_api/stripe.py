"""Stripe's events not delivered: the account's ``GET /v1/events`` with ``delivery_success=false``
(tests/provider_api/ vendors the operation from stripe/openapi).

Stripe keeps no per-endpoint log a client can read, and has no API to ask for a redelivery; it
lists the account's events of the last 30 days, newest first, up to 100 a page, the next page
asked for with ``starting_after`` (the last event's ID) while ``has_more``. With
``delivery_success=false`` the list holds the events whose delivery to some endpoint is still
pending or failed every attempt. Each is a gap if the route has no claim of its ``id``; it is
recovered the way Stripe documents for undelivered events: the event object itself (the API's
event is the object a webhook carries), sent to the route by the proxy, signed with the
route's endpoint secret in Stripe's scheme (``Stripe-Signature: t=<now>,v1=<HMAC-SHA256>``),
so that the route verifies, claims and forwards it as any delivery.

Stripe's answers are translated as every provider's (``providers_api.answered``); the route's
own answer to a recovered event is not the provider's, and a non-2xx one is
``errors.RecoveryRefused``. Since the proxy signs what it sends, what the API lists is checked
first: an event's ``id`` of Stripe's form (``evt_…``), and, with ``types``, an event of another
type is not listed (nor signed, nor sent) whatever the API answers.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp

from proxy import errors
from proxy.config import reconcile
from proxy.providers_api import Delivery, fetch_json, of_form, pages, reaching, session

log = logging.getLogger(__name__)

# Stripe's page size at most.
LIMIT = 100
# The pages one run reads at most: 100,000 events.
MAX_PAGES = 1000
# An event's ID as Stripe gives it.
_EVENT_ID = re.compile(r"evt_[A-Za-z0-9]{1,250}")


class UndeliveredEvents:
    """The account's events that Stripe has not delivered to every endpoint."""

    def __init__(self, settings: reconcile.Reconcile, *, user_agent: str) -> None:
        self._settings = settings
        self._url = settings.api_url.rstrip("/") + "/v1/events"
        self._user_agent = user_agent
        # The event objects listed, by ID: what ``recover`` sends.
        self._events: dict[str, dict[str, Any]] = {}
        self._api = session({"Authorization": f"Bearer {settings.token}", "User-Agent": user_agent})
        self._route = session()
        self.truncated = False

    async def close(self) -> None:
        await self._api.close()
        await self._route.close()

    async def deliveries(self, since: float) -> AsyncIterator[Delivery]:
        """Each event created at or after ``since`` that is not delivered everywhere, once."""
        query: list[tuple[str, str]] = [
            ("delivery_success", "false"),
            ("created[gte]", str(int(since))),
            ("limit", str(LIMIT)),
            *(("types[]", kind) for kind in self._settings.types),
        ]
        seen: set[str] = set()
        async for listed in pages(self, query, self._page, max_pages=MAX_PAGES):
            if None in listed:
                log.warning("Stripe listed %d event(s) of types the route does not ask for "
                            "(reconcile.types): not delivered", listed.count(None))  # fmt: skip
            for delivery in listed:
                if delivery is None or delivery.event_id in seen:
                    continue  # not asked for; or listed twice, the list shifted meanwhile
                seen.add(delivery.event_id)
                yield delivery

    def _delivery(self, item: dict[str, Any]) -> Delivery | None:
        """The event as a delivery to recover; None for a type the route did not ask for."""
        event_id = of_form(item["id"], _EVENT_ID, "an event's id is not of Stripe's form (evt_...)")
        kind = item.get("type")
        if self._settings.types and kind not in self._settings.types:
            return None
        self._events[event_id] = item
        return Delivery(
            event_id=event_id,
            ref=event_id,
            event=str(kind or ""),
            at=float(item["created"]),
            delivered=False,
            status=f"pending_webhooks {item.get('pending_webhooks')}",
        )

    async def _page(
        self, query: list[tuple[str, str]]
    ) -> tuple[list[Delivery | None], list[tuple[str, str]] | None]:
        """A page's events as deliveries (None for a type not asked for), and the query of the
        next page (None: the last)."""
        what = "listing the account's undelivered events"
        with reaching(what):
            page, _ = await fetch_json(self._api.get(self._url, params=query), what)
            if not (
                isinstance(page, dict)
                and isinstance(page.get("data"), list)
                and isinstance(page.get("has_more"), bool)
            ):
                raise ValueError("the events are not a list object")
            listed = [self._delivery(item) for item in page["data"]]
        if not page["has_more"] or not page["data"]:
            return listed, None
        after = str(page["data"][-1]["id"])
        first = [(key, value) for key, value in query if key != "starting_after"]
        return listed, [*first, ("starting_after", after)]

    async def recover(self, delivery: Delivery) -> None:
        """The event object, signed now with the route's secret, POSTed to the route."""
        body = json.dumps(self._events[delivery.ref], indent=2).encode()
        stamp = str(int(time.time()))
        signature = hmac.new(
            self._settings.signing_secret, f"{stamp}.".encode() + body, hashlib.sha256
        ).hexdigest()
        headers = {
            "Content-Type": "application/json; charset=utf-8",
            "Stripe-Signature": f"t={stamp},v1={signature}",
            "User-Agent": self._user_agent,
        }
        what = f"delivering event {delivery.ref} to {self._settings.deliver_to}"
        with _to_route(what):
            async with self._route.post(
                self._settings.deliver_to, data=body, headers=headers
            ) as response:
                if not 200 <= response.status < 300:
                    raise errors.RecoveryRefused(
                        f"{what}: the route answered {response.status} (its signature check, "
                        "the database or the app: the proxy's log line for the event says which)",
                        status=response.status,
                    )


@contextlib.contextmanager
def _to_route(what: str) -> Iterator[None]:
    """The route not reached (aiohttp's client errors, a timeout) as ``RecoveryRefused``."""
    try:
        yield
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise errors.RecoveryRefused(f"{what}: {exc!r}") from exc
