"""Stand-ins for the providers' APIs the reconciler reads (``proxy.providers_api``), built from
the operations vendored under tests/provider_api/: GitHub's hook deliveries (a repository's, or
a GitHub App's), Stripe's events.

``GitHubHook`` is a hook that delivers to a URL (the proxy's route) and keeps a log of every
attempt, newest first, as GitHub's deliveries API lists it: pages of ``per_page`` with a
``Link: <…>; rel="next"`` cursor. Asked to redeliver an attempt, it sends the event again, the
same GUID under the same hook ID, signed with the hook's secret, and logs that attempt too.
``faults`` scripts the next answers of the API (a 429 with Retry-After, a 401, a 503);
``tamper`` and ``next_origin`` make it a hostile or broken API (a page rewritten, a ``Link`` to
another host).
``GitHubHook.app_hook`` makes it a GitHub App's hook (``/app/hook``), its API open only to a JWT
signed with the App's key and not expired, as GitHub checks it.

``StripeAccount`` is an account with one webhook endpoint (a URL: the proxy's route): each event
is created, sent once, signed with the endpoint's secret, and never retried (a sender that
never retries); one the endpoint did not answer with a 2xx keeps ``pending_webhooks`` 1, and
``GET /v1/events?delivery_success=false`` lists it, newest first, in pages of ``limit`` walked
with ``starting_after`` while ``has_more``, as stripe/openapi describes it. It has ``faults``
as GitHub's does, and ``tamper``.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import jwt
from aiohttp import web
from yarl import URL


@dataclass
class Attempt:
    id: int
    guid: str
    event: str
    body: bytes
    status_code: int
    redelivery: bool
    at: datetime
    headers: dict[str, str] = field(default_factory=dict)

    def item(self) -> dict[str, Any]:
        """As ``hook-delivery-item`` describes it."""
        return {
            "id": self.id,
            "guid": self.guid,
            "delivered_at": self.at.isoformat().replace("+00:00", "Z"),
            "redelivery": self.redelivery,
            "duration": 0.05,
            "status": "OK"
            if 200 <= self.status_code < 300
            else f"Invalid HTTP Response: {self.status_code}",
            "status_code": self.status_code,
            "event": self.event,
            "action": None,
            "installation_id": None,
            "repository_id": 1296269,
        }

    def delivery(self, url: str) -> dict[str, Any]:
        """As ``hook-delivery`` describes it: the item, with the request and the response."""
        return {
            **self.item(),
            "url": url,
            "throttled_at": None,
            "request": {"headers": self.headers, "payload": json.loads(self.body)},
            "response": {"headers": {}, "payload": None},
        }


@dataclass
class GitHubHook:
    """A repository hook and the API over its deliveries."""

    secret: str
    token: str
    hook_id: int = 1
    owner: str = "octo"
    repo: str = "app"
    target: str = ""  # where the hook delivers: the proxy's route URL
    api_url: str = ""  # where the stand-in listens
    attempts: list[Attempt] = field(default_factory=list)  # oldest first
    # The next answers of the API, one per request, before any other (status, headers).
    faults: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    list_requests: int = 0
    redelivery_requests: list[int] = field(default_factory=list)
    # A hostile or broken API: what each page of the list becomes; the origin its Link names.
    tamper: Callable[[list[dict[str, Any]]], Any] | None = None
    next_origin: str = ""
    # A GitHub App's hook: the App's client ID (the JWT's issuer) and public key.
    app_client_id: str = ""
    app_public_key: Any = None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(12000000000))

    @classmethod
    def app_hook(cls, *, secret: str, client_id: str, public_key: Any) -> GitHubHook:
        return cls(secret=secret, token="", app_client_id=client_id, app_public_key=public_key)

    @property
    def prefix(self) -> str:
        if self.app_client_id:
            return "/app/hook"
        return f"/repos/{self.owner}/{self.repo}/hooks/{self.hook_id}"

    def app(self) -> web.Application:
        application = web.Application()
        application.router.add_get(f"{self.prefix}/deliveries", self._list)
        application.router.add_get(f"{self.prefix}/deliveries/{{delivery_id}}", self._get)
        application.router.add_post(
            f"{self.prefix}/deliveries/{{delivery_id}}/attempts", self._redeliver
        )
        return application

    async def deliver(
        self, guid: str, body: bytes, *, event: str = "push", redelivery: bool = False
    ) -> int:
        """Send the event to ``target`` once, as GitHub does (never retried); the status, logged."""
        signature = hmac.new(self.secret.encode(), body, hashlib.sha256).hexdigest()
        headers = {
            "X-GitHub-Delivery": guid,
            "X-GitHub-Hook-ID": str(self.hook_id),
            "X-GitHub-Event": event,
            "X-Hub-Signature-256": f"sha256={signature}",
            "Content-Type": "application/json",
            "User-Agent": "GitHub-Hookshot/stand-in",
        }
        if self.app_client_id:
            headers["X-GitHub-Hook-Installation-Target-Type"] = "integration"
            headers["X-GitHub-Hook-Installation-Target-ID"] = "1"
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(self.target, data=body, headers=headers) as response,
            ):
                status = response.status
        except aiohttp.ClientError:
            status = 0  # GitHub logs "failed to connect" with no status code
        self.attempts.append(
            Attempt(
                next(self._ids), guid, event, body, status, redelivery, datetime.now(UTC), headers
            )
        )
        return status

    def items(self) -> list[dict[str, Any]]:
        return [attempt.item() for attempt in reversed(self.attempts)]

    def _fault(self) -> web.Response | None:
        if not self.faults:
            return None
        status, headers = self.faults.pop(0)
        return web.json_response(
            {"message": "stand-in fault", "documentation_url": ""}, status=status, headers=headers
        )

    def _refused(self, request: web.Request) -> web.Response | None:
        """401 unless the request carries the token, or for an App's hook a JWT signed with the
        App's key, issued by the App, not expired and expiring within 10 minutes."""
        given = request.headers.get("Authorization", "")
        if not self.app_client_id:
            if given == f"Bearer {self.token}":
                return None
            return web.json_response({"message": "Bad credentials"}, status=401)
        try:
            claims = jwt.decode(
                given.removeprefix("Bearer "),
                self.app_public_key,
                algorithms=["RS256"],
                issuer=self.app_client_id,
                options={"require": ["iat", "exp", "iss"]},
            )
        except jwt.ExpiredSignatureError:
            message = "'Expiration time' claim ('exp') must be a numeric value representing the future time at which the assertion expires"  # noqa: E501
        except jwt.PyJWTError:
            message = "A JSON web token could not be decoded"
        else:
            if claims["exp"] - datetime.now(UTC).timestamp() <= 600:
                return None
            message = "'Expiration time' claim ('exp') is too far in the future"
        return web.json_response({"message": message}, status=401)

    async def _list(self, request: web.Request) -> web.Response:
        self.list_requests += 1
        if (fault := self._fault()) is not None:
            return fault
        if (refused := self._refused(request)) is not None:
            return refused
        per_page = min(100, int(request.query.get("per_page", "30")))
        start = int(request.query.get("cursor", "0"))
        items = self.items()
        page = items[start : start + per_page]
        headers = {}
        if start + per_page < len(items):
            following = request.url.update_query(cursor=str(start + per_page))
            if self.next_origin:
                following = URL(self.next_origin).join(following.relative())
            headers["Link"] = f'<{following}>; rel="next"'
        return web.json_response(
            page if self.tamper is None else self.tamper(page), headers=headers
        )

    async def _get(self, request: web.Request) -> web.Response:
        if (fault := self._fault()) is not None:
            return fault
        if (refused := self._refused(request)) is not None:
            return refused
        wanted = int(request.match_info["delivery_id"])
        found = next((a for a in self.attempts if a.id == wanted), None)
        if found is None:
            return web.json_response({"message": "Not Found"}, status=404)
        return web.json_response(found.delivery(self.target))

    async def _redeliver(self, request: web.Request) -> web.Response:
        if (fault := self._fault()) is not None:
            return fault
        if (refused := self._refused(request)) is not None:
            return refused
        wanted = int(request.match_info["delivery_id"])
        self.redelivery_requests.append(wanted)
        found = next((a for a in self.attempts if a.id == wanted), None)
        if found is None:
            return web.json_response({"message": "Not Found"}, status=404)
        # GitHub queues the redelivery; here it is made before the answer, so a test need
        # not wait for it.
        await self.deliver(found.guid, found.body, event=found.event, redelivery=True)
        return web.json_response({}, status=202)


@dataclass
class StripeEvent:
    id: str
    type: str
    created: int
    data: dict[str, Any]
    delivered: bool = False

    def item(self) -> dict[str, Any]:
        """As stripe/openapi's ``event`` schema describes it: the object a webhook carries."""
        return {
            "id": self.id,
            "object": "event",
            "api_version": "2024-06-20",
            "created": self.created,
            "data": self.data,
            "livemode": False,
            "pending_webhooks": 0 if self.delivered else 1,
            "request": {"id": None, "idempotency_key": None},
            "type": self.type,
        }


@dataclass
class StripeAccount:
    """An account with one webhook endpoint, and the API over its events."""

    secret: str  # the endpoint's signing secret (whsec_…)
    key: str  # the API key the stand-in accepts (a restricted key, rk_…)
    target: str = ""  # the endpoint's URL: the proxy's route
    api_url: str = ""  # where the stand-in listens
    events: list[StripeEvent] = field(default_factory=list)  # oldest first
    faults: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    list_requests: list[dict[str, str]] = field(default_factory=list)  # each request's query
    # A hostile or broken API: what each list object becomes.
    tamper: Callable[[dict[str, Any]], Any] | None = None
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def app(self) -> web.Application:
        application = web.Application()
        application.router.add_get("/v1/events", self._list)
        return application

    async def send(self, event_type: str = "charge.succeeded", **data: Any) -> int:
        """Create an event and send it to ``target`` once (never retried); the status."""
        event = StripeEvent(
            f"evt_{next(self._ids):024d}", event_type, int(time.time()), {"object": data}
        )
        self.events.append(event)
        body = json.dumps(event.item(), indent=2).encode()
        stamp = str(int(time.time()))
        signature = hmac.new(
            self.secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256
        ).hexdigest()
        headers = {
            "Stripe-Signature": f"t={stamp},v1={signature}",
            "Content-Type": "application/json; charset=utf-8",
            "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
        }
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(self.target, data=body, headers=headers) as response,
            ):
                status = response.status
        except aiohttp.ClientError:
            status = 0
        event.delivered = 200 <= status < 300
        return status

    def page(self, query: dict[str, str]) -> dict[str, Any]:
        """The list object ``GET /v1/events`` answers for ``query``."""
        listed = [event.item() for event in reversed(self.events)]  # newest first
        if query.get("delivery_success") == "false":
            listed = [item for item in listed if item["pending_webhooks"] > 0]
        elif query.get("delivery_success") == "true":
            listed = [item for item in listed if item["pending_webhooks"] == 0]
        if "created[gte]" in query:
            listed = [item for item in listed if item["created"] >= int(query["created[gte]"])]
        if "starting_after" in query:
            ids = [item["id"] for item in listed]
            listed = listed[ids.index(query["starting_after"]) + 1 :]
        limit = min(100, int(query.get("limit", "10")))
        return {
            "object": "list",
            "url": "/v1/events",
            "has_more": len(listed) > limit,
            "data": listed[:limit],
        }

    async def _list(self, request: web.Request) -> web.Response:
        self.list_requests.append(dict(request.query))
        if self.faults:
            status, headers = self.faults.pop(0)
            error = {"error": {"type": "api_error", "message": "stand-in fault"}}
            return web.json_response(error, status=status, headers=headers)
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            error = {"error": {"type": "invalid_request_error", "message": "Invalid API Key"}}
            return web.json_response(error, status=401)
        page = self.page(dict(request.query))
        return web.json_response(page if self.tamper is None else self.tamper(page))


def json_schema(schema: Any) -> Any:
    """An OpenAPI 3.0 schema as JSON Schema: ``nullable`` as the null type (its references
    resolve within one document as they are)."""
    if isinstance(schema, dict):
        converted = {k: json_schema(v) for k, v in schema.items() if k != "nullable"}
        if schema.get("nullable"):
            converted["type"] = [schema["type"], "null"]
        return converted
    if isinstance(schema, list):
        return [json_schema(item) for item in schema]
    return schema
