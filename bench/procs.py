"""The processes the benchmark starts, and what the kernel says they cost.

CPU time comes from ``/proc/PID/stat`` (utime + stime, in clock ticks), peak memory from
``VmHWM`` in ``/proc/PID/status``, the whole machine's busy time from ``/proc/stat``: the same
accounting ``top`` uses, read before and after each load run.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


_handed_out: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, and not one this process handed out before: the kernel can
    give a released port again at once, and two services on one port fail to start."""
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no new free port after 1000 tries ({len(_handed_out)} handed out)")


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name: [0] is state (field 3)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def children(pid: int) -> list[int]:
    """Every live descendant of ``pid``."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def cpu_seconds(pid: int, *, reaped: bool = False) -> float:
    """utime + stime of ``pid`` (plus its reaped children's with ``reaped``); 0 if gone."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / TICK


def user_system_seconds(pid: int) -> tuple[float, float]:
    """utime and stime of ``pid``, apart: the interpreter's work, and the kernel's."""
    fields = _stat(pid)
    if fields is None:
        return 0.0, 0.0
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def tree_cpu_seconds(pid: int) -> float:
    """CPU of ``pid``, its live descendants, and the descendants it has already reaped.

    A PostgreSQL backend that exits during a run moves its time into the postmaster's cutime,
    so the sum stays continuous as connections come and go.
    """
    return cpu_seconds(pid, reaped=True) + sum(cpu_seconds(kid) for kid in children(pid))


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the most resident memory ``pid`` has had since it started."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def system_busy_seconds() -> float:
    """CPU time the whole machine spent not idle, summed over cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values[:8]) - idle) / TICK


def listen_overflows() -> int:
    """Connections the kernel dropped because a listen queue was full (TcpExt, whole host)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            return int(dict(zip(names.split(), values.split(), strict=True))["ListenOverflows"])
    return 0


def reaped_children_seconds() -> float:
    """CPU of this process's waited-for children (the load generators)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Window:
    """CPU spent by named processes, by load generators and by everything else, over a span."""

    probes: dict[str, Callable[[], float]]
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    loadgen: float = 0.0
    others: float = 0.0  # in cores: what other programs on the machine used meanwhile

    def __post_init__(self) -> None:
        self._before = {name: probe() for name, probe in self.probes.items()}
        self._busy = system_busy_seconds()
        self._reaped = reaped_children_seconds()

    def close(self) -> Window:
        self.seconds = time.monotonic() - self.started
        self.cpu = {name: probe() - self._before[name] for name, probe in self.probes.items()}
        self.loadgen = reaped_children_seconds() - self._reaped
        busy = system_busy_seconds() - self._busy
        ours = sum(self.cpu.values()) + self.loadgen
        self.others = max(0.0, busy - ours) / max(self.seconds, 1e-9)
        return self


class Service:
    """A long-running child process (proxy, upstream), its output in a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        port: int,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.log_path = log_path
        with log_path.open("wb") as log:
            # A session of its own: a Ctrl-C meant for the benchmark does not reach it, and
            # stop() ends it in order.
            self.process = subprocess.Popen(
                list(argv), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=None if env is None else {**os.environ, **env},
            )  # fmt: skip
        self.pid = self.process.pid

    def wait_listening(self, within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.process.returncode}):\n{self.tail()}"
                )
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} is not listening:\n{self.tail()}") from None
                time.sleep(0.05)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def pids(self) -> list[int]:
        return [self.pid, *children(self.pid)]

    def cpu(self) -> float:
        return tree_cpu_seconds(self.pid)

    def peak_rss(self) -> dict[int, int]:
        """VmHWM of the process and of each descendant (workers, if it ever forks any)."""
        return {pid: peak_rss_bytes(pid) for pid in self.pids()}

    def stop(self, within: float = 15.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``within`` seconds."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(within)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
