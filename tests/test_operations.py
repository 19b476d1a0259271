"""The operator commands: events list / forget, stats, schema, migrate — and the CLI around them."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import multidict
import pytest
import yaml

from proxy import config, database, errors, inbox_commands, operations, webhooks
from tests.helpers import (
    FakeUpstream,
    MakeProxy,
    claimed,
    execute,
    fetch,
    github_headers,
    github_route,
    run_cli,
)


@pytest.fixture
def config_file(tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url},
                "database": {"dsn": pg_dsn, "table": table},
                "routes": [
                    {"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"},
                    {"name": "gh", "path": "/gh", "preset": "github", "scope": "github-main"},
                ],
            }
        )
    )
    return path


async def test_forget_lets_a_manual_redelivery_through(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path, pg_dsn: str, table: str
) -> None:
    proxy = await make_proxy()
    for event_id in ("a", "b"):
        await proxy.post("/webhooks/corvel", data=f'{{"id": "{event_id}"}}'.encode())
    cfg = config.load(config_file)
    out = io.StringIO()

    code = await operations.forget(cfg, "corvel", ["a", "missing"], out)

    assert code == 1  # one of them was not there
    assert out.getvalue() == "forgotten: corvel a\nnot found: corvel missing\n"
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["b"]
    redelivered = await proxy.post("/webhooks/corvel", data=b'{"id": "a"}')
    assert "Dedup-Status" not in redelivered.headers
    assert len(upstream.requests) == 3


BACKSLASHED = "1:b\\"  # an ID ending in a backslash: LIKE's escape


async def test_forget_takes_the_id_as_the_provider_sent_it_on_a_bound_route(
    make_proxy: MakeProxy, upstream: FakeUpstream, tmp_path: Path, pg_dsn: str, table: str
) -> None:
    """On a GitHub route with verify the claim's ID is the event ID bound to the body: forget
    takes the ID as GitHub sent it (and as stored), lists the claims of an ID whose body
    differed rather than pick one, and reads no '%', '_' or '\\' in an ID as a pattern."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url},
                "database": {"dsn": pg_dsn, "table": table},
                "routes": [github_route()],
            }
        )
    )
    proxy = await make_proxy(routes=[github_route()])
    body, other = b'{"n": 1}', b'{"n": 2}'
    # GitHub's ID is the hook's and the delivery's, '%' escaped ("1:p%25"), as logged.
    sent = [
        ("d-1", body),
        ("x_", body),
        ("xy", body),
        ("p%", body),
        ("pq25", body),
        ("b\\", body),
        ("b", body),
        ("two", body),
        ("two", other),
    ]
    for delivery, content in sent:
        await proxy.post(
            "/webhooks/github", data=content, headers=github_headers(content, delivery)
        )

    def bound(event_id: str, content: bytes = body) -> str:
        return webhooks.bound(event_id, "", hashlib.sha256(content).digest())

    async def forget(*event_ids: str) -> tuple[int, str, str]:
        return await run_cli(
            "events", "forget", "--config", str(config_file), "--route", "github", *event_ids
        )

    code, out, err = await forget("1:d-1")
    assert (code, out, err) == (0, f"forgotten: github 1:d-1 (claim {bound('1:d-1')})\n", "")
    again = await proxy.post("/webhooks/github", data=body, headers=github_headers(body, "d-1"))
    assert "Dedup-Status" not in again.headers  # a manual redelivery goes through
    assert (await forget(bound("1:d-1")))[:2] == (0, f"forgotten: github {bound('1:d-1')}\n")

    code, out, _ = await forget("1:x_", "1:p%25", BACKSLASHED, "1:two", "1:nope")
    assert code == 1
    two = sorted([bound("1:two"), bound("1:two", other)])
    assert out.splitlines() == [
        f"forgotten: github 1:x_ (claim {bound('1:x_')})",
        f"forgotten: github 1:p%25 (claim {bound('1:p%25')})",
        f"forgotten: github {BACKSLASHED} (claim {bound(BACKSLASHED)})",
        f"ambiguous: github 1:two is 2 claims (bound to different bodies); give one of: "
        f"{two[0]} {two[1]}",
        "not found: github 1:nope (looked for 1:nope, 1:nope~<digest>)",
    ]
    left = [event_id for _, event_id, _ in await claimed(pg_dsn, table)]
    assert sorted(left) == sorted([bound("1:xy"), bound("1:pq25"), bound("1:b"), *two])


async def test_forget_neither_sees_nor_waits_on_a_claim_in_flight(
    make_proxy: MakeProxy, upstream: FakeUpstream, config_file: Path, pg_dsn: str, table: str
) -> None:
    upstream.gate = asyncio.Event()
    proxy = await make_proxy()
    held = asyncio.create_task(proxy.post("/webhooks/corvel", data=b'{"id": "busy"}'))
    await upstream.arrived.wait()
    out = io.StringIO()
    try:
        code = await asyncio.wait_for(
            operations.forget(config.load(config_file), "corvel", ["busy"], out), timeout=10
        )
    finally:
        upstream.gate.set()
    assert (code, out.getvalue()) == (1, "not found: corvel busy\n")
    assert (await held).status == 200
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["busy"]


async def test_forget_gives_up_on_a_locked_claim(
    make_proxy: MakeProxy, config_file: Path, pg_dsn: str, table: str
) -> None:
    proxy = await make_proxy()
    await proxy.post("/webhooks/corvel", data=b'{"id": "locked"}')
    cfg = config.load(config_file)
    quick = dataclasses.replace(cfg, claim_wait=0.3)
    holder = await asyncpg.connect(pg_dsn)
    try:
        async with holder.transaction():
            await holder.execute(f"SELECT 1 FROM \"{table}\" WHERE event_id = 'locked' FOR UPDATE")
            with pytest.raises(errors.StoreUnavailable, match="locked by another transaction"):
                await operations.forget(quick, "corvel", ["locked"], io.StringIO())
    finally:
        await holder.close()
    assert [row[1] for row in await claimed(pg_dsn, table)] == ["locked"]


async def test_events_list_and_stats(
    make_proxy: MakeProxy, config_file: Path, pg_dsn: str, table: str
) -> None:
    proxy = await make_proxy()
    for n in range(3):
        await proxy.post("/webhooks/corvel", data=f'{{"id": "e{n}", "type": "t{n}"}}'.encode())
    await execute(
        pg_dsn,
        f"UPDATE \"{table}\" SET received_at = now() - interval '2 hours' WHERE event_id = 'e0'",
    )
    cfg = config.load(config_file)

    recent = io.StringIO()
    await operations.list_events(cfg, "corvel", since=3600, limit=10, out=recent)
    everything = io.StringIO()
    await operations.list_events(cfg, "corvel", since=None, limit=2, out=everything)
    summary = io.StringIO()
    await operations.stats(cfg, summary)

    lines = recent.getvalue().splitlines()
    assert lines[0].split() == ["received_at", "scope", "event_id", "event_type", "state"]
    assert [line.split()[2:] for line in lines[1:-1]] == [["e2", "t2", "-"], ["e1", "t1", "-"]]
    assert lines[-1] == "2 claim(s) in scope corvel"
    assert [line.split()[2] for line in everything.getvalue().splitlines()[1:-1]] == ["e2", "e1"]
    assert everything.getvalue().splitlines()[-1] == (
        "showing the 2 newest of 3 claim(s) in scope corvel"
    )
    rows = [line.split() for line in summary.getvalue().splitlines()]
    assert rows[0] == [
        "route", "scope", "rows", "pending", "dead", "oldest", "newest", "retention",
    ]  # fmt: skip
    assert rows[1][:5] == ["corvel", "corvel", "3", "0", "0"]
    assert rows[2] == ["gh", "github-main", "0", "0", "0", "-", "-", "4d"]


async def test_schema_and_migrate_for_create_schema_false(
    config_file: Path, pg_dsn: str, table: str, proxy_config: Callable[..., config.Config]
) -> None:
    code, ddl, _ = await run_cli("schema", "--config", str(config_file))
    assert code == 0
    assert f'CREATE TABLE IF NOT EXISTS "{table}"' in ddl
    assert "PRIMARY KEY (scope, event_id)" in ddl

    code, out, _ = await run_cli("migrate", "--config", str(config_file))
    assert (code, out) == (0, f"schema applied: table {table}\n")
    columns = await fetch(
        pg_dsn, "SELECT column_name FROM information_schema.columns WHERE table_name = $1", table
    )
    assert {c["column_name"] for c in columns} == {
        "scope",
        "event_id",
        "event_type",
        "received_at",
        "body_sha256",
        "answer_status",
        "answer_headers",
        "answer_body",
        *database.inbox.COLUMNS,
    }
    code, _, _ = await run_cli("migrate", "--config", str(config_file))
    assert code == 0  # idempotent


async def test_cli_events_exit_codes_and_help(config_file: Path) -> None:
    code, out, err = await run_cli(
        "events", "list", "--route", "nope", "--config", str(config_file)
    )
    assert (code, err) == (
        2,
        "dedup-proxy events list: unknown route 'nope' (routes: corvel, gh)\n",
    )
    code, _, err = await run_cli(
        "events", "list", "--route", "corvel", "--limit", "-5", "-c", str(config_file)
    )
    assert code == 2  # a usage error, before any database
    assert "argument --limit: must be a whole number, 1 or more; got '-5'" in err

    code, out, err = await run_cli("events", "list", "--route", "corvel", "-c", str(config_file))
    assert code == 1
    assert "the claim table does not exist yet" in err
    assert (await run_cli("migrate", "-c", str(config_file)))[0] == 0

    code, out, err = await run_cli("events", "list", "--route", "corvel", "-c", str(config_file))
    assert (code, err) == (0, "")
    assert out.endswith("0 claim(s) in scope corvel\n")

    code, out, err = await run_cli(
        "events", "forget", "--route", "corvel", "x", "-c", str(config_file)
    )
    assert (code, out) == (1, "not found: corvel x\n")

    code, out, _ = await run_cli("--help")
    for command in ("serve", "check", "events", "stats", "schema", "migrate", "demo"):
        assert command in out
    code, out, _ = await run_cli("events", "forget", "--help")
    assert "forwarded to the app again" in out


async def test_ctrl_c_while_a_command_waits_exits_130_in_one_line(
    tmp_path: Path, upstream: FakeUpstream
) -> None:
    """Ctrl-C while a command waits for the database: said in a line, exit status 130."""
    connected = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()  # and never answers the client's startup message
        await reader.read()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url},
                "database": {
                    "dsn": f"postgresql://u@127.0.0.1:{port}/db",
                    "connect_timeout": "60s",
                },
                "routes": [{"name": "corvel", "path": "/c", "event_id": "body:/id"}],
            }
        )
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "proxy",
        "events",
        "list",
        "--route",
        "corvel",
        "-c",
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await asyncio.wait_for(connected.wait(), 30)
        process.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(process.communicate(), 30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        server.close()
    assert (process.returncode, out, err) == (130, b"", b"dedup-proxy events list: interrupted\n")


async def test_read_only_commands_need_no_signing_secrets(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> None:
    """stats, migrate and events run where the routes' signing secrets are not set (a migrate
    Job, a kubectl exec); serve and check, which verify or show what they verify with, refuse."""
    unset = "DEDUP_TEST_NEVER_SET_SECRET"
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url},
                "database": {"dsn": pg_dsn, "table": table},
                "routes": [
                    {
                        "name": "gh",
                        "path": "/gh",
                        "preset": "github",
                        "verify": {"secret": f"${{{unset}}}"},
                        "redeliver": {"schedule": ["1h"], "for": "1d"},
                    },
                    {
                        "name": "t",
                        "path": "/t/{tenant}",
                        "event_id": "body:/id",
                        "verify": {"scheme": "stripe", "tenant_secrets": {"acme": f"${{{unset}}}"}},
                    },
                ],
            }
        )
    )
    ran = {
        " ".join(command): await run_cli(*command, "--config", str(path))
        for command in (
            ("migrate",),
            ("stats",),
            ("events", "list", "--route", "gh"),
            ("events", "pending", "--route", "gh"),
        )
    }
    refused = [await run_cli(command, "--config", str(path)) for command in ("check", "serve")]

    assert {command: (code, err) for command, (code, _, err) in ran.items()} == {
        command: (0, "") for command in ran
    }
    for code, out, err in refused:
        assert (code, out) == (2, "")
        assert f"routes[0].verify.secret: environment variable {unset} is not set" in err
        assert f"routes[1].verify.tenant_secrets.acme: environment variable {unset} is not set" in (
            err
        )


def test_a_configuration_without_secrets_refuses_every_signature() -> None:
    """The verifiers of a configuration read without its secrets describe the scheme as with
    them (what the event ID's form depends on) and fail closed."""
    raw = {
        "upstream": {"url": "http://127.0.0.1:9"},
        "database": {"dsn": "embedded"},
        "routes": [
            {
                "name": "gh",
                "path": "/gh",
                "preset": "github",
                "verify": {"secret": "${DEDUP_TEST_NEVER_SET_SECRET}"},
            }
        ],
    }
    (verified,) = config.parse(raw, secrets=False).routes
    assert verified.verify is not None
    assert (verified.verify.scheme, verified.id_signed) == ("github", False)
    assert verified.verify.headers == ("X-Hub-Signature-256",)
    with pytest.raises(errors.SignatureInvalid, match="the signing secrets were not read"):
        verified.verify.verify(
            multidict.CIMultiDict({"X-Hub-Signature-256": "sha256=00"}), b"{}", 0.0
        )


async def test_cli_reports_an_unreachable_database(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "upstream: {url: 'http://127.0.0.1:9'}\n"
        "database: {dsn: 'postgresql://nobody@127.0.0.1:1/none', connect_timeout: 2s}\n"
        "routes: [{name: a, path: /a, event_id: 'body:/id'}]\n"
    )
    code, _, err = await run_cli("stats", "--config", str(path))
    assert code == 1
    assert err.startswith("dedup-proxy stats: cannot connect to PostgreSQL")
    assert "Traceback" not in err


def test_table_formatting() -> None:
    out = io.StringIO()
    rows: list[tuple[Any, ...]] = [("a", None, 1), ("long value", "x", 22)]
    operations.table(rows, ("h1", "h2", "h3"), out)
    assert out.getvalue().splitlines() == [
        "h1          h2  h3",
        "a               1",
        "long value  x   22",
    ]
    out = io.StringIO()
    operations.table(rows, ("h1", "h2", "h3"), out, width=12, shrink=("h1",))
    assert out.getvalue().splitlines() == [  # 18 columns wide: h1 cut by 6, its cell with "…"
        "h1    h2  h3",
        "a         1",
        "lon…  x   22",
    ]


async def test_events_of_a_route_scoped_by_its_path(
    make_proxy: MakeProxy, tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> None:
    routes = [{"name": "t", "path": "/hooks/{tenant}", "event_id": "body:/id"}]
    proxy = await make_proxy(routes=routes)
    for tenant in ("acme", "globex"):
        assert (await proxy.post(f"/hooks/{tenant}", data=b'{"id": "e1"}')).status == 200
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url},
                "database": {"dsn": pg_dsn, "table": table},
                "routes": routes,
            }
        )
    )

    listed = await run_cli("events", "list", "--route", "t", "--config", str(path))
    unscoped = await run_cli("events", "forget", "--route", "t", "e1", "--config", str(path))
    forgotten = await run_cli(
        "events", "forget", "--route", "t", "--scope", "t/acme", "e1", "--config", str(path)
    )
    stats = await run_cli("stats", "--config", str(path))

    assert sorted(line.split()[1] for line in listed[1].splitlines()[1:-1]) == [
        "t/acme",
        "t/globex",
    ]
    assert unscoped[0] == 2
    assert "give --scope" in unscoped[2]
    assert (forgotten[0], forgotten[1]) == (0, "forgotten: t/acme e1\n")
    assert stats[1].splitlines()[1].split()[:3] == ["t", "t/…", "1"]
    assert [row[:2] for row in await claimed(pg_dsn, table)] == [("t/globex", "e1")]


# An OSC 52 clipboard write, a screen clear, a right-to-left override, a C1 CSI and DEL.
HOSTILE = "deploy\x1b]52;c;Y3VybCBldmlsfHNo\x07\x1b[2J\u202egnp.exe\x9b31m\x7f"


async def test_a_pause_s_words_typed_in_the_console_reach_the_terminal_escaped(
    make_proxy: MakeProxy, config_file: Path
) -> None:
    await make_proxy()
    cfg = config.load(config_file)
    async with operations.open_store(cfg) as store:  # as the console pauses a route
        said = await operations.pause_route(
            store, cfg, "corvel", for_=None, note=HOSTILE, by=f"ops{HOSTILE}"
        )
    summary = io.StringIO()
    await operations.stats(cfg, summary)
    paused = io.StringIO()
    await inbox_commands.pause(cfg, "gh", note=HOSTILE, by="ops", out=paused)

    for shown in ("\n".join(said), summary.getvalue(), paused.getvalue()):
        assert "deploy\\u001b]52;c;" in shown
        for control in ("\x1b", "\x07", "\u202e", "\x9b", "\x7f"):
            assert control not in shown


def test_a_table_escapes_what_came_from_outside() -> None:
    out = io.StringIO()
    operations.table([(HOSTILE, 1)], ("from outside", "n"), out)
    assert out.getvalue().splitlines()[1].startswith("deploy\\u001b]52;c;")


def receipted(path: Path, pg_dsn: str, table: str, url: str, receipts_dsn: str) -> Path:
    """A configuration at ``path`` whose route ``pay`` keeps its receipts in the claim
    database, and ``app`` in the database ``receipts_dsn`` names."""
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": url},
                "database": {"dsn": pg_dsn, "table": table},
                "routes": [
                    {"name": "pay", "path": "/pay", "event_id": "body:/id", "receipt": True},
                    {"name": "app", "path": "/app", "event_id": "body:/id",
                     "receipt": {"dsn": receipts_dsn}},
                ],
            }
        )
    )  # fmt: skip
    return path


async def test_schema_prints_the_receipts_ddl_and_migrate_names_the_database_that_failed(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> None:
    nowhere = "postgresql://app:pw@127.0.0.1:9/ledger"  # nothing listens on port 9
    path = receipted(tmp_path / "config.yaml", pg_dsn, table, upstream.url, nowhere)

    code, ddl, _ = await run_cli("schema", "--config", str(path))
    code_alone, alone, _ = await run_cli("schema", "--receipts")
    code_migrate, out, err = await run_cli("migrate", "--config", str(path))

    assert (code, code_alone) == (0, 0)
    # Before: the claim table's DDL alone.
    assert f'CREATE TABLE IF NOT EXISTS "{table}"' in ddl
    assert "-- The receipts (route pay: receipt), in the claim database:" in ddl
    assert "CREATE TABLE IF NOT EXISTS dedup_receipts" in ddl
    assert "-- Route app keeps its receipts in its receipt.dsn" in ddl
    assert "CREATE OR REPLACE FUNCTION dedup_receipt(receipt text)" in alone
    assert "--   GRANT SELECT, INSERT, DELETE ON dedup_receipts TO <proxy_role>;" in alone
    assert table not in alone
    assert code_migrate == 1
    assert out.startswith(f"schema applied: table {table}\n")
    # Before: "dedup-proxy migrate: cannot connect to the receipts' database: …", not which.
    assert err.startswith(
        "dedup-proxy migrate: receipts in postgresql://app:***@127.0.0.1:9/ledger (route app): "
    ), err
    assert "pw" not in err


async def test_commands_that_touch_no_receipt_need_no_receipt_dsn_variable(
    tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> None:
    unset = "DEDUP_TEST_NEVER_SET_APP_DATABASE"
    path = receipted(tmp_path / "config.yaml", pg_dsn, table, upstream.url, f"${{{unset}}}")
    await execute(pg_dsn, database.schema_sql(table))

    ran = {
        " ".join(command): await run_cli(*command, "--config", str(path))
        for command in (
            ("stats",),
            ("schema",),
            ("events", "list", "--route", "pay"),
            ("events", "pending"),
        )
    }
    migrate = await run_cli("migrate", "--config", str(path))

    # Before: each exit 2, "routes[1].receipt.dsn: environment variable … is not set".
    assert {command: (code, err) for command, (code, _, err) in ran.items()} == {
        command: (0, "") for command in ran
    }
    assert migrate[0] == 2  # migrate makes the receipts' table there: it needs it
    assert f"routes[1].receipt.dsn: environment variable {unset} is not set" in migrate[2]
