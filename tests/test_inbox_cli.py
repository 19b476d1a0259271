"""The inbox's operator commands (``events pending``, ``dead``, ``show``, ``redeliver``,
``discard``) run as ``dedup-proxy`` against rows the proxy kept on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy import webhooks
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    connection,
    execute,
    fetch,
    free_port,
    github_headers,
    github_route,
    read_answer,
    run_cli,
    wait_until,
)

SLOW = {"schedule": ["1h"], "for": "1d"}  # the redeliverer never comes back by itself here
QUICK = {"poll": "100ms", "rate": 1000}


@pytest.fixture
def routes() -> list[dict[str, Any]]:
    """A route that redelivers, one scoped by its path, one whose app never listens, and one
    that does not redeliver."""
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    return [
        {"name": "hooks", "path": "/hooks", "event_id": "body:/id", "event_type": "body:/type",
         "redeliver": SLOW},
        {"name": "tenants", "path": "/t/{tenant}", "event_id": "body:/id", "redeliver": SLOW},
        {"name": "down", "path": "/down", "event_id": "body:/id", "redeliver": SLOW,
         "upstream": down},
        {"name": "plain", "path": "/plain", "event_id": "body:/id"},
    ]  # fmt: skip


@pytest.fixture
def config_file(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream, routes: list[dict[str, Any]]
) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url, "timeout": "5s"},
                "database": {"dsn": pg_dsn, "table": table},
                "redeliverer": QUICK,
                "routes": routes,
            }
        )
    )
    return path


Keep = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
def keep(make_proxy: MakeProxy, upstream: FakeUpstream, routes: list[dict[str, Any]]) -> Keep:
    """Post these event IDs to ``/hooks`` through a proxy whose app answers ``statuses`` in
    order (then 200): the proxy."""

    async def post(event_ids: Sequence[str], *statuses: int) -> TestClient[Any, Any]:
        upstream.respond = answering(*statuses)
        proxy = await make_proxy(routes=routes, redeliverer=QUICK)
        for event_id in event_ids:
            await proxy.post("/hooks", data=json.dumps({"id": event_id}))
        return proxy

    return post


def answering(*statuses: int) -> Any:
    """The app's answers, in order; 200 once they run out."""
    return lambda n: web.Response(status=statuses[n] if n < len(statuses) else 200)


async def cli(config_file: Path, *args: str) -> tuple[int, str, str]:
    return await run_cli("events", *args, "--config", str(config_file))


async def row(dsn: str, table: str, event_id: str) -> Any:
    found = await fetch(
        dsn,
        f"SELECT scope, inbox_state, inbox_body, inbox_due <= now() AS due, "
        f'inbox_until - now() AS left_, inbox_failures FROM "{table}" WHERE event_id = $1',
        event_id,
    )
    return found[0] if found else None


async def test_pending_and_dead_list_the_kept_deliveries_oldest_first(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path, routes: list[dict[str, Any]]
) -> None:
    upstream.respond = answering(503, 422, 503)
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    for event_id in ("p1", "d1", "p2", "ok"):
        await proxy.post("/hooks", data=json.dumps({"id": event_id, "type": "t." + event_id}))
    await proxy.post("/down", data=b'{"id": "u1"}')

    code, out, err = await cli(config_file, "pending", "--route", "hooks")
    print(out)

    assert (code, err) == (0, "")
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["received_at", "scope", "event_id", "event_type", "attempts", "last",
                        "next_due", "body_bytes"]  # fmt: skip
    assert [line[1:6] for line in lines[1:-1]] == [
        ["hooks", "p1", "t.p1", "1", "503"],
        ["hooks", "p2", "t.p2", "1", "503"],
    ]
    assert lines[1][7] == str(len(json.dumps({"id": "p1", "type": "t.p1"})))
    assert lines[1][0] < lines[1][6]  # due an hour after it was received
    assert out.splitlines()[-1] == "2 pending delivery(ies) in scope hooks"

    code, out, _ = await cli(config_file, "pending", "--route", "hooks", "--limit", "1")
    assert [line.split()[2] for line in out.splitlines()[1:-1]] == ["p1"]
    assert out.splitlines()[-1] == "showing the 1 oldest of 2 pending delivery(ies) in scope hooks"

    code, out, err = await cli(config_file, "dead", "--route", "hooks")
    print(out)
    assert (code, err) == (0, "")
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["received_at", "scope", "event_id", "event_type", "attempts", "last",
                        "body_bytes"]  # fmt: skip
    size = str(len(json.dumps({"id": "d1", "type": "t.d1"})))
    assert [line[1:7] for line in lines[1:-1]] == [["hooks", "d1", "t.d1", "1", "422", size]]
    assert out.splitlines()[-1] == "1 dead delivery(ies) in scope hooks"

    # No answer at all: the last answer is what went wrong, in words; too long for the row's
    # 120 columns, on a line of its own below it, with the next due time.
    code, out, _ = await cli(config_file, "pending", "--route", "down")
    print(out)
    header, listed, below = out.splitlines()[:3]
    assert "last" not in header.split()
    assert listed.split()[1:3] == ["down", "u1"]
    assert below.startswith("    next due ")
    assert below.endswith("; last: upstream refused the connection: nothing listens there")


async def test_show_prints_the_state_the_request_kept_and_every_attempt(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path, routes: list[dict[str, Any]]
) -> None:
    upstream.respond = answering(503)
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    body = b'{"id": "p1", "type": "charge.failed"}'
    headers = {"Authorization": "Bearer s3cret", "X-Signature": "sig=abc"}
    await proxy.post("/hooks?attempt=1", data=body, headers=headers)
    await proxy.post("/hooks", data=b'{"id": "ok"}')

    code, out, err = await cli(config_file, "show", "--route", "hooks", "p1")
    print(out)

    assert (code, err) == (0, "")
    fields = dict(line.split(":", 1) for line in out.splitlines() if not line.startswith(" "))
    assert fields["event"].strip() == "p1"
    assert fields["type"].strip() == "charge.failed"
    assert fields["state"].strip() == "pending"
    assert {"received_at", "next due", "until", "changed"} <= set(fields)
    assert fields["request"].strip() == "POST /hooks?attempt=1"
    assert fields["upstream"].strip() == f"{upstream.url} (where it was sent)"
    assert fields["redelivery"].strip() == f"{upstream.url} (the same: route hooks's upstream now)"
    assert fields["body"].strip() == f"{len(body)} bytes"
    assert "  Authorization: <redacted 13 bytes>" in out.splitlines()
    # One masking policy with the console's event page (``presenting``): a signature too.
    assert "  X-Signature: <redacted 7 bytes>" in out.splitlines()
    assert "s3cret" not in out
    assert "sig=abc" not in out
    attempts = out.splitlines()[out.splitlines().index("attempts:    1") + 1 :]
    assert attempts[0].split() == ["#", "at", "status", "ms", "error"]
    assert attempts[1].split()[:3] == ["1", attempts[1].split()[1], "503"]

    code, raw, _ = await cli(config_file, "show", "--route", "hooks", "p1", "--body")
    assert (code, raw) == (0, body.decode())

    code, out, _ = await cli(config_file, "show", "--route", "hooks", "ok")
    assert code == 0
    assert "state:       delivered at the first try" in out.splitlines()
    assert "request:     not kept (delivered at the first try)" in out.splitlines()
    code, _, err = await cli(config_file, "show", "--route", "hooks", "ok", "--body")
    assert (code, err) == (1, "no body kept: hooks ok (delivered at the first try)\n")

    code, out, err = await cli(config_file, "show", "--route", "hooks", "nope")
    assert (code, out, err) == (1, "", "not found: hooks nope\n")


def moving(config_file: Path, upstream: str) -> None:
    """The first route of ``config_file`` sent to ``upstream`` from now on."""
    settings = yaml.safe_load(config_file.read_text())
    settings["routes"][0]["upstream"] = upstream
    config_file.write_text(yaml.safe_dump(settings))


async def test_show_says_where_it_was_sent_and_where_a_redelivery_goes_now(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path, routes: list[dict[str, Any]]
) -> None:
    upstream.respond = answering(503)
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    await proxy.post("/hooks", data=b'{"id": "moved"}')
    moved = f"http://svc:pw@127.0.0.1:{free_port()}"  # the app moved since (and signs in)
    moving(config_file, moved)

    code, out, err = await cli(config_file, "show", "--route", "hooks", "moved")
    code_json, document, _ = await cli(config_file, "show", "--route", "hooks", "moved", "--json")

    assert (code, err, code_json) == (0, "", 0)
    lines = out.splitlines()
    # Before: "upstream:    <the old one>" alone, where the redeliverer no longer sends it.
    assert f"upstream:    {upstream.url} (where it was sent)" in lines
    masked = moved.replace(":pw@", ":***@")
    assert f"redelivery:  {masked} (route hooks's upstream now, changed since)" in lines
    assert ":pw@" not in out
    request = json.loads(document)["request"]
    assert (request["upstream"], request["redelivery_upstream"]) == (upstream.url, masked)


def with_github(config_file: Path) -> list[dict[str, Any]]:
    """The routes of ``config_file`` and a GitHub route with verify (its claims bound to the
    body) that redelivers, added to it."""
    settings = yaml.safe_load(config_file.read_text())
    settings["routes"].append(github_route(redeliver=SLOW))
    config_file.write_text(yaml.safe_dump(settings))
    routes: list[dict[str, Any]] = settings["routes"]
    return routes


async def test_the_commands_take_the_id_as_the_provider_sent_it_and_the_logs_carry_both(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    config_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a GitHub route with verify the claim's ID is the event ID bound to the body: show,
    redeliver and discard take the ID the provider sent (the log line's and the 202's
    event_id), and the request's and the redelivery's log lines carry both forms."""
    upstream.respond = answering(503, 503)
    proxy = await make_proxy(routes=with_github(config_file), redeliverer=QUICK)
    # Two events, two bodies: one body under a second delivery ID is a replay, never kept twice.
    bodies = {n: b'{"n": %d}' % n for n in (1, 2)}
    bound = {n: webhooks.bound(f"1:g-{n}", "", hashlib.sha256(bodies[n]).digest()) for n in (1, 2)}
    with caplog.at_level(logging.INFO):
        for n in (1, 2):
            kept = await proxy.post("/webhooks/github", data=bodies[n],
                                    headers=github_headers(bodies[n], f"g-{n}"))  # fmt: skip
            assert (await kept.json())["event_id"] == f"1:g-{n}"

        code, out, err = await cli(config_file, "show", "--route", "github", "1:g-1")
        fields = dict(line.split(":", 1) for line in out.splitlines() if not line.startswith(" "))
        redelivering = await cli(config_file, "redeliver", "--route", "github", "1:g-1")
        discarding = await cli(config_file, "discard", "--route", "github", "1:g-2", "1:g-3")

        def redelivered() -> list[Any]:
            return [r for r in caplog.records if r.getMessage().startswith("redelivery of")]

        async def sent() -> bool:
            return bool(redelivered())

        await wait_until(sent, "the redelivery")

    assert (code, err) == (0, "")
    assert (fields["event"].strip(), fields["claim"].strip()) == ("1:g-1", bound[1])
    assert fields["state"].strip() == "pending"
    assert redelivering[0] == 0
    assert redelivering[1].splitlines()[0] == f"redelivering: github 1:g-1 (claim {bound[1]})"
    assert discarding[:2] == (
        1,
        f"discarded: github 1:g-2 (claim {bound[2]})\n"
        "not found: github 1:g-3 (looked for 1:g-3, 1:g-3~<digest>)\n",
    )
    lines = [r.fields for r in caplog.records if r.name == "proxy.pipeline"]  # type: ignore[attr-defined]
    assert [(line["event_id"], line["claim_id"]) for line in lines] == [
        ("1:g-1", bound[1]), ("1:g-2", bound[2])
    ]  # fmt: skip
    (line,) = [r.fields for r in redelivered()]
    assert (line["event_id"], line["claim_id"], line["result"]) == ("1:g-1", bound[1], "delivered")
    assert redelivered()[0].getMessage() == "redelivery of github 1:g-1: delivered"


GUID = "20ed78ab-6a3e-11ef-8d3c-5d1e2b1c9f00"


async def test_pending_lines_fit_120_columns_the_id_whole_as_the_provider_sent_it(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path
) -> None:
    """A GitHub delivery (its claim bound to the body), a long event type, and no answer from
    the app: each line within 120 columns (before: 200 and more), the event type cut with "…",
    the ID whole, as the commands take it, the last answer and next due time on a line below."""
    routes = with_github(config_file)
    routes[-1]["upstream"] = f"http://127.0.0.1:{free_port()}"  # nothing listens: an error
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    body = b'{"zen": "Keep it logically awesome."}'
    headers = github_headers(body, GUID, "123456789")
    headers["X-GitHub-Event"] = "pull_request_review_comment_thread_resolved"
    assert (await proxy.post("/webhooks/github", data=body, headers=headers)).status == 202

    code, out, err = await cli(config_file, "pending", "--route", "github")
    print(out)

    assert (code, err) == (0, "")
    header, listed, below = out.splitlines()[:3]
    assert max(len(line) for line in out.splitlines()) <= 120
    assert header.split() == ["received_at", "scope", "event_id", "event_type", "attempts",
                              "body_bytes"]  # fmt: skip
    assert listed.split()[2] == f"123456789:{GUID}"
    kind = listed[header.index("event_type") : header.index("attempts")].strip()
    assert kind.endswith("…")
    assert "pull_request_review_comment_thread_resolved".startswith(kind[:-1])
    assert re.fullmatch(
        r"    next due \S+; last: upstream refused the connection: nothing listens there", below
    ), below
    code, out, _ = await cli(config_file, "show", "--route", "github", f"123456789:{GUID}")
    assert code == 0  # the ID as listed is taken


async def test_a_github_guid_as_github_shows_it_finds_its_delivery_in_every_command(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path
) -> None:
    """GitHub's delivery page shows the GUID alone; the claim is ``<hook ID>:<GUID>`` bound
    to the body: show, redeliver and forget take the GUID, with or without the hook ID, and
    an unknown one is "not found" naming the forms looked for."""
    upstream.respond = answering(503)
    proxy = await make_proxy(routes=with_github(config_file), redeliverer=QUICK)
    body = b'{"zen": "Design for failure."}'
    kept = await proxy.post("/webhooks/github", data=body, headers=github_headers(body, GUID, "77"))
    assert kept.status == 202
    bound = webhooks.bound(f"77:{GUID}", "", hashlib.sha256(body).digest())

    shown = {given: await cli(config_file, "show", "--route", "github", given)
             for given in (GUID, f"77:{GUID}", bound)}  # fmt: skip
    for given, (code, out, err) in shown.items():
        fields = dict(line.split(":", 1) for line in out.splitlines() if not line.startswith(" "))
        assert (code, err) == (0, ""), given
        assert (fields["event"].strip(), fields["claim"].strip()) == (f"77:{GUID}", bound)
    redelivering = await cli(config_file, "redeliver", "--route", "github", GUID)
    assert redelivering[0] == 0
    assert redelivering[1].splitlines()[0] == f"redelivering: github {GUID} (claim {bound})"
    unknown = "0f0f0f0f-0000-4000-8000-000000000000"
    code, out, err = await cli(config_file, "show", "--route", "github", unknown)
    assert (code, out) == (1, "")
    assert err == (
        f"not found: github {unknown} (looked for {unknown}, {unknown}~<digest>, "
        f"<X-GitHub-Hook-ID>:{unknown}[~<digest>])\n"
    )
    assert await cli(config_file, "forget", "--route", "github", GUID) == (
        0, f"forgotten: github {GUID} (claim {bound})\n", ""
    )  # fmt: skip


async def test_show_escapes_what_a_terminal_would_act_on_in_kept_headers_and_target(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    config_file: Path,
    routes: list[dict[str, Any]],
    pg_dsn: str,
    table: str,
) -> None:
    # C1 CSI (U+009B) and OSC (U+009D, an OSC 52 clipboard write) and U+202E, as a client can
    # send them: raw bytes over a socket.
    hostile = b"\xc2\x9b2J \xc2\x9d52;c;aGk=\xc2\x9c \xe2\x80\xaeevil"
    upstream.respond = answering(503)
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    body = b'{"id": "t1"}'
    async with connection(proxy) as (reader, writer):
        writer.write(
            b"POST /hooks?q=%E2%80%AE HTTP/1.1\r\nHost: x\r\nX-Evil: " + hostile
            + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )  # fmt: skip
        answer = await read_answer(reader)
    assert answer is not None
    assert answer.status == 202
    # A raw 0x9B byte (not UTF-8): refused now, but a row kept before that may hold one.
    raw = '[["X-Raw", {"base64": "mzMxbQ=="}]]'  # b"\x9b31m"
    headers = f"(inbox_request->'headers') || '{raw}'::jsonb"
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET inbox_request = jsonb_set(inbox_request, '{{headers}}', "
        f"{headers}) WHERE event_id = 't1'",
    )

    code, out, err = await cli(config_file, "show", "--route", "hooks", "t1")

    assert (code, err) == (0, "")
    assert all(line.isprintable() for line in out.splitlines())
    for character in ("\x9b", "\x9d", "\x9c", "\u202e", "\udc9b"):
        assert character not in out
    evil = next(line for line in out.splitlines() if line.startswith("  X-Evil: "))
    assert evil == r"  X-Evil: \u009b2J \u009d52;c;aGk=\u009c \u202eevil"
    assert r"  X-Raw: \udc9b31m" in out.splitlines()


async def test_redeliver_makes_the_given_deliveries_due_now_with_the_whole_for_again(
    keep: Keep,
    config_file: Path,
    pg_dsn: str,
    table: str,
) -> None:
    proxy = await keep(["p1", "d1", "ok"], 503, 422)
    await execute(pg_dsn, f"UPDATE \"{table}\" SET inbox_until = now() + interval '1 minute'")
    await proxy.close()  # no redeliverer takes them while they are looked at

    code, out, err = await cli(config_file, "redeliver", "--route", "hooks", "p1", "d1", "ok")

    assert (code, err) == (1, "")  # "ok" was delivered: nothing to redeliver
    assert out.splitlines() == [
        "redelivering: hooks p1",
        "redelivering: hooks d1",
        "not found: hooks ok",
        "2 delivery(ies) due now; the redeliverer takes them within its poll interval",
    ]
    for event_id in ("p1", "d1"):
        found = await row(pg_dsn, table, event_id)
        assert (found["inbox_state"], found["due"], found["inbox_failures"]) == ("pending", True, 0)
        assert found["left_"].total_seconds() > 86000  # the route's for: 1d, again
    assert (await row(pg_dsn, table, "ok"))["inbox_state"] is None


async def test_redeliver_dead_takes_the_routes_dead_ones_since_a_while(
    keep: Keep,
    config_file: Path,
    pg_dsn: str,
    table: str,
) -> None:
    proxy = await keep(["d1", "d2", "p1"], 422, 422, 503)
    await proxy.close()
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET inbox_changed = now() - interval '2 hours' WHERE event_id = 'd2'",
    )

    code, out, _ = await cli(
        config_file, "redeliver", "--route", "hooks", "--dead", "--since", "1h"
    )
    assert (code, out.splitlines()[0]) == (0, "redelivering: hooks d1")
    assert len(out.splitlines()) == 2
    assert (await row(pg_dsn, table, "d2"))["inbox_state"] == "dead"

    code, out, _ = await cli(config_file, "redeliver", "--route", "hooks", "--dead")
    assert (code, out.splitlines()) == (0, [
        "redelivering: hooks d2",
        "1 delivery(ies) due now; the redeliverer takes them within its poll interval",
    ])  # fmt: skip
    assert (await row(pg_dsn, table, "d2"))["inbox_state"] == "pending"

    code, out, _ = await cli(config_file, "redeliver", "--route", "hooks", "--dead")
    assert (code, out) == (0, "no dead deliveries in scope hooks\n")


async def test_redeliver_pending_makes_every_pending_one_due_now(
    keep: Keep,
    config_file: Path,
    pg_dsn: str,
    table: str,
) -> None:
    proxy = await keep(["p1", "p2", "d1"], 503, 503, 422)  # p1, p2 pending for an hour; d1 dead
    await proxy.close()

    code, out, _ = await cli(config_file, "redeliver", "--route", "hooks", "--pending")

    assert (code, out.splitlines()) == (0, [
        "redelivering: hooks p1",
        "redelivering: hooks p2",
        "2 delivery(ies) due now; the redeliverer takes them within its poll interval",
    ])  # fmt: skip
    for event_id in ("p1", "p2"):
        assert (await row(pg_dsn, table, event_id))["due"] is True
    assert (await row(pg_dsn, table, "d1"))["inbox_state"] == "dead"  # not pending: untouched
    code, out, _ = await cli(config_file, "redeliver", "--route", "down", "--pending")
    assert (code, out) == (0, "no pending deliveries in scope down\n")
    code, _, err = await cli(config_file, "redeliver", "--route", "hooks", "--pending", "--dead")
    assert code == 2
    assert "not allowed with argument" in err


async def test_a_dead_delivery_redelivered_by_the_operator_reaches_the_app(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    config_file: Path,
    routes: list[dict[str, Any]],
    pg_dsn: str,
    table: str,
) -> None:
    upstream.respond = answering(422)  # the app refused it, then its bug was fixed
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    body = b'{"id": "d1"}'
    first = await proxy.post("/hooks", data=body)
    assert first.headers["Dedup-Status"] == "dead_letter"

    code, out, _ = await cli(config_file, "redeliver", "--route", "hooks", "d1")

    assert (code, out.splitlines()[0]) == (0, "redelivering: hooks d1")

    async def delivered() -> bool:
        return (await row(pg_dsn, table, "d1"))["inbox_state"] == "delivered"

    await wait_until(delivered, "the redelivery")
    assert upstream.bodies() == [body, body]
    code, out, _ = await cli(config_file, "show", "--route", "hooks", "d1")
    assert "request:     dropped (delivered), headers and body" in out.splitlines()
    attempted = out.splitlines()[out.splitlines().index("attempts:    2") + 2 :]
    assert [line.split()[2] for line in attempted[:2]] == ["422", "200"]


async def test_discard_drops_the_delivery_and_keeps_the_claim(
    keep: Keep,
    upstream: FakeUpstream,
    config_file: Path,
    pg_dsn: str,
    table: str,
) -> None:
    proxy = await keep(["p1", "d1", "ok"], 503, 422)

    code, out, err = await cli(config_file, "discard", "--route", "hooks", "p1", "d1", "ok")

    assert (code, err) == (1, "")
    assert out.splitlines() == ["discarded: hooks p1", "discarded: hooks d1", "not found: hooks ok"]
    for event_id in ("p1", "d1"):
        found = await row(pg_dsn, table, event_id)
        assert (found["inbox_state"], found["inbox_body"]) == ("discarded", None)
    code, out, _ = await cli(config_file, "show", "--route", "hooks", "d1")
    assert "request:     dropped (discarded), headers and body" in out.splitlines()
    attempted = out.splitlines()[out.splitlines().index("attempts:    1") + 2]
    assert "  422  " in attempted  # its attempts stay
    # The claim stays: the provider's copy is an ordinary duplicate, never forwarded.
    copy = await proxy.post("/hooks", data=b'{"id": "p1"}')
    assert (copy.status, copy.headers["Dedup-Status"]) == (200, "duplicate")
    assert len(upstream.requests) == 3
    code, out, _ = await cli(config_file, "pending", "--route", "hooks")
    assert out.splitlines()[-1] == "0 pending delivery(ies) in scope hooks"
    code, out, _ = await run_cli("events", "discard", "--help")
    assert "use events forget" in " ".join(out.split())


async def test_a_route_scoped_by_its_path_is_listed_whole_and_its_events_need_scope(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    config_file: Path,
    routes: list[dict[str, Any]],
    pg_dsn: str,
    table: str,
) -> None:
    upstream.respond = answering(422, 422)
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    for tenant in ("acme", "globex"):
        await proxy.post(f"/t/{tenant}", data=b'{"id": "d1"}')
    await proxy.close()

    code, out, _ = await cli(config_file, "dead", "--route", "tenants")
    assert [line.split()[1:3] for line in out.splitlines()[1:-1]] == [
        ["tenants/acme", "d1"],
        ["tenants/globex", "d1"],
    ]
    assert out.splitlines()[-1] == "2 dead delivery(ies) in scope tenants"

    code, _, err = await cli(config_file, "show", "--route", "tenants", "d1")
    assert (code, err) == (2, "dedup-proxy events show: route 'tenants' scopes claims by its "
                              "path: give --scope (events list shows it)\n")  # fmt: skip
    code, _, err = await cli(config_file, "show", "--route", "tenants", "--scope", "hooks", "d1")
    assert (code, err) == (2, "dedup-proxy events show: 'hooks' is not a scope of route "
                              "'tenants'\n")  # fmt: skip
    code, out, _ = await cli(config_file, "show", "--route", "tenants", "--scope",
                             "tenants/acme", "d1")  # fmt: skip
    assert "scope:       tenants/acme" in out.splitlines()

    code, out, _ = await cli(config_file, "redeliver", "--route", "tenants", "--dead", "--scope",
                             "tenants/globex")  # fmt: skip
    assert (code, out.splitlines()[0]) == (0, "redelivering: tenants/globex d1")
    assert [r["inbox_state"] for r in await fetch(
        pg_dsn, f'SELECT inbox_state FROM "{table}" ORDER BY scope'
    )] == ["dead", "pending"]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["redeliver", "--route", "hooks", "--dead", "p1"],
         "give event IDs, --dead or --pending: one of them"),
        (["redeliver", "--route", "hooks"], "give event IDs, --dead or --pending: one of them"),
        (["redeliver", "--route", "hooks", "--since", "1h", "p1"],
         "--since goes with --dead or --pending only"),
        (["redeliver", "--route", "plain", "p1"],
         "route 'plain' has no redeliver: nothing would redeliver it"),
        (["pending", "--route", "nope"],
         "unknown route 'nope' (routes: hooks, tenants, down, plain)"),
        (["discard", "--route", "tenants", "p1"],
         "route 'tenants' scopes claims by its path: give --scope (events list shows it)"),
    ],
)  # fmt: skip
async def test_usage_errors_exit_2_before_any_database(
    config_file: Path, args: list[str], problem: str
) -> None:
    # The claim table does not even exist: the database would be an exit 1.
    code, out, err = await cli(config_file, *args)
    assert (code, out, err) == (2, "", f"dedup-proxy events {args[0]}: {problem}\n")


async def test_an_unknown_id_exits_1_and_a_missing_table_is_said(config_file: Path) -> None:
    code, _, err = await cli(config_file, "pending", "--route", "hooks")
    assert code == 1
    assert err.startswith("dedup-proxy events pending: ")
    assert "does not exist" in err
    assert "Traceback" not in err
    assert (await run_cli("migrate", "-c", str(config_file)))[0] == 0

    code, out, err = await cli(config_file, "redeliver", "--route", "hooks", "x")
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        "not found: hooks x",
        "0 delivery(ies) due now; the redeliverer takes them within its poll interval",
    ]
    code, out, _ = await cli(config_file, "discard", "--route", "hooks", "x")
    assert (code, out) == (1, "not found: hooks x\n")


# Many dead rows of the route "hooks", as the proxy keeps them: e00000, e00001, …
MANY_DEAD = (
    'INSERT INTO "{table}" (scope, event_id, received_at, inbox_state, inbox_body, '
    "inbox_request, inbox_attempts, inbox_failures, inbox_changed, inbox_until) "
    "SELECT 'hooks', 'e' || lpad(n::text, 5, '0'), now() - interval '1 day', 'dead', 'BODY', "
    '\'{{"route":"hooks","upstream":"http://127.0.0.1:9","method":"POST","target":"/hooks",'
    '"headers":[]}}\', \'[{{"at":"2026-01-01T00:00:00+00:00","status":500,"error":null}}]\', '
    "1, now() - interval '1 hour', now() FROM generate_series(0, {last}) AS n"
)


async def many_dead(config_file: Path, dsn: str, table: str, count: int) -> None:
    code, _, err = await run_cli("migrate", "--config", str(config_file))
    assert (code, err) == (0, "")
    await execute(dsn, MANY_DEAD.format(table=table, last=count - 1))


async def states(dsn: str, table: str) -> dict[str | None, int]:
    """How many rows in each state, every row checked whole: a pending row made due by the
    operator (no failure counted, due, the route's for again, its body kept), a dead row as it
    was (one failure, not due)."""
    rows = await fetch(
        dsn,
        f"SELECT inbox_state, inbox_failures, inbox_due IS NOT NULL AS due, "
        f"inbox_until > now() + interval '23 hours' AS renewed, inbox_body IS NOT NULL AS body "
        f'FROM "{table}"',
    )
    counts: dict[str | None, int] = {}
    for found in rows:
        whole = {
            "pending": (0, True, True, True),
            "dead": (1, False, False, True),
            "discarded": (1, False, False, False),
        }[found["inbox_state"]]
        assert tuple(found)[1:] == whole, found  # never half changed
        counts[found["inbox_state"]] = counts.get(found["inbox_state"], 0) + 1
    return counts


async def test_a_dry_run_counts_and_shows_the_first_rows_and_changes_nothing(
    config_file: Path, pg_dsn: str, table: str
) -> None:
    await many_dead(config_file, pg_dsn, table, 3000)

    for command in ("redeliver", "discard"):
        code, out, err = await cli(config_file, command, "--route", "hooks", "--dead", "--dry-run")
        assert (code, err) == (0, "")
        lines = out.splitlines()
        assert lines[0].split()[:3] == ["received_at", "scope", "event_id"]
        assert [line.split()[2] for line in lines[1:-1]] == [f"e{n:05}" for n in range(10)]
        assert lines[-1] == (
            f"would {command} 3000 dead delivery(ies) in scope hooks (the first 10 above); "
            "nothing changed (--dry-run)"
        )
    code, out, _ = await cli(
        config_file, "redeliver", "--route", "hooks", "--dead", "--since", "10m", "--dry-run"
    )
    assert (code, out) == (
        0,
        "would redeliver 0 dead delivery(ies) in scope hooks; nothing changed (--dry-run)\n",
    )
    assert await states(pg_dsn, table) == {"dead": 3000}
    code, _, err = await cli(config_file, "redeliver", "--route", "hooks", "e00001", "--dry-run")
    assert (code, err) == (2, "dedup-proxy events redeliver: --dry-run goes with --dead or "
                              "--pending only\n")  # fmt: skip


async def test_a_bulk_redeliver_interrupted_by_ctrl_c_leaves_rows_whole_and_a_rerun_ends_it(
    config_file: Path, pg_dsn: str, table: str
) -> None:
    """Ctrl-C while a batch is in flight: the batches before it committed, it rolled back
    whole, every row is either changed or as it was; the same command again does the rest."""
    await many_dead(config_file, pg_dsn, table, 3000)
    # The fourth batch (e01500…) waits, mid-batch, at e01700 for a lock this test holds.
    lock = 740_017
    await execute(
        pg_dsn,
        f'CREATE FUNCTION "{table}_hold"() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN '
        f"PERFORM pg_advisory_xact_lock({lock}); RETURN NEW; END $$; "
        f'CREATE TRIGGER hold BEFORE UPDATE ON "{table}" FOR EACH ROW '
        f"WHEN (OLD.event_id = 'e01700') EXECUTE FUNCTION \"{table}_hold\"()",
    )
    holder = await asyncpg.connect(pg_dsn)
    await holder.execute(f"SELECT pg_advisory_lock({lock})")
    command = ("redeliver", "--route", "hooks", "--dead", "--config", str(config_file))
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "events", *command,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:

        async def waiting() -> bool:
            rows = await holder.fetch(
                "SELECT FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $1",
                lock,
            )
            return bool(rows)

        await wait_until(waiting, "the fourth batch to wait at e01700", within=60)
        process.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await holder.close()

    print(err.decode())
    assert process.returncode == 130
    progress = err.decode().splitlines()
    assert progress == [
        "made due 500 of 3000",
        "made due 1000 of 3000",
        "made due 1500 of 3000",
        "interrupted: made due 1500 of 3000, each batch committed whole; the rest are as they "
        "were: run the same command again to continue",
        "dedup-proxy events redeliver: interrupted",
    ]
    assert len(out.decode().splitlines()) == 1500
    assert await states(pg_dsn, table) == {"pending": 1500, "dead": 1500}

    await execute(pg_dsn, f'DROP TRIGGER hold ON "{table}"')
    code, out_again, err_again = await cli(config_file, "redeliver", "--route", "hooks", "--dead")
    assert code == 0
    assert err_again.splitlines() == ["made due 500 of 1500", "made due 1000 of 1500",
                                      "made due 1500 of 1500"]  # fmt: skip
    lines = out_again.splitlines()
    assert lines[0] == "redelivering: hooks e01500"
    assert lines[-1] == (
        "1500 delivery(ies) due now; the redeliverer takes them within its poll interval"
    )
    assert await states(pg_dsn, table) == {"pending": 3000}
    # Those pending now were made due by the operator: a rerun of --pending passes them over.
    code, out_again, _ = await cli(config_file, "redeliver", "--route", "hooks", "--pending")
    assert (code, out_again) == (0, "no pending deliveries in scope hooks\n")


async def test_discard_by_state_drops_the_routes_dead_ones_and_their_claims_stay(
    keep: Keep, upstream: FakeUpstream, config_file: Path, pg_dsn: str, table: str
) -> None:
    proxy = await keep(["p1", "d1", "d2", "ok"], 503, 422, 422)
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET inbox_changed = now() - interval '2 hours' WHERE event_id = 'd2'",
    )

    code, out, err = await cli(
        config_file, "discard", "--route", "hooks", "--dead", "--since", "1h"
    )

    assert (code, err) == (0, "discarded 1 of 1\n")
    assert out.splitlines() == [
        "discarded: hooks d1",
        "1 dead delivery(ies) discarded in scope hooks",
    ]
    got = {r["event_id"]: r["inbox_state"] for r in await fetch(pg_dsn, f'SELECT * FROM "{table}"')}
    assert got == {"p1": "pending", "d1": "discarded", "d2": "dead", "ok": None}
    code, out, _ = await cli(config_file, "discard", "--route", "hooks", "--pending")
    assert (code, out.splitlines()[-1]) == (0, "1 pending delivery(ies) discarded in scope hooks")
    copy = await proxy.post("/hooks", data=b'{"id": "p1"}')
    assert copy.headers["Dedup-Status"] == "duplicate"  # the claim stays
    assert len(upstream.requests) == 4
    code, _, err = await cli(config_file, "discard", "--route", "hooks", "--since", "1h", "d2")
    assert (code, err) == (2, "dedup-proxy events discard: --since goes with --dead or --pending "
                              "only\n")  # fmt: skip


async def test_pending_and_dead_without_route_list_every_route_and_json_is_one_document(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path, routes: list[dict[str, Any]]
) -> None:
    upstream.respond = answering(503, 422)
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    await proxy.post("/hooks", data=b'{"id": "p1", "type": "t.p1"}')
    await proxy.post("/hooks", data=b'{"id": "d1"}')
    await proxy.post("/t/acme", data=b'{"id": "a1"}')  # answered 200 by the app
    await proxy.post("/down", data=b'{"id": "u1"}')

    code, out, err = await cli(config_file, "pending")

    assert (code, err) == (0, "")
    rows = [line for line in out.splitlines()[1:-1] if not line.startswith(" ")]
    assert [line.split()[1:3] for line in rows] == [["hooks", "p1"], ["down", "u1"]]
    assert out.splitlines()[-1] == "2 pending delivery(ies) in scope hooks, tenants, down, plain"
    code, out, err = await cli(config_file, "pending", "--json", "--limit", "1")
    assert (code, err) == (0, "")
    document = json.loads(out)
    assert (document["state"], document["total"]) == ("pending", 2)
    assert document["scopes"] == ["hooks", "tenants", "down", "plain"]
    (first,) = document["deliveries"]
    assert first["received_at"].endswith("+00:00")
    assert first["next_due"] > first["received_at"]
    assert {k: v for k, v in first.items() if k not in ("received_at", "next_due")} == {
        "scope": "hooks", "event_id": "p1", "event_type": "t.p1", "state": "pending",
        "attempts": 1, "last_status": 503, "last_error": None, "body_bytes": 28,
    }  # fmt: skip
    code, out, _ = await cli(config_file, "dead", "--json")
    assert [(d["event_id"], d["last_status"]) for d in json.loads(out)["deliveries"]] == [
        ("d1", 422)
    ]

    code, out, _ = await cli(config_file, "list", "--route", "hooks", "--json")
    document = json.loads(out)
    assert (document["route"], document["scope"], document["total"]) == ("hooks", "hooks", 2)
    assert {e["event_id"]: e["state"] for e in document["events"]} == {"p1": "pending",
                                                                     "d1": "dead"}  # fmt: skip
    code, out, _ = await cli(config_file, "list", "--route", "tenants")
    assert out.splitlines()[1].split()[1:] == ["tenants/acme", "a1", "-", "-"]
    code, out, _ = await run_cli("stats", "--json", "--config", str(config_file))
    by_route = {r["route"]: r for r in json.loads(out)["routes"]}
    assert {name: (r["rows"], r["pending"], r["dead"]) for name, r in by_route.items()} == {
        "hooks": (2, 1, 1), "tenants": (1, 0, 0), "down": (1, 1, 0), "plain": (0, 0, 0),
    }  # fmt: skip
    assert by_route["plain"]["oldest"] is None
    assert by_route["tenants"]["scope"] == "tenants/…"
    code, out, _ = await run_cli("stats", "--config", str(config_file))
    assert out.splitlines()[1].split()[:5] == ["hooks", "hooks", "2", "1", "1"]


async def test_show_json_is_valid_json_for_hostile_bytes_and_masks_credentials(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    config_file: Path,
    routes: list[dict[str, Any]],
    pg_dsn: str,
    table: str,
) -> None:
    hostile = b"\xc2\x9b2J \xc2\x9d52;c;aGk=\xc2\x9c \xe2\x80\xaeevil"  # C1 CSI, OSC 52, U+202E
    upstream.respond = answering(503)
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    body = b'{"id": "t1"}'
    async with connection(proxy) as (reader, writer):
        writer.write(
            b"POST /hooks?q=%E2%80%AE HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
            b"X-Evil: " + hostile + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )  # fmt: skip
        answer = await read_answer(reader)
    assert answer is not None
    assert answer.status == 202
    raw = '[["X-Raw", {"base64": "mzMxbQ=="}]]'  # b"\x9b31m": not UTF-8
    headers = f"(inbox_request->'headers') || '{raw}'::jsonb"
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET inbox_request = jsonb_set(inbox_request, '{{headers}}', "
        f"{headers}) WHERE event_id = 't1'",
    )

    code, out, err = await cli(config_file, "show", "--route", "hooks", "t1", "--json")

    assert (code, err) == (0, "")
    assert out.isascii()  # nothing a terminal could act on
    shown = json.loads(out)
    assert (shown["event_id"], shown["claim_id"], shown["state"]) == ("t1", "t1", "pending")
    assert shown["request"]["target"] == "/hooks?q=%E2%80%AE"
    values = {h["name"]: h for h in shown["request"]["headers"]}
    assert values["X-Evil"]["value"] == hostile.decode()
    assert values["X-Raw"]["value"] == {"base64": "mzMxbQ=="}
    assert values["Authorization"] == {"name": "Authorization", "value": None,
                                       "redacted_bytes": 13}  # fmt: skip
    assert "s3cret" not in out
    assert shown["request"]["body_bytes"] == len(body)
    assert [a["status"] for a in shown["attempts"]] == [503]
    # An event ID and type with escape sequences (ESC, BEL) inside, which the proxy refuses
    # now but a row kept before, or by another deployment, may hold: JSON escapes them all.
    evil_id, evil_type = "x\x1b]52;c;aGk=\x07", "t\x1b[2J\u202e"
    copy = await asyncpg.connect(pg_dsn)
    try:
        await copy.execute(f'CREATE TEMP TABLE kept AS SELECT * FROM "{table}"')
        await copy.execute(
            "UPDATE kept SET event_id = $1, event_type = $2, received_at = now()",
            evil_id, evil_type,
        )  # fmt: skip
        await copy.execute(f'INSERT INTO "{table}" SELECT * FROM kept')
    finally:
        await copy.close()
    code, out, _ = await cli(config_file, "pending", "--json")
    assert out.isascii()
    assert [(d["event_id"], d["event_type"]) for d in json.loads(out)["deliveries"]] == [
        ("t1", None), (evil_id, evil_type)
    ]  # fmt: skip
    code, out, _ = await cli(config_file, "pending")
    assert "\x1b" not in out
    assert "\x07" not in out
    code, out, _ = await cli(config_file, "show", "--route", "hooks", evil_id)
    assert code == 0
    assert "event:       x\\u001b]52;c;aGk=\\u0007" in out.splitlines()
    assert "\x1b" not in out
    code, out, _ = await cli(config_file, "list", "--route", "hooks", "--json")
    assert out.isascii()
    assert {e["event_id"] for e in json.loads(out)["events"]} == {"t1", evil_id}
    code, _, err = await cli(config_file, "show", "--route", "hooks", "t1", "--json", "--body")
    assert (code, err) == (2, "dedup-proxy events show: --body and --json: one of them\n")


# An app's error page: markup, a terminal's controls (an OSC 52 clipboard write, a screen
# clear) and C1 CSI, with more lines than a terminal would want.
APP_ERROR = "<h1>oops</h1><script>alert(1)</script>\n\x1b]52;c;aGk=\x07\x1b[2J\u009b2J\nline 3\n"


async def test_show_says_why_first_then_each_attempt_with_what_the_app_answered(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    config_file: Path,
    routes: list[dict[str, Any]],
    pg_dsn: str,
    table: str,
) -> None:
    def respond(n: int) -> web.Response:
        if n < 2:
            return web.Response(status=500, text=APP_ERROR, headers={"X-App": "v2"})
        return web.Response(status=422, text="no such customer " + "y" * 3000)

    upstream.respond = respond
    proxy = await make_proxy(routes=routes, redeliverer=QUICK)
    await proxy.post("/hooks", data=b'{"id": "p1"}')
    assert (await cli(config_file, "redeliver", "--route", "hooks", "p1"))[0] == 0

    async def tried() -> bool:
        found = await fetch(
            pg_dsn, f"SELECT jsonb_array_length(inbox_attempts) AS n FROM \"{table}\" "
            "WHERE event_id = 'p1'",
        )  # fmt: skip
        return bool(found[0]["n"] == 2)

    await wait_until(tried, "the second attempt")
    await proxy.post("/hooks", data=b'{"id": "d1"}')  # 422: dead at once

    code, out, err = await cli(config_file, "show", "--route", "hooks", "p1")
    print(out)

    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert all(line.isprintable() for line in lines)
    for raw in ("\x1b", "\x07", "\x9b"):
        assert raw not in out
    fields = [line.split(":", 1)[0] for line in lines if not line.startswith(" ")]
    assert fields.index("why") == fields.index("state") + 1  # the current reason, first
    why = next(line for line in lines if line.startswith("why:"))
    assert re.fullmatch(r"why: +attempt 2 failed: the app answered 500 after [\d.]+ ms", why)
    assert "until" in fields  # pending: tried until then
    attempted = lines[lines.index("attempts:    2") + 1 :]
    assert attempted[0].split() == ["#", "at", "status", "ms", "error"]
    assert [row.split()[0] for row in attempted[1:3]] == ["1", "2"]
    assert [row.split()[2] for row in attempted[1:3]] == ["500", "500"]
    start = next(i for i, line in enumerate(attempted) if line.startswith("  answer #1: "))
    first = attempted[start:]
    assert re.fullmatch(r"  answer #1: the app answered 500 after [\d.]+ ms", first[0])
    assert "    Content-Type: text/plain; charset=utf-8" in first
    assert "    X-App: v2" in first
    body = first.index(f"    body: {len(APP_ERROR.encode())} bytes:")
    assert first[body + 1 : body + 4] == [
        "    | <h1>oops</h1><script>alert(1)</script>",
        r"    | \u001b]52;c;aGk=\u0007\u001b[2J\u009b2J",
        "    | line 3",
    ]

    code, out, _ = await cli(config_file, "show", "--route", "hooks", "p1", "--json")
    shown = json.loads(out)
    assert shown["why"].startswith("attempt 2 failed: the app answered 500 after ")
    assert [(a["n"], a["status"], a["body"]) for a in shown["attempts"]] == [
        (1, 500, APP_ERROR), (2, 500, APP_ERROR)
    ]  # fmt: skip
    assert all(a["ms"] >= 0 for a in shown["attempts"])

    code, out, _ = await cli(config_file, "show", "--route", "hooks", "d1")
    print(out)
    lines = out.splitlines()
    fields = [line.split(":", 1)[0] for line in lines if not line.startswith(" ")]
    assert "until" not in fields  # dead: its schedule is over
    why = next(line for line in lines if line.startswith("why:"))
    assert re.fullmatch(r"why: +the app answered 422 after [\d.]+ ms: retrying cannot fix it", why)
    assert f"    body: {len('no such customer ') + 3000} bytes, the first 2048 shown:" in lines
