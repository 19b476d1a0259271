"""One request through the proxy: key → claim → forward → commit or roll back → respond.

``Route`` holds what the requests of one configured route share, among them its semantics
(``semantics.Semantics``: ``webhooks`` or ``idempotency``, how a request maps onto a claim, and
what a copy in flight or a duplicate is answered); ``Cycle`` is one request on it, from its headers
to its answer. This is the one place where a ``RequestError`` becomes an HTTP answer, from the
facts the error carries, and where each request's canonical log line (``log_line``) is filled in.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from proxy import (
    app_keys,
    app_limit,
    config,
    database,
    delivery,
    errors,
    event_ids,
    flights,
    idempotency,
    log_line,
    memory,
    metrics,
    ordering,
    paths,
    replay,
    request_body,
    semantics,
    signatures,
    tracing,
    webhooks,
)
from proxy.config import routes
from proxy.database import inbox, slots
from proxy.upstream import forwarder, http1, proxy_headers, transports

log = logging.getLogger(__name__)
KeptFor = database.KeptFor

# Why a new event was kept without being sent (``Cycle._keep_unsent``), as the refusal says
# when it could not be kept either.
UNSENT = inbox.KEPT_UNSENT


# How often, at most, a worker checks that a 2xx on a route with receipt came with one.
RECEIPT_CHECK_EVERY = 10.0

# After a hand-off, how long past upstream.timeout its row waits before a lane may take it:
# time for the attempt's result to be written.
HAND_OFF_MARGIN = 5.0


def _json(
    status: int,
    payload: dict[str, Any],
    outcome: errors.Outcome,
    retry_after: int | None = None,
    extra: dict[str, str] | None = None,
) -> web.Response:
    headers = {"Dedup-Status": outcome, **(extra or {})}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(payload, status=status, headers=headers)


def error_response(exc: errors.RequestError, *, problem: bool = False) -> web.Response:
    """The proxy's own answer for a request it could not carry through; with ``problem``, as
    RFC 9457 problem details (idempotency-key routes: API clients parse those)."""
    if problem:
        response = _json(
            exc.status,
            {"type": "about:blank", "title": HTTPStatus(exc.status).phrase,
             "status": exc.status, "detail": exc.public, "code": exc.code},
            exc.outcome,
            exc.retry_after,
            exc.headers,
        )  # fmt: skip
        response.content_type = "application/problem+json"
        return response
    return _json(
        exc.status,
        {"status": "error", "error": exc.code, "message": exc.public},
        exc.outcome,
        exc.retry_after,
        exc.headers,
    )


class Route:
    """The handler of one configured route: what every request on it shares."""

    def __init__(
        self,
        route: routes.RouteConfig,
        cfg: config.Config,
        meters: metrics.Metrics,
        traces: tracing.Tracing,
    ) -> None:
        self.config = route
        self.tracing = traces
        self.semantics: semantics.Semantics = (
            idempotency.IdempotencyKeySemantics(route)
            if route.idempotency
            else webhooks.WebhookSemantics(route)
        )
        self.meters = meters.route(route.name, route)
        self.client_timeout = cfg.client_timeout
        self.client_body_timeout = cfg.client_body_timeout
        # A route's claim_wait (a provider's short deadline) only ever shortens the global one:
        # the pool's command timeout is sized by the global one.
        self.claim_wait = (
            cfg.claim_wait if route.claim_wait is None else min(route.claim_wait, cfg.claim_wait)
        )
        self.extractor = event_ids.Extractor(route.name, route.event_id, route.event_type)
        self.redeliver = route.redeliver  # None: a failure is relayed, the claim released
        self.orderer = None if route.order is None else ordering.Orderer(route.name, route.order)
        # A hand-off at or past upstream.timeout never comes: the app's answer, or its
        # timeout, comes first. A delivery handed off is due again only after its lease, by
        # when the attempt has ended either way.
        hand_off = route.hand_off
        self.hand_off = (
            hand_off if hand_off is not None and hand_off < cfg.upstream.timeout else None
        )
        self.lease = cfg.upstream.timeout + HAND_OFF_MARGIN
        self.pool_timeout = cfg.database.pool_timeout  # the longest a request waits for room
        self.table = cfg.database.table
        self._receipt_checked = float("-inf")
        self.shed = {reason: meters.shed.labels(reason) for reason in ("memory", "pool", "limit")}

    def receipt_check_due(self) -> bool:
        """Whether to check that this 2xx came with a receipt: at most every
        RECEIPT_CHECK_EVERY seconds (one read; the happy path costs nothing else)."""
        now = time.monotonic()
        if now - self._receipt_checked < RECEIPT_CHECK_EVERY:
            return False
        self._receipt_checked = now
        return True


class Cycle:
    """One request on a route, from its headers to its answer (uvicorn's
    ``RequestResponseCycle``): what it carries, and the log line it fills in."""

    __slots__ = (
        "body", "event_id", "line", "object", "receipt", "request", "reservation", "route",
        "scope", "sent", "services", "started", "target", "trace", "turn", "verifier",
    )  # fmt: skip

    reservation: memory.Reservation  # set once the request is in the budget (``run``)

    def __init__(
        self,
        route: Route,
        request: web.Request,
        match: paths.Match[Route],
        started: float,
        services: app_keys.Services,
    ) -> None:
        self.route = route
        self.request = request
        self.services = services  # what every request uses, handed in (never looked up)
        self.started = started
        self.target = match.target
        self.scope = route.config.scope_for(match.values)
        self.verifier = route.config.verifier_for(match.values)
        self.line = log_line.start(request, route.config.name, self.scope)
        self.trace = route.tracing.begin(request, route.config.name, route.config.path, self.line)
        self.body = b""
        self.event_id = ""  # as the request carried it (``semantics.Semantics.key``)
        # What the app was sent, on a route that redelivers: what is kept if it fails.
        self.sent: tuple[tuple[str, str], ...] = ()
        self.receipt: str | None = None  # on a route with receipt: its key, once claimed
        self.object: ordering.Object | None = None  # on a route with order: the request's

    async def run(self) -> web.StreamResponse:
        """The request's answer, written, counted and logged."""
        route, request = self.route, self.request
        in_flight = route.meters.in_flight
        in_flight.inc()
        try:
            methods = route.config.methods
            if request.method not in methods + signatures.handshake_methods(self.verifier):
                raise errors.MethodNotAllowed(
                    f"route {route.config.name!r} takes {', '.join(methods)}", methods
                )
            with self.services.budget.reservation() as reservation:
                self.reservation = reservation
                response, outcome = await self._process()
                self.line["outcome"] = outcome
                # Written while the reservation holds: an answer its client does not read
                # stays counted in max_buffered until it is written (or send_timeout ends it).
                if not response.prepared:  # (a hand-off wrote its answer already)
                    await self._write(response)
        except errors.RequestError as exc:
            response = self._refuse(exc)
        except BaseException as raised:  # cancelled at the end of a drain: its spans end too
            self.trace.abort(raised)
            raise
        finally:
            in_flight.dec()
        log_line.finish(route.meters, self.line, self.started, response)
        self.trace.finish(self.line)
        return response

    async def _process(self) -> tuple[web.StreamResponse, errors.Outcome]:
        """Read the body, then claim what it carries (or forward it unclaimed): the answer and
        the outcome."""
        route = self.route
        self.body = await request_body.read(
            self.request, route.config.max_body, route.client_timeout, self.reservation,
            pause=route.client_body_timeout,
        )  # fmt: skip
        verifier = self.verifier
        if verifier is not None:
            if signatures.prepares(verifier):
                # What the check needs from elsewhere (PayPal's certificate), fetched here:
                # from here to the claim's verify nothing awaits, so it is still in the cache.
                await signatures.prepare(verifier, self.request.headers, self.body)
            if signatures.handshakes(verifier):
                answered = await self._handshake()
                if answered is not None:
                    return answered, "handshake"
        try:
            key = self._key()
        except errors.EventIdMissing:
            if not route.config.forward_missing_id:
                raise
            return await self._unclaimed()
        route.semantics.refuse_in_flight(self.services.flights, key)
        return await self._once(key)

    async def _handshake(self) -> web.Response | None:
        """The proxy's own answer to a provider's handshake (Meta's subscription check, Twitch's,
        Discord's and Zoom's signed ones, SNS's subscription where the proxy confirms it), never
        claimed or forwarded; a failed one is refused as a forged signature is. None for any
        other request, refused here if its method is the handshake's, not the route's. Only
        for a scheme with a handshake (``signatures.handshakes``)."""
        route, request = self.route.config, self.request
        query = request.raw_path.partition("?")[2]
        try:
            answer = signatures.handshake(
                self.verifier, request.method, query, headers=request.headers, body=self.body,
                now=time.time(),
            )  # fmt: skip
        except errors.SignatureInvalid as exc:
            raise errors.SignatureInvalid(f"route {route.name!r}: {exc.message}") from None
        if answer is not None:
            await signatures.confirm(self.verifier, answer)
            return web.Response(
                status=answer.status, text=answer.text, content_type=answer.content_type,
                # The challenge is the sender's text, echoed: never to be read as a page.
                headers={"Dedup-Status": "handshake", "X-Content-Type-Options": "nosniff"},
            )  # fmt: skip
        if request.method not in route.methods:
            raise errors.MethodNotAllowed(
                f"route {route.name!r} takes {', '.join(route.methods)}", route.methods
            )
        return None

    async def _unclaimed(self) -> tuple[web.StreamResponse, errors.Outcome]:
        """Forward a request without an event ID, unclaimed (a handshake), in its turn at the
        app."""
        room = self.services.room
        await self._wait_for_room(room)
        try:
            result = await self._call()
        finally:
            room.leave()
        return forwarder.relayed(result.relayed()), "unclaimed"

    def _key(self) -> database.Key:
        """What this request claims; its event ID and type on the log line."""
        # The raw query: aiohttp's decoded one turns bytes that are not UTF-8 into U+FFFD.
        query = self.request.raw_path.partition("?")[2]
        self.event_id, key = self.route.semantics.key(self, query)
        self.line["event_id"] = self.event_id
        if key.event_id != self.event_id:
            self.line["claim_id"] = key.event_id
        self.line["event_type"] = key.event_type
        orderer = self.route.orderer
        if orderer is not None:
            self.object = orderer.object_of(self.request.headers, query, self.body, key.event_type)
            if self.object is not None:
                self.line["object"] = self.object.key
                if self.object.unparsed is not None:
                    # Ordered by arrival, never superseded (docs/configuration.md, "order").
                    self.line["version_unparsed"] = self.object.unparsed
        return key

    def inspect(self, query: str) -> tuple[str, str | None, bytes]:
        """Verify the signature, then find the event ID and type and the body's digest."""
        route, headers, verifier = self.route, self.request.headers, self.verifier
        if verifier is not None:
            name = route.config.name
            # A header listed in Connection would be removed before the app sees it.
            event_ids.refuse_connection_naming(headers, verifier.headers, name)
            # Before the claim: an unauthenticated request must never squat an event ID.
            try:
                verifier.verify(headers, self.body, time.time(), query=query)
            except errors.SignatureInvalid as exc:
                raise errors.SignatureInvalid(f"route {name!r}: {exc.message}") from None
        event_id, event_type = route.extractor.extract(headers, query, self.body)
        return event_id, event_type, hashlib.sha256(self.body).digest()

    async def _once(self, key: database.Key) -> tuple[web.StreamResponse, errors.Outcome]:
        """Take this event's turn in this process, then claim it; or, a copy here having just
        committed it, answer as a duplicate at once."""
        route = self.route
        started = time.perf_counter()
        turn = self.services.flights.turn((key.scope, key.event_id), route.claim_wait)
        self.turn = turn
        async with turn as flight:
            if flight.committed_sha256 is not None:
                # A copy in this process just committed this event: no database round trip.
                log_line.phase(self.line, "claim_ms", route.meters.claim_wait, started)
                mismatch = flight.committed_sha256 != key.body_sha256
                return self._duplicate(key, mismatch, flight.answer)
            # The local wait and the row lock's share one claim_wait.
            wait = route.semantics.lock_wait(route.claim_wait - (time.perf_counter() - started))
            try:
                return await self._claimed(key, wait, flight, started)
            except errors.ClaimWaitExceeded as exc:
                raise route.semantics.wait_exceeded(exc) from None

    # The claim protocol: _claimed and _forward (with _commit) are all that use the claim.

    async def _claimed(
        self, key: database.Key, wait: float, flight: flights.Flight, started: float
    ) -> tuple[web.StreamResponse, errors.Outcome]:
        """Claim ``key`` in the database, waiting at most ``wait`` on a copy's row lock; then
        forward it (a new event, with room at the app), keep it for the redeliverer (a new
        event the app has no room for, on a route that redelivers), or settle it as a
        duplicate."""
        route, trace = self.route, self.trace
        store = self.services.store
        keys = await self.services.executor.receipt_keys(route.config)
        room = self.services.room
        kept_for = await self._enter(room)  # None: a place at the app is this request's
        try:
            span = trace.database("claim", "INSERT")
            async with store.claim(key, wait) as claim:
                log_line.phase(self.line, "claim_ms", route.meters.claim_wait, started)
                trace.end(span, {"dedup.acquired": claim.acquired})
                if claim.acquired:
                    other = route.semantics.claimed_as(key, self.event_id)
                    if other is not None:
                        self.line["body_claimed_as"] = other
                    if keys is not None:
                        self.receipt = keys.key(route.table, key.scope, key.event_id)
                    if kept_for is not None:
                        return await self._keep_unsent(claim, kept_for)
                    if self.object is not None:
                        turn = await self._hold_object(claim, self.object, started)
                        if turn is not None:
                            return await self._not_forwarded(key, claim, flight, turn)
                    return await self._forward(key, claim, flight)
                span = trace.database("settle_duplicate", "ROLLBACK")
                mismatch, stored, kept = await claim.settle_duplicate(
                    read_answer=route.config.replay, inbox=route.redeliver is not None
                )
                trace.end(span)
        finally:
            if kept_for is None:
                room.leave()
        if kept is not None:
            return self._kept_duplicate(kept, mismatch)
        if not mismatch:
            # Committed elsewhere (another worker or replica) with this body: the copies
            # queued behind this one in this process need no database round trip either.
            flight.committed_sha256 = key.body_sha256
            flight.answer = stored
        return self._duplicate(key, mismatch, stored)

    async def _hold_object(
        self, claim: database.Claim, obj: ordering.Object, started: float
    ) -> database.Turn | None:
        """Take the request's object for this delivery (``Claim.hold_object``), waiting what
        claim_wait has left for a delivery of it at the app: None once held and to be
        forwarded; else why it is not forwarded (superseded, kept behind, or the wait ran
        out)."""
        route = self.route
        wait = route.claim_wait - (time.perf_counter() - started)
        span = self.trace.database("hold_object", "INSERT")
        turn = await claim.hold_object(
            database.Held(claim.key.scope, obj.key, obj.version), wait,
            behind=route.redeliver is not None,
        )  # fmt: skip
        self.trace.end(span, {"dedup.object": turn})
        if turn is database.Turn.HELD or (turn is database.Turn.STALE and not obj.supersedes):
            return None
        return turn

    async def _not_forwarded(
        self,
        key: database.Key,
        claim: database.Claim,
        flight: flights.Flight,
        turn: database.Turn,
    ) -> tuple[web.StreamResponse, errors.Outcome]:
        """An ordered delivery not forwarded: superseded (committed, 200), or, its object held
        or an older delivery of it kept, kept behind (a route that redelivers: 202) or answered
        as a copy in flight (503)."""
        if turn is database.Turn.STALE:
            await claim.supersede()
            flight.committed_sha256 = key.body_sha256
            payload = {"status": "superseded", "event_id": self.event_id}
            return _json(200, payload, "superseded"), "superseded"
        if self.route.redeliver is not None:
            return await self._keep_unsent(claim, KeptFor.ORDERING)
        raise errors.ClaimWaitExceeded(
            f"another delivery of object {self.object.key if self.object else ''!r} is at the app"
        )

    async def _enter(self, room: app_limit.Room) -> str | None:
        """Take a place at the app (``app_limit``) before claiming, since a claim holds its
        connection for as long as the app works on it: None once taken. A route that
        redelivers waits for one ``_keep_wait`` at most: why the delivery is kept
        instead ("limit"; or, its route held, "paused" or "retry_after"). Any other route
        waits its turn up to pool_timeout, then AppBusy; held, it is refused at once
        (RoutePaused). Their providers retry."""
        route = self.route
        hold = self.services.holds.held(self.scope)
        if route.redeliver is not None:
            if hold is not None:
                return hold.reason  # paused, or the app asked to wait: kept, sent after
            behind = route.config.verify is None
            return None if await room.enter(self._keep_wait(), behind=behind) else KeptFor.LIMIT
        if hold is not None:
            raise errors.RoutePaused.holding(route.config.name, hold)
        await self._wait_for_room(room)
        return None

    def _keep_wait(self) -> float:
        """How long a request of a route that redelivers waits for a place before it is kept:
        ``app_limit.KEEP_WAIT``, never past the route's hand_off (its provider is answered
        by then)."""
        hand_off = self.route.hand_off
        if hand_off is None:
            return app_limit.KEEP_WAIT
        left = hand_off - (time.perf_counter() - self.started)
        return max(0.0, min(app_limit.KEEP_WAIT, left))

    async def _wait_for_room(self, room: app_limit.Room) -> None:
        """A place at the app, waited for up to pool_timeout (behind the signed requests'
        and the lanes' when the route has no ``verify``); else AppBusy."""
        behind = self.route.config.verify is None
        if not await room.enter(self.route.pool_timeout, behind=behind):
            raise errors.AppBusy(
                f"no room at the app within {self.route.pool_timeout:g}s: {room.size} "
                "requests at it already (upstream.concurrency, this worker's share)"
            )

    async def _take_place(
        self, claim: database.Claim
    ) -> tuple[web.StreamResponse, errors.Outcome] | None:
        """With a limit shared by every replica (``database.slots``): one of its places, held
        in the claim's transaction (after its claim row and its object's), looked for again
        after a short backoff while none is free, the claim held meanwhile. None once held (or
        the limit is not shared). None free within ``_keep_wait`` on a route that redelivers:
        the delivery kept, as when this worker's room is full (202, kept_for "limit"); within
        pool_timeout on any other route: AppBusy (503), the claim released on the way out."""
        places = self.services.store.slots
        if places is None:
            return None
        route = self.route
        keeps = route.redeliver is not None
        patience = self._keep_wait() if keeps else route.pool_timeout
        deadline = time.monotonic() + patience
        tries = 0
        while not await claim.take_place(places):
            if tries == 0:
                self.services.metrics.app_place_waits.inc()
            left = deadline - time.monotonic()
            if left <= 0:
                self.line["place_waited"] = tries
                if keeps:
                    return await self._keep_unsent(claim, KeptFor.LIMIT)
                raise errors.AppBusy(
                    f"no place at the app within {patience:g}s: {places.limit} requests at it "
                    "already, from every replica (upstream.concurrency, shared)"
                )
            await asyncio.sleep(min(left, slots.backoff(tries)))
            tries += 1
        if tries:
            self.line["place_waited"] = tries
        return None

    async def _keep_unsent(
        self, claim: database.Claim, reason: str
    ) -> tuple[web.StreamResponse, errors.Outcome]:
        """Keep a new event the app was not sent (``reason``: why, a ``database.KeptFor``),
        due at once, and answer 202: the redeliverer sends it when the app has room, oldest
        first. When it cannot be kept, the claim is released and the provider told to retry:
        503."""
        self.sent = self._unsent_headers()
        kept = await self._keep(
            claim, database.Attempt(None), reason=reason, attempted=False, why=reason
        )
        if kept is not None:
            if reason == KeptFor.LIMIT:
                self.services.room.overflowed()  # due now: the lanes look
            return kept
        await self._release(claim)
        if self.line.get("inbox_not_kept"):
            raise errors.StoreUnavailable("keeping the delivery for the redeliverer failed")
        raise errors.AppBusy(
            f"{UNSENT[reason]}, and it could not be kept: "
            + ("its signed body is kept already" if self.line.get("inbox_kept_as") is not None
               else "the inbox is full (redeliver.max_pending, max_pending_bytes)")
        )  # fmt: skip

    async def _forward(
        self, key: database.Key, claim: database.Claim, flight: flights.Flight
    ) -> tuple[web.StreamResponse, errors.Outcome]:
        """Forward, then commit on a 2xx (with the answer to replay, where the route does) and
        tell the copies queued in this process: the answer and the outcome. Any other answer
        leaves the claim to be released on the way out. With a limit shared by every replica,
        a place of it first (``_take_place``)."""
        if (not_placed := await self._take_place(claim)) is not None:
            return not_placed
        result, handed = await self._attempt(claim)
        if handed is not None:
            return handed
        if not result.taken and (settled := await self._settled_by_receipt(claim)) is not None:
            return settled
        if result.failure is not None:
            if (kept := await self._failed(claim, result)) is not None:
                return kept
            await self._release(claim)
            raise result.failure
        upstream = result.relayed()
        response = forwarder.relayed(upstream)
        if not upstream.ok:
            kept = await self._keep_failed(claim, result)
            if kept is None:
                await self._release(claim)
            return kept or (response, "upstream_error")
        return await self._processed(key, claim, flight, response, upstream)

    async def _processed(
        self,
        key: database.Key,
        claim: database.Claim,
        flight: flights.Flight,
        response: web.StreamResponse,
        upstream: http1.Answer,
    ) -> tuple[web.StreamResponse, errors.Outcome]:
        """The app answered 2xx: COMMIT (with the answer to replay, where the route does) and
        tell the copies queued in this process."""
        line = self.line
        answer = self._answer_to_store(upstream)
        try:
            done = await self._commit(claim, answer)
        except errors.CommitFailed as exc:
            # The upstream did the work: answering anything but its 2xx would make the provider
            # retry, and the retry would be forwarded again (see docs/guarantees.md).
            line["error"] = exc.message
            unsent = isinstance(exc, errors.CommitNotSent)
            return response, "commit_not_sent" if unsent else "ambiguous_commit"
        if done.answer_refused is not None:
            # Committed without its answer (the role may not store it): its duplicates get
            # the acknowledgement, and the operator a warning and a counter.
            line["answer_store_error"] = done.answer_refused
            self.route.meters.answer_store_failures.inc()
        if done.reconciled:
            line["reconciled"] = True  # re-claimed on another connection, without the answer
        flight.committed_sha256 = key.body_sha256
        flight.answer = done.stored(answer)
        if self.receipt is not None and self.route.receipt_check_due():
            await self._check_receipt_written()
        return response, "processed"

    async def _written(self) -> bool | None:
        """Whether the app committed this delivery's receipt (``database.receipts``): True,
        False, None (undecided); counted and on the log line."""
        assert self.receipt is not None
        executor = self.services.executor
        written, self.line["receipt"] = await executor.receipt_written(
            self.route.config, self.receipt
        )
        return written

    async def _settled_by_receipt(
        self, claim: database.Claim
    ) -> tuple[web.StreamResponse, errors.Outcome] | None:
        """On a route with ``receipt``, an attempt that did not come back 2xx: if the app
        committed its receipt (a second attempt failing on the first's receipt, an answer
        lost or late), its effect is done: the claim is committed and the provider answered
        200, the event never sent again. None otherwise (absent, or undecided: the delivery is
        failed as on any route; a later attempt cannot commit a second receipt)."""
        if self.receipt is None or not await self._written():
            return None
        try:
            done = await self._commit(claim, None)
        except errors.CommitFailed as exc:
            self.line["commit_error"] = exc.message  # its next copy is settled by the receipt
        else:
            if done.reconciled:
                self.line["reconciled"] = True  # re-claimed on another connection
        payload = {"status": "processed", "event_id": self.event_id, "receipt": "written"}
        return _json(200, payload, "processed"), "processed"

    async def _check_receipt_written(self) -> None:
        """A route that asks for receipts whose app answered 2xx without writing one says so
        (a warning, ``dedup_receipts_total{result="missing"}``): otherwise the doubt it was
        meant to settle would be settled as "not done", and the event sent again."""
        route = self.route
        assert self.receipt is not None
        executor = self.services.executor
        if await executor.receipt_missing(route.config, self.receipt):
            self.line["receipt"] = "missing"
            log.warning(
                "route %s asks for receipts, but the app answered %s 2xx without writing one "
                "(Dedup-Receipt: SELECT dedup_receipt($1) in its transaction): doubtful "
                "outcomes of this route are settled as not done, and sent again",
                route.config.name, self.event_id,
            )  # fmt: skip

    async def _attempt(
        self, claim: database.Claim
    ) -> tuple[delivery.Result, tuple[web.StreamResponse, errors.Outcome] | None]:
        """The attempt at the app; on a route with a hand_off, the delivery handed off if the
        attempt has not ended by then (the answer already given, the result recorded: see
        ``_hand_off``), or kept unsent if the hand_off passed before it could start."""
        route = self.route
        if route.hand_off is None:
            return await self._call(), None
        after = route.hand_off - (time.perf_counter() - self.started)
        if after <= 0:
            return delivery.Result(None), await self._keep_unsent(claim, KeptFor.DEADLINE)
        # A shared place carried past the keep's COMMIT (``_carry_place``), until the attempt ends.
        async with contextlib.AsyncExitStack() as place:
            result, handed = await delivery.handing_off(
                self._call(), after, functools.partial(self._hand_off, claim, place)
            )
            if handed is not None:
                await self._after_hand_off(claim, result)
        return result, handed

    async def _carry_place(self, place: contextlib.AsyncExitStack) -> bool:
        """With a limit shared by every replica: before a hand-off's keep commits its claim,
        and with it the place it holds, a second place held in a transaction of its own on a
        connection free now, until the attempt ends (``place``): the app never has more than
        the limit, two places held for an instant at most. Whether one was (True when the
        limit is not shared); if not, no hand-off: the attempt is waited for in the claim's
        place."""
        store = self.services.store
        if store.slots is None:
            return True
        keeper = store.place_keeper()
        if keeper is None:
            return False
        try:
            if await place.enter_async_context(keeper):
                return True
        except errors.StoreUnavailable as exc:
            self.line["place_not_carried"] = exc.message
        await place.aclose()
        return False

    async def _hand_off(
        self, claim: database.Claim, place: contextlib.AsyncExitStack
    ) -> tuple[web.StreamResponse, errors.Outcome] | None:
        """The app has not answered by the route's hand_off: keep the delivery (committed),
        due only after the lease, let the copies queued here go on (they find it kept), and
        answer the provider 202 now, while the attempt goes on. None: it could not be kept
        (or, the limit shared, its place not carried past the COMMIT: ``_carry_place``), and
        the attempt's end is waited for as on any route."""
        route = self.route
        if not await self._carry_place(place):
            return None
        self.sent = self._unsent_headers()
        kept = await self._keep(
            claim, database.Attempt(None), reason=KeptFor.DEADLINE, delay=route.lease,
            attempted=False, why=KeptFor.HANDED_OFF,
        )  # fmt: skip
        if kept is None:
            await place.aclose()  # the claim still holds its place
            return None
        self.turn.let_go()
        response = kept[0]
        response.force_close()  # this connection is busy until the attempt ends
        await self._write(response)
        return kept

    async def _after_hand_off(self, claim: database.Claim, result: delivery.Result) -> None:
        """The attempt of a delivery handed off ended: its result in its row (delivered; or
        failed, due on the route's schedule), as a redelivery's is (``delivery.record``). If
        that fails, the row stays due at its lease's end, and is sent again then."""
        route, line = self.route, self.line
        obj = self.object
        handed = database.HandedOff(
            self.services.store.inbox, claim.key.scope, claim.key.event_id,
            obj=None if obj is None else obj.key, version=None if obj is None else obj.version,
        )  # fmt: skip
        executor = self.services.executor
        try:
            line["handed_off"] = await executor.record(
                handed, route.config, result, claim.key.scope, self.receipt
            )
        except errors.StoreUnavailable as exc:
            line["handed_off"] = "unrecorded"
            line["commit_error"] = exc.message

    async def _failed(
        self, claim: database.Claim, result: delivery.Result
    ) -> tuple[web.StreamResponse, errors.Outcome] | None:
        """No answer of the app's to relay (none came through, or a 410): the answer if the
        delivery was kept for redelivery; else None, and the failure is relayed."""
        failed = result.attempt
        if result.taken:
            # The app did the work; only its answer cannot be held or relayed (over budget,
            # cut off, malformed after a 2xx status line). Keep the claim: the provider's
            # retry of this 502 is then a duplicate, not a second delivery.
            self.line["upstream_status"] = failed.status
            try:
                await self._commit(claim, None)
            except errors.CommitFailed as exc:
                self.line["commit_error"] = exc.message
            return None
        kept = await self._keep_failed(claim, result)
        if kept is not None and failed.error is not None:
            self.line["error"] = failed.error  # kept: the line still says why the app failed
        return kept

    async def _keep_failed(
        self, claim: database.Claim, result: delivery.Result
    ) -> tuple[web.StreamResponse, errors.Outcome] | None:
        """Keep a delivery the app failed (``_keep``): due after the schedule's first wait, or
        after the app's ``Retry-After`` if it asked for longer, which then holds the claim's
        scope (on a templated route the tenant's, not the route's) as long (``holds``)."""
        route = self.route
        if route.redeliver is None:
            return None  # relayed, the claim released: the provider's retry is the next try
        # Its redeliveries, and its scope's, wait as long on every replica.
        retry_after = await self.services.executor.back_off(claim.key.scope, result)
        if retry_after is None:
            return await self._keep(claim, result.attempt)
        delay = max(retry_after, route.redeliver.schedule[0])
        return await self._keep(claim, result.attempt, reason=KeptFor.RETRY_AFTER, delay=delay)

    def _unsent_headers(self) -> tuple[tuple[str, str], ...]:
        """The headers the app is sent, for a delivery kept before its attempt ended."""
        return tuple(self._outgoing().headers.items())

    def _outgoing(self) -> transports.Request:
        """The request the app is sent (with the receipt's key, on a route with receipt)."""
        client = self.services.forwarder
        outgoing = client.outgoing(self.request, self.target, self.body, self.line["request_id"])
        self.services.executor.with_receipt(outgoing.headers, self.receipt)
        return outgoing

    async def _keep(
        self,
        claim: database.Claim,
        attempt: database.Attempt,
        *,
        reason: str = KeptFor.FAILED,
        delay: float | None = None,
        attempted: bool = True,
        why: str | None = None,
    ) -> tuple[web.StreamResponse, errors.Outcome] | None:
        """On a route that redelivers: keep the delivery and answer 202 (the provider need not
        retry); ``reason``: why (``database.KeptFor``: the app failed it, or it was not
        sent, then due at once); ``why``: what the kept row says of it for an operator
        (``inbox.KEPT_UNSENT``'s keys), when no attempt of its is recorded. None on any other
        route, or when it could not be kept (over the cap, its signed body kept already under
        another ID, or the database failed: marked on the line and counted), so the failure is
        relayed."""
        route, line = self.route, self.line
        if route.redeliver is None:
            return None
        config_ = route.config
        obj = self.object
        stored = database.StoredRequest(
            config_.name, config_.upstream, self.request.method, self.target, self.sent,
            self.body, why, None if obj is None else obj.key, None if obj is None else obj.version,
            obj is not None and obj.supersedes,
        )  # fmt: skip
        keep = delivery.keep(
            config_, route.redeliver, attempt, claim.key.scope,
            route.semantics.signed_part(claim.key),
            delay=0.0 if reason in UNSENT and delay is None else delay, attempted=attempted,
        )  # fmt: skip
        span = self.trace.database("queue", "UPDATE")
        state, kept_as = await claim.keep(stored, attempt, keep)
        self.trace.end(span, {"dedup.kept": state})
        if state == database.NotKept.FULL:
            line["inbox_full"] = True
            route.meters.inbox_full.inc()
            return None
        if state == database.NotKept.KEPT_AS:
            # The same signed body is kept already under another ID: a captured body re-sent
            # under a fresh ID (or one body sent as two events) is kept once, not once per ID.
            line["inbox_kept_as"] = kept_as or ""
            route.meters.inbox_replays.inc()
            return None
        if state == database.NotKept.FAILED:
            line["inbox_not_kept"] = True  # the database failed or refused: logged by the claim
            route.meters.inbox_keep_failures.inc()
            return None
        outcome: errors.Outcome = "dead_letter" if state == database.InboxState.DEAD else "queued"
        line["kept"] = state
        route.meters.kept[reason].inc()
        payload: dict[str, Any] = {"status": outcome, "event_id": self.event_id}
        if attempted:
            payload["upstream_status"] = attempt.status  # null: no answer came
        if reason != KeptFor.FAILED:
            line["kept_for"] = reason
            payload["kept_for"] = reason
        return _json(202, payload, outcome), outcome

    def _kept_duplicate(
        self, kept: database.InboxState, mismatch: bool
    ) -> tuple[web.StreamResponse, errors.Outcome]:
        """A copy of an event kept for redelivery: never forwarded (only the redeliverer
        forwards it), answered 202."""
        if mismatch:
            self.line["mismatch"] = True
        self.line["kept"] = kept
        payload = {"status": "duplicate", "event_id": self.event_id, "kept": kept}
        return _json(202, payload, "duplicate_queued"), "duplicate_queued"

    async def _commit(
        self, claim: database.Claim, answer: database.Answer | None
    ) -> database.Commit:
        """COMMIT the claim (with ``answer``), timed on the log line and in the metrics."""
        started = time.perf_counter()
        span = self.trace.database("commit", "COMMIT")
        try:
            done = await claim.commit(answer)
        finally:
            log_line.phase(self.line, "commit_ms", self.route.meters.commit_duration, started)
        self.trace.end(span, {"dedup.reconciled": True} if done.reconciled else None)
        return done

    async def _release(self, claim: database.Claim) -> None:
        """ROLLBACK: the app failed and the delivery is not kept (what the claim's ``async
        with`` would do on the way out, done here as a step of its own)."""
        if not claim.open:
            return  # committed (a 2xx whose answer failed), or its connection closed
        span = self.trace.database("release", "ROLLBACK")
        await claim.release()
        self.trace.end(span)

    async def _call(self) -> delivery.Result:
        """The attempt at the app (``delivery.attempt``); its status and time on the log line
        when an answer came through."""
        route, line = self.route, self.line
        started = time.perf_counter()
        outgoing = self._outgoing()
        result = await self.services.executor.attempt(
            route.config.upstream, outgoing, self.reservation.answer, self.trace,
            keeps=route.redeliver is not None,
        )  # fmt: skip
        self.sent = result.sent
        if result.answer is not None:
            line["upstream_status"] = result.answer.status
            log_line.phase(line, "upstream_ms", route.meters.upstream_duration, started)
        return result

    def _answer_to_store(self, upstream: http1.Answer) -> database.Answer | None:
        answer, skipped = replay.answer_to_store(self.route.config, upstream)
        if skipped is not None:
            self.line["replay_skipped"] = skipped
            self.route.meters.replay_skipped.inc()
        return answer

    def _duplicate(
        self, key: database.Key, mismatch: bool, stored: database.Answer | None
    ) -> tuple[web.StreamResponse, errors.Outcome]:
        route = self.route
        route.semantics.duplicate(key, mismatch)
        if mismatch:
            # Same ID, other bytes: the ID is not a per-event key here, or a replay. Never the
            # stored answer: it was the answer to another request (a one-time code in TwiML).
            self.line["mismatch"] = True
        elif stored is not None and route.config.replay:
            # (Only on a replay route: an ack route sharing the scope finds the replay route's
            # answer in the single-flight.)
            self.line["replayed"] = True
            self.trace.event("dedup.replay", {"http.response.status_code": stored.status})
            route.meters.replays.inc()
            response = replay.response(stored)
            self.reservation.replay(response.content_length or 0)
            return response, "duplicate"
        ack = {"status": "duplicate", "event_id": self.event_id}
        return _json(200, ack, "duplicate"), "duplicate"

    async def _write(self, response: web.StreamResponse) -> None:
        """Write the answer; a client gone (or cut off at send_timeout) is noted on the log
        line. aiohttp's own finish, after the handler, then finds the answer written or its
        connection closed."""
        try:
            await response.prepare(self.request)
            await response.write_eof()
        except ConnectionError:
            self.line["client_gone"] = True
        else:
            # A connection aborted while its answer waited to drain ends the wait without an
            # error.
            if self.request.transport is None:
                self.line["client_gone"] = True

    def _refuse(self, exc: errors.RequestError) -> web.Response:
        """The answer to a request that could not be carried through, noted and counted."""
        line, route = self.line, self.route
        if isinstance(exc, errors.BodyTooLarge):
            route.meters.oversized.inc()  # the operator's to fix: max_body is too small
        if exc.shed is not None:
            line["shed"] = exc.shed
            route.shed[exc.shed].inc()
        return refusal(line, exc, problem=route.semantics.problem)


def refusal(
    line: log_line.LogLine, exc: errors.RequestError, *, problem: bool = False
) -> web.Response:
    """The answer to a request that could not be carried through (``error_response``), its
    outcome and why on its log line: every refusal, on a route or not, is written here."""
    line["outcome"] = exc.outcome
    line["error"] = exc.message
    line["code"] = exc.code
    return error_response(exc, problem=problem)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_dispatcher(
    cfg: config.Config, meters: metrics.Metrics, traces: tracing.Tracing | None = None
) -> Handler:
    """The one handler: normalize the path, then the route it is, or pass-through."""
    traces = traces or tracing.Tracing((), proxy_headers.TrustedProxies(), cfg.database.table)
    table = paths.Table(
        [(route.pattern, Route(route, cfg, meters, traces)) for route in cfg.routes]
    )
    route_meters = meters.route("")
    upstream, passthrough = cfg.upstream.url, cfg.passthrough

    async def dispatch(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        services = request.app[app_keys.SERVICES]
        try:
            # Before anything reads a header: what is read must be what the app receives.
            forwarder.refuse_not_utf8(request.headers)
            target = paths.normalize(request.raw_path)
            match = table.match(target, request.raw_path)
            if match is not None and match.route.semantics.handles(request.method):
                return await Cycle(match.route, request, match, started, services).run()
            if not paths.passes(passthrough, target.path):
                if match is not None:
                    # A method an idempotency-key route does not claim is pass-through
                    # traffic, and pass-through does not allow it here.
                    route = match.route.config
                    raise errors.MethodNotAllowed(
                        f"route {route.name!r} claims {', '.join(route.methods)}, and "
                        "passthrough does not allow other methods on its path",
                        route.methods,
                    )
                raise errors.NotRouted()
        except errors.RequestError as exc:
            refused: errors.RequestError | None = exc
        else:
            refused = None
        # Not a route's: pass-through, or refused before it was one.
        line = log_line.start(request, None, None)
        trace = traces.begin(request, None, None, line)
        response: web.StreamResponse
        try:
            if refused is not None:
                raise refused
            with services.budget.reservation() as reservation:
                response = await services.forwarder.relay(
                    request,
                    upstream if match is None else match.route.config.upstream,
                    target.path + target.query,
                    line["request_id"],
                    trace=trace,
                    pause=cfg.client_body_timeout,
                    reserve=reservation.body,
                    go_ahead=functools.partial(request_body.go_ahead, request),
                )
            line["outcome"] = "passthrough"
        except errors.RequestError as exc:
            response = refusal(line, exc)
        except BaseException as raised:
            trace.abort(raised)
            raise
        log_line.finish(route_meters, line, started, response)
        trace.finish(line)
        return response

    return dispatch
