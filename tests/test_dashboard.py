"""The Grafana dashboard (deploy/grafana/dedup-proxy.json) against a real Prometheus scraping a
real proxy under traffic: every panel's every query, its template variables substituted as
Grafana would ("All" for route and instance), returns data; so do the variables' own queries.
The panels are read from the JSON, so a panel added to deploy/grafana/dashboard.py is tested
without more."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests import prometheus
from tests.helpers import (
    CORVEL,
    GITHUB_SECRET,
    FakeUpstream,
    Serve,
    Served,
    event,
    github_route,
    wait_until,
)
from tests.provider_standins import GitHubHook

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dedup-proxy.json"
# What Grafana puts in place of each template variable with "All" selected, and of its own
# interval variables (a scrape every second: any window of a few scrapes holds data).
VALUES = {
    "route": ".*",
    "instance": ".*",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}
VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*(\w+)\)$")
DATA_WITHIN = 60.0  # seconds: the bound on Prometheus holding every panel's series
MAX_CONNECTIONS = 2  # per worker: IDLE idle connections make one worker close one (shed)
IDLE = 2 * MAX_CONNECTIONS + 1
HOOKS: dict[str, Any] = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "redeliver": {"schedule": ["100ms"], "for": "1d"},
    "order": {"key": "body:/id"},  # each event its own object: the blocked objects' gauges
}
# A route with receipt whose app writes none: its 2xx counted as a receipt missing.
PAY: dict[str, Any] = {"name": "pay", "path": "/pay", "event_id": "body:/id", "receipt": True}
TOKEN = "github_pat_stand_in_token_0123456789"
# The app's answers by event ID, in turn (the last one repeated); 200 for any other.
ANSWERS = {
    "evt_retry": (503, 200),  # kept (queued), then delivered at a redelivery
    "evt_dead": (422,),  # dead at the first try (dead_letter)
    "evt_dead_later": (503, 422),  # kept, then dead at its redelivery
}


def substitute(expr: str, where: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        if name not in VALUES:
            pytest.fail(f"{where}: the test knows no value for the variable ${name}")
        return VALUES[name]

    return VARIABLE.sub(value, expr)


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where: the panel's title and the target's refId, the query) of every panel."""
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            where = f"panel {panel['title']!r} target {target['refId']}"
            found.append((where, substitute(target["expr"], where)))
    return found


def answering(upstream: FakeUpstream) -> Any:
    def respond(n: int) -> web.Response:
        event_id = json.loads(upstream.requests[n].body or b"{}").get("id")
        earlier = sum(json.loads(r.body or b"{}").get("id") == event_id
                      for r in upstream.requests[:n])  # fmt: skip
        statuses = ANSWERS.get(event_id, (200,))
        return web.Response(status=statuses[min(earlier, len(statuses) - 1)], text="answer")

    return respond


async def post(session: aiohttp.ClientSession, url: str, body: bytes) -> str:
    async with session.post(url, data=body) as response:
        await response.read()
        return response.headers.get("Dedup-Status", str(response.status))


async def send_traffic(served: Served, upstream: FakeUpstream) -> None:
    """Every outcome a panel graphs: processed, duplicates, a refused request, a failure kept
    and then delivered, dead letters at the first try and at a redelivery, and a shed
    connection."""
    corvel, hooks = served.url + CORVEL["path"], served.url + HOOKS["path"]
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        outcomes = [await post(session, corvel, event(f"evt_{n}")) for n in range(5)]
        outcomes += [await post(session, corvel, event("evt_0")) for _ in range(2)]
        outcomes.append(await post(session, corvel, b'{"type": "no id"}'))
        for event_id in ("evt_retry", "evt_dead", "evt_dead_later", "evt_ok", "evt_ok"):
            outcomes.append(await post(session, hooks, event(event_id)))
        assert await post(session, served.url + PAY["path"], event("pay_1")) == "200"
    # The app's own answer relayed (processed) carries no Dedup-Status: its status stands in.
    assert outcomes == [*["200"] * 5, "duplicate", "duplicate", "rejected",
                        "queued", "dead_letter", "queued", "200", "duplicate"]  # fmt: skip

    async def redelivered() -> bool:
        ids = [json.loads(r.body or b"{}").get("id") for r in upstream.requests]
        return ids.count("evt_retry") >= 2 and ids.count("evt_dead_later") >= 2

    await wait_until(redelivered, "the kept deliveries' redeliveries", within=30)

    idle = [await asyncio.open_connection("127.0.0.1", served.port) for _ in range(IDLE)]
    try:
        await wait_until(
            lambda: shed(served), "a worker to close an idle connection at max_connections"
        )
    finally:
        for _, writer in idle:
            writer.close()


async def shed(served: Served) -> bool:
    samples = await served.metrics()
    return samples.get('dedup_shed_requests_total{reason="connections"}', 0.0) > 0


@pytest.fixture
async def hook(aiohttp_server: Any) -> GitHubHook:
    """GitHub's hook deliveries API (a stand-in), holding one delivery that never arrived: the
    reconciler's first run finds it a gap and recovers it."""
    stand_in = GitHubHook(secret=GITHUB_SECRET, token=TOKEN)
    server = await aiohttp_server(stand_in.app())
    stand_in.api_url = str(server.make_url(""))
    stand_in.target = "http://127.0.0.1:9/webhooks/github"  # nothing listens: status 0
    assert await stand_in.deliver("lost-1", b'{"ref": "refs/heads/main"}') == 0
    return stand_in


async def test_every_panel_of_the_dashboard_returns_data_from_a_real_prometheus(
    serve: Serve, upstream: FakeUpstream, hook: GitHubHook, tmp_path: Path
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = targets(dashboard)
    assert len(queries) >= 20, "the dashboard lost its panels"
    upstream.respond = answering(upstream)
    reconcile = {"every": "1h", "since": "1h", "repository": "octo/app", "hook_id": 1,
                 "token": TOKEN, "api_url": hook.api_url}  # fmt: skip
    served = await serve(
        workers=2,
        routes=[CORVEL, HOOKS, PAY, github_route(reconcile=reconcile)],
        redeliverer={"poll": "100ms"},
        max_connections=MAX_CONNECTIONS,
    )
    hook.target = served.url + "/webhooks/github"  # its redelivery, if the run comes after
    async with prometheus.scraping([f"127.0.0.1:{served.admin_port}"], tmp_path / "prom") as prom:
        await send_traffic(served, upstream)

        empty: list[str] = []
        deadline = time.monotonic() + DATA_WITHIN
        while True:
            empty = [f"{where}: {expr}" for where, expr in queries if not await prom.query(expr)]
            if not empty or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert not empty, "panels whose query returned nothing:\n" + "\n".join(empty)

        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            where = f"template variable {variable['name']!r}"
            match = LABEL_VALUES.match(substitute(variable["query"], where))
            assert match, f"{where}: not label_values(selector, label): {variable['query']}"
            values = await prom.label_values(match[2], match[1])
            assert values, f"{where} lists nothing: {variable['query']}"
        routes = await prom.label_values("route", "dedup_requests_total")
        assert {"corvel", "hooks"} <= set(routes)


def test_every_panel_reads_the_datasource_variable_and_has_unique_ids() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = [variable["name"] for variable in dashboard["templating"]["list"]]
    assert names == ["datasource", "instance", "route"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        refs = [target["refId"] for target in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]
        for source in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
            assert source == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
