"""The faults tests/test_receipt_snippets.py stages around a WSGI app (Django's, Flask's), once
its view has returned (its transaction committed or rolled back), as the request's ``X-Fault``
header asks: ``late`` answers after ``LATE`` seconds (past the proxy's ``upstream.timeout``),
``kill`` SIGKILLs the process before a byte of the answer is written. The app's own code is the
page's, untouched."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

LATE = 4.0

App = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def wsgi(app: App) -> App:
    """``app`` with the faults: the view runs to its end, then the fault, then the answer."""

    def faulty(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        started: list[tuple[Any, ...]] = []

        def start(*args: Any) -> Callable[[bytes], None]:
            started.append(args)
            return lambda data: None  # neither framework writes through it

        result = app(environ, start)
        try:
            body = list(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        fault = environ.get("HTTP_X_FAULT")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "late":
            time.sleep(LATE)
        start_response(*started[0])
        return body

    return faulty
