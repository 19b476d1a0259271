"""GitHub's hook deliveries: a repository's, an organization's or a GitHub App's hook, over the
REST API (``GET {hook}/deliveries``, ``POST {hook}/deliveries/{id}/attempts``; tests/provider_api/
vendors the operations from github/rest-api-description). A repository's or an organization's
hook is read with a token; an App's (``/app/hook``) with a JWT the App signs (``github_app``).

The log lists every attempt, newest first, a page of up to 100 at a time, the next page named
by the ``Link`` header's ``rel="next"`` (a ``cursor`` parameter). An event (a GUID) can appear
several times: its first attempt and each redelivery. It was delivered if any attempt was
(``status`` "OK" and a 2xx ``status_code``); else it is a gap, recovered by asking GitHub to
redeliver its newest attempt: GitHub then sends the event again, the same GUID under the same
hook, signed as ever, and the proxy claims it like any other.

A next page is followed only on ``api_url``'s origin (the token goes with it), and an attempt's
``id`` is a number before it is put in the redelivery's URL; an answer otherwise is
``errors.ProviderRefused``, as one not as GitHub describes it.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from proxy import errors, event_ids
from proxy.config import reconcile
from proxy.providers_api import (
    Delivery,
    fetch_json,
    github_app,
    next_page,
    pages,
    reaching,
    send,
    session,
)

API_VERSION = "2022-11-28"
PER_PAGE = 100
# The pages one run reads at most (GitHub keeps 3 days): 100,000 attempts.
MAX_PAGES = 1000
_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="next"')
# A delivery's ID as GitHub gives it: an integer (it goes into the redelivery's URL).
_DELIVERY_ID = re.compile(r"[0-9]{1,20}")


class HookDeliveries:
    """The deliveries of one GitHub hook (``reconcile.hook``)."""

    def __init__(self, settings: reconcile.Reconcile, *, user_agent: str) -> None:
        self._settings = settings
        self._hook = settings.api_url.rstrip("/") + settings.hook
        self._app = (
            None if settings.app is None else github_app.AppJWT(settings.app, settings.private_key)
        )
        self._session = session(
            {
                "Accept": "application/vnd.github+json",
                "X-GitHub-Api-Version": API_VERSION,
                "User-Agent": user_agent,
            }
        )
        self.truncated = False

    async def close(self) -> None:
        await self._session.close()

    def _authorization(self) -> dict[str, str]:
        """The token, or the App's JWT (signed afresh when it is near its end)."""
        bearer = self._settings.token if self._app is None else self._app.bearer()
        return {"Authorization": f"Bearer {bearer}"}

    async def deliveries(self, since: float) -> AsyncIterator[Delivery]:
        """Each GUID attempted at or after ``since`` once, its attempts taken together (all of
        them within the window: the log is read to its end before any is yielded)."""
        events: dict[str, list[dict[str, Any]]] = {}
        url = f"{self._hook}/deliveries?per_page={PER_PAGE}"
        async for page in pages(self, url, self._page, max_pages=MAX_PAGES):
            older = False
            with reaching("listing the hook's deliveries"):
                for attempt in page:
                    if _time(attempt["delivered_at"]) < since:
                        older = True  # newest first: the rest of the log is older still
                        continue
                    events.setdefault(str(attempt["guid"]), []).append(attempt)
            if older:
                break
        with reaching("listing the hook's deliveries"):
            found = [self._delivery(guid, attempts) for guid, attempts in events.items()]
        for delivery in found:
            yield delivery

    def _delivery(self, guid: str, attempts: list[dict[str, Any]]) -> Delivery:
        newest = attempts[0]
        ref = newest["id"]
        if isinstance(ref, bool) or not _DELIVERY_ID.fullmatch(str(ref)):
            raise ValueError("a delivery's id is not a number")
        return Delivery(
            event_id=event_ids.join([str(self._settings.hook_id), guid]),
            ref=str(ref),
            event=str(newest.get("event") or ""),
            at=_time(newest["delivered_at"]),
            delivered=any(_succeeded(attempt) for attempt in attempts),
            status=f"{newest.get('status_code')} {newest.get('status')}",
            attempts=len(attempts),
        )

    async def _page(self, url: str) -> tuple[list[dict[str, Any]], str | None]:
        what = "listing the hook's deliveries"
        with reaching(what):
            page, headers = await fetch_json(
                self._session.get(url, headers=self._authorization()), what
            )
            following = _NEXT.search(headers.get("Link", ""))
            if not isinstance(page, list):
                raise ValueError("the deliveries are not a list")
            if following is None:
                return page, None
            return page, next_page(url, following[1], self._settings.api_url, what)

    async def recover(self, delivery: Delivery) -> None:
        what = f"redelivering delivery {delivery.ref}"
        if not _DELIVERY_ID.fullmatch(delivery.ref):
            raise errors.ProviderRefused(f"{what}: a delivery's id is not a number")
        with reaching(what):
            attempts = f"{self._hook}/deliveries/{delivery.ref}/attempts"
            await send(self._session.post(attempts, headers=self._authorization()), what)


def _succeeded(attempt: dict[str, Any]) -> bool:
    code = attempt.get("status_code")
    return attempt.get("status") == "OK" and isinstance(code, int) and 200 <= code < 300


def _time(text: object) -> float:
    """An ISO 8601 time (``2021-06-03T23:23:49Z``) as time.time()."""
    if not isinstance(text, str):
        raise ValueError(f"not a time: {text!r}")
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
