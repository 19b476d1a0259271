"""A randomized Jepsen-style fault campaign against real ``dedup-proxy serve`` processes.

Set-up: a PostgreSQL of the campaign's own (so it can be restarted), one fault relay per replica
between that replica and PostgreSQL, 2-3 replicas, a fake app with random latency and 5xx, and a
fake provider delivering each event 1-5 times to random replicas and retrying with back-off.
A nemesis meanwhile kills replicas (``kill -9``, then restarts them), restarts PostgreSQL,
blackholes, resets or refuses a replica's database link and makes the app slow. Afterwards every
event not yet acknowledged is redelivered until it is (the settle phase), the database and every
replica's pool are checked for leftovers, and ``checker.check`` judges the history.

With ``--inbox`` the route redelivers (``redeliver``, a schedule of seconds) and the provider is
GitHub's: each event sent 1-3 times, a failure never retried, any 2xx (``queued`` and
``duplicate_queued`` included) taken as accepted. The settle phase then only waits until no row
is pending and the app has every accepted event; an event whose every send failed was refused
(the provider was told to retry), which the checker tells apart from a loss. Flow control is
set up as its user would (``Settings.with_inbox``): ``upstream.concurrency`` per replica, with a
pool sized for it and for the short transactions beside it, so a delivery over the limit is
kept (``202``, ``kept_for: limit``); the route's ``hand_off``
at 0.7 of ``upstream.timeout``, so one the app is slow on is kept at the hand-off (``kept_for:
deadline``) while the attempt goes on; ``claim_wait`` past the hand-off, so a copy finds a slow
delivery kept rather than still in flight.

With ``--reconcile`` (and ``--inbox``) the provider is GitHub itself: each send is signed as
GitHub signs it and logged in a stand-in of GitHub's hook deliveries API with the proxy's answer
(a cut connection: failed), and the route (GitHub's preset) has ``reconcile:`` pointing its
``api_url`` at the stand-in, every 10 s. The replicas' reconciler runs on its schedule through
the nemesis; asked to redeliver, the stand-in sends the event again (``reconcile_sender``).
After the nemesis the campaign waits (bounded) until every event sent has reached the app and
one reconcile run more has found no gap. An event whose every send was refused must then have
been recovered, and the reconciler must never have asked for an event with a claim
(``reconcile_rules``).

The database can be another set-up (``databases``), with the same checker and invariant:

- ``--pgbouncer``: the replicas reach PostgreSQL through a real PgBouncer in transaction pooling
  mode, with the settings docs/deployment.md recommends (``tests/pgbouncer.py``). The relays
  sit between each replica and PgBouncer, so a link fault still cuts one replica off;
  ``pg_restart`` restarts the PostgreSQL behind PgBouncer, which stays up. Nothing new is
  excused: a claim's transaction dies with its server connection as it does without the
  pooler, and a COMMIT PgBouncer relays as acknowledged is the server's own.
- ``--failover``: a PostgreSQL 15 primary and a standby replicating synchronously
  (``tests/replication.py``); each replica's DSN lists both servers, each through a relay of its
  own (so a link fault cuts the replica off both), with ``target_session_attrs=read-write``.
  Instead of restarting PostgreSQL the nemesis fails over: it kills the primary (SIGKILL), promotes
  the standby, and a moment later rebuilds the old primary as the new one's standby, so that the
  next failover has one. The first round's second action is a failover, so even a short run has
  one. No acknowledged event may be lost (a COMMIT acknowledged was on the standby first: a
  second forward after a claim logged committed is ``forwarded_after_commit``), and the only
  new window for a second delivery is an app call straddling the kill.

With ``--receipts`` (with any of the above) the route has ``receipt``, in the app's own
database: a PostgreSQL of its own that the nemesis leaves alone. The app credits a ledger there
and writes the ``Dedup-Receipt`` in the same transaction (``ledger_app``), and the checker
counts effects committed twice, read from the ledger, with no window to excuse one
(``receipt_rule``).

With ``--ordering`` (with or without ``--inbox``) the events are versions of a few hundred
objects (``VERSIONS_PER_OBJECT`` each): Stripe's shape, ``data.object.id`` and ``created`` (a
strictly increasing integer per object), of type ``ORDER_TYPE``. The route has ``order: {key:
body:/data/object/id, version: body:/created, supersede: [ORDER_TYPE]}``. The sender interleaves
a few objects at a time, so that an object's versions are in flight together, and sends some
versions before the one older (``OUT_OF_ORDER``); the copies and the retries reorder more, as
providers do. The app applies each version last-writer-wins when it answers 2xx and keeps each
object's version; ``order_rules`` adds the ordering invariants to the checker's.

With ``--shared-limit N`` (and ``--inbox``) every replica has ``upstream.concurrency: {limit:
N, shared: true}`` on the one claim table (each replica's own room what its pool allows, up
to N). The app records, besides each call's start and end, when the proxy's connection
closed before the answer (``UpstreamCall.dropped``): its ``upstream.timeout`` fired or its
replica was killed, and the place went with the transaction's ROLLBACK or its dead connection.
``limit_rules`` adds: at no instant more than N calls at the app that a proxy still waits on,
but for those whose place a database fault freed under them; after the nemesis, every place
is free.

Each replica reaches the app on a port of its own, so the app knows which replica sent a call,
a redelivery included (it carries the headers of the delivery it redelivers).

Run it on demand (exit status 1 on any violation)::

    python -m tests.faults.campaign --minutes 5 [--replicas 3] [--seed S] [--events K] [--inbox]
    python -m tests.faults.campaign --minutes 5 --inbox --reconcile
    python -m tests.faults.campaign --minutes 5 --pgbouncer
    python -m tests.faults.campaign --minutes 5 --failover
    python -m tests.faults.campaign --minutes 5 --receipts [--inbox] [--pgbouncer | --failover]
    python -m tests.faults.campaign --minutes 4 --ordering [--inbox]
    python -m tests.faults.campaign --minutes 4 --inbox --shared-limit 4
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import contextlib
import itertools
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import asyncpg
import yaml
from aiohttp import web

from proxy import app_limit, config, embedded, errors
from proxy.database import pool, slots, sql
from tests.faults import (
    checker,
    databases,
    ledger_app,
    limit_rules,
    order_rules,
    reconcile_rules,
    reconcile_sender,
)
from tests.faults.relay import Mode
from tests.helpers import accepts, free_port

ROOT = Path(__file__).resolve().parents[2]
ROUTE = "camp"
HOOK = "/hook"
KINDS = ("kill", "pg_restart", "blackhole", "reset", "refuse", "latency")
_WEIGHTS = {"kill": 2, "pg_restart": 1, "blackhole": 2, "reset": 2, "refuse": 1, "latency": 2}
_WEIGHTS["failover"] = _WEIGHTS["pg_restart"]  # in its place, with a primary and a standby
_DATABASE_FAULTS = frozenset({"pg_restart", "failover"})
_LINK_FAULTS: dict[str, Mode] = {"blackhole": "blackhole", "reset": "reset", "refuse": "refuse"}
_LINK_HOLD = {"blackhole": (1.0, 4.0), "reset": (0.0, 0.5), "refuse": (0.5, 2.5)}
_POLL = 0.05
RESTART_WITHIN = 30.0  # a killed replica must listen again within this
HAND_OFF_SHARE = 0.7  # of upstream.timeout, as the presets' hand_off is of the deadline
INBOX_CLAIM_WAIT = 2.0  # past the hand_off (1.4 s) and its COMMIT
# The inbox mode's limit at the app per replica, and the connections beside it for the short
# transactions (a delivery kept, a copy settled, a hand-off's result, the redeliverer's reads),
# by Little's law: while the app is slow every delivery is kept, some 25 a second per replica
# here, each transaction up to 0.2 s on two shared cores. One connection (the fifth of a pool
# of 4 the limit keeps free) was measured to shed 50 deliveries in 4 minutes (docs/guarantees.md).
INBOX_CONCURRENCY = 3
INBOX_SHORT_TRANSACTIONS = 5
# --ordering: each object's versions, the objects interleaved at a time in the send order, and
# the share of versions sent before the one older.
VERSIONS_PER_OBJECT = 10
ACTIVE_OBJECTS = 8
OUT_OF_ORDER = 0.15
ORDER_TYPE = "customer.updated"
FIRST_VERSION = 1_700_000_000  # ``created``: whole seconds, as Stripe's


class CampaignError(Exception):
    """The harness itself could not carry on (not a finding about the proxy)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """The replicas' configuration and the provider's behaviour."""

    upstream_timeout: float = 2.0
    claim_wait: float = 1.0
    pool_size: int = 4
    pool_timeout: float = 1.0
    connect_timeout: float = 1.0
    shutdown_timeout: float = 1.0
    table: str = "processed_events"
    provider_timeout: float = 15.0  # a real provider waits 10-30 s
    attempts: int = 5  # per copy while the nemesis runs
    max_in_flight: int = 64  # provider-side concurrency cap
    settle_timeout: float = 30.0
    failure_rate: float = 0.05  # the app answers 5xx
    spike_rate: float = 0.02  # the app answers later than upstream.timeout
    # The inbox mode: the route's redeliver schedule and the redeliverer's pace (per replica).
    inbox: bool = False
    schedule: tuple[str, ...] = ("500ms", "1s", "2s")
    redeliver_for: str = "1h"
    redeliverer_concurrency: int = 2
    redeliverer_rate: float = 100.0
    redeliverer_poll: float = 0.1
    # Flow control, as its user configures it (inbox mode only): the limit at the app per
    # replica (upstream.concurrency; None: what the pool allows), and the route's hand_off, at
    # 0.7 of upstream.timeout as the presets take 0.7 of the provider's deadline. A copy waits
    # on an event in flight longer than the hand-off (as the defaults have it: claim_wait 10 s,
    # GitHub's hand_off 7 s), so that it finds a slow delivery kept, not still in flight.
    concurrency: int | None = None
    hand_off: float | None = None
    # The receipt mode (``ledger_app``): the route has ``receipt`` in the app's own database.
    receipts: bool = False
    receipt_dsn: str | None = None  # that database, once started
    # --reconcile (with the inbox): the stand-in of GitHub's API the route reconciles against.
    reconcile_api: str | None = None
    # --ordering: the route orders by object (key, version) and supersedes stale versions.
    ordering: bool = False
    # --shared-limit: upstream.concurrency {limit: N, shared: true} on every replica, in place
    # of ``concurrency`` per replica.
    shared_limit: int | None = None

    def with_inbox(self) -> Settings:
        """These settings in the inbox mode, with flow control as its user sets it up: a limit
        at the app, a pool sized for it and for the short transactions beside it, a hand_off
        at 0.7 of upstream.timeout, and claim_wait past it."""
        concurrency = self.concurrency or INBOX_CONCURRENCY
        pool_size = max(self.pool_size, concurrency + INBOX_SHORT_TRANSACTIONS)
        if app_limit.room_for(pool_size, keeps=True) < concurrency:
            raise CampaignError(f"pool_size {pool_size} has no room for {concurrency} at the app")
        return replace(
            self,
            inbox=True,
            concurrency=concurrency,
            pool_size=pool_size,
            hand_off=self.hand_off or round(HAND_OFF_SHARE * self.upstream_timeout, 3),
            claim_wait=max(self.claim_wait, INBOX_CLAIM_WAIT),
        )

    @property
    def request_bound(self) -> float:
        """About the longest one request may take by the configured timeouts."""
        return (
            self.pool_timeout
            + 2 * self.claim_wait
            + self.upstream_timeout
            + 3 * self.connect_timeout
            + 1.0
        )

    @property
    def limit_config(self) -> int | dict[str, Any] | None:
        """``upstream.concurrency`` as configured: shared, per replica, or unset."""
        if self.shared_limit is not None:
            return {"limit": self.shared_limit, "shared": True}
        return self.concurrency

    @property
    def commit_margin(self) -> float:
        """After the app's answer, how long its claim may still be lost (COMMIT bound + slack)."""
        return self.connect_timeout + 0.5

    def replica_config(self, *, port: int, upstream: str, dsn: str) -> dict[str, Any]:
        route: dict[str, Any] = {"name": ROUTE, "path": HOOK, "event_id": "body:/id"}
        if self.reconcile_api is not None:
            route = reconcile_sender.route(route, self.reconcile_api)
        extra: dict[str, Any] = {}
        if self.ordering:
            route["event_type"] = "body:/type"
            route["order"] = {
                "key": "body:/data/object/id",
                "version": "body:/created",
                "supersede": [ORDER_TYPE],
            }
        if self.receipt_dsn is not None:
            route["receipt"] = {"dsn": self.receipt_dsn}
        if self.inbox:
            route["redeliver"] = {"schedule": list(self.schedule), "for": self.redeliver_for}
            if self.hand_off is not None:
                route["hand_off"] = f"{self.hand_off:g}s"
            extra["redeliverer"] = {
                "concurrency": self.redeliverer_concurrency,
                "rate": self.redeliverer_rate,
                "poll": f"{self.redeliverer_poll}s",
            }
        return _known_keys(
            {
                "listen": f"127.0.0.1:{port}",
                # Several replicas share one host here: each needs its own admin port.
                "admin": {"listen": f"127.0.0.1:{free_port()}"},
                "upstream": {
                    "url": upstream,
                    "timeout": f"{self.upstream_timeout}s",
                    **({} if self.limit_config is None else {"concurrency": self.limit_config}),
                },
                "database": {
                    "dsn": dsn,
                    "table": self.table,
                    "pool_size": self.pool_size,
                    "pool_timeout": f"{self.pool_timeout}s",
                    "connect_timeout": f"{self.connect_timeout}s",
                },
                "claim_wait": f"{self.claim_wait}s",
                "shutdown_timeout": f"{self.shutdown_timeout}s",
                "log": {"level": "debug", "format": "json"},
                "routes": [route],
                **extra,
            }
        )


def _known_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` without the optional top-level keys this version of the proxy does not know."""
    try:
        config.parse(raw)
    except errors.ConfigError as exc:
        unknown = {p.split(":")[0] for p in exc.problems if ": unknown key" in p}
        return {key: value for key, value in raw.items() if key not in unknown}
    return raw


async def poll(
    check: Callable[[], Awaitable[bool] | bool], what: str, within: float, *, every: float = _POLL
) -> float:
    """Poll ``check`` until true; return the seconds it took; CampaignError past ``within``."""
    started = time.monotonic()
    while True:
        result = check()
        if result if isinstance(result, bool) else await result:
            return time.monotonic() - started
        if time.monotonic() - started > within:
            raise CampaignError(f"timed out after {within:g}s waiting for {what}")
        await asyncio.sleep(every)


def event_body(event_id: str) -> bytes:
    return json.dumps({"id": event_id, "type": "camp.test"}).encode()


@dataclass(frozen=True, slots=True)
class Objects:
    """--ordering: the events in the order they are sent, each one's object and version, and
    its body."""

    send_order: list[str]
    versions: dict[str, tuple[str, int]]
    bodies: dict[str, bytes]


def objects_of(event_ids: Sequence[str], rng: random.Random) -> Objects:
    """The events as versions of ``len(event_ids) / VERSIONS_PER_OBJECT`` objects (the n-th
    event of an object its n-th version), and an order to send them in: ``ACTIVE_OBJECTS``
    objects at a time, each version after the one older but for ``OUT_OF_ORDER`` of them,
    sent before it."""
    count = max(1, round(len(event_ids) / VERSIONS_PER_OBJECT))
    queues: dict[str, list[str]] = {}
    versions: dict[str, tuple[str, int]] = {}
    bodies: dict[str, bytes] = {}
    for n, event_id in enumerate(event_ids):
        obj = f"cus_{n % count:04d}"
        version = FIRST_VERSION + n // count
        queues.setdefault(obj, []).append(event_id)
        versions[event_id] = (obj, version)
        body = {"id": event_id, "type": ORDER_TYPE, "created": version}
        bodies[event_id] = json.dumps({**body, "data": {"object": {"id": obj}}}).encode()
    waiting = list(queues.values())
    rng.shuffle(waiting)
    active: list[list[str]] = []
    order: list[str] = []
    while waiting or active:
        while waiting and len(active) < ACTIVE_OBJECTS:
            active.append(waiting.pop())
        queue = rng.choice(active)
        if len(queue) > 1 and rng.random() < OUT_OF_ORDER:
            queue[0], queue[1] = queue[1], queue[0]
        order.append(queue.pop(0))
        if not queue:
            active.remove(queue)
    return Objects(order, versions, bodies)


def object_of(event: Mapping[str, Any]) -> tuple[str, int] | None:
    """A body's object and version (--ordering), or None."""
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    key = obj.get("id") if isinstance(obj, dict) else None
    version = event.get("created")
    if isinstance(key, str) and isinstance(version, int):
        return key, version
    return None


def monotonic_of(stamp: object) -> float | None:
    """A log line's ``ts`` (``2024-05-01T12:00:00.123Z``, UTC) on this process's monotonic
    clock (the replicas share the host's wall clock); None if it is not one."""
    if not isinstance(stamp, str) or len(stamp) != 24:
        return None
    try:
        second = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))
        wall = second + int(stamp[20:23]) / 1000
    except ValueError:
        return None
    return wall - (time.time() - time.monotonic())


def kinds_of(fault: str) -> tuple[str, ...]:
    """The nemesis's kinds of action when the database's own fault is ``fault``
    (``pg_restart``, or ``failover`` for a primary and standby)."""
    return tuple(fault if kind == "pg_restart" else kind for kind in KINDS)


# --- the app behind the proxy -------------------------------------------------------------


class App:
    """The fake upstream app: records every request it answers (a 2xx answer: it acted), and
    which replica sent it (each replica has a port of its own: ``listen``)."""

    def __init__(self, rng: random.Random, settings: Settings) -> None:
        self.rng = rng
        self.settings = settings
        self.calls: list[checker.UpstreamCall] = []
        self.arrived: list[tuple[str, str | None, float]] = []  # event, delivery, time
        self.in_flight = 0
        self.chaos = False  # random latency and 5xx for campaign events
        self.spikes = True  # with chaos: now and then an answer later than upstream.timeout
        self.spike_until = 0.0
        self.latency = 0.02  # the most an ordinary answer takes
        self.fixed: dict[str, float] = {}  # event-ID prefix -> latency, answered 200
        self.gates: dict[str, asyncio.Event] = {}  # event ID -> answer once set
        self._senders: dict[int, str] = {}  # the app's port -> the replica given it
        self.ledger: ledger_app.Ledger | None = None  # the receipt mode's database
        # --ordering: each object's version, applied last-writer-wins on each 2xx.
        self.versions: dict[str, int] = {}
        self._working: set[asyncio.Future[web.Response]] = set()
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        application = web.Application()
        application.router.add_post(HOOK, self._handle)
        # The handler is cancelled when the proxy's connection closes before the answer (its
        # upstream.timeout, its replica killed): the moment the proxy stopped waiting
        # (``UpstreamCall.dropped``). The work itself goes on (``_work``), as a real app's does.
        self._runner = web.AppRunner(
            application, access_log=None, shutdown_timeout=1.0, handler_cancellation=True
        )
        await self._runner.setup()

    async def listen(self, replica: str) -> str:
        """A port of the app's for ``replica`` alone: its URL."""
        assert self._runner is not None
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[-1][1]
        self._senders[port] = replica
        return f"http://127.0.0.1:{port}"

    def _sender(self, request: web.Request) -> str | None:
        transport = request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        sender = self._senders.get(sockname[1]) if sockname else None
        return sender or request.headers.get("X-Camp-Replica")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def decide(self, event_id: str) -> tuple[float, int]:
        """(latency, status) for one request."""
        for prefix, latency in self.fixed.items():
            if event_id.startswith(prefix):
                return latency, 200
        rng, timeout = self.rng, self.settings.upstream_timeout
        if not self.chaos:
            return rng.uniform(0.001, self.latency), 200
        status = rng.choice((500, 502, 503)) if rng.random() < self.settings.failure_rate else 200
        roll = rng.random()
        if time.monotonic() < self.spike_until:
            return rng.uniform(0.3, 1.8) * timeout, status
        if self.spikes and roll < self.settings.spike_rate:
            return rng.uniform(1.05, 1.6) * timeout, status
        if roll < 0.1:
            return rng.uniform(0.05, 0.4), status
        return rng.uniform(0.001, self.latency), status

    async def _handle(self, request: web.Request) -> web.Response:
        start = time.monotonic()
        dropped: list[float] = []
        work = asyncio.ensure_future(self._work(request, start, dropped))
        self._working.add(work)
        work.add_done_callback(self._worked)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            dropped.append(time.monotonic())
            raise

    def _worked(self, work: asyncio.Future[web.Response]) -> None:
        self._working.discard(work)
        if not work.cancelled():
            work.exception()  # retrieved: a request the proxy dropped while it was being read

    async def _work(
        self, request: web.Request, start: float, dropped: Sequence[float]
    ) -> web.Response:
        sender = self._sender(request)
        self.in_flight += 1
        try:
            event = json.loads(await request.read())
            event_id = str(event["id"])
            delivery = request.headers.get("X-Camp-Delivery")
            self.arrived.append((event_id, delivery, start))
            latency, status = self.decide(event_id)
            gate = self.gates.get(event_id)
            if gate is not None:
                await gate.wait()
            effect = None
            if self.ledger is None:
                await asyncio.sleep(latency)
            else:
                receipt = request.headers.get("Dedup-Receipt")
                done = await self.ledger.credit(
                    event_id, receipt, latency, status, delivery=delivery, replica=sender
                )
                effect, status = done.effect, done.status
            call = checker.UpstreamCall(
                event_id=event_id,
                delivery_id=delivery,
                replica=sender,
                start=start,
                end=time.monotonic(),
                status=status,
                effect=effect,
                dropped=dropped[0] if dropped else None,
            )
            # Applied as the call ends, with no await between: the calls' ends are the order
            # the versions were applied in.
            versioned = object_of(event)
            if versioned is not None and call.acted:
                self.versions[versioned[0]] = versioned[1]
            self.calls.append(call)
            return web.Response(status=status, text="acted" if status < 300 else "failed")
        finally:
            self.in_flight -= 1


# --- the proxy replicas -------------------------------------------------------------------


class Replica:
    """One ``python -m proxy serve`` process (restartable) and every line it logged."""

    def __init__(self, name: str, workdir: Path, document: dict[str, Any], port: int) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.admin = document.get("admin", {}).get("listen")  # host:port, or None (no admin)
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(document))
        self.log_path = workdir / f"{name}.log"
        self.stderr_path = workdir / f"{name}.stderr"
        self.logs: list[dict[str, Any]] = []
        self.incarnation = 0
        self.listening = False  # seen listening since its last start (a health check's view)
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._log_file: TextIO | None = None
        self._stderr: TextIO | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self, within: float = 30.0) -> float:
        """Start and wait until it listens (starting again if it exits, e.g. while the database
        is down); return the seconds it took."""
        started = time.monotonic()
        for _ in range(50):
            await self._spawn()
            while self.running and time.monotonic() - started <= within:
                if await accepts(self.port):
                    self.listening = True
                    return time.monotonic() - started
                await asyncio.sleep(_POLL)
            if self.process is not None and self.process.returncode is None:
                self.process.send_signal(signal.SIGKILL)  # still not listening: give up on it
            await self._reap()
            if time.monotonic() - started > within:
                break
            await asyncio.sleep(0.2)  # back-off before the next start attempt
        raise CampaignError(
            f"replica {self.name} did not listen within {within:g}s; see {self.stderr_path}"
        )

    async def kill(self) -> int:
        """``kill -9``; return the PID killed."""
        process = self.process
        if process is None or process.returncode is not None:
            raise CampaignError(f"replica {self.name} is not running")
        self.listening = False
        process.send_signal(signal.SIGKILL)
        await self._reap()
        return process.pid

    async def stop(self) -> None:
        """SIGTERM (a graceful drain), SIGKILL if it does not exit in time."""
        self.listening = False
        process = self.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 10.0)
            except TimeoutError:
                process.send_signal(signal.SIGKILL)
        await self._reap()
        for handle in (self._log_file, self._stderr):
            if handle is not None:
                handle.close()
        self._log_file = self._stderr = None

    async def _spawn(self) -> None:
        self.listening = False
        if self._log_file is None:
            self._log_file = self.log_path.open("a", encoding="utf-8")
            self._stderr = self.stderr_path.open("a", encoding="utf-8")
        self.incarnation += 1
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(self.config_path),
            stdout=asyncio.subprocess.PIPE, stderr=self._stderr, cwd=ROOT,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read(self.process, self.incarnation))

    async def _reap(self) -> None:
        """Wait for the process to exit (after a signal) and for its output to be read."""
        process, reader = self.process, self._reader
        if process is not None and process.returncode is None:
            try:
                await asyncio.wait_for(process.wait(), 10.0)
            except TimeoutError:
                process.send_signal(signal.SIGKILL)
                await process.wait()
        if reader is not None:
            await reader
            self._reader = None

    async def _read(self, process: asyncio.subprocess.Process, incarnation: int) -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            text = raw.decode(errors="replace").rstrip("\n")
            if self._log_file is not None:
                self._log_file.write(text + "\n")
            try:
                line = json.loads(text)
            except ValueError:
                line = {"msg": text}
            if not isinstance(line, dict):
                line = {"msg": text}
            line.update(replica=self.name, incarnation=incarnation, pid=process.pid)
            line["at"] = monotonic_of(line.get("ts"))
            self.logs.append(line)


# --- the provider -------------------------------------------------------------------------


class Provider:
    """Delivers events like a webhook provider: at least once, retrying with back-off."""

    copies = (1, 5)  # each event is sent this many times (at random), as copies

    def __init__(self, replicas: Sequence[Replica], rng: random.Random, settings: Settings) -> None:
        self.replicas = replicas
        self.rng = rng
        self.settings = settings
        self.deliveries: list[checker.Delivery] = []
        self.acked: set[str] = set()
        self.retrying = True  # copies retry while the nemesis runs; settling takes over after
        self.github: reconcile_sender.CampaignHook | None = None  # --reconcile: signs, logs
        self.bodies: Mapping[str, bytes] = {}  # --ordering: each event's body
        self._ids = itertools.count(1)
        self._slots = asyncio.Semaphore(settings.max_in_flight)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Provider:
        self._session = aiohttp.ClientSession(
            # One connection per delivery: a killed replica's kept-alive socket would otherwise
            # fail a later delivery that never reached it.
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            timeout=aiohttp.ClientTimeout(total=self.settings.provider_timeout),
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def deliver(self, event_id: str, replica: Replica, phase: str) -> checker.Delivery:
        assert self._session is not None
        delivery_id = f"d{next(self._ids)}"
        status: int | None = None
        dedup: str | None = None
        body = b""
        error: str | None = None
        payload = self.bodies.get(event_id) or event_body(event_id)
        headers = {
            "Content-Type": "application/json",
            "X-Camp-Delivery": delivery_id,
            "X-Camp-Replica": replica.name,
            # The proxy's log line then carries the delivery (request_id).
            "X-Request-Id": delivery_id,
        }
        if self.github is not None:
            headers |= self.github.headers(event_id, payload)
        async with self._slots:
            start = time.monotonic()
            try:
                async with self._session.post(
                    replica.url + HOOK, data=payload, headers=headers
                ) as response:
                    body = await response.read()
                    status = response.status
                    dedup = response.headers.get("Dedup-Status")
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:160]
            end = time.monotonic()
        delivery = checker.Delivery(
            delivery_id=delivery_id,
            event_id=event_id,
            replica=replica.name,
            phase=phase,
            start=start,
            end=end,
            status=status,
            duplicate=dedup in checker.DUPLICATE_ANSWERS,
            error=error,
            dedup_status=dedup,
            upstream_status=_kept_status(body) if dedup in checker.KEPT_ANSWERS else None,
            kept_for=_kept_for(body) if dedup in checker.KEPT_ANSWERS else None,
        )
        self.deliveries.append(delivery)
        if self.github is not None:
            self.github.record(delivery, payload)
        if delivery.outcome == "ok":
            self.acked.add(event_id)
        return delivery

    def backoff(self, attempt: int) -> float:
        return min(3.0, 0.25 * 2.0**attempt) * self.rng.uniform(0.5, 1.5)

    async def copy(self, event_id: str, delay: float) -> None:
        """One copy of an event, retried on failure to a random replica."""
        await asyncio.sleep(delay)
        for attempt in range(self.settings.attempts):
            delivery = await self.deliver(event_id, self.rng.choice(self.replicas), "nemesis")
            if delivery.outcome == "ok" or not self.retrying:
                return
            await asyncio.sleep(self.backoff(attempt))
            if not self.retrying:
                return

    async def send(self, event_id: str) -> None:
        """An event, sent ``copies`` times: either in a burst or spread over a second or two."""
        copies = self.rng.randint(*self.copies)
        spread = 0.05 if self.rng.random() < 0.5 else 2.0
        await asyncio.gather(
            *(self.copy(event_id, self.rng.uniform(0, spread)) for _ in range(copies))
        )

    async def settle(self, events: Sequence[str], within: float) -> float:
        """Redeliver every event not yet acknowledged until it is (bounded); return the time."""
        started = time.monotonic()
        for attempt in range(100):
            pending = [e for e in events if e not in self.acked]
            if not pending or time.monotonic() - started > within:
                break
            await asyncio.gather(
                *(self.deliver(e, self.rng.choice(self.replicas), "settle") for e in pending)
            )
            if any(e not in self.acked for e in pending):
                await asyncio.sleep(min(2.0, 0.2 * 2.0**attempt))
        return time.monotonic() - started


class OneShotProvider(Provider):
    """Delivers like GitHub: each event 1-3 times (copies, as providers send them), each copy
    once; a failure (5xx, timeout, connection error) is never retried. Any 2xx (200 processed
    or duplicate, 202 queued or duplicate_queued) is acceptance. A copy goes to a replica
    seen listening, as a load balancer's health check would have it (one being killed just
    then is still hit)."""

    copies = (1, 3)

    async def copy(self, event_id: str, delay: float) -> None:
        await asyncio.sleep(delay)
        await self.deliver(event_id, self._healthy(), "nemesis")

    async def redeliver(self, event_id: str) -> checker.Delivery:
        """A redelivery the reconciler asked for (``--reconcile``): once, as a copy is sent."""
        return await self.deliver(event_id, self._healthy(), reconcile_rules.PHASE)

    def _healthy(self) -> Replica:
        healthy = [r for r in self.replicas if r.listening]
        return self.rng.choice(healthy or self.replicas)


def _kept_status(body: bytes) -> int | None:
    """The app's status in a ``queued`` answer (``{"upstream_status": 503, …}``; None: the app
    did not answer)."""
    try:
        status = json.loads(body).get("upstream_status")
    except (ValueError, AttributeError):
        return None
    return status if isinstance(status, int) else None


def _kept_for(body: bytes) -> str | None:
    """Why a ``queued`` answer kept a delivery the app did not fail (``{"kept_for": "limit",
    …}``: the limit at the app; ``deadline``: the route's hand_off); None: the app failed it."""
    try:
        reason = json.loads(body).get("kept_for")
    except (ValueError, AttributeError):
        return None
    return reason if isinstance(reason, str) else None


# --- the nemesis --------------------------------------------------------------------------


class Nemesis:
    """Random faults, each recorded from its first effect until it is healed. The database's
    own fault (``pg_restart``, or ``failover``) is the database set-up's to carry out."""

    def __init__(
        self,
        rng: random.Random,
        replicas: Sequence[Replica],
        links: Sequence[databases.Link],
        database: databases.Database,
        app: App,
        say: Callable[[str], None],
        origin: float,
    ) -> None:
        self.rng = rng
        self.replicas = replicas
        self.links = links
        self.database = database
        self.kinds = kinds_of(database.fault)
        self.app = app
        self.say = say
        self.origin = origin
        self.actions: list[checker.Action] = []
        self.restart_failures: list[str] = []
        self._busy: set[str] = set()

    async def run(self, until: float, *, concurrency: int = 2, pause: float = 2.0) -> None:
        """Act until ``until`` (monotonic): every kind once first (in random order, but a
        failover second, a few seconds in, so that even a short run has one with traffic in
        flight), then at random; at most ``concurrency`` actions at a time, never two on one
        resource."""
        first_round = list(self.kinds)
        self.rng.shuffle(first_round)
        if "failover" in first_round:
            first_round.remove("failover")
            first_round.insert(1, "failover")
        kinds = list(self.kinds)
        weights = [_WEIGHTS[kind] for kind in kinds]
        slots = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task[None]] = set()
        failures: list[BaseException] = []
        for _ in range(10_000):
            await asyncio.sleep(self.rng.uniform(0.2, pause))
            await slots.acquire()
            if time.monotonic() >= until or failures:
                slots.release()
                break
            kind = first_round[0] if first_round else self.rng.choices(kinds, weights)[0]
            target = self._target(kind)
            if target is None:
                slots.release()
                continue
            if first_round:
                first_round.pop(0)
            self._busy.add(target)
            task = asyncio.create_task(self._act(kind, target))
            running.add(task)

            def done(task: asyncio.Task[None], target: str = target) -> None:
                running.discard(task)
                self._busy.discard(target)
                slots.release()
                if not task.cancelled() and task.exception() is not None:
                    failures.append(task.exception())  # type: ignore[arg-type]

            task.add_done_callback(done)
        await asyncio.gather(*running, return_exceptions=True)
        if failures:
            raise failures[0]

    def _target(self, kind: str) -> str | None:
        if kind in _DATABASE_FAULTS:
            candidates = ["postgres"]
        elif kind == "latency":
            candidates = ["app"]
        elif kind == "kill":
            candidates = [f"proc:{r.name}" for r in self.replicas if r.running]
        else:
            candidates = [f"link:{r.name}" for r in self.replicas]
        free = [c for c in candidates if c not in self._busy]
        return self.rng.choice(free) if free else None

    async def _act(self, kind: str, resource: str) -> None:
        target = resource.partition(":")[2] or resource
        index = next((n for n, r in enumerate(self.replicas) if r.name == target), -1)
        start = time.monotonic()
        detail = ""
        if kind == "kill":
            replica = self.replicas[index]
            pid = await replica.kill()
            down = self.rng.uniform(0, 1.5)
            await asyncio.sleep(down)
            try:
                took = await replica.start(within=RESTART_WITHIN)
                detail = f"pid {pid}, down {down:.1f}s + {took:.1f}s to listen again"
            except CampaignError as exc:
                # Left down; the settle phase starts it again. A finding, not a harness error.
                self.restart_failures.append(str(exc))
                detail = f"pid {pid}, NOT listening again within {RESTART_WITHIN:g}s"
        elif kind in _DATABASE_FAULTS:
            for action in await self.database.disrupt(self.rng):
                self._record(action)
            return
        elif kind == "latency":
            length = self.rng.uniform(1.0, 4.0)
            self.app.spike_until = start + length
            await asyncio.sleep(length)
        else:
            link = self.links[index]
            mode: Mode = _LINK_FAULTS[kind]
            hold = self.rng.uniform(*_LINK_HOLD[kind])
            await link.set_mode(mode)
            await asyncio.sleep(hold)
            await link.set_mode("pass")
        self._record(checker.Action(kind, target, start, time.monotonic(), detail))

    def _record(self, action: checker.Action) -> None:
        self.actions.append(action)
        took = action.end - action.start
        self.say(
            f"{action.start - self.origin:7.2f}s  {action.kind:<10} {action.target:<8} "
            f"{took:5.2f}s  {action.detail}"
        )


# --- the whole campaign -------------------------------------------------------------------


@dataclass
class Cluster:
    settings: Settings
    dsn: str  # direct, for the checks (not through a relay)
    app: App
    replicas: list[Replica]
    links: list[databases.Link] = field(default_factory=list)
    database: databases.Database | None = None


@contextlib.asynccontextmanager
async def cluster(
    workdir: Path,
    settings: Settings,
    replicas: int,
    rng: random.Random,
    *,
    dsn: str | None = None,
    mode: str = "plain",
) -> AsyncIterator[Cluster]:
    """The database (the campaign's own of ``mode``, one of ``databases.MODES``, reached through
    a link per replica; or ``dsn``, directly), the fake app and the replicas, all listening;
    everything stopped on exit."""
    async with contextlib.AsyncExitStack() as stack:
        database: databases.Database | None = None
        if dsn is None:
            database = await stack.enter_async_context(databases.database(mode, workdir))
            dsn = database.dsn
        app = App(rng, settings)
        if settings.receipts:
            app.ledger = await stack.enter_async_context(ledger_app.ledger(workdir, rng))
            settings = replace(settings, receipt_dsn=app.ledger.dsn)
        await app.start()
        stack.push_async_callback(app.close)
        links: list[databases.Link] = []
        made: list[Replica] = []
        for n in range(replicas):
            replica_dsn = dsn
            if database is not None:
                replica_dsn, link = await database.link(stack)
                links.append(link)
            port, name = free_port(), f"r{n + 1}"
            upstream = await app.listen(name)
            document = settings.replica_config(port=port, upstream=upstream, dsn=replica_dsn)
            replica = Replica(name, workdir, document, port)
            stack.push_async_callback(replica.stop)
            made.append(replica)
        await asyncio.gather(*(r.start() for r in made))
        yield Cluster(settings, dsn, app, made, links, database)


async def fetch(dsn: str, query: str, *args: Any) -> list[asyncpg.Record]:
    connection = await asyncpg.connect(dsn, timeout=10)
    try:
        return await connection.fetch(query, *args, timeout=10)
    finally:
        await connection.close()


async def claim_rows(dsn: str, table: str) -> dict[str, str | None]:
    """Each claimed event of the route, and its ``inbox_state`` (None: delivered at the first
    try, or a proxy without the inbox)."""
    rows = await fetch(
        dsn,
        f"SELECT event_id, to_jsonb(t) ->> 'inbox_state' AS state FROM \"{table}\" t "
        "WHERE scope = $1",
        ROUTE,
    )
    return {row["event_id"]: row["state"] for row in rows}


async def settle_inbox(c: Cluster, provider: Provider, within: float) -> float:
    """Wait (bounded) until no row of the route is pending and the app has answered 2xx for
    every event the provider got a 2xx for (or, --ordering, the proxy superseded it); return
    the time it took (past ``within`` the checker reports what is left)."""
    started = time.monotonic()
    table = c.settings.table
    query = f'SELECT count(*) FROM "{table}" WHERE scope = $1 AND inbox_state = $2'
    superseded = f'SELECT event_id FROM "{table}" WHERE scope = $1 AND inbox_state = $2'

    async def drained() -> bool:
        rows = await fetch(c.dsn, query, ROUTE, "pending")
        taken = {call.event_id for call in c.app.calls if call.acted}
        if rows[0][0] != 0:
            return False
        if c.settings.ordering and not provider.acked <= taken:
            # Superseded (never forwarded, by design) is taken too (order_rules judges it).
            taken |= {row[0] for row in await fetch(c.dsn, superseded, ROUTE, "superseded")}
        return provider.acked <= taken

    with contextlib.suppress(CampaignError):
        await poll(drained, "the inbox to drain", within, every=0.25)
    return time.monotonic() - started


async def idle_in_transaction(dsn: str) -> list[str]:
    rows = await fetch(
        dsn,
        "SELECT pid, application_name, state, now() - xact_start AS age, left(query, 80) AS q "
        "FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'",
    )
    return [
        f"pid {r['pid']} {r['application_name']} {r['state']} for {r['age']}: {r['q']}"
        for r in rows
    ]


def check_restarts(nemesis: Nemesis, replicas: Sequence[Replica]) -> checker.PostCheck:
    """Every killed replica listened again within RESTART_WITHIN."""
    evidence = tuple(
        json.dumps(line, sort_keys=True, default=str)
        for r in replicas
        for line in r.logs
        if str(line.get("msg", "")).startswith("cannot start")
    )
    return checker.PostCheck(
        f"killed replicas listen again within {RESTART_WITHIN:g}s",
        not nemesis.restart_failures,
        "; ".join(nemesis.restart_failures),
        evidence[:20],
    )


async def check_places_free(c: Cluster, within: float = 2.0) -> checker.PostCheck:
    """--shared-limit: once nothing is in flight, every place at the app is free (none is held
    by a transaction left behind, idle or not)."""
    limit = c.settings.shared_limit
    assert limit is not None
    name = f"every one of the {limit} shared places free"
    query = (
        f'SELECT count(*) FROM (SELECT FROM "{c.settings.table}" WHERE scope = $1 '
        "AND event_id = ANY($2::text[]) FOR UPDATE SKIP LOCKED) AS free"
    )
    scope, ids = f"{sql.SLOTS}/app", [slots.place_id(n) for n in range(limit)]
    free = [0]

    async def all_free() -> bool:
        free[0] = (await fetch(c.dsn, query, scope, ids))[0][0]
        return free[0] == limit

    with contextlib.suppress(CampaignError):
        await poll(all_free, name, within)
    return checker.PostCheck(name, free[0] == limit, f"{free[0]} free of {limit}")


async def check_no_idle_transactions(
    dsn: str, within: float = 2.0, where: str = ""
) -> checker.PostCheck:
    """No session is left holding a transaction once nothing is in flight."""
    name = "no idle-in-transaction sessions" + where
    left: list[str] = []

    async def none_left() -> bool:
        left[:] = await idle_in_transaction(dsn)
        return not left

    with contextlib.suppress(CampaignError):
        await poll(none_left, name, within)
    return checker.PostCheck(name, not left, "; ".join(left))


async def _ready(session: aiohttp.ClientSession, replica: Replica) -> bool:
    """Whether the replica's ``/readyz`` says it takes webhooks (True without an admin port)."""
    if replica.admin is None:
        return True
    try:
        async with session.get(f"http://{replica.admin}/readyz") as response:
            return response.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def wait_ready(replicas: Sequence[Replica], within: float) -> str:
    """Wait (bounded) until every replica is ready, as a load balancer would before sending it
    traffic (a pool that has just seen failures waits out a back-off of up to a second before
    it connects again); the replicas still not ready, "" if none."""
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        left = list(replicas)

        async def all_ready() -> bool:
            answers = await asyncio.gather(*(_ready(session, r) for r in left))
            left[:] = [r for r, ok in zip(left, answers, strict=True) if not ok]
            return not left

        with contextlib.suppress(CampaignError):
            await poll(all_ready, "every replica ready", within, every=0.1)
    return ", ".join(r.name for r in left)


async def check_pools_free(c: Cluster, provider: Provider) -> checker.PostCheck:
    """Each replica, once ready, serves ``pool_size`` concurrent events with a slow app without
    a 503: a pool slot leaked by a fault would make one of them wait past ``pool_timeout``.
    With a limit at the app (the inbox mode), ``upstream.concurrency`` of them are forwarded
    (a place at the app leaked would keep one more) and the others kept for the limit (a
    connection leaked would leave none to keep them with); with a shared limit, that many of
    them all replicas together (a place leaked, held by no delivery, would keep one more)."""
    settings = c.settings
    limit = settings.concurrency if settings.inbox else None
    shared = settings.shared_limit
    if shared is not None:
        limit = shared
    name = f"{settings.pool_size} concurrent slow events per replica" + (
        f" ({limit} forwarded{' by all' if shared else ''}, the others kept for the limit)"
        if limit
        else ""
    )
    slow = settings.pool_timeout + 0.5
    if limit is not None and settings.hand_off is not None:
        slow = (settings.pool_timeout + settings.hand_off) / 2  # mostly before the hand-off
    if not settings.pool_timeout < slow < min(settings.upstream_timeout, settings.hand_off or 60):
        raise CampaignError("the pool check needs pool_timeout < hand_off < upstream.timeout")
    if unready := await wait_ready(c.replicas, 15.0):
        return checker.PostCheck(name, False, f"not ready (/readyz) within 15s: {unready}")
    # Ready says one connection works; a pool whose last connects failed still waits out its
    # back-off (at most BACKOFF_MAX) before it opens the others, refusing meanwhile (503
    # "reconnecting"): the check is of leaked slots, not of the back-off, so wait it out.
    await asyncio.sleep(pool.BACKOFF_MAX + 0.1)
    c.app.fixed["health-"] = slow
    results = await asyncio.gather(
        *(
            provider.deliver(f"health-{r.name}-{k}", r, "check")
            for r in c.replicas
            for k in range(settings.pool_size)
        )
    )
    bad = [d for d in results if not _served(d, limit)]
    if shared is not None:
        if sum(_forwarded(d) for d in results) < shared:
            bad += [d for d in results if d not in bad]
    elif limit is not None:
        for replica in c.replicas:
            forwarded = [d for d in results if d.replica == replica.name and _forwarded(d)]
            if len(forwarded) < min(limit, settings.pool_size):
                bad += [d for d in results if d.replica == replica.name and d not in bad]
    detail = "; ".join(
        f"{d.event_id} on {d.replica} -> {d.status or d.error} after {d.end - d.start:.2f}s"
        for d in bad
    )
    wanted = {d.event_id for d in bad}
    evidence = tuple(
        json.dumps(line, sort_keys=True, default=str)
        for r in c.replicas
        for line in r.logs
        if line.get("event_id") in wanted
    )
    return checker.PostCheck(name, not bad, detail, evidence)


def _forwarded(delivery: checker.Delivery) -> bool:
    """Forwarded to the app: answered its 200, or kept at the hand-off while at the app (its
    claim's wait and the app's answer together can pass the hand_off)."""
    if delivery.status == 200 and not delivery.duplicate:
        return True
    return delivery.status == 202 and delivery.kept_for == checker.HANDED_OFF


def _served(delivery: checker.Delivery, limit: int | None) -> bool:
    """Forwarded; with a limit at the app, or kept for it."""
    if limit is None:
        return delivery.status == 200 and not delivery.duplicate
    return _forwarded(delivery) or (delivery.status == 202 and delivery.kept_for == "limit")


async def _traffic(provider: Provider, events: Sequence[str], span: float) -> None:
    """Start the events evenly over ``span`` seconds."""
    started = time.monotonic()
    sending: list[asyncio.Task[None]] = []
    for n, event_id in enumerate(events):
        delay = started + span * n / len(events) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sending.append(asyncio.create_task(provider.send(event_id)))
    await asyncio.gather(*sending)


def _quiet(message: str) -> None:
    pass


async def run_campaign(
    *,
    minutes: float = 1.0,
    replicas: int = 3,
    seed: int | None = None,
    events: int | None = None,
    workdir: Path | None = None,
    settings: Settings | None = None,
    inbox: bool = False,
    database: str = "plain",
    receipts: bool = False,
    reconcile: bool = False,
    ordering: bool = False,
    shared_limit: int | None = None,
    say: Callable[[str], None] = _quiet,
) -> checker.Report:
    """Run one campaign (``minutes`` of nemesis, then settling and checks); return the report,
    whose ``violations`` are empty when the invariant held. ``inbox``: the inbox mode;
    ``database``: ``plain``, ``pgbouncer`` or ``failover`` (see the module's docstring);
    ``receipts``: the receipt mode (``ledger_app``); ``reconcile``: the inbox mode with GitHub's
    sender and a reconciler (``reconcile_sender``); ``ordering``: versions of objects on a route
    that orders them (``order_rules``); ``shared_limit``: the inbox mode with that limit at the
    app shared by every replica (``limit_rules``)."""
    settings = settings or Settings()
    if shared_limit is not None:
        settings = replace(settings, shared_limit=shared_limit)
        inbox = True
    if receipts:
        settings = replace(settings, receipts=True)
    if ordering:
        if reconcile:
            raise CampaignError("--ordering is not made for --reconcile's sender")
        settings = replace(settings, ordering=True)
    if (inbox or reconcile) and not settings.inbox:
        settings = settings.with_inbox()
    seed = seed if seed is not None else random.SystemRandom().randrange(2**32)
    duration = minutes * 60
    count = events or max(100, round(900 * minutes))
    event_ids = [f"evt-{seed:08x}-{n:05d}" for n in range(count)]
    own_dir = workdir is None
    work = Path(tempfile.mkdtemp(prefix="dedup-campaign-")) if workdir is None else workdir
    mode = (" inbox" if settings.inbox else "") + ("" if database == "plain" else f" {database}")
    mode += " receipts" if settings.receipts else ""
    mode += " reconcile" if reconcile else ""
    mode += " ordering" if settings.ordering else ""
    mode += f" shared-limit={settings.shared_limit}" if settings.shared_limit is not None else ""
    say(
        f"campaign{mode} seed={seed} replicas={replicas} events={count} nemesis={duration:g}s "
        f"in {work}"
    )
    keep = True  # the replicas' logs are the evidence when something went wrong
    try:
        async with contextlib.AsyncExitStack() as stack:
            github = None
            if reconcile:
                github = await stack.enter_async_context(reconcile_sender.stand_in())
                settings = replace(settings, reconcile_api=github.api_url)
            report = await _campaign(
                work, settings, replicas, seed, event_ids, duration, database, say, github
            )
        keep = bool(report.violations) or bool(os.environ.get("DEDUP_CAMPAIGN_KEEP"))
        return report
    finally:
        if own_dir and not keep:
            shutil.rmtree(work, ignore_errors=True)
        elif own_dir:
            say(f"replica logs and configuration kept in {work}")


async def _campaign(
    work: Path,
    settings: Settings,
    replicas: int,
    seed: int,
    event_ids: list[str],
    duration: float,
    mode: str,
    say: Callable[[str], None],
    github: reconcile_sender.CampaignHook | None = None,
) -> checker.Report:
    rng = random.Random(seed)
    # Its own generator: the other modes' traffic and faults draw as they did.
    objects = objects_of(event_ids, random.Random(f"order-{seed}")) if settings.ordering else None
    async with cluster(work, settings, replicas, rng, mode=mode) as c:
        assert c.database is not None
        origin = time.monotonic()
        nemesis = Nemesis(rng, c.replicas, c.links, c.database, c.app, say, origin)
        c.app.chaos = True
        kind = OneShotProvider if settings.inbox else Provider
        async with kind(c.replicas, rng, settings) as provider:
            if github is not None:
                assert isinstance(provider, OneShotProvider)
                provider.github, github.redeliver = github, provider.redeliver
            sent = event_ids
            if objects is not None:
                provider.bodies, sent = objects.bodies, objects.send_order
            traffic = asyncio.create_task(_traffic(provider, sent, duration * 0.9))
            try:
                await nemesis.run(origin + duration)
                provider.retrying = False
                c.app.spikes = False
                await asyncio.wait_for(asyncio.shield(traffic), 2 * settings.provider_timeout + 10)
            finally:
                if not traffic.done():
                    traffic.cancel()
                    await asyncio.gather(traffic, return_exceptions=True)
            say(f"{time.monotonic() - origin:7.2f}s  nemesis over; settling")
            settle = await _settle(c, provider, event_ids)
            if github is not None:
                settle += await _settle_reconcile(c, provider, github)
            say(f"{time.monotonic() - origin:7.2f}s  settled in {settle:.1f}s; checking")
            post = await _post_checks(c, nemesis, provider)
            rows = await claim_rows(c.dsn, settings.table)
            ledger = None if c.app.ledger is None else await c.app.ledger.counts()
            final_versions = dict(c.app.versions)
        stopped = time.monotonic()
        for replica in c.replicas:
            await replica.stop()
        logs: list[Any] = [line for r in c.replicas for line in r.logs]
        if github is not None:  # the proxy's IDs are {hook}:{guid}, the campaign's the GUIDs
            logs = reconcile_sender.as_sent(logs)
            rows = {reconcile_sender.campaign_id(e): state for e, state in rows.items()}
        records = checker.Records(
            events=event_ids,
            deliveries=provider.deliveries,
            calls=c.app.calls,
            actions=nemesis.actions,
            logs=logs,
            claimed=frozenset(rows),
            ledger=ledger,
            inbox=settings.inbox,
            inbox_states={e: state for e, state in rows.items() if state is not None},
            hand_off=settings.hand_off if settings.inbox else None,
            upstream_timeout=settings.upstream_timeout,
            commit_margin=settings.commit_margin,
            request_bound=settings.request_bound,
            origin=origin,
            post_checks=post,
            objects=None if objects is None else objects.versions,
            final_versions=final_versions,
            shared_limit=settings.shared_limit,
            stopped=stopped,
            settings={
                "seed": seed,
                "replicas": replicas,
                "database": c.database.label,
                "nemesis": f"{duration:g}s",
                "settle": f"{settle:.1f}s",
                "upstream.timeout": f"{settings.upstream_timeout:g}s",
                "claim_wait": f"{settings.claim_wait:g}s",
                "pool": settings.pool_size,
                **_inbox_settings(settings),
                **({"app_pool": c.app.ledger.described()} if c.app.ledger else {}),
                **(_order_settings(objects) if objects is not None else {}),
            },
        )
        return _judge(records, github)


async def _post_checks(c: Cluster, nemesis: Nemesis, provider: Provider) -> list[checker.PostCheck]:
    """The checks once the campaign settled: replicas restarted, nothing left in a transaction
    (nor, with a shared limit, holding a place), no pool slot leaked."""
    post = [check_restarts(nemesis, c.replicas)]
    post.append(await check_no_idle_transactions(c.dsn))
    if c.app.ledger is not None:  # before the pool check's events reach the app
        post.append(await check_no_idle_transactions(c.app.ledger.dsn, where=" (the app's)"))
    if c.settings.shared_limit is not None:
        post.append(await check_places_free(c))
    post.append(await check_pools_free(c, provider))
    return post


def _judge(
    records: checker.Records, github: reconcile_sender.CampaignHook | None
) -> checker.Report:
    """The report of the mode's rules."""
    if github is not None:
        report, _ = reconcile_rules.check(records, github.recovery())
    elif records.objects is not None:
        report, _ = order_rules.check(records)
    else:
        report, _ = checker.check(records)
    if records.shared_limit is not None:
        report, _ = limit_rules.check(records, report)
    return report


async def _settle_reconcile(
    c: Cluster, provider: Provider, github: reconcile_sender.CampaignHook
) -> float:
    """``--reconcile``: the reconciler's recoveries in, one quiet run after, the inbox drained."""
    took = await reconcile_sender.settle(
        github,
        {d.event_id for d in provider.deliveries},
        lambda: {call.event_id for call in c.app.calls if call.acted},
        lambda: [line for r in c.replicas for line in r.logs],
        pace=float(c.settings.concurrency or c.settings.pool_size),
    )
    took += await settle_inbox(c, provider, c.settings.settle_timeout)
    await poll(lambda: c.app.in_flight == 0, "the app's last answers", 30)
    return took


async def _settle(c: Cluster, provider: Provider, event_ids: Sequence[str]) -> float:
    """Every replica listening again, then the settle phase of the mode; the app's calls ended."""
    for replica in c.replicas:
        if not replica.running:
            await replica.start(within=RESTART_WITHIN)
    if c.settings.inbox:
        took = await settle_inbox(c, provider, c.settings.settle_timeout)
    else:
        took = await provider.settle(event_ids, c.settings.settle_timeout)
    await poll(lambda: c.app.in_flight == 0, "the app's last answers", 30)
    return took


def _order_settings(objects: Objects) -> dict[str, str]:
    count = len({obj for obj, _ in objects.versions.values()})
    return {
        "order": f"{count} objects, key data.object.id, version created, supersede {ORDER_TYPE}",
    }


def _inbox_settings(settings: Settings) -> dict[str, str]:
    if not settings.inbox:
        return {}
    return {
        "redeliver": f"[{', '.join(settings.schedule)}] for {settings.redeliver_for}",
        "redeliverer": (
            f"{settings.redeliverer_concurrency} lanes, {settings.redeliverer_rate:g}/s, "
            f"poll {settings.redeliverer_poll:g}s"
        ),
        "upstream.concurrency": (
            f"{settings.shared_limit} shared"
            if settings.shared_limit is not None
            else str(settings.concurrency or "unset")
        ),
        "hand_off": f"{settings.hand_off:g}s" if settings.hand_off else "off",
        **(
            {"reconcile": f"every {reconcile_sender.EVERY:g}s since {reconcile_sender.SINCE}"}
            if settings.reconcile_api
            else {}
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults.campaign", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--minutes", type=float, required=True, help="how long the nemesis runs")
    parser.add_argument("--replicas", type=int, default=3, choices=(2, 3))
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--events", type=int, default=None, help="distinct events (900/minute)")
    parser.add_argument("--evidence", type=int, default=2, help="violations shown with evidence")
    parser.add_argument(
        "--inbox",
        action="store_true",
        help="the route redelivers; the provider sends each event 1-3 times and never retries",
    )
    parser.add_argument(
        "--reconcile",
        action="store_true",
        help="with --inbox: GitHub's sender, and the route reconciles against a stand-in of "
        "GitHub's API (every refused event must be recovered)",
    )
    database = parser.add_mutually_exclusive_group()
    database.add_argument(
        "--pgbouncer",
        action="store_const",
        const="pgbouncer",
        dest="database",
        help="the replicas reach PostgreSQL through PgBouncer (transaction pooling)",
    )
    database.add_argument(
        "--failover",
        action="store_const",
        const="failover",
        dest="database",
        help="a primary and a synchronous standby; the nemesis fails over instead of restarting",
    )
    parser.add_argument(
        "--receipts",
        action="store_true",
        help="the route has receipt; the app writes a ledger row and the receipt in one "
        "transaction in a database of its own",
    )
    parser.add_argument(
        "--ordering",
        action="store_true",
        help="the events are versions of a few hundred objects; the route orders them by "
        "object and supersedes stale versions, and the checker adds the ordering invariants",
    )
    parser.add_argument(
        "--shared-limit",
        type=int,
        default=None,
        metavar="N",
        help="with --inbox: every replica has upstream.concurrency {limit: N, shared: true}; "
        "the checker adds: never more than N at the app that a proxy still waits on",
    )
    parser.set_defaults(database="plain")
    args = parser.parse_args(argv)
    if args.reconcile and not args.inbox:
        parser.error("--reconcile needs --inbox")
    if args.ordering and args.reconcile:
        parser.error("--ordering is not made for --reconcile's sender")
    if args.shared_limit is not None and not args.inbox:
        parser.error("--shared-limit needs --inbox")
    if args.shared_limit is not None and args.shared_limit < 1:
        parser.error("--shared-limit must be at least 1")

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # The embedded server's "for one machine only" warning, at every restart.
    logging.getLogger(embedded.__name__).setLevel(logging.ERROR)

    report = asyncio.run(
        run_campaign(
            minutes=args.minutes,
            replicas=args.replicas,
            seed=args.seed,
            events=args.events,
            inbox=args.inbox,
            database=args.database,
            receipts=args.receipts,
            reconcile=args.reconcile,
            ordering=args.ordering,
            shared_limit=args.shared_limit,
            say=say,
        )
    )
    print(checker.format_report(report, evidence=args.evidence))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
