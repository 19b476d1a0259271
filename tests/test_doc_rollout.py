"""docs/first-rollout.md, run against a real PostgreSQL with the shipped Kubernetes configuration.

Its SQL blocks are run in order as the role each one names in its first line (``-- as an
administrator``: the suite's own role; ``-- as dedup_migrate``), the roles and the schema renamed
to names of this test's own; then ``dedup-proxy migrate`` as the owner and ``dedup-proxy check
--database`` as the proxy's role, each with the role in ``DATABASE_USER`` and its password in
the file ``DATABASE_PASSWORD_FILE`` names, as deploy/kubernetes/ runs them. The page's grants
are then exactly enough: the check passes, and the proxy's role can create nothing.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.helpers import execute, fetch, run_cli
from tests.roles import as_role

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "first-rollout.md"
CONFIG = ROOT / "deploy" / "kubernetes" / "config" / "config.yaml"
SIGNING = {"STRIPE_WEBHOOK_SECRET": "whsec_dGVzdA==", "GITHUB_WEBHOOK_SECRET": "github-secret"}


def sql_blocks(section: str) -> list[tuple[str, str]]:
    """The SQL blocks of one ``##`` section of the page: (who runs it, the SQL)."""
    text = PAGE.read_text(encoding="utf-8")
    found = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"docs/first-rollout.md has no section {section!r}"
    blocks = re.findall(r"^```sql\n(.*?)^```", found[1], re.M | re.S)
    runs = []
    for block in blocks:
        who = re.match(r"-- as (an administrator|dedup_migrate)\b", block)
        assert who, f"an SQL block that does not say who runs it:\n{block}"
        runs.append((who[1], block))
    return runs


class Names:
    """The page's roles and schema, renamed for this test, and their passwords."""

    def __init__(self) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.owner, self.proxy = f"dedup_migrate_{suffix}", f"dedup_proxy_{suffix}"
        self.schema = f"dedup_{suffix}"
        self.passwords = {self.owner: f"owner-{suffix}", self.proxy: f"proxy-{suffix}"}

    def sql(self, block: str) -> str:
        block = re.sub(r"\bdedup_migrate\b", self.owner, block)
        block = re.sub(r"\bdedup_proxy\b", self.proxy, block)
        block = re.sub(r"\bdedup\b", self.schema, block)
        # The page's two CREATE ROLE lines, in this order, each with the '…' placeholder.
        for role in (self.owner, self.proxy):
            block = re.sub(
                rf"(CREATE ROLE {role} LOGIN PASSWORD )'…'", rf"\1'{self.passwords[role]}'", block
            )
        assert "…" not in block, block
        return block


@pytest.fixture
async def names(pg_dsn: str) -> AsyncIterator[Names]:
    made = Names()
    yield made
    await execute(
        pg_dsn,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE usename IN ('{made.owner}', '{made.proxy}'); "
        # The schema's owner drops what is in it, the owner's table and default privileges too.
        f"DROP SCHEMA IF EXISTS {made.schema} CASCADE; "
        f"DROP ROLE IF EXISTS {made.proxy}; DROP ROLE IF EXISTS {made.owner}",
    )


def shipped_config(pg_dsn: str, names: Names, tmp_path: Path) -> Path:
    """deploy/kubernetes/config/config.yaml pointed at this suite's server and test schema."""
    raw = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    database = raw["database"]
    server = urlsplit(pg_dsn)
    user, _, place = database["dsn"].partition("@")
    assert user == "postgresql://${DATABASE_USER}", database["dsn"]
    assert place.split("/")[0] == "postgres.example.internal:5432", database["dsn"]
    host = server.netloc.rpartition("@")[2]  # empty with a socket directory in the query
    database["dsn"] = f"{user}@{host}{server.path}" + (f"?{server.query}" if server.query else "")
    assert database["table"].startswith("dedup."), database["table"]
    database["table"] = database["table"].replace("dedup.", f"{names.schema}.", 1)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def role_env(names: Names, role: str, tmp_path: Path) -> dict[str, str]:
    """What a pod gives the configuration: its role, and its password as a file."""
    password = tmp_path / f"{role}.password"
    password.write_text(names.passwords[role] + "\n", encoding="utf-8")
    return {"DATABASE_USER": role, "DATABASE_PASSWORD_FILE": str(password), **SIGNING}


async def test_the_first_rollouts_grants_are_what_migrate_and_the_proxys_role_need(
    pg_dsn: str, names: Names, tmp_path: Path
) -> None:
    def dsn(who: str) -> str:
        if who == "an administrator":
            return pg_dsn
        return as_role(pg_dsn, names.owner, names.passwords[names.owner])

    before = sql_blocks("1. The database and its roles")
    assert [who for who, _ in before] == ["an administrator", "dedup_migrate"]
    for who, block in before:
        await execute(dsn(who), names.sql(block))
    config_file = shipped_config(pg_dsn, names, tmp_path)

    code, out, err = await run_cli(
        "migrate", "--config", str(config_file), env=role_env(names, names.owner, tmp_path)
    )
    assert code == 0, out + err
    for who, block in sql_blocks("5. Migrate, then check the proxy's role"):
        await execute(dsn(who), names.sql(block))
    code, out, err = await run_cli(
        "check",
        "--database",
        "--config",
        str(config_file),
        env=role_env(names, names.proxy, tmp_path),
    )

    assert code == 0, out + err
    assert re.search(rf"^ok +connect: .* as {names.proxy}\b", out, re.M), out
    assert re.search(r"^ok +privileges", out, re.M), out
    (row,) = await fetch(
        pg_dsn,
        "SELECT pg_get_userbyid(c.relowner) AS owner, "
        "has_schema_privilege($1, n.oid, 'CREATE') AS proxy_creates "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = $2 AND c.relname = 'processed_events'",
        names.proxy,
        names.schema,
    )
    assert row["owner"] == names.owner
    assert row["proxy_creates"] is False
