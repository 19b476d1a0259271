"""``workers: N`` on one port: a listening socket per worker, and a stuck sibling's queue adopted.

One listening socket shared by every worker balances connections, not requests: whichever
worker wakes first accepts the whole queue, so the few long-lived connections of an ingress or
a load balancer's pool can all land on one worker, and a second worker then adds nothing (a
5-minute soak put 42,182 webhooks on one worker of two). On Linux the supervisor therefore binds
one socket per worker with ``SO_REUSEPORT``, as nginx's ``reuseport`` and Envoy do: the kernel
hashes each new connection's addresses to one socket of the group, so connections, and with
them the requests they carry, spread over the workers.

A queue of its own must not die with its worker, nor wait behind one that is stuck. So:

* The supervisor holds every socket for its whole life and hands a replacement worker the
  socket of the one it replaces: a worker that dies closes only its own copy, and the
  connections waiting in its queue are taken by the replacement (or a sibling) rather than
  reset. (Linux's ``net.ipv4.tcp_migrate_req`` moves a queue only when its socket closes, which
  for a hung worker is when the watchdog kills it, 30 s later; and it is a sysctl Kubernetes
  does not count as safe.)
* Every worker also holds its siblings' sockets and looks at their queues each ``PERIOD``
  (``queued``: the accept queue's length, from ``TCP_INFO``). A healthy worker empties its queue
  within microseconds of a connection's arrival; a queue seen non-empty twice in a row belongs
  to a worker that is hung, dead, restarting, or has been busy for that long, and the worker
  that saw it accepts those connections itself (``Adopter``). So a stuck worker holds up a new
  connection for at most two periods (half a second), not for the watchdog's timeout. A worker
  looks first ``STARTUP_GRACE`` after it started: at start-up the connections queued for a
  sibling still starting wait for it, rather than all go to whichever worker was up first.

The port is the workers' alone. ``SO_REUSEPORT`` lets any process of the same user join a
port's group, and the kernel would then split the connections between two proxies (a second
one started by mistake, with another configuration or database) without a word. So the
supervisor holds each address it binds (``Holder``): an abstract Unix socket named after it,
which the kernel keeps unique in the network namespace, as it keeps ports, and drops when the
supervisor dies, however it dies (its workers do not inherit it); and before binding, a probe
without ``SO_REUSEPORT``, which fails while anything else listens on the address, or on the
wildcard address over it. Either failure is "Address already in use", as for a single process.
Only the workers of a killed supervisor, still draining on the addresses they name, are let be.

Elsewhere (no ``SO_REUSEPORT`` balancing) the workers share one socket, as before, and the
kernel alone keeps the port exclusive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
from collections.abc import Callable, Collection, Sequence
from typing import Any

log = logging.getLogger(__name__)

PERIOD = 0.25  # seconds between two looks at the siblings' queues
# Before its first look: the workers start together, and one up first must not adopt the queue
# of a sibling still starting (connections it would keep for good; that sibling is up within
# a second or two). A sibling that dies or hangs later is looked at every PERIOD.
STARTUP_GRACE = 10.0
REPORT_EVERY = 10.0  # seconds: at most one line about adopted connections
# struct tcp_info: eight one-byte fields, then u32 rto, ato, snd_mss, rcv_mss, unacked: on a
# listening socket Linux reports its accept queue's length as tcpi_unacked.
_UNACKED = struct.Struct("=24xI")


def balanced() -> bool:
    """Whether the kernel spreads connections over sockets bound with SO_REUSEPORT (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def address_name(address: tuple[Any, ...]) -> str:
    """``host port`` for a socket address (IPv4's pair, IPv6's quadruple)."""
    return f"{address[0]} {address[1]}"


class Holder:
    """The addresses one supervisor's workers share with no one (see the module's docstring).

    ``draining`` names the addresses (``address_name``) that workers of a killed supervisor
    still listen on while they drain: a supervisor restarted meanwhile binds beside them."""

    def __init__(self, draining: Collection[str] = ()) -> None:
        self._draining = frozenset(draining)
        self._held: dict[str, socket.socket] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._held)

    def take(self, family: int, address: tuple[Any, ...]) -> None:
        """Hold ``address`` before its sockets are bound; OSError (EADDRINUSE) if another
        supervisor holds it or another program listens there."""
        name = address_name(address)
        if name in self._held:
            return
        lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lock.bind(f"\0dedup-proxy {name}")
            if name not in self._draining:
                with socket.socket(family, socket.SOCK_STREAM) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    probe.bind(address)  # not listening: no conflict with the group bound next
        except OSError:
            lock.close()
            raise
        self._held[name] = lock

    def close(self) -> None:
        for lock in self._held.values():
            lock.close()
        self._held.clear()


def queued(sock: socket.socket) -> int:
    """Connections waiting in ``sock``'s accept queue (a listening TCP socket, on Linux)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _UNACKED.size)
    return int(_UNACKED.unpack(info)[0])


class Adopter:
    """Accepts, into this worker, the connections waiting in a sibling's queue that was already
    non-empty at the previous look (see the module's docstring). ``factory`` makes the protocol
    of an adopted connection: the one the worker's own listener uses, so its connection bound
    counts adopted connections too."""

    def __init__(
        self,
        siblings: Sequence[socket.socket],
        factory: Callable[[], asyncio.Protocol],
        *,
        period: float = PERIOD,
    ) -> None:
        self._siblings = tuple(siblings)
        for sock in self._siblings:
            sock.setblocking(False)  # a queue its owner emptied meanwhile must not block accept
        self._factory = factory
        self._period = period
        self._waiting: set[int] = set()  # the siblings' indexes whose queue was non-empty
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._unreported = 0  # adopted since the last line that said so
        self._reported = -REPORT_EVERY

    def start(self, grace: float = STARTUP_GRACE) -> None:
        if self._siblings and self._timer is None:
            self._timer = self._loop.call_later(max(grace, self._period), self._look)

    def stop(self) -> None:
        """Adopt nothing more (the drain): what was adopted is the server's like any other."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _look(self) -> None:
        self._timer = self._loop.call_later(self._period, self._look)
        waiting: set[int] = set()
        for index, sock in enumerate(self._siblings):
            try:
                count = queued(sock)
            except OSError:
                continue
            if not count:
                continue
            if index in self._waiting:
                self._adopt(sock, count)
            else:
                waiting.add(index)
        self._waiting = waiting
        self._report()

    def _adopt(self, sock: socket.socket, count: int) -> None:
        for _ in range(count):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                break  # its owner (or another sibling) took the rest meanwhile
            except OSError as exc:
                log.warning("could not adopt a connection from a sibling's queue: %s", exc)
                break
            conn.setblocking(False)
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn))
            task.add_done_callback(_closed_on_failure(conn))
            self._unreported += 1

    def _report(self) -> None:
        now = self._loop.time()
        if self._unreported and now - self._reported >= REPORT_EVERY:
            log.warning(
                "adopted %d connection(s) that waited in another worker's queue (that worker "
                "is stuck, restarting or busy)",
                self._unreported,
                extra={"fields": {"adopted": self._unreported}},
            )
            self._unreported = 0
            self._reported = now


def _closed_on_failure(conn: socket.socket) -> Callable[[asyncio.Task[object]], None]:
    def done(task: asyncio.Task[object]) -> None:
        if task.cancelled() or task.exception() is not None:
            with contextlib.suppress(OSError):
                conn.close()

    return done
