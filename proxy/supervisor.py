"""``workers: N``: N proxy processes sharing the listeners, started, watched and drained here.

Each worker is a whole proxy (``dedup-proxy serve`` in a child process, with its own event loop
and database pool) bound to the public and admin ports with SO_REUSEPORT, so the kernel spreads
new connections across them. Nothing about claims changes: copies of an event that reach two
workers meet at PostgreSQL's row lock, exactly as copies on two replicas do.

The supervisor itself serves nothing. It starts the embedded PostgreSQL when there is one (the
workers connect to it), gives the workers a shared directory for their metrics, forwards
SIGTERM/SIGINT so they drain, and restarts a worker that dies while serving. A worker says it is
listening by writing one byte to a pipe: one of the first workers that exits before that (bad
DSN, port taken) is a start-up failure, and every worker is stopped with that worker's exit
code; a replacement that does is retried with a growing pause. Each worker also holds the read
end of a pipe only the supervisor writes to: end-of-file means the supervisor died, and the
worker drains rather than serve on unsupervised.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from prometheus_client import multiprocess

from proxy import config, embedded, errors, metrics

log = logging.getLogger(__name__)

WORKER_ENV = "DEDUP_PROXY_WORKER"  # set in a worker: its number, from 1
DSN_ENV = "DEDUP_PROXY_WORKER_DSN"  # set in a worker when the supervisor runs the embedded server
READY_ENV = "DEDUP_PROXY_WORKER_READY_FD"  # the pipe a worker writes to once it listens
LIFELINE_ENV = "DEDUP_PROXY_WORKER_LIFELINE_FD"  # end-of-file on it: the supervisor is gone
_RESTART_PAUSE = 1.0  # a worker that dies this soon after it listened is restarted after a pause
_MAX_RESTART_PAUSE = 30.0
_KILL_MARGIN = 10.0  # past shutdown_timeout, a worker that has not exited is killed


@dataclass(slots=True)
class Worker:
    number: int
    process: asyncio.subprocess.Process
    started: float
    replacement: bool  # started in place of one that died
    ready_pipe: int  # read end: the worker writes one byte once it listens
    lifeline: int  # write end: the worker drains when it reads end-of-file (we died)

    def was_listening(self) -> bool:
        """Whether it wrote its byte before exiting (asked once, after it exited)."""
        try:
            return os.read(self.ready_pipe, 1) == b"r"
        except BlockingIOError:
            return False
        finally:
            self.close_pipes()

    def close_pipes(self) -> None:
        for fd in (self.ready_pipe, self.lifeline):
            with contextlib.suppress(OSError):
                os.close(fd)


class Supervisor:
    """The workers of one ``serve``."""

    def __init__(
        self, cfg: config.Config, config_path: str, dsn: str | None, stopping: asyncio.Event
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.dsn = dsn
        self.stopping = stopping
        try:
            self.metrics_dir = tempfile.mkdtemp(prefix="dedup-proxy-metrics-")
        except OSError as exc:  # a read-only root filesystem with no /tmp mounted
            raise errors.ProxyError(
                "workers > 1 needs a writable temporary directory for the workers' metrics: "
                f"mount a tmpfs (an emptyDir) on /tmp, or set TMPDIR ({exc})"
            ) from exc
        self.workers: dict[int, Worker] = {}
        self.failures: dict[int, int] = {}  # replacements in a row that did not start

    async def run(self) -> int:
        try:
            for number in range(1, self.cfg.workers + 1):
                await self._start(number, replacement=False)
            log.info("supervising %d workers", self.cfg.workers)
            return await self._watch()
        finally:
            await self._stop_all()
            for worker in self.workers.values():
                worker.close_pipes()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    async def _start(self, number: int, *, replacement: bool) -> None:
        env = dict(os.environ)
        env[WORKER_ENV] = str(number)
        env[metrics.MULTIPROC_ENV] = self.metrics_dir
        if self.dsn is not None:
            env[DSN_ENV] = self.dsn
        ready_read, ready_write = os.pipe()
        life_read, life_write = os.pipe()
        os.set_blocking(ready_read, False)
        env[READY_ENV] = str(ready_write)
        env[LIFELINE_ENV] = str(life_read)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "proxy", "serve", "--config", self.config_path,
                env=env, pass_fds=(ready_write, life_read),
            )  # fmt: skip
        except BaseException:
            os.close(ready_read)
            os.close(life_write)
            raise
        finally:
            os.close(ready_write)
            os.close(life_read)
        self.workers[number] = Worker(
            number, process, time.monotonic(), replacement, ready_read, life_write
        )

    async def _watch(self) -> int:
        """Until SIGTERM (0) or a worker failing at start-up (its exit code)."""
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            while True:
                waits = {asyncio.ensure_future(w.process.wait()): w for w in self.workers.values()}
                done, _ = await asyncio.wait([stop, *waits], return_when=asyncio.FIRST_COMPLETED)
                for future in waits:
                    if future not in done:
                        future.cancel()
                if stop in done:
                    return 0
                for future in done:
                    code = await self._replace(waits[future])
                    if code is not None:
                        return code
        finally:
            stop.cancel()

    async def _replace(self, worker: Worker) -> int | None:
        """Start a worker in place of one that exited; an exit code if the supervisor must stop.

        A first worker that exits before it listens is a start-up failure (bad DSN, port
        taken): everything stops. A replacement that does is retried with a growing pause
        (the database may be failing over), while the other workers keep serving.
        """
        code = worker.process.returncode
        pid = worker.process.pid
        multiprocess.mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]
        if worker.was_listening():
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
    """Run ``cfg.workers`` workers until SIGTERM; the embedded database, if any, outlives them."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Before anything starts: a SIGTERM while the embedded server starts must still stop it.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stopping.set)
    server = embedded.EmbeddedPostgres(cfg.database.data_dir) if cfg.database.embedded else None
    try:
        dsn = None
        if server is not None:
            dsn = await asyncio.to_thread(server.start)
        if stopping.is_set():
            return 0
        code = await Supervisor(cfg, config_path, dsn, stopping).run()
        log.info("all workers stopped")
        return code
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def worker_number() -> int | None:
    """This process's number if the supervisor started it, else None."""
    value = os.environ.get(WORKER_ENV)
    return int(value) if value and value.isdigit() else None


def report_listening() -> None:
    """In a worker: tell the supervisor that the listeners are up (no-op elsewhere)."""
    fd = os.environ.pop(READY_ENV, None)
    if fd is not None and fd.isdigit():
        try:
            os.write(int(fd), b"r")
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(int(fd))


def lifeline() -> int | None:
    """In a worker: the pipe that reaches end-of-file when the supervisor dies."""
    fd = os.environ.pop(LIFELINE_ENV, None)
    return int(fd) if fd is not None and fd.isdigit() else None


def worker_config(cfg: config.Config) -> config.Config:
    """A worker's configuration: the supervisor's embedded database instead of its own."""
    dsn = os.environ.get(DSN_ENV)
    if dsn is None or not cfg.database.embedded:
        return cfg
    database = dataclasses.replace(cfg.database, dsn=config.Secret(dsn))
    return dataclasses.replace(cfg, database=database)
