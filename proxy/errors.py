"""The proxy's exception tree.

Foreign exceptions are translated into these exactly once, where they enter, and nowhere else:

- the database driver's, in the claim store (``database.pool``);
- aiohttp's client errors and timeouts, in the upstream transports (``upstream.transports``),
  and the socket errors, timeouts and refused answers of the proxy's own client
  (``upstream.http1``);
- aiohttp's client errors and a provider API's refusals, in the provider API clients
  (``providers_api``);
- a request body that ends early or arrives too slowly, where it is read
  (``request_body``);
- aiohttp's client errors and timeouts while a signing certificate is fetched, in
  ``certificates``;
- YAML, file and value errors, in the config loader (``config``), and the embedded server's,
  in ``embedded``; an address that cannot be bound, in ``server``.

Everything above those boundaries deals only in this tree, and the pipeline turns a
``RequestError`` into its HTTP answer in one place, reading what the error carries: its
status, code, public text, outcome (the log line's and the metric's) and shed reason.

::

    * ProxyError
      x ConfigError                 start-up; lists every problem at once
      x UsageError                  a command-line argument the configuration refuses
      x EmbeddedDatabaseError       the embedded PostgreSQL could not be started
      x UnsafeRuntime               aiohttp's C HTTP parser is not in use
      x ListenFailed                a listener's address is taken or not allowed
      x CommitFailed                COMMIT after an upstream 2xx did not go through
        x CommitNotSent             ... never sent: the connection was closed before it
      x StartTimedOut               no answer from the database within start_timeout
      x ProviderAPIError            a provider's API (reconcile) did not answer as asked;
                                    carries .kind, the label of dedup_reconcile_errors_total
        x ProviderRateLimited       429, or 403 with Retry-After or x-ratelimit-remaining 0;
                                    carries .retry_after (seconds)
        x ProviderUnauthorized      401 or 403: the token expired, was revoked or lacks
                                    the permission
        x ProviderUnavailable       5xx, refused, reset or timed out
        x ProviderRefused           any other answer, or one not as the API describes
        x RecoveryRefused           the route did not take an event the reconciler delivered
                                    itself (Stripe): its signature, the database, the app
      x RequestError                carries .status, .code, .retry_after, .headers, .public,
                                    .outcome ("rejected" unless noted) and .shed (None unless
                                    noted: the request was shed to protect the worker)
        + PathRefused               400  an ambiguous variant of a webhook path, not origin-form
        + HeaderRefused             400  a request header value whose bytes are not UTF-8
        + NotRouted                 404  matches no route, and pass-through does not allow it
        + MethodNotAllowed          405  a webhook path with a method its route does not take
        + EventIdInvalid            400  no usable event ID in the request
          + EventIdMissing          400  the event ID's source is absent
            + KeyMissing            400  an idempotency-key route's request has no key
          + KeyInvalid              400  an Idempotency-Key that is no RFC 8941 string
        + ClientUnidentified        400  a scope_from header absent or repeated
        + RequestIncomplete         400  the body ended before its declared end
        + SignatureInvalid          401  the route's signature check failed
        + CertificateUnavailable    503  the signing certificate a request names could not be
                                         fetched from its allowed host (outcome unavailable)
        + KeyInProgress             409  an Idempotency-Key whose first request is in flight
                                         (outcome in_progress)
        + KeyReused                 422  an Idempotency-Key sent again with another request
                                         (outcome key_reused)
        + RequestTimeout            408  the client sent its body too slowly
        + BodyTooLarge              413  body over max_body
        + StoreUnavailable          503  database down, pool exhausted, schema missing
                                         (outcome unavailable)
          + PoolExhausted           503  no free database connection within pool_timeout
                                         (shed: pool)
          + ClaimWaitExceeded       503  a copy waited longer than claim_wait
          + LockTimeout             503  a lock not granted within lock_timeout (55P03)
          + StatementCancelled      503  the statement cancelled (57014: statement_timeout,
                                         a claim's own on Citus; pg_cancel_backend)
          + TableMissing            503  the claim table, or a column of it, does not exist
                                         (42P01, 42703)
          + PermissionDenied        503  the role lacks a privilege (42501)
          + ReadOnly                503  the server takes no writes (25006, a standby)
          + Reconnecting            503  connecting failed just now; waiting out a back-off
          + Starting                503  started during an outage: no answer from it yet
          + NotPrepared             503  the table or the grants are not what routes need
        + Overloaded                503  the request does not fit max_buffered
                                         (outcome unavailable, shed: memory)
        + AppBusy                   503  no room at the app (upstream.concurrency) within
                                         pool_timeout, on a route that cannot keep it
                                         (outcome unavailable, shed: limit)
          + RoutePaused             503  the route is held (events pause) and cannot keep
                                         what arrives: it has no redeliver
            + RouteHeldForTheApp    503  the same, held because the app answered Retry-After
        + UpstreamFailed                 the app's answer did not come through (outcome
                                         upstream_error); carries .upstream_status (the status
                                         line, if it came)
          + UpstreamUnavailable     502  refused, reset or unreachable upstream
            + AnswerOverBudget      502  the app's answer does not fit max_buffered
                                         (shed: memory)
          + UpstreamTimeout         504  upstream did not answer in time

A subclass's docstring is its default message.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal, Self

# A request's outcome: on its log line (``log_line.LogLine``), in the Dedup-Status of the
# proxy's own answers, and as dedup_requests_total's label (``metrics.OUTCOMES``). An error's
# is one of them (``RequestError.outcome``).
Outcome = Literal[
    "processed", "duplicate", "upstream_error", "rejected", "unavailable", "passthrough",
    "unclaimed", "ambiguous_commit", "commit_not_sent", "in_progress", "key_reused", "queued",
    "dead_letter", "duplicate_queued", "superseded", "handshake",
]  # fmt: skip


class ProxyError(Exception):
    """The proxy failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or " ".join((self.__doc__ or "").split()))

    @property
    def message(self) -> str:
        return str(self.args[0])


class ConfigError(ProxyError):
    """Invalid configuration."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        lines = "\n".join(f"  {problem}" for problem in self.problems)
        super().__init__(f"invalid configuration in {source}:\n{lines}")


class UsageError(ProxyError):
    """A command-line argument the configuration refuses (an unknown route, a scope not the
    route's), or arguments that do not go together: the CLI's usage error, exit status 2, as
    argparse's own."""


class EmbeddedDatabaseError(ProxyError):
    """The embedded PostgreSQL could not be started."""


class UnsafeRuntime(ProxyError):
    """aiohttp's C HTTP parser is not in use (AIOHTTP_NO_EXTENSIONS set, or no compiled wheel for
    this platform); the pure-Python parser is more lenient, and leniency is how requests are
    smuggled past a proxy. Refusing to start."""


class ListenFailed(ProxyError):
    """A listener could not be opened."""


class CommitFailed(ProxyError):
    """COMMIT did not go through; whether the claim was stored is unknown."""


class CommitNotSent(CommitFailed):
    """The connection was closed before COMMIT could be sent: the claim is certainly not
    stored (its transaction ended with the connection), and it could not be stored again."""


class StartTimedOut(ProxyError):
    """The database did not answer within database.start_timeout of the start."""


class ProviderAPIError(ProxyError):
    """The provider's API did not answer as asked."""

    kind = "error"


class ProviderRateLimited(ProviderAPIError):
    """The provider's API asked to slow down."""

    kind = "rate_limited"

    def __init__(self, message: str | None = None, *, retry_after: float = 60.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ProviderUnauthorized(ProviderAPIError):
    """The provider's API refused the token: expired, revoked, or without the permission."""

    kind = "unauthorized"


class ProviderUnavailable(ProviderAPIError):
    """The provider's API did not answer (5xx, refused, reset or timed out)."""

    kind = "unavailable"


class ProviderRefused(ProviderAPIError):
    """The provider's API refused the request, or answered other than as it is described."""

    kind = "refused"


class RecoveryRefused(ProviderAPIError):
    """The route did not take a recovered event: a non-2xx answer (``status``), or no answer
    (``status`` None)."""

    kind = "recovery_refused"

    def __init__(self, message: str | None = None, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def about_the_event(self) -> bool:
        """Whether the answer is about this event alone (the app's, or a body the route
        refuses), so that the run goes on to the next gap. Not: no answer, a signature the
        route refuses (401, 403: every event would be) or the proxy's own 503 or 429 (its
        database, or the app's limit: the next run)."""
        return self.status is not None and self.status not in (401, 403, 429, 503)


class RequestError(ProxyError):
    """The request could not be processed."""

    status = 500
    code = "internal_error"
    retry_after: int | None = None
    # The request's outcome on its log line, in its Dedup-Status and in dedup_requests_total.
    outcome: Outcome = "rejected"
    # Why the request was shed to protect the worker (dedup_shed_requests_total), if it was.
    shed: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """Header fields the answer needs besides Retry-After."""
        return {}

    @property
    def public(self) -> str:
        """The fixed message of this error's answer: its class docstring. The details (which
        may quote a socket error, the app's bytes or a URL) are for the log line only."""
        return " ".join((type(self).__doc__ or "").split())


class PathRefused(RequestError):
    """The request path is refused."""

    status = 400
    code = "path_refused"


class HeaderRefused(RequestError):
    """A request header value holds bytes that are not UTF-8."""

    status = 400
    code = "header_refused"


class NotRouted(RequestError):
    """No route for this path, and pass-through is not allowed for it."""

    status = 404
    code = "not_found"


class MethodNotAllowed(RequestError):
    """This webhook path does not take that method."""

    status = 405
    code = "method_not_allowed"

    def __init__(self, message: str, allow: Sequence[str]) -> None:
        super().__init__(message)
        self.allow = tuple(allow)

    @property
    def headers(self) -> dict[str, str]:
        return {"Allow": ", ".join(self.allow)}


class EventIdInvalid(RequestError):
    """The request carries no usable event ID."""

    status = 400
    code = "event_id_invalid"


class EventIdMissing(EventIdInvalid):
    """The request carries no event ID."""


class KeyMissing(EventIdMissing):
    """The request carries no Idempotency-Key."""

    code = "idempotency_key_missing"


class KeyInvalid(EventIdInvalid):
    """The Idempotency-Key must be an RFC 8941 string of 1 to 256 printable ASCII characters."""

    code = "idempotency_key_invalid"


class ClientUnidentified(RequestError):
    """The request does not carry, once, the header this route tells clients apart by."""

    status = 400
    code = "client_unidentified"


class RequestIncomplete(RequestError):
    """The request body ended before its declared end."""

    status = 400
    code = "request_incomplete"


class SignatureInvalid(RequestError):
    """The request's signature does not verify."""

    status = 401
    code = "signature_invalid"


class CertificateUnavailable(RequestError):
    """The signing certificate could not be fetched; try again later."""

    status = 503
    code = "certificate_unavailable"
    retry_after = 5
    outcome: Outcome = "unavailable"


class KeyInProgress(RequestError):
    """A request with this Idempotency-Key is still being processed; retry later."""

    status = 409
    code = "idempotency_key_in_progress"
    outcome: Outcome = "in_progress"


class KeyReused(RequestError):
    """This Idempotency-Key was already used with a different request."""

    status = 422
    code = "idempotency_key_reused"
    outcome: Outcome = "key_reused"


class RequestTimeout(RequestError):
    """The request body did not arrive within client_timeout."""

    status = 408
    code = "request_timeout"


class BodyTooLarge(RequestError):
    """The request body is larger than max_body."""

    status = 413
    code = "body_too_large"


class StoreUnavailable(RequestError):
    """The claim store (PostgreSQL) is unavailable."""

    status = 503
    code = "store_unavailable"
    retry_after = 5
    outcome: Outcome = "unavailable"


class PoolExhausted(StoreUnavailable):
    """No database connection is free; try again later."""

    shed = "pool"


class ClaimWaitExceeded(StoreUnavailable):
    """Another copy of this event is still in flight; try again later."""

    code = "claim_wait_exceeded"


class LockTimeout(StoreUnavailable):
    """A row or table lock was not granted within the transaction's lock_timeout (55P03)."""


class StatementCancelled(StoreUnavailable):
    """The server cancelled the statement (57014): a statement_timeout (on Citus, the bound
    that ends a wait on a worker's row lock: ``sql.wait_bound``), or pg_cancel_backend."""


def waited(distributed: bool) -> tuple[type[StoreUnavailable], ...]:
    """The errors that mean a wait on a row ran past its bound: LockTimeout, and on a table
    distributed by Citus, whose rows' locks the coordinator's lock_timeout does not reach, the
    statement cancelled by the bound's statement_timeout too."""
    return (LockTimeout, StatementCancelled) if distributed else (LockTimeout,)


class TableMissing(StoreUnavailable):
    """The claim table, or a column of it, does not exist (42P01, 42703)."""


class PermissionDenied(StoreUnavailable):
    """The role lacks a privilege the statement needs (42501)."""


class ReadOnly(StoreUnavailable):
    """The server takes no writes: a standby, or a primary demoted or set read-only (25006)."""


class Reconnecting(StoreUnavailable):
    """Connections to the database failed just now; the next attempt waits out a back-off."""


class Starting(StoreUnavailable):
    """The proxy is starting: the database has not answered yet."""


class NotPrepared(StoreUnavailable):
    """The database answers, but the claim table or the role's grants are not what the routes
    need; retrying does not fix it (the start is refused)."""


class UpstreamFailed(RequestError):
    """The upstream's answer did not come through."""

    outcome: Outcome = "upstream_error"

    def __init__(self, message: str | None = None, *, upstream_status: int | None = None) -> None:
        super().__init__(message)
        # The status line the app had sent when its answer failed (None: none arrived).
        self.upstream_status = upstream_status

    @property
    def answered_2xx(self) -> bool:
        """The app did the work: the claim is kept although the answer cannot be relayed."""
        return self.upstream_status is not None and 200 <= self.upstream_status < 300

    def after(self, upstream_status: int | None) -> Self:
        """The same failure, raised anew as one after the app's status line
        ``upstream_status`` (a failure raised before the status was known, by a Reserve)."""
        return type(self)(self.message, upstream_status=upstream_status)


class UpstreamUnavailable(UpstreamFailed):
    """The upstream could not be reached or dropped the connection."""

    status = 502
    code = "upstream_unavailable"


class AnswerOverBudget(UpstreamUnavailable):
    """The upstream's answer does not fit the proxy's memory budget."""

    code = "answer_too_large"
    shed = "memory"


class Overloaded(RequestError):
    """The proxy is at its memory limit; try again later."""

    status = 503
    code = "overloaded"
    retry_after = 5
    outcome: Outcome = "unavailable"
    shed = "memory"


class AppBusy(RequestError):
    """The app has as many requests as upstream.concurrency allows; try again later."""

    status = 503
    code = "app_busy"
    retry_after = 5
    outcome: Outcome = "unavailable"
    shed: str | None = "limit"


class RoutePaused(AppBusy):
    """The route is paused; try again later."""

    code = "route_paused"
    shed = None

    @classmethod
    def holding(cls, route: str, hold: Any) -> RoutePaused:
        """The refusal of a webhook on ``route`` while ``hold`` (a ``database.Hold``) holds it,
        saying what holds it (an operator's pause, or the app's Retry-After): ``Retry-After``
        its remaining time, from 5 s to a minute (the provider backs off on its own past
        that)."""
        left = 60.0 if hold.until is None else hold.until - time.time()
        held = RoutePaused if hold.reason == "paused" else RouteHeldForTheApp
        refusal = held(f"route {route!r} is held ({hold.reason}; dedup-proxy events resume)")
        refusal.retry_after = int(min(60.0, max(5.0, left)))
        return refusal


class RouteHeldForTheApp(RoutePaused):
    """The app asked for a pause (Retry-After); try again later."""

    code = "app_retry_after"


class UpstreamTimeout(UpstreamFailed):
    """The upstream did not answer in time."""

    status = 504
    code = "upstream_timeout"
