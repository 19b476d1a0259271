"""The memory budget of one worker: bytes of request bodies and app answers held at once.

A webhook is held whole (to find its ID, check its signature and forward it byte-exact), and
so is the app's answer to it, so nothing else bounds the memory a worker needs: a burst of
large webhooks would get it killed for its memory limit, with every request in flight. Each
request reserves what it will hold before holding it: a body part by part as its bytes arrive
(never a declared length ahead of them, which a request head alone could claim), an answer's
length before reading it. What does not fit is
refused at once, and a request's reservation is released when it ends, however it ends.
A request always fits when nothing but its own bytes is held, so max_body alone decides the
size of a lone request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from proxy import errors

# An answer's first bytes are not counted: a typical answer ("ok", a small JSON) must never
# be refused after the app did the work because bodies fill the budget. At most one such
# allowance per request in flight, so pool_size of them per worker.
ANSWER_ALLOWANCE = 64 * 1024


class Budget:
    """``limit`` bytes shared by the requests of one worker (one event loop: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # read by the metrics (dedup_buffered_bytes) when they are written

    @contextlib.contextmanager
    def reservation(self) -> Iterator[Reservation]:
        """A request's share, given back on exit (returned, raised or cancelled)."""
        reservation = Reservation(self)
        try:
            yield reservation
        finally:
            self._give_back(reservation.size)

    def _take(self, size: int, own: int) -> bool:
        """Take ``size`` bytes for a request already holding ``own``: they fit under the limit,
        or nothing but that request's own bytes is held."""
        if self.held > own and self.held + size > self.limit:
            return False
        self.held += size
        return True

    def _give_back(self, size: int) -> None:
        self.held -= size


class Reservation:
    """What one request holds of the budget."""

    def __init__(self, budget: Budget) -> None:
        self._budget = budget
        self.size = 0
        self._answered = 0

    def body(self, size: int) -> None:
        """Reserve ``size`` more bytes of request body; Overloaded (503) if they do not fit."""
        if not self._budget._take(size, self.size):
            raise errors.Overloaded(
                f"{size} bytes of body do not fit max_buffered {self._budget.limit} "
                f"({self._budget.held} held)"
            )
        self.size += size

    def replay(self, size: int) -> None:
        """Reserve a stored answer about to be replayed, beyond the first ANSWER_ALLOWANCE;
        Overloaded (503: the duplicate is answered on a retry) if it does not fit."""
        counted = max(0, size - ANSWER_ALLOWANCE)
        if counted and not self._budget._take(counted, self.size):
            raise errors.Overloaded(
                f"a stored answer of {size} bytes does not fit max_buffered "
                f"{self._budget.limit} ({self._budget.held} held)"
            )
        self.size += counted

    def answer(self, size: int) -> None:
        """Reserve ``size`` more bytes of the app's answer beyond the first ANSWER_ALLOWANCE;
        AnswerOverBudget (502) if they do not fit."""
        counted = max(0, self._answered + size - ANSWER_ALLOWANCE) - max(
            0, self._answered - ANSWER_ALLOWANCE
        )
        self._answered += size
        if counted and not self._budget._take(counted, self.size):
            raise errors.AnswerOverBudget(
                f"{self._answered} bytes of the app's answer do not fit max_buffered "
                f"{self._budget.limit} ({self._budget.held} held)"
            )
        self.size += counted
