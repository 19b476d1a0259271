"""What the failover tests share (``test_failover.py``, ``test_auto_failover.py``): the app that
records each call, the provider that sends every event twice and retries a ``503`` until it is
answered 2xx (faster than the ``Retry-After: 5`` a real one honours, so that the moment the proxy
reaches the new primary shows), what a run measured (``Outcome``), and the judgement of what
reached the app again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
from aiohttp import web

from tests.helpers import event, free_port

APP_HOLDS = 0.02  # the app's work per call
RETRY_EVERY = 0.5
PATH = "/webhooks/corvel"
FIGURES = Path("/tmp/failover/figures.jsonl")


@dataclass
class Call:
    """One request at the app."""

    event: str
    send: str  # the X-Request-ID of the provider's send that the proxy forwarded
    arrived: float


@dataclass
class App:
    calls: list[Call] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        self.calls.append(Call(body["id"], request.headers["X-Request-ID"], time.monotonic()))
        await asyncio.sleep(APP_HOLDS)
        return web.Response(text="processed")


@dataclass(frozen=True)
class Answer:
    """The proxy's answer to one send (one attempt of one copy of one event)."""

    send: str
    event: str
    copy: int
    sent: float
    answered: float
    status: int | None  # None: no answer (see error)
    retry_after: str | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


@contextlib.asynccontextmanager
async def recording_app() -> AsyncIterator[tuple[App, str]]:
    """The recording app and its URL, stopped at the block's end."""
    recorder = App()
    application = web.Application()
    application.router.add_route("*", "/{tail:.*}", recorder.handle)
    runner = web.AppRunner(application, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield recorder, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@dataclass(frozen=True)
class Provider:
    """``rate`` events a second, each sent twice ``copy_after`` apart; a copy not acknowledged
    ``give_up`` seconds after its first send is left."""

    rate: float
    copy_after: float
    give_up: float

    async def send(self, url: str, events: int, t0: float) -> list[Answer]:
        answers: list[Answer] = []
        timeout = aiohttp.ClientTimeout(total=15)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(
                *(
                    self._deliver(session, url, n, copy, self._at(t0, n, copy), answers)
                    for n in range(events)
                    for copy in (0, 1)
                )
            )
        return answers

    def _at(self, t0: float, n: int, copy: int) -> float:
        return t0 + n / self.rate + copy * self.copy_after

    async def _deliver(
        self,
        session: aiohttp.ClientSession,
        url: str,
        n: int,
        copy: int,
        at: float,
        out: list[Answer],
    ) -> None:
        """Send copy ``copy`` of event ``n`` at ``at``, again on every 503 until a 2xx
        (bounded); any other answer ends it."""
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        event_id = f"evt_{n:04d}"
        deadline = time.monotonic() + self.give_up
        for attempt in range(int(self.give_up / RETRY_EVERY) + 1):
            send = f"{event_id}.{copy}.{attempt}"
            sent = time.monotonic()
            try:
                async with session.post(
                    url, data=event(event_id), headers={"X-Request-ID": send}
                ) as response:
                    await response.read()
                    answer = Answer(
                        send,
                        event_id,
                        copy,
                        sent,
                        time.monotonic(),
                        response.status,
                        response.headers.get("Retry-After"),
                    )
            except (aiohttp.ClientError, TimeoutError) as exc:
                answer = Answer(send, event_id, copy, sent, time.monotonic(), None, None, repr(exc))
            out.append(answer)
            if answer.status != 503 or time.monotonic() > deadline:
                return
            await asyncio.sleep(RETRY_EVERY)


def reforwarded(
    answers: list[Answer], calls: list[Call], kill_start: float, kill_end: float
) -> tuple[list[str], list[str]]:
    """Events the app got again after a first call acknowledged 2xx to the provider: those
    whose first call did not straddle the kill, and those whose first call did (it reached the
    app before the kill ended and its answer left after the kill began: the COMMIT may have
    died with the primary, the documented window)."""
    by_send = {a.send: a for a in answers}
    firsts: dict[str, Call] = {}
    again: set[str] = set()
    for call in sorted(calls, key=lambda c: c.arrived):
        if call.event in firsts:
            again.add(call.event)
        else:
            firsts[call.event] = call
    outside: list[str] = []
    inside: list[str] = []
    for name in sorted(again):
        first = firsts[name]
        answer = by_send[first.send]
        if answer.ok:
            straddles = first.arrived < kill_end and answer.answered >= kill_start
            (inside if straddles else outside).append(name)
    return outside, inside


class Kill(Protocol):
    """A run's timeline, as far as every test reads it: when the primary's kill began and ended
    (time.monotonic())."""

    kill_start: float
    kill_end: float


T = TypeVar("T", bound=Kill)


@dataclass
class Outcome(Generic[T]):
    """What a failover run measured, on its nemesis's own timeline."""

    answers: list[Answer]
    calls: list[Call]
    timeline: T
    rows: int
    log_outcomes: Counter[str]
    proxy_exited: bool  # the proxy ran on, never restarted, through the failover

    def reforwarded(self) -> tuple[list[str], list[str]]:
        """Events forwarded again after an acknowledged first call: outside the window, and
        straddling the kill (``reforwarded``)."""
        t = self.timeline
        return reforwarded(self.answers, self.calls, t.kill_start, t.kill_end)

    def first_2xx(self, sent_from: float) -> float | None:
        """When the first 2xx was answered to a send made at ``sent_from`` or later."""
        return min((a.answered for a in self.answers if a.ok and a.sent >= sent_from), default=None)


def assert_answered_as_documented(answers: list[Answer], events: int) -> None:
    """Only 2xx, or 503 with Retry-After; every copy acknowledged in the end; some 503 (else
    the primary was not killed)."""
    others = [a for a in answers if not a.ok and a.status != 503]
    assert others == [], f"answers other than 2xx and 503: {others[:5]}"
    bare = [a for a in answers if a.status == 503 and not a.retry_after]
    assert bare == [], f"503 without Retry-After: {bare[:5]}"
    acknowledged = {(a.event, a.copy) for a in answers if a.ok}
    assert len(acknowledged) == 2 * events, "not every copy was acknowledged in the end"
    assert any(a.status == 503 for a in answers), "the failover cost no 503: was it killed?"


def record(figures: dict[str, Any]) -> None:
    """Print ``figures`` (``pytest -s``) and append them to FIGURES, one JSON line."""
    print(f"\n{figures['test']} figures: {json.dumps(figures)}")
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    with FIGURES.open("a") as out:
        out.write(json.dumps(figures) + "\n")
