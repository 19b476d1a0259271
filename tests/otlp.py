"""A real OTLP/HTTP traces receiver for the tests (and bench/): ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` in protobuf, decoded with ``opentelemetry-proto`` as a collector
decodes it, each span kept flattened (``Received``). ``hang`` makes it take requests and never
answer them, as a collector that is stuck does. ``python -m tests.otlp PORT`` runs one on its
own (bench/tracing_cost.py; ``PORT hang`` for one that hangs), printing what it decoded at
SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

KINDS = {
    trace_pb2.Span.SPAN_KIND_INTERNAL: "INTERNAL",
    trace_pb2.Span.SPAN_KIND_SERVER: "SERVER",
    trace_pb2.Span.SPAN_KIND_CLIENT: "CLIENT",
    trace_pb2.Span.SPAN_KIND_PRODUCER: "PRODUCER",
    trace_pb2.Span.SPAN_KIND_CONSUMER: "CONSUMER",
}
STATUSES = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


@dataclass
class Received:
    """One span as the receiver decoded it."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict[str, Any]
    status: str
    status_message: str
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str, dict[str, Any]]]  # trace ID, span ID, attributes
    start_ns: int
    end_ns: int

    def line(self) -> str:
        """The span on one line, as the closing note shows a trace."""
        attributes = ", ".join(f"{k}={v!r}" for k, v in sorted(self.attributes.items()))
        return (
            f"{self.service} {self.kind} {self.name!r} span={self.span_id} "
            f"parent={self.parent_id or '-'} status={self.status} "
            f"{(self.end_ns - self.start_ns) / 1e6:.2f}ms {{{attributes}}}"
            + (f" events={[name for name, _ in self.events]}" if self.events else "")
            + (f" links={[(t, s) for t, s, _ in self.links]}" if self.links else "")
        )


def _received(service: str, span: trace_pb2.Span) -> Received:
    links = [
        (link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
        for link in span.links
    ]
    return Received(
        service=service,
        name=span.name,
        kind=KINDS[span.kind],
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(),
        attributes=_attributes(span.attributes),
        status=STATUSES[span.status.code],
        status_message=span.status.message,
        events=[(event.name, _attributes(event.attributes)) for event in span.events],
        links=links,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
    )


def tree(spans: list[Received]) -> str:
    """One trace as an indented tree, children under their parent in start order (the closing
    note's and docs/operations.md's example)."""
    ids = {span.span_id for span in spans}
    children: dict[str, list[Received]] = {}
    for span in sorted(spans, key=lambda span: span.start_ns):
        parent = span.parent_id if span.parent_id in ids else ""
        children.setdefault(parent, []).append(span)
    start = min(span.start_ns for span in spans)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            offset, took = (span.start_ns - start) / 1e6, (span.end_ns - span.start_ns) / 1e6
            head = f"{'  ' * depth}{span.service} {span.kind} {span.name!r}"
            lines.append(f"{head}  +{offset:.1f} ms, {took:.1f} ms, status {span.status}")
            if depth == 0 and span.parent_id:
                lines.append(f"{'  ' * depth}  parent {span.parent_id} (not in this export)")
            for key, value in sorted(span.attributes.items()):
                lines.append(f"{'  ' * depth}    {key} = {value!r}")
            for name, attributes in span.events:
                lines.append(f"{'  ' * depth}    event {name} {attributes}")
            walk(span.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


@dataclass
class Receiver:
    """The receiver; ``url`` is its traces endpoint once started."""

    url: str = ""
    spans: list[Received] = field(default_factory=list)
    requests: int = 0
    hang: bool = False
    hanging: int = 0  # requests taken and held unanswered
    held: asyncio.Event = field(default_factory=asyncio.Event)  # set once one is
    _release: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        application = web.Application()
        application.router.add_post("/v1/traces", self._handle)
        self._runner = web.AppRunner(application, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/v1/traces"
        return self.url

    def stop_hanging(self) -> None:
        """Answer the exports held so far, and every one from now on."""
        self.hang = False
        self._release.set()

    async def close(self) -> None:
        self._release.set()
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = await request.read()
        if self.hang:
            self.hanging += 1
            self.held.set()
            await self._release.wait()
        assert request.content_type == "application/x-protobuf", request.content_type
        message = trace_service_pb2.ExportTraceServiceRequest()
        message.ParseFromString(body)
        for resource_spans in message.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                self.spans.extend(_received(service, span) for span in scope_spans.spans)
        answer = trace_service_pb2.ExportTraceServiceResponse()
        return web.Response(body=answer.SerializeToString(), content_type="application/x-protobuf")

    def trace(self, trace_id: str) -> list[Received]:
        return [span for span in self.spans if span.trace_id == trace_id]

    async def wait_for(
        self, count: int, *, trace_id: str | None = None, within: float = 10.0
    ) -> list[Received]:
        """The spans (of ``trace_id``) once at least ``count`` arrived; AssertionError after
        ``within`` seconds, naming what did."""
        deadline = asyncio.get_running_loop().time() + within
        while True:
            found = self.spans if trace_id is None else self.trace(trace_id)
            if len(found) >= count:
                return found
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(
                    f"{len(found)} span(s) of {count} arrived: "
                    + "; ".join(span.line() for span in found)
                )
            await asyncio.sleep(0.02)


async def _serve(port: int, hang: bool) -> None:
    """Run a receiver on ``port`` until SIGTERM; then print the spans it decoded (bench/).
    With ``hang``, one that takes every export and never answers."""
    receiver = Receiver(hang=hang)
    application = web.Application()
    application.router.add_post("/v1/traces", receiver._handle)
    runner = web.AppRunner(application)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    print(f"{receiver.requests} export(s), {len(receiver.spans)} span(s) decoded", flush=True)
    receiver._release.set()
    await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(_serve(int(sys.argv[1]), hang=sys.argv[2:] == ["hang"]))
