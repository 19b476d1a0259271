"""Event-ID extraction: where a route finds the provider's event ID and type in a request.

A source is written ``body:/json/pointer`` (RFC 6901), ``header:Name`` or ``query:name``. Sources
are parsed once at start-up; extraction is a pure function of the request's headers, query and
raw body, so this module knows nothing of aiohttp.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Literal, NoReturn, Protocol

from proxy import errors

MAX_ID_BYTES = 256
_KINDS = ("body", "header", "query")
_MISSING = object()

Kind = Literal["body", "header", "query"]


class MultiMapping(Protocol):
    """Read access to a multi-valued, for headers case-insensitive, mapping (a multidict)."""

    def getall(self, key: str, default: list[str], /) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Source:
    """Where a value lives in a request."""

    kind: Kind
    name: str
    pointer: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


def parse_source(text: str) -> Source:
    """Parse ``kind:name``; raises ValueError with a message fit for a config error."""
    kind, sep, name = text.partition(":")
    if not sep or kind not in _KINDS:
        raise ValueError(f"must be body:/pointer, header:Name or query:name, got {text!r}")
    if kind == "body":
        if name and not name.startswith("/"):
            raise ValueError(f"a JSON pointer must be empty or start with '/', got {name!r}")
        tokens = tuple(token.replace("~1", "/").replace("~0", "~") for token in name.split("/")[1:])
        return Source("body", name, tokens)
    if not name or not name.isprintable() or " " in name:
        raise ValueError(f"{kind} name must be a non-empty token, got {name!r}")
    return Source(kind, name)  # type: ignore[arg-type]


def _is_index(token: str) -> bool:
    """RFC 6901 array index: ASCII digits, no leading zero."""
    return token.isascii() and token.isdigit() and (token == "0" or token[0] != "0")


def _resolve_pointer(document: object, tokens: tuple[str, ...]) -> object:
    node = document
    for token in tokens:
        if isinstance(node, dict):
            node = node.get(token, _MISSING)
        elif isinstance(node, list) and _is_index(token):
            index = int(token)
            node = node[index] if index < len(node) else _MISSING
        else:
            return _MISSING
        if node is _MISSING:
            return _MISSING
    return node


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", float: "number", dict: "object", list: "array"}.get(
        type(value), type(value).__name__
    )


def _normalise(value: object) -> str | None:
    """An ID as stored, or None when the value is not an acceptable ID."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str) or not value:
        return None
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return None
    # Control characters (NUL above all: PostgreSQL text cannot hold it) never appear in real IDs.
    if any(unicodedata.category(char) in ("Cc", "Cs") for char in value):
        return None
    return value


@dataclass(frozen=True, slots=True)
class _Repeated:
    count: int


class DuplicateKey(ValueError):
    """A JSON object names the same key twice."""


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    document = dict(pairs)
    if len(document) != len(pairs):
        # Parsers disagree on which duplicate wins: the proxy and the app could see different IDs.
        raise DuplicateKey("duplicate key in a JSON object")
    return document


# What json.loads(body, object_pairs_hook=...) does, without building a decoder per call.
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)


def parse_json(body: bytes) -> object:
    """The body as JSON; ValueError for anything a strict reader would refuse."""
    try:
        return _DECODER.decode(body.decode(json.detect_encoding(body), "surrogatepass"))
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def _join(parts: list[str]) -> str:
    """Composite key: parts escaped so that no two different lists give the same string."""
    return ":".join(part.replace("%", "%25").replace(":", "%3A") for part in parts)


@dataclass(frozen=True, slots=True)
class Extractor:
    """Finds one route's event ID (required) and event type (informational) in a request.

    ``event_id`` may be several sources (a composite key, e.g. GitHub's hook ID and delivery
    GUID); each part must be present and valid, and the parts are joined unambiguously.
    """

    route: str
    event_id: Source | tuple[Source, ...]
    event_type: Source | None = None

    @property
    def id_sources(self) -> tuple[Source, ...]:
        return self.event_id if isinstance(self.event_id, tuple) else (self.event_id,)

    def extract(
        self, headers: MultiMapping, query: MultiMapping, body: bytes
    ) -> tuple[str, str | None]:
        """Return ``(event_id, event_type)``; raise EventIdInvalid naming the route and source."""
        sources = self.id_sources
        document: object = _MISSING
        in_body = [source for source in sources if source.kind == "body"]
        if in_body or (self.event_type and self.event_type.kind == "body"):
            try:
                document = parse_json(body)
            except DuplicateKey:
                if in_body:
                    self._fail(f"body has a duplicate JSON key (needed for {in_body[0]})")
            except ValueError:
                # Also invalid UTF-8 and integers too long to convert.
                if in_body:
                    self._fail(f"body is not valid JSON (needed for {in_body[0]})")
        parts = [self._part(source, headers, query, document) for source in sources]
        event_type = None
        if self.event_type is not None:
            # The type is informational: a missing or odd one is stored as NULL, never refused.
            event_type = _normalise(self._lookup(self.event_type, headers, query, document))
        return (parts[0] if len(parts) == 1 else _join(parts)), event_type

    def _part(
        self, source: Source, headers: MultiMapping, query: MultiMapping, document: object
    ) -> str:
        raw = self._lookup(source, headers, query, document)
        if raw is _MISSING:
            raise errors.EventIdMissing(f"route {self.route!r}: no event ID at {source}")
        if isinstance(raw, _Repeated):
            # Two values means the proxy and the app might read different IDs.
            self._fail(f"{source} appears {raw.count} times")
        value = _normalise(raw)
        if value is None:
            self._fail(
                f"event ID at {source} must be a non-empty string (at most "
                f"{MAX_ID_BYTES} bytes, no control characters) or an integer, "
                f"got {_type_name(raw)}"
            )
        return value

    @staticmethod
    def _lookup(
        source: Source, headers: MultiMapping, query: MultiMapping, document: object
    ) -> object:
        if source.kind == "body":
            return _resolve_pointer(document, source.pointer)
        values = (headers if source.kind == "header" else query).getall(source.name, [])
        if len(values) > 1:
            return _Repeated(len(values))
        return values[0] if values else _MISSING

    def _fail(self, reason: str) -> NoReturn:
        raise errors.EventIdInvalid(f"route {self.route!r}: {reason}")
