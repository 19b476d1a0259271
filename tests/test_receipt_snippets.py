"""docs/how-it-works.md's receipt apps ("The app's side": Django, SQLAlchemy in Flask,
node-postgres), each run as the page shows it, on its framework's own server, with a real
PostgreSQL, behind the proxy, through what a receipt is for:

- the late answer: the app commits, then answers after ``upstream.timeout``;
- the kill after COMMIT: the app is SIGKILLed between its COMMIT and its answer;
- the rollback: the app's transaction fails after the receipt's INSERT (the ledger refuses the
  row), and the provider's next copy is processed;
- the copy after COMMIT: the claim is lost (a failover), the next copy reaches the app, whose
  receipt fails with ``unique_violation``: it must answer 5xx, never 2xx (the page's rule);
- no ``Dedup-Receipt`` (the route's receipt off): the app credits, as without receipts.

The page's code is written to files as its blocks name them (``# ledger/views.py``) and run
untouched; what the test stages around it (tests/receipt_apps/: the late answer and the kill, a
Django project, Flask's runner) acts after the app's code has returned. The rollback is the
ledger's: a trigger that refuses an event listed in ``faults``. Each test's ledger is in a
schema of its own (``PGOPTIONS``'s search_path), the receipts in the claim database.

node and npm: CI (``CI=true``) fails without them; elsewhere the node app's tests are skipped.
``pg`` is installed from npm once per session.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from proxy import database
from tests.helpers import MakeProxy, accepts, execute, fetch, free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "how-it-works.md"
HARNESS = Path(__file__).resolve().parent / "receipt_apps"
TIMEOUT = "2s"  # the proxy's upstream.timeout; a late answer comes after 4 s (receipt_apps)
ROUTE = {"name": "pay", "path": "/pay", "event_id": "body:/id", "receipt": True}
FRAMEWORKS = {  # the files of the page each framework's app is made of
    "django": ["ledger/models.py", "ledger/views.py"],
    "flask": ["app.py"],
    "node": ["server.js"],
}


def page_files() -> dict[str, str]:
    """The page's whole apps: each block of "The app's side" whose first line names a file."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(r"^### The app's side\n(.*?)(?=^##)", text, re.M | re.S)
    assert found, 'docs/how-it-works.md has no section "The app\'s side"'
    blocks = re.findall(
        r"^```(?:python|js)\n(?:#|//) ([\w/]+\.(?:py|js))\n(.*?)^```", found[1], re.M | re.S
    )
    return dict(blocks)


def test_the_page_shows_each_frameworks_app_whole() -> None:
    assert sorted(page_files()) == sorted(name for names in FRAMEWORKS.values() for name in names)


@pytest.fixture(scope="session")
def node_modules(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """node-postgres, installed from npm for the session (node and npm: see the docstring)."""
    missing = [tool for tool in ("node", "npm") if shutil.which(tool) is None]
    if missing:
        message = f"{' and '.join(missing)} not installed: the node-postgres receipt app needs them"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message} (apt-get install nodejs npm)")
        pytest.skip(message)
    where = tmp_path_factory.mktemp("npm")
    npm = ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(where), "pg"]
    done = subprocess.run(npm, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(npm)} failed:\n{done.stderr}")
    return where / "node_modules"


JSON = {"Content-Type": "application/json"}  # as a provider sends it (Flask's get_json needs it)


def event(event_id: str) -> bytes:
    return b'{"id": "%s", "amount": 100}' % event_id.encode()


@dataclass
class App:
    """One of the page's apps, running, and its ledger."""

    process: asyncio.subprocess.Process
    url: str
    schema: str
    dsn: str
    log: Path

    async def credits(self, event: str) -> int:
        rows = await fetch(
            self.dsn, f"SELECT count(*) AS n FROM {self.schema}.ledger WHERE event = $1", event
        )
        return int(rows[0]["n"])

    async def refuse(self, event: str, refused: bool = True) -> None:
        """The ledger refuses ``event``'s row (its trigger raises), or no longer does."""
        if refused:
            await execute(self.dsn, f"INSERT INTO {self.schema}.faults VALUES ('{event}')")
        else:
            await execute(self.dsn, f"DELETE FROM {self.schema}.faults WHERE event = '{event}'")


async def ledger(dsn: str, schema: str) -> None:
    """The ledger the page's apps credit (as Django's migration would make it), in ``schema``,
    with a trigger that refuses an event listed in ``faults``; the receipts in public."""
    receipts = database.Receipts(dsn, connect_timeout=5.0, op_timeout=5.0)
    try:
        await receipts.migrate()
    finally:
        await receipts.close()
    await execute(
        dsn,
        f"CREATE SCHEMA {schema};"
        f"CREATE TABLE {schema}.ledger (id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,"
        " event text NOT NULL, amount integer NOT NULL);"
        f"CREATE TABLE {schema}.faults (event text);"
        f"CREATE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        f" IF EXISTS (SELECT 1 FROM {schema}.faults WHERE event = NEW.event) THEN"
        " RAISE EXCEPTION 'the ledger refuses %', NEW.event; END IF; RETURN NEW; END $$;"
        f"CREATE TRIGGER refuse AFTER INSERT ON {schema}.ledger FOR EACH ROW"
        f" EXECUTE FUNCTION {schema}.refuse()",
    )


def command(framework: str, where: Path, port: int, node_path: Path | None) -> list[str]:
    """How the framework's app is started in ``where``, on its own server, listening on ``port``."""
    if framework == "django":
        (where / "ledger" / "__init__.py").touch()
        return [sys.executable, "-m", "django", "runserver", "--noreload", f"127.0.0.1:{port}"]
    if framework == "flask":
        return [sys.executable, str(HARNESS / "flask_run.py")]
    assert node_path is not None
    return ["node", "--require", str(HARNESS / "faults.js"), str(where / "server.js")]


def environment(framework: str, where: Path, port: int, dsn: str, schema: str) -> dict[str, str]:
    """The app's environment: its database (its ledger first on the search path), its port,
    and where its modules are (the page's files, tests.receipt_apps)."""
    if framework == "flask":  # SQLAlchemy's URL names its driver
        dsn = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    return {
        **os.environ,
        "DATABASE_URL": dsn,
        "PGOPTIONS": f"-c search_path={schema},public",
        "PORT": str(port),
        "PYTHONPATH": os.pathsep.join([str(where), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "tests.receipt_apps.django_settings",
    }


@pytest.fixture(params=list(FRAMEWORKS))
async def app(request: pytest.FixtureRequest, pg_dsn: str, tmp_path: Path) -> AsyncIterator[App]:
    """The framework's app, as the page shows it, on its own server; killed at the end."""
    framework: str = request.param
    node_path = request.getfixturevalue("node_modules") if framework == "node" else None
    files, where = page_files(), tmp_path / framework
    for name in FRAMEWORKS[framework]:
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text(files[name], encoding="utf-8")
    schema, port = f"ledger_{uuid.uuid4().hex[:12]}", free_port()
    await ledger(pg_dsn, schema)
    env = environment(framework, where, port, pg_dsn, schema)
    if node_path is not None:
        env["NODE_PATH"] = str(node_path)
    log = tmp_path / f"{framework}.log"
    with log.open("wb") as output:
        process = await asyncio.create_subprocess_exec(
            *command(framework, where, port, node_path),
            cwd=where,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:

        async def listening() -> bool:
            if process.returncode is not None:
                pytest.fail(f"the {framework} app exited:\n{log.read_text()}")
            return await accepts(port)

        await wait_until(listening, f"the {framework} app to listen", within=30)
        url = f"http://127.0.0.1:{port}"
        # Its first request (imports, URLs, a connection) done before a test's: a cold start
        # slower than upstream.timeout would be taken for the late answer.
        async with aiohttp.ClientSession() as session:
            warm = await session.post(f"{url}/pay", data=event("warm-up"), headers=JSON)
            text = await warm.text()
            assert warm.status == 200, f"without Dedup-Receipt, {warm.status}: {text}"
        yield App(process, url, schema, pg_dsn, log)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        await execute(pg_dsn, f"DROP SCHEMA {schema} CASCADE")


def proxy_for(make_proxy: MakeProxy, app: App, **route: Any) -> Awaitable[TestClient[Any, Any]]:
    return make_proxy(routes=[{**ROUTE, **route}], upstream={"url": app.url, "timeout": TIMEOUT})


SETTLED = {"status": "processed", "receipt": "written"}


async def settled_by_the_receipt(answer: Any, event_id: str) -> None:
    """The proxy's answer from the app's receipt, not one of the app's."""
    body = await answer.text()
    assert answer.content_type == "application/json", f"the app answered {answer.status} {body!r}"
    assert (answer.status, json.loads(body)) == (200, {**SETTLED, "event_id": event_id})


async def test_an_answer_after_upstream_timeout_is_settled_by_the_apps_receipt(
    make_proxy: MakeProxy, app: App
) -> None:
    proxy = await proxy_for(make_proxy, app)

    late = await proxy.post("/pay", data=event("e1"), headers={**JSON, "X-Fault": "late"})

    await settled_by_the_receipt(late, "e1")  # not the 504 the provider would send again
    copy = await proxy.post("/pay", data=event("e1"), headers=JSON)
    assert copy.headers["Dedup-Status"] == "duplicate"
    assert await app.credits("e1") == 1


async def test_the_app_killed_between_its_commit_and_its_answer_credits_once(
    make_proxy: MakeProxy, app: App
) -> None:
    proxy = await proxy_for(make_proxy, app)

    killed = await proxy.post("/pay", data=event("e2"), headers={**JSON, "X-Fault": "kill"})

    assert await app.process.wait() == -9
    await settled_by_the_receipt(killed, "e2")
    copy = await proxy.post("/pay", data=event("e2"), headers=JSON)
    assert copy.headers["Dedup-Status"] == "duplicate"
    assert await app.credits("e2") == 1


async def test_a_transaction_failing_after_the_receipt_leaves_none_and_the_copy_credits_once(
    make_proxy: MakeProxy, app: App
) -> None:
    proxy = await proxy_for(make_proxy, app)
    await app.refuse("e3")

    failed = await proxy.post("/pay", data=event("e3"), headers=JSON)

    assert failed.status == 500  # the app's own answer: no receipt, so not settled
    assert await app.credits("e3") == 0
    await app.refuse("e3", refused=False)
    copy = await proxy.post("/pay", data=event("e3"), headers=JSON)
    assert copy.status == 200
    assert await copy.text() == "credited"  # the app's answer: this copy did it
    assert await app.credits("e3") == 1


async def test_a_copy_after_the_apps_commit_fails_on_the_receipt_and_is_answered_5xx(
    make_proxy: MakeProxy, app: App, pg_dsn: str, table: str
) -> None:
    proxy = await proxy_for(make_proxy, app)
    first = await proxy.post("/pay", data=event("e4"), headers=JSON)
    assert await first.text() == "credited"
    await execute(pg_dsn, f"DELETE FROM \"{table}\" WHERE event_id = 'e4'")  # the claim lost

    copy = await proxy.post("/pay", data=event("e4"), headers=JSON)

    assert await app.credits("e4") == 1  # not credited again (a savepoint that caught it would)
    # The app let its unique_violation fail the request: the proxy read the first receipt.
    # An app that caught it and answered 2xx would have its own answer here.
    await settled_by_the_receipt(copy, "e4")


async def test_without_dedup_receipt_the_app_credits_as_it_would_without_receipt(
    make_proxy: MakeProxy, app: App
) -> None:
    proxy = await proxy_for(make_proxy, app, receipt=False)  # the route's receipt off

    answer = await proxy.post("/pay", data=event("e5"), headers=JSON)

    assert answer.status == 200
    assert await answer.text() == "credited"  # not refused, nor failed on a missing header
    assert await app.credits("e5") == 1
