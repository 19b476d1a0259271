"""The spans themselves, on the OpenTelemetry SDK (the extra ``otel``): imported only when
tracing is on (``proxy.tracing``).

``Sdk`` is the process's tracer provider, its batch processors and the propagator; ``begin``
starts a request's SERVER span, continuing a trusted peer's trace or linking an untrusted one's.
``RequestTrace`` is one request's spans. The batch queue's drops are counted here, from what
is handed to the processor and what it hands to the exporter, without the SDK's internals.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from aiohttp import hdrs, web
from multidict import CIMultiDict
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
# The query parameters whose values the conventions redact in url.full (signed URLs' secrets).
_REDACTED_PARAMETERS = frozenset(("AWSAccessKeyId", "Signature", "sig", "X-Goog-Signature"))
_NAMED_BY_TABLE = frozenset(("INSERT", "UPDATE", "SELECT"))


def _no_count(result: str, spans: int) -> None:
    return None


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
        self.fields = tuple(sorted({field.lower() for field in self.propagator.fields}))
        self.trusted = trusted
        self.table = table
        self._upstreams: dict[str, tuple[str, str, int | None]] = {}

    def shutdown(self) -> None:
        self.provider.shutdown()

    def begin(
        self, request: web.BaseRequest, route: str | None, http_route: str | None,
        line: log_line.LogLine,
    ) -> RequestTrace:  # fmt: skip
        headers = request.headers
        links: Sequence[trace.Link] = ()
        if self.trusted.trusts(request.remote):
            parent = self.propagator.extract(headers)
        else:
            parent = context_api.Context()
            if any(field in headers for field in self.fields):
                named = trace.get_current_span(self.propagator.extract(headers))
                if named.get_span_context().is_valid:
                    links = (trace.Link(named.get_span_context(), {"webhook.untrusted": True}),)
        method = request.method
        known = method if method in _KNOWN_METHODS else "_OTHER"
        name = "HTTP" if known == "_OTHER" else known
        attributes: dict[str, Any] = {
            "http.request.method": known,
            "url.path": request.raw_path.partition("?")[0],
            "url.scheme": request.scheme,
            "network.protocol.version": f"{request.version.major}.{request.version.minor}",
        }
        if known == "_OTHER":
            attributes["http.request.method_original"] = method
        if http_route is not None:
            attributes["http.route"] = http_route
            name = f"{name} {http_route}"
        if route is not None:
            attributes["webhook.route"] = route
        if request.remote:
            attributes["client.address"] = request.remote
            attributes["network.peer.address"] = request.remote
        _server_of(headers.get(hdrs.HOST), attributes)
        if agent := headers.get(hdrs.USER_AGENT):
            attributes["user_agent.original"] = agent
        span = self.tracer.start_span(
            name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes, links=links
        )
        ids = span.get_span_context()
        line["trace_id"] = format(ids.trace_id, "032x")
        line["span_id"] = format(ids.span_id, "016x")
        return RequestTrace(self, span, trace.set_span_in_context(span, parent))

    def redelivery(
        self, route: str, event_id: str, attempt: int, headers: Sequence[tuple[str, str]]
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
        span = self.tracer.start_span(
            f"redeliver {route}", context=root, kind=trace.SpanKind.INTERNAL, links=links,
            attributes={"webhook.route": route, "webhook.event_id": event_id,
                        "webhook.redelivery.attempt": attempt},
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


def _server_of(host: str | None, attributes: dict[str, Any]) -> None:
    """server.address and server.port from a Host header ("example.com:8443", "[::1]:80")."""
    if not host:
        return
    address, colon, port = host.rpartition(":")
    if not colon or "]" in port or not port.isdigit():
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

    __slots__ = ("_open", "_sdk", "context", "span")

    def __init__(self, sdk: Sdk, span: Span, context: context_api.Context) -> None:
        self._sdk = sdk
        self.span = span
        self.context = context
        self._open: list[Span] = []

    def database(self, step: str, operation: str) -> Span:
        """A span for one round trip of the claim protocol (``step``), ``operation`` the SQL
        verb that ends it; never the statement (it holds the event ID)."""
        table = self._sdk.table
        name = f"{operation} {table}" if operation in _NAMED_BY_TABLE else operation
        span = self._sdk.tracer.start_span(
            name, context=self.context, kind=trace.SpanKind.CLIENT,
            attributes={"db.system.name": "postgresql", "db.operation.name": operation,
                        "db.collection.name": table, "dedup.step": step},
        )  # fmt: skip
        self._open.append(span)
        return span

    def end(self, span: Span | None, attributes: Mapping[str, Any] | None = None) -> None:
        """End a span this trace started, with ``attributes``."""
        if span is None:
            return
        if attributes and span.is_recording():
            span.set_attributes(attributes)
        span.end()
        self._open.remove(span)

    def forwarding(
        self, method: str, base_url: str, target: str, headers: CIMultiDict[str]
    ) -> Span:
        """The forward's CLIENT span, started now; ``headers`` carry it to the app."""
        base, host, port = self._sdk.upstream(base_url)
        known = method if method in _KNOWN_METHODS else "_OTHER"
        attributes: dict[str, Any] = {
            "http.request.method": known,
            "server.address": host,
            "url.full": base + _redacted(target),
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

    def failed(self, span: Span | None, kind: str, message: str) -> None:
        """The span's step failed (``kind``: the error's code): it ends as an error."""
        if span is None:
            return
        if span.is_recording():
            _failed(span, kind, message)
        self.end(span)

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        """A span event on the SERVER span (a replay, a mismatch)."""
        self.span.add_event(name, attributes)

    def close(self, attributes: Mapping[str, Any], error: str | None = None) -> None:
        """End every span still open, then the root, with ``attributes`` (an error, with
        ``error``, when the step it stands for failed)."""
        for span in self._open:
            span.end()
        self._open.clear()
        span = self.span
        if span.is_recording():
            span.set_attributes(attributes)
            if error is not None:
                _failed(span, str(attributes.get("dedup.redelivery.result", "error")), error)
        span.end()

    def finish(self, line: log_line.LogLine) -> None:
        """End every span still open, then the SERVER span, with the line's facts."""
        error = line.get("error")
        for span in self._open:
            if span.is_recording():
                _failed(span, line.get("outcome", "error"), error)
            span.end()
        self._open.clear()
        span = self.span
        if span.is_recording():
            span.set_attributes(_server_attributes(line))
            status = line.get("status", 500)
            if status >= 500:
                _failed(span, str(status), error)
            if line.get("mismatch"):
                span.add_event("dedup.mismatch", {"webhook.event_id": line.get("event_id", "")})
        span.end()


def _server_attributes(line: log_line.LogLine) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "http.response.status_code": line.get("status", 500),
        "dedup.outcome": line.get("outcome", "rejected"),
    }
    if "event_id" in line:
        attributes["webhook.event_id"] = line["event_id"]
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
    span.set_attribute("error.type", kind)
    span.set_status(Status(StatusCode.ERROR, description))


def _redacted(target: str) -> str:
    """``target`` with the values of the conventions' sensitive query parameters redacted."""
    path, mark, query = target.partition("?")
    if not mark or not any(name in query for name in _REDACTED_PARAMETERS):
        return target
    pairs = []
    for pair in query.split("&"):
        name, equals, _value = pair.partition("=")
        pairs.append(f"{name}=REDACTED" if equals and name in _REDACTED_PARAMETERS else pair)
    return f"{path}?{'&'.join(pairs)}"
