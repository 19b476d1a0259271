"""Configuration: YAML in, frozen dataclasses out.

``${VAR}`` and ``${VAR:-default}`` are interpolated inside parsed string values (never in the raw
YAML text, so a variable cannot inject structure), unknown keys are errors, and every problem is
collected with its path and reported at once in one ``ConfigError``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import yaml

from proxy import errors, keys, presets, signatures, values

DEFAULT_LISTEN = "0.0.0.0:8080"
DEFAULT_UPSTREAM_TIMEOUT = 30.0
DEFAULT_UPSTREAM_KEEPALIVE = 4.0
DEFAULT_CLAIM_WAIT = 10.0
DEFAULT_MAX_BODY = 10 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_CLIENT_TIMEOUT = 60.0
DEFAULT_RETENTION = 30 * 86400.0
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9901"
DEFAULT_SWEEP_INTERVAL = 60.0
DEFAULT_SWEEP_BATCH = 1000
DEFAULT_POOL_SIZE = 10
DEFAULT_POOL_TIMEOUT = 5.0
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_TABLE = "processed_events"
DEFAULT_DATA_DIR = ".dedup-proxy/pgdata"

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_LEVELS = ("debug", "info", "warning", "error")
_TOP_KEYS = ("listen", "upstream", "database", "routes", "claim_wait", "max_body",
             "shutdown_timeout", "client_timeout", "log", "admin", "sweeper")  # fmt: skip
_DATABASE_KEYS = ("dsn", "data_dir", "table", "create_schema", "pool_size", "pool_timeout",
                  "connect_timeout")  # fmt: skip
_ROUTE_KEYS = ("name", "path", "preset", "scope", "event_id", "event_type", "upstream",
               "max_body", "verify", "retention", "missing_id")  # fmt: skip
_VERIFY_KEYS = ("scheme", "secret", "secrets", "tolerance", "header", "algorithm", "encoding",
                "prefix")  # fmt: skip
T = TypeVar("T")
# Timeouts become PostgreSQL settings in milliseconds or bound a single request: an hour is
# far beyond any provider's patience.
_SHORT_DURATION = values.parse_duration_upto(3600)


class Secret:
    """A string that does not show itself in ``repr`` or ``str``."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def redact_dsn(dsn: str) -> str:
    """The DSN with its password (in the authority or as ``?password=``) replaced."""
    parts = urlsplit(dsn)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = netloc.replace(f":{parts.password}@", ":***@", 1)
    query = "&".join(
        "password=***" if pair.split("=", 1)[0].lower() == "password" else pair
        for pair in parts.query.split("&")
    )
    return parts._replace(netloc=netloc, query=query if parts.query else "").geturl()


@dataclass(frozen=True, slots=True, kw_only=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True, kw_only=True)
class UpstreamConfig:
    url: str
    timeout: float = DEFAULT_UPSTREAM_TIMEOUT
    preserve_host: bool = True
    keepalive: float = DEFAULT_UPSTREAM_KEEPALIVE


@dataclass(frozen=True, slots=True, kw_only=True)
class DatabaseConfig:
    dsn: Secret | None  # None: the embedded server
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    table: str = DEFAULT_TABLE
    create_schema: bool = True
    pool_size: int = DEFAULT_POOL_SIZE
    pool_timeout: float = DEFAULT_POOL_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT

    @property
    def embedded(self) -> bool:
        return self.dsn is None


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteConfig:
    name: str
    path: str
    scope: str
    event_id: keys.Source | tuple[keys.Source, ...]  # a tuple: a composite key
    event_type: keys.Source | None
    upstream: str
    max_body: int
    preset: str | None = None
    verify: signatures.Verifier | None = None
    retention: float = DEFAULT_RETENTION
    forward_missing_id: bool = False  # ``missing_id: forward``


@dataclass(frozen=True, slots=True, kw_only=True)
class LogConfig:
    level: str = "info"
    format: str = "auto"  # auto: JSON unless stderr is a terminal


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminConfig:
    listen: Listen = field(default_factory=lambda: _listen(DEFAULT_ADMIN_LISTEN))


@dataclass(frozen=True, slots=True, kw_only=True)
class SweeperConfig:
    interval: float = DEFAULT_SWEEP_INTERVAL
    batch: int = DEFAULT_SWEEP_BATCH


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    listen: Listen
    upstream: UpstreamConfig
    database: DatabaseConfig
    routes: tuple[RouteConfig, ...]
    claim_wait: float = DEFAULT_CLAIM_WAIT
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT
    log: LogConfig = field(default_factory=LogConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    sweeper: SweeperConfig = field(default_factory=SweeperConfig)


def _listen(value: object) -> Listen:
    host, port = values.parse_listen(value)
    return Listen(host=host, port=port)


def _dsn(value: object) -> Secret | None:
    dsn = values.parse_dsn(value)
    return None if dsn is None else Secret(dsn)


class _Reader:
    """Walks the parsed YAML, interpolating and validating, and collects every problem."""

    def __init__(self) -> None:
        self.problems: list[str] = []

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
                self.problem(_join(path, str(key)), f"unknown key ({suggestion})")
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
        where = _join(path, key)
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
            self.problem(_join(path, key), "is required")
            return None
        return self.value(section, key, path, parse, None)

    def strings(self, section: Mapping[str, Any], key: str, path: str) -> list[str] | None:
        """A string or a list of strings (each interpolated); None, reported, if absent."""
        where = _join(path, key)
        raw = section.get(key)
        items = [raw] if isinstance(raw, str) else raw
        if not isinstance(items, list) or not items or not all(isinstance(i, str) for i in items):
            self.problem(where, "must be a string or a non-empty list of strings")
            return None
        resolved = [self.interpolate(item, f"{where}[{n}]") for n, item in enumerate(items)]
        return None if None in resolved else [str(item) for item in resolved]

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


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file; raise ConfigError listing every problem."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise errors.ConfigError(source, [f"cannot read file: {exc}"]) from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise errors.ConfigError(source, [f"not valid YAML: {exc}"]) from exc
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        # PyYAML's constructors let these through for e.g. `2001-13-01`, `!!timestamp x`,
        # 5000-digit integers or deep nesting.
        raise errors.ConfigError(source, [f"not valid YAML: {exc!r}"]) from exc
    return parse(raw, source=source)


def parse(raw: object, *, source: str = "<config>") -> Config:
    """Validate an already-parsed YAML document."""
    r = _Reader()
    top = r.mapping(raw, "", _TOP_KEYS)
    listen = r.value(top, "listen", "", _listen, _listen(DEFAULT_LISTEN))
    up = r.mapping(
        top.get("upstream"), "upstream", ("url", "timeout", "preserve_host", "keepalive")
    )
    upstream = UpstreamConfig(
        url=r.required(up, "url", "upstream", values.parse_http_url) or "",
        timeout=r.value(up, "timeout", "upstream", _SHORT_DURATION, DEFAULT_UPSTREAM_TIMEOUT),
        preserve_host=r.value(up, "preserve_host", "upstream", values.parse_bool, True),
        keepalive=r.value(
            up, "keepalive", "upstream", values.parse_duration, DEFAULT_UPSTREAM_KEEPALIVE
        ),
    )
    db = r.mapping(top.get("database"), "database", _DATABASE_KEYS)
    if top.get("database") is None:
        r.problem("database", "is required (dsn: embedded, or a postgresql:// URL)")
    database = DatabaseConfig(
        dsn=r.required(db, "dsn", "database", _dsn) if top.get("database") is not None else None,
        data_dir=Path(r.value(db, "data_dir", "database", str, DEFAULT_DATA_DIR)),
        table=r.value(db, "table", "database", values.parse_table, DEFAULT_TABLE),
        create_schema=r.value(db, "create_schema", "database", values.parse_bool, True),
        pool_size=r.value(
            db, "pool_size", "database", values.parse_positive_int, DEFAULT_POOL_SIZE
        ),
        pool_timeout=r.value(db, "pool_timeout", "database", _SHORT_DURATION, DEFAULT_POOL_TIMEOUT),
        connect_timeout=r.value(
            db, "connect_timeout", "database", _SHORT_DURATION, DEFAULT_CONNECT_TIMEOUT
        ),
    )
    lg = r.mapping(top.get("log"), "log", ("level", "format"))
    adm = r.mapping(top.get("admin"), "admin", ("listen",))
    sw = r.mapping(top.get("sweeper"), "sweeper", ("interval", "batch"))
    max_body = r.value(top, "max_body", "", values.parse_size, DEFAULT_MAX_BODY)
    config = Config(
        listen=listen,
        upstream=upstream,
        database=database,
        routes=_parse_routes(r, top.get("routes"), upstream.url, max_body),
        claim_wait=r.value(top, "claim_wait", "", _SHORT_DURATION, DEFAULT_CLAIM_WAIT),
        shutdown_timeout=r.value(
            top, "shutdown_timeout", "", values.parse_duration, DEFAULT_SHUTDOWN_TIMEOUT
        ),
        client_timeout=r.value(
            top, "client_timeout", "", values.parse_duration, DEFAULT_CLIENT_TIMEOUT
        ),
        admin=AdminConfig(
            listen=r.value(adm, "listen", "admin", _listen, _listen(DEFAULT_ADMIN_LISTEN))
        ),
        sweeper=SweeperConfig(
            interval=r.value(
                sw, "interval", "sweeper", values.parse_duration, DEFAULT_SWEEP_INTERVAL
            ),
            batch=r.value(sw, "batch", "sweeper", values.parse_positive_int, DEFAULT_SWEEP_BATCH),
        ),
        log=LogConfig(
            level=r.value(lg, "level", "log", values.parse_choice(*_LEVELS), "info"),
            format=r.value(
                lg, "format", "log", values.parse_choice("auto", "json", "text"), "auto"
            ),
        ),
    )
    if config.admin.listen.port == config.listen.port:
        r.problem("admin.listen", f"must not share the public port {config.listen.port}")
    if r.problems:
        raise errors.ConfigError(source, r.problems)
    return config


def _parse_routes(
    r: _Reader, raw: object, default_upstream: str, default_max_body: int
) -> tuple[RouteConfig, ...]:
    if not isinstance(raw, list) or not raw:
        r.problem("routes", "must be a non-empty list of routes")
        return ()
    parsed: list[RouteConfig] = []
    seen_names: dict[str, str] = {}
    seen_paths: dict[str, str] = {}
    for index, item in enumerate(raw):
        path = f"routes[{index}]"
        route = r.mapping(item, path, _ROUTE_KEYS)
        if not route:
            r.problem(path, "must be a mapping with name, path and event_id (or preset)")
            continue
        preset_name = r.value(route, "preset", path, values.parse_choice(*presets.PRESETS), None)
        preset = presets.PRESETS.get(preset_name or "")
        name = r.required(route, "name", path, values.parse_name)
        url_path = r.required(route, "path", path, values.parse_path)
        if preset is None:
            event_id = r.required(route, "event_id", path, values.parse_sources)
        else:
            ids = preset.event_id
            event_id = r.value(
                route, "event_id", path, values.parse_sources,
                values.parse_sources(ids if len(ids) > 1 else ids[0]),
            )  # fmt: skip
        for value, seen, key in ((name, seen_names, "name"), (url_path, seen_paths, "path")):
            if value is not None and value in seen:
                r.problem(f"{path}.{key}", f"{value!r} is already used by {seen[value]}")
            elif value is not None:
                seen[value] = path
        default_type = (
            values.parse_source(preset.event_type) if preset and preset.event_type else None
        )
        missing_id = "forward" if preset and preset.forward_missing_id else "reject"
        route_config = RouteConfig(
            name=name or "",
            path=url_path or "",
            scope=r.value(route, "scope", path, values.parse_name, name or ""),
            event_id=event_id or (),
            event_type=r.value(route, "event_type", path, values.parse_source, default_type),
            upstream=r.value(route, "upstream", path, values.parse_http_url, default_upstream),
            max_body=r.value(route, "max_body", path, values.parse_size, default_max_body),
            preset=preset_name,
            verify=_parse_verify(r, route.get("verify"), f"{path}.verify", preset_name, preset),
            retention=r.value(
                route,
                "retention",
                path,
                values.parse_duration,
                preset.retention if preset else DEFAULT_RETENTION,
            ),
            forward_missing_id=r.value(
                route, "missing_id", path, values.parse_choice("reject", "forward"), missing_id
            )
            == "forward",
        )
        if name is not None and url_path is not None and event_id is not None:
            parsed.append(route_config)
    return tuple(parsed)


def _parse_verify(
    r: _Reader, raw: object, path: str, preset_name: str | None, preset: presets.Preset | None
) -> signatures.Verifier | None:
    section = r.mapping(raw, path, _VERIFY_KEYS)
    if raw is None:
        return None
    scheme = r.value(section, "scheme", path, values.parse_choice(*signatures.SCHEMES), None)
    if scheme is None and "scheme" not in section:
        scheme = preset.scheme if preset else None
        if scheme is None:
            reason = (
                f"preset {preset_name} has no signature scheme the proxy can check"
                if preset_name
                else "is required"
            )
            r.problem(f"{path}.scheme", reason)
    if "secret" in section and "secrets" in section:
        r.problem(path, "give either secret or secrets, not both")
    secrets = r.strings(section, "secrets" if "secrets" in section else "secret", path)
    options = {
        key: r.value(section, key, path, str, None)
        for key in ("header", "algorithm", "encoding", "prefix")
    }
    default_tolerance = (preset and preset.tolerance) or signatures.DEFAULT_TOLERANCE
    tolerance = r.value(section, "tolerance", path, values.parse_duration, default_tolerance)
    if scheme is None or secrets is None:
        return None
    try:
        return signatures.build(scheme, secrets, tolerance=tolerance, **options)
    except ValueError as exc:
        r.problem(path, str(exc))
        return None
