"""``workers: N``: processes sharing the port, their metrics added up, restart and drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.conftest import FakeUpstream, claimed, wait_until
from tests.ports import accepts, free_port


class Supervised:
    """A ``dedup-proxy serve`` with ``workers: 2``, its JSON log in a file."""

    def __init__(self, process: asyncio.subprocess.Process, log: Path, port: int, admin: int):
        self.process = process
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{admin}"

    def lines(self) -> list[dict[str, Any]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def workers(self) -> list[int]:
        """The supervisor's live children."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        return [int(pid) for pid in path.read_text().split()] if path.exists() else []

    async def listening(self, count: int) -> None:
        async def enough() -> bool:
            return sum(1 for x in self.lines() if x["msg"].startswith("listening")) >= count

        await wait_until(enough, f"{count} workers listening", within=60)

    async def metrics(self) -> dict[str, float]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{self.admin_url}/metrics") as response,
        ):
            text = await response.text()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples


def _config(tmp_path: Path, port: int, admin: int, upstream: str, dsn: str, table: str) -> Path:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{port}",
                "admin": {"listen": f"127.0.0.1:{admin}"},
                "workers": 2,
                "upstream": {"url": upstream, "timeout": "10s"},
                "database": {"dsn": dsn, "table": table, "pool_size": 3},
                "shutdown_timeout": "10s",
                "log": {"format": "json"},
                "routes": [{"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}],
            }
        )
    )
    return config_file


@pytest.fixture
async def supervised(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> AsyncIterator[Supervised]:
    port, admin = free_port(), free_port()
    config_file = _config(tmp_path, port, admin, upstream.url, pg_dsn, table)
    log = tmp_path / "proxy.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(config_file),
            stdout=out, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    proxy = Supervised(process, log, port, admin)
    try:
        await wait_until(lambda: accepts(port), "the workers to listen", within=60)
        await proxy.listening(2)
        yield proxy
    finally:
        if process.returncode is None:
            for pid in proxy.workers():
                os.kill(pid, signal.SIGKILL)
            process.kill()
            await process.wait()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _post(url: str, event_id: str) -> aiohttp.ClientResponse:
    # A connection per request, so that the kernel can hand each to either worker.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        response = await s.post(f"{url}/webhooks/corvel", data=json.dumps({"id": event_id}))
        await response.read()
        return response


async def test_workers_share_the_port_and_add_up_their_metrics(
    supervised: Supervised, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    ids = [f"evt_{n}" for n in range(30)]
    first = await asyncio.gather(*(_post(supervised.url, i) for i in ids))
    again = await asyncio.gather(*(_post(supervised.url, i) for i in ids))

    assert [r.status for r in first + again] == [200] * 60
    assert [r.headers.get("Dedup-Status") for r in again] == ["duplicate"] * 30
    assert sorted(json.loads(b)["id"] for b in upstream.bodies()) == sorted(ids)
    assert len(await claimed(pg_dsn, table)) == 30
    served_by = {x["worker"] for x in supervised.lines() if x.get("outcome")}
    assert served_by == {1, 2}

    samples = await supervised.metrics()
    processed = 'dedup_requests_total{outcome="processed",route="corvel"}'
    duplicate = 'dedup_requests_total{outcome="duplicate",route="corvel"}'
    assert (samples[processed], samples[duplicate]) == (30, 30)

    async def both_pools() -> bool:
        return (await supervised.metrics()).get("dedup_db_pool_connections") == 6

    await wait_until(both_pools, "both workers' pools in the gauge (2 x pool_size 3)")


async def test_a_killed_worker_is_replaced_and_sigterm_stops_every_worker(
    supervised: Supervised, upstream: FakeUpstream
) -> None:
    workers = supervised.workers()
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)

    async def replaced() -> bool:
        current = supervised.workers()
        return len(current) == 2 and workers[0] not in current

    await wait_until(replaced, "a new worker in place of the killed one", within=30)
    await supervised.listening(3)
    assert any("starting a new one" in x["msg"] for x in supervised.lines())
    responses = await asyncio.gather(*(_post(supervised.url, f"evt_r{n}") for n in range(10)))
    assert [r.status for r in responses] == [200] * 10

    survivors = supervised.workers()
    supervised.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(supervised.process.wait(), timeout=30) == 0
    assert not any(_alive(pid) for pid in survivors)
    assert sum(1 for x in supervised.lines() if x["msg"] == "stopped") == 2


async def test_a_worker_that_cannot_start_stops_the_supervisor(
    tmp_path: Path, pg_dsn: str, table: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config_file = _config(tmp_path, port, free_port(), "http://127.0.0.1:9", pg_dsn, table)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(config_file),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(process.communicate(), timeout=60)

    assert process.returncode == 1
    text = output.decode()
    assert f"cannot listen on http://127.0.0.1:{port}" in text
    assert "while starting; stopping" in text
    assert "Traceback" not in text


async def test_workers_drain_and_exit_when_the_supervisor_is_killed(
    supervised: Supervised,
) -> None:
    workers = supervised.workers()
    supervised.process.kill()  # no SIGTERM to pass on: the workers must notice by themselves
    await supervised.process.wait()

    async def gone() -> bool:
        return not any(_alive(pid) for pid in workers)

    await wait_until(gone, "the orphaned workers to drain and exit", within=30)
    assert sum(1 for x in supervised.lines() if x["msg"] == "the supervisor is gone: draining") == 2
