"""``workers: N``: N proxy processes behind one pair of listeners, started, watched and drained.

Each worker is a whole proxy (``dedup-proxy serve`` in a child process, with its own event loop
and database pool). Nothing about claims changes: copies of an event that reach two workers
meet at PostgreSQL's row lock, exactly as copies on two replicas do.

The supervisor serves nothing itself. It binds the listeners and hands the sockets down: on
Linux a public socket per worker in one ``SO_REUSEPORT`` group, so that the kernel spreads
connections over the workers, each worker also holding its siblings' sockets to adopt what waits
in a stuck one's queue (``shared_port``); elsewhere one public socket for all. What a worker is
handed (its number, its sockets, its two pipes, the embedded server's DSN) is one
``WorkerEnvironment``, written into its environment here and read there once. The admin socket
is shared. The supervisor holds every socket until it stops, and a replacement worker gets the
socket of the one it replaces: a worker that dies takes only the connections it had accepted,
never ones still waiting in a queue. It copies the configuration file into a private directory
and validates the copy; every worker, a replacement started hours later too, loads that copy, so
an edit on disk reaches none of them before a reload or a restart. It starts the embedded
PostgreSQL when there is one, gives the workers a shared directory for their metrics, forwards
SIGTERM/SIGINT so they drain, and restarts a worker that dies while serving. No other process
may join its ports (``shared_port.Holder``).

SIGHUP reloads: the file is copied and validated again, and refused (logged, the workers serve
on) if it is invalid or changes what only a restart can (``restart_only``). Otherwise the copy
becomes the one workers load, and each worker in turn gets a new one started beside it on the
same sockets; once the new one listens, the old one drains as on SIGTERM. The sockets stay open
throughout, so no connection is refused, and the old worker finishes what it accepted.

Each worker writes to a pipe: one byte once it listens, then one a second from its event loop.
One of the first workers that exits before its first byte (bad DSN) is a start-up failure, and
every worker is stopped with that worker's exit code; a replacement that does is retried with a
growing pause. A worker whose bytes stop for ``timeout`` seconds (its loop is stuck, or it was
stopped) is killed with SIGKILL and replaced, as gunicorn's arbiter does. Each worker also holds
the read end of a pipe only the supervisor writes to: end-of-file means the supervisor died,
and the worker drains rather than serve on unsupervised.

The private directory outlives a supervisor killed with SIGKILL, so each start removes the
ones left behind. It is named after the supervisor's PID, and the supervisor and every worker
hold an exclusive lock on it (one open file, inherited): a directory is removed only once its
supervisor is gone and the kernel has dropped the lock, which happens when the last process
holding it dies, however it dies. The lock keeps the directory of workers still draining after
their supervisor was killed; the PID keeps it in the moment between making and locking it. A
PID taken over by another program only delays the removal; a directory named after the new
supervisor's own PID (PID 1 again, in a restarted container) is a leftover, its lock alone
deciding. Those locked directories name the addresses their draining workers still hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import multiprocess

from proxy import config, embedded, errors, logs, metrics, server, shared_port

log = logging.getLogger(__name__)

WORKER_ENV = "DEDUP_PROXY_WORKER"  # set in a worker: its number, from 1
LISTEN_FDS_ENV = "DEDUP_PROXY_LISTEN_FDS"  # its sockets: "public:5,admin:6,sibling:7", inherited
BEAT_ENV = "DEDUP_PROXY_WORKER_BEAT_FD"  # the pipe a worker writes its heartbeat to
LIFELINE_ENV = "DEDUP_PROXY_WORKER_LIFELINE_FD"  # end-of-file on it: the supervisor is gone
DSN_ENV = "DEDUP_PROXY_WORKER_DSN"  # set in a worker when the supervisor runs the embedded server
TIMEOUT_ENV = "DEDUP_PROXY_WORKER_TIMEOUT"  # seconds without a heartbeat before a worker is killed
BEAT_INTERVAL = 1.0
# gunicorn's default, well above a healthy worker's longest stall: the parses of the worst-case
# JSON bodies max_buffered lets it hold at once, run back to back (bench/RESULTS.md, loop_stall:
# 3.3 s per 25 MiB). A worker killed while only slow loses its requests; a hung one meanwhile
# holds up only the connections it had accepted: its siblings adopt what waits in its queue.
DEFAULT_TIMEOUT = 30.0
# A worker's exit code when its start failed for good (the database did not answer within
# database.start_timeout, or the table or the grants are wrong), possibly after it listened:
# the supervisor stops every worker and exits with it, instead of starting another.
EXIT_START_FAILED = 3
_RESTART_PAUSE = 1.0  # a worker that dies this soon after it listened is restarted after a pause
_MAX_RESTART_PAUSE = 30.0
_KILL_MARGIN = 10.0  # past shutdown_timeout, a worker that has not exited is killed
_LISTEN_POLL = 0.05  # seconds between two looks at a reload's new worker, until it listens
_HOME_PREFIX = "dedup-proxy-"
_HOME_NAME = re.compile(re.escape(_HOME_PREFIX) + r"([1-9][0-9]*)-[^-]+")  # mkdtemp's suffix
SNAPSHOT = "config.yaml"  # in the private directory: the configuration every worker loads
ADDRESSES = "addresses"  # in the private directory: the addresses held (shared_port.Holder)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEnvironment:
    """What the supervisor hands a worker in its environment: written by ``to_environ`` when it
    starts one, read by ``from_environ`` once in the worker, as it starts serving."""

    number: int  # from 1
    listeners: server.Listeners | None  # the sockets it serves, bound by the supervisor
    beat: int | None  # the pipe it writes a byte to once it listens, then one a second
    lifeline: int | None  # end-of-file on this pipe: the supervisor is gone
    dsn: str | None = None  # the supervisor's embedded server, if it runs one

    def to_environ(self) -> dict[str, str]:
        """The variables a worker started with them finds these in (the descriptors passed to
        it under the same numbers)."""
        values = {
            WORKER_ENV: self.number,
            LISTEN_FDS_ENV: None if self.listeners is None else self.listeners.named_fds(),
            BEAT_ENV: self.beat,
            LIFELINE_ENV: self.lifeline,
            DSN_ENV: self.dsn,
        }
        return {name: str(value) for name, value in values.items() if value is not None}

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] = os.environ
    ) -> WorkerEnvironment | None:
        """This process's, taken out of ``environ``; None if no supervisor started it."""
        number, fds, beat, lifeline, dsn = (
            environ.pop(name, None)
            for name in (WORKER_ENV, LISTEN_FDS_ENV, BEAT_ENV, LIFELINE_ENV, DSN_ENV)
        )
        if not (number and number.isdigit()):
            return None
        return cls(
            number=int(number),
            listeners=server.Listeners.from_named_fds(fds) if fds else None,
            beat=_descriptor(beat),
            lifeline=_descriptor(lifeline),
            dsn=dsn,
        )

    def config(self, cfg: config.Config) -> config.Config:
        """The worker's configuration: the supervisor's embedded database instead of its own."""
        if self.dsn is None or not cfg.database.embedded:
            return cfg
        database = dataclasses.replace(cfg.database, dsn=config.Secret(self.dsn))
        return dataclasses.replace(cfg, database=database)

    def report_listening(self) -> None:
        """Tell the supervisor that the listeners are up, then, once a second from the event
        loop, that the loop still turns."""
        if self.beat is not None:
            os.set_blocking(self.beat, False)
            _beat(asyncio.get_running_loop(), self.beat)


def _descriptor(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


@dataclass(slots=True)
class Worker:
    number: int
    process: asyncio.subprocess.Process
    replacement: bool  # started in place of one that died
    beats: int  # read end: a byte once the worker listens, then one a second
    lifeline: int  # write end: the worker drains when it reads end-of-file (we died)
    started: float = dataclasses.field(default_factory=time.monotonic)
    listening: bool = False
    last_beat: float = 0.0
    killed: bool = False

    def take_beats(self) -> None:
        """Read what the worker wrote since the last call (the pipe never blocks)."""
        if self.beats < 0:
            return
        try:
            data = os.read(self.beats, 4096)
        except BlockingIOError:  # nothing new
            return
        if data:
            self.listening = True
            self.last_beat = time.monotonic()

    def hung(self, timeout: float) -> bool:
        """Whether it listens but has not beaten for ``timeout`` seconds (read beats first)."""
        if not self.listening or self.killed or self.process.returncode is not None:
            return False
        return time.monotonic() - self.last_beat > timeout

    def close_pipes(self) -> None:
        """Close both pipes, once: their numbers may be reused by then."""
        for fd in (self.beats, self.lifeline):
            if fd >= 0:
                os.close(fd)
        self.beats = self.lifeline = -1


class Supervisor:
    """The workers of one ``serve``, on the listeners and the configuration copy it hands them."""

    def __init__(
        self,
        cfg: config.Config,
        home: Path,
        *,
        listeners: server.Listeners,
        lock: int,
        dsn: str | None,
        stopping: asyncio.Event,
        timeout: float,
        config_path: str,
        hangup: asyncio.Event,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path  # the operator's file, read again on SIGHUP
        self.snapshot = home / SNAPSHOT
        self.metrics_dir = home / "metrics"
        self.listeners = listeners  # the admin socket(s), and the first worker's public ones
        self.public: dict[int, tuple[socket.socket, ...]] = {1: listeners.public}
        self.lock = lock  # on home; every worker inherits it
        self.dsn = dsn
        self.stopping = stopping
        self.hangup = hangup  # set by SIGHUP: reload
        self.timeout = timeout
        self.workers: dict[int, Worker] = {}
        self.failures: dict[int, int] = {}  # replacements in a row that did not start
        self.retiring: set[asyncio.Task[None]] = set()  # workers draining after a reload

    async def run(self) -> int:
        watchdog = asyncio.ensure_future(self._watchdog())
        try:
            if shared_port.balanced():  # every worker's socket in the group before any starts
                for number in range(2, self.cfg.workers + 1):
                    self.public[number] = server.bind(self.cfg.listen, reuse_port=True)
            for number in range(1, self.cfg.workers + 1):
                await self._start(number, replacement=False)
            log.info(
                "supervising %d workers (replaced after %gs without a heartbeat)",
                self.cfg.workers, self.timeout,
            )  # fmt: skip
            return await self._watch()
        finally:
            watchdog.cancel()
            # Once the draining workers close theirs too, new connections are refused.
            self.listeners.close()
            for number, sockets in self.public.items():
                if number != 1:
                    for sock in sockets:
                        sock.close()
            await self._stop_all()
            await asyncio.gather(*self.retiring)
            for worker in self.workers.values():
                worker.close_pipes()

    def _listeners(self, number: int) -> server.Listeners:
        """Worker ``number``'s sockets: its own public ones (the same for each replacement) and
        its siblings', or with no balancing the one shared."""
        if not shared_port.balanced():
            return self.listeners
        siblings = [s for n, sockets in self.public.items() if n != number for s in sockets]
        return server.Listeners(
            public=self.public[number], admin=self.listeners.admin, siblings=tuple(siblings)
        )

    async def _start(self, number: int, *, replacement: bool) -> None:
        listeners = self._listeners(number)
        beat_read, beat_write = os.pipe()
        life_read, life_write = os.pipe()
        os.set_blocking(beat_read, False)
        handed = WorkerEnvironment(
            number=number, listeners=listeners, beat=beat_write, lifeline=life_read, dsn=self.dsn
        )
        env = {**os.environ, metrics.MULTIPROC_ENV: str(self.metrics_dir), **handed.to_environ()}
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy", "serve", "--config", str(self.snapshot),
                env=env, pass_fds=(beat_write, life_read, self.lock, *listeners.filenos()),
            )  # fmt: skip
        except BaseException:
            os.close(beat_read)
            os.close(life_write)
            raise
        finally:
            os.close(beat_write)
            os.close(life_read)
        self.workers[number] = Worker(number, process, replacement, beat_read, life_write)

    async def _watch(self) -> int:
        """Until SIGTERM (0) or a worker failing at start-up (its exit code); a reload at
        each SIGHUP."""
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            while True:
                hangup = asyncio.ensure_future(self.hangup.wait())
                waits = {asyncio.ensure_future(w.process.wait()): w for w in self.workers.values()}
                done, _ = await asyncio.wait(
                    [stop, hangup, *waits], return_when=asyncio.FIRST_COMPLETED
                )
                for future in (hangup, *waits):
                    if future not in done:
                        future.cancel()
                if stop in done:
                    return 0
                for future, worker in waits.items():
                    if future in done:
                        code = await self._replace(worker)
                        if code is not None:
                            return code
                if hangup in done:
                    self.hangup.clear()
                    await self._reload()
        finally:
            stop.cancel()

    async def _reload(self) -> None:
        """SIGHUP: validate the file again, then replace the workers one at a time on the
        sockets held here. A file that is not valid, or that changes what only a restart can
        (``restart_only``), is refused and the running workers serve on."""
        started = time.monotonic()
        log.info("SIGHUP: reloading %s", self.config_path)
        candidate = self.snapshot.with_name(f"next-{SNAPSHOT}")
        try:
            cfg = _snapshot(self.config_path, candidate)
        except errors.ConfigError as exc:
            log.error(
                "reload refused, the running configuration serves on: %s",
                errors.ConfigError(self.config_path, exc.problems),
            )
            return
        except errors.ProxyError as exc:
            log.error("reload refused, the running configuration serves on: %s", exc)
            return
        if changed := restart_only(self.cfg, cfg):
            log.error(
                "reload refused, the running configuration serves on: %s changed, which only "
                "a restart applies (%s)",
                ", ".join(changed), self.config_path,
            )  # fmt: skip
            return
        candidate.replace(self.snapshot)  # what every worker started from now on loads
        changed = changes(self.cfg, cfg)
        self.cfg = cfg
        logs.setup(cfg.log)
        for number in sorted(self.workers):
            if self.stopping.is_set() or not await self._roll(number):
                return
        log.info(
            "reloaded %s: %d workers replaced in %.1fs; %s",
            self.config_path, len(self.workers), time.monotonic() - started,
            "; ".join(changed) or "nothing changed",
        )  # fmt: skip

    async def _roll(self, number: int) -> bool:
        """Start a worker on ``number``'s sockets beside the one running there; once it
        listens, the old one drains as on SIGTERM. The queue never closes: both hold it."""
        old = self.workers[number]
        await self._start(number, replacement=True)
        new = self.workers[number]
        deadline = time.monotonic() + self.timeout
        while not new.listening:
            if self.stopping.is_set():
                self._retire(old)  # _stop_all stops the new one
                return False
            if new.process.returncode is not None or time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    new.process.kill()
                code = await new.process.wait()
                multiprocess.mark_process_dead(new.process.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
                new.close_pipes()
                self.workers[number] = old
                log.error(
                    "reload stopped: worker %d's replacement (pid %d) exited with code %s or "
                    "did not listen within %gs; worker %d serves on, the workers before it "
                    "run the new configuration and the ones after it the old one",
                    number, new.process.pid, code, self.timeout, number,
                )  # fmt: skip
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(new.process.wait(), _LISTEN_POLL)
            new.take_beats()
        self._retire(old)
        log.info(
            "worker %d (pid %d) replaced by pid %d for the reload; the old one drains",
            number, old.process.pid, new.process.pid,
        )  # fmt: skip
        return True

    def _retire(self, worker: Worker) -> None:
        """SIGTERM a worker a reload replaced, and clean up after it once it has drained."""
        with contextlib.suppress(ProcessLookupError):
            worker.process.send_signal(signal.SIGTERM)
        task = asyncio.ensure_future(self._drained(worker))
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)

    async def _drained(self, worker: Worker) -> None:
        process = worker.process
        try:
            await asyncio.wait_for(process.wait(), self.cfg.shutdown_timeout + _KILL_MARGIN)
        except TimeoutError:
            log.error("worker pid %d did not stop; killing it", process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        multiprocess.mark_process_dead(process.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
        worker.close_pipes()

    async def _watchdog(self) -> None:
        """Kill a worker whose event loop has not beaten for ``timeout`` seconds: ``_watch``
        then replaces it as any worker that died. Only connections it had accepted are lost."""
        while True:
            await asyncio.sleep(BEAT_INTERVAL)
            for worker in list(self.workers.values()):
                worker.take_beats()
                if worker.hung(self.timeout):
                    log.error(
                        "worker %d (pid %d) sent no heartbeat for %gs: killing it",
                        worker.number, worker.process.pid, self.timeout,
                    )  # fmt: skip
                    worker.killed = True
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.kill()

    async def _replace(self, worker: Worker) -> int | None:
        """Start a worker in place of one that exited; an exit code if the supervisor must stop.

        A first worker that exits before it listens is a start-up failure (bad DSN): everything
        stops. A replacement that does is retried with a growing pause (the database may be
        failing over), while the other workers keep serving.
        """
        code = worker.process.returncode
        pid = worker.process.pid
        multiprocess.mark_process_dead(pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
        worker.take_beats()
        worker.close_pipes()
        if code == EXIT_START_FAILED:
            log.error(
                "worker %d (pid %d) could not start (exit code %s); stopping",
                worker.number, pid, code,
            )  # fmt: skip
            return 1
        if worker.listening:
            self.failures[worker.number] = 0
            log.error(
                "worker %d (pid %d) exited with code %s; starting a new one",
                worker.number, pid, code,
            )  # fmt: skip
            lived = time.monotonic() - worker.started
            pause = _RESTART_PAUSE if lived < _RESTART_PAUSE else 0.0
        elif not worker.replacement:
            log.error(
                "worker %d (pid %d) exited with code %s while starting; stopping",
                worker.number, pid, code,
            )  # fmt: skip
            return code if code and code > 0 else 1
        else:
            failures = self.failures[worker.number] = self.failures.get(worker.number, 0) + 1
            pause = min(_MAX_RESTART_PAUSE, _RESTART_PAUSE * 2**failures)
            log.error(
                "worker %d (pid %d) exited with code %s before listening; retrying in %gs",
                worker.number, pid, code, pause,
            )  # fmt: skip
        if pause:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), pause)
        if self.stopping.is_set():
            return 0
        await self._start(worker.number, replacement=True)
        return None

    async def _stop_all(self) -> None:
        """SIGTERM every worker (they drain), SIGKILL the ones still there past the drain."""
        running = [w.process for w in self.workers.values() if w.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        if not running:
            return
        waiting = asyncio.gather(*(p.wait() for p in running))
        try:
            await asyncio.wait_for(waiting, self.cfg.shutdown_timeout + _KILL_MARGIN)
        except TimeoutError:
            for process in running:
                if process.returncode is None:
                    log.error("worker pid %d did not stop; killing it", process.pid)
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await asyncio.gather(*(p.wait() for p in running))


async def supervise(cfg: config.Config, config_path: str) -> int:
    """Run ``cfg.workers`` workers until SIGTERM, reloading ``config_path`` on SIGHUP; the
    embedded database, if any, outlives them.

    ``cfg`` was read from ``config_path``; what runs is the copy of the file taken here, which
    is validated again (it would differ only if the file changed in between).
    """
    stopping = asyncio.Event()
    hangup = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.ExitStack() as cleanup:
        # Before anything starts: a SIGTERM while the embedded server starts must still stop
        # it, and a SIGHUP then is a reload once the workers are up, not the end of the proxy.
        for signum, event in ((signal.SIGTERM, stopping), (signal.SIGINT, stopping),
                              (signal.SIGHUP, hangup)):  # fmt: skip
            loop.add_signal_handler(signum, event.set)
            cleanup.callback(loop.remove_signal_handler, signum)
        timeout = _timeout()
        home, lock, draining = _private_directory()
        cleanup.callback(shutil.rmtree, home, ignore_errors=True)
        cleanup.callback(os.close, lock)
        cfg = _snapshot(config_path, home / SNAPSHOT)
        (home / "metrics").mkdir()
        holder = shared_port.Holder(draining)
        cleanup.callback(holder.close)
        db = (
            embedded.EmbeddedPostgres(cfg.database.data_dir, before=cfg.database.data_dir_before)
            if cfg.database.embedded
            else None
        )
        try:
            dsn = None
            if db is not None:
                dsn = await asyncio.to_thread(db.start)
            if stopping.is_set():
                return 0
            listeners = server.bind_all(cfg, holder)
            # For a supervisor started while these workers drain, after this one was killed.
            (home / ADDRESSES).write_text("".join(f"{name}\n" for name in holder.names))
            code = await Supervisor(
                cfg, home, listeners=listeners, lock=lock, dsn=dsn, stopping=stopping,
                timeout=timeout, config_path=config_path, hangup=hangup,
            ).run()  # fmt: skip
            log.info("all workers stopped")
            return code
        finally:
            if db is not None:
                await asyncio.to_thread(db.stop)


def _private_directory() -> tuple[Path, int, set[str]]:
    """A directory only this user can read (mkdtemp's 0700): the configuration copy may hold
    secrets written into the file, and the workers' metrics files live beside it. With it, the
    descriptor holding its lock, and the addresses that workers of killed supervisors still
    drain on; the directories earlier supervisors left are removed first."""
    try:
        parent = Path(tempfile.gettempdir())
        draining = _remove_leftovers(parent)
        home = Path(tempfile.mkdtemp(prefix=f"{_HOME_PREFIX}{os.getpid()}-", dir=parent))
    except OSError as exc:  # a read-only root filesystem with no /tmp mounted
        raise errors.ProxyError(
            "workers > 1 needs a writable temporary directory for the workers' configuration "
            f"and metrics: mount a tmpfs (an emptyDir) on /tmp, or set TMPDIR ({exc})"
        ) from exc
    lock = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new directory: no one else holds it
    return home, lock, draining


def _remove_leftovers(parent: Path) -> set[str]:
    """Remove this user's private directories in ``parent`` whose supervisor and workers are
    all gone (see the module docstring); return the addresses of those whose workers still
    drain.

    A directory named after this process's PID is a leftover too: this supervisor has not made
    its own yet, and an earlier one had the same PID (PID 1 in a restarted container, whose
    ``/tmp`` outlives it). Its lock still keeps it while that one's workers drain."""
    draining: set[str] = set()
    for path in parent.iterdir():
        name = _HOME_NAME.fullmatch(path.name)
        if name is None:
            continue
        pid = int(name[1])
        if pid != os.getpid() and _running(pid):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # locked: a worker of that supervisor is still draining
            with contextlib.suppress(OSError):
                draining.update((path / ADDRESSES).read_text().splitlines())
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, left by a supervisor that was killed", path)
        finally:
            os.close(fd)
    return draining


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's, or one not yet reaped, counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _snapshot(config_path: str, copy: Path) -> config.Config:
    """Copy the configuration file to ``copy`` and load the copy. ``${VAR}`` is expanded the
    same way in every worker: each inherits the supervisor's environment, which never changes."""
    text = config.read_file(config_path)
    try:
        copy.write_bytes(text)
    except OSError as exc:
        raise errors.ProxyError(f"cannot copy the configuration to {copy}: {exc}") from exc
    # Paths in it mean what they meant beside the operator's file, not beside the copy; and
    # its problems are said of the operator's file, which is the one to fix.
    return config.load(copy, base=Path(os.path.abspath(config_path)).parent, named=config_path)


def changes(running: config.Config, new: config.Config) -> list[str]:
    """What a reload changes, by name only (a value may be a secret): each setting that
    differs (``database.pool_size``; a section's name when it is not a dataclass), the routes
    added and removed, and each changed route with its settings that differ."""
    said = []
    for name, was, now in _differing(running, new):
        if name == "routes":
            continue
        if dataclasses.is_dataclass(was) and type(was) is type(now):
            said += [f"{name}.{inner}" for inner, _, _ in _differing(was, now)]
        else:
            said.append(name)
    before = {route.name: route for route in running.routes}
    after = {route.name: route for route in new.routes}
    if added := [name for name in after if name not in before]:
        said.append(f"routes added: {', '.join(added)}")
    if removed := [name for name in before if name not in after]:
        said.append(f"routes removed: {', '.join(removed)}")
    for name in (name for name in after if name in before):
        if fields := [field for field, _, _ in _differing(before[name], after[name])]:
            said.append(f"route {name}: {', '.join(fields)}")
    return said


def _differing(was: object, now: object) -> list[tuple[str, object, object]]:
    """The fields of two dataclasses of one type whose values differ."""
    return [
        (field.name, getattr(was, field.name), getattr(now, field.name))
        for field in dataclasses.fields(was)  # type: ignore[arg-type]
        if getattr(was, field.name) != getattr(now, field.name)
    ]


def restart_only(running: config.Config, new: config.Config) -> list[str]:
    """The settings ``new`` changes that a reload cannot apply: the addresses (the sockets are
    bound once), the number of workers (a socket each), and which database and table (during
    the reload old and new workers serve side by side, and copies of an event must meet at one
    table's row lock). A new password, pool size or timeout is applied."""
    fixed = {
        "listen": (running.listen, new.listen),
        "admin.listen": (running.admin.listen, new.admin.listen),
        "workers": (running.workers, new.workers),
        "database.dsn": tuple(_server(c.database) for c in (running, new)),
        "database.table": (running.database.table, new.database.table),
    }
    return [key for key, (was, now) in fixed.items() if was != now]


def _server(db: config.DatabaseConfig) -> str:
    """The database a configuration names, whatever its password."""
    return f"embedded {db.data_dir}" if db.dsn is None else config.redact_dsn(db.dsn.reveal())


def _timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return DEFAULT_TIMEOUT
    try:
        timeout = float(value)
    except ValueError:
        timeout = math.nan
    if not (math.isfinite(timeout) and timeout >= 2 * BEAT_INTERVAL):
        raise errors.ProxyError(
            f"{TIMEOUT_ENV} must be a number of seconds, at least {2 * BEAT_INTERVAL:g}; "
            f"got {value!r}"
        )
    return timeout


def _beat(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    try:
        os.write(fd, b".")
    except BlockingIOError:
        pass  # a full pipe: the supervisor has beats enough to read
    except OSError:  # the supervisor is gone, and the lifeline drains this worker
        os.close(fd)
        return
    loop.call_later(BEAT_INTERVAL, _beat, loop, fd)
