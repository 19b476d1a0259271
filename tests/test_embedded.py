"""The embedded PostgreSQL is tidy: whoever starts it stops it, an orphan included."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import run_python, wait_until

ORPHAN = """
import os, signal, sys
from collections.abc import Iterator
from pathlib import Path
from proxy import embedded
embedded.EmbeddedPostgres(Path(sys.argv[1])).start()
os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a kubelet would: no clean-up
"""


def running(data_dir: Path) -> int | None:
    """The PID of the postmaster on ``data_dir`` if it is alive (read here, not through the
    module under test)."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


async def run(*args: str, cwd: Path | None = None) -> tuple[int, str]:
    code, out, err = await run_python(*args, within=120, cwd=cwd)
    return code, out + err


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "pgdata"
    yield folder
    if pid := running(folder):  # what a failing test left running
        os.kill(pid, signal.SIGQUIT)


async def test_the_operator_commands_stop_the_server_they_start_and_adopt_an_orphan(
    tmp_path: Path, data_dir: Path
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "upstream: {url: 'http://127.0.0.1:9'}\n"
        f"database: {{dsn: embedded, data_dir: '{data_dir}'}}\n"
        "routes: [{name: a, path: /a, event_id: 'body:/id'}]\n"
    )
    code, _ = await run("-c", ORPHAN, str(data_dir))
    assert code == -signal.SIGKILL
    orphan = running(data_dir)
    assert orphan is not None  # a server nobody will stop

    migrated = await run("-m", "proxy", "migrate", "--config", str(path))
    assert migrated[0] == 0, migrated[1]
    assert running(data_dir) is None

    for command in (["stats"], ["events", "list", "--route", "a"]):
        code, out = await run("-m", "proxy", *command, "--config", str(path))
        assert code == 0, out
        assert running(data_dir) is None, command

    async def stopped() -> bool:
        try:
            os.kill(orphan, 0)
        except ProcessLookupError:
            return True
        return False

    await wait_until(stopped, "the orphan's postmaster to exit")


def embedded_config(folder: Path, data_dir: str = ".dedup-proxy/pgdata") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.yaml"
    path.write_text(
        "upstream: {url: 'http://127.0.0.1:9'}\n"
        f"database: {{dsn: embedded, data_dir: '{data_dir}'}}\n"
        "routes: [{name: a, path: /a, event_id: 'body:/id'}]\n"
    )
    return path


async def test_one_configuration_is_one_embedded_server_whichever_directory_a_command_runs_in(
    tmp_path: Path,
) -> None:
    """A relative data_dir is read against the configuration file's directory: ``migrate`` in
    one directory and ``check`` and ``events`` in others meet one cluster, named absolute."""
    path = embedded_config(tmp_path / "etc")
    placed = tmp_path / "etc" / ".dedup-proxy" / "pgdata"
    elsewhere = [tmp_path / "home", tmp_path / "var"]
    for folder in elsewhere:
        folder.mkdir()
    try:
        migrated = await run("-m", "proxy", "migrate", "--config", str(path), cwd=elsewhere[0])
        assert migrated[0] == 0, migrated[1]
        assert (placed / "PG_VERSION").is_file()
        code, out = await run("-m", "proxy", "check", "--config", str(path), cwd=elsewhere[1])
        assert code == 0, out
        assert f"embedded (data in {placed})" in out
        code, out = await run(
            "-m", "proxy", "events", "list", "--route", "a", "--config", str(path), cwd=tmp_path
        )
        assert code == 0, out
        assert "migrate" not in out  # the table migrate made is found
        assert not any((folder / ".dedup-proxy").exists() for folder in [*elsewhere, tmp_path])
    finally:
        if pid := running(placed):
            os.kill(pid, signal.SIGQUIT)


async def test_a_cluster_an_earlier_release_left_in_the_working_directory_is_not_replaced(
    tmp_path: Path,
) -> None:
    """Up to 0.2.0 a relative data_dir was read against the working directory: a cluster
    there and none beside the configuration is refused, never an empty one started beside it."""
    path = embedded_config(tmp_path / "etc")
    work = tmp_path / "work"
    left = work / ".dedup-proxy" / "pgdata"
    left.mkdir(parents=True)
    (left / "PG_VERSION").write_text("18\n")  # all that marks a cluster's directory
    code, out = await run(
        "-m", "proxy", "events", "list", "--route", "a", "--config", str(path), cwd=work
    )
    assert code != 0
    assert str(left) in out
    assert str(tmp_path / "etc" / ".dedup-proxy" / "pgdata") in out
    assert not (tmp_path / "etc" / ".dedup-proxy").exists()
    assert "Traceback" not in out
