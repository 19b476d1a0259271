"""Passwords with URL-reserved characters, against a PostgreSQL that checks passwords.

The session's server trusts every connection, so a wrong password would pass there: this module
starts its own, with scram-sha-256 for every role but the superuser, and one role per password.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import asyncpg
import pytest
import yaml

from proxy import config, embedded, errors, logs
from proxy.config import values
from tests.helpers import FakeUpstream, MakeProxy, execute, run_cli

# openssl rand -base64's alphabet, the issue's p@ss#word, and the rest of the reserved set.
PASSWORDS = ["Xy7Qk9+LmN/a8bZ=", "Pq3@Sx9#Wd7", "Jk4:Uv8?Rt2=Gh", "Cb5%41Zz%zq", "Ne6+/=@#:?%Fy"]


@dataclass
class PasswordServer:
    superuser_dsn: str
    socket_query: str  # ?host=<the socket directory>
    roles: dict[str, str]  # password -> role

    def dsn(self, password: str, *, spelled: str | None = None) -> str:
        """A DSN for the role of ``password``, the password written as ``spelled`` (percent-
        encoded unless given; "" for none)."""
        written = quote(password, safe="") if spelled is None else spelled
        userinfo = f"{self.roles[password]}:{written}" if written else self.roles[password]
        return f"postgresql://{userinfo}@/postgres{self.socket_query}"


@pytest.fixture(scope="module")
def password_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PasswordServer]:
    server = embedded.EmbeddedPostgres(tmp_path_factory.mktemp("pw") / "data")
    dsn = server.start()
    roles = {password: f"pw_{uuid.uuid4().hex[:8]}" for password in PASSWORDS}
    try:
        (server.data_dir / "pg_hba.conf").write_text(
            "local all postgres trust\n"
            "local all all scram-sha-256\n"
            "host all all all scram-sha-256\n"
        )
        script = [
            f"CREATE ROLE {role} LOGIN PASSWORD '{password}'; "
            f"GRANT CREATE, USAGE ON SCHEMA public TO {role}"
            for password, role in roles.items()
        ]
        asyncio.run(execute(dsn, "; ".join([*script, "SELECT pg_reload_conf()"])))
        yield PasswordServer(dsn, "?" + dsn.partition("?")[2], roles)
    finally:
        server.stop()


def fragments(password: str) -> list[str]:
    """The pieces a parser splitting at reserved characters would print: runs of 3+ letters
    and digits, of the password and of its percent-encoded form."""
    return re.findall(r"[A-Za-z0-9]{3,}", password) + re.findall(
        r"[A-Za-z0-9]{3,}", quote(password, safe="")
    )


def assert_not_shown(password: str, text: str) -> None:
    assert password not in text
    assert quote(password, safe="") not in text
    for piece in fragments(password):
        assert piece not in text, piece


def config_file(
    tmp_path: Path, database: dict[str, Any], upstream: str = "http://app:3000"
) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream},
                "database": database,
                "routes": [{"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}],
            }
        )
    )
    return path


async def deduplicates(make_proxy: MakeProxy, upstream: FakeUpstream, **database: Any) -> None:
    """A proxy on ``database`` forwards an event once and answers its copy as a duplicate."""
    client = await make_proxy(database={"table": f"t_{uuid.uuid4().hex[:10]}", **database})
    first = await client.post("/webhooks/corvel", data=b'{"id": "evt_pw"}')
    second = await client.post("/webhooks/corvel", data=b'{"id": "evt_pw"}')
    assert first.status == 200
    assert second.headers["Dedup-Status"] == "duplicate"
    assert len(upstream.requests) == 1


async def test_the_server_refuses_a_wrong_password(password_server: PasswordServer) -> None:
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(password_server.dsn(PASSWORDS[0], spelled="wrong"))


@pytest.mark.parametrize("password", PASSWORDS)
async def test_a_percent_encoded_password_connects_through_the_proxy(
    password: str, password_server: PasswordServer, make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    await deduplicates(make_proxy, upstream, dsn=password_server.dsn(password))


@pytest.mark.parametrize("password", PASSWORDS)
def test_a_raw_reserved_character_is_a_config_error_without_the_password(
    password: str, password_server: PasswordServer
) -> None:
    raw = {
        "upstream": {"url": "http://app:3000"},
        "database": {"dsn": password_server.dsn(password, spelled=password)},
        "routes": [{"name": "a", "path": "/a", "event_id": "body:/id"}],
    }
    with pytest.raises(errors.ConfigError) as info:
        config.parse(raw)

    (problem,) = info.value.problems
    assert problem.startswith("database.dsn: ")
    assert "percent-encode" in problem
    assert "urllib.parse.quote(password, safe='')" in problem
    assert_not_shown(password, str(info.value))


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize("command", ["check", "serve"])
async def test_a_raw_password_makes_the_cli_exit_2_without_printing_it(
    password: str, command: str, password_server: PasswordServer, tmp_path: Path
) -> None:
    path = config_file(tmp_path, {"dsn": password_server.dsn(password, spelled=password)})

    code, out, err = await run_cli(command, "--config", str(path))

    assert code == 2
    assert "database.dsn: " in err
    assert "Traceback" not in err
    assert_not_shown(password, out + err)


@pytest.mark.parametrize("password", PASSWORDS)
async def test_check_masks_a_percent_encoded_password(
    password: str, password_server: PasswordServer, tmp_path: Path
) -> None:
    path = config_file(tmp_path, {"dsn": password_server.dsn(password)})

    code, out, err = await run_cli("check", "--config", str(path))

    assert code == 0, err
    assert f"postgresql://{password_server.roles[password]}:***@/postgres" in out
    assert_not_shown(password, out + err)


@pytest.mark.parametrize("password", PASSWORDS)
async def test_a_password_file_connects_through_the_proxy(
    password: str,
    password_server: PasswordServer,
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    tmp_path: Path,
) -> None:
    secret = tmp_path / "password"
    secret.write_text(password + "\n")  # as `kubectl create secret --from-file` may leave it

    await deduplicates(
        make_proxy,
        upstream,
        dsn=password_server.dsn(password, spelled=""),
        password_file=str(secret),
    )


async def test_check_with_a_password_file_never_prints_it(
    password_server: PasswordServer, tmp_path: Path
) -> None:
    password = PASSWORDS[-1]
    secret = tmp_path / "password"
    secret.write_text(password)
    database = {"dsn": password_server.dsn(password, spelled=""), "password_file": str(secret)}
    path = config_file(tmp_path, database)

    code, out, err = await run_cli("check", "--config", str(path))

    assert code == 0, err
    assert f"postgresql://{password_server.roles[password]}:***@/postgres" in out
    assert_not_shown(password, out + err)


async def test_pgpassword_is_read_when_the_dsn_has_no_password(
    password_server: PasswordServer,
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    password = PASSWORDS[1]
    monkeypatch.setenv("PGPASSWORD", password)

    await deduplicates(make_proxy, upstream, dsn=password_server.dsn(password, spelled=""))


async def test_a_pgpass_file_is_read_when_the_dsn_has_no_password(
    password_server: PasswordServer,
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # Not one with a ':': asyncpg (0.32) does not undo the passfile's "\:" escape, as libpq does.
    password = PASSWORDS[0]
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"*:*:*:{password_server.roles[password]}:{password}\n")
    passfile.chmod(0o600)  # libpq and asyncpg ignore a passfile others may read
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(passfile))

    await deduplicates(make_proxy, upstream, dsn=password_server.dsn(password, spelled=""))


@pytest.mark.parametrize(
    ("database", "problem"),
    [
        (
            {"dsn": "postgresql://u:pw@db/app", "password_file": "{file}"},
            "database.password_file: not with a password in database.dsn too",
        ),
        (
            {"dsn": "postgresql://u@db/app?password=pw", "password_file": "{file}"},
            "database.password_file: not with a password in database.dsn too",
        ),
        (
            {"dsn": "embedded", "password_file": "{file}"},
            "database.password_file: only with a postgresql:// dsn, not embedded",
        ),
        (
            {"dsn": "postgresql://u@db/app", "password_file": "{missing}"},
            "database.password_file: cannot read: [Errno 2] No such file or directory: '{missing}'",
        ),
        (
            {"dsn": "postgresql://u@db/app", "password_file": "{empty}"},
            "database.password_file: {empty} is empty",
        ),
        (
            {"dsn": "postgresql://u@db/app", "password_file": "{lines}"},
            "database.password_file: {lines} must hold the password on one line",
        ),
        (
            {"dsn": "postgresql://u@db/app?sslmode=verify_full"},
            "database.dsn: sslmode must be one of disable, allow, prefer, require, verify-ca, "
            "verify-full; got 'verify_full'",
        ),
    ],
)
def test_password_file_and_sslmode_problems(
    database: dict[str, str], problem: str, tmp_path: Path
) -> None:
    names = {
        "file": tmp_path / "password",
        "missing": tmp_path / "absent",
        "empty": tmp_path / "empty",
        "lines": tmp_path / "lines",
    }
    names["file"].write_text("pw\n")
    names["empty"].write_text("\n")
    names["lines"].write_text("pw\nmore\n")
    spelled = {f"{{{key}}}": str(path) for key, path in names.items()}

    def fill(text: str) -> str:
        for key, path in spelled.items():
            text = text.replace(key, path)
        return text

    raw = {
        "upstream": {"url": "http://app:3000"},
        "database": {key: fill(value) for key, value in database.items()},
        "routes": [{"name": "a", "path": "/a", "event_id": "body:/id"}],
    }
    with pytest.raises(errors.ConfigError) as info:
        config.parse(raw)

    assert info.value.problems == (fill(problem),)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://dedup:Xy7Qk9%2BLmN%2Fa8bZ%3D@db:5432/app",
        "postgresql://dedup:a:b@db/app",  # ':' may stand raw: the first one ends the user
        "postgresql://dedup@db1:5432,db2:5433/app?sslmode=verify-full&sslrootcert=/ca.pem",
        "postgresql://dedup@[::1]:5432/app",
        "postgresql://postgres:@/postgres?host=/run/postgresql",
        "postgresql://dedup@db/app?user=dedup@tenant",
    ],
)
def test_well_formed_dsns_are_kept_as_written(dsn: str) -> None:
    assert values.parse_dsn(dsn) == dsn


def test_the_password_file_goes_into_the_dsn_percent_encoded(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("p@ss#word/+=\r\n")
    raw = {
        "upstream": {"url": "http://app:3000"},
        "database": {"dsn": "postgresql://dedup@db:5432/app", "password_file": str(secret)},
        "routes": [{"name": "a", "path": "/a", "event_id": "body:/id"}],
    }

    cfg = config.parse(raw)

    assert cfg.database.dsn is not None
    assert cfg.database.dsn.reveal() == "postgresql://dedup:p%40ss%23word%2F%2B%3D@db:5432/app"
    assert "word" not in repr(cfg)
    assert logs.mask(f"x {cfg.database.dsn.reveal()} y") == "x postgresql://dedup:***@db:5432/app y"


def libpq(server: PasswordServer, password: str) -> str:
    """A libpq key=value DSN for ``password``'s role, its password single-quoted and escaped."""
    socket = server.socket_query.removeprefix("?host=")
    quoted = password.replace("\\", "\\\\").replace("'", "\\'")
    return f"host={socket} user={server.roles[password]} password='{quoted}' dbname=postgres"


@pytest.mark.parametrize("password", PASSWORDS)
async def test_a_libpq_key_value_dsn_connects_through_the_proxy(
    password: str, password_server: PasswordServer, make_proxy: MakeProxy, upstream: FakeUpstream
) -> None:
    await deduplicates(make_proxy, upstream, dsn=libpq(password_server, password))


@pytest.mark.parametrize("password", PASSWORDS)
async def test_check_masks_the_password_of_a_libpq_dsn(
    password: str, password_server: PasswordServer, tmp_path: Path
) -> None:
    path = config_file(tmp_path, {"dsn": libpq(password_server, password)})

    code, out, err = await run_cli("check", "--config", str(path))

    assert code == 0, err
    assert f"postgresql://{password_server.roles[password]}:***@/postgres?host=/" in out
    assert_not_shown(password, out + err)
    assert_not_shown(password, logs.mask(libpq(password_server, password)))


@pytest.mark.parametrize(
    ("dsn", "url"),
    [
        (
            "host=db port=5432 user=app password=s3cret dbname=events sslmode=require",
            "postgresql://app:s3cret@db:5432/events?sslmode=require",
        ),
        ("host = db user=app password='Zq9x''s' dbname=events", None),
        (
            "host=a,b port=5432 user=app dbname=events target_session_attrs=read-write",
            "postgresql://app@a:5432,b:5432/events?target_session_attrs=read-write",
        ),
        (
            "host=::1 user=app password='a b\\'c' dbname=events",
            "postgresql://app:a%20b%27c@[::1]/events",
        ),
    ],
)
def test_a_libpq_dsn_becomes_the_url_asyncpg_reads(dsn: str, url: str | None) -> None:
    if url is None:
        with pytest.raises(ValueError, match="libpq's key=value pairs") as refused:
            values.parse_dsn(dsn)
        assert "Zq9x" not in str(refused.value)
    else:
        assert values.parse_dsn(dsn) == url


def test_a_libpq_keyword_asyncpg_does_not_read_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"'connect_timeout' .*database\.connect_timeout"):
        values.parse_dsn("host=db user=app password=s3cret connect_timeout=10")


# A password holding an '@' after a '/' or a '?': asyncpg's host is the text between the first
# '@' and the '/' ('k9'), where a reader (and the masking) sees the one after the last '@'.
SPLIT_PASSWORDS = ["Xy7Q@k9/a8b=", "Xy7Q@k9?a8b=", "Xy7Q@k9/a8b=@Lm4"]


@pytest.mark.parametrize("password", SPLIT_PASSWORDS)
async def test_a_password_that_moves_the_host_is_refused_by_check_without_the_password(
    password: str, tmp_path: Path
) -> None:
    dsn = f"postgresql://dedup_proxy:{password}@127.0.0.1:55433/shop"
    path = config_file(tmp_path, {"dsn": dsn})

    code, out, err = await run_cli("check", "--config", str(path))

    assert code == 2
    assert "database.dsn: " in err
    assert "percent-encode" in err
    assert "Traceback" not in err
    assert_not_shown(password, out + err)
    assert "k9" not in out + err


@pytest.mark.parametrize("password", SPLIT_PASSWORDS)
def test_a_receipts_dsn_whose_password_moves_the_host_is_refused(password: str) -> None:
    with pytest.raises(ValueError, match="percent-encode") as info:
        values.parse_dsn(f"postgresql://dedup_proxy:{password}@db:5432/receipts")
    assert_not_shown(password, str(info.value))
