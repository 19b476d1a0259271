"""One request through the proxy: key → claim → forward → commit or roll back → respond.

This is the one place where a ``RequestError`` becomes an HTTP answer, and where each request's
canonical log line is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import aiohttp
from aiohttp import hdrs, web

from proxy import (
    budget,
    claims,
    config,
    errors,
    flights,
    forwarder,
    idempotency,
    keys,
    metrics,
    paths,
    replay,
    reuse,
    routes,
    signatures,
)

log = logging.getLogger(__name__)

STORE = web.AppKey("store", claims.ClaimStore)
FORWARDER = web.AppKey("forwarder", forwarder.Forwarder)
FLIGHTS = web.AppKey("flights", flights.Flights)
METRICS = web.AppKey("metrics", metrics.Metrics)
DRAINING = web.AppKey("draining", asyncio.Event)
BUDGET = web.AppKey("budget", budget.Budget)


def _json(
    status: int,
    payload: dict[str, Any],
    outcome: str,
    retry_after: int | None = None,
    extra: dict[str, str] | None = None,
) -> web.Response:
    headers = {"Dedup-Status": outcome, **(extra or {})}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(payload, status=status, headers=headers)


def _outcome(exc: errors.RequestError) -> str:
    if isinstance(exc, errors.KeyInProgress):
        return "in_progress"
    if isinstance(exc, errors.KeyReused):
        return "key_reused"
    if isinstance(exc, errors.StoreUnavailable | errors.Overloaded):
        return "unavailable"
    if isinstance(exc, errors.UpstreamFailed):
        return "upstream_error"
    return "rejected"


def error_response(exc: errors.RequestError, *, problem: bool = False) -> web.Response:
    """The proxy's own answer for a request it could not carry through; with ``problem``, as
    RFC 9457 problem details (idempotency-key routes: API clients parse those)."""
    if problem:
        response = _json(
            exc.status,
            {"type": "about:blank", "title": HTTPStatus(exc.status).phrase,
             "status": exc.status, "detail": exc.public, "code": exc.code},
            _outcome(exc),
            exc.retry_after,
            exc.headers,
        )  # fmt: skip
        response.content_type = "application/problem+json"
        return response
    return _json(
        exc.status,
        {"status": "error", "error": exc.code, "message": exc.public},
        _outcome(exc),
        exc.retry_after,
        exc.headers,
    )


async def read_body(
    request: web.Request,
    limit: int,
    within: float,
    reservation: budget.Reservation,
    *,
    pause: float = float("inf"),
) -> bytes:
    """The whole body within ``within`` seconds, its bytes never pausing longer than ``pause``
    (nginx's client_body_timeout, counted between two reads), refusing more than ``limit`` bytes
    (before reading, when the length is declared).

    Each part is reserved against the memory budget as it arrives, never a declared length
    ahead of its bytes: a request head alone (``Content-Length: 26214400`` and no body) must
    not hold any of the budget, or a few such heads would shed every genuine webhook.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise errors.BodyTooLarge(f"body of {declared} bytes is over max_body {limit}")
    content = request.content
    try:
        if content.is_eof():
            # All of it arrived with the headers (a typical webhook): no wait, no timer.
            body = content.read_nowait()
            reservation.body(len(body))
        else:
            body = await _read_parts(content, limit, within, pause, reservation)
    except TimeoutError as exc:
        raise errors.RequestTimeout(f"body not received within {within:g}s") from exc
    except (aiohttp.ClientPayloadError, OSError) as exc:
        raise errors.RequestIncomplete(f"request body ended early: {exc!r}") from exc
    if len(body) > limit:
        raise errors.BodyTooLarge(f"body is over max_body {limit} bytes")
    return body


async def _read_parts(
    content: aiohttp.StreamReader,
    limit: int,
    within: float,
    pause: float,
    reservation: budget.Reservation,
) -> bytes:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    chunks = bytearray()
    while len(chunks) <= limit:
        left = end - loop.time()
        try:
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(min(left, pause)):
                chunk = await content.readany()
        except TimeoutError:
            if pause < left:
                raise errors.RequestTimeout(
                    f"body paused for over client_body_timeout {pause:g}s"
                ) from None
            raise
        if not chunk:
            break
        reservation.body(len(chunk))
        chunks += chunk
    return bytes(chunks)


async def _write(
    request: web.Request, response: web.StreamResponse, fields: dict[str, Any]
) -> None:
    """Write the answer; a client gone (or cut off at send_timeout) is noted on the log line.
    aiohttp's own finish, after the handler, then finds the answer written or its connection
    closed."""
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionError:
        fields["client_gone"] = True
    else:
        # A connection aborted while its answer waited to drain ends the wait without an error.
        if request.transport is None:
            fields["client_gone"] = True


def _log_line(fields: dict[str, Any]) -> None:
    outcome = fields["outcome"]
    if (
        fields.get("mismatch")
        or fields.get("body_claimed_as")
        or fields.get("replay_skipped")
        or fields.get("answer_store_error")
    ):
        outcome = "mismatch"
    level = {
        "duplicate": logging.DEBUG,
        "unavailable": logging.ERROR,
        "ambiguous_commit": logging.ERROR,
        "rejected": logging.WARNING,
        "mismatch": logging.WARNING,
        # The app failed (answered 5xx or 4xx, refused, reset, timed out): an alert on warning
        # and above must see an app outage.
        "upstream_error": logging.WARNING,
    }.get(outcome, logging.INFO)
    log.log(
        level, "%s %s -> %s", fields["method"], fields["path"], outcome, extra={"fields": fields}
    )


class Webhook:
    """The handler of one configured webhook route."""

    def __init__(
        self, route: routes.RouteConfig, cfg: config.Config, meters: metrics.Metrics
    ) -> None:
        self.route = route
        self.meters = meters.route(route.name)
        self.client_timeout = cfg.client_timeout
        self.client_body_timeout = cfg.client_body_timeout
        # A route's claim_wait (a provider's short deadline) only ever shortens the global one:
        # the pool's command timeout is sized by the global one.
        self.claim_wait = (
            cfg.claim_wait if route.claim_wait is None else min(route.claim_wait, cfg.claim_wait)
        )
        self.extractor = keys.Extractor(route.name, route.event_id, route.event_type)
        self.shed = {reason: meters.shed.labels(reason) for reason in ("memory", "pool")}
        # Where a valid signature says nothing of the ID (GitHub, Shopify, Twilio), the claim
        # is bound to what is signed (see ``bound``), and a body seen under another ID is
        # reported (see reuse).
        self.bind_to_body = (
            route.verify is not None and not route.id_signed and not route.idempotency
        )
        self.recent_bodies = reuse.RecentBodies() if self.bind_to_body else None

    def handles(self, method: str) -> bool:
        """Whether a request with ``method`` is this route's (a webhook route answers any
        other method 405); on an idempotency-key route, the other methods are pass-through
        traffic, which ``passthrough`` allows or not (405), unclaimed whatever they carry."""
        return not self.route.idempotency or method in self.route.methods

    async def handle(self, request: web.Request, match: paths.Match[Webhook]) -> web.StreamResponse:
        started = time.perf_counter()
        scope = self.route.scope_for(match.values)
        verifier = self.route.verifier_for(match.values)
        fields = _fields(request, self.route, scope)
        in_flight = self.meters.in_flight
        in_flight.inc()
        try:
            if request.method not in self.route.methods:
                raise errors.MethodNotAllowed(
                    f"route {self.route.name!r} takes {', '.join(self.route.methods)}",
                    self.route.methods,
                )
            with request.app[BUDGET].reservation() as reservation:
                response = await self._handle(
                    request, match.target, scope, reservation, fields, verifier=verifier
                )
                if fields.get("replayed"):
                    reservation.replay(response.content_length or 0)
                # Written while the reservation holds: an answer its client does not read
                # stays counted in max_buffered until it is written (or send_timeout ends it).
                await _write(request, response, fields)
        except errors.RequestError as exc:
            fields.update(outcome=_outcome(exc), error=exc.message)
            if isinstance(exc, errors.BodyTooLarge):
                self.meters.oversized.inc()  # the operator's to fix: max_body is too small
            shed = _shed_reason(exc)
            if shed is not None:
                fields["shed"] = shed
                self.shed[shed].inc()
            response = error_response(exc, problem=self.route.idempotency)
        finally:
            in_flight.dec()
        _finish(self.meters, fields, started, response)
        return response

    async def _handle(
        self,
        request: web.Request,
        target: str,
        scope: str,
        reservation: budget.Reservation,
        fields: dict[str, Any],
        *,
        verifier: signatures.Verifier | None,
    ) -> web.StreamResponse:
        route = self.route
        body = await read_body(
            request, route.max_body, self.client_timeout, reservation,
            pause=self.client_body_timeout,
        )  # fmt: skip
        try:
            key = self._key(request, body, target, scope, verifier)
        except errors.EventIdMissing:
            if not route.forward_missing_id:
                raise
            upstream = await self._call(request, target, body, reservation, fields)
            fields["outcome"] = "unclaimed"
            return upstream.to_web()
        fields.update(event_id=self._sent_id(key), event_type=key.event_type)
        if route.idempotency and request.app[FLIGHTS].waiting((key.scope, key.event_id)):
            # A key in flight is answered at once, here and (claim wait 0) at the row lock.
            raise errors.KeyInProgress(f"route {route.name!r}: key in flight here")
        return await self._once(request, target, body, key, fields, reservation=reservation)

    async def _once(
        self,
        request: web.Request,
        target: str,
        body: bytes,
        key: claims.Key,
        fields: dict[str, Any],
        *,
        reservation: budget.Reservation,
    ) -> web.StreamResponse:
        """Claim ``key``, then forward (a new event) or answer as a duplicate."""
        claim_started = time.perf_counter()
        async with request.app[FLIGHTS].turn((key.scope, key.event_id), self.claim_wait) as flight:
            if flight.committed_sha256 is not None:
                # A copy in this process just committed this event: no database round trip.
                _phase(fields, "claim_ms", self.meters.claim_wait, claim_started)
                mismatch = flight.committed_sha256 != key.body_sha256
                return self._duplicate(key, mismatch, fields, flight.answer)
            # The local wait and the row lock's share one claim_wait.
            wait = 0.0
            if not self.route.idempotency:
                wait = max(0.001, self.claim_wait - (time.perf_counter() - claim_started))
            stored: claims.Answer | None = None
            async with self._claim(request, key, wait) as claim:
                _phase(fields, "claim_ms", self.meters.claim_wait, claim_started)
                if claim.acquired:
                    if self.recent_bodies is not None:
                        other = self.recent_bodies.claimed(
                            key.scope, key.body_sha256, self._sent_id(key)
                        )
                        if other is not None:
                            fields["body_claimed_as"] = other
                    response, answer = await self._forward(
                        request, target, body, claim, fields, reservation=reservation
                    )
                    if fields["outcome"] == "processed":
                        flight.committed_sha256 = key.body_sha256
                        flight.answer = answer
                    return response
                if self.route.replay:
                    stored = await claim.stored_answer()
            # A duplicate: its ROLLBACK, on the way out of the claim, also compared the bodies
            # (or stored_answer did).
            if not claim.mismatch:
                # Committed elsewhere (another worker or replica) with this body: the copies
                # queued behind this one in this process need no database round trip either.
                flight.committed_sha256 = key.body_sha256
                flight.answer = stored
            return self._duplicate(key, claim.mismatch, fields, stored)

    def _key(
        self,
        request: web.Request,
        body: bytes,
        target: str,
        scope: str,
        verifier: signatures.Verifier | None,
    ) -> claims.Key:
        """What this request claims. On an idempotency-key route: the key (its errors named
        as such), in the client's own scope, with the request's fingerprint as its digest."""
        route = self.route
        # The raw query: aiohttp's decoded one turns bytes that are not UTF-8 into U+FFFD.
        query = request.raw_path.partition("?")[2]
        try:
            event_id, event_type, digest = self._inspect(request, body, query, verifier)
        except errors.EventIdMissing as exc:
            if route.idempotency:
                raise errors.KeyMissing(exc.message) from None
            raise
        except errors.EventIdInvalid as exc:
            if route.idempotency and type(exc) is errors.EventIdInvalid:
                raise errors.KeyInvalid(exc.message) from None
            raise
        if route.idempotency:
            event_id = idempotency.key(event_id, route.name)
            scope = idempotency.client_scope(scope, route.scope_from, request.headers, route.name)
            digest = idempotency.fingerprint(request.method, target, digest)
        elif self.bind_to_body:
            event_id = bound(event_id, query, digest)
        return claims.Key(scope, event_id, event_type, digest)

    @contextlib.asynccontextmanager
    async def _claim(
        self, request: web.Request, key: claims.Key, wait: float
    ) -> AsyncIterator[claims.Claim]:
        try:
            async with request.app[STORE].claim(key, wait) as claim:
                yield claim
        except errors.ClaimWaitExceeded:
            if not self.route.idempotency:
                raise
            raise errors.KeyInProgress(
                f"route {self.route.name!r}: key in flight at another proxy"
            ) from None

    def _inspect(
        self, request: web.Request, body: bytes, query: str, verifier: signatures.Verifier | None
    ) -> tuple[str, str | None, bytes]:
        """Verify the signature, then find the event ID and type and the body's digest."""
        route = self.route
        if verifier is not None:
            # A header listed in Connection would be removed before the app sees it.
            keys.refuse_connection_naming(request.headers, verifier.headers, route.name)
            # Before the claim: an unauthenticated request must never squat an event ID.
            try:
                verifier.verify(request.headers, body, time.time(), query=query)
            except errors.SignatureInvalid as exc:
                raise errors.SignatureInvalid(f"route {route.name!r}: {exc.message}") from None
        event_id, event_type = self.extractor.extract(request.headers, query, body)
        return event_id, event_type, hashlib.sha256(body).digest()

    async def _call(
        self,
        request: web.Request,
        target: str,
        body: bytes,
        reservation: budget.Reservation,
        fields: dict[str, Any],
    ) -> forwarder.UpstreamResponse:
        started = time.perf_counter()
        upstream = await request.app[FORWARDER].forward(
            request, self.route.upstream, target, body, fields["request_id"],
            reserve=reservation.answer,
        )  # fmt: skip
        fields["upstream_status"] = upstream.status
        _phase(fields, "upstream_ms", self.meters.upstream_latency, started)
        if upstream.status == 410:
            # Standard Webhooks senders disable an endpoint that answers 410: never relay it.
            raise errors.UpstreamUnavailable("upstream answered 410 Gone; relayed as 502")
        return upstream

    async def _forward(
        self,
        request: web.Request,
        target: str,
        body: bytes,
        claim: claims.Claim,
        fields: dict[str, Any],
        *,
        reservation: budget.Reservation,
    ) -> tuple[web.StreamResponse, claims.Answer | None]:
        """Forward, then commit on a 2xx (with the answer to replay, where the route does):
        the response, and the answer stored with the claim."""
        try:
            upstream = await self._call(request, target, body, reservation, fields)
        except errors.UpstreamFailed as exc:
            if exc.answered_2xx:
                # The app did the work; only its answer cannot be held or relayed (over budget,
                # cut off, malformed after a 2xx status line). Keep the claim: the provider's
                # retry of this 502 is then a duplicate, not a second delivery.
                fields["upstream_status"] = exc.upstream_status
                try:
                    await self._commit(claim, None, fields)
                except errors.CommitFailed as failed:
                    fields["commit_error"] = failed.message
            raise
        if not upstream.ok:
            fields["outcome"] = "upstream_error"
            return upstream.to_web(), None
        answer = self._answer_to_store(upstream, fields)
        try:
            await self._commit(claim, answer, fields)
        except errors.CommitFailed as exc:
            # The upstream did the work: answering anything but its 2xx would make the provider
            # retry, and the retry would be forwarded again (see docs/guarantees.md).
            fields.update(outcome="ambiguous_commit", error=exc.message)
            return upstream.to_web(), None
        fields["outcome"] = "processed"
        if claim.answer_refused is not None:
            # Committed without its answer (the role may not store it): its duplicates get
            # the acknowledgement, and the operator a warning and a counter.
            fields["answer_store_error"] = claim.answer_refused
            self.meters.answer_store_failures.inc()
            answer = None
        if claim.reconciled:
            fields["reconciled"] = True
            answer = None  # re-claimed on another connection, without it
        return upstream.to_web(), answer

    async def _commit(
        self, claim: claims.Claim, answer: claims.Answer | None, fields: dict[str, Any]
    ) -> None:
        """COMMIT the claim (with ``answer``), timed on the log line and in the metrics."""
        started = time.perf_counter()
        try:
            await claim.commit(answer)
        finally:
            _phase(fields, "commit_ms", self.meters.commit_latency, started)

    def _answer_to_store(
        self, upstream: forwarder.UpstreamResponse, fields: dict[str, Any]
    ) -> claims.Answer | None:
        answer, skipped = replay.answer_to_store(self.route, upstream)
        if skipped is not None:
            fields["replay_skipped"] = skipped
            self.meters.replay_skipped.inc()
        return answer

    def _duplicate(
        self,
        key: claims.Key,
        mismatch: bool,
        fields: dict[str, Any],
        stored: claims.Answer | None = None,
    ) -> web.Response:
        if mismatch and self.route.idempotency:
            # The key names another request (method, target or body): never its answer.
            raise errors.KeyReused(f"route {self.route.name!r}: key {key.event_id!r} reused")
        fields["outcome"] = "duplicate"
        if mismatch:
            # Same ID, other bytes: the ID is not a per-event key here, or a replay. Never the
            # stored answer: it was the answer to another request (a one-time code in TwiML).
            fields["mismatch"] = True
        elif stored is not None and self.route.replay:
            # (Only on a replay route: an ack route sharing the scope finds the replay route's
            # answer in the single-flight.)
            fields["replayed"] = True
            self.meters.replays.inc()
            return replay.response(stored)
        return _json(200, {"status": "duplicate", "event_id": self._sent_id(key)}, "duplicate")

    def _sent_id(self, key: claims.Key) -> str:
        """The event ID as the request carried it (without what ``bound`` added), for the
        log line and the acknowledgement."""
        return key.event_id.rpartition("~")[0] if self.bind_to_body else key.event_id


def bound(event_id: str, query: str, body_sha256: bytes) -> str:
    """The claim's ID on a route whose signature does not cover the event ID: the ID bound to
    a digest of what is signed (the body, and the query for Twilio, which signs the URL).

    A captured, validly signed request re-sent under another ID is then another claim: it can
    neither take a victim's stored answer nor, sent first under a future ID, swallow the
    genuine delivery. A provider's own retry sends the same bytes under the same ID, so it is
    still a duplicate. 128 bits of digest: an attacker holds only bodies the provider signed.
    """
    material = hashlib.sha256(b"%s\n%s" % (query.encode("utf-8", "surrogateescape"), body_sha256))
    return f"{event_id}~{material.hexdigest()[:32]}"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_dispatcher(cfg: config.Config, meters: metrics.Metrics) -> Handler:
    """The one handler: normalize the path, then the webhook route it is, or pass-through."""
    table = paths.Table([(route.pattern, Webhook(route, cfg, meters)) for route in cfg.routes])
    route_meters = meters.route("")
    upstream, passthrough = cfg.upstream.url, cfg.passthrough

    async def dispatch(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            target = paths.normalize(request.raw_path)
            match = table.match(target, request.raw_path)
            if match is not None and match.route.handles(request.method):
                return await match.route.handle(request, match)
            if not paths.passes(passthrough, target.path):
                if match is not None:
                    # A method an idempotency-key route does not claim is pass-through
                    # traffic, and pass-through does not allow it here.
                    methods = match.route.route.methods
                    raise errors.MethodNotAllowed(
                        f"route {match.route.route.name!r} claims {', '.join(methods)}, and "
                        "passthrough does not allow other methods on its path",
                        methods,
                    )
                raise errors.NotRouted()
        except errors.RequestError as exc:
            fields = _fields(request, None, None)
            fields.update(outcome=_outcome(exc), error=exc.message)
            refusal = error_response(exc)
            _finish(route_meters, fields, started, refusal)
            return refusal
        fields = _fields(request, None, None)
        response: web.StreamResponse
        try:
            response = await request.app[FORWARDER].relay(
                request,
                upstream if match is None else match.route.route.upstream,
                target.path + target.query,
                fields["request_id"],
            )
            fields["outcome"] = "passthrough"
        except errors.RequestError as exc:
            fields.update(outcome=_outcome(exc), error=exc.message)
            response = error_response(exc)
        _finish(route_meters, fields, started, response)
        return response

    return dispatch


def _phase(fields: dict[str, Any], name: str, timings: metrics.Timings, started: float) -> None:
    """The time since ``started``: in milliseconds on the log line as ``name``, in seconds in
    the phase's histogram."""
    took = time.perf_counter() - started
    fields[name] = round(took * 1000, 2)
    timings.observe(took)


def _shed_reason(exc: errors.RequestError) -> str | None:
    """Why a request was shed to protect the worker, if it was."""
    if isinstance(exc, errors.Overloaded | errors.AnswerOverBudget):
        return "memory"
    if isinstance(exc, errors.PoolExhausted):
        return "pool"
    return None


def _fields(
    request: web.Request, route: routes.RouteConfig | None, scope: str | None
) -> dict[str, Any]:
    """The start of the request's canonical log line."""
    return {
        "route": route.name if route else None,
        "scope": scope,
        "method": request.method,
        "path": request.raw_path.partition("?")[0],
        # The provider's (or an ingress's) ID if it sent one, so the lines can be joined.
        # Else 128 random bits in hex, as uuid4().hex looks, at a sixth of its cost.
        "request_id": request.headers.get(hdrs.X_REQUEST_ID) or os.urandom(16).hex(),
    }


def _finish(
    meters: metrics.RouteMeters,
    fields: dict[str, Any],
    started: float,
    response: web.StreamResponse,
) -> None:
    """Count the request and write its canonical log line."""
    fields["status"] = response.status
    _phase(fields, "total_ms", meters.duration, started)
    meters.requests[fields["outcome"]].inc()
    if fields.get("mismatch"):
        meters.mismatches.inc()
    if fields.get("body_claimed_as"):
        meters.reused_bodies.inc()
    if fields["outcome"] == "ambiguous_commit":
        meters.ambiguous_commits.inc()
    _log_line(fields)
