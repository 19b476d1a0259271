"""Request paths: normalized once, before routing; the route table matches on that form only.

A webhook route must not be sidestepped by a variant of its path. Every request target is
read from the raw request line and normalized in one place (RFC 3986 section 6.2.2: escapes of
unreserved characters decoded, remaining escapes upper-cased, dot segments removed; plus
repeated slashes merged). The table matches that path case-insensitively and ignores a trailing
slash, as many app frameworks do. Whatever is forwarded carries the path the table decided on,
case-folded, parameter values included (the tenant the claim is scoped by), so the proxy and the
app's router never read one request two ways.

A variant the proxy will not interpret safely (an encoded ``/`` or ``\\``, a ``\\``, ``;``
parameters, an encoded control character or space, an unsafe path parameter) is refused when,
read loosely as an app might (everything decoded, ``\\`` as ``/``, parameters dropped,
whitespace trimmed), it would be a route's path. Anything else that is not a route passes
through (if allowed) with its normalized path. Only origin-form targets (``/…``) are accepted.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import unquote

from proxy import errors

T = TypeVar("T")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PARAM_VALUE = re.compile(r"[A-Za-z0-9._~-]+")
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Characters no safe reading of a segment contains (sub-delimiters included: ';' starts
# parameters in Servlet containers and Spring, ',' and '=' in some matrix-parameter routers).
_LOOSE_STRIP = " \t\r\n\f\v\x00"


@dataclass(frozen=True, slots=True)
class Target:
    """A request target: its normalized path and its query, raw (``""`` or ``"?…"``)."""

    path: str
    query: str

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(s for s in self.path.split("/") if s)


def _decode_unreserved(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    return char if char in _UNRESERVED else "%" + match.group(1).upper()


def _remove_dots(segments: Sequence[str]) -> list[str]:
    kept: list[str] = []
    for segment in segments:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment not in (".", ""):
            kept.append(segment)
    return kept


def normalize(raw_target: str) -> Target:
    """The normalized form of a raw request target; PathRefused if it is not origin-form."""
    if not raw_target.startswith("/"):
        raise errors.PathRefused("the request target must be a path (origin-form)")
    path = raw_target.partition("?")[0]
    if not already_normal(path):
        path = normalize_path(path)
    return Target(path, query_of(raw_target))


def already_normal(path: str) -> bool:
    """Nothing to decode, no dot segment, no empty one: ``normalize_path`` would return
    ``path`` as it is (most requests; checked without the work)."""
    return "%" not in path and "/." not in path and "//" not in path


def normalize_path(path: str) -> str:
    decoded = _ESCAPE.sub(_decode_unreserved, path)
    segments = _remove_dots(decoded.split("/"))
    last = decoded.rsplit("/", 1)[-1]
    trailing = bool(segments) and (decoded.endswith("/") or last in (".", ".."))
    return "/" + "/".join(segments) + ("/" if trailing else "")


def query_of(raw_target: str) -> str:
    """The raw query of a request target, with its "?" (``""`` when it has none)."""
    _, mark, query = raw_target.partition("?")
    return mark + query


def normalize_prefix(prefix: str) -> str | None:
    """A pass-through prefix as normalized (no trailing slash); None if it is not a path."""
    try:
        return normalize(prefix).path.rstrip("/") or "/"
    except errors.PathRefused:
        return None


def passes(prefixes: tuple[str, ...] | None, path: str) -> bool:
    """Whether a normalized path that is no route's may pass through."""
    if prefixes is None:
        return True
    return any(prefix in ("/", path) or path.startswith(prefix + "/") for prefix in prefixes)


def _loose_segments(path: str) -> list[str]:
    """How the most forgiving app router might read a path."""
    decoded = unquote(path.partition("?")[0], errors="replace").replace("\\", "/")
    # A segment that only parameters or whitespace made empty stays a segment (";"), which a
    # route's {parameter} matches: refusing one variant too many is the safe side.
    segments = [s.split(";", 1)[0].strip(_LOOSE_STRIP) or (s and ";") for s in decoded.split("/")]
    return [s.lower() for s in _remove_dots(segments)]


@dataclass(frozen=True, slots=True)
class Pattern:
    """A configured route path: literal segments and ``{name}`` parameters (whole segments)."""

    path: str
    segments: tuple[str, ...]  # literals lower-cased; parameters as "{name}"

    @classmethod
    def parse(cls, path: object) -> Pattern:
        """A route path from the configuration; ValueError unless it is already normalized."""
        if not isinstance(path, str) or not path.startswith("/"):
            raise ValueError(f"must be a URL path starting with '/', got {path!r}")
        raw = [s for s in path.split("/") if s]
        names: list[str] = []
        for segment in raw:
            param = _PARAM.fullmatch(segment)
            if param:
                names.append(param.group(1))
            elif not _PARAM_VALUE.fullmatch(segment) or segment in (".", ".."):
                raise ValueError(
                    f"must be a normalized path of letters, digits, '-', '.', '_', '~' and "
                    f"{{name}} segments, got {path!r} (segment {segment!r})"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"repeats a parameter name: {path!r}")
        return cls(path, tuple(s if _PARAM.fullmatch(s) else s.lower() for s in raw))

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(s[1:-1] for s in self.segments if s.startswith("{"))

    @property
    def key(self) -> tuple[str, ...]:
        """Equal for two patterns that match the same paths."""
        return tuple("{}" if s.startswith("{") else s for s in self.segments)

    def match(self, segments: Sequence[str]) -> tuple[str, ...] | None:
        """The parameter values if ``segments`` is this path, else None. Values are case-folded
        as the literals are: the folded value is the one scoped, verified and forwarded, so the
        app receives ``/hooks/ACME`` as ``/hooks/acme``, the tenant whose claims it shares."""
        if len(segments) != len(self.segments):
            return None
        values = []
        for want, got in zip(self.segments, segments, strict=True):
            if want.startswith("{"):
                values.append(got.lower())
            elif want != got.lower():
                return None
        return tuple(values)

    def parse_values(self, text: object) -> tuple[str, ...]:
        """Parameter values as the configuration names them (``acme``; ``acme/eu`` for two
        parameters), case-folded as ``match`` does; ValueError unless a path can carry them."""
        parts = text.split("/") if isinstance(text, str) else []
        if len(parts) != len(self.params) or not all(
            _PARAM_VALUE.fullmatch(part) and part not in (".", "..") for part in parts
        ):
            names = "/".join(f"{{{name}}}" for name in self.params)
            raise ValueError(
                f"must be a value of {names} in {self.path} (letters, digits, '-', '.', '_', '~'"
                f"{', the values joined by /' if len(self.params) > 1 else ''}), got {text!r}"
            )
        return tuple(part.lower() for part in parts)

    def fill(self, values: Sequence[str]) -> str:
        """This path with its parameters replaced by ``values``."""
        given = iter(values)
        parts = [next(given) if s.startswith("{") else s for s in self.segments]
        return "/" + "/".join(parts)


@dataclass(frozen=True, slots=True)
class Match(Generic[T]):
    """A request that is a route's: the route, its parameter values (case-folded), and the target
    to forward (the route's path with those values filled in, and the query as sent)."""

    route: T
    values: tuple[str, ...]
    target: str


class Table(Generic[T]):
    """The routes' patterns; a path with literal segments is preferred to one with parameters."""

    def __init__(self, entries: Sequence[tuple[Pattern, T]]) -> None:
        # Most literal segments first: /hooks/health before /hooks/{tenant}.
        self._entries = sorted(
            entries, key=lambda entry: -sum(not s.startswith("{") for s in entry[0].segments)
        )

    def match(self, target: Target, raw_target: str) -> Match[T] | None:
        """The route ``target`` belongs to; PathRefused for an unsafe variant of one."""
        segments = target.segments
        for pattern, route in self._entries:
            values = pattern.match(segments)
            if values is None:
                continue
            if all(_PARAM_VALUE.fullmatch(v) for v in values):
                return Match(route, values, pattern.fill(values) + target.query)
            # A parameter the app might read otherwise (Express decodes %2F in one).
            raise _refused(raw_target, pattern)
        loose = _loose_segments(raw_target)
        for pattern, _ in self._entries:
            if pattern.match(loose) is not None:
                raise _refused(raw_target, pattern)
        return None


def _refused(raw_target: str, pattern: Pattern) -> errors.PathRefused:
    path = raw_target.partition("?")[0][:200]
    return errors.PathRefused(
        f"path {path!r} is an ambiguous variant of the webhook path {pattern.path!r}"
    )
