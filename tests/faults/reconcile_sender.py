"""The fault campaign's ``--reconcile`` mode: a sender like GitHub's, which never retries, and a
stand-in of GitHub's hook deliveries API that the replicas' reconciler reads.

The provider (``campaign.OneShotProvider``) signs each send as GitHub does (``X-GitHub-Delivery``
the event's ID as its GUID, ``X-GitHub-Hook-ID``, ``X-Hub-Signature-256``) and logs it in the
stand-in (``CampaignHook``, a ``tests.provider_standins.GitHubHook``) with the proxy's answer: a
2xx is ``OK``, anything else (a 5xx, a cut connection, the provider's time-out) failed. The route
is GitHub's preset with ``reconcile:`` pointing its ``api_url`` at the stand-in, every
``EVERY`` seconds over the last ``SINCE``; asked to redeliver, the stand-in has the provider send
the event again (the same GUID, signed as ever) to a replica seen listening, as a copy, after its
``202`` (GitHub queues a redelivery), and logs that attempt too.

After the nemesis the campaign waits (``settle``, bounded) until every event sent has reached the
app, and then for one reconcile run more that finds no gap, the database healthy. The rules the
checker adds are ``reconcile_rules``'; the proxy's claim IDs (``{hook}:{guid}``, bound to the
body: ``…~digest``) are the campaign's event IDs again by ``campaign_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from proxy import webhooks
from tests.faults import checker, reconcile_rules
from tests.provider_standins import Attempt, GitHubHook

HOOK_ID = 1
SECRET = "campaign-github-secret"
TOKEN = "github_pat_campaign_stand_in"
EVERY = 10.0  # the reconciler's period: the shortest the configuration allows
SINCE = "1h"  # the look-back: longer than any campaign
EVENT = "push"


def route(base: Mapping[str, Any], api_url: str, every: float = EVERY) -> dict[str, Any]:
    """``base`` (the campaign's route) as a GitHub route that reconciles against ``api_url``."""
    settings = {key: value for key, value in base.items() if key != "event_id"}
    return {
        **settings,
        "preset": "github",
        "verify": {"secret": SECRET},
        "reconcile": {
            "every": f"{every:g}s",
            "since": SINCE,
            "repository": "camp/app",
            "hook_id": HOOK_ID,
            "token": TOKEN,
            "api_url": api_url,
        },
    }


def campaign_id(claim_id: str) -> str:
    """The campaign's event ID of the proxy's ``{hook}:{guid}`` (bound to the body or not)."""
    plain = claim_id.partition(webhooks.BOUND)[0]
    hook, colon, guid = plain.partition(":")
    return guid if colon and hook == str(HOOK_ID) else claim_id


def as_sent(logs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The replicas' log lines, each ``event_id`` the campaign's."""
    return [
        {**line, "event_id": campaign_id(str(line["event_id"]))} if "event_id" in line else line
        for line in logs
    ]


@dataclass(eq=False, kw_only=True)
class CampaignHook(GitHubHook):
    """GitHub's log of the campaign's sends, and the API over it; asked to redeliver an attempt,
    the campaign's provider sends its event again (``redeliver``)."""

    redeliver: Callable[[str], Awaitable[object]] | None = None
    asks: list[reconcile_rules.Ask] = field(default_factory=list)
    logged: list[reconcile_rules.Logged] = field(default_factory=list)
    _sending: set[asyncio.Task[None]] = field(default_factory=set)
    _items: list[dict[str, Any]] = field(default_factory=list)  # each attempt's, oldest first

    @property
    def redelivering(self) -> int:
        """Redeliveries asked for and not yet answered by the proxy."""
        return len(self._sending)

    def headers(self, event_id: str, body: bytes) -> dict[str, str]:
        """A send's headers as GitHub signs it: ``event_id`` is its GUID."""
        signature = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
        return {
            "X-GitHub-Delivery": event_id,
            "X-GitHub-Hook-ID": str(HOOK_ID),
            "X-GitHub-Event": EVENT,
            "X-Hub-Signature-256": f"sha256={signature}",
            "User-Agent": "GitHub-Hookshot/campaign",
        }

    def record(self, delivery: checker.Delivery, body: bytes) -> None:
        """Log a send of the provider's with the proxy's answer (none: failed, status 0)."""
        status = delivery.status or 0
        redelivery = delivery.phase == reconcile_rules.PHASE
        attempt = Attempt(
            next(self._ids), delivery.event_id, EVENT, body, status, redelivery, datetime.now(UTC)
        )
        self.attempts.append(attempt)
        self._items.append(attempt.item())
        self.logged.append(
            reconcile_rules.Logged(delivery.event_id, attempt.id, status, redelivery, delivery.end)
        )

    async def deliver(
        self, guid: str, body: bytes, *, event: str = EVENT, redelivery: bool = False
    ) -> int:
        """A redelivery the reconciler asked for: sent by the campaign's provider after the
        API's answer, as GitHub queues it (its attempt is logged when the proxy answers)."""
        assert redelivery
        self.asks.append(reconcile_rules.Ask(guid, self.redelivery_requests[-1], time.monotonic()))
        task = asyncio.create_task(self._send(guid))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return 0

    async def _send(self, guid: str) -> None:
        assert self.redeliver is not None
        await asyncio.sleep(0)  # after the API's 202
        await self.redeliver(guid)

    def items(self) -> list[dict[str, Any]]:
        """As ``GitHubHook``'s, each attempt's item made once: a run reads thousands of them a
        page at a time, and the campaign's one event loop serves the app and the sends too."""
        return self._items[::-1]

    def recovery(self) -> reconcile_rules.Recovery:
        return reconcile_rules.Recovery(asks=tuple(self.asks), logged=tuple(self.logged))

    async def close(self) -> None:
        for task in self._sending:
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)


@contextlib.asynccontextmanager
async def stand_in() -> AsyncIterator[CampaignHook]:
    """The stand-in, listening on 127.0.0.1 (``api_url``) until the block ends."""
    hook = CampaignHook(
        secret=SECRET, token=TOKEN, hook_id=HOOK_ID, owner="camp", repo="app", target="-"
    )
    runner = web.AppRunner(hook.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    hook.api_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield hook
    finally:
        await hook.close()
        await runner.cleanup()


def runs_after(logs: Iterable[Mapping[str, Any]], since: float) -> list[Mapping[str, Any]]:
    """The reconcile runs the replicas logged ending after ``since`` (the campaign's clock)."""
    return [
        line
        for line in reconcile_rules.runs(logs)
        if isinstance(line.get("at"), float) and line["at"] > since
    ]


async def settle(
    hook: CampaignHook,
    sent: Collection[str],
    arrived: Callable[[], set[str]],
    logs: Callable[[], list[Mapping[str, Any]]],
    *,
    pace: float,
    every: float = EVERY,
) -> float:
    """Wait (bounded) until every event sent reached the app with no redelivery in flight, then
    for a reconcile run ending after that which found no gap (the database healthy: its reads
    succeeded); the time it took. Past the bound the checker reports what is left. The bound
    allows the gaps left at ``pace`` (the reconciler's, a second) and four periods more."""
    started = time.monotonic()
    missing = len(set(sent) - arrived())
    within = 4 * every + 60 + 1.5 * missing / pace

    def reached() -> bool:
        return hook.redelivering == 0 and arrived() >= set(sent)

    def quiet_since(moment: float) -> bool:
        return any(line.get("gaps") == 0 for line in runs_after(logs(), moment))

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within):
            await _until(reached)
            moment = time.monotonic()
            await _until(lambda: quiet_since(moment) and reached())
    return time.monotonic() - started


async def _until(check: Callable[[], bool], every: float = 0.25) -> None:
    for _ in range(100_000):
        if check():
            return
        await asyncio.sleep(every)
