"""Event-ID extraction: where a route finds the provider's event ID and type in a request.

A source is written ``body:/json/pointer`` (RFC 6901), ``header:Name`` or ``query:name``. Sources
are parsed once at start-up; extraction is a pure function of the request's headers, query and
raw body, so this module knows nothing of aiohttp. A batch (SendGrid's, HubSpot's, Adyen's: one
POST, an array of events) is keyed by a pointer with one ``*`` token, every element of the array
at that point: the delivery's ID is the elements' IDs, one element's as it is, several hashed
(``Extractor.extract``).

Only input that every reader decodes the same way is accepted: a UTF-8 JSON body (RFC 8259) with
no duplicate keys and no ``NaN``/``Infinity``, a query parameter that is percent-encoded UTF-8,
and IDs with no control or Unicode format characters. Anything else is ``EventIdInvalid``, since
the proxy and the app must never read two IDs, or two events as one, out of the same request.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NoReturn, Protocol
from urllib.parse import unquote_to_bytes

from proxy import errors

MAX_ID_BYTES = 256
EACH = "*"  # the pointer token for every element of an array (a batch of events)
BATCH_PREFIX = "batch:sha256:"
_KINDS = ("body", "header", "query")
_MISSING = object()
# Control characters (NUL above all: PostgreSQL text cannot hold it), surrogates, and format
# characters: bidi overrides and zero-width characters make two IDs look alike, or one look
# like another, in logs and in ``events list``.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs"})
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
_BOM = "\ufeff"

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

    @property
    def each(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """For a batch's source (a ``*`` token in the pointer): the pointer to the array and
        the pointer inside each of its elements; None for any other source."""
        if self.kind != "body" or EACH not in self.pointer:
            return None
        at = self.pointer.index(EACH)
        return self.pointer[:at], self.pointer[at + 1 :]


def parse_source(text: str) -> Source:
    """Parse ``kind:name``; raises ValueError with a message fit for a config error."""
    kind, sep, name = text.partition(":")
    if not sep or kind not in _KINDS:
        raise ValueError(f"must be body:/pointer, header:Name or query:name, got {text!r}")
    if kind == "body":
        if name and not name.startswith("/"):
            raise ValueError(f"a JSON pointer must be empty or start with '/', got {name!r}")
        raw = name.split("/")[1:]
        if raw.count(EACH) > 1:
            raise ValueError(f"a JSON pointer may hold one '{EACH}' (every element), got {name!r}")
        tokens = tuple(token.replace("~1", "/").replace("~0", "~") for token in raw)
        return Source("body", name, tokens)
    if not name or not name.isprintable() or " " in name:
        raise ValueError(f"{kind} name must be a non-empty token, got {name!r}")
    if kind == "header" and "_" in name:
        raise ValueError(
            f"header name must not contain '_' (such headers are not forwarded), got {name!r}"
        )
    return Source(kind, name)  # type: ignore[arg-type]


def _is_index(token: str) -> bool:
    """RFC 6901 array index: ASCII digits, no leading zero."""
    return token.isascii() and token.isdigit() and (token == "0" or token[0] != "0")


def _resolve_pointer(document: object, tokens: tuple[str, ...]) -> object:
    node = document
    for token in tokens:
        if isinstance(node, tuple):  # an object, as its (key, value) pairs (parse_json)
            found = [value for key, value in node if key == token]
            if len(found) > 1:
                # Parsers disagree on which duplicate wins: the proxy and the app could read
                # different IDs.
                return _Refused(f"body has a duplicate JSON key {token!r} on the way to the ID")
            node = found[0] if found else _MISSING
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
    return {bool: "boolean", float: "number", tuple: "object", list: "array"}.get(
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
    if value.isascii():
        # The common case, without a category lookup per character: in ASCII, only the
        # control characters are not printable.
        return value if len(value) <= MAX_ID_BYTES and value.isprintable() else None
    if len(value.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        return None
    if any(unicodedata.category(char) in _REFUSED_CATEGORIES for char in value):
        return None
    return value


@dataclass(frozen=True, slots=True)
class _Refused:
    """A source's value that exists but cannot be read unambiguously."""

    reason: str


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON (RFC 8259 has no non-finite numbers)")


# What json.loads(body, ...) does, without building a decoder per call or guessing the encoding.
# Objects stay tuples of their (key, value) pairs: no Python call per object (a body of a
# million small objects parses in a sixth of the time a duplicate-key hook takes), duplicate
# keys kept for _resolve_pointer to refuse where they matter, on the way to the ID.
_DECODER = json.JSONDecoder(object_pairs_hook=tuple, parse_constant=_no_constant)


def parse_json(body: bytes) -> object:
    """The body as JSON, each object a tuple of its (key, value) pairs; ValueError for anything
    a strict reader would refuse.

    Only UTF-8 is JSON on the wire (RFC 8259 section 8.1): UTF-16 and UTF-32 bodies, and
    surrogates encoded as UTF-8 (CESU-8), are refused rather than read as json.loads would.
    One leading byte order mark is ignored, as the RFC allows: it cannot change the ID.
    """
    try:
        # Strict UTF-8: it refuses encoded surrogates, and the NUL bytes of UTF-16/32 are
        # no JSON whitespace.
        return _DECODER.decode(body.decode("utf-8").removeprefix(_BOM))
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def _percent_decoded(text: str) -> str | None:
    """A query key or value as a form decodes it (``+`` is a space), or None unless each ``%``
    starts an escape and the bytes are UTF-8: aiohttp would put U+FFFD for any bad byte, and
    apps variously do that, keep the escape, drop the parameter or fail."""
    text = text.replace("+", " ")
    if "%" not in text:
        return text
    if _BAD_ESCAPE.search(text):
        return None
    try:
        return unquote_to_bytes(text).decode("utf-8")
    except UnicodeDecodeError:
        return None


def _query_lookup(raw: str, source: Source) -> object:
    if "#" in raw or ";" in raw:
        # Go's net/http keeps "#..." in the query where others drop it; Rack 2 splits on ";".
        return _Refused("the query has '#' or ';', which parsers split differently")
    values = [
        _percent_decoded(value)
        for key, _, value in (pair.partition("=") for pair in raw.split("&"))
        if _percent_decoded(key) == source.name
    ]
    if len(values) > 1:
        return _Refused(f"{source} appears {len(values)} times")
    if not values:
        return _MISSING
    if values[0] is None:
        return _Refused(f"{source} is not percent-encoded UTF-8")
    return values[0]


def _named_by_connection(headers: MultiMapping, names: Mapping[str, str]) -> str | None:
    """The first of ``names`` (lower-cased, to the name to report) that Connection lists."""
    for value in headers.getall("Connection", []):
        for token in value.split(","):
            name = names.get(token.strip().lower())
            if name is not None:
                return name
    return None


def refuse_connection_naming(headers: MultiMapping, names: Iterable[str], route: str) -> None:
    """Raise EventIdInvalid if the request's Connection header lists one of ``names``.

    What Connection lists is hop-by-hop: the forwarder removes it, as any proxy on the way may,
    so the proxy would act on a header (an ID, a signature) that the app never receives.
    """
    hidden = _named_by_connection(headers, {name.lower(): name for name in names})
    if hidden is not None:
        raise errors.EventIdInvalid(
            f"route {route!r}: Connection names {hidden}, which would not reach the app"
        )


def join(parts: list[str]) -> str:
    """Composite key: parts escaped so that no two different lists give the same string."""
    return ":".join(part.replace("%", "%25").replace(":", "%3A") for part in parts)


def check_batch(sources: tuple[Source, ...]) -> None:
    """ValueError unless an event ID's sources are all a batch's (``*``) into the same array,
    or none is."""
    arrays = {source.each[0] if source.each else None for source in sources}
    if len(arrays) > 1:
        raise ValueError(
            f"a batch's event ID ('{EACH}' in a pointer) reads every part inside the elements of "
            "one array: each part's pointer must have the same path to its '*'"
        )


@dataclass(frozen=True, slots=True)
class Extractor:
    """Finds one route's event ID (required) and event type (informational) in a request.

    ``event_id`` may be several sources (a composite key, e.g. GitHub's hook ID and delivery
    GUID); each part must be present and valid, and the parts are joined unambiguously.
    """

    route: str
    event_id: Source | tuple[Source, ...]
    event_type: Source | None = None
    _header_names: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_batch(self.id_sources)
        sources = [*self.id_sources, *([self.event_type] if self.event_type else [])]
        names = {s.name.lower(): s.name for s in sources if s.kind == "header"}
        object.__setattr__(self, "_header_names", names)

    @property
    def id_sources(self) -> tuple[Source, ...]:
        return self.event_id if isinstance(self.event_id, tuple) else (self.event_id,)

    def extract(
        self, headers: MultiMapping, query: str | MultiMapping, body: bytes
    ) -> tuple[str, str | None]:
        """Return ``(event_id, event_type)``; raise EventIdInvalid naming the route and source.

        ``query`` is the raw query string as sent (after the ``?``), or the query already
        decoded as aiohttp does it: then a U+FFFD in an ID is refused, since it may stand for
        any byte that was not UTF-8.
        """
        if self._header_names:
            hidden = _named_by_connection(headers, self._header_names)
            if hidden is not None:
                self._fail(f"Connection names {hidden}, which would not reach the app")
        sources = self.id_sources
        document: object = _MISSING
        in_body = [source for source in sources if source.kind == "body"]
        if in_body or (self.event_type and self.event_type.kind == "body"):
            try:
                document = parse_json(body)
            except ValueError:
                # Also invalid UTF-8 and integers too long to convert.
                if in_body:
                    self._fail(f"body is not valid JSON (needed for {in_body[0]})")
        if sources[0].each is not None:
            event_id = self._batch(headers, query, document)
        else:
            parts = [self._part(source, headers, query, document) for source in sources]
            event_id = parts[0] if len(parts) == 1 else join(parts)
        event_type = None
        if self.event_type is not None:
            # The type is informational: a missing or odd one is stored as NULL, never refused.
            event_type = _normalise(self._lookup(self.event_type, headers, query, document))
        return event_id, event_type

    def _batch(self, headers: MultiMapping, query: str | MultiMapping, document: object) -> str:
        """A batch's ID: its one element's ID (the sources read inside it, joined as a composite
        key's parts), or, for several elements, ``batch:sha256:`` and the hex SHA-256 of their
        distinct IDs, sorted and joined. Each element must carry a valid ID. A batch regrouped
        by its sender is another delivery (its events forwarded again, never dropped); one
        resent with its events in another order is the same delivery."""
        first = self.id_sources[0]
        array = _resolve_pointer(document, first.pointer[: first.pointer.index(EACH)])
        if isinstance(array, _Refused):
            self._fail(array.reason)
        if not isinstance(array, list) or not array:
            raise errors.EventIdMissing(
                f"route {self.route!r}: no event ID at {first} (no array, or an empty one)"
            )
        inner = [
            Source("body", source.name, source.pointer[source.pointer.index(EACH) + 1 :])
            for source in self.id_sources
        ]
        ids: set[str] = set()
        for element in array:
            parts = [self._part(source, headers, query, element) for source in inner]
            ids.add(parts[0] if len(parts) == 1 else join(parts))
        if len(ids) == 1:
            return ids.pop()
        digest = hashlib.sha256(join(sorted(ids)).encode("utf-8", "surrogatepass")).hexdigest()
        return BATCH_PREFIX + digest

    def _part(
        self, source: Source, headers: MultiMapping, query: str | MultiMapping, document: object
    ) -> str:
        raw = self._lookup(source, headers, query, document)
        if raw is _MISSING:
            raise errors.EventIdMissing(f"route {self.route!r}: no event ID at {source}")
        if isinstance(raw, _Refused):
            self._fail(raw.reason)
        value = _normalise(raw)
        if value is None:
            self._fail(
                f"event ID at {source} must be a non-empty string (at most {MAX_ID_BYTES} "
                "bytes, no control characters or Unicode format characters) or an integer, "
                f"got {_type_name(raw)}"
            )
        return value

    @staticmethod
    def _lookup(
        source: Source, headers: MultiMapping, query: str | MultiMapping, document: object
    ) -> object:
        if source.kind == "body":
            return _resolve_pointer(document, source.pointer)
        if source.kind == "header":
            values = headers.getall(source.name, [])
        elif isinstance(query, str):
            return _query_lookup(query, source)
        else:
            values = query.getall(source.name, [])
        if len(values) > 1:
            # Two values means the proxy and the app might read different IDs.
            return _Refused(f"{source} appears {len(values)} times")
        if not values:
            return _MISSING
        if source.kind == "query" and "\ufffd" in values[0]:
            return _Refused(f"{source} holds U+FFFD, which stands for any byte that was not UTF-8")
        return values[0]

    def _fail(self, reason: str) -> NoReturn:
        raise errors.EventIdInvalid(f"route {self.route!r}: {reason}")
