"""OpenTelemetry traces: a webhook's path through the proxy as spans in its caller's trace, the
dedup outcome on them (docs/operations.md, "Traces").

Optional: the SDK and the OTLP/HTTP exporter come with the extra ``otel``, and only
``spans`` imports them (when tracing is on). Tracing is on when the standard variables ask for
it (``wanted``) and ``OTEL_SDK_DISABLED`` is not ``true``; the SDK reads the rest itself
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``/``_ARG``,
``OTEL_EXPORTER_OTLP_*``, ``OTEL_BSP_*``, ``OTEL_PROPAGATORS``). Off, every request gets
``NOT_TRACED``, whose methods do nothing: the cost of tracing off is a call or two per request.

Per request (``spans.RequestTrace``): a SERVER span from its head to its answer, a CLIENT span
around the forward to the app (whose request carries it as the parent, in ``traceparent``),
and a CLIENT span per database round trip of the claim protocol (the claim's INSERT, and the
step that ends its transaction), named by the OpenTelemetry HTTP and database semantic
conventions. Attributes of our own are under ``webhook.`` and ``dedup.`` (the log line's facts:
its outcome as in ``Dedup-Status``).

Trust: only a peer in ``trusted_proxies`` (an ingress that traces) is continued: its trace
headers (``traceparent``, ``tracestate``, ``baggage``) make the parent. Anyone else's start a
new trace, linked to the one they named: a client cannot pick the trace ID, force sampling, or
hand the app baggage through the proxy. With tracing on, the app is always sent the proxy's
own context; with it off, the trace headers reach the app as they came (the proxy takes no
part in the trace).

Export runs on the SDK's batch thread with a bounded queue (``OTEL_BSP_MAX_QUEUE_SIZE``): a
collector that is down or hangs never holds a webhook; what is dropped is counted
(``dedup_trace_spans_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from proxy import errors
from proxy.upstream import proxy_headers

if TYPE_CHECKING:
    from aiohttp import web
    from multidict import CIMultiDict

    from proxy import log_line
    from proxy.tracing import spans

log = logging.getLogger(__name__)

# Either asks for traces over OTLP; OTEL_TRACES_EXPORTER too (also "console", or "none").
ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOLS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
EXPORTERS = ("otlp", "console")
INSTALL_HINT = "pip install 'webhook-dedup-proxy[otel]'"
# A drain waits at most this long for the spans still queued to go out.
SHUTDOWN_TIMEOUT = 5.0


def wanted(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The exporters the standard variables ask for (none: tracing is off). ConfigError for a
    value the proxy cannot honour (another exporter, OTLP over gRPC or JSON)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ()
    names = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if names:
        chosen = tuple(name.strip() for name in names.split(",") if name.strip())
        if chosen == ("none",):
            return ()
        unknown = [name for name in chosen if name not in EXPORTERS]
        if unknown:
            raise _refused(
                f"OTEL_TRACES_EXPORTER: {', '.join(unknown)} is not an exporter the proxy "
                f"ships (it has {' and '.join(EXPORTERS)}, or none)"
            )
    elif any(environ.get(name) for name in ENDPOINTS):
        chosen = ("otlp",)
    else:
        return ()
    _batch_sizes(environ)
    if "otlp" in chosen:
        for name in PROTOCOLS:
            protocol = environ.get(name, "").strip()
            if protocol and protocol != "http/protobuf":
                raise _refused(
                    f"{name}={protocol}: the proxy exports OTLP over HTTP as protobuf only "
                    "(http/protobuf, port 4318 on a collector)"
                )
    return chosen


def _batch_sizes(environ: Mapping[str, str]) -> None:
    """The batch queue's sizes as the SDK would refuse them, before it does at start-up."""
    sizes = {}
    defaults = (("OTEL_BSP_MAX_QUEUE_SIZE", 2048), ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512))
    for name, default in defaults:
        raw = environ.get(name, "").strip()
        try:
            sizes[name] = int(raw) if raw else default
        except ValueError:
            raise _refused(f"{name}={raw}: not a whole number") from None
        if sizes[name] <= 0:
            raise _refused(f"{name}={raw}: must be above 0")
    if sizes["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"] > sizes["OTEL_BSP_MAX_QUEUE_SIZE"]:
        raise _refused(
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE must not exceed OTEL_BSP_MAX_QUEUE_SIZE "
            f"({sizes['OTEL_BSP_MAX_EXPORT_BATCH_SIZE']} > {sizes['OTEL_BSP_MAX_QUEUE_SIZE']}; "
            "their defaults are 512 and 2048)"
        )


def _refused(problem: str) -> errors.ConfigError:
    return errors.ConfigError("the environment (OTEL_* variables)", [problem])


def describe(environ: Mapping[str, str]) -> str:
    """What turned tracing on and where it goes, for the log and ``check`` (an endpoint's
    password masked; OTEL_EXPORTER_OTLP_HEADERS, which may hold a token, never shown)."""
    names = ("OTEL_TRACES_EXPORTER", *ENDPOINTS, "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
             "OTEL_SERVICE_NAME")  # fmt: skip
    return ", ".join(f"{name}={_masked(environ[name])}" for name in names if environ.get(name))


def _masked(value: str) -> str:
    """A URL with its password as *** and without its query string and fragment (where a
    collector's token such as ``?api_key=`` travels); any other value as it is."""
    if "://" not in value:
        return value
    url = urllib.parse.urlsplit(value)
    user, at, host = url.netloc.rpartition("@")
    if ":" in user:
        user = user.partition(":")[0] + ":***"
    return urllib.parse.urlunsplit((url.scheme, f"{user}{at}{host}", url.path, "", ""))


def summary(environ: Mapping[str, str]) -> str:
    """Tracing as ``check`` shows it: off, or where the spans go and how they are sampled.
    ConfigError as ``wanted``, and when tracing is asked for without the extra."""
    exporters = wanted(environ)
    if not exporters:
        return "off (set OTEL_EXPORTER_OTLP_ENDPOINT to export traces; docs/operations.md)"
    _importable(environ)
    shown = []
    for exporter in exporters:
        if exporter == "otlp":
            endpoint = environ.get(ENDPOINTS[0]) or (
                environ.get(ENDPOINTS[1], "http://localhost:4318").rstrip("/") + "/v1/traces"
            )
            shown.append(f"OTLP/HTTP to {_masked(endpoint)}")
        else:
            shown.append("the console (stdout)")
    sampler = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    if environ.get("OTEL_TRACES_SAMPLER_ARG"):
        sampler += f" {environ['OTEL_TRACES_SAMPLER_ARG']}"
    service = environ.get("OTEL_SERVICE_NAME", "webhook-dedup-proxy")
    return f"on: {' and '.join(shown)}, sampler {sampler}, service {service}"


def _importable(environ: Mapping[str, str]) -> None:
    try:
        importlib.import_module("proxy.tracing.spans")
    except ImportError as exc:
        raise _refused(
            f"tracing is asked for ({describe(environ)}) but the OpenTelemetry SDK is not "
            f"installed ({exc}): {INSTALL_HINT}"
        ) from None
    except Exception as refusal:  # the SDK refused a variable as it loaded (OTEL_PROPAGATORS=b3)
        raise _refused(f"the OpenTelemetry SDK refused the environment: {refusal}") from None


class Tracing:
    """The process's tracing: every request is ``NOT_TRACED`` until ``open`` and after
    ``close``; in between, ``begin`` starts its trace.

    ``exporters`` (from ``wanted``) empty: off for good. ConfigError when tracing is asked for
    but the extra is not installed.
    """

    def __init__(
        self,
        exporters: Sequence[str],
        trusted: proxy_headers.TrustedProxies,
        table: str,
        count: spans.Count | None = None,
    ) -> None:
        self.exporters = tuple(exporters)
        self.trusted = trusted
        self.table = table
        self._count = count
        self._sdk: spans.Sdk | None = None
        if self.exporters:
            _importable(os.environ)

    @property
    def on(self) -> bool:
        return self._sdk is not None

    def open(self) -> None:
        """Start the SDK: its sampler, exporters and batch threads as the environment says."""
        if self.exporters and self._sdk is None:
            from proxy.tracing import spans

            self._sdk = spans.Sdk(self.exporters, self.trusted, self.table, self._count)
            if self._count is not None:
                for result in ("exported", "failed", "dropped"):  # every series at 0
                    self._count(result, 0)
            log.info("tracing on: %s", describe(os.environ) or ", ".join(self.exporters))

    async def close(self) -> None:
        """Export what is queued, waiting at most SHUTDOWN_TIMEOUT (then drop it).

        On a thread of its own, a daemon: the loop's executor would hold the process's exit
        until an export to a collector that hangs timed out (OTEL_EXPORTER_OTLP_TIMEOUT)."""
        sdk, self._sdk = self._sdk, None
        if sdk is None:
            return
        loop = asyncio.get_running_loop()
        finished = loop.create_future()

        def shut_down() -> None:
            try:
                sdk.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(finish)

        def finish() -> None:
            if not finished.done():
                finished.set_result(None)

        threading.Thread(target=shut_down, name="tracing-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(finished), SHUTDOWN_TIMEOUT)
        except TimeoutError:
            log.warning(
                "spans still queued at shutdown were not exported within %gs: dropped",
                SHUTDOWN_TIMEOUT,
            )

    def begin(
        self, request: web.BaseRequest, route: str | None, http_route: str | None,
        line: log_line.LogLine,
    ) -> spans.RequestTrace | NotTraced:  # fmt: skip
        """The request's trace, its SERVER span started now and its IDs on ``line``."""
        sdk = self._sdk
        if sdk is None:
            return NOT_TRACED
        return sdk.begin(request, route, http_route, line) or NOT_TRACED

    def redelivery(
        self,
        route: str,
        event_id: str,
        attempt: int,
        headers: Sequence[tuple[str, str]],
        claim_id: str | None = None,
    ) -> spans.RequestTrace | NotTraced:
        """A redelivery's trace (a new one, linked to the first delivery's), started now:
        ``event_id`` as the provider sent it, ``claim_id`` as stored where it differs."""
        sdk = self._sdk
        if sdk is None:
            return NOT_TRACED
        return sdk.redelivery(route, event_id, attempt, headers, claim_id) or NOT_TRACED


class NotTraced:
    """A request's trace with tracing off: every call does nothing."""

    __slots__ = ()

    def database(self, step: str, operation: str) -> None:
        return None

    def end(self, span: object, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def forwarding(
        self, method: str, base_url: str, target: str, headers: CIMultiDict[str]
    ) -> None:
        return None

    def answered(self, span: object, status: int, resend_count: int = 0) -> None:
        return None

    def failed(self, span: object, kind: str, message: str) -> None:
        return None

    def event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def close(self, attributes: Mapping[str, Any], error: str | None = None) -> None:
        return None

    def abort(self, exc: BaseException) -> None:
        return None

    def finish(self, line: log_line.LogLine) -> None:
        return None


NOT_TRACED = NotTraced()
