"""Running the proxy: the listeners, signal handling and the graceful drain on SIGTERM.

SIGHUP reloads the configuration where there is a supervisor to do it (``workers`` of 2 or
more: ``supervisor``), and a worker ignores it. A single process has no one to hand its sockets
to while it drains: at SIGHUP it checks the file and logs that a restart applies it, and serves
on.

A single process binds its listeners itself. A worker of ``workers: N`` is handed them: the
supervisor binds them and passes the listening sockets down as inherited file descriptors, named
in the worker's environment (``supervisor.WorkerEnvironment``, as systemd's socket activation
does with ``LISTEN_FDS``), and holds them for its whole life, so no accept queue dies with a
worker. On Linux each worker has a public
socket of its own in one ``SO_REUSEPORT`` group, and adopts what waits too long in a sibling's
(``shared_port``); elsewhere they share one. The public listener admits connections through
``connections`` (the per-worker connection bound), and so does the admin listener (one socket
for all workers), under its own small bound and keep-alive (``admin``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import http_parser, web

from proxy import admin, app, app_keys, config, connections, errors, shared_port
from proxy.config import routes

log = logging.getLogger(__name__)

BACKLOG = 128  # aiohttp's default; per public socket (one per worker on Linux)
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True, slots=True)
class Listeners:
    """The listening sockets of one proxy: one per address its host resolves to; in a worker
    on Linux, also its siblings' public sockets (``shared_port``)."""

    public: tuple[socket.socket, ...]
    admin: tuple[socket.socket, ...]
    siblings: tuple[socket.socket, ...] = ()

    def _named(self) -> list[tuple[str, socket.socket]]:
        return (
            [("public", s) for s in self.public]
            + [("admin", s) for s in self.admin]
            + [("sibling", s) for s in self.siblings]
        )

    def filenos(self) -> tuple[int, ...]:
        return tuple(sock.fileno() for _, sock in self._named())

    def named_fds(self) -> str:
        """These sockets by role and descriptor ("public:5,admin:6,sibling:7"), for a worker that
        inherits them under the same numbers (``from_named_fds``)."""
        return ",".join(f"{role}:{sock.fileno()}" for role, sock in self._named())

    @classmethod
    def from_named_fds(cls, value: str) -> Listeners:
        """In a worker: the sockets ``named_fds`` named in its supervisor."""
        named = [item.partition(":") for item in value.split(",")]
        sockets = [(role, socket.socket(fileno=int(fd))) for role, _, fd in named]
        return cls(
            public=tuple(s for role, s in sockets if role == "public"),
            admin=tuple(s for role, s in sockets if role == "admin"),
            siblings=tuple(s for role, s in sockets if role == "sibling"),
        )

    def close(self) -> None:
        for _, sock in self._named():
            sock.close()


def bind(
    listen: config.Listen,
    *,
    key: str = "listen",
    reuse_port: bool = False,
    holder: shared_port.Holder | None = None,
) -> tuple[socket.socket, ...]:
    """Listening sockets for ``listen`` (the configuration's ``key``, named in the error), bound
    as ``loop.create_server(host, port)`` binds them: every address the host resolves to,
    SO_REUSEADDR, IPv6 sockets IPv6-only. ``holder`` first takes each address, so that a port
    bound with SO_REUSEPORT is still this proxy's alone (``shared_port``)."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            listen.host, listen.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in dict.fromkeys(infos):
            if holder is not None:
                holder.take(family, address)
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise errors.ListenFailed(
            f"cannot listen on http://{listen} ({key}): {exc.strerror or exc}"
        ) from exc
    return tuple(sockets)


def bind_all(cfg: config.Config, holder: shared_port.Holder) -> Listeners:
    """Both listeners of ``cfg``: the supervisor's, handed down to every worker, on addresses
    ``holder`` keeps for them alone.

    Where the kernel balances SO_REUSEPORT, the admin socket has it too, only so that a
    supervisor restarted after it was killed can bind beside the old one's workers while they
    drain: they close the public listener at once, but serve ``/readyz`` (503) until their
    requests have finished."""
    reuse = shared_port.balanced()
    held = holder if reuse else None
    admin_sockets = bind(cfg.admin.listen, key="admin.listen", reuse_port=reuse, holder=held)
    try:
        return Listeners(
            public=bind(cfg.listen, reuse_port=reuse, holder=held), admin=admin_sockets
        )
    except errors.ListenFailed:
        for sock in admin_sockets:
            sock.close()
        raise


async def serve(
    cfg: config.Config,
    *,
    worker: int | None = None,
    handed: Listeners | None = None,
    on_listening: Callable[[], None] | None = None,
    lifeline: int | None = None,
    config_path: str | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT, then drain: ``/readyz`` turns 503, the public listener
    closes (new connections are refused), in-flight requests finish and commit (bounded by
    ``shutdown_timeout``), the pool closes, and the admin listener goes last.

    A ``worker`` (one of ``workers: N``) serves the sockets its supervisor bound (``handed``),
    says it listens (``on_listening``) and drains when its supervisor is gone (end-of-file on
    ``lifeline``): what ``supervisor.WorkerEnvironment`` read. A single process binds its own
    sockets, the admin listener before the database pool starts and the public one once it
    has. Each worker keeps at most ``max_connections`` client connections open (see
    ``connections``)."""
    if http_parser.HttpRequestParser is not getattr(http_parser, "HttpRequestParserC", None):
        raise errors.UnsafeRuntime()
    server = _Server(cfg, worker=worker, handed=handed, lifeline=lifeline, config_path=config_path)
    server.install_signal_handlers()
    try:
        await server.startup(on_listening)
        await server.main_loop()
    finally:
        await server.shutdown()
    if (failure := server.proxy[app_keys.START].error) is not None:
        raise failure
    log.info("stopped")


class _Server:
    """One run of ``serve`` in uvicorn's three phases: ``startup`` brings the listeners up,
    ``main_loop`` waits for the signal to stop, ``shutdown`` drains and releases whatever
    ``startup`` took, however far it got."""

    def __init__(
        self,
        cfg: config.Config,
        *,
        worker: int | None,
        handed: Listeners | None,
        lifeline: int | None,
        config_path: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.worker = worker
        self.handed = handed
        self.lifeline = lifeline
        self.bound = connections.connection_bound(cfg, connections.raise_open_files())
        self.proxy = app.create_app(cfg)
        self.runner = app.Runner(
            self.proxy,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=cfg.shutdown_timeout,
            **app.runner_options(cfg),
        )
        # No lingering read: only the console's actions read a body (a small form, read before
        # the answer), and a connection that declares one and never sends it would hold the
        # admin bound for aiohttp's 10 s of lingering.
        self.admin_runner = web.AppRunner(
            admin.create_admin_app(self.proxy),
            access_log=None,
            keepalive_timeout=admin.KEEPALIVE,
            lingering_time=0,
        )
        self.stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        # Closed by their sites, or in the end if never served.
        self.sockets: list[socket.socket] = []
        self.adopter: shared_port.Adopter | None = None

    def install_signal_handlers(self) -> None:
        """The signals (and in a worker, its supervisor's end) only set ``stop``: the drain runs
        in ``main_loop`` and ``shutdown``, not inside a handler."""
        for signum in _SIGNALS:
            self.loop.add_signal_handler(signum, self.stop.set)
        self.loop.add_signal_handler(signal.SIGHUP, self._hangup)
        if self.lifeline is not None:
            _watch_lifeline(self.loop, self.lifeline, self.stop)

    def _hangup(self) -> None:
        """SIGHUP: a worker leaves it to its supervisor (a terminal's hangup reaches the whole
        process group); a single process checks the file and says what a reload needs."""
        if self.worker is not None or self.config_path is None:
            return
        try:
            config.load(self.config_path)
        except errors.ConfigError as exc:
            log.error("SIGHUP: not reloaded, the running configuration serves on: %s", exc)
            return
        log.warning(
            "SIGHUP: %s is valid, but with workers: 1 there is no supervisor to start a new "
            "process on the listeners while this one drains: restart the proxy to apply it "
            "(with workers: 2 or more, SIGHUP reloads); serving on",
            self.config_path,
        )

    async def startup(self, on_listening: Callable[[], None] | None) -> None:
        """The admin listener first, so that ``/healthz`` answers and ``/readyz`` says
        "starting" while the proxy's ``runner.setup`` starts the pool; the public listener once
        it has; then the proxy says it is listening."""
        await self._start_admin()
        await self._start_public()
        # What start-up built (modules, configuration, routes, pools) stays for the life of
        # the process: out of the cyclic collector's sight, each collection under load walks
        # only what requests made (about 3 % of the CPU per request: docs/benchmarks.md).
        gc.freeze()
        if on_listening is not None:
            on_listening()  # first: once the line below is out, the supervisor has been told
        cfg = self.cfg
        console = cfg.admin.console
        log.info(
            "listening on %s (admin on %s%s), %d route(s), upstream %s%s",
            cfg.listen,
            cfg.admin.listen,
            f", console at http://{cfg.admin.listen}/console/" if console.enabled else "",
            len(cfg.routes),
            cfg.upstream.url,
            "" if self.worker is None else f", worker {self.worker} of {cfg.workers}",
            extra={"fields": {"listen": str(cfg.listen), "routes": [r.name for r in cfg.routes]}},
        )
        if self.worker in (None, 1):
            _warn_unprotected(cfg.routes)
            admin.warn_open_console(cfg.admin)

    async def _start_admin(self) -> None:
        await self.admin_runner.setup()
        admin_listen = self.cfg.admin.listen
        admin_sockets = self.handed.admin if self.handed else bind(admin_listen, key="admin.listen")
        self.sockets += admin_sockets
        for sock in admin_sockets:
            # A backlog no longer than the bound: the loop accepts a whole queue before the
            # bound sees any of it, so the queue is what the admin listener may briefly hold
            # beyond its bound.
            await connections.BoundedSite(
                self.admin_runner, sock, bound=admin.MAX_CONNECTIONS, shed=_uncounted,
                backlog=admin.MAX_CONNECTIONS, name="the admin listener's bound", max_lingering=0,
                send_timeout=self.cfg.send_timeout, max_head=self.cfg.max_head,
            ).start()  # fmt: skip

    async def _start_public(self) -> None:
        await self.runner.setup()
        shed = self.proxy[app_keys.METRICS].shed.labels("connections").inc
        public = self.handed.public if self.handed else bind(self.cfg.listen)
        self.sockets += public
        for sock in public:
            site = connections.BoundedSite(
                self.runner, sock, bound=self.bound, shed=shed, backlog=BACKLOG,
                send_timeout=self.cfg.send_timeout, max_head=self.cfg.max_head,
            )  # fmt: skip
            await site.start()
        if self.handed is not None and self.handed.siblings:
            self.adopter = shared_port.Adopter(self.handed.siblings, site.admission)
            self.adopter.start()

    async def main_loop(self) -> None:
        """Until a signal, or a start the database let fail (``app_keys.Start``): then ``/readyz``
        turns 503 before ``shutdown`` closes anything."""
        waits = [asyncio.ensure_future(self.stop.wait()),
                 asyncio.ensure_future(self.proxy[app_keys.START].failed.wait())]  # fmt: skip
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        self.proxy[app_keys.DRAINING].set()
        self.proxy[app_keys.METRICS].draining.set(1)
        self._leave_siblings()
        log.info("draining: no new connections, waiting up to %gs", self.cfg.shutdown_timeout)

    def _leave_siblings(self) -> None:
        """Adopt nothing more, and close this worker's copies of its siblings' sockets: left
        open in a worker whose supervisor was killed, they would stay in the port's group with
        nobody accepting from them once the siblings have gone."""
        if self.adopter is not None:
            self.adopter.stop()
        if self.handed is not None:
            for sock in self.handed.siblings:
                sock.close()

    async def shutdown(self) -> None:
        """The drain: the public listener closes, connections waiting for a request get a moment
        to send it (``connections.settle``), then the public runner's cleanup closes the ones
        still waiting, lets in-flight requests finish within ``shutdown_timeout`` and closes
        the pool; the admin listener goes after it, even if it fails, so that ``/readyz``
        reports the drain to its end."""
        try:
            for site in list(self.runner.sites):
                await site.stop()  # what runner.cleanup does first
            await connections.settle(self.runner.server)
            await self.runner.cleanup()
        finally:
            await self.admin_runner.cleanup()
            for signum in (*_SIGNALS, signal.SIGHUP):
                self.loop.remove_signal_handler(signum)
            if self.lifeline is not None:
                self.loop.remove_reader(self.lifeline)
                os.close(self.lifeline)
            self._leave_siblings()
            for sock in self.sockets:
                sock.close()
            if self.handed is not None:
                self.handed.close()


def _uncounted() -> None:
    """Admin connections shed are not webhooks shed: only the warning line reports them."""


def _warn_unprotected(configured: Sequence[routes.RouteConfig]) -> None:
    """Once per proxy: the routes anyone who can reach it may claim events on."""
    for route in configured:
        if route.idempotency and not route.scope_from:
            log.warning(
                "route %s has no scope_from: all clients share one key space, and one "
                "client's key can replay or block another's (see docs/how-it-works.md)",
                route.name,
            )
        elif route.verify is None and not route.scope_from:
            log.warning(
                "route %s checks no signature: anyone who can reach the proxy and knows an "
                "event ID can claim it first%s (see docs/security.md)",
                route.name,
                ", and while the app fails, fill its inbox (redeliver)" if route.redeliver else "",
            )


def _watch_lifeline(loop: asyncio.AbstractEventLoop, fd: int, stop: asyncio.Event) -> None:
    """A worker drains when its supervisor is gone (killed, out of memory): otherwise it would
    go on serving beside the workers of a restarted supervisor, on the old configuration."""

    def readable() -> None:
        try:
            data = os.read(fd, 1)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            if not stop.is_set():
                log.warning("the supervisor is gone: draining")
                stop.set()

    loop.add_reader(fd, readable)
