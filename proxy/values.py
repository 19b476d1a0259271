"""Parsers for single configuration values: durations, sizes, addresses, URLs, names.

Each takes the value as YAML (or ``${VAR}`` interpolation) produced it and returns the typed value,
or raises ValueError with a message that completes "<path>: …".
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from urllib.parse import urlsplit

from proxy import keys

EMBEDDED = "embedded"

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_SIZE = re.compile(r"(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?")
_SIZE_UNITS = {None: 1, "B": 1, "KB": 10**3, "KiB": 2**10, "MB": 10**6, "MiB": 2**20,
               "GB": 10**9, "GiB": 2**30}  # fmt: skip
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_METHOD = re.compile(r"[A-Z]{1,20}")


def parse_duration(value: object) -> float:
    """``500ms``, ``30s``, ``5m``, ``2h``, ``30d`` or a number of seconds; positive."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**9:
        # float() of a huge integer overflows; no duration is that long anyway.
        raise ValueError(f"must be at most 1000000000 seconds, got {value!r}")
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        seconds = float(match[1]) * _DURATION_UNITS[match[2]]
    else:
        raise ValueError(f"must be a duration like 500ms, 30s, 5m or 30d, got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"must be a finite duration, got {value!r}")
    if seconds <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    return seconds


def parse_duration_upto(limit: float) -> Callable[[object], float]:
    """A duration of at most ``limit`` seconds (those sent to PostgreSQL as milliseconds must
    stay below its 24.8-day maximum)."""

    def parse(value: object) -> float:
        seconds = parse_duration(value)
        if seconds > limit:
            raise ValueError(f"must be at most {limit:g}s, got {value!r}")
        return seconds

    return parse


def parse_size(value: object) -> int:
    """A byte count: an integer or ``512KiB``, ``10MiB``, ``1MB``…; positive."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value.strip())):
        size = int(match[1]) * _SIZE_UNITS[match[2]]
    else:
        raise ValueError(f"must be a size like 512KiB or 10MiB, got {value!r}")
    if size <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    return size


def parse_listen(value: object) -> tuple[str, int]:
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    bracketed = host.startswith("[") == host.endswith("]")
    host = host.removeprefix("[").removesuffix("]")
    if not (sep and host and bracketed and port.isascii() and port.isdigit()) or not (
        0 < int(port) <= 65535
    ):
        raise ValueError(f"must be host:port, port 1-65535, IPv6 as [::1]:port; got {value!r}")
    return host, int(port)


def parse_http_url(value: object) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL, got {value!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"must not carry a query or fragment, got {value!r}")
    return str(value).rstrip("/")


def parse_dsn(value: object) -> str | None:
    if value == EMBEDDED:
        return None
    if not isinstance(value, str) or urlsplit(value).scheme not in ("postgres", "postgresql"):
        raise ValueError("must be 'embedded' or a postgresql:// URL")
    return value


def parse_table(value: object) -> str:
    if not isinstance(value, str) or not all(
        _IDENTIFIER.fullmatch(part) for part in value.split(".", 1)
    ):
        raise ValueError(
            f"must be a lower-case SQL identifier, optionally schema.table; got {value!r}"
        )
    return value


def parse_name(value: object) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"must be letters, digits, '_', '.' or '-' (at most 63), got {value!r}")
    return value


def parse_methods(value: object) -> tuple[str, ...]:
    """A list of HTTP methods (upper case, as sent)."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty list of HTTP methods, got {value!r}")
    methods = []
    for item in value:
        if not isinstance(item, str) or not _METHOD.fullmatch(item):
            raise ValueError(f"must be HTTP methods in upper case (POST, PUT), got {item!r}")
        methods.append(item)
    return tuple(dict.fromkeys(methods))


def parse_source(value: object) -> keys.Source:
    if not isinstance(value, str):
        raise ValueError(f"must be body:/pointer, header:Name or query:name, got {value!r}")
    return keys.parse_source(value)


def parse_sources(value: object) -> keys.Source | tuple[keys.Source, ...]:
    """One source, or a list of them for a composite key."""
    if isinstance(value, list | tuple):
        if len(value) < 2:
            raise ValueError("a composite event_id needs at least two sources")
        return tuple(parse_source(item) for item in value)
    return parse_source(value)


def parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"must be true or false, got {value!r}")


def parse_positive_int(value: object) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return value


def parse_choice(*choices: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}; got {value!r}")
        return str(value)

    return parse
