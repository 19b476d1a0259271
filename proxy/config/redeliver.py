"""``redeliver`` on a route, and the ``redeliverer`` section: the inbox's settings.

A route with ``redeliver`` keeps a delivery the app failed (see ``proxy.redeliverer``) instead
of relaying the failure and waiting for the provider's retry. Routes whose answer matters to
the sender (``on_duplicate: replay``, ``semantics: idempotency-key``) refuse it: the sender
would be told 202 instead of the app's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.config import reader, values

# After each failed attempt, the wait before the next; the last one repeats until ``for``.
DEFAULT_SCHEDULE = (10.0, 60.0, 300.0, 1800.0, 7200.0, 21600.0)
DEFAULT_FOR = 3 * 86400.0  # or the route's retention, if shorter
DEFAULT_MAX_PENDING = 10_000
DEFAULT_MAX_PENDING_BYTES = 256 * 1024 * 1024
DEFAULT_DEAD_RETENTION = 30 * 86400.0
# PostgreSQL's interval arithmetic is exact far beyond this; it only keeps typos out.
MAX_DURATION = 366 * 86400.0
REDELIVER_KEYS = ("schedule", "for", "max_pending", "max_pending_bytes", "dead_retention")

DEFAULT_POLL = 1.0
REDELIVERER_KEYS = ("concurrency", "rate", "poll")


@dataclass(frozen=True, slots=True, kw_only=True)
class Redeliver:
    """A route's inbox: when to try again, for how long, and how much it may hold."""

    schedule: tuple[float, ...] = DEFAULT_SCHEDULE
    for_: float = DEFAULT_FOR
    max_pending: int = DEFAULT_MAX_PENDING
    max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES
    dead_retention: float = DEFAULT_DEAD_RETENTION

    def delay(self, failures: int) -> float:
        """The wait after the ``failures``-th failed attempt (from 1)."""
        return self.schedule[min(failures, len(self.schedule)) - 1]


@dataclass(frozen=True, slots=True, kw_only=True)
class RedelivererConfig:
    """Per replica (shared out among its workers): redeliveries at once (None: as many as the
    limit at the app lets in, ``upstream.concurrency``), and started per second (None:
    unpaced, as fast as the app's room frees)."""

    concurrency: int | None = None
    rate: float | None = None
    poll: float = DEFAULT_POLL


def _schedule(value: object) -> tuple[float, ...]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("must be a duration or a non-empty list of durations")
    return tuple(values.parse_duration_upto(MAX_DURATION)(item) for item in items)


def _rate(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 10_000:
        raise ValueError(
            f"must be a number of redeliveries per second in (0, 10000], got {value!r}"
        )
    return float(value)


def parse_redeliver(
    r: reader.Reader, raw: object, path: str, *, default_for: float = DEFAULT_FOR
) -> Redeliver | None:
    """``redeliver: true`` (the defaults, ``for`` ``default_for``), ``false``/absent (None) or
    a mapping."""
    if isinstance(raw, str | bool):
        try:
            return Redeliver(for_=default_for) if values.parse_bool(raw) else None
        except ValueError:
            r.problem(path, f"must be true, false or a mapping of {', '.join(REDELIVER_KEYS)}")
            return None
    if raw is None:
        return None
    if not isinstance(raw, dict):
        r.problem(path, f"must be true, false or a mapping of {', '.join(REDELIVER_KEYS)}")
        return None
    section: dict[str, Any] = r.mapping(raw, path, REDELIVER_KEYS)
    duration = values.parse_duration_upto(MAX_DURATION)
    settings = Redeliver(
        schedule=r.value(section, "schedule", path, _schedule, DEFAULT_SCHEDULE),
        for_=r.value(section, "for", path, duration, default_for),
        max_pending=r.value(
            section, "max_pending", path, values.parse_positive_int, DEFAULT_MAX_PENDING
        ),
        max_pending_bytes=r.value(
            section, "max_pending_bytes", path, values.parse_size, DEFAULT_MAX_PENDING_BYTES
        ),
        dead_retention=r.value(section, "dead_retention", path, duration, DEFAULT_DEAD_RETENTION),
    )
    if settings.schedule[0] >= settings.for_:
        r.problem(
            f"{path}.schedule",
            f"the first wait ({settings.schedule[0]:g}s) must be shorter than 'for' "
            f"({settings.for_:g}s), or nothing would ever be redelivered",
        )
    return settings


def parse_redeliverer(r: reader.Reader, raw: object) -> RedelivererConfig:
    section = r.mapping(raw, "redeliverer", REDELIVERER_KEYS)
    return RedelivererConfig(
        concurrency=r.value(section, "concurrency", "redeliverer", values.parse_positive_int, None),
        rate=r.value(section, "rate", "redeliverer", _rate, None),
        poll=r.value(
            section, "poll", "redeliverer", values.parse_duration_upto(60.0), DEFAULT_POLL
        ),
    )
