"""``workers: N``: processes on the supervisor's listeners and configuration, their metrics added
up; a dead or hung worker replaced without losing queued connections; drain."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

import proxy
from proxy import config, server, shared_port, supervisor
from tests.helpers import (
    FakeUpstream,
    Serve,
    Served,
    Stream,
    accepted_by,
    claimed,
    free_port,
    open_stream,
    read_answer,
    run_cli,
    serve_settings,
    wait_until,
    webhook_request,
)

WITHIN = 20.0  # bound on every wait for an answer (a retry may wait claim_wait on a lock)

SETTINGS = {  # two workers (the default is one)
    "workers": 2,
    "upstream": {"timeout": "10s"},
    "database": {"pool_size": 3},
    "shutdown_timeout": "10s",
}


async def listening(served: Served, count: int) -> None:
    """Wait until ``count`` workers have logged that they listen (replacements included)."""

    async def enough() -> bool:
        return sum(1 for x in served.lines() if x["msg"].startswith("listening")) >= count

    await wait_until(enough, f"{count} workers listening", within=60)


@pytest.fixture
def start(serve: Serve) -> Serve:
    """Start ``serve`` with ``workers: 2`` (as conftest's ``serve``), once both listen."""

    async def run(**overrides: Any) -> Served:
        served = await serve(**{**SETTINGS, **overrides})
        await listening(served, 2)
        return served

    return run


@pytest.fixture
async def supervised(start: Serve) -> Served:
    return await start()


def config_file(tmp_path: Path, dsn: str, table: str, **overrides: Any) -> Path:
    """A two-worker configuration on free ports, for an app nothing listens on."""
    settings = serve_settings("http://127.0.0.1:9", dsn, table, **{**SETTINGS, **overrides})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _post(url: str, event_id: str) -> aiohttp.ClientResponse:
    # A connection per request, so that either worker may accept each.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        response = await s.post(f"{url}/webhooks/corvel", data=json.dumps({"id": event_id}))
        await response.read()
        return response


def test_each_workers_start_up_line_says_where_the_console_is(supervised: Served) -> None:
    """The console is found from the log too, not only from ``check`` (a new user's first
    look is the start-up output)."""
    started = [x["msg"] for x in supervised.lines() if x["msg"].startswith("listening")]

    assert len(started) == 2
    assert all(f"console at {supervised.admin_url}/console/" in msg for msg in started)


async def test_workers_share_the_port_and_add_up_their_metrics(
    supervised: Served, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    ids = [f"evt_{n}" for n in range(30)]
    # Whichever worker is idle first accepts a connection from the shared queue: each half is
    # sent while the other worker is stopped, so that both certainly serve.
    first: list[aiohttp.ClientResponse] = []
    for paused, half in zip(supervised.workers(), (ids[:15], ids[15:]), strict=True):
        os.kill(paused, signal.SIGSTOP)
        try:
            first += await asyncio.gather(*(_post(supervised.url, i) for i in half))
        finally:
            os.kill(paused, signal.SIGCONT)
    again = await asyncio.gather(*(_post(supervised.url, i) for i in ids))

    assert [r.status for r in first + again] == [200] * 60
    assert [r.headers.get("Dedup-Status") for r in again] == ["duplicate"] * 30
    assert sorted(json.loads(b)["id"] for b in upstream.bodies()) == sorted(ids)
    assert len(await claimed(pg_dsn, table)) == 30
    served_by = {x["worker"] for x in supervised.lines() if x.get("outcome")}
    assert served_by == {1, 2}

    processed = 'dedup_requests_total{outcome="processed",route="corvel"}'
    duplicate = 'dedup_requests_total{outcome="duplicate",route="corvel"}'

    async def both_counted() -> bool:
        # The worker not answering the scrape writes its counts every second.
        samples = await supervised.metrics()
        return (samples.get(processed), samples.get(duplicate)) == (30, 30)

    await wait_until(both_counted, "both workers' requests in the counters")

    async def both_pools() -> bool:
        return (await supervised.metrics()).get("dedup_database_connections") == 6

    await wait_until(both_pools, "both workers' pools in the gauge (2 x pool_size 3)")
    # One release, one series: not one per worker.
    samples = await supervised.metrics()
    build = {name: value for name, value in samples.items() if name.startswith("dedup_build_info")}
    assert list(build.values()) == [1]
    assert f'version="{proxy.__version__}"' in next(iter(build))


@pytest.mark.skipif(not shared_port.balanced(), reason="SO_REUSEPORT balancing is Linux's")
async def test_kept_alive_connections_spread_over_the_workers(
    supervised: Served, upstream: FakeUpstream
) -> None:
    # An ingress's pool of 32 connections, opened while one worker is busy (stopped, here, for
    # 0.1 s), each then carrying 5 webhooks. From one shared queue the
    # worker awake took every connection, and kept them: the other then served nothing. The
    # kernel hashes each connection to one worker's own socket, where it waits for that worker
    # (its sibling adopts only what it sees waiting at two looks 0.25 s apart): all 32 on one
    # of two, 2 in 2**32.
    busy = supervised.workers()[0]
    os.kill(busy, signal.SIGSTOP)
    try:
        streams = await asyncio.gather(*(open_stream(supervised.port) for _ in range(32)))
        await asyncio.sleep(0.1)  # the other worker accepts what it may meanwhile
    finally:
        os.kill(busy, signal.SIGCONT)
    try:
        for round_ in range(5):
            for n, (_, writer) in enumerate(streams):
                writer.write(webhook_request(f"evt_ka_{round_}_{n}"))
            answers = [await read_answer(reader) for reader, _ in streams]
            assert [a.status if a else None for a in answers] == [200] * 32
    finally:
        for _, writer in streams:
            writer.close()

    def served() -> list[int]:
        return [x["worker"] for x in supervised.lines() if x.get("outcome") == "processed"]

    async def logged() -> bool:
        return len(served()) == 160

    await wait_until(logged, "every webhook's log line")
    assert len(upstream.requests) == 160
    assert set(served()) == {1, 2}
    assert not any(x["msg"].startswith("adopted") for x in supervised.lines())


@pytest.mark.skipif(not shared_port.balanced(), reason="SO_REUSEPORT balancing is Linux's")
async def test_a_stopped_workers_queue_is_adopted_by_its_sibling(
    supervised: Served, upstream: FakeUpstream
) -> None:
    # At start-up a worker leaves a sibling's queue to that sibling for a while.
    await asyncio.sleep(shared_port.STARTUP_GRACE)
    paused = supervised.workers()[0]
    os.kill(paused, signal.SIGSTOP)  # as hung as a worker gets: the watchdog's 30 s are far
    try:
        # Connections the kernel hashes to the stopped worker's socket wait there until its
        # sibling, looking at the queue every second, adopts them.
        streams = [await _send(supervised.port, f"evt_adopt_{n}") for n in range(24)]
        outcomes = await asyncio.gather(*(_outcome(s) for s, _ in streams))
    finally:
        os.kill(paused, signal.SIGCONT)
    assert outcomes == ["200"] * 24
    assert len(upstream.requests) == 24
    served = {x["worker"] for x in supervised.lines() if x.get("outcome") == "processed"}
    assert len(served) == 1  # the running one, its own connections and the adopted ones
    adopted = [x for x in supervised.lines() if x["msg"].startswith("adopted")]
    # 24 connections, none hashed to the stopped worker's socket: odds of 1 in 2**24.
    assert adopted
    assert {x["worker"] for x in adopted} == served


async def test_a_killed_worker_is_replaced_and_sigterm_stops_every_worker(
    supervised: Served, upstream: FakeUpstream
) -> None:
    workers = supervised.workers()
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)

    async def replaced() -> bool:
        current = supervised.workers()
        return len(current) == 2 and workers[0] not in current

    await wait_until(replaced, "a new worker in place of the killed one", within=30)
    await listening(supervised, 3)
    assert any("starting a new one" in x["msg"] for x in supervised.lines())
    responses = await asyncio.gather(*(_post(supervised.url, f"evt_r{n}") for n in range(10)))
    assert [r.status for r in responses] == [200] * 10

    survivors = supervised.workers()
    supervised.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(supervised.process.wait(), timeout=30) == 0
    assert not any(_alive(pid) for pid in survivors)
    assert sum(1 for x in supervised.lines() if x["msg"] == "stopped") == 2


async def _run_to_exit(path: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``serve`` on ``path`` to its end: its exit status and everything it printed."""
    code, out, err = await run_cli("serve", "--config", str(path), env=env)
    return code, out + err


async def test_a_taken_port_stops_the_supervisor_before_any_worker_starts(
    tmp_path: Path, pg_dsn: str, table: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = config_file(tmp_path, pg_dsn, table, listen=f"127.0.0.1:{port}")
        code, text = await _run_to_exit(path)

    assert code == 1
    assert f"cannot listen on http://127.0.0.1:{port}" in text
    assert '"worker":' not in text  # the supervisor binds first: no worker ever logged
    assert "Traceback" not in text


async def test_a_worker_that_cannot_start_stops_the_supervisor(tmp_path: Path, table: str) -> None:
    """Workers started during an outage listen and wait; at start_timeout the first to give up
    stops the supervisor, rather than be replaced by another that waits again."""
    unreachable = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"
    path = config_file(
        tmp_path, unreachable, table, database={"connect_timeout": "1s", "start_timeout": "2s"}
    )
    code, text = await _run_to_exit(path)

    assert code == 1
    assert "the database did not answer within 2s (database.start_timeout)" in text
    assert "could not start (exit code 3); stopping" in text
    assert "starting a new one" not in text
    assert "Traceback" not in text


async def test_a_heartbeat_timeout_below_two_beats_is_a_start_up_error(
    tmp_path: Path, pg_dsn: str, table: str
) -> None:
    path = config_file(tmp_path, pg_dsn, table)
    code, text = await _run_to_exit(path, env={supervisor.TIMEOUT_ENV: "1"})

    assert code == 1
    assert f"{supervisor.TIMEOUT_ENV} must be a number of seconds, at least 2; got '1'" in text
    assert "Traceback" not in text


def _homes(tmp: Path) -> set[Path]:
    """The supervisors' private directories in ``tmp``."""
    return {path for path in tmp.iterdir() if path.name.startswith("dedup-proxy-")}


async def test_a_supervisor_restarted_after_a_kill_binds_beside_the_draining_workers(
    start: Serve, upstream: FakeUpstream, tmp_path: Path
) -> None:
    (tmp := tmp_path / "tmp").mkdir()
    env = {"TMPDIR": str(tmp)}
    old = await start(env=env, shutdown_timeout="60s", upstream={"timeout": "60s"})  # a long drain
    (old_home,) = _homes(tmp)
    upstream.gate = asyncio.Event()
    in_flight = asyncio.ensure_future(_post(old.url, "evt_draining"))
    await upstream.arrived.wait()
    orphans = old.workers()
    try:
        old.process.kill()
        await old.process.wait()
        # The orphan holding the request drains, its admin listener still open, while the new
        # supervisor binds both ports and starts its workers.
        new = await start(env=env, again=old)
        assert any(_alive(pid) for pid in orphans)
        # Its workers still use the old supervisor's directory (their metrics files): kept.
        assert old_home in _homes(tmp)
        upstream.gate.set()
        assert (await asyncio.wait_for(in_flight, WITHIN)).status == 200
        responses = await asyncio.gather(*(_post(new.url, f"evt_new{n}") for n in range(5)))
        assert [r.status for r in responses] == [200] * 5
    finally:
        upstream.gate.set()
        for pid in orphans:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


async def test_a_killed_supervisors_directory_is_removed_at_the_next_start(
    start: Serve, tmp_path: Path
) -> None:
    (tmp := tmp_path / "tmp").mkdir()
    env = {"TMPDIR": str(tmp)}
    live = await start(env=env)  # another supervisor on the same machine, still running
    (live_home,) = _homes(tmp)
    killed = await start(env=env)
    (killed_home,) = _homes(tmp) - {live_home}
    workers = killed.workers()
    killed.process.kill()
    await killed.process.wait()

    async def gone() -> bool:
        return not any(_alive(pid) for pid in workers)

    await wait_until(gone, "the orphaned workers to drain and exit", within=30)
    assert killed_home in _homes(tmp)  # the kill left it: nothing could remove it then

    again = await start(env=env, again=killed)
    assert _homes(tmp) - {live_home, killed_home}  # the new supervisor's own
    assert killed_home not in _homes(tmp)
    assert live_home in _homes(tmp)
    assert (await _post(live.url, "evt_live")).status == 200
    assert (await _post(again.url, "evt_again")).status == 200


async def test_workers_drain_and_exit_when_the_supervisor_is_killed(
    supervised: Served,
) -> None:
    workers = supervised.workers()
    supervised.process.kill()  # no SIGTERM to pass on: the workers must notice by themselves
    await supervised.process.wait()

    async def gone() -> bool:
        return not any(_alive(pid) for pid in workers)

    await wait_until(gone, "the orphaned workers to drain and exit", within=30)
    assert sum(1 for x in supervised.lines() if x["msg"] == "the supervisor is gone: draining") == 2


async def _send(port: int, event_id: str) -> tuple[Stream, int]:
    """A new connection carrying one webhook, and the client's port (unanswered yet)."""
    reader, writer = await open_stream(port)
    writer.write(webhook_request(event_id, b"Connection: close"))
    await writer.drain()
    return (reader, writer), writer.get_extra_info("sockname")[1]


async def _outcome(stream: Stream) -> str | None:
    """The answer's status, with its Dedup-Status if any (``200 duplicate``; the app's own
    answer has none), or None when the connection closed without an answer."""
    reader, writer = stream
    try:
        answer = await read_answer(reader, WITHIN)
    finally:
        writer.close()
    if answer is None:
        return None
    return " ".join(filter(None, (str(answer.status), answer.headers.get("dedup-status"))))


def _queued(port: int) -> int:
    """Connections waiting in the accept queues of the listeners on ``port``, taken by no one."""
    waiting = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
            waiting += int(fields[4].partition(":")[2], 16)
    return waiting


async def test_a_worker_killed_under_load_loses_only_the_connections_it_had_accepted(
    start: Serve, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    proxy = await start(database={"pool_size": 8})
    upstream.gate = asyncio.Event()  # the app holds every request until the kill
    held = {f"evt_held_{n}": await _send(proxy.port, f"evt_held_{n}") for n in range(8)}

    async def at_the_app() -> bool:
        return len(upstream.requests) == len(held)

    await wait_until(at_the_app, "every held request claimed and forwarded")
    workers = proxy.workers()
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)  # from here on no worker accepts a connection
    accepted = {pid: accepted_by(pid, proxy.port) for pid in workers}
    assert sorted(p for ports in accepted.values() for p in ports) == sorted(
        port for _, port in held.values()
    )
    victim, survivor = sorted(workers, key=lambda pid: len(accepted[pid]), reverse=True)
    queued = {f"evt_queued_{n}": await _send(proxy.port, f"evt_queued_{n}") for n in range(20)}

    async def in_the_queue() -> bool:
        return _queued(proxy.port) == len(queued)

    await wait_until(in_the_queue, "the new connections waiting in the listen queue")
    os.kill(victim, signal.SIGKILL)
    os.kill(survivor, signal.SIGCONT)
    upstream.gate.set()
    after = {f"evt_after_{n}": await _send(proxy.port, f"evt_after_{n}") for n in range(10)}
    streams = {**held, **queued, **after}
    outcomes = dict(
        zip(streams, await asyncio.gather(*(_outcome(s) for s, _ in streams.values())), strict=True)
    )

    taken = {i for i, (_, port) in held.items() if port in accepted[victim]}
    assert taken  # the killed worker had requests in flight (8 held, 2 workers)
    assert {i for i, outcome in outcomes.items() if outcome is None} == taken
    assert {outcomes[i] for i in streams if i not in taken} == {"200"}
    # What failed was claimed but never committed; the app saw every event once.
    assert {row[1] for row in await claimed(pg_dsn, table)} == set(streams) - taken
    assert sorted(json.loads(b)["id"] for b in upstream.bodies()) == sorted(streams)
    # The provider's retry of a failed one goes through: its claim was rolled back.
    retries = [await _send(proxy.port, i) for i in sorted(taken)]
    assert [await _outcome(s) for s, _ in retries] == ["200"] * len(taken)


async def test_a_hung_worker_is_killed_and_replaced(start: Serve) -> None:
    proxy = await start(env={supervisor.TIMEOUT_ENV: "5"})
    workers = proxy.workers()
    os.kill(workers[0], signal.SIGSTOP)  # its event loop no longer turns
    # Meanwhile the other worker takes every new connection from the shared queue.
    responses = await asyncio.gather(*(_post(proxy.url, f"evt_h{n}") for n in range(10)))
    assert [r.status for r in responses] == [200] * 10

    async def replaced() -> bool:
        current = proxy.workers()
        return len(current) == 2 and workers[0] not in current

    await wait_until(replaced, "the hung worker killed and replaced", within=30)
    await listening(proxy, 3)
    assert workers[1] in proxy.workers()
    assert any("sent no heartbeat for 5s: killing it" in x["msg"] for x in proxy.lines())


async def test_a_restarted_worker_runs_the_configuration_the_supervisor_started_with(
    start: Serve,
) -> None:
    proxy = await start()
    edited = yaml.safe_load(proxy.config_file.read_text())
    edited["routes"][0]["event_id"] = "header:X-Event-Id"  # would refuse these webhooks: 400
    proxy.config_file.write_text(yaml.safe_dump(edited))
    config.load(proxy.config_file)  # a valid configuration: a worker could have started on it
    workers = proxy.workers()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)

    async def replaced() -> bool:
        current = proxy.workers()
        return len(current) == 2 and not set(workers) & set(current)

    await wait_until(replaced, "both workers replaced", within=30)
    await listening(proxy, 4)
    responses = await asyncio.gather(*(_post(proxy.url, f"evt_c{n}") for n in range(10)))
    assert [r.status for r in responses] == [200] * 10


async def test_a_second_instance_on_a_taken_address_exits_naming_it(
    supervised: Served, tmp_path: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> None:
    # SO_REUSEPORT would let a second supervisor of the same user join both ports' groups,
    # and the kernel would split the webhooks and the scrapes between the two proxies.
    public = f"127.0.0.1:{supervised.port}"
    admin = f"127.0.0.1:{supervised.admin_port}"
    for key, settings in (
        ("listen", {"listen": public}),
        ("admin.listen", {"admin": {"listen": admin}}),
    ):
        (tmp := tmp_path / key).mkdir()
        code, text = await _run_to_exit(config_file(tmp, pg_dsn, table, **settings))
        taken = public if key == "listen" else admin
        assert code == 1, text
        assert f"cannot listen on http://{taken} ({key}): Address already in use" in text
        assert '"worker":' not in text
    responses = await asyncio.gather(*(_post(supervised.url, f"evt_one_{n}") for n in range(10)))
    assert [r.status for r in responses] == [200] * 10
    assert len(upstream.requests) == 10


@pytest.mark.skipif(not shared_port.balanced(), reason="SO_REUSEPORT balancing is Linux's")
async def test_another_program_in_the_ports_group_stops_the_supervisor(
    tmp_path: Path, pg_dsn: str, table: str
) -> None:
    """A program of the same user listening with SO_REUSEPORT (as nginx's ``reuseport`` does)
    would let the supervisor's sockets join its group."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("0.0.0.0", 0))  # the wildcard: over 127.0.0.1 too
        other.listen()
        port = other.getsockname()[1]
        path = config_file(tmp_path, pg_dsn, table, listen=f"127.0.0.1:{port}")
        code, text = await _run_to_exit(path)

    assert code == 1, text
    assert f"cannot listen on http://127.0.0.1:{port} (listen): Address already in use" in text


def test_a_worker_reads_what_its_supervisor_handed_it_once() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    handed = supervisor.WorkerEnvironment(
        number=2,
        listeners=server.Listeners(public=(listener,), admin=()),
        beat=7,
        lifeline=8,
        dsn="postgresql://u@db/events",
    )
    environ = {"PATH": "/usr/bin", **handed.to_environ()}
    read = supervisor.WorkerEnvironment.from_environ(environ)
    listener.detach()  # the worker's socket owns the descriptor now, as in a worker
    assert read is not None
    assert read.listeners is not None
    with read.listeners.public[0] as public:
        assert public.getsockname() == address
    assert (read.number, read.beat, read.lifeline, read.dsn, read.listeners.admin) == (
        2,
        7,
        8,
        "postgresql://u@db/events",
        (),
    )
    # Taken out as it is read: nothing the worker starts sees them.
    assert environ == {"PATH": "/usr/bin"}
    assert supervisor.WorkerEnvironment.from_environ(environ) is None


def test_a_directory_named_after_this_pid_is_a_leftover(tmp_path: Path) -> None:
    """PID 1 in a restarted container: the killed supervisor had the PID of the new one."""
    mine = tmp_path / f"dedup-proxy-{os.getpid()}-abcd1234"
    (mine / "metrics").mkdir(parents=True)
    (mine / "config.yaml").write_text("listen: 127.0.0.1:1\n")

    draining = supervisor._remove_leftovers(tmp_path)
    assert not mine.exists()
    assert draining == set()


def test_a_directory_named_after_this_pid_is_kept_while_its_workers_drain(
    tmp_path: Path,
) -> None:
    mine = tmp_path / f"dedup-proxy-{os.getpid()}-abcd1234"
    mine.mkdir()
    (mine / supervisor.ADDRESSES).write_text("127.0.0.1 8080\n127.0.0.1 9090\n")
    held = os.open(mine, os.O_RDONLY | os.O_DIRECTORY)  # as a draining worker holds it
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert supervisor._remove_leftovers(tmp_path) == {"127.0.0.1 8080", "127.0.0.1 9090"}
        assert mine.exists()
    finally:
        os.close(held)
    assert supervisor._remove_leftovers(tmp_path) == set()
    assert not mine.exists()


class _Traffic:
    """Webhooks sent back to back, each on a new connection (so that every worker, old and
    new, takes some), by ``lanes`` senders until ``stop``; every outcome kept."""

    def __init__(self, url: str, lanes: int = 2) -> None:
        self.url = url
        self.outcomes: list[int | str] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._send(lane)) for lane in range(lanes)]

    async def _send(self, lane: int) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                response = await asyncio.wait_for(_post(self.url, f"evt_t{lane}_{n}"), WITHIN)
                self.outcomes.append(response.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.outcomes.append(repr(exc))
            n += 1

    async def until(self, count: int) -> None:
        async def enough() -> bool:
            return len(self.outcomes) >= count

        await wait_until(enough, f"{count} webhooks answered", within=60)

    async def stop(self) -> list[int | str]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.outcomes


def _logged(served: Served, start: str) -> list[dict[str, Any]]:
    return [x for x in served.lines() if x["msg"].startswith(start)]


async def _hangup(served: Served, start: str, count: int = 1) -> dict[str, Any]:
    """SIGHUP the supervisor and wait for its ``count``-th line starting with ``start``."""
    served.process.send_signal(signal.SIGHUP)

    async def logged() -> bool:
        return len(_logged(served, start)) >= count

    await wait_until(logged, f"the supervisor to log {start!r}", within=60)
    return _logged(served, start)[count - 1]


def _peak_rss(pid: int) -> int:
    """The most memory process ``pid`` has held (VmHWM), in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1])


async def test_sighup_on_a_file_swapped_for_a_huge_one_or_dev_zero_reads_a_bounded_prefix(
    supervised: Served,
) -> None:
    before = _peak_rss(supervised.process.pid)
    supervised.config_file.unlink()
    with supervised.config_file.open("wb") as file:
        file.truncate(100 * 1024 * 1024)  # sparse: 100 MiB of NULs that take no disk
    huge = await _hangup(supervised, "reload refused")
    assert "not a configuration file: larger than 1 MiB" in huge["msg"]
    assert _peak_rss(supervised.process.pid) - before < 16 * 1024
    # Read whole, /dev/zero would take the supervisor's memory until there is none.
    supervised.config_file.unlink()
    supervised.config_file.symlink_to("/dev/zero")
    zero = await _hangup(supervised, "reload refused", count=2)
    assert "not a configuration file: larger than 1 MiB" in zero["msg"]
    assert _peak_rss(supervised.process.pid) - before < 16 * 1024
    assert len(supervised.workers()) == 2
    assert supervised.process.returncode is None


async def test_a_reload_names_the_operators_file_and_says_what_it_changed(
    supervised: Served,
) -> None:
    settings = yaml.safe_load(supervised.config_file.read_text())
    supervised.config_file.write_text("routes: [\n  {name: broken\n")  # not YAML
    refused = await _hangup(supervised, "reload refused")
    secret = "s3cret-never-logged"
    settings["claim_wait"] = "7s"
    settings["database"]["pool_size"] = 5
    settings["routes"][0]["retention"] = "2d"
    settings["routes"].append({"name": "signed", "path": "/signed", "preset": "github",
                               "verify": {"secret": secret}})  # fmt: skip
    supervised.config_file.write_text(yaml.safe_dump(settings))
    reloaded = await _hangup(supervised, "reloaded")

    # Before: 'in "/tmp/dedup-proxy-…/next-config.yaml", line 3', the supervisor's own copy.
    assert f'in "{supervised.config_file}", line' in refused["msg"], refused["msg"]
    assert "next-" not in refused["msg"]
    # Before: "reloaded …: 2 workers replaced in 1.2s", and nothing of what changed.
    assert reloaded["msg"].endswith(
        "database.pool_size; claim_wait; routes added: signed; route corvel: retention"
    ), reloaded["msg"]
    assert secret not in json.dumps(supervised.lines())


async def _duplicate_on(url: str, path: str, event_id: str) -> str | None:
    """The Dedup-Status of a second copy of ``event_id`` to ``path`` (None: not claimed)."""
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(url + path, data=json.dumps({"id": event_id})) as response:
                assert response.status == 200
                status = response.headers.get("Dedup-Status")
    return status


async def test_sighup_reloads_worker_by_worker_under_traffic(start: Serve) -> None:
    proxy = await start()
    settings = yaml.safe_load(proxy.config_file.read_text())
    # Before the reload a path no route has is passed through, unclaimed.
    assert await _duplicate_on(proxy.url, "/webhooks/added", "evt_before") is None
    old_workers = proxy.workers()
    traffic = _Traffic(proxy.url)
    try:
        await traffic.until(20)
        settings["routes"].append(
            {"name": "added", "path": "/webhooks/added", "event_id": "body:/id"}
        )
        proxy.config_file.write_text(yaml.safe_dump(settings))
        reloaded = await _hangup(proxy, "reloaded")
        answered = len(traffic.outcomes)
        await traffic.until(answered + 20)  # the new workers serve the steady traffic

        # A broken file is refused with its errors, and the running configuration serves on.
        broken = {**settings, "claim_wait": "soon"}
        proxy.config_file.write_text(yaml.safe_dump(broken))
        refused = await _hangup(proxy, "reload refused")
        # So is one that changes what only a restart applies.
        proxy.config_file.write_text(yaml.safe_dump({**settings, "workers": 3}))
        restart = await _hangup(proxy, "reload refused", count=2)
        answered = len(traffic.outcomes)
        await traffic.until(answered + 20)
    finally:
        outcomes = await traffic.stop()

    assert len(outcomes) >= 60
    assert outcomes == [200] * len(outcomes)  # no connection refused, no request dropped
    assert "2 workers replaced" in reloaded["msg"]
    assert f"invalid configuration in {proxy.config_file}:\n  claim_wait:" in refused["msg"]
    assert "workers changed, which only a restart applies" in restart["msg"]
    assert await _duplicate_on(proxy.url, "/webhooks/added", "evt_after") == "duplicate"

    async def old_gone() -> bool:
        return not any(_alive(pid) for pid in old_workers)

    await wait_until(old_gone, "the replaced workers to drain and exit", within=30)
    assert len(proxy.workers()) == 2
    assert proxy.process.returncode is None
