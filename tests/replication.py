"""A real PostgreSQL 15 primary and streaming standby (``pg_basebackup -R``) on 127.0.0.1, for
the failover tests and the fault campaign: kill the primary as a dying machine would, promote
the standby, cut the WAL stream, and rebuild the lost node as the new primary's standby.

Both servers are Debian's PostgreSQL 15 binaries, run as the ``postgres`` system user when the
tests run as root (PostgreSQL refuses root). The proxy's role ``dedup`` logs in with a password
over TCP and owns the database ``dedup``; it is no superuser, and, as in ``.ci/postgres15``, may
create roles and end sessions. The tests' own queries go in as the superuser over a private unix
socket directory.

``synchronous=True`` makes every commit on the primary wait for the standby's flush
(``synchronous_standby_names = '*'``, ``synchronous_commit = on``, on both nodes). A promoted
node has no standby yet, so ``promote`` clears its ``synchronous_standby_names`` (as Patroni's
non-strict synchronous mode does when the standby is gone: otherwise every commit would wait
forever) and ``rebuild_standby`` sets it again once the new standby streams.

Every method blocks (for seconds at most, each wait bounded); from a coroutine, call them
through ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from tests.helpers import free_port

BIN = Path("/usr/lib/postgresql/15/bin")
INSTALL_HINT = "PostgreSQL 15 is not installed: apt-get install postgresql-15"
ROLE = "dedup"
DATABASE = "dedup"
PASSWORD = "dedup-failover"
REPLICATOR = "replicator"
REPLICATOR_PASSWORD = "replicator-failover"
START_WITHIN = 30.0  # a server accepting connections, a promotion, a standby streaming
STOP_WITHIN = 15.0
SYSTEM_USER = "postgres"

# Small and quick to fail over; durability settings (fsync, full_page_writes) stay on.
SETTINGS = """
listen_addresses = '127.0.0.1'
shared_buffers = 16MB
max_connections = 100
wal_level = replica
max_wal_senders = 5
wal_keep_size = 64MB
hot_standby = on
synchronous_commit = on
wal_retrieve_retry_interval = 500ms
wal_receiver_status_interval = 1s
log_min_messages = warning
log_line_prefix = '%m [%p] %q%a '
"""

HBA = f"""
local all all trust
host {DATABASE} {ROLE} 127.0.0.1/32 scram-sha-256
host replication {REPLICATOR} 127.0.0.1/32 scram-sha-256
"""


def _user() -> str | None:
    """The system user the servers run as: ``postgres`` when we are root, else ourselves."""
    return SYSTEM_USER if os.geteuid() == 0 else None


def as_user() -> dict[str, Any]:
    """``subprocess`` arguments that run a program as ``_user()``, in its own group alone (with
    root's group kept, a root-owned 0700 folder would be closed to it by its group bits)."""
    user = _user()
    return {} if user is None else {"user": user, "group": user, "extra_groups": []}


def _run(*command: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
    """Run a PostgreSQL program as the servers' user; its stdout. Fails with its output."""
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]], capture_output=True, text=True, **as_user(),
        env={**os.environ, **(env or {})}, timeout=timeout, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}: {result.stderr}")
    return result.stdout


def _own(path: Path) -> None:
    """Hand ``path`` to the servers' user (a no-op unless we are root)."""
    if (user := _user()) is not None:
        shutil.chown(path, user, user)


def _traversable(folder: Path) -> None:
    """Let the servers' user reach ``folder``: add o+x to it and each parent that lacks it (a
    pytest ``tmp_path`` is private to root)."""
    if _user() is None:
        return
    for path in [folder, *folder.parents]:
        mode = path.stat().st_mode
        if not mode & stat.S_IXOTH:
            path.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a postmaster's backends and workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: it holds no socket and no file)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def poll_until(check: Callable[[], bool], what: str, within: float = START_WITHIN) -> None:
    """Poll ``check`` until it holds; RuntimeError after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {within:g}s waiting for {what}")
        time.sleep(0.05)


def _quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class Node:
    """One PostgreSQL server: its data directory, its port, and the postmaster once started."""

    def __init__(self, name: str, data: Path, sockets: Path, log: Path) -> None:
        self.name = name
        self.data = data
        self.port = free_port()
        self.sockets = sockets
        self.log = log
        self._process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        return f"Node({self.name!r}, port={self.port}, running={self.running})"

    @property
    def pid(self) -> int:
        """The postmaster's PID."""
        if self._process is None:
            raise RuntimeError(f"node {self.name} is not running")
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def sql(self, query: str, *, database: str = "postgres") -> str:
        """Run ``query`` (one statement, or several in one implicit transaction) as the
        superuser over the local socket; its rows as psql prints them unaligned, stripped."""
        result = subprocess.run(
            [str(BIN / "psql"), "-XAtq", "-v", "ON_ERROR_STOP=1", "-h", str(self.sockets),
             "-p", str(self.port), "-U", "postgres", "-d", database, "-c", query],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"{self.name}: {query!r} failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def start(self) -> None:
        """Start the postmaster; returns once it accepts connections (bounded)."""
        if self.running:
            return
        with self.log.open("ab") as out:
            self._process = subprocess.Popen(
                [str(BIN / "postgres"), "-D", str(self.data), "-c", f"port={self.port}",
                 "-c", f"unix_socket_directories={self.sockets}",
                 "-c", f"cluster_name={self.name}"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **as_user(),
            )  # fmt: skip

        def accepting() -> bool:
            if not self.running:
                raise RuntimeError(f"node {self.name} exited at start-up:\n{self.tail()}")
            ready = subprocess.run(
                [str(BIN / "pg_isready"), "-q", "-h", str(self.sockets), "-p", str(self.port)],
                timeout=10, check=False,
            )  # fmt: skip
            return ready.returncode == 0

        try:
            poll_until(accepting, f"node {self.name} to accept connections")
        except BaseException:
            self.kill()
            raise

    def stop(self) -> None:
        """A fast shutdown (SIGINT), or ``kill`` if it does not finish in time."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(STOP_WITHIN)
            except subprocess.TimeoutExpired:
                self.kill()
                return
        self._process = None

    def kill(self) -> None:
        """SIGKILL the postmaster and every child at once: no shutdown checkpoint, no goodbye to
        clients or the standby, as when the machine dies. The postmaster is frozen first so
        that it forks nothing new while its children are found."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            with suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGSTOP)
            children = _children(process.pid)
            for child in children:
                with suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            with suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(STOP_WITHIN)
            poll_until(
                lambda: not any(map(_alive, children)), f"node {self.name}'s children to die"
            )

    def tail(self, lines: int = 30) -> str:
        with suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def accepts_writes(self) -> bool:
        return self.sql("SELECT NOT pg_is_in_recovery()") == "t"

    def set_synchronous(self, on: bool) -> None:
        """Whether commits on this node wait for a standby (takes effect at the reload)."""
        self.sql(f"ALTER SYSTEM SET synchronous_standby_names = {_quote('*' if on else '')}")
        self.sql("SELECT pg_reload_conf()")

    def streaming_standbys(self, *, sync: bool = False) -> int:
        """Standbys streaming from this node (only synchronous ones with ``sync``)."""
        where = "state = 'streaming'" + (" AND sync_state = 'sync'" if sync else "")
        return int(self.sql(f"SELECT count(*) FROM pg_stat_replication WHERE {where}"))


class Pair:
    """A primary and its streaming standby; ``primary`` is always the writable one."""

    def __init__(self, folder: Path, sockets: Path, *, synchronous: bool) -> None:
        self.folder = folder
        self.synchronous = synchronous
        self.primary = Node("a", folder / "a", sockets, folder / "a.log")
        self.standby = Node("b", folder / "b", sockets, folder / "b.log")
        self._conninfo = ""  # the standby's primary_conninfo while replication is cut

    @property
    def nodes(self) -> tuple[Node, Node]:
        return self.primary, self.standby

    def dsn(self, *, multi_host: bool = True) -> str:
        """The proxy's DSN: role ``dedup`` on database ``dedup``. Multi-host lists the primary
        and then the standby, as they are now, and asks for the one that takes writes."""
        login = f"postgresql://{ROLE}:{PASSWORD}@"
        if not multi_host:
            return f"{login}127.0.0.1:{self.primary.port}/{DATABASE}"
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"{login}{hosts}/{DATABASE}?target_session_attrs=read-write"

    def init(self) -> None:
        """initdb the primary, create the roles and the database, then the standby."""
        self.primary.data.mkdir(mode=0o700)
        _own(self.primary.data)
        _run(
            "initdb", "-D", str(self.primary.data), "-U", "postgres", "-E", "UTF8",
            "--locale=C", "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync",
        )  # fmt: skip
        with (self.primary.data / "postgresql.conf").open("a") as conf:
            conf.write(SETTINGS)
        (self.primary.data / "pg_hba.conf").write_text(HBA)
        self.primary.start()
        for statement in (
            f"CREATE ROLE {ROLE} LOGIN CREATEROLE PASSWORD {_quote(PASSWORD)}",
            f"CREATE DATABASE {DATABASE} OWNER {ROLE}",
            f"GRANT pg_signal_backend TO {ROLE}",
            f"CREATE ROLE {REPLICATOR} LOGIN REPLICATION PASSWORD {_quote(REPLICATOR_PASSWORD)}",
        ):
            self.primary.sql(statement)
        self._make_standby()

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and its children: stopped hard, as a machine dying."""
        self.primary.kill()

    def promote(self) -> None:
        """Promote the standby, wait until it takes writes (bounded), then swap the roles: the
        old primary becomes ``standby`` (stopped, until ``rebuild_standby``)."""
        new = self.standby
        if self.synchronous:
            new.set_synchronous(False)  # no standby of its own yet
        _run("pg_ctl", "promote", "-D", str(new.data), "-w", "-t", str(int(START_WITHIN)))
        poll_until(new.accepts_writes, f"node {new.name} to accept writes")
        self.primary, self.standby = new, self.primary

    def cut_replication(self) -> None:
        """The standby stops receiving WAL while both stay up: its ``primary_conninfo`` is
        emptied and its walreceiver ends (bounded wait). With ``synchronous``, commits on the
        primary then wait until ``heal_replication``."""
        standby = self.standby
        self._conninfo = standby.sql("SHOW primary_conninfo")
        standby.sql("ALTER SYSTEM SET primary_conninfo = ''")
        standby.sql("SELECT pg_reload_conf()")

        def stopped() -> bool:
            return standby.sql("SELECT count(*) FROM pg_stat_wal_receiver") == "0"

        poll_until(stopped, f"node {standby.name}'s walreceiver to stop")

    def heal_replication(self) -> None:
        """Undo ``cut_replication``: the standby streams again (bounded wait)."""
        if not self._conninfo:
            return
        self.standby.sql(f"ALTER SYSTEM SET primary_conninfo = {_quote(self._conninfo)}")
        self.standby.sql("SELECT pg_reload_conf()")
        self._conninfo = ""
        self._wait_streaming()

    def rebuild_standby(self) -> None:
        """After ``promote``: the old primary's data directory replaced by a ``pg_basebackup -R``
        of the new primary, started as its standby, streaming (and synchronous again with
        ``synchronous``) before this returns."""
        self.standby.kill()
        shutil.rmtree(self.standby.data)
        self._conninfo = ""
        self._make_standby()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def _make_standby(self) -> None:
        standby = self.standby
        standby.data.mkdir(mode=0o700)
        _own(standby.data)
        _run(
            "pg_basebackup", "-D", str(standby.data), "-h", "127.0.0.1",
            "-p", str(self.primary.port), "-U", REPLICATOR, "-R", "-X", "stream", "-c", "fast",
            env={"PGPASSWORD": REPLICATOR_PASSWORD},
        )  # fmt: skip
        auto = standby.data / "postgresql.auto.conf"
        kept = [line for line in auto.read_text().splitlines() if "synchronous_standby" not in line]
        auto.write_text("\n".join(kept) + "\n")  # the new primary's "no standby" setting
        standby.start()
        self._wait_streaming()
        if self.synchronous:
            standby.set_synchronous(True)
            self.primary.set_synchronous(True)
            poll_until(
                lambda: self.primary.streaming_standbys(sync=True) > 0, "a synchronous standby"
            )

    def _wait_streaming(self) -> None:
        poll_until(
            lambda: self.primary.streaming_standbys() > 0, f"node {self.standby.name} to stream"
        )


@contextmanager
def pair(folder: Path, *, synchronous: bool) -> Iterator[Pair]:
    """A primary and a streaming standby in ``folder`` (created; removed afterwards, both
    servers stopped). Raises RuntimeError when PostgreSQL 15 is not installed."""
    if not (BIN / "postgres").exists():
        raise RuntimeError(INSTALL_HINT)
    folder.mkdir(parents=True, exist_ok=True)
    _traversable(folder)
    # Unix socket paths are short (107 bytes): a folder of their own, outside ``folder``.
    sockets = Path(tempfile.mkdtemp(prefix="pg-pair-"))
    _own(sockets)
    replicated = Pair(folder, sockets, synchronous=synchronous)
    try:
        replicated.init()
        yield replicated
    finally:
        for node in replicated.nodes:
            with suppress(Exception):
                node.stop()
            node.kill()
        shutil.rmtree(sockets, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
