"""A real PgBouncer (Debian's ``pgbouncer``) in transaction pooling mode, in front of a test
database: every setting at its default except the pooling mode, the listener and the login, unless
the caller adds settings (``documented_settings``: the block docs/deployment.md recommends)."""

from __future__ import annotations

import configparser
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from tests.helpers import free_port

INSTALL_HINT = "PgBouncer is not installed: apt-get install pgbouncer"
DEPLOYMENT = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"


def documented_settings(page: Path = DEPLOYMENT) -> dict[str, str]:
    """The settings of the one ``ini`` block in ``page`` that opens with ``[pgbouncer]``: what
    docs/deployment.md recommends, read from the page so that the example is what the tests run."""
    blocks = re.findall(r"^```ini\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)
    ours = [block for block in blocks if block.lstrip().startswith("[pgbouncer]")]
    if len(ours) != 1:
        raise RuntimeError(f"{page.name}: {len(ours)} ini blocks open with [pgbouncer], not one")
    parser = configparser.ConfigParser(interpolation=None, comment_prefixes=(";", "#"))
    parser.read_string(ours[0])
    return dict(parser["pgbouncer"])


def _target(dsn: str) -> tuple[str, str]:
    """(the [databases] entry that reaches ``dsn``, the database name)."""
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or "127.0.0.1"])[0]
    dbname = unquote(parts.path.lstrip("/")) or "postgres"
    fields = {
        "host": host,
        "port": str(parts.port or 5432),
        "user": unquote(parts.username or "postgres"),
        "password": unquote(parts.password or ""),
        "dbname": dbname,
    }
    return " ".join(f"{k}={v}" for k, v in fields.items() if v), dbname


def _run_as(dsn: str) -> list[str]:
    """PgBouncer refuses to run as root: then run it as the owner of the server's socket
    directory (the embedded server's is private to its user), or as nobody over TCP."""
    if os.geteuid() != 0:
        return []
    host = parse_qs(urlsplit(dsn).query).get("host", [""])[0]
    user = pwd.getpwuid(os.stat(host).st_uid).pw_name if host.startswith("/") else "nobody"
    return ["-u", user]


@contextmanager
def pgbouncer(dsn: str, settings: Mapping[str, str] | None = None) -> Iterator[str]:
    """Run PgBouncer in front of ``dsn``; yield the DSN that goes through it.

    ``settings`` go into its ``[pgbouncer]`` section (``pool_mode`` among them, if given); the
    listener and the login stay the harness's own."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        raise RuntimeError(INSTALL_HINT)
    entry, dbname = _target(dsn)
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    folder.chmod(0o755)
    ini = folder / "pgbouncer.ini"
    fields = {
        "pool_mode": "transaction",
        **(settings or {}),
        "listen_addr": "127.0.0.1",
        "listen_port": str(port),
        "unix_socket_dir": "",
        "auth_type": "any",
    }
    lines = "".join(f"{key} = {value}\n" for key, value in fields.items())
    ini.write_text(f"[databases]\n{dbname} = {entry}\n\n[pgbouncer]\n{lines}")
    ini.chmod(0o644)
    log = open(folder / "log", "wb")  # noqa: SIM115 (the process writes it until stopped)
    process = subprocess.Popen([binary, *_run_as(dsn), str(ini)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 10
        while not _accepts(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PgBouncer did not start: {(folder / 'log').read_text()}")
            time.sleep(0.05)
        yield f"postgresql://dedup@127.0.0.1:{port}/{dbname}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
