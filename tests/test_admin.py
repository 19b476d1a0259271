"""The admin listener (metrics, health, readiness) and the canonical log line."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from proxy import app_keys, config, embedded, errors, logs
from tests.helpers import FakeUpstream, MakeProxy, admin_client, scrape, wait_until


async def test_metrics_count_requests_by_route_and_outcome(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_client: Any
) -> None:
    proxy = await make_proxy()
    client = await admin_client(aiohttp_client, proxy)
    await proxy.post("/webhooks/corvel", data=b'{"id": "m1"}')
    await proxy.post("/webhooks/corvel", data=b'{"id": "m1"}')
    await proxy.post("/webhooks/corvel", data=b'{"id": "m1", "changed": true}')
    await proxy.post("/webhooks/corvel", data=b"{}")
    await proxy.get("/elsewhere")

    samples = await scrape(client)

    def requests(route: str, outcome: str) -> float:
        return samples.get(("dedup_requests_total", (("outcome", outcome), ("route", route))), 0.0)

    assert requests("corvel", "processed") == 1
    assert requests("corvel", "duplicate") == 2
    assert requests("corvel", "rejected") == 1
    assert requests("", "passthrough") == 1
    assert samples[("dedup_payload_mismatches_total", (("route", "corvel"),))] == 1
    assert samples[("dedup_upstream_duration_seconds_count", (("route", "corvel"),))] == 1
    assert samples[("dedup_claim_wait_seconds_count", (("route", "corvel"),))] == 3
    assert samples[("dedup_commit_duration_seconds_count", (("route", "corvel"),))] == 1
    # Every request, refused and passed-through ones included, under its route and outcome
    # (the outcomes of dedup_requests_total, those the route had and no other).
    durations = {
        labels: count
        for (name, labels), count in samples.items()
        if name == "dedup_request_duration_seconds_count"
    }
    assert durations == {
        (("outcome", "processed"), ("route", "corvel")): 1,
        (("outcome", "duplicate"), ("route", "corvel")): 2,
        (("outcome", "rejected"), ("route", "corvel")): 1,
        (("outcome", "passthrough"), ("route", "")): 1,
    }
    assert samples[("dedup_database_connections", ())] == 4  # pool_size in the test config
    assert samples[("dedup_database_connections_in_use", ())] == 0
    assert samples[("dedup_in_flight_requests", (("route", "corvel"),))] == 0


async def test_in_flight_and_pool_in_use_while_a_webhook_is_held(
    make_proxy: MakeProxy, upstream: FakeUpstream, aiohttp_client: Any
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy()
    client = await admin_client(aiohttp_client, proxy)
    held = asyncio.create_task(proxy.post("/webhooks/corvel", data=b'{"id": "held"}'))
    await upstream.arrived.wait()

    # The held claim's connection; the route holds' poll and the sweeper borrow one for a
    # moment now and then, so the gauge reads 1 once none of theirs is out.
    samples: dict[Any, float] = {}

    async def one_held() -> bool:
        samples.update(await scrape(client))
        return samples[("dedup_database_connections_in_use", ())] == 1

    await wait_until(one_held, "the held claim's connection alone in use")
    upstream.gate.set()
    assert (await held).status == 200

    assert samples[("dedup_in_flight_requests", (("route", "corvel"),))] == 1


async def test_health_and_readiness(
    make_proxy: MakeProxy, aiohttp_client: Any, tmp_path: Path
) -> None:
    server = embedded.EmbeddedPostgres(tmp_path / "data")
    dsn = server.start()
    try:
        proxy = await make_proxy(database={"dsn": dsn})
        client = await admin_client(aiohttp_client, proxy)
        assert (await client.get("/healthz")).status == 200
        ready = await client.get("/readyz")
        assert (ready.status, await ready.json()) == (200, {"status": "ready"})

        await asyncio.to_thread(server.stop)
        down = await client.get("/readyz")
        assert down.status == 503
        assert (await down.json())["status"] == "unavailable"
        assert (await client.get("/healthz")).status == 200  # alive, just not ready

        await asyncio.to_thread(server.start)
        assert (await client.get("/readyz")).status == 200

        proxy.app[app_keys.DRAINING].set()
        draining = await client.get("/readyz")
        assert (draining.status, await draining.json()) == (503, {"status": "draining"})
    finally:
        server.stop()


async def test_canonical_log_line(
    make_proxy: MakeProxy, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await make_proxy()
    with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
        response = await proxy.post(
            "/webhooks/corvel",
            data=b'{"id": "evt_log", "type": "invoice.paid", "card": "4242424242424242"}',
            headers={"X-Request-Id": "req-123", "Authorization": "Bearer s3cret"},
        )
    assert response.status == 200

    (record,) = [r for r in caplog.records if r.name == "proxy.pipeline"]
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["route"] == "corvel"
    assert fields["scope"] == "corvel"
    assert fields["event_id"] == "evt_log"
    assert fields["event_type"] == "invoice.paid"
    assert fields["outcome"] == "processed"
    assert fields["upstream_status"] == 200
    assert fields["request_id"] == "req-123"
    # The phases, in order, inside the whole: each a round trip (to PostgreSQL, to the app), so
    # more than the 0.01 ms each is rounded to.
    assert fields["claim_ms"] > 0
    assert fields["upstream_ms"] > 0
    assert fields["commit_ms"] > 0
    phases = fields["claim_ms"] + fields["upstream_ms"] + fields["commit_ms"]
    assert fields["total_ms"] >= phases - 0.02  # each rounded to 0.01 ms
    # The request ID reaches the app too, so its logs can be joined with the proxy's.
    assert upstream.requests[0].headers["x-request-id"] == ["req-123"]

    stream = io.StringIO()
    formatter = logs.JsonFormatter()
    line = json.loads(formatter.format(record))
    assert line["level"] == "info"
    assert line["outcome"] == "processed"
    stream.write(formatter.format(record))
    assert "4242424242424242" not in stream.getvalue()
    assert "s3cret" not in stream.getvalue()


def test_log_format_follows_the_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        for stream, expect_json in ((io.StringIO(), True), (Terminal(), False)):
            logs.setup(config.LogConfig(), stream)
            logging.getLogger("proxy.test").info("hello", extra={"fields": {"k": "v"}})
            text = stream.getvalue().strip()
            if expect_json:
                assert json.loads(text)["k"] == "v"
            else:
                assert text.endswith("proxy.test: hello k=v")
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


def test_admin_listener_defaults_to_loopback_and_never_shares_the_public_port() -> None:
    base: dict[str, Any] = {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "embedded"},
        "routes": [{"name": "a", "path": "/a", "event_id": "body:/id"}],
    }
    assert str(config.parse(base).admin.listen) == "127.0.0.1:9901"
    with pytest.raises(errors.ConfigError) as info:
        config.parse({**base, "listen": "0.0.0.0:9000", "admin": {"listen": "127.0.0.1:9000"}})
    assert info.value.problems == ("admin.listen: must not share the public port 9000",)
