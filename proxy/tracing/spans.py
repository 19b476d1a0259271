"""The spans themselves, on the OpenTelemetry SDK (the extra ``otel``): imported only when
tracing is on (``proxy.tracing``).

``Sdk`` is the process's tracer provider, its batch processors and the propagator; ``begin``
starts a request's SERVER span, continuing a trusted peer's trace or linking an untrusted one's.
``RequestTrace`` is one request's spans. The batch queue's drops are counted here, from what
is handed to the processor and what it hands to the exporter, without the SDK's internals.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar
from urllib.parse import urlsplit, urlunsplit

from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry import context as context_api
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import Span, Status, StatusCode

import proxy

if TYPE_CHECKING:
    from proxy import log_line
    from proxy.upstream import proxy_headers

log = logging.getLogger("proxy.tracing")

# What the counter is told: "exported", "failed" (the collector refused or was unreachable:
# the batch is lost) or "dropped" (the queue was full), and how many spans.
Count = Callable[[str, int], None]

SERVICE_NAME = "webhook-dedup-proxy"
# The SDK's default for OTEL_BSP_MAX_QUEUE_SIZE (the specification's).
DEFAULT_QUEUE = 2048

# The methods the HTTP conventions name; any other is "_OTHER" (and its span name "HTTP").
_KNOWN_METHODS = frozenset(
    ("CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE", "QUERY")
)
_NAMED_BY_TABLE = frozenset(("INSERT", "UPDATE", "SELECT"))


# The trace headers the app is sent the proxy's own of, whatever OTEL_PROPAGATORS names: with
# "tracecontext" alone a client's baggage would reach the app untouched otherwise.
W3C_FIELDS = ("baggage", "traceparent", "tracestate")
P = ParamSpec("P")
R = TypeVar("R")
_complained = [0.0]  # when a failure was last logged (monotonic)


def never_raises(method: Callable[P, R]) -> Callable[P, R | None]:
    """Tracing never changes an answer: a failure in it is logged (once a minute at most)
    and the call returns None (no span), the request going on untraced from there."""

    @functools.wraps(method)
    def guarded(*args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return method(*args, **kwargs)
        except Exception:
            if time.monotonic() - _complained[0] > 60:
                _complained[0] = time.monotonic()
                log.exception("tracing failed (the request goes on; spans may be missing)")
            return None

    return guarded


def _no_count(result: str, spans: int) -> None:
    return None


def _text(value: str) -> str:
    """``value`` as OTLP can carry it: a lone surrogate (a header's obs-text, a JSON event ID's
    escape) replaced, rather than the attribute dropped (or, in a status, the batch lost)."""
    if value.isascii():
        return value
    return value.encode("utf-8", "replace").decode("utf-8")


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    for key, value in attributes.items():
        if type(value) is str and not value.isascii():
            attributes[key] = _text(value)
    return attributes


class Sdk:
    """The tracer provider and what each request's trace shares."""

    def __init__(
        self,
        exporters: Sequence[str],
        trusted: proxy_headers.TrustedProxies,
        table: str,
        count: Count | None,
    ) -> None:
        resource = Resource.create({"service.version": proxy.__version__})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        # ``Tracing.close`` shuts it down within its timeout; the SDK's own at-exit shutdown
        # would wait up to 30 s for a collector that hangs.
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        count = count or _no_count
        size = _queue_size(os.environ)
        for name in exporters:
            queue = _Queue(size, count)
            processor = BatchSpanProcessor(_Counted(_exporter(name), queue), max_queue_size=size)
            self.provider.add_span_processor(_Bounded(processor, queue))
        self.tracer = self.provider.get_tracer("webhook-dedup-proxy", proxy.__version__)
        self.propagator = propagate.get_global_textmap()
        self.fields = tuple(
            sorted({field.lower() for field in self.propagator.fields}.union(W3C_FIELDS))
        )
        self.trusted = trusted
        self.table = table
        self._upstreams: dict[str, tuple[str, str, int | None]] = {}

    def shutdown(self) -> None:
        self.provider.shutdown()

    @never_raises
    def begin(
        self, request: web.BaseRequest, route: str | None, http_route: str | None,
        line: log_line.LogLine,
    ) -> RequestTrace:  # fmt: skip
        headers = request.headers
        trusted = self.trusted.trusts(request.remote)
        parent, links = self._parent(headers, trusted)
        method = request.method
        known = method if method in _KNOWN_METHODS else "_OTHER"
        name = "HTTP" if known == "_OTHER" else known
        # What a sampler may look at, at the start; the rest only on a span that records.
        attributes: dict[str, Any] = {
            "http.request.method": known,
            "url.path": request.raw_path.partition("?")[0],
            "url.scheme": request.scheme,
        }
        if http_route is not None:
            attributes["http.route"] = http_route
            name = f"{name} {http_route}"
        span = self.tracer.start_span(
            name, context=parent, kind=trace.SpanKind.SERVER, attributes=_clean(attributes),
            links=links,
        )  # fmt: skip
        if span.is_recording():
            span.set_attributes(_clean(_request_attributes(request, trusted, route, known)))
        ids = span.get_span_context()
        line["trace_id"] = format(ids.trace_id, "032x")
        line["span_id"] = format(ids.span_id, "016x")
        return RequestTrace(self, span, trace.set_span_in_context(span, parent))

    def _parent(
        self, headers: CIMultiDictProxy[str], trusted: bool
    ) -> tuple[context_api.Context, Sequence[trace.Link]]:
        """A trusted peer's context, continued; anyone else's, a link from a new trace."""
        if trusted:
            return self.propagator.extract(headers), ()
        if any(field in headers for field in self.fields):
            named = trace.get_current_span(self.propagator.extract(headers)).get_span_context()
            if named.is_valid:
                return context_api.Context(), (trace.Link(named, {"webhook.untrusted": True}),)
        return context_api.Context(), ()

    @never_raises
    def redelivery(
        self,
        route: str,
        event_id: str,
        attempt: int,
        headers: Sequence[tuple[str, str]],
        claim_id: str | None = None,
    ) -> RequestTrace:
        """A redelivery's trace: a new one (its root an INTERNAL span), linked to the first
        delivery's forward through the trace headers that delivery was sent with and kept."""
        links: Sequence[trace.Link] = ()
        kept = {name.lower(): value for name, value in headers if name.lower() in self.fields}
        if kept:
            first = trace.get_current_span(self.propagator.extract(kept)).get_span_context()
            if first.is_valid:
                links = (trace.Link(first, {"webhook.first_delivery": True}),)
        root = context_api.Context()
        attributes: dict[str, Any] = {"webhook.route": route, "webhook.event_id": event_id,
                                      "webhook.redelivery.attempt": attempt}  # fmt: skip
        if claim_id is not None:
            attributes["dedup.claim_id"] = claim_id
        span = self.tracer.start_span(
            f"redeliver {route}", context=root, kind=trace.SpanKind.INTERNAL, links=links,
            attributes=attributes,
        )  # fmt: skip
        return RequestTrace(self, span, trace.set_span_in_context(span, root))

    def upstream(self, base_url: str) -> tuple[str, str, int | None]:
        """``base_url`` without credentials, its host and its port, as the spans show them."""
        known = self._upstreams.get(base_url)
        if known is None:
            parts = urlsplit(base_url)
            host = parts.hostname or ""
            netloc = f"[{host}]" if ":" in host else host
            if parts.port is not None:
                netloc = f"{netloc}:{parts.port}"
            base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
            port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
            known = self._upstreams[base_url] = (base, host, port)
        return known

    def inject(self, context: context_api.Context, headers: CIMultiDict[str]) -> None:
        """Replace whatever trace headers ``headers`` carry with ``context``'s."""
        for field in self.fields:
            headers.popall(field, None)
        self.propagator.inject(headers, context=context)


def _request_attributes(
    request: web.BaseRequest, trusted: bool, route: str | None, known: str
) -> dict[str, Any]:
    """The SERVER span's attributes from the request, past the ones it starts with."""
    headers = request.headers
    attributes: dict[str, Any] = {
        "network.protocol.version": f"{request.version.major}.{request.version.minor}",
    }
    if known == "_OTHER":
        attributes["http.request.method_original"] = request.method
    if route is not None:
        attributes["webhook.route"] = route
    if request.remote:
        attributes["client.address"] = request.remote
        attributes["network.peer.address"] = request.remote
    host = headers.get(hdrs.HOST)
    if trusted:
        # Behind an ingress: the client and the host it reached, as the ingress says.
        if forwarded := headers.get(hdrs.X_FORWARDED_FOR):
            attributes["client.address"] = forwarded.partition(",")[0].strip()
        host = headers.get(hdrs.X_FORWARDED_HOST, host)
    _server_of(host, attributes)
    if agent := headers.get(hdrs.USER_AGENT):
        attributes["user_agent.original"] = agent
    return attributes


def _server_of(host: str | None, attributes: dict[str, Any]) -> None:
    """server.address and server.port from a Host header ("example.com:8443", "[::1]:80")."""
    if not host:
        return
    address, colon, port = host.rpartition(":")
    # isdecimal alone takes "²" and other digits int() refuses; a port is ASCII, 1 to 65535.
    if not colon or not (port.isascii() and port.isdecimal() and 0 < int(port) < 65536):
        address, port = host, ""
    attributes["server.address"] = address.strip("[]")
    if port:
        attributes["server.port"] = int(port)


def _queue_size(environ: Mapping[str, str]) -> int:
    try:
        size = int(environ.get("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_QUEUE))
    except ValueError:
        return DEFAULT_QUEUE  # as the SDK does with a value it cannot read
    return size if size > 0 else DEFAULT_QUEUE


def _exporter(name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


class _Queue:
    """How many spans one batch processor holds, told by ``_Bounded`` (handed in) and
    ``_Counted`` (handed to the exporter): a span handed in while it is full makes the SDK's
    queue drop its oldest, counted as "dropped". The event loop and the SDK's batch thread
    both move it, under a lock."""

    def __init__(self, size: int, count: Count) -> None:
        self.size = size
        self.count = count
        self.held = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            full = self.held >= self.size
            if not full:
                self.held += 1
        if full:
            self.count("dropped", 1)

    def taken(self, spans: int) -> None:
        with self._lock:
            self.held = max(0, self.held - spans)


class _Bounded(SpanProcessor):
    """A batch processor that tells its ``_Queue`` each sampled span it is handed."""

    def __init__(self, processor: BatchSpanProcessor, queue: _Queue) -> None:
        self._processor = processor
        self._queue = queue

    def on_start(self, span: Span, parent_context: context_api.Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            self._queue.add()
            self._processor.on_end(span)

    def shutdown(self) -> None:
        self._processor.shutdown()  # type: ignore[no-untyped-call]

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._processor.force_flush(timeout_millis)


class _Counted(SpanExporter):
    """An exporter that counts what it is given: exported, or failed."""

    def __init__(self, exporter: SpanExporter, queue: _Queue) -> None:
        self._exporter = exporter
        self._queue = queue

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._queue.taken(len(spans))
        try:
            result = self._exporter.export(spans)
        except Exception:
            self._queue.count("failed", len(spans))
            raise
        ok = result is SpanExportResult.SUCCESS
        self._queue.count("exported" if ok else "failed", len(spans))
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class RequestTrace:
    """One request's spans: the SERVER span, and the CLIENT spans it starts. A span left open
    when the request ends (its step raised) ends with the request's error."""

    __slots__ = ("_open", "_sdk", "context", "recording", "span")

    def __init__(self, sdk: Sdk, span: Span, context: context_api.Context) -> None:
        self._sdk = sdk
        self.span = span
        self.context = context
        # Not sampled: no span below it would be either (the parent-based sampler, whatever
        # the root's), so none is started; the app is sent this one's context, unsampled.
        self.recording = span.is_recording()
        self._open: list[Span] = []

    @never_raises
    def database(self, step: str, operation: str) -> Span | None:
        """A span for one round trip of the claim protocol (``step``), ``operation`` the SQL
        verb that ends it; never the statement (it holds the event ID)."""
        if not self.recording:
            return None
        table = self._sdk.table
        name = f"{operation} {table}" if operation in _NAMED_BY_TABLE else operation
        span = self._sdk.tracer.start_span(
            name, context=self.context, kind=trace.SpanKind.CLIENT,
            attributes={"db.system.name": "postgresql", "db.operation.name": operation,
                        "db.collection.name": table, "dedup.step": step},
        )  # fmt: skip
        self._open.append(span)
        return span

    @never_raises
    def end(self, span: Span | None, attributes: Mapping[str, Any] | None = None) -> None:
        """End a span this trace started, with ``attributes``."""
        if span is None:
            return
        if attributes and span.is_recording():
            span.set_attributes(attributes)
        span.end()
        self._open.remove(span)

    @never_raises
    def forwarding(
        self, method: str, base_url: str, target: str, headers: CIMultiDict[str]
    ) -> Span | None:
        """The forward's CLIENT span, started now; ``headers`` carry it to the app."""
        if not self.recording:
            self._sdk.inject(self.context, headers)
            return None
        base, host, port = self._sdk.upstream(base_url)
        known = method if method in _KNOWN_METHODS else "_OTHER"
        attributes: dict[str, Any] = {
            "http.request.method": known,
            "server.address": host,
            "url.full": base + _text(_redacted(target)),
            "network.protocol.version": "1.1",
        }
        if port is not None:
            attributes["server.port"] = port
        if known == "_OTHER":
            attributes["http.request.method_original"] = method
        span = self._sdk.tracer.start_span(
            known if known != "_OTHER" else "HTTP", context=self.context,
            kind=trace.SpanKind.CLIENT, attributes=attributes,
        )  # fmt: skip
        self._open.append(span)
        self._sdk.inject(trace.set_span_in_context(span, self.context), headers)
        return span

    @never_raises
    def answered(self, span: Span | None, status: int, resend_count: int = 0) -> None:
        """The app answered ``status`` (after ``resend_count`` more sends): the CLIENT span
        ends, an error from 400 on (the conventions' rule for a client)."""
        if span is None:
            return
        if span.is_recording():
            span.set_attribute("http.response.status_code", status)
            if resend_count:
                span.set_attribute("http.request.resend_count", resend_count)
            if status >= 400:
                _failed(span, str(status), None)
        self.end(span)

    @never_raises
    def failed(self, span: Span | None, kind: str, message: str) -> None:
        """The span's step failed (``kind``: the error's code): it ends as an error."""
        if span is None:
            return
        if span.is_recording():
            _failed(span, kind, message)
        self.end(span)

    @never_raises
    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        """A span event on the SERVER span (a replay, a mismatch)."""
        self.span.add_event(name, attributes)

    def _end_open(self, kind: str | None, description: str | None) -> None:
        """End the spans a step left open: as errors of ``kind``, or (None) as they are."""
        for span in self._open:
            if kind is not None and span.is_recording():
                _failed(span, kind, description)
            span.end()
        self._open.clear()

    @never_raises
    def abort(self, exc: BaseException) -> None:
        """The request or redelivery ended by an exception it was not meant to end by (a
        cancellation at the end of a drain, a bug): every span ends as an error naming it."""
        kind = type(exc).__name__
        self._end_open(kind, str(exc) or kind)
        if self.span.is_recording():
            _failed(self.span, kind, str(exc) or kind)
        self.span.end()

    @never_raises
    def close(self, attributes: Mapping[str, Any], error: str | None = None) -> None:
        """End every span still open, then the root, with ``attributes`` (an error, with
        ``error``, when the step it stands for failed)."""
        self._end_open(None, None)
        span = self.span
        if span.is_recording():
            span.set_attributes(attributes)
            if error is not None:
                _failed(span, str(attributes.get("dedup.redelivery.result", "error")), error)
        span.end()

    @never_raises
    def finish(self, line: log_line.LogLine) -> None:
        """End every span still open, then the SERVER span, with the line's facts."""
        error = line.get("error")
        self._end_open(line.get("outcome", "error"), error)
        span = self.span
        if span.is_recording():
            span.set_attributes(_clean(_server_attributes(line)))
            status = line.get("status", 500)
            if status >= 500:
                _failed(span, str(status), error)
            if line.get("mismatch"):
                event = {"webhook.event_id": line.get("event_id", "")}
                span.add_event("dedup.mismatch", _clean(event))
        span.end()


def _server_attributes(line: log_line.LogLine) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "http.response.status_code": line.get("status", 500),
        "dedup.outcome": line.get("outcome", "rejected"),
    }
    if "event_id" in line:
        attributes["webhook.event_id"] = line["event_id"]
    if "claim_id" in line:
        attributes["dedup.claim_id"] = line["claim_id"]
    if line.get("event_type"):
        attributes["webhook.event_type"] = line["event_type"]
    if "claim_ms" in line:
        attributes["dedup.waited_ms"] = line["claim_ms"]
    for key in ("replayed", "mismatch", "reconciled"):
        if line.get(key):
            attributes[f"dedup.{key}"] = True
    if "kept" in line:
        attributes["dedup.kept"] = line["kept"]
    if "upstream_status" in line and line["upstream_status"] is not None:
        attributes["webhook.upstream_status"] = line["upstream_status"]
    return attributes


def _failed(span: Span, kind: str, description: str | None) -> None:
    description = None if description is None else _text(description)
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, description))


def _redacted(target: str) -> str:
    """``target`` with every query value redacted, its names kept: the conventions redact the
    values of signed URLs' parameters; a webhook URL's query carries tokens of any name
    (``?token=…``), and a trace store is read by more people than the log."""
    path, mark, query = target.partition("?")
    if not mark or not query:
        return target
    pairs = []
    for pair in query.split("&"):
        name, equals, _value = pair.partition("=")
        pairs.append(f"{name}=REDACTED" if equals else pair)
    return f"{path}?{'&'.join(pairs)}"
