"""The campaign's databases, one class per set-up behind one interface: PostgreSQL alone, behind
PgBouncer (``--pgbouncer``), or a primary with a synchronous standby (``--failover``).

Each one opens a replica's *link* to it (a fault relay per database host, faulted as one, so a
blackhole, reset or refusal cuts that replica off the database and no other), gives the DSN the
checks use (direct, through no relay and no pooler) and carries out its own fault, recorded as
``checker.Action``s:

- ``pg_restart``: PostgreSQL stops and starts again. Behind PgBouncer it is the server behind
  the pooler that restarts; PgBouncer stays up, the replicas' connections to it stay open, and
  it reconnects to the server on its own (how soon: its ``server_login_retry``).
- ``failover``: the primary is killed (SIGKILL), the standby promoted, and a little later the
  old primary is rebuilt as the new one's standby, so that the next failover finds a standby.
  Only the kill can cost a claim (its transaction dies with the primary; a committed one was
  on the standby first), so the ``failover`` action spans the kill alone, and the promotion
  and the rebuild are separate actions (``promote``, ``rebuild``) that explain nothing.

The relays sit between each replica and what it connects to: PostgreSQL, PgBouncer (so the link
faults stay per replica; the pooler's own link to the server is hit by ``pg_restart``), or each
of the pair's two servers (the replica's multi-host DSN lists one relay per server).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit, urlunsplit

from proxy import embedded
from tests import pgbouncer, replication
from tests.faults import checker
from tests.faults.relay import Mode, Relay, Target

MODES = ("plain", "pgbouncer", "failover")


class Link:
    """One replica's link to the database: a fault relay per database host, faulted as one."""

    def __init__(self, relays: Sequence[Relay]) -> None:
        self.relays = list(relays)

    async def set_mode(self, mode: Mode) -> None:
        for relay in self.relays:
            await relay.set_mode(mode)


class Database(Protocol):
    """What the campaign needs of a database set-up."""

    fault: str  # the nemesis's action on it: "pg_restart" or "failover"
    dsn: str  # direct, for the checks
    label: str  # for the report's settings

    async def link(self, stack: contextlib.AsyncExitStack) -> tuple[str, Link]:
        """A new replica's DSN through a link of its own (closed with ``stack``)."""
        ...

    async def disrupt(self, rng: random.Random) -> list[checker.Action]:
        """The fault, from its first effect until healed; the actions it recorded."""
        ...


def unix_socket_of(dsn: str) -> Path:
    """The socket file of a ``postgresql://…?host=/dir`` DSN (the embedded server's)."""
    parts = urlsplit(dsn)
    directory = parse_qs(parts.query)["host"][0]
    return Path(directory) / f".s.PGSQL.{parts.port or 5432}"


def with_hosts(dsn: str, ports: Sequence[int]) -> str:
    """``dsn`` with its host list replaced by 127.0.0.1 on each of ``ports`` (user, password,
    database and query kept)."""
    parts = urlsplit(dsn)
    login = parts.netloc.rpartition("@")[0]
    hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
    return urlunsplit(parts._replace(netloc=f"{login}@{hosts}" if login else hosts))


async def _relayed(stack: contextlib.AsyncExitStack, target: Target) -> Relay:
    relay = Relay(target)
    await relay.start()
    stack.push_async_callback(relay.close)
    return relay


class Plain:
    """The campaign's own embedded PostgreSQL (so it can be restarted), each replica's link a
    relay to its unix socket."""

    fault = "pg_restart"
    label = "postgres"
    behind = ""  # what the restart's detail says about the server's place

    def __init__(self, pg: embedded.EmbeddedPostgres, dsn: str) -> None:
        self.pg = pg
        self.dsn = dsn

    def target(self) -> Target:
        return unix_socket_of(self.dsn)

    def through(self, port: int) -> str:
        return f"postgresql://postgres@127.0.0.1:{port}/postgres"

    async def link(self, stack: contextlib.AsyncExitStack) -> tuple[str, Link]:
        relay = await _relayed(stack, self.target())
        return self.through(relay.port), Link([relay])

    async def disrupt(self, rng: random.Random) -> list[checker.Action]:
        start = time.monotonic()
        await asyncio.to_thread(self.pg.stop)
        down = rng.uniform(0, 1.0)
        await asyncio.sleep(down)
        await asyncio.to_thread(self.pg.start)
        detail = f"down {down:.1f}s{self.behind}"
        return [checker.Action("pg_restart", "postgres", start, time.monotonic(), detail)]


class Bounced(Plain):
    """The embedded PostgreSQL behind a real PgBouncer in transaction pooling mode, with the
    settings docs/deployment.md recommends (``pgbouncer.documented_settings``: a campaign of the
    deployment the docs describe); each replica's link a relay to PgBouncer."""

    label = "pgbouncer (docs/deployment.md settings)"
    behind = ", behind PgBouncer"

    def __init__(self, pg: embedded.EmbeddedPostgres, dsn: str, bouncer: str) -> None:
        super().__init__(pg, dsn)
        self.bouncer = bouncer

    def target(self) -> Target:
        return ("127.0.0.1", urlsplit(self.bouncer).port or 6432)

    def through(self, port: int) -> str:
        return with_hosts(self.bouncer, [port])


class Replicated:
    """A PostgreSQL primary and a standby replicating synchronously (``tests/replication.py``);
    each replica's link one relay per server, its DSN listing both with
    ``target_session_attrs=read-write``, so that after a failover it finds the new primary."""

    fault = "failover"
    label = "primary+sync standby"

    def __init__(self, pair: replication.Pair) -> None:
        self.pair = pair
        self.dsn = pair.dsn(multi_host=True)

    async def link(self, stack: contextlib.AsyncExitStack) -> tuple[str, Link]:
        # A server keeps its port through failovers and rebuilds (only the roles swap), so
        # each relay stays with its server.
        ports = (self.pair.primary.port, self.pair.standby.port)
        relays = [await _relayed(stack, ("127.0.0.1", port)) for port in ports]
        return with_hosts(self.dsn, [r.port for r in relays]), Link(relays)

    async def disrupt(self, rng: random.Random) -> list[checker.Action]:
        pair = self.pair
        pid = pair.primary.pid
        start = time.monotonic()
        await asyncio.to_thread(pair.kill_primary)
        killed = time.monotonic()
        await asyncio.to_thread(pair.promote)
        promoted = time.monotonic()
        actions = [
            checker.Action("failover", "postgres", start, killed, f"primary pid {pid} killed"),
            checker.Action(
                "promote", "postgres", killed, promoted, f"standby on port {pair.primary.port}"
            ),
        ]
        # The new primary runs alone for a while, as after a real failover.
        await asyncio.sleep(rng.uniform(0, 2.0))
        rebuilt = time.monotonic()
        await asyncio.to_thread(pair.rebuild_standby)
        actions.append(
            checker.Action(
                "rebuild", "postgres", rebuilt, time.monotonic(), f"port {pair.standby.port}"
            )
        )
        return actions


@contextlib.asynccontextmanager
async def database(mode: str, workdir: Path) -> AsyncIterator[Database]:
    """The database of ``mode`` (one of MODES), running; stopped on exit."""
    if mode not in MODES:
        raise ValueError(f"unknown database mode {mode!r}")
    async with contextlib.AsyncExitStack() as stack:
        if mode == "failover":
            pair = await _entered(stack, replication.pair(workdir / "pair", synchronous=True))
            yield Replicated(pair)
            return
        pg = embedded.EmbeddedPostgres(workdir / "pg")
        dsn = await asyncio.to_thread(pg.start)
        stack.push_async_callback(asyncio.to_thread, pg.stop)
        if mode == "pgbouncer":
            settings = pgbouncer.documented_settings()
            bouncer = await _entered(stack, pgbouncer.pgbouncer(dsn, settings))
            yield Bounced(pg, dsn, bouncer)
        else:
            yield Plain(pg, dsn)


async def _entered(stack: contextlib.AsyncExitStack, manager: Any) -> Any:
    """A blocking context manager entered in a thread; exited (in a thread) with ``stack``."""
    value = await asyncio.to_thread(manager.__enter__)
    stack.push_async_callback(asyncio.to_thread, manager.__exit__, None, None, None)
    return value
