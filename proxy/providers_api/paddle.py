"""Paddle Billing's failed notifications: a notification destination's ``GET /notifications``
with ``status=failed``, and ``POST /notifications/{notification_id}/replay``
(tests/provider_api/ vendors the operations from PaddleHQ/paddle-openapi).

Paddle keeps a notification per event and destination for 90 days, and lists them newest first
(``order_by`` ``id[DESC]``), up to 200 a page, the next page named by ``meta.pagination.next``
(a URL with an ``after`` cursor) while ``meta.pagination.has_more``. ``failed`` is a
notification Paddle tried and will not try again. Its ``payload`` is the event the webhook
carries, whose ``event_id`` is the route's claim; a gap is recovered by asking Paddle to replay
the notification: Paddle then sends the event again (a new notification, the same
``event_id``), signed as ever, and the proxy claims it like any other. A replayed notification
can not be replayed again: an event's ``origin: event`` notification is the one asked for.

The API key goes as a bearer token to ``api_url`` only: a next page is followed on its origin,
and never through a redirect. A notification's and an event's ID are of the form Paddle's
description gives (``ntf_`` and ``evt_`` and 26 lower-case letters or digits) before the first
goes into a URL; an answer otherwise is ``errors.ProviderRefused``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

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

# Paddle's page size at most.
PER_PAGE = 200
# The pages one run reads at most: 200,000 notifications.
MAX_PAGES = 1000
_NOTIFICATION_ID = re.compile(r"ntf_[a-z0-9]{26}")
_EVENT_ID = re.compile(r"evt_[a-z0-9]{26}")


class FailedNotifications:
    """The failed notifications of one notification destination (``notification_setting_id``)."""

    def __init__(self, settings: reconcile.Reconcile, *, user_agent: str) -> None:
        self._settings = settings
        self._api = settings.api_url.rstrip("/")
        self._session = session(
            {
                "Authorization": f"Bearer {settings.token}",
                "Accept": "application/json",
                "User-Agent": user_agent,
            }
        )
        self.truncated = False

    async def close(self) -> None:
        await self._session.close()

    async def deliveries(self, since: float) -> AsyncIterator[Delivery]:
        """Each event with a notification that failed at or after ``since``, once (its
        ``origin: event`` notification, which a replay is asked of)."""
        start = datetime.fromtimestamp(since, UTC).isoformat(timespec="seconds")
        url = str(
            yarl.URL(f"{self._api}/notifications").with_query(
                status="failed",
                notification_setting_id=self._settings.notification_setting_id,
                **{"from": start.replace("+00:00", "Z")},
                per_page=str(PER_PAGE),
            )
        )
        events: dict[str, Delivery] = {}
        async for page in pages(self, url, self._page, max_pages=MAX_PAGES):
            with reaching("listing the destination's failed notifications"):
                for item in page:
                    delivery = _delivery(item)
                    if delivery is None:
                        continue
                    known = events.get(delivery.event_id)
                    if known is None or (known.ref == "" and delivery.ref):
                        events[delivery.event_id] = delivery
        for delivery in events.values():
            if delivery.ref:  # only replays of it listed: its own notification was delivered
                yield delivery

    async def _page(self, url: str) -> tuple[list[dict[str, Any]], str | None]:
        what = "listing the destination's failed notifications"
        with reaching(what):
            page, _ = await fetch_json(self._session.get(url, allow_redirects=False), what)
            pagination = page["meta"]["pagination"]
            if not isinstance(page["data"], list) or not isinstance(pagination["has_more"], bool):
                raise ValueError("the notifications are not a paginated list")
            if not pagination["has_more"] or not page["data"]:
                return page["data"], None
            following = pagination["next"]
            if not isinstance(following, str):
                raise ValueError("meta.pagination.next is not a URL")
            api_url = self._settings.api_url
            after = next_page(url, following, api_url, what, credential="the API key")
        return page["data"], after

    async def recover(self, delivery: Delivery) -> None:
        what = f"replaying notification {delivery.ref}"
        if not _NOTIFICATION_ID.fullmatch(delivery.ref):
            raise errors.ProviderRefused(f"{what}: not a notification's ID (ntf_...)")
        with reaching(what):
            replay = f"{self._api}/notifications/{delivery.ref}/replay"
            await send(self._session.post(replay, allow_redirects=False), what)


def _delivery(item: dict[str, Any]) -> Delivery | None:
    """The notification as an event to recover (``ref`` "" for a replay's, which cannot be
    replayed); None for one not failed (an API that answers more than it was asked)."""
    notification_id, payload = item["id"], item["payload"]
    notification_id = of_form(
        notification_id, _NOTIFICATION_ID, "a notification's id is not of Paddle's form (ntf_...)"
    )
    event_id = of_form(
        payload["event_id"],
        _EVENT_ID,
        "a notification's payload.event_id is not of Paddle's form (evt_...)",
    )
    status, origin, attempted = item["status"], item["origin"], item.get("times_attempted")
    if status != "failed":
        return None
    if origin not in ("event", "replay"):
        raise ValueError(f"a notification's origin is not event or replay: {origin!r:.50}")
    return Delivery(
        event_id=event_id,
        ref=notification_id if origin == "event" else "",
        event=str(item.get("type") or ""),
        at=_time(item.get("last_attempt_at") or item["occurred_at"]),
        delivered=False,
        status=f"{status}",
        attempts=attempted if isinstance(attempted, int) and attempted > 0 else 1,
    )


def _time(text: object) -> float:
    """An RFC 3339 time (``2024-04-12T10:18:48.294633Z``) as time.time()."""
    if not isinstance(text, str):
        raise ValueError(f"not a time: {text!r:.50}")
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
