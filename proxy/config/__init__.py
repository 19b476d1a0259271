"""Configuration: YAML in, frozen dataclasses out.

``${VAR}`` and ``${VAR:-default}`` are interpolated inside parsed string values (never in the raw
YAML text, so a variable cannot inject structure), unknown keys are errors, and every problem is
collected with its path and reported at once in one ``ConfigError``.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from proxy import app_limit, errors, paths, signatures
from proxy.config import console, reader, redeliver, values
from proxy.config import routes as routes_module
from proxy.upstream import proxy_headers

DEFAULT_LISTEN = "0.0.0.0:8080"
DEFAULT_UPSTREAM_TIMEOUT = 30.0
# Below the shortest keep-alive timeout of the common app servers (gunicorn 2 s; uvicorn and
# Node.js 5 s): an idle connection is dropped before the app could close it under a request.
DEFAULT_UPSTREAM_KEEPALIVE = 1.5
DEFAULT_CLAIM_WAIT = 10.0
# nginx's client_max_body_size: webhooks are kilobytes, and a body's parse holds the event loop
# (about 0.1 s per MiB of the worst JSON). Presets raise it to a provider's documented cap.
DEFAULT_MAX_BODY = 1024 * 1024
DEFAULT_MAX_BUFFERED = 64 * 1024 * 1024
# Idle keep-alive connections cost a file descriptor and some 10-20 KB each; 1,000 per worker
# serves any provider fan-in we know of and stays far below memory limits.
DEFAULT_MAX_CONNECTIONS = 1000
# Node.js's --max-http-header-size: a webhook's head is 1-2 KB, and a head is held for as long
# as its request lasts, outside max_buffered, so max_connections of them must fit in memory.
DEFAULT_MAX_HEAD = 16 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
DEFAULT_CLIENT_TIMEOUT = 60.0
# nginx's client_body_timeout and send_timeout, counted between two successive reads of a
# request body and two successive writes of an answer (nginx's default is 60 s): a provider
# sends a webhook in one burst and reads its answer at once, and its own deadline is 10-30 s.
DEFAULT_CLIENT_BODY_TIMEOUT = 10.0
DEFAULT_SEND_TIMEOUT = 10.0
DEFAULT_ADMIN_LISTEN = "127.0.0.1:9901"
DEFAULT_SWEEP_INTERVAL = 60.0
DEFAULT_SWEEP_BATCH = 1000
DEFAULT_POOL_SIZE = 10
DEFAULT_POOL_TIMEOUT = 5.0
DEFAULT_CONNECT_TIMEOUT = 5.0
# How long serve, started while the database does not answer, keeps trying before it exits 1.
DEFAULT_START_TIMEOUT = 300.0
DEFAULT_TABLE = "processed_events"
DEFAULT_DATA_DIR = ".dedup-proxy/pgdata"
MAX_WORKERS = 64

_LEVELS = ("debug", "info", "warning", "error")
TOP_KEYS = ("listen", "upstream", "database", "routes", "claim_wait", "max_body",
             "shutdown_timeout", "client_timeout", "client_body_timeout", "send_timeout",
             "log", "admin", "sweeper", "workers", "passthrough", "max_buffered", "max_connections",
             "max_head", "trusted_proxies", "redeliverer")  # fmt: skip
DATABASE_KEYS = ("dsn", "password_file", "data_dir", "table", "create_schema", "pool_size",
                  "pool_timeout", "connect_timeout", "start_timeout")  # fmt: skip
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


_QUERY_PASSWORD = re.compile(r"(?i)([?&]password=)[^&]*")
# What redact_dsn hides in the query: the password, and the client key's passphrase.
_QUERY_SECRET = re.compile(r"(?i)([?&](?:ssl)?password=)[^&]*")


def redact_dsn(dsn: str) -> str:
    """The DSN with its password (in the authority or as ``?password=``) and the client key's
    passphrase (``?sslpassword=``) replaced."""
    scheme, sep, rest = dsn.partition("://")
    authority, tail = values.split_authority(rest)
    userinfo, _, host = authority.rpartition("@")
    if ":" in userinfo:
        authority = f"{userinfo.partition(':')[0]}:***@{host}"
    return scheme + sep + authority + _QUERY_SECRET.sub(r"\1***", tail)


def with_password(dsn: str, password: str) -> str:
    """``dsn`` (which has none) with ``password`` in it, percent-encoded as asyncpg reads it."""
    scheme, _, rest = dsn.partition("://")
    authority, tail = values.split_authority(rest)
    user, _, host = authority.rpartition("@")
    return f"{scheme}://{user}:{quote(password, safe='')}@{host}{tail}"


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
    # At most this many requests at the app at once, per replica (``app_limit``); None: as many
    # as each worker's pool allows.
    concurrency: int | None = None
    # ``concurrency: {limit: N, shared: true}``: the limit is held by every replica and worker
    # on the claim table together (``database.slots``), not per replica.
    shared: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class DatabaseConfig:
    # None: the embedded server. Holds the password_file's password too, for every connection.
    dsn: Secret | None
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    # A relative data_dir as releases up to 0.2.0 read it, against the working directory
    # (``load`` reads it against the configuration file's): where a cluster may be left.
    data_dir_before: Path | None = field(default=None, compare=False)
    table: str = DEFAULT_TABLE
    create_schema: bool = True
    pool_size: int = DEFAULT_POOL_SIZE
    pool_timeout: float = DEFAULT_POOL_TIMEOUT
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    start_timeout: float = DEFAULT_START_TIMEOUT

    @property
    def embedded(self) -> bool:
        return self.dsn is None


@dataclass(frozen=True, slots=True, kw_only=True)
class LogConfig:
    level: str = "info"
    format: str = "auto"  # auto: JSON unless stdout is a terminal


@dataclass(frozen=True, slots=True, kw_only=True)
class AdminConfig:
    listen: Listen = field(default_factory=lambda: _listen(DEFAULT_ADMIN_LISTEN))
    console: console.ConsoleConfig = field(default_factory=console.ConsoleConfig)
    # Host names the admin listener answers to beside localhost, any IP address and its own
    # listen name (``admin.AllowedHosts``); ".example.org" takes its subdomains, "*" any name.
    allowed_hosts: tuple[str, ...] = ()

    @property
    def open_console(self) -> bool:
        """The console is served, asking for no credentials, beyond loopback."""
        shown = self.console.enabled and not self.console.credentials
        return shown and not values.is_loopback(self.listen.host)


@dataclass(frozen=True, slots=True, kw_only=True)
class SweeperConfig:
    interval: float = DEFAULT_SWEEP_INTERVAL
    batch: int = DEFAULT_SWEEP_BATCH


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    listen: Listen
    upstream: UpstreamConfig
    database: DatabaseConfig
    routes: tuple[routes_module.RouteConfig, ...]
    claim_wait: float = DEFAULT_CLAIM_WAIT
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    client_timeout: float = DEFAULT_CLIENT_TIMEOUT
    # A request body's bytes may pause at most this long; a client may read none of its answer
    # for at most send_timeout. Either ends the connection (and frees what it held).
    client_body_timeout: float = DEFAULT_CLIENT_BODY_TIMEOUT
    send_timeout: float = DEFAULT_SEND_TIMEOUT
    log: LogConfig = field(default_factory=LogConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    sweeper: SweeperConfig = field(default_factory=SweeperConfig)
    redeliverer: redeliver.RedelivererConfig = field(default_factory=redeliver.RedelivererConfig)
    workers: int = 1  # processes on the listeners the supervisor binds once, each with its own pool
    # Paths that match no route: forwarded if under one of these prefixes; None: all of them.
    passthrough: tuple[str, ...] | None = None
    # Per worker: bytes of request bodies and app answers held at once; client connections.
    max_buffered: int = DEFAULT_MAX_BUFFERED
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_head: int = DEFAULT_MAX_HEAD  # per request: its request line and header fields
    # Peers (an ingress, a load balancer) whose X-Forwarded-* headers the app is passed as sent.
    trusted_proxies: tuple[proxy_headers.Network, ...] = ()


def _listen(value: object) -> Listen:
    host, port = values.parse_listen(value)
    return Listen(host=host, port=port)


def _dsn(value: object) -> Secret | None:
    dsn = values.parse_dsn(value)
    return None if dsn is None else Secret(dsn)


def _with_password_file(r: reader.Reader, db: dict[str, Any], dsn: Secret | None) -> Secret | None:
    """The DSN with ``database.password_file``'s password in it, when there is one."""
    if db.get("password_file") is None:
        return dsn
    password = r.value(db, "password_file", "database", values.read_password_file, None)
    if dsn is None:
        if not any(problem.startswith("database.dsn:") for problem in r.problems):
            r.problem("database.password_file", "only with a postgresql:// dsn, not embedded")
        return dsn
    if _has_password(dsn.reveal()):
        r.problem("database.password_file", "not with a password in database.dsn too")
        return dsn
    return dsn if password is None else Secret(with_password(dsn.reveal(), password))


def _has_password(dsn: str) -> bool:
    authority, tail = values.split_authority(dsn.partition("://")[2])
    return ":" in authority.rpartition("@")[0] or bool(_QUERY_PASSWORD.search(tail))


def _head_size(value: object) -> int:
    """Between 1 KiB (below it, ordinary requests would be refused) and 1 MiB (aiohttp's own
    limits: 128 header lines of 8,190 bytes)."""
    size = values.parse_size(value)
    if not 1024 <= size <= 1024 * 1024:
        raise ValueError(f"must be between 1KiB and 1MiB, got {value!r}")
    return size


def _passthrough(value: object) -> tuple[str, ...] | None:
    """``all`` (None), ``none`` (no prefix) or a list of normalized path prefixes."""
    if value in ("all", "none"):
        return None if value == "all" else ()
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be all, none or a list of path prefixes, got {value!r}")
    prefixes = []
    for item in value:
        if not isinstance(item, str) or paths.normalize_prefix(item) != item:
            raise ValueError(f"must be normalized path prefixes like /api, got {item!r}")
        prefixes.append(item)
    return tuple(prefixes)


def read_file(path: str | os.PathLike[str]) -> bytes:
    """A configuration file's bytes, at most ``reader.MAX_FILE``; ConfigError otherwise."""
    try:
        return reader.read_bounded(path)
    except OSError as exc:
        raise errors.ConfigError(str(path), [f"cannot read file: {exc}"]) from exc
    except ValueError as exc:  # too large, or a NUL in the path
        raise errors.ConfigError(str(path), [f"not a configuration file: {exc}"]) from exc


def load(
    path: str | os.PathLike[str],
    *,
    secrets: bool = True,
    receipts: bool | None = None,
    base: Path | None = None,
    named: str | None = None,
) -> Config:
    """Read and validate a config file; raise ConfigError listing every problem. Without
    ``secrets`` the routes' signing secrets are not read (their ``${VAR}`` may be unset) and
    their verifiers refuse every request: for the commands that verify nothing. Without
    ``receipts`` (by default: as ``secrets``) a route's ``receipt.dsn`` is taken as written,
    its ``${VAR}`` not looked up: for the commands that touch no receipt.

    A relative ``database.data_dir`` is read against ``base``, by default the file's own
    directory: whichever directory a command runs from (a systemd unit, a cron job, an
    operator's shell), one configuration means one embedded server. ``named``: the file its
    problems are said of, when ``path`` is a copy of it (the supervisor's)."""
    source = str(path) if named is None else named
    try:
        text = read_file(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise errors.ConfigError(source, [f"cannot read file: {exc}"]) from exc
    try:
        stream = io.StringIO(text)
        stream.name = source  # PyYAML names it in its errors; "<unicode string>" otherwise
        raw = yaml.safe_load(stream)
    except yaml.YAMLError as exc:
        raise errors.ConfigError(source, [f"not valid YAML: {exc}"]) from exc
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        # PyYAML's constructors let these through for e.g. `2001-13-01`, `!!timestamp x`,
        # 5000-digit integers or deep nesting.
        raise errors.ConfigError(source, [f"not valid YAML: {exc!r}"]) from exc
    cfg = parse(raw, source=source, secrets=secrets, receipts=receipts)
    return _with_data_dir(cfg, Path(os.path.abspath(path)).parent if base is None else base)


def _with_data_dir(cfg: Config, base: Path) -> Config:
    """``cfg`` with its relative ``data_dir`` read against ``base``, and where releases up to
    0.2.0 read it (the working directory), for ``embedded`` to refuse a cluster left there."""
    written = cfg.database.data_dir
    if written.is_absolute():
        return cfg
    placed, before = base / written, Path.cwd() / written
    database = replace(
        cfg.database, data_dir=placed, data_dir_before=None if before == placed else before
    )
    return replace(cfg, database=database)


def _check_room(r: reader.Reader, config: Config) -> None:
    """``upstream.concurrency`` shared out among the workers must fit each worker's pool, less
    the connections kept for short transactions (``app_limit``)."""
    concurrency, workers = config.upstream.concurrency, config.workers
    if concurrency is None or config.upstream.shared:
        return  # shared: each worker's room is what its pool allows, the slots the bound
    if concurrency < workers:
        r.problem(
            "upstream.concurrency",
            f"is per replica, shared out among its {workers} workers: it must be at least "
            f"{workers}, got {concurrency}",
        )
        return
    keeps = any(route.redeliver for route in config.routes)
    pool_size = config.database.pool_size
    room = app_limit.room_for(pool_size, keeps=keeps)
    if concurrency // workers > room:
        kept = f", less {app_limit.reserve(pool_size)} kept for short transactions" if keeps else ""
        r.problem(
            "upstream.concurrency",
            f"{concurrency} shared out among {workers} worker(s) is {concurrency // workers} "
            f"each, more than database.pool_size {pool_size} allows at the app{kept} ({room}): "
            f"raise pool_size to {pool_size + concurrency // workers - room} or lower "
            "concurrency",
        )


def _concurrency(r: reader.Reader, up: dict[str, Any]) -> tuple[int | None, bool]:
    """``upstream.concurrency``: a number (per replica), or ``{limit: N, shared: true}`` (held
    by every replica together; ``shared: false`` is the number's form)."""
    raw = up.get("concurrency")
    if not isinstance(raw, dict):
        return r.value(up, "concurrency", "upstream", values.parse_positive_int, None), False
    section = r.mapping(raw, "upstream.concurrency", ("limit", "shared"))
    limit = r.required(section, "limit", "upstream.concurrency", values.parse_positive_int)
    shared = r.value(section, "shared", "upstream.concurrency", values.parse_bool, False)
    return limit, shared


def parse(
    raw: object, *, source: str = "<config>", secrets: bool = True, receipts: bool | None = None
) -> Config:
    """Validate an already-parsed YAML document (``secrets``, ``receipts``: as ``load``). The
    sections are read in a fixed order, which is the order of the problems."""
    r = reader.Reader(secrets=secrets, receipts=secrets if receipts is None else receipts)
    top = r.mapping(raw, "", TOP_KEYS)
    listen = r.value(top, "listen", "", _listen, _listen(DEFAULT_LISTEN))
    upstream = _upstream(r, top.get("upstream"))
    database = _database(r, top.get("database"))
    lg = r.mapping(top.get("log"), "log", ("level", "format"))
    adm = r.mapping(top.get("admin"), "admin", ("listen", "console", "allowed_hosts"))
    admin_listen = r.value(adm, "listen", "admin", _listen, _listen(DEFAULT_ADMIN_LISTEN))
    sw = r.mapping(top.get("sweeper"), "sweeper", ("interval", "batch"))
    max_body = r.value(top, "max_body", "", values.parse_size, DEFAULT_MAX_BODY)
    claim_wait = r.value(top, "claim_wait", "", _SHORT_DURATION, DEFAULT_CLAIM_WAIT)
    config = Config(
        listen=listen,
        upstream=upstream,
        database=database,
        routes=routes_module.parse_routes(r, top.get("routes"), upstream.url, max_body, claim_wait),
        claim_wait=claim_wait,
        shutdown_timeout=r.value(
            top, "shutdown_timeout", "", values.parse_duration, DEFAULT_SHUTDOWN_TIMEOUT
        ),
        client_timeout=r.value(
            top, "client_timeout", "", values.parse_duration, DEFAULT_CLIENT_TIMEOUT
        ),
        client_body_timeout=r.value(
            top, "client_body_timeout", "", _SHORT_DURATION, DEFAULT_CLIENT_BODY_TIMEOUT
        ),
        send_timeout=r.value(top, "send_timeout", "", _SHORT_DURATION, DEFAULT_SEND_TIMEOUT),
        admin=_admin(r, adm, admin_listen),
        sweeper=_sweeper(r, sw),
        redeliverer=redeliver.parse_redeliverer(r, top.get("redeliverer")),
        workers=r.value(top, "workers", "", values.parse_positive_int, 1),
        passthrough=r.value(top, "passthrough", "", _passthrough, None),
        max_buffered=r.value(top, "max_buffered", "", values.parse_size, DEFAULT_MAX_BUFFERED),
        max_connections=r.value(
            top, "max_connections", "", values.parse_positive_int, DEFAULT_MAX_CONNECTIONS
        ),
        max_head=r.value(top, "max_head", "", _head_size, DEFAULT_MAX_HEAD),
        trusted_proxies=r.value(top, "trusted_proxies", "", proxy_headers.parse_networks, ()),
        log=_log(r, lg),
    )
    recovering = (_stripe_recovery(r, n, route, listen) for n, route in enumerate(config.routes))
    config = replace(config, routes=tuple(recovering))
    _check_together(r, config)
    if r.problems:
        raise errors.ConfigError(source, r.problems)
    return config


def _upstream(r: reader.Reader, raw: object) -> UpstreamConfig:
    up = r.mapping(raw, "upstream", ("url", "timeout", "preserve_host", "keepalive", "concurrency"))
    concurrency, shared = _concurrency(r, up)
    return UpstreamConfig(
        url=r.required(up, "url", "upstream", values.parse_http_url) or "",
        timeout=r.value(up, "timeout", "upstream", _SHORT_DURATION, DEFAULT_UPSTREAM_TIMEOUT),
        preserve_host=r.value(up, "preserve_host", "upstream", values.parse_bool, True),
        keepalive=r.value(
            up, "keepalive", "upstream", values.parse_duration, DEFAULT_UPSTREAM_KEEPALIVE
        ),
        concurrency=concurrency,
        shared=shared,
    )


def _database(r: reader.Reader, raw: object) -> DatabaseConfig:
    db = r.mapping(raw, "database", DATABASE_KEYS)
    if raw is None:
        r.problem("database", "is required (dsn: embedded, or a postgresql:// URL)")
    dsn = r.required(db, "dsn", "database", _dsn) if raw is not None else None
    return DatabaseConfig(
        dsn=_with_password_file(r, db, dsn),
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
        start_timeout=r.value(
            db, "start_timeout", "database", values.parse_duration, DEFAULT_START_TIMEOUT
        ),
    )


def _admin(r: reader.Reader, adm: dict[str, Any], listen: Listen) -> AdminConfig:
    """``admin`` beyond its ``listen``, read before the routes (``adm``: its mapping)."""
    return AdminConfig(
        listen=listen,
        console=console.parse_console(
            r, adm.get("console"), listen=str(listen), loopback=values.is_loopback(listen.host)
        ),
        allowed_hosts=r.value(adm, "allowed_hosts", "admin", values.parse_host_names, ()),
    )


def _sweeper(r: reader.Reader, sw: dict[str, Any]) -> SweeperConfig:
    return SweeperConfig(
        interval=r.value(sw, "interval", "sweeper", values.parse_duration, DEFAULT_SWEEP_INTERVAL),
        batch=r.value(sw, "batch", "sweeper", values.parse_positive_int, DEFAULT_SWEEP_BATCH),
    )


def _log(r: reader.Reader, lg: dict[str, Any]) -> LogConfig:
    return LogConfig(
        level=r.value(lg, "level", "log", values.parse_choice(*_LEVELS), "info"),
        format=r.value(lg, "format", "log", values.parse_choice("auto", "json", "text"), "auto"),
    )


def _check_together(r: reader.Reader, config: Config) -> None:
    """What one section's values allow of another's."""
    if any(route.redeliver for route in config.routes) and config.database.pool_size < 2:
        r.problem(
            "database.pool_size",
            "must be at least 2 with a route that redelivers: a redelivery holds a connection "
            "while the app works on it, and one is always left to requests",
        )
    _check_room(r, config)
    if config.workers > MAX_WORKERS:
        r.problem("workers", f"must be at most {MAX_WORKERS}, got {config.workers}")
    if config.admin.listen.port == config.listen.port:
        r.problem("admin.listen", f"must not share the public port {config.listen.port}")


def _stripe_recovery(
    r: reader.Reader, index: int, route: routes_module.RouteConfig, listen: Listen
) -> routes_module.RouteConfig:
    """A Stripe route's ``reconcile`` with what a recovery needs from the rest of the route: the
    endpoint secret it is signed with (the first of ``verify``'s) and, unless ``deliver_to``
    says otherwise, the proxy's own listener on the route's path (the gap then enters the
    pipeline as any delivery does: verified, claimed, forwarded)."""
    settings = route.reconcile
    if settings is None or settings.provider != "stripe":
        return route
    path = f"routes[{index}].reconcile"
    secret = b""
    if isinstance(route.verify, signatures.ListedSignature) and route.verify.scheme == "stripe":
        secret = route.verify.secrets[0]
    elif not isinstance(route.verify, signatures.SecretsUnread) or route.verify.scheme != "stripe":
        r.problem(path, "needs the route's verify with scheme stripe: a recovered event is "
                  "signed with the endpoint secret, and checked as any delivery")  # fmt: skip
    target = settings.deliver_to
    if not target and route.pattern.params:
        r.problem(f"{path}.deliver_to", "is required on a path with {parameters}: which path "
                  "a recovered event goes to is not in Stripe's log")  # fmt: skip
    elif not target:
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(listen.host, listen.host)
        target = f"http://{f'[{host}]' if ':' in host else host}:{listen.port}{route.path}"
    return replace(route, reconcile=replace(settings, deliver_to=target, signing_secret=secret))
