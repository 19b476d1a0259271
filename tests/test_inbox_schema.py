"""Upgrading to the inbox: a claim table from before it keeps working for routes that do not
redeliver; a route that does needs the new columns, which ``migrate`` (or create_schema) adds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from proxy import config, errors
from proxy.database import sql
from tests.helpers import MakeProxy, execute, fetch, run_cli, start_up, sweeper_of

PLAIN = {"name": "hooks", "path": "/hooks", "event_id": "body:/id"}
KEPT = {**PLAIN, "redeliver": {"schedule": ["1h"], "for": "1d"}}


async def old_table(dsn: str, table: str) -> None:
    """The claim table as the release before the inbox made it."""
    await execute(
        dsn,
        f'CREATE TABLE "{table}" (scope text NOT NULL, event_id text NOT NULL, event_type text, '
        "received_at timestamptz NOT NULL DEFAULT now(), body_sha256 bytea, "
        "answer_status smallint, answer_headers jsonb, answer_body bytea, "
        f'PRIMARY KEY (scope, event_id)); CREATE INDEX "{table}_received_at_idx" '
        f'ON "{table}" (received_at)',
    )


async def test_an_old_table_serves_routes_that_do_not_redeliver_and_sweeps_as_before(
    make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    await old_table(pg_dsn, table)
    proxy = await make_proxy(routes=[PLAIN], database={"create_schema": False})
    assert (await proxy.post("/hooks", data=b'{"id": "a"}')).status == 200
    assert (await proxy.post("/hooks", data=b'{"id": "a"}')).headers["Dedup-Status"] == "duplicate"
    await execute(pg_dsn, f"UPDATE \"{table}\" SET received_at = now() - interval '40 days'")
    assert await sweeper_of(proxy).sweep() == {"hooks": 1}


async def test_a_redelivering_route_needs_the_inbox_columns_which_migrate_adds(
    proxy_config: Callable[..., config.Config], tmp_path: Path, pg_dsn: str, table: str
) -> None:
    await old_table(pg_dsn, table)
    cfg = proxy_config(routes=[KEPT], database={"create_schema": False})
    with pytest.raises(errors.StoreUnavailable) as refused:
        await start_up(cfg)
    assert "lacks the inbox columns (redeliver) and the inbox's index (redeliver)" in str(
        refused.value
    )
    assert "run 'dedup-proxy migrate'" in str(refused.value)

    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": "http://127.0.0.1:9"},
                "routes": [KEPT],
                "database": {"dsn": pg_dsn, "table": table, "create_schema": False},
            }
        )
    )
    code, out, err = await run_cli("migrate", "--config", str(config_file))
    assert (code, out) == (0, f"schema applied: table {table}\n"), err
    await start_up(cfg)
    columns = await fetch(
        pg_dsn, "SELECT column_name FROM information_schema.columns WHERE table_name = $1", table
    )
    assert "inbox_state" in {c["column_name"] for c in columns}


async def release_0_2_0_table(dsn: str, table: str) -> None:
    """The claim table as 0.2.0 made it: the inbox's columns but inbox_size."""
    await old_table(dsn, table)
    types = {name: kind for name, kind in sql.INBOX_TYPES.items() if name != "inbox_size"}
    columns = ", ".join(f"ADD COLUMN {name} {kind}" for name, kind in types.items())
    await execute(
        dsn,
        f'ALTER TABLE "{table}" {columns}; CREATE INDEX "{table}_inbox_idx" ON "{table}" '
        "(inbox_state, inbox_due) WHERE inbox_state IN ('pending', 'dead')",
    )


async def test_a_redelivering_route_on_a_0_2_0_table_needs_inbox_size_which_migrate_adds(
    proxy_config: Callable[..., config.Config], tmp_path: Path, pg_dsn: str, table: str
) -> None:
    await release_0_2_0_table(pg_dsn, table)
    await start_up(proxy_config(routes=[PLAIN], database={"create_schema": False}))
    cfg = proxy_config(routes=[KEPT], database={"create_schema": False})
    with pytest.raises(errors.StoreUnavailable) as refused:
        await start_up(cfg)
    assert str(refused.value) == (
        f"table {table}: lacks column inbox_size (redeliver's cap), and database.create_schema "
        "is false; run 'dedup-proxy migrate' (or apply 'dedup-proxy schema') or set "
        "create_schema: true"
    )

    config_file = tmp_path / "config.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": "http://127.0.0.1:9"},
                "routes": [KEPT],
                "database": {"dsn": pg_dsn, "table": table, "create_schema": False},
            }
        )
    )
    code, out, err = await run_cli("migrate", "--config", str(config_file))
    assert (code, out) == (0, f"schema applied: table {table}\n"), err
    await start_up(cfg)


async def test_create_schema_adds_inbox_size_to_a_0_2_0_table_at_start_up(
    proxy_config: Callable[..., config.Config], pg_dsn: str, table: str
) -> None:
    await release_0_2_0_table(pg_dsn, table)
    await start_up(proxy_config(routes=[KEPT]))
    columns = await fetch(
        pg_dsn, "SELECT column_name FROM information_schema.columns WHERE table_name = $1", table
    )
    assert "inbox_size" in {c["column_name"] for c in columns}


async def test_create_schema_adds_the_inbox_columns_at_start_up(
    proxy_config: Callable[..., config.Config], pg_dsn: str, table: str
) -> None:
    await old_table(pg_dsn, table)
    await start_up(proxy_config(routes=[KEPT]))
    indexes = await fetch(pg_dsn, "SELECT indexname FROM pg_indexes WHERE tablename = $1", table)
    assert f"{table}_inbox_idx" in {row["indexname"] for row in indexes}


async def test_a_replica_started_on_an_old_table_spares_kept_rows_once_migrated(
    make_proxy: MakeProxy, pg_dsn: str, table: str
) -> None:
    await old_table(pg_dsn, table)
    proxy = await make_proxy(routes=[PLAIN], database={"create_schema": False})
    await execute(pg_dsn, sql.for_table(table).schema)  # another replica's migrate
    # ... and its route kept a dead delivery, long ago.
    await execute(
        pg_dsn,
        f'INSERT INTO "{table}" (scope, event_id, received_at, inbox_state, inbox_body, '
        "inbox_changed) VALUES ('hooks', 'kept', now() - interval '40 days', 'dead', 'B', "
        "now() - interval '1 day')",
    )

    assert await sweeper_of(proxy).sweep() == {"hooks": 0}
    assert [row["event_id"] for row in await fetch(pg_dsn, f'SELECT event_id FROM "{table}"')] == [
        "kept"
    ]
