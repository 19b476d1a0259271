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

Elsewhere (no ``SO_REUSEPORT`` balancing) the workers share one socket, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
from collections.abc import Callable, Sequence

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
