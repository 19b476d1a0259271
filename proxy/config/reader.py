"""Walking parsed YAML: ``${VAR}`` interpolation, unknown keys and typed values, with every
problem collected under its path (``routes[1].event_id: …``) instead of stopping at the first;
and reading the files it comes from, bounded (``read_bounded``)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

# A configuration is kilobytes. A path that names something far larger (swapped for /dev/zero, a
# log) is no configuration, and read whole it would take the memory of the process (the
# supervisor, on SIGHUP) before the parser could say so.
MAX_FILE = 1024 * 1024
# A password or a few operators' name:password lines.
MAX_SECRET_FILE = 64 * 1024

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
T = TypeVar("T")


class Reader:
    """Walks the parsed YAML, interpolating and validating, and collects every problem. Without
    ``secrets``, the values read as secrets (``strings(secret=True)``) are taken as written:
    their ``${VAR}`` is not looked up, so an unset one is no problem; without ``receipts``,
    likewise a route's ``receipt.dsn``."""

    def __init__(self, *, secrets: bool = True, receipts: bool = True) -> None:
        self.problems: list[str] = []
        self.secrets = secrets
        self.receipts = receipts

    def problem(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}" if path else message)

    def mapping(self, raw: object, path: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            self.problem(path, f"must be a mapping, got {type(raw).__name__}")
            return {}
        for key in raw:
            if key not in allowed:
                hint = difflib.get_close_matches(str(key), allowed, n=1)
                suggestion = (
                    f"did you mean {hint[0]!r}?" if hint else f"expected {', '.join(allowed)}"
                )
                self.problem(join(path, str(key)), f"unknown key ({suggestion})")
        return dict(raw)

    def value(
        self,
        section: Mapping[str, Any],
        key: str,
        path: str,
        parse: Callable[[object], T],
        default: T,
    ) -> T:
        """The parsed value at ``key``, or ``default`` when it is absent or invalid."""
        where = join(path, key)
        if section.get(key) is None:
            return default
        raw = self.interpolate(section[key], where)
        if raw is None:
            return default
        try:
            return parse(raw)
        except ValueError as exc:
            self.problem(where, str(exc))
            return default

    def required(
        self, section: Mapping[str, Any], key: str, path: str, parse: Callable[[object], T]
    ) -> T | None:
        if section.get(key) is None:
            self.problem(join(path, key), "is required")
            return None
        return self.value(section, key, path, parse, None)

    def strings(
        self, section: Mapping[str, Any], key: str, path: str, *, secret: bool = False
    ) -> list[str] | None:
        """A string or a list of strings (each interpolated, unless ``secret`` and this reader
        leaves secrets unread); None, reported, if absent."""
        where = join(path, key)
        raw = section.get(key)
        items = [raw] if isinstance(raw, str) else raw
        if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
            self.problem(where, "must be a string or a non-empty list of strings")
            return None
        spelled = [f"{where}[{n}]" for n in range(len(items))] if isinstance(raw, list) else [where]
        if secret and not self.secrets:
            return list(items)
        resolved = [self.interpolate(item, at) for item, at in zip(items, spelled, strict=True)]
        for item, at in zip(resolved, spelled, strict=True):
            if item == "":
                self.problem(at, "must not be empty")
        return None if None in resolved or "" in resolved else [str(item) for item in resolved]

    def interpolate(self, raw: object, path: str) -> object:
        if isinstance(raw, list):
            items = [self.interpolate(item, f"{path}[{n}]") for n, item in enumerate(raw)]
            return None if None in items else items
        if not isinstance(raw, str):
            return raw
        missing: list[str] = []

        def substitute(match: re.Match[str]) -> str:
            if match[0] == "$$":
                return "$"
            name, default = match[1], match[2]
            # As in POSIX shells: ":-" falls back when the variable is unset *or empty*.
            if os.environ.get(name):
                return os.environ[name]
            if default is not None:
                return default
            if name in os.environ:
                return ""
            missing.append(name)
            return ""

        value = _VAR.sub(substitute, raw)
        for name in missing:
            self.problem(path, f"environment variable {name} is not set")
        return None if missing else value


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def read_bounded(path: str | os.PathLike[str], limit: int = MAX_FILE) -> bytes:
    """The bytes of the file at ``path``, at most ``limit`` of them read; ValueError beyond that
    (or for a NUL in the path), OSError as ``open`` raises it."""
    with open(path, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        size = f"{limit >> 20} MiB" if limit % (1 << 20) == 0 else f"{limit >> 10} KiB"
        raise ValueError(f"larger than {size}, the most read")
    return data
