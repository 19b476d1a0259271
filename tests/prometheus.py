"""A real Prometheus server (Debian's ``prometheus``) scraping the given targets every second,
its storage in a temporary directory, its HTTP API on a free loopback port; and instant queries
against that API."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.helpers import free_port, wait_until

INSTALL_HINT = "Prometheus is not installed: apt-get install prometheus"
JOB = "dedup-proxy"
STOP_WITHIN = 10.0


@dataclass(frozen=True, slots=True)
class Prometheus:
    """A running server's API and its log."""

    url: str
    log: Path

    async def get(self, path: str, **params: str) -> Any:
        """The ``data`` of a successful API answer; fails the test on an error answer."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{self.url}{path}", params=params) as response,
        ):
            answer = await response.json()
        if answer.get("status") != "success":
            pytest.fail(f"Prometheus answered {response.status} to {path} {params}: {answer}")
        return answer["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result, now (a vector: one entry per series)."""
        data = await self.get("/api/v1/query", query=expr)
        return list(data["result"])

    async def label_values(self, label: str, selector: str) -> list[str]:
        return list(await self.get(f"/api/v1/label/{label}/values", **{"match[]": selector}))


def write_config(directory: Path, targets: Sequence[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "prometheus.yml"
    scrape = {"job_name": JOB, "static_configs": [{"targets": list(targets)}]}
    settings = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [scrape],
    }
    config.write_text(yaml.safe_dump(settings))
    return config


@contextlib.asynccontextmanager
async def scraping(targets: Sequence[str], directory: Path) -> AsyncIterator[Prometheus]:
    """Prometheus scraping ``/metrics`` of ``targets`` (host:port) every second, job ``JOB``;
    stopped (SIGTERM, then SIGKILL) on the way out."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError(INSTALL_HINT)
    config = write_config(directory, targets)
    port = free_port()
    log = directory / "prometheus.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdout=out, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    server = Prometheus(f"http://127.0.0.1:{port}", log)

    async def ready() -> bool:
        if process.returncode is not None:
            pytest.fail(f"prometheus exited {process.returncode}:\n{log.read_text()}")
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{server.url}/-/ready") as response,
            ):
                return response.status == 200
        except aiohttp.ClientError:
            return False

    try:
        await wait_until(ready, "Prometheus to be ready", within=30)
        yield server
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), STOP_WITHIN)
            except TimeoutError:
                process.kill()
                await process.wait()
