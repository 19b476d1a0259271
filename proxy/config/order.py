"""``order`` on a route: deliveries of one object reach the app one at a time, in order.

``order: {key: <source>, version: <source>, supersede: [types]}`` names where a request carries
the object it is about (``key``), optionally the object's version (``version``: a number, or an
RFC 3339 time), and the event types whose stale versions are never forwarded (``supersede``:
needs ``version``). Sources are written as ``event_id``'s. ``order: preset`` takes the route's
preset's documented fields (``presets.Preset.order``); a preset never orders a route by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy import event_ids
from proxy.config import presets, reader, values

ORDER_KEYS = ("key", "version", "supersede")


@dataclass(frozen=True, slots=True, kw_only=True)
class Order:
    """Where a request names its object (``key``) and, optionally, the object's version; the
    event types superseded when older than the newest version the app accepted."""

    key: event_ids.Source
    version: event_ids.Source | None = None
    supersede: tuple[str, ...] = ()


def _types(value: object) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(item, str) and item for item in items):
        raise ValueError("must be an event type or a non-empty list of event types")
    return tuple(dict.fromkeys(str(item) for item in items))


def parse_order(r: reader.Reader, raw: object, path: str, *, preset: str | None) -> Order | None:
    """``order: preset`` (the preset's fields), a mapping, or absent (None)."""
    if raw is None:
        return None
    if raw == "preset":
        default = presets.PRESETS[preset].order if preset in presets.PRESETS else None
        if default is None:
            with_order = [name for name, p in presets.PRESETS.items() if p.order is not None]
            r.problem(
                path,
                f"'preset' needs a route preset that names its objects ({', '.join(with_order)}); "
                "else give key (and version) as a mapping",
            )
            return None
        return Order(
            key=event_ids.parse_source(default[0]), version=event_ids.parse_source(default[1])
        )
    if not isinstance(raw, dict):
        r.problem(path, f"must be 'preset' or a mapping of {', '.join(ORDER_KEYS)}")
        return None
    section: dict[str, Any] = r.mapping(raw, path, ORDER_KEYS)
    key = r.required(section, "key", path, values.parse_source)
    version = r.value(section, "version", path, values.parse_source, None)
    supersede: tuple[str, ...] = r.value(section, "supersede", path, _types, ())
    if supersede and version is None and "version" not in section:
        r.problem(
            f"{path}.supersede",
            "needs version: only an event older than the newest version the app accepted is "
            "superseded",
        )
    if key is None:
        return None
    return Order(key=key, version=version, supersede=supersede)
