"""Stand-ins for the providers' APIs the reconciler reads (``proxy.providers_api``), built from
the operations vendored under tests/provider_api/: GitHub's hook deliveries (a repository's, or
a GitHub App's), Stripe's events, Paddle's notifications, PayPal's webhook events.

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

``PaddleDestination`` is a Paddle notification destination and ``PayPalApp`` a PayPal REST app
with one webhook, each built from the operations vendored from the provider's published API
description (their docstrings say what each does); both have ``faults``, ``tamper`` and
``next_origin``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
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


def _stamp(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


@dataclass
class PaddleNotification:
    id: str
    event_id: str
    type: str
    origin: str  # "event", or "replay"
    body: bytes  # the payload as sent: the event, with this notification's ID
    occurred_at: datetime
    status: str = "not_attempted"
    times_attempted: int = 0
    last_attempt_at: datetime | None = None
    replayed_at: datetime | None = None
    setting_id: str = ""

    def item(self) -> dict[str, Any]:
        """As PaddleHQ/paddle-openapi's ``notification`` schema describes it."""
        return {
            "id": self.id,
            "type": self.type,
            "status": self.status,
            "payload": json.loads(self.body),
            "occurred_at": _stamp(self.occurred_at),
            "delivered_at": _stamp(self.last_attempt_at)
            if self.status == "delivered" and self.last_attempt_at
            else None,
            "replayed_at": None if self.replayed_at is None else _stamp(self.replayed_at),
            "origin": self.origin,
            "last_attempt_at": None
            if self.last_attempt_at is None
            else _stamp(self.last_attempt_at),
            "retry_at": None,
            "times_attempted": self.times_attempted,
            "notification_setting_id": self.setting_id,
        }


@dataclass
class PaddleDestination:
    """A Paddle notification destination (a URL: the proxy's route) and the API over its
    notifications: each event notified once, signed with the destination's secret key, never
    retried (``failed`` at once unless answered with a 2xx); ``GET /notifications`` lists them
    newest first (``id[DESC]``), in pages of ``per_page`` walked with ``after`` through
    ``meta.pagination.next``; ``POST /notifications/{id}/replay`` notifies the event again (a
    new notification, origin ``replay``, the same ``event_id``), as paddle-openapi describes."""

    secret: str  # the destination's secret key, which signs Paddle-Signature
    key: str  # the API key the stand-in accepts
    setting_id: str = "ntfset_01hv8wptq8987qeep44cyrewp9"
    target: str = ""
    api_url: str = ""
    notifications: list[PaddleNotification] = field(default_factory=list)  # oldest first
    faults: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    list_requests: list[dict[str, str]] = field(default_factory=list)
    replay_requests: list[str] = field(default_factory=list)
    tamper: Callable[[dict[str, Any]], Any] | None = None
    next_origin: str = ""
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def app(self) -> web.Application:
        application = web.Application()
        application.router.add_get("/notifications", self._list)
        application.router.add_post("/notifications/{notification_id}/replay", self._replay)
        return application

    def _id(self, prefix: str) -> str:
        return f"{prefix}_01hv{next(self._ids):022d}"

    async def send(self, event_type: str = "transaction.completed", **data: Any) -> int:
        """An event, notified once (never retried); the status."""
        event_id, at = self._id("evt"), datetime.now(UTC)
        return await self._notify(event_id, event_type, at, "event", data)

    async def _notify(
        self, event_id: str, event_type: str, at: datetime, origin: str, data: dict[str, Any]
    ) -> int:
        notification_id = self._id("ntf")
        body = json.dumps(
            {
                "event_id": event_id,
                "event_type": event_type,
                "occurred_at": _stamp(at),
                "notification_id": notification_id,
                "data": data,
            }
        ).encode()
        notification = PaddleNotification(
            notification_id,
            event_id,
            event_type,
            origin,
            body,
            datetime.now(UTC),
            setting_id=self.setting_id,
        )
        self.notifications.append(notification)
        stamp = str(int(time.time()))
        signature = hmac.new(self.secret.encode(), f"{stamp}:".encode() + body, hashlib.sha256)
        headers = {
            "Paddle-Signature": f"ts={stamp};h1={signature.hexdigest()}",
            "Content-Type": "application/json",
            "User-Agent": "Paddle",
        }
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(self.target, data=body, headers=headers) as response,
            ):
                status = response.status
        except aiohttp.ClientError:
            status = 0
        notification.times_attempted += 1
        notification.last_attempt_at = datetime.now(UTC)
        notification.status = "delivered" if 200 <= status < 300 else "failed"
        return status

    def page(self, query: dict[str, str], url: URL) -> dict[str, Any]:
        """The answer ``GET /notifications`` gives for ``query``."""
        listed = sorted(self.notifications, key=lambda n: n.id, reverse=True)
        if "status" in query:
            listed = [n for n in listed if n.status in query["status"].split(",")]
        if "notification_setting_id" in query:
            wanted = query["notification_setting_id"].split(",")
            listed = [n for n in listed if n.setting_id in wanted]
        if "from" in query:
            since = datetime.fromisoformat(query["from"].replace("Z", "+00:00"))
            listed = [n for n in listed if n.occurred_at >= since]
        if "after" in query:
            listed = [n for n in listed if n.id < query["after"]]
        per_page = min(200, int(query.get("per_page", "50")))
        data = [n.item() for n in listed[:per_page]]
        following = url.update_query(after=data[-1]["id"] if data else query.get("after", ""))
        if self.next_origin:
            following = URL(self.next_origin).join(following.relative())
        return {
            "data": data,
            "meta": {
                "request_id": "b15ec92e-8688-40d4-a04d-f44cbec93355",
                "pagination": {
                    "per_page": per_page,
                    "next": str(following),
                    "has_more": len(listed) > per_page,
                    "estimated_total": len(listed),
                },
            },
        }

    def _refused(self, request: web.Request) -> web.Response | None:
        if self.faults:
            status, headers = self.faults.pop(0)
            error = {
                "error": {
                    "type": "api_error",
                    "code": "internal_error",
                    "detail": "stand-in fault",
                },
                "meta": {"request_id": "x"},
            }
            return web.json_response(error, status=status, headers=headers)
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            error = {
                "error": {
                    "type": "request_error",
                    "code": "authentication_malformed",
                    "detail": "Authentication header included, but incorrectly formatted",
                },
                "meta": {"request_id": "x"},
            }
            return web.json_response(error, status=403)
        return None

    async def _list(self, request: web.Request) -> web.Response:
        self.list_requests.append(dict(request.query))
        if (refused := self._refused(request)) is not None:
            return refused
        page = self.page(dict(request.query), request.url)
        return web.json_response(page if self.tamper is None else self.tamper(page))

    async def replay(self, notification_id: str) -> str | None:
        """Notify the event of an ``origin: event`` notification again; the new notification's
        ID (None: no such notification, or a replay's)."""
        found = next((n for n in self.notifications if n.id == notification_id), None)
        if found is None or found.origin != "event":
            return None
        found.replayed_at = datetime.now(UTC)
        payload = json.loads(found.body)
        at = datetime.fromisoformat(payload["occurred_at"].replace("Z", "+00:00"))
        await self._notify(found.event_id, found.type, at, "replay", payload["data"])
        return self.notifications[-1].id

    async def _replay(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        wanted = request.match_info["notification_id"]
        self.replay_requests.append(wanted)
        # Paddle queues the replay; here it is made before the answer.
        replayed = await self.replay(wanted)
        if replayed is None:
            error = {
                "error": {"type": "request_error", "code": "not_found", "detail": "not found"},
                "meta": {"request_id": "x"},
            }
            return web.json_response(error, status=404)
        answer = {
            "data": {"notification_id": replayed},
            "meta": {"request_id": "cfe92cac-86a1-49fe-ac50-20620dcd024f"},
        }
        return web.json_response(answer, status=202)


@dataclass
class PayPalEvent:
    id: str
    event_type: str
    create_time: datetime
    resource: dict[str, Any]

    def item(self) -> dict[str, Any]:
        """As paypal-rest-api-specifications' ``event`` schema describes it: the object a
        webhook carries."""
        return {
            "id": self.id,
            "create_time": self.create_time.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "resource_type": self.event_type.split(".")[0].lower(),
            "event_version": "1.0",
            "event_type": self.event_type,
            "summary": f"stand-in {self.event_type}",
            "resource_version": "2.0",
            "resource": self.resource,
            "links": [
                {
                    "href": f"https://api-m.paypal.com/v1/notifications/webhooks-events/{self.id}",
                    "rel": "self",
                    "method": "GET",
                }
            ],
        }


@dataclass
class PayPalApp:
    """A PayPal REST app with one webhook (a URL: the proxy's route) and the API over its
    events: each event sent once, signed as PayPal signs (RSA-SHA256 under the certificate at
    ``cert_url``, over ``transmission_id|time|webhook_id|crc32``), never retried;
    ``GET /v1/notifications/webhooks-events`` lists every event (delivered or not: the
    description says nothing of deliveries), newest first, ``page_size`` a page, the next named
    by a ``links`` entry ``rel: next``; ``POST …/{event_id}/resend`` sends it again to the
    ``webhook_ids`` named; ``POST /v1/oauth2/token`` issues bearer tokens for the app's client
    ID and secret (HTTP basic), each good for ``expires_in`` seconds."""

    client_id: str
    client_secret: str
    webhook_id: str
    signing_key: Any  # the certificate's RSA private key
    cert_url: str = ""  # where the signing certificate is served (https)
    target: str = ""
    api_url: str = ""
    expires_in: int = 32400
    events: list[PayPalEvent] = field(default_factory=list)  # oldest first
    delivered: dict[str, bool] = field(default_factory=dict)
    faults: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    token_requests: int = 0
    list_requests: list[dict[str, str]] = field(default_factory=list)
    resend_requests: list[tuple[str, Any]] = field(default_factory=list)
    tamper: Callable[[dict[str, Any]], Any] | None = None
    tamper_token: Callable[[dict[str, Any]], Any] | None = None
    next_origin: str = ""
    tokens: dict[str, float] = field(default_factory=dict)  # token: its end (time.time())
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def app(self) -> web.Application:
        application = web.Application()
        application.router.add_post("/v1/oauth2/token", self._token)
        application.router.add_get("/v1/notifications/webhooks-events", self._list)
        application.router.add_post(
            "/v1/notifications/webhooks-events/{event_id}/resend", self._resend
        )
        return application

    async def send(self, event_type: str = "PAYMENT.CAPTURE.COMPLETED", **resource: Any) -> int:
        """An event, sent once to the webhook (never retried); the status."""
        number = next(self._ids)
        event = PayPalEvent(
            f"WH-{number:017d}-8HN650336L201105X", event_type, datetime.now(UTC), resource
        )
        self.events.append(event)
        return await self._deliver(event)

    async def _deliver(self, event: PayPalEvent) -> int:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        body = json.dumps(event.item()).encode()
        transmission = f"b2384410-07c8-11ef-8fd2-{next(self._ids):012d}"
        at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = f"{transmission}|{at}|{self.webhook_id}|{zlib.crc32(body)}".encode()
        signature = self.signing_key.sign(message, padding.PKCS1v15(), hashes.SHA256())
        headers = {
            "PAYPAL-TRANSMISSION-ID": transmission,
            "PAYPAL-TRANSMISSION-TIME": at,
            "PAYPAL-TRANSMISSION-SIG": base64.b64encode(signature).decode(),
            "PAYPAL-CERT-URL": self.cert_url,
            "PAYPAL-AUTH-ALGO": "SHA256withRSA",
            "Content-Type": "application/json",
        }
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(self.target, data=body, headers=headers) as response,
            ):
                status = response.status
        except aiohttp.ClientError:
            status = 0
        self.delivered[event.id] = self.delivered.get(event.id, False) or 200 <= status < 300
        return status

    def _fault(self) -> web.Response | None:
        if not self.faults:
            return None
        status, headers = self.faults.pop(0)
        error = {"name": "INTERNAL_SERVICE_ERROR", "message": "stand-in fault"}
        return web.json_response(error, status=status, headers=headers)

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if self.tokens.get(given, 0.0) > time.time():
            return None
        error = {
            "error": "invalid_token",
            "error_description": "Token signature verification failed",
        }
        return web.json_response(error, status=401)

    async def _token(self, request: web.Request) -> web.Response:
        self.token_requests += 1
        if (fault := self._fault()) is not None:
            return fault
        form = await request.post()
        given = request.headers.get("Authorization", "")
        expected = base64.b64encode(f"{self.client_id}:{self.client_secret}".encode()).decode()
        if given != f"Basic {expected}":
            error = {"error": "invalid_client", "error_description": "Client Authentication failed"}
            return web.json_response(error, status=401)
        if form.get("grant_type") != "client_credentials":
            return web.json_response({"error": "unsupported_grant_type"}, status=400)
        token = f"A21AA{next(self._ids):040d}"
        self.tokens[token] = time.time() + self.expires_in
        answer = {
            "scope": "https://uri.paypal.com/services/applications/webhooks",
            "access_token": token,
            "token_type": "Bearer",
            "app_id": "APP-80W284485P519543T",
            "expires_in": self.expires_in,
            "nonce": "2024-05-01T12:00:00Zstand-in",
        }
        return web.json_response(answer if self.tamper_token is None else self.tamper_token(answer))

    def page(self, query: dict[str, str], url: URL) -> dict[str, Any]:
        """The ``EventList`` the list answers for ``query``."""
        listed = list(reversed(self.events))
        if "start_time" in query:
            start = datetime.fromisoformat(query["start_time"].replace("Z", "+00:00"))
            listed = [e for e in listed if e.create_time >= start]
        if "end_time" in query:
            end = datetime.fromisoformat(query["end_time"].replace("Z", "+00:00"))
            listed = [e for e in listed if e.create_time <= end + timedelta(seconds=1)]
        if "event_type" in query:
            listed = [e for e in listed if e.event_type == query["event_type"]]
        size = int(query.get("page_size", "10"))
        start_at = int(query.get("page", "0"))
        shown = listed[start_at : start_at + size]
        links = [{"href": str(url), "rel": "self", "method": "GET"}]
        if start_at + size < len(listed):
            following = url.update_query(page=str(start_at + size))
            if self.next_origin:
                following = URL(self.next_origin).join(following.relative())
            links.append({"href": str(following), "rel": "next", "method": "GET"})
        return {"events": [e.item() for e in shown], "count": len(shown), "links": links}

    async def _list(self, request: web.Request) -> web.Response:
        self.list_requests.append(dict(request.query))
        if (fault := self._fault()) is not None:
            return fault
        if (refused := self._unauthorized(request)) is not None:
            return refused
        page = self.page(dict(request.query), request.url)
        return web.json_response(page if self.tamper is None else self.tamper(page))

    async def _resend(self, request: web.Request) -> web.Response:
        if (fault := self._fault()) is not None:
            return fault
        if (refused := self._unauthorized(request)) is not None:
            return refused
        wanted = request.match_info["event_id"]
        body = await request.json()
        self.resend_requests.append((wanted, body))
        found = next((e for e in self.events if e.id == wanted), None)
        if found is None:
            error = {
                "name": "RESOURCE_NOT_FOUND",
                "message": "The specified resource does not exist.",
            }
            return web.json_response(error, status=404)
        # PayPal queues the resend; here it is made before the answer.
        if self.webhook_id in body.get("webhook_ids", []):
            await self._deliver(found)
        return web.json_response(found.item(), status=202)
