"""Traces through ``create_app``, exported over OTLP/HTTP to a real receiver (``tests.otlp``) and
decoded there: one trace holds the caller's parent, the proxy's SERVER span, its CLIENT span
and database spans, and the app's own span (the test app continues the trace it is sent); a
duplicate's trace has no CLIENT span; untrusted trace headers start a new, linked trace; a
collector that is down or hangs never changes a webhook's answer; off, nothing is traced.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy import app_keys, errors, tracing, webhooks
from proxy.upstream import proxy_headers
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    Serve,
    admin_client,
    connection,
    event,
    github_headers,
    github_route,
    run_cli,
    scrape,
    send,
    wait_until,
    webhook_request,
)
from tests.otlp import Received, Receiver, tree

EXAMPLE = Path(__file__).resolve().parents[1] / "config.example.yaml"
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"


@pytest.fixture(autouse=True)
async def no_sdk_thread_outlives_its_test() -> AsyncIterator[None]:
    """After each test (and its fixtures): the SDK's batch threads, and the proxy's shutdown
    thread, have ended. One left retrying an export would draw on the random module's state
    under a later test (hypothesis refuses strategies whose draws move it)."""
    yield
    deadline = asyncio.get_running_loop().time() + 10
    while left := [
        thread.name for thread in threading.enumerate()
        if thread.name.startswith("OtelBatch") or thread.name == "tracing-shutdown"
    ]:  # fmt: skip
        assert asyncio.get_running_loop().time() < deadline, f"still running: {left}"
        await asyncio.sleep(0.05)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    await found.start()
    yield found
    await found.close()


@dataclass
class TracedApp:
    """The app behind the proxy, traced itself: it continues the trace it is sent."""

    url: str = ""
    headers: list[dict[str, str]] = field(default_factory=list)
    status: int = 200


@pytest.fixture
async def traced_app(aiohttp_server: Any, receiver: Receiver) -> AsyncIterator[TracedApp]:
    app = TracedApp()
    provider = TracerProvider(resource=Resource.create({"service.name": "the-app"}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=receiver.url), schedule_delay_millis=50)
    )
    tracer = provider.get_tracer("the-app")
    propagator = TraceContextTextMapPropagator()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        app.headers.append({name.lower(): value for name, value in request.headers.items()})
        parent = propagator.extract(request.headers)
        with tracer.start_as_current_span("handle webhook", context=parent, kind=SpanKind.SERVER):
            return web.Response(status=app.status, text="ok")

    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", handle)
    server = await aiohttp_server(application)
    app.url = str(server.make_url("")).rstrip("/")
    yield app
    await asyncio.to_thread(provider.shutdown)


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch, receiver: Receiver) -> None:
    """Tracing on, as the standard variables turn it on, exporting to the receiver quickly."""
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")


def _one(spans: list[Received], **wanted: Any) -> Received:
    found = [
        span for span in spans
        if all(getattr(span, key) == value for key, value in wanted.items())
    ]  # fmt: skip
    assert len(found) == 1, [span.line() for span in spans]
    return found[0]


def _proxy_spans(spans: list[Received]) -> list[Received]:
    return [span for span in spans if span.service == "webhook-dedup-proxy"]


@pytest.mark.usefixtures("traced")
async def test_one_trace_holds_the_callers_parent_the_proxy_and_the_app(
    make_proxy: MakeProxy, traced_app: TracedApp, receiver: Receiver,
    caplog: pytest.LogCaptureFixture, table: str,
) -> None:  # fmt: skip
    client = await make_proxy(upstream={"url": traced_app.url}, trusted_proxies=["127.0.0.1/32"])
    with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
        response = await client.post(
            "/webhooks/corvel?x=1",
            data=event("evt_traced"),
            headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc",
                     "baggage": "tenant=acme"},
        )  # fmt: skip
    assert response.status == 200

    # The proxy's SERVER, its CLIENT and two database spans, and the app's span.
    spans = await receiver.wait_for(5, trace_id=PARENT_TRACE)
    print(f"trace {PARENT_TRACE}:\n{tree(spans)}")  # the docs' example trace (pytest -s)
    server = _one(spans, kind="SERVER", service="webhook-dedup-proxy")
    assert server.name == "POST /webhooks/corvel"
    assert server.parent_id == PARENT_SPAN
    assert server.status == "UNSET"
    assert (
        server.attributes
        | {
            "http.request.method": "POST",
            "http.route": "/webhooks/corvel",
            "url.path": "/webhooks/corvel",
            "url.scheme": "http",
            "http.response.status_code": 200,
            "webhook.route": "corvel",
            "webhook.event_id": "evt_traced",
            "webhook.event_type": "charge.succeeded",
            "dedup.outcome": "processed",
            "client.address": "127.0.0.1",
        }
        == server.attributes
    )
    assert isinstance(server.attributes["dedup.waited_ms"], float)

    forward = _one(spans, name="POST", kind="CLIENT")
    assert forward.parent_id == server.span_id
    host, port = traced_app.url.removeprefix("http://").split(":")
    assert forward.attributes == {
        "http.request.method": "POST",
        "server.address": host,
        "server.port": int(port),
        "url.full": f"{traced_app.url}/webhooks/corvel?x=REDACTED",  # the app got ?x=1
        "network.protocol.version": "1.1",
        "http.response.status_code": 200,
    }
    app_span = _one(spans, service="the-app")
    assert app_span.parent_id == forward.span_id  # the app joined the trace under the forward

    claim = _one(spans, name=f"INSERT {table}")
    commit = _one(spans, name="COMMIT")
    for span in (claim, commit):
        assert span.kind == "CLIENT"
        assert span.parent_id == server.span_id
        assert span.attributes["db.system.name"] == "postgresql"
        assert "evt_traced" not in repr(span.attributes)  # never the statement with the ID
    assert claim.attributes["dedup.acquired"] is True
    assert commit.attributes["db.operation.name"] == "COMMIT"
    assert claim.end_ns <= forward.start_ns <= forward.end_ns <= commit.start_ns

    # The app was sent the proxy's CLIENT span as its parent, the trusted caller's state and
    # baggage carried on.
    sent = traced_app.headers[0]
    assert sent["traceparent"] == f"00-{PARENT_TRACE}-{forward.span_id}-01"  # sampled, as sent
    assert sent["tracestate"] == "vendor=abc"
    assert sent["baggage"] == "tenant=acme"

    # The log line leads to the trace.
    (line,) = [r.fields for r in caplog.records if getattr(r, "fields", {}).get("event_id")]  # type: ignore[attr-defined]
    assert (line["trace_id"], line["span_id"]) == (PARENT_TRACE, server.span_id)


@pytest.mark.usefixtures("traced")
async def test_a_duplicates_trace_has_its_outcome_and_no_client_span(
    make_proxy: MakeProxy, traced_app: TracedApp, receiver: Receiver, table: str
) -> None:
    client = await make_proxy(upstream={"url": traced_app.url})
    assert (await client.post("/webhooks/corvel", data=event("evt_dup"))).status == 200
    response = await client.post("/webhooks/corvel", data=event("evt_dup"))
    assert response.status == 200
    assert response.headers["Dedup-Status"] == "duplicate"

    servers = [
        s for s in await _servers(receiver, 2) if s.attributes["webhook.event_id"] == "evt_dup"
    ]
    first, second = sorted(servers, key=lambda span: span.start_ns)
    assert first.attributes["dedup.outcome"] == "processed"
    assert second.attributes["dedup.outcome"] == "duplicate"
    assert second.status == "UNSET"  # a duplicate is no error
    spans = await receiver.wait_for(3, trace_id=second.trace_id)
    assert {(span.kind, span.name) for span in _proxy_spans(spans)} == {
        ("SERVER", "POST /webhooks/corvel"),
        ("CLIENT", f"INSERT {table}"),
        ("CLIENT", "ROLLBACK"),  # the duplicate's settle: its comparison and ROLLBACK
    }
    assert len(traced_app.headers) == 1  # the app saw the first copy only
    assert first.trace_id != second.trace_id  # each delivery its own trace


async def _servers(receiver: Receiver, count: int) -> list[Received]:
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        servers = [s for s in _proxy_spans(receiver.spans) if s.kind == "SERVER"]
        if len(servers) >= count or asyncio.get_running_loop().time() > deadline:
            return servers
        await asyncio.sleep(0.02)


@pytest.mark.usefixtures("traced")
@pytest.mark.parametrize("propagators", [None, "tracecontext"])
async def test_an_untrusted_callers_trace_headers_start_a_new_linked_trace(
    make_proxy: MakeProxy, traced_app: TracedApp, receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch, propagators: str | None,
) -> None:  # fmt: skip
    """Also with a propagator list that does not name baggage: the client's never reaches
    the app."""
    if propagators is not None:
        monkeypatch.setenv("OTEL_PROPAGATORS", propagators)
    client = await make_proxy(upstream={"url": traced_app.url})  # no trusted_proxies
    response = await client.post(
        "/webhooks/corvel",
        data=event("evt_untrusted"),
        headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc", "baggage": "admin=1"},
    )
    assert response.status == 200

    (server,) = await _servers(receiver, 1)
    assert server.trace_id != PARENT_TRACE
    assert server.parent_id == ""
    assert server.links == [(PARENT_TRACE, PARENT_SPAN, {"webhook.untrusted": True})]
    forward = _one(await receiver.wait_for(5, trace_id=server.trace_id), kind="CLIENT", name="POST")
    sent = traced_app.headers[0]
    # Sampled (01), the trace ID random (02: W3C Trace Context level 2, as the SDK sets it).
    assert sent["traceparent"] == f"00-{server.trace_id}-{forward.span_id}-03"
    assert "tracestate" not in sent
    assert "baggage" not in sent


@pytest.mark.usefixtures("traced")
async def test_a_failed_app_and_the_proxys_own_errors_have_error_status(
    make_proxy: MakeProxy, traced_app: TracedApp, receiver: Receiver
) -> None:
    traced_app.status = 500
    client = await make_proxy(upstream={"url": traced_app.url})
    assert (await client.post("/webhooks/corvel", data=event("evt_500"))).status == 500
    assert (await client.post("/webhooks/corvel", data=b"not json")).status == 400

    servers = await _servers(receiver, 2)
    failed = _one(servers, status="ERROR")
    assert failed.attributes["dedup.outcome"] == "upstream_error"
    assert failed.attributes["error.type"] == "500"
    spans = await receiver.wait_for(5, trace_id=failed.trace_id)
    forward = _one(spans, kind="CLIENT", name="POST")
    assert (forward.status, forward.attributes["error.type"]) == ("ERROR", "500")
    release = _one(spans, name="ROLLBACK")
    assert release.attributes["dedup.step"] == "release"
    rejected = _one(servers, status="UNSET")  # a 4xx is the caller's, not an error of ours
    assert rejected.attributes["http.response.status_code"] == 400
    assert rejected.attributes["dedup.outcome"] == "rejected"


@pytest.mark.usefixtures("traced")
async def test_pass_through_is_traced_and_carries_the_context(
    make_proxy: MakeProxy, traced_app: TracedApp, receiver: Receiver
) -> None:
    client = await make_proxy(upstream={"url": traced_app.url}, passthrough="all")
    assert (await client.get("/health/deep")).status == 200
    (server,) = await _servers(receiver, 1)
    assert server.name == "GET"  # no route: the conventions' name is the method alone
    assert "http.route" not in server.attributes
    assert server.attributes["dedup.outcome"] == "passthrough"
    spans = await receiver.wait_for(3, trace_id=server.trace_id)
    forward = _one(spans, kind="CLIENT")
    assert _one(spans, service="the-app").parent_id == forward.span_id


async def test_a_collector_that_hangs_changes_no_answer(
    monkeypatch: pytest.MonkeyPatch, make_proxy: MakeProxy, upstream: FakeUpstream,
    receiver: Receiver, aiohttp_client: Any,
) -> None:  # fmt: skip
    """The collector takes the export and never answers: every webhook is answered as before
    while the export is held, and the queue's overflow is dropped and counted."""
    receiver.hang = True
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "16")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "30")
    client = await make_proxy()  # the app: untraced, so every export is the proxy's
    assert (await client.post("/webhooks/corvel", data=event("evt_first"))).status == 200
    await asyncio.wait_for(receiver.held.wait(), 10)  # the batch thread is stuck exporting
    for number in range(40):
        response = await client.post("/webhooks/corvel", data=event(f"evt_{number}"))
        assert response.status == 200
    assert (receiver.hanging, receiver.spans) == (1, [])  # all answered while it hung
    assert len(upstream.requests) == 41
    samples = await scrape(await admin_client(aiohttp_client, client))
    assert samples[("dedup_trace_spans_total", (("result", "exported"),))] == 0
    dropped = samples[("dedup_trace_spans_total", (("result", "dropped"),))]
    assert dropped >= 40 * 4 - 16  # four spans a webhook, a queue of 16
    # The SDK's threads end within this test: a retry of theirs later would move the random
    # module's state under another test (hypothesis's strategies refuse that).
    receiver.stop_hanging()
    await client.close()


async def test_a_collector_that_is_down_counts_failed_exports(
    monkeypatch: pytest.MonkeyPatch, make_proxy: MakeProxy, traced_app: TracedApp,
    aiohttp_client: Any, unused_tcp_port: int,
) -> None:  # fmt: skip
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{unused_tcp_port}/v1/traces"
    )
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    client = await make_proxy(upstream={"url": traced_app.url})
    for number in range(5):
        assert (
            await client.post("/webhooks/corvel", data=event(f"evt_down{number}"))
        ).status == 200
    admin = await admin_client(aiohttp_client, client)
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        failed = (await scrape(admin)).get(("dedup_trace_spans_total", (("result", "failed"),)), 0)
        if failed > 0 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.1)
    assert failed > 0
    await client.close()  # the SDK's threads end within this test (see the hang test)


async def test_a_sampler_of_zero_exports_nothing_but_still_propagates(
    monkeypatch: pytest.MonkeyPatch, make_proxy: MakeProxy, traced_app: TracedApp,
    receiver: Receiver, traced: None,
) -> None:  # fmt: skip
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    client = await make_proxy(upstream={"url": traced_app.url})
    assert (await client.post("/webhooks/corvel", data=event("evt_unsampled"))).status == 200
    await client.close()  # the drain exports whatever is queued
    assert receiver.spans == []
    flags = int(traced_app.headers[0]["traceparent"].rpartition("-")[2], 16)
    assert flags & 1 == 0  # not sampled: the app is told so


async def test_off_the_trace_headers_reach_the_app_as_they_came(
    monkeypatch: pytest.MonkeyPatch, make_proxy: MakeProxy, traced_app: TracedApp,
    receiver: Receiver,
) -> None:  # fmt: skip
    for name in [name for name in os.environ if name.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    client = await make_proxy(upstream={"url": traced_app.url})
    assert not client.app[tracing_key()].on
    response = await client.post(
        "/webhooks/corvel", data=event("evt_off"), headers={"traceparent": TRACEPARENT}
    )
    assert response.status == 200
    assert traced_app.headers[0]["traceparent"] == TRACEPARENT
    # The app's own span is there (it traces); the proxy's are not.
    assert _proxy_spans(await receiver.wait_for(1)) == []


def tracing_key() -> Any:

    return app_keys.TRACING


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ("otlp", "console")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, ()),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, ()),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, ("otlp",)),
    ],
)
def test_the_standard_variables_turn_tracing_on(
    environ: dict[str, str], exporters: tuple[str, ...]
) -> None:
    assert tracing.wanted(environ) == exporters


@pytest.mark.parametrize(
    ("environ", "problem"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "zipkin is not an exporter the proxy ships"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc: the proxy exports OTLP over HTTP as protobuf only",
        ),
    ],
)
def test_a_variable_the_proxy_cannot_honour_is_refused(
    environ: dict[str, str], problem: str
) -> None:
    with pytest.raises(errors.ConfigError) as refused:
        tracing.wanted(environ)
    assert problem in str(refused.value)


def test_tracing_asked_for_without_the_extra_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "proxy.tracing.spans", None)  # as if not installed
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    with pytest.raises(errors.ConfigError) as refused:
        tracing.Tracing(("otlp",), proxy_headers.TrustedProxies(), "webhook_claims")
    assert "pip install 'webhook-dedup-proxy[otel]'" in str(refused.value)
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318" in str(refused.value)


REPLAY_ROUTE = {
    "name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id",
    "on_duplicate": "replay",
}  # fmt: skip


@pytest.mark.usefixtures("traced")
async def test_a_replay_and_a_mismatch_are_events_on_the_duplicates_span(
    make_proxy: MakeProxy, upstream: FakeUpstream, receiver: Receiver
) -> None:
    client = await make_proxy(routes=[REPLAY_ROUTE])
    assert (await client.post("/webhooks/corvel", data=event("evt_r"))).status == 200
    replayed = await client.post("/webhooks/corvel", data=event("evt_r"))
    assert await replayed.read() == b"processed\x00bytes"  # the app's answer, replayed
    other = await client.post("/webhooks/corvel", data=event("evt_r", amount=2))
    assert other.headers["Dedup-Status"] == "duplicate"

    first, replay, mismatch = sorted(await _servers(receiver, 3), key=lambda s: s.start_ns)
    assert first.events == []
    assert replay.attributes["dedup.replayed"] is True
    assert replay.events == [("dedup.replay", {"http.response.status_code": 200})]
    assert mismatch.attributes["dedup.mismatch"] is True
    assert mismatch.events == [("dedup.mismatch", {"webhook.event_id": "evt_r"})]
    assert len(upstream.requests) == 1


@pytest.mark.usefixtures("traced")
async def test_a_copy_that_waited_says_how_long(
    make_proxy: MakeProxy, upstream: FakeUpstream, receiver: Receiver
) -> None:
    upstream.gate = asyncio.Event()
    client = await make_proxy()
    first = asyncio.ensure_future(client.post("/webhooks/corvel", data=event("evt_w")))
    await asyncio.wait_for(upstream.arrived.wait(), 5)
    copy = asyncio.ensure_future(client.post("/webhooks/corvel", data=event("evt_w")))
    await asyncio.sleep(0.5)  # the copy waits on the first one's claim meanwhile
    upstream.gate.set()
    assert [(await first).status, (await copy).status] == [200, 200]

    spans = {s.attributes["dedup.outcome"]: s for s in await _servers(receiver, 2)}
    # Most of the half second the first copy was held (the copy's own way to the proxy took
    # the rest): the wait is causal, not a benchmark.
    assert spans["duplicate"].attributes["dedup.waited_ms"] >= 250
    assert (
        spans["processed"].attributes["dedup.waited_ms"]
        < spans["duplicate"].attributes["dedup.waited_ms"]
    )


async def test_a_request_sent_again_on_a_new_connection_says_so(
    monkeypatch: pytest.MonkeyPatch, make_proxy: MakeProxy, receiver: Receiver, traced: None
) -> None:
    """The app closes a kept-alive connection as the next request arrives on it: the forward
    goes again on a new one, and its CLIENT span has http.request.resend_count 1."""
    connections = 0

    async def app(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        number = connections
        for request in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            if number == 1 and request == 1:
                break  # closes under the second request, as an idle timer firing would
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(app, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = await make_proxy(upstream={"url": f"http://127.0.0.1:{port}"})
        for name in ("evt_a", "evt_b"):
            assert (await client.post("/webhooks/corvel", data=event(name))).status == 200
        spans = await receiver.wait_for(8)
    finally:
        server.close()
    forwards = sorted(
        (s for s in spans if s.kind == "CLIENT" and s.name == "POST"), key=lambda s: s.start_ns
    )
    assert [s.attributes.get("http.request.resend_count") for s in forwards] == [None, 1]
    assert connections == 2


@pytest.mark.usefixtures("traced")
async def test_on_a_bound_route_both_spans_carry_the_id_as_sent_and_the_claim_as_stored(
    make_proxy: MakeProxy, upstream: FakeUpstream, receiver: Receiver
) -> None:
    """A GitHub route with verify stores its claims bound to the body: the SERVER span and the
    redelivery's root carry the ID as GitHub sent it and the claim's as stored, in the same
    attributes."""
    upstream.respond = lambda n: web.Response(status=503 if n == 0 else 200)
    client = await make_proxy(
        routes=[github_route(redeliver={"schedule": ["200ms"], "for": "1d"})],
        redeliverer={"poll": "100ms", "rate": 1000},
    )
    body = b'{"n": 1}'
    response = await client.post("/webhooks/github", data=body, headers=github_headers(body, "g"))
    assert response.headers["Dedup-Status"] == "queued"

    (first,) = await _servers(receiver, 1)
    await receiver.wait_for(6)
    root = _one(receiver.spans, name="redeliver github")
    claim = webhooks.bound("1:g", "", hashlib.sha256(body).digest())
    for span in (first, root):
        ids = (span.attributes["webhook.event_id"], span.attributes["dedup.claim_id"])
        assert ids == ("1:g", claim)


@pytest.mark.usefixtures("traced")
async def test_a_redelivery_is_a_trace_of_its_own_linked_to_the_first_delivery(
    make_proxy: MakeProxy, upstream: FakeUpstream, receiver: Receiver
) -> None:
    upstream.respond = lambda n: web.Response(status=503 if n == 0 else 200)
    client = await make_proxy(
        routes=[{"name": "hooks", "path": "/hooks", "event_id": "body:/id",
                 "redeliver": {"schedule": ["200ms"], "for": "1d"}}],
        redeliverer={"poll": "100ms", "rate": 1000},
    )  # fmt: skip
    response = await client.post("/hooks", data=event("evt_kept"))
    assert response.headers["Dedup-Status"] == "queued"

    (first,) = await _servers(receiver, 1)
    assert first.attributes["dedup.outcome"] == "queued"
    # The first delivery's four spans (its claim, forward, queue and SERVER), the redelivery's two.
    await receiver.wait_for(6)
    root = _one(receiver.spans, name="redeliver hooks")
    first_forward = _one(receiver.trace(first.trace_id), kind="CLIENT", name="POST")
    assert root.kind == "INTERNAL"
    assert root.parent_id == ""
    assert root.links == [(first.trace_id, first_forward.span_id, {"webhook.first_delivery": True})]
    assert root.attributes | {
        "webhook.route": "hooks", "webhook.event_id": "evt_kept",
        "webhook.redelivery.attempt": 2, "dedup.redelivery.result": "delivered",
        "webhook.upstream_status": 200,
    } == root.attributes  # fmt: skip
    forward = _one(receiver.trace(root.trace_id), kind="CLIENT")
    assert forward.parent_id == root.span_id
    # The app was sent the redelivery's context, not the first delivery's it was kept with.
    sent = upstream.requests[1].headers["traceparent"]
    assert sent == [f"00-{root.trace_id}-{forward.span_id}-03"]
    assert upstream.requests[0].headers["traceparent"][0].split("-")[1] == first.trace_id


async def test_serve_with_two_workers_exports_and_drains_its_spans(
    serve: Serve, receiver: Receiver, upstream: FakeUpstream
) -> None:
    """As an operator runs it: ``dedup-proxy serve`` with ``workers: 2`` (each worker its own
    SDK, after the supervisor started it) and the standard variable; every webhook's SERVER
    span reaches the receiver, the log lines carry their trace IDs, and SIGTERM exports what
    is still queued before the exit."""
    served = await serve(
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url.removesuffix("/v1/traces"),
             "OTEL_SERVICE_NAME": "proxy-under-test", "OTEL_BSP_SCHEDULE_DELAY": "60000"},
        workers=2, database={"pool_size": 3},
    )  # fmt: skip

    async def both_listening() -> bool:
        return sum(1 for x in served.lines() if x["msg"].startswith("listening")) >= 2

    await wait_until(both_listening, "2 workers listening", within=60)
    async with aiohttp.ClientSession() as session:
        for number in range(20):
            # A connection each: the workers share the listener's connections between them.
            async with session.post(
                f"{served.url}/webhooks/corvel", data=event(f"evt_serve{number}"),
                headers={"Connection": "close"},
            ) as response:  # fmt: skip
                assert response.status == 200
    assert receiver.spans == []  # a minute's schedule: nothing exported yet
    served.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(served.process.wait(), 30) == 0
    servers = [s for s in receiver.spans if s.kind == "SERVER"]
    assert {s.service for s in servers} == {"proxy-under-test"}
    assert sorted(s.attributes["webhook.event_id"] for s in servers) == sorted(
        f"evt_serve{n}" for n in range(20)
    )
    lines = {x["event_id"]: x for x in served.lines() if x.get("event_id")}
    assert {s.trace_id for s in servers} == {line["trace_id"] for line in lines.values()}


@pytest.mark.usefixtures("traced")
async def test_the_admin_listener_is_not_traced(
    make_proxy: MakeProxy, receiver: Receiver, aiohttp_client: Any
) -> None:
    client = await make_proxy()
    admin = await admin_client(aiohttp_client, client)
    for path in ("/metrics", "/healthz", "/readyz"):
        assert (await admin.get(path)).status == 200
    assert (await client.post("/webhooks/corvel", data=event("evt_admin"))).status == 200
    servers = await _servers(receiver, 1)
    await client.close()  # the drain exports whatever is still queued
    assert [s.attributes["url.path"] for s in servers] == ["/webhooks/corvel"]
    assert [s.name for s in receiver.spans if s.kind == "SERVER"] == ["POST /webhooks/corvel"]


@pytest.mark.usefixtures("traced")
async def test_hostile_header_bytes_never_change_an_answer(
    make_proxy: MakeProxy, upstream: FakeUpstream, receiver: Receiver
) -> None:
    """Bytes a client picks reach span attributes (a Host whose port int() refuses, a byte
    that is not UTF-8 in a User-Agent, a port past 65535): the webhooks are answered as without
    tracing (the byte that is not UTF-8 refused), and their spans exported with the bytes
    replaced."""
    client = await make_proxy(trusted_proxies=["127.0.0.1/32"])
    requests = [
        (webhook_request("evt_host").replace(b"Host: proxy.test", b"Host: proxy.test:\xc2\xb2"),
         200),
        (webhook_request("evt_agent", b"User-Agent: a\xffb", b"X-Forwarded-Host: x:99999999999"),
         400),
    ]  # fmt: skip
    async with connection(client) as stream:
        for raw, expected in requests:
            answer = await send(stream, raw)
            assert answer is not None
            assert answer.status == expected
    # An event ID with a lone surrogate is refused, as without tracing; its span still goes.
    surrogate = b'{"id": "evt_\\ud800"}'
    assert (await client.post("/webhooks/corvel", data=surrogate)).status == 400
    spans = await _servers(receiver, 3)
    servers = {s.attributes.get("webhook.event_id"): s for s in spans}
    assert servers["evt_host"].attributes["server.address"] == "proxy.test:\u00b2"
    assert "server.port" not in servers["evt_host"].attributes
    (agent,) = [s for s in spans if s.attributes.get("user_agent.original") == "a?b"]
    assert "server.port" not in agent.attributes
    assert [s.attributes["dedup.outcome"] for s in spans if s is not servers["evt_host"]] == [
        "rejected",
        "rejected",
    ]
    assert len(upstream.requests) == 1


@pytest.mark.parametrize(
    ("env", "code", "said"),
    [
        ({}, 0, "tracing:     off (set OTEL_EXPORTER_OTLP_ENDPOINT"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
             "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
            0,
            "tracing:     on: OTLP/HTTP to http://collector:4318/v1/traces, sampler "
            "parentbased_traceidratio 0.1, service webhook-dedup-proxy",
        ),
        (
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://tenant:s3cret@otlp.example/v1/traces",
             "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer t0ken"},
            0,
            "tracing:     on: OTLP/HTTP to https://tenant:***@otlp.example/v1/traces",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            2,
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc: the proxy exports OTLP over HTTP as protobuf only",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_BSP_MAX_QUEUE_SIZE": "100"},
            2,
            "OTEL_BSP_MAX_EXPORT_BATCH_SIZE must not exceed OTEL_BSP_MAX_QUEUE_SIZE (512 > 100",
        ),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_PROPAGATORS": "b3"},
            2,
            "the OpenTelemetry SDK refused the environment",
        ),
    ],
)  # fmt: skip
async def test_check_says_what_tracing_will_do_and_refuses_what_it_cannot(
    env: dict[str, str], code: int, said: str
) -> None:
    clean = {name: "" for name in os.environ if name.startswith("OTEL_")}
    status, out, err = await run_cli("check", "--config", str(EXAMPLE), env={**clean, **env})
    assert (status, said in out + err) == (code, True), out + err
    assert "s3cret" not in out + err
    assert "t0ken" not in out + err
