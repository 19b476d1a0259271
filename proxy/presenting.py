"""How a kept row and a route's hold are told to an operator, in the console's pages and the
CLI's commands alike: the words for a row's state (``state``, ``head_state``, ``last``), for a
hold (``hold``), its times and ages (``when`` on a terminal, ``page_when`` on a page, ``age``),
which header values are masked (``masked``, ``shown_headers``) and the facts of each attempt
kept (``attempts``). Whatever a sender or an app wrote is escaped here (``logs.printable``), so
neither a terminal nor a page acts on it; a page then autoescapes it as any text.

One masking policy, for the request's headers and the app's answer's, on a page, a terminal
and in ``--json``: a header whose name holds one of ``MASKED_WORDS`` is shown as its size only,
never a character of it. That covers the sender's session credentials (``Authorization``,
``Cookie``), the signatures (worth nothing without the secret, but not a page's or a
terminal's to hand around) and the providers that send the secret itself as a header
(GitLab's ``X-Gitlab-Token``). What an operator needs to check a signature by hand is the body,
as sent (``events show --body``), and the secret, which is theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proxy import database, logs
from proxy.database import inbox

# A header whose name holds one of these words is shown as its size only.
MASKED_WORDS = (
    "authorization",
    "cookie",
    "signature",
    "secret",
    "token",
    "api-key",
    "apikey",
    "password",
)
# The last attempt's error, in a column, is cut to this many characters ("…").
LAST_ERROR_WIDTH = 60
FIRST_TRY = "delivered at the first try"

When = Callable[[datetime | None], str]


def when(value: datetime | None) -> str:
    """A time on a terminal: ISO 8601 in UTC, to the second ("-": none)."""
    return "-" if value is None else value.astimezone(UTC).isoformat(timespec="seconds")


def page_when(value: datetime | None) -> str:
    """A time on a page: UTC, to the second, its column or label saying UTC ("": none)."""
    return "" if value is None else value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def age(seconds: float | None) -> str:
    """How long, in its two largest units: ``1h 59m``, ``3d 2h``, ``0s`` ("-": unknown)."""
    if seconds is None:
        return "-"
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [(days, "d"), (hours, "h"), (minutes, "m"), (secs, "s")]
    shown = [f"{n}{unit}" for n, unit in parts if n][:2]
    return " ".join(shown) or "0s"


def state(value: str | None) -> str:
    """A claim's state in words: its inbox state, or that it was delivered at the first try."""
    return value or FIRST_TRY


def head_state(row: inbox.Blocked, when: When) -> str:
    """A blocked object's head: at the app (handed off), or pending and when it is due."""
    return "at the app" if row.at_app else f"pending, due {when(row.due)}"


def last(status: int | None, error: str | None) -> str:
    """The last attempt, in a column: the app's status, else what went wrong, on one line and
    cut to ``LAST_ERROR_WIDTH``."""
    if status is not None:
        return str(status)
    if not error:
        return "-"
    text = " ".join(error.split())
    return text if len(text) <= LAST_ERROR_WIDTH else text[: LAST_ERROR_WIDTH - 1] + "…"


def hold(held: database.Hold, now: float, when: When, scope: str | None = None) -> str:
    """A route's hold in one line: by whom (an operator's pause, or the app's Retry-After),
    since and until when (and how long is left), and why; with ``scope``, naming it first."""
    since = when(datetime.fromtimestamp(held.since, UTC))
    if held.until is None:
        until = "until resumed"
    else:
        ends = when(datetime.fromtimestamp(held.until, UTC))
        until = f"until {ends} ({age(held.until - now)} left)"
    where = f"scope {logs.printable(scope)} " if scope is not None else ""
    if held.reason == database.HoldKind.RETRY_AFTER:
        return f"{where}held for the app's Retry-After since {since}, {until}"
    note = f": {logs.printable(held.note)}" if held.note else ""
    return f"{where}paused by {logs.printable(held.by)} since {since}, {until}{note}"


def masked(name: str) -> bool:
    """Whether a header's value is shown as its size only (``MASKED_WORDS``)."""
    lowered = name.lower()
    return any(word in lowered for word in MASKED_WORDS)


def size(value: str) -> int:
    """A header value's length in bytes, as the inbox keeps it."""
    return len(value.encode("utf-8", "surrogateescape"))


def shown_headers(headers: Iterable[Sequence[str]]) -> list[tuple[str, str]]:
    """Headers as an operator sees them: escaped, and a masked one's value as its size."""
    return [
        (
            logs.printable(str(name)),
            f"<redacted {size(str(value))} bytes>"
            if masked(str(name))
            else logs.printable(str(value)),
        )
        for name, value in headers
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Attempt:
    """One attempt kept, as both the event page and ``events show`` tell it."""

    n: int
    at: str
    status: int | None
    ms: float | None
    error: str  # "" when the app answered
    words: str  # ``inbox.attempt_words``: what the app answered, or what went wrong
    headers: list[tuple[str, str]]  # the app's answer's, kept (``shown_headers``)
    body_lines: list[str]  # the answer's body kept, each line escaped
    body_bytes: int | None  # its whole length; None: no answer kept
    cut: bool  # the body is longer than what is kept (``inbox.ATTEMPT_BODY``)


def attempts(kept: Sequence[dict[str, Any]], when: When) -> list[Attempt]:
    """Every attempt kept, oldest first, each numbered as it was made (a row keeps its first
    and newest ones)."""
    return [_attempt(n, attempt, when) for n, attempt in enumerate(kept, 1)]


def _attempt(index: int, attempt: dict[str, Any], when: When) -> Attempt:
    try:
        at = when(datetime.fromisoformat(attempt["at"]))
    except (KeyError, TypeError, ValueError):
        at = logs.printable(str(attempt.get("at")))
    size = attempt.get("body_bytes")
    return Attempt(
        n=attempt.get("n") or index,
        at=at,
        status=attempt.get("status"),
        ms=attempt.get("ms"),
        error=logs.printable(str(attempt.get("error") or "")),
        words=logs.printable(inbox.attempt_words(attempt)),
        headers=shown_headers(attempt.get("headers") or []),
        body_lines=[logs.printable(line) for line in str(attempt.get("body") or "").splitlines()],
        body_bytes=size if isinstance(size, int) else None,
        cut=isinstance(size, int) and size > inbox.ATTEMPT_BODY,
    )
