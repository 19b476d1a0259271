"""A pg_auto_failover formation on 127.0.0.1: a monitor and two PostgreSQL 15 nodes, ``a`` the
primary and ``b`` its synchronous standby, each run by its own ``pg_autoctl`` service. Unlike
``tests/replication.py``, nobody here promotes anything: once the primary is killed, the
monitor notices and promotes the standby by itself, as it would in production.

Debian's ``postgresql-15-auto-failover`` (and the ``pg-auto-failover-cli`` it pulls in) must be
installed. ``pg_autoctl`` runs as the ``postgres`` system user when the tests run as root
(PostgreSQL refuses root), with its configuration, state and PID files under the formation's
folder (``XDG_*``), never in a home directory. Everything listens on 127.0.0.1 only, so the
nodes trust each other and the superuser (``--auth trust --no-ssl``); the proxy's role ``dedup``
alone logs in with a password (``scram-sha-256``), owns the database ``dedup`` and is no
superuser.

The monitor's health checks are tuned (``MONITOR_SETTINGS``) so that a failover takes seconds
rather than the default ~50 s: the defaults wait 20 s for a silent node and then 30 s for the
dead primary to demote itself. The keepers' ``network_partition_timeout`` comes down with them:
a primary cut off from the monitor and its standby must stop itself before the monitor gives up
waiting for it, or a partition would leave two primaries.

Every method blocks (for seconds at most, each wait bounded); from a coroutine, call them
through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from tests.helpers import free_port
from tests.replication import as_user, poll_until

BIN = Path("/usr/lib/postgresql/15/bin")
PG_AUTOCTL = Path("/usr/bin/pg_autoctl")
EXTENSION = Path("/usr/lib/postgresql/15/lib/pgautofailover.so")  # the monitor's
INSTALL_HINT = (
    "pg_auto_failover is not installed: apt-get install postgresql-15-auto-failover"
    " (it brings pg_autoctl, package pg-auto-failover-cli)"
)
SYSTEM_USER = "postgres"
# Where Debian's PostgreSQL puts its unix sockets (pg_ctlcluster, or postgresql-common's
# tmpfiles, make it). Not a private folder as in replication.py: ``pg_autoctl create`` starts
# each server before its unix_socket_directories could be set.
SOCKETS = Path("/var/run/postgresql")
ROLE = "dedup"
DATABASE = "dedup"
PASSWORD = "dedup-auto-failover"
READY_WITHIN = 60.0  # a node created, registered and in its state; the formation in sync
STOP_WITHIN = 15.0

# The monitor's side of a failover (milliseconds). A primary is unhealthy once it has not
# reported for node_considered_unhealthy_timeout and a health check (with its retries) failed;
# the standby is promoted primary_demote_timeout after the monitor asked the primary to demote.
MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": 1000,
    "pgautofailover.health_check_timeout": 1000,
    "pgautofailover.health_check_max_retries": 1,
    "pgautofailover.health_check_retry_delay": 500,
    "pgautofailover.node_considered_unhealthy_timeout": 2000,
    "pgautofailover.primary_demote_timeout": 4000,
}
# The keepers' side (seconds): below unhealthy + demote timeouts, so an isolated primary stops
# before its standby takes writes.
KEEPER_SETTINGS = {"timeout.network_partition_timeout": 3}
WRITABLE = frozenset({"single", "wait_primary", "primary"})


def _reach(folder: Path) -> None:
    """Make ``folder`` the servers' user's and let it through each parent (a pytest
    ``tmp_path`` is private to root): o+x where it lacks."""
    if os.geteuid() != 0:
        return
    shutil.chown(folder, SYSTEM_USER, SYSTEM_USER)
    for path in folder.parents:
        mode = path.stat().st_mode
        if not mode & stat.S_IXOTH:
            path.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _tree(leader: int) -> set[int]:
    """The live processes a ``pg_autoctl`` started as the leader of its own session left:
    those of its session, and their descendants (each PostgreSQL backend calls setsid)."""
    table: list[tuple[int, int, int]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):  # a zombie holds no socket and no file
            table.append((int(entry.name), int(fields[1]), int(fields[3])))
    found = {pid for pid, _, sid in table if sid == leader}
    while grown := {pid for pid, parent, _ in table if parent in found} - found:
        found |= grown
    return found


def _kill_tree(leader: int) -> None:
    """SIGKILL ``_tree(leader)`` at once, as when the machine dies: each process is frozen
    first, so that none notices the others dying and none forks anew while they are found."""
    frozen: set[int] = set()
    while found := _tree(leader) - frozen:
        for pid in sorted(found):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen |= found
    for pid in sorted(frozen):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    poll_until(lambda: not _tree(leader), f"the processes of session {leader} to die", STOP_WITHIN)


def _tail(log: Path, lines: int = 25) -> str:
    with suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


class Service:
    """One ``pg_autoctl`` service (a monitor or a keeper) and the PostgreSQL it runs."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.data = folder / name
        self.port = free_port()
        self.log = folder / f"{name}.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"Service({self.name!r}, port={self.port}, running={self.running})"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def sql(self, query: str, *, database: str = "postgres") -> str:
        """Run ``query`` as the superuser over 127.0.0.1 (trusted); psql's unaligned output."""
        result = subprocess.run(
            [str(BIN / "psql"), "-XAtq", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
             "-p", str(self.port), "-U", "postgres", "-d", database, "-c", query],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"{self.name}: {query!r} failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def accepts_writes(self) -> bool:
        try:
            return self.sql("SELECT NOT pg_is_in_recovery()") == "t"
        except RuntimeError:
            return False

    def run(self, env: dict[str, str]) -> None:
        """Start ``pg_autoctl run`` as the leader of a session of its own, so that every
        process it starts, PostgreSQL's among them, can be found (and killed) by session."""
        with self.log.open("ab") as out:
            self._process = subprocess.Popen(
                [str(PG_AUTOCTL), "run", "--pgdata", str(self.data)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, **as_user(),
            )  # fmt: skip

    def kill(self) -> None:
        """SIGKILL the service and everything it started (``_kill_tree``). The postmaster's
        socket and lock file are removed from the shared socket directory: a later server on
        this port would take the lock for a live one (its PID lingers while unreaped)."""
        process, self._process = self._process, None
        if process is None:
            return
        postmaster = self._postmaster()
        _kill_tree(process.pid)
        process.wait(STOP_WITHIN)
        lock = SOCKETS / f".s.PGSQL.{self.port}.lock"
        with suppress(OSError):
            if postmaster and lock.read_text().split("\n", 1)[0] == postmaster:
                (SOCKETS / f".s.PGSQL.{self.port}").unlink(missing_ok=True)
                lock.unlink()

    def _postmaster(self) -> str:
        """The PID in ``postmaster.pid``, as text ("" without one)."""
        with suppress(OSError):
            return (self.data / "postmaster.pid").read_text().split("\n", 1)[0]
        return ""

    def stop(self, env: dict[str, str]) -> None:
        """``pg_autoctl stop --fast``, then whatever is left of it killed (bounded)."""
        if self.running:
            subprocess.run(
                [str(PG_AUTOCTL), "stop", "--fast", "--pgdata", str(self.data)],
                capture_output=True, env=env, timeout=STOP_WITHIN, check=False, **as_user(),
            )  # fmt: skip
            assert self._process is not None
            with suppress(subprocess.TimeoutExpired):
                self._process.wait(STOP_WITHIN)
        self.kill()


class Formation:
    """The monitor and the nodes ``a`` and ``b``; which one is primary is the monitor's call."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.monitor = Service("monitor", folder)
        self.nodes = (Service("a", folder), Service("b", folder))
        # pg_autoctl keeps its configuration, state and PID files in the XDG directories; no
        # PG* variable of ours may point it elsewhere.
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("PG", "XDG_"))},
            "HOME": str(folder),
            "XDG_CONFIG_HOME": str(folder / "config"),
            "XDG_DATA_HOME": str(folder / "data"),
            "XDG_RUNTIME_DIR": str(folder / "run"),
        }
        self.killed: Service | None = None

    def dsn(self) -> str:
        """The proxy's DSN: role ``dedup`` on database ``dedup``, both nodes listed, asking
        for the one that takes writes."""
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        login = f"postgresql://{ROLE}:{PASSWORD}@"
        return f"{login}{hosts}/{DATABASE}?target_session_attrs=read-write"

    def state(self) -> dict[str, tuple[str, str]]:
        """Each node's (reported, assigned) state, per ``pg_autoctl show state``."""
        shown = self._autoctl("show", "state", "--json", "--pgdata", str(self.monitor.data))
        return {
            node["nodename"]: (node["current_group_state"], node["assigned_group_state"])
            for node in json.loads(shown)
        }

    def primary(self) -> Service | None:
        """The node the monitor has as primary (reported and assigned a writable state), the
        killed one last (the monitor has it as primary until it notices); None while a
        failover is under way."""
        state = self.state()
        writable = [
            node
            for node in self.nodes
            if node.name in state and all(s in WRITABLE for s in state[node.name])
        ]
        writable.sort(key=lambda node: node is self.killed)
        return writable[0] if writable else None

    def kill_primary(self) -> Service:
        """SIGKILL the primary's ``pg_autoctl`` and PostgreSQL processes; the node killed."""
        primary = self.primary()
        if primary is None:
            raise RuntimeError(f"no primary to kill: {self.state()}")
        primary.kill()
        self.killed = primary
        return primary

    def wait_for_new_primary(self, within: float) -> Service:
        """Wait until the monitor has promoted a node other than the one killed and that node
        takes writes (at most ``within`` seconds); that node."""
        found: list[Service] = []

        def promoted() -> bool:
            primary = self.primary()
            if primary is None or primary is self.killed or not primary.accepts_writes():
                return False
            found.append(primary)
            return True

        try:
            poll_until(promoted, "pg_auto_failover to promote the standby", within)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; state: {self.state()}\n{_tail(self.monitor.log)}") from exc
        return found[0]

    def start(self) -> None:
        """The monitor, tuned; node ``a`` and the proxy's role and database on it; node ``b``
        cloned from it; returns once ``a`` is primary and ``b`` its synchronous standby."""
        for name in ("config", "data", "run"):
            (self.folder / name).mkdir()
            _reach(self.folder / name)
        self._create(self.monitor, "monitor", "--pgport", str(self.monitor.port))
        with (self.monitor.data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{name} = {value}\n" for name, value in MONITOR_SETTINGS.items())
        self.monitor.run(self.env)
        a, b = self.nodes
        self._create_node(a)
        self._wait_for({a.name: ("single", "single")})
        poll_until(a.accepts_writes, "node a to take writes", READY_WITHIN)
        for statement in (
            f"CREATE ROLE {ROLE} LOGIN CREATEROLE PASSWORD '{PASSWORD}'",
            f"CREATE DATABASE {DATABASE} OWNER {ROLE}",
            f"GRANT pg_signal_backend TO {ROLE}",
            # pg_autoctl's pg_basebackup asks for a spread checkpoint: without this, b's clone
            # would wait minutes for the dirty pages of CREATE DATABASE to trickle out.
            "ALTER SYSTEM SET checkpoint_completion_target = 0",
        ):
            a.sql(statement)
        # Ahead of initdb's "trust" lines: the proxy's password is checked. ``b``'s base backup
        # copies this file.
        hba = a.data / "pg_hba.conf"
        hba.write_text(f"host {DATABASE} {ROLE} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        a.sql("SELECT pg_reload_conf()")
        self._create_node(b)
        self._wait_for({a.name: ("primary", "primary"), b.name: ("secondary", "secondary")})

    def stop(self) -> None:
        """Every service stopped (the nodes before their monitor), whatever is left killed."""
        for service in (*self.nodes, self.monitor):
            with suppress(Exception):
                service.stop(self.env)
            service.kill()

    def _create(self, service: Service, kind: str, *options: str) -> None:
        """``pg_autoctl create``: initdb (or a base backup), registered, then stopped again."""
        self._autoctl(
            "create", kind, "--pgdata", str(service.data), "--pgctl", str(BIN / "pg_ctl"),
            "--hostname", "127.0.0.1", "--listen", "127.0.0.1", "--auth", "trust", "--no-ssl",
            *options,
            log=service.log,
        )  # fmt: skip

    def _create_node(self, node: Service) -> None:
        monitor = f"postgres://autoctl_node@127.0.0.1:{self.monitor.port}/pg_auto_failover"
        self._create(
            node, "postgres", "--pgport", str(node.port), "--name", node.name,
            "--monitor", f"{monitor}?sslmode=disable",
        )  # fmt: skip
        for key, value in KEEPER_SETTINGS.items():
            self._autoctl("config", "set", "--pgdata", str(node.data), key, str(value))
        node.run(self.env)

    def _wait_for(self, states: dict[str, tuple[str, str]]) -> None:
        """Wait until each node named in ``states`` reports and is assigned its state."""

        def reached() -> bool:
            now = self.state()
            return all(now.get(name) == wanted for name, wanted in states.items())

        try:
            poll_until(reached, f"the states {states}", READY_WITHIN)
        except RuntimeError as exc:
            logs = "\n".join(_tail(s.log) for s in (self.monitor, *self.nodes))
            raise RuntimeError(f"{exc}; state: {self.state()}\n{logs}") from exc

    def _autoctl(self, *args: str, log: Path | None = None) -> str:
        """Run ``pg_autoctl *args`` as the servers' user to its end (bounded): its output to
        ``log``, or else its stdout returned. Fails with its output. Whatever it leaves
        running is killed: a ``create`` cut short leaves a PostgreSQL behind."""
        what = f"pg_autoctl {' '.join(args)}"
        with ExitStack() as files:
            out: Any = files.enter_context(log.open("ab")) if log else subprocess.PIPE
            process = subprocess.Popen(
                [str(PG_AUTOCTL), *args], stdout=out, stderr=out, env=self.env, text=True,
                start_new_session=True, **as_user(),
            )  # fmt: skip
            try:
                stdout, stderr = process.communicate(timeout=READY_WITHIN)
            except subprocess.TimeoutExpired:
                _kill_tree(process.pid)
                process.communicate()
                raise RuntimeError(f"{what}: no end after {READY_WITHIN:g}s") from None
            _kill_tree(process.pid)
        if process.returncode != 0:
            shown = stderr or (_tail(log) if log else "")
            raise RuntimeError(f"{what} exited {process.returncode}: {shown}")
        return stdout or ""


@contextmanager
def formation(folder: Path) -> Iterator[Formation]:
    """A monitor and two nodes in ``folder`` (created; removed afterwards, every process
    stopped). Raises RuntimeError when pg_auto_failover is not installed."""
    if not all(path.exists() for path in (PG_AUTOCTL, BIN / "postgres", EXTENSION)):
        raise RuntimeError(INSTALL_HINT)
    if os.geteuid() == 0 and not SOCKETS.is_dir():
        SOCKETS.mkdir(parents=True)
        SOCKETS.chmod(0o2775)
        shutil.chown(SOCKETS, SYSTEM_USER, SYSTEM_USER)
    folder.mkdir(parents=True, exist_ok=True)
    _reach(folder)
    made = Formation(folder)
    try:
        made.start()
        yield made
    finally:
        made.stop()
        shutil.rmtree(folder, ignore_errors=True)
