"""PayPal's webhook events: the REST app's ``GET /v1/notifications/webhooks-events`` over the
window (``start_time``, ``end_time``), and ``POST /v1/notifications/webhooks-events/{event_id}/
resend`` to the route's webhook (tests/provider_api/ vendors the operations from
paypal/paypal-rest-api-specifications).

PayPal's description of an event says nothing of its deliveries: the list is every event of the
REST app, delivered or not, each with its ``id`` (the route's claim) and ``event_type``, in pages
of ``page_size`` (fewer may come), the next page named by the ``links`` entry whose ``rel`` is
``next``. Every event listed is a failed delivery as far as the reconciler can tell, and the
claims decide: one without a claim is a gap, recovered by asking PayPal to resend it to the
route's webhook (``webhook_ids``: ``reconcile.webhook_id``), which PayPal signs as ever. The list
being the app's, every webhook together, ``types`` narrows it to those the route's webhook
subscribes to: an event of another type is not resent whatever the API answers.

The API is read with an OAuth 2.0 access token (RFC 6749's client credentials grant, at the
description's ``tokenUrl``, ``/v1/oauth2/token``: the app's client ID and secret in HTTP basic
authentication), asked for at the run's first request and again when it is near its end
(``ClientCredentials``). The secret and the token go to ``api_url`` only: a next page is
followed on its origin, never through a redirect; neither is in a message, a log line or a
``repr``. An event's ID is of the form the description gives (letters and digits, at most 50;
and the hyphens PayPal's IDs have) before it goes into a URL; an answer otherwise is
``errors.ProviderRefused``.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import yarl

from proxy import errors
from proxy.config import reconcile
from proxy.providers_api import (
    Delivery,
    fetch_json,
    next_page,
    of_form,
    pages,
    reaching,
    send,
    session,
)

log = logging.getLogger(__name__)

# Asked for a page; PayPal's description sets no maximum and says fewer may come.
PAGE_SIZE = 100
# The pages one run reads at most.
MAX_PAGES = 1000
# A token with less than this left is asked for afresh.
RENEW_BEFORE = 60.0
# An event's ID: the resend operation's path parameter is described as letters and digits (at
# most 50), while the IDs PayPal sends have hyphens (``WH-58D3…-8HN6…``); neither goes further.
_EVENT_ID = re.compile(r"[a-zA-Z0-9-]{1,50}")
# An access token as RFC 6750 allows a bearer token (b64token), bounded.
_ACCESS_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]{1,4096}=*")


class ClientCredentials:
    """The REST app's access token: asked for with the client ID and secret, kept until
    ``RENEW_BEFORE`` from its ``expires_in``."""

    def __init__(self, settings: reconcile.Reconcile, session: aiohttp.ClientSession) -> None:
        self._url = settings.api_url.rstrip("/") + "/v1/oauth2/token"
        # HTTP basic authentication, as PayPal's own examples send it (curl -u id:secret).
        pair = f"{settings.client_id}:{settings.client_secret}".encode()
        self._basic = "Basic " + base64.b64encode(pair).decode("ascii")
        self._client_id = settings.client_id
        self._session = session
        self._token = ""
        self._expires = 0.0

    def __repr__(self) -> str:
        return f"ClientCredentials(client_id={self._client_id!r}, client_secret=<masked>)"

    async def authorization(self) -> dict[str, str]:
        if not self._token or self._expires - time.monotonic() < RENEW_BEFORE:
            self._token, lifetime = await self._ask()
            self._expires = time.monotonic() + lifetime
        return {"Authorization": f"Bearer {self._token}"}

    async def _ask(self) -> tuple[str, float]:
        what = "asking PayPal for an access token"
        with reaching(what):
            request = self._session.post(
                self._url,
                data={"grant_type": "client_credentials"},
                headers={"Authorization": self._basic},
                allow_redirects=False,
            )
            answer, _ = await fetch_json(request, what)
            token, kind, lifetime = (
                answer["access_token"], answer["token_type"], answer["expires_in"]
            )  # fmt: skip
        # Not through ``reaching``: its message would quote the answer, the token in it.
        if not isinstance(token, str) or not _ACCESS_TOKEN.fullmatch(token):
            raise errors.ProviderRefused(f"{what}: access_token is not a bearer token")
        if not isinstance(kind, str) or kind.lower() != "bearer":
            raise errors.ProviderRefused(f"{what}: token_type is not Bearer")
        if isinstance(lifetime, bool) or not isinstance(lifetime, int) or lifetime <= 0:
            raise errors.ProviderRefused(f"{what}: expires_in is not a positive integer")
        return token, float(lifetime)


class WebhookEvents:
    """The REST app's webhook events, each without a claim resent to the route's webhook."""

    def __init__(self, settings: reconcile.Reconcile, *, user_agent: str) -> None:
        self._settings = settings
        self._api = settings.api_url.rstrip("/")
        self._session = session({"Accept": "application/json", "User-Agent": user_agent})
        self._credentials = ClientCredentials(settings, self._session)
        self.truncated = False

    async def close(self) -> None:
        await self._session.close()

    async def deliveries(self, since: float) -> AsyncIterator[Delivery]:
        """Each event created at or after ``since`` (of ``types``, if given), once."""
        query = {
            "page_size": str(PAGE_SIZE),
            "start_time": _stamp(since),
            "end_time": _stamp(time.time()),
        }
        if len(self._settings.types) == 1:
            query["event_type"] = self._settings.types[0]
        url = str(yarl.URL(f"{self._api}/v1/notifications/webhooks-events").with_query(query))
        seen: set[str] = set()
        others = 0
        found: list[Delivery] = []
        async for page in pages(self, url, self._page, max_pages=MAX_PAGES):
            with reaching("listing the app's webhook events"):
                for item in page:
                    delivery = self._delivery(item)
                    if delivery is None:
                        others += 1
                    elif delivery.event_id not in seen:  # listed twice: the list shifted
                        seen.add(delivery.event_id)
                        found.append(delivery)
        if others:
            log.info("PayPal listed %d event(s) of types the route does not ask for "
                     "(reconcile.types): not resent", others)  # fmt: skip
        for delivery in found:
            yield delivery

    def _delivery(self, item: dict[str, Any]) -> Delivery | None:
        event_id = of_form(
            item["id"], _EVENT_ID, "an event's id is not of PayPal's form (letters and digits)"
        )
        kind = item["event_type"]
        if not isinstance(kind, str):
            raise ValueError("an event's event_type is not a string")
        if self._settings.types and kind not in self._settings.types:
            return None
        return Delivery(
            event_id=event_id,
            ref=event_id,
            event=kind,
            at=_time(item["create_time"]),
            delivered=False,
            status="listed (PayPal says nothing of its deliveries)",
        )

    async def _page(self, url: str) -> tuple[list[dict[str, Any]], str | None]:
        what = "listing the app's webhook events"
        authorization = await self._credentials.authorization()
        with reaching(what):
            request = self._session.get(url, headers=authorization, allow_redirects=False)
            page, _ = await fetch_json(request, what)
            events, links = page["events"], page.get("links") or []
            if not isinstance(events, list) or not isinstance(links, list):
                raise ValueError("the events are not an event list")
            following = [link["href"] for link in links if link["rel"] == "next"]
            if not following or not events:
                return events, None
            if not isinstance(following[0], str):
                raise ValueError("the next link's href is not a URL")
            return events, next_page(url, following[0], self._settings.api_url, what)

    async def recover(self, delivery: Delivery) -> None:
        what = f"resending event {delivery.ref} to webhook {self._settings.webhook_id}"
        if not _EVENT_ID.fullmatch(delivery.ref):
            raise errors.ProviderRefused(f"{what}: not an event's ID of PayPal's form")
        authorization = await self._credentials.authorization()
        with reaching(what):
            request = self._session.post(
                f"{self._api}/v1/notifications/webhooks-events/{delivery.ref}/resend",
                json={"webhook_ids": [self._settings.webhook_id]},
                headers=authorization,
                allow_redirects=False,
            )
            await send(request, what)


def _stamp(moment: float) -> str:
    """time.time() in RFC 3339, as the description's example (``2013-03-06T11:00:00Z``)."""
    return datetime.fromtimestamp(int(moment), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _time(text: object) -> float:
    if not isinstance(text, str):
        raise ValueError(f"not a time: {text!r:.50}")
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
