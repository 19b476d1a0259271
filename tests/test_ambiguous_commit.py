"""A COMMIT whose answer never comes back: the claim is reconciled on a fresh connection; where
that fails too, a COMMIT never sent is told apart from one in doubt.

A one-way relay between the proxy and PostgreSQL loses, on the connections open at that moment,
either PostgreSQL's answers (the COMMIT took effect) or the proxy's requests (it never arrived).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from aiohttp import web

from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    admin_client,
    claimed,
    event,
    scrape,
    wait_until,
)


class OneWayRelay:
    """Forwards TCP connections to PostgreSQL; ``cut()`` silences one direction on the
    connections open at that moment (new ones flow normally)."""

    def __init__(self, dsn: str) -> None:
        parts = urlsplit(dsn)
        host = parse_qs(parts.query).get("host", [parts.hostname or ""])[0]
        self._unix = f"{host}/.s.PGSQL.{parts.port or 5432}" if host.startswith("/") else None
        self._tcp = (host, parts.port or 5432)
        self._dsn = parts
        self._links: list[dict[str, bool]] = []
        self._writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.Server | None = None

    @property
    def dsn(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        user = self._dsn.username or "postgres"
        password = f":{self._dsn.password}" if self._dsn.password else ""
        return f"postgresql://{user}{password}@127.0.0.1:{port}{self._dsn.path}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def cut(self, *, answers: bool) -> None:
        """Lose PostgreSQL's answers (``answers``) or the proxy's requests from now on."""
        for link in self._links:
            link["answers" if answers else "requests"] = False

    def cut_at_commit(self) -> None:
        """Lose the proxy's requests from its next COMMIT on (what comes before it flows)."""
        for link in self._links:
            link["at_commit"] = True

    async def drop(self) -> None:
        """Close the connections open now, both ends, as a server or a network failing would;
        the proxy's side notices before it sends anything more."""
        for writer in self._writers:
            writer.close()
        await asyncio.sleep(0.2)  # the proxy's loop reads the end of its connections

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self._writers:
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._unix:
            up_reader, up_writer = await asyncio.open_unix_connection(self._unix)
        else:
            up_reader, up_writer = await asyncio.open_connection(*self._tcp)
        link = {"answers": True, "requests": True, "at_commit": False}
        self._links.append(link)
        self._writers += [writer, up_writer]

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, key: str) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    if key == "requests" and link["at_commit"] and b"COMMIT" in data:
                        link["requests"] = False
                    if link[key]:
                        dst.write(data)
            # One side closed: close the other, as the kernel would for a dead peer.
            dst.close()

        await asyncio.gather(
            pump(reader, up_writer, "requests"), pump(up_reader, writer, "answers")
        )


@pytest.fixture
async def relay(pg_dsn: str) -> AsyncIterator[OneWayRelay]:
    relay = OneWayRelay(pg_dsn)
    await relay.start()
    yield relay
    await relay.close()


@pytest.mark.parametrize("lost", ["answers", "requests"])
async def test_commit_in_doubt_is_reconciled(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    relay: OneWayRelay,
    pg_dsn: str,
    table: str,
    lost: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    upstream.gate = asyncio.Event()
    client = await make_proxy(
        database={"dsn": relay.dsn, "pool_size": 2, "connect_timeout": "1s"}, claim_wait="2s"
    )
    request = asyncio.create_task(client.post("/webhooks/corvel", data=b'{"id": "evt_doubt"}'))
    await upstream.arrived.wait()
    # answers: the COMMIT takes effect but its answer is lost;
    # requests: the COMMIT never arrives, and the claim dies with its connection.
    relay.cut(answers=lost == "answers")

    with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
        upstream.gate.set()
        response = await request

    assert response.status == 200
    assert await response.read() == b"processed\x00bytes"
    (line,) = [r.fields for r in caplog.records if hasattr(r, "fields")]
    assert (line["outcome"], line.get("reconciled")) == ("processed", True)
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_doubt"]
    again = await client.post("/webhooks/corvel", data=b'{"id": "evt_doubt"}')
    assert again.headers["Dedup-Status"] == "duplicate"
    assert len(upstream.requests) == 1


@pytest.mark.parametrize("sent", [False, True])
async def test_a_commit_never_sent_is_told_apart_from_one_in_doubt(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    pg_dsn: str,
    table: str,
    sent: bool,
    aiohttp_client: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    relay = OneWayRelay(pg_dsn)
    await relay.start()
    upstream.gate = asyncio.Event()
    try:
        proxy = await make_proxy(
            database={"dsn": relay.dsn, "pool_size": 2, "connect_timeout": "1s"},
            claim_wait="1s",
        )
        admin = await admin_client(aiohttp_client, proxy)
        request = asyncio.create_task(proxy.post("/webhooks/corvel", data=event("doubt")))
        await upstream.arrived.wait()
        assert relay.server is not None
        relay.server.close()  # no fresh connection: reconciling fails either way
        if sent:
            relay.cut(answers=False)  # COMMIT is sent, and lost on the way
        else:
            await relay.drop()  # the connection is closed before COMMIT
        with caplog.at_level(logging.INFO, logger="proxy.pipeline"):
            upstream.gate.set()
            response = await request
        samples = await scrape(admin)
    finally:
        await relay.close()
    assert response.status == 200  # the app did the work
    (line,) = [r.fields for r in caplog.records if hasattr(r, "fields")]
    label = (("route", "corvel"),)
    if sent:
        assert line["outcome"] == "ambiguous_commit"
        assert line["error"].startswith("COMMIT failed and could not be reconciled: ")
        assert samples[("dedup_ambiguous_commits_total", label)] == 1
        assert samples[("dedup_unsent_commits_total", label)] == 0
    else:
        assert line["outcome"] == "commit_not_sent"
        assert line["error"].startswith(
            "the connection was closed before COMMIT could be sent, so the claim is not stored"
        )
        assert samples[("dedup_unsent_commits_total", label)] == 1
        assert samples[("dedup_ambiguous_commits_total", label)] == 0
        assert await claimed(pg_dsn, table) == []


HANDED = {"name": "hooks", "path": "/hooks", "event_id": "body:/id",
          "redeliver": {"schedule": ["1h"], "for": "1d"}, "hand_off": "300ms"}  # fmt: skip


@pytest.mark.parametrize("app_status", [200, 503])
async def test_a_hand_off_that_cannot_keep_relays_the_apps_answer(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    relay: OneWayRelay,
    pg_dsn: str,
    table: str,
    app_status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The database stops answering the claim's connection before the hand-off: keeping the
    # delivery fails, and the provider waits for the app's own answer, as on any route.
    upstream.gate = asyncio.Event()
    upstream.respond = lambda n: web.Response(status=app_status, text="app")
    client = await make_proxy(
        database={"dsn": relay.dsn, "pool_size": 2, "connect_timeout": "1s"},
        routes=[HANDED],
    )

    async def not_kept() -> bool:
        return any("could not be kept" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO):
        request = asyncio.create_task(client.post("/hooks", data=b'{"id": "evt_handed"}'))
        await upstream.arrived.wait()
        relay.cut(answers=True)
        await wait_until(not_kept, "the hand-off's keep to fail")
        upstream.gate.set()
        response = await request

    assert response.status == app_status  # not 500
    assert await response.text() == "app"
    (line,) = [r.fields for r in caplog.records if hasattr(r, "fields")]
    if app_status == 200:
        # The claim died with its connection: stored again on a fresh one.
        assert (line["outcome"], line.get("reconciled")) == ("processed", True)
        assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_handed"]
    else:
        assert line["outcome"] == "upstream_error"
        assert await claimed(pg_dsn, table) == []


@pytest.mark.parametrize("app_status", [200, 503])
async def test_a_hand_off_whose_keep_commit_fails_relays_the_apps_answer(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    relay: OneWayRelay,
    pg_dsn: str,
    table: str,
    app_status: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The hand-off's keep is written, and its COMMIT lost on the way: the claim's transaction
    # ended with its connection, as when the keep itself failed (the campaign found a 500:
    # "claim ... is kept already", when the attempt then ended).
    upstream.gate = asyncio.Event()
    upstream.respond = lambda n: web.Response(status=app_status, text="app")
    client = await make_proxy(
        database={"dsn": relay.dsn, "pool_size": 2, "connect_timeout": "1s"},
        routes=[HANDED],
    )

    async def commit_failed() -> bool:
        return any("the COMMIT keeping" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO):
        request = asyncio.create_task(client.post("/hooks", data=b'{"id": "evt_handed"}'))
        await upstream.arrived.wait()
        relay.cut_at_commit()
        await wait_until(commit_failed, "the hand-off's COMMIT to fail")
        upstream.gate.set()
        response = await request

    assert response.status == app_status  # not 500
    assert await response.text() == "app"
    (line,) = [r.fields for r in caplog.records if hasattr(r, "fields")]
    if app_status == 200:
        assert (line["outcome"], line.get("reconciled")) == ("processed", True)
        assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_handed"]
    else:
        assert line["outcome"] == "upstream_error"
        assert await claimed(pg_dsn, table) == []
