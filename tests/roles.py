"""PostgreSQL roles with exactly the grants a test names, for the least-privilege tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import quote, urlsplit, urlunsplit

from tests.helpers import execute

# What docs/deployment.md grants the proxy's role on the claim table.
DOCUMENTED = "SELECT, INSERT, DELETE"
ANSWERS = "UPDATE (answer_status, answer_headers, answer_body)"
INBOX = (
    "UPDATE (inbox_state, inbox_request, inbox_body, inbox_attempts, inbox_failures, inbox_due, "
    "inbox_until, inbox_changed, inbox_size)"
)


def as_role(dsn: str, role: str, password: str) -> str:
    """``dsn`` with another user and password."""
    parts = urlsplit(dsn)
    host = parts.hostname or ""
    netloc = f"{quote(role)}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


@asynccontextmanager
async def limited_role(
    dsn: str, table: str, *grants: str, password: str = "s3cret-pw", counts: bool = False
) -> AsyncIterator[tuple[str, str]]:
    """A login role holding ``grants`` on ``table`` (which must exist; ``schema.name`` or a
    name on search_path) and nothing else: (its name, a DSN that connects as it); with
    ``counts``, SELECT on the kept rows' counts beside it too (a redelivering route's). Dropped
    afterwards, with any USAGE a test gave it on the table's schema."""
    role = f"dedup_{uuid.uuid4().hex[:10]}"
    schema, _, name = table.rpartition(".")
    quoted = f'"{schema}"."{name}"' if schema else f'"{table}"'
    kept = f'{quoted[:-1]}_kept"'
    script = [f"CREATE ROLE {role} LOGIN PASSWORD '{password}'"]
    script += [f"GRANT {grant} ON {quoted} TO {role}" for grant in grants]
    script += [f"GRANT SELECT ON {kept} TO {role}"] if counts else []
    await execute(dsn, "; ".join(script))
    try:
        yield role, as_role(dsn, role, password)
    finally:
        await execute(
            dsn,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            # REVOKE rather than DROP OWNED, which PostgreSQL 15 allows only a member of the
            # role (CI's role there has CREATEROLE, not superuser).
            f"WHERE usename = '{role}'; REVOKE ALL ON {quoted} FROM {role}; "
            + (f"REVOKE ALL ON {kept} FROM {role}; " if counts else "")
            + (f'REVOKE ALL ON SCHEMA "{schema}" FROM {role}; ' if schema else "")
            + f"DROP ROLE {role}",
        )
