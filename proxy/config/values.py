"""Parsers for single configuration values: durations, sizes, addresses, URLs, names.

Each takes the value as YAML (or ``${VAR}`` interpolation) produced it and returns the typed value,
or raises ValueError with a message that completes "<path>: …".
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from urllib.parse import parse_qs, quote, unquote, urlsplit

from proxy import event_ids
from proxy.config import reader

EMBEDDED = "embedded"

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_SIZE = re.compile(r"(\d+)\s*(B|KB|KiB|MB|MiB|GB|GiB)?")
_SIZE_UNITS = {None: 1, "B": 1, "KB": 10**3, "KiB": 2**10, "MB": 10**6, "MiB": 2**20,
               "GB": 10**9, "GiB": 2**30}  # fmt: skip
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_METHOD = re.compile(r"[A-Z]{1,20}")
# RFC 3986's userinfo: what may stand unencoded before a URL's "@".
_USERINFO = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:-]|%[0-9A-Fa-f]{2})*")
_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^:\[\]]*)(?::[0-9]*)?")
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
PERCENT_ENCODE = (
    "percent-encode the user name and password (urllib.parse.quote(password, safe='') "
    "turns '/' into %2F, '@' into %40, '#' into %23, '?' into %3F, '%' into %25), "
    "or give the password in database.password_file"
)


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


def format_duration(seconds: float) -> str:
    """A duration as configured: ``500ms``, ``30s``, ``5m``, ``2h``, ``3d`` (the largest unit
    it is a whole number of, else seconds)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size:g}{unit}"
    return f"{seconds * 1000:g}ms" if seconds < 1 else f"{seconds:g}s"


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


def format_size(size: int) -> str:
    """A byte count as configured: ``1MiB``, ``512KiB``, ``10MB`` (the largest unit it is a whole
    number of, binary first), else ``1500B``."""
    for unit in ("GiB", "MiB", "KiB", "GB", "MB", "KB"):
        if size >= _SIZE_UNITS[unit] and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return f"{size}B"


def parse_listen(value: object) -> tuple[str, int]:
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    bracketed = host.startswith("[") == host.endswith("]")
    host = host.removeprefix("[").removesuffix("]")
    if not (sep and host and bracketed and port.isascii() and port.isdigit()) or not (
        0 < int(port) <= 65535
    ):
        raise ValueError(f"must be host:port, port 1-65535, IPv6 as [::1]:port; got {value!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only: localhost, a loopback address."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME = re.compile(rf"\.?(?:{_LABEL}\.)*{_LABEL}")


def parse_host_names(value: object) -> tuple[str, ...]:
    """Host names (lower-cased, no trailing dot), ``.example.org`` for it and its subdomains, or
    ``*``: one or a list."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError(f"must be a host name or a list of them, got {value!r}")
    names = []
    for item in items:
        name = item.lower().rstrip(".") if isinstance(item, str) else ""
        if name != "*" and not _HOST_NAME.fullmatch(name):
            raise ValueError(
                "must be host names such as dedup-proxy.shop.svc, .svc.cluster.local (it and "
                f"its subdomains) or *, without scheme or port (IP addresses are always "
                f"answered); got {item!r}"
            )
        names.append(name)
    return tuple(names)


def parse_http_url(value: object) -> str:
    parts = urlsplit(value) if isinstance(value, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL, got {value!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"must not carry a query or fragment, got {value!r}")
    return str(value).rstrip("/")


# libpq's "key=value" form: a keyword, "=", and a value single-quoted (\\ and \' escaped) or
# a run without spaces (backslash escapes too), separated by spaces.
_LIBPQ_PAIR = re.compile(
    r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(?:'((?:[^'\\]|\\.)*)'|((?:[^\s'\\]|\\.)*))"
)
# The libpq keywords asyncpg reads, besides those that become the URL's parts: any other it would
# send to the server as a setting, where libpq refuses it as an invalid connection option.
_LIBPQ_QUERY = ("passfile", "sslmode", "sslcert", "sslkey", "sslrootcert", "sslcrl", "sslpassword",
                "sslnegotiation", "ssl_min_protocol_version", "ssl_max_protocol_version",
                "target_session_attrs", "krbsrvname", "gsslib", "service")  # fmt: skip
_LIBPQ_HINTS = {
    "connect_timeout": "set database.connect_timeout instead",
    "application_name": "the proxy names its connections dedup-proxy (dedup-proxy-cli)",
}


def libpq_url(text: str) -> str:
    """A libpq ``key=value`` DSN (``host=db port=5432 user=app password=… dbname=events``) as
    the postgresql:// URL asyncpg reads, every part percent-encoded; ValueError, never quoting
    a value (the password), for what cannot be read or converted."""
    pairs: dict[str, str] = {}
    position, end = 0, len(text.rstrip())
    while position < end:
        match = _LIBPQ_PAIR.match(text, position)
        if match is None or match.end() == position:
            raise ValueError(
                "must be 'embedded', a postgresql:// URL or libpq's key=value pairs "
                "(a value with spaces in single quotes)"
            )
        raw = match[2] if match[2] is not None else match[3]
        pairs[match[1]] = re.sub(r"\\(.)", r"\1", raw)
        position = match.end()
    for key in pairs:
        if key not in (*_LIBPQ_QUERY, "host", "port", "user", "password", "dbname"):
            hint = _LIBPQ_HINTS.get(key, "the proxy's driver, asyncpg, does not read it")
            raise ValueError(f"libpq keyword {key!r} is not supported here: {hint}")
    user = quote(pairs.pop("user", ""), safe="")
    password = pairs.pop("password", None)
    userinfo = user + ("" if password is None else ":" + quote(password, safe=""))
    hosts = pairs.get("host", "").split(",") if pairs.get("host") else []
    ports = pairs.get("port", "").split(",") if pairs.get("port") else []
    authority = ""
    if hosts and not any(host.startswith("/") for host in hosts):
        if len(ports) not in (0, 1, len(hosts)):
            raise ValueError(f"libpq port: {len(ports)} port numbers for {len(hosts)} hosts")
        ports = ports * len(hosts) if len(ports) == 1 else ports or [""] * len(hosts)
        authority = ",".join(
            (f"[{host}]" if ":" in host else quote(host, safe=".-")) + (f":{port}" if port else "")
            for host, port in zip(hosts, ports, strict=True)
        )
        pairs.pop("host")
        pairs.pop("port", None)
    database = quote(pairs.pop("dbname", ""), safe="")
    query = "&".join(f"{key}={quote(value, safe='/,')}" for key, value in pairs.items())
    at = "@" if userinfo else ""
    return f"postgresql://{userinfo}{at}{authority}/{database}" + (f"?{query}" if query else "")


def parse_dsn(value: object) -> str | None:
    """``embedded`` (None), a postgresql:// URL that asyncpg reads as written, or libpq's
    ``key=value`` pairs (converted to such a URL by ``libpq_url``).

    asyncpg splits the URL where a browser would: a raw '/', '?' or '#' in the password ends the
    host part early (and the rest is read as a port, a database or a query), a raw '@' moves the
    host. Such a URL is refused here, by what is wrong and never by quoting it: its password.
    """
    if value == EMBEDDED:
        return None
    if isinstance(value, str) and "://" not in value and "=" in value:
        value = libpq_url(value)
    scheme, sep, rest = value.partition("://") if isinstance(value, str) else ("", "", "")
    if not isinstance(value, str) or not sep or scheme.lower() not in ("postgres", "postgresql"):
        raise ValueError("must be 'embedded' or a postgresql:// URL")
    authority, tail = split_authority(rest)
    userinfo, at, hostspec = authority.rpartition("@")
    if "#" in rest:
        raise ValueError(f"has a '#', which ends a URL; {PERCENT_ENCODE}")
    _one_host(userinfo, bool(at), tail)
    if not _USERINFO.fullmatch(userinfo) or not _decodes(userinfo):
        raise ValueError(f"has a character the password must not hold raw; {PERCENT_ENCODE}")
    if not all(_HOST.fullmatch(host) for host in hostspec.split(",")):
        raise ValueError(
            f"has a host:port that cannot be read (a port is digits); {PERCENT_ENCODE}"
        )
    try:
        urlsplit(value)  # its errors quote the host part, password and all
        query = parse_qs(tail.partition("?")[2], strict_parsing=True) if "?" in tail else {}
    except ValueError:
        raise ValueError(
            "must be postgresql://user:password@host:port/database?key=value"
        ) from None
    sslmode = query.get("sslmode", [SSL_MODES[2]])[-1]
    if sslmode not in SSL_MODES:
        raise ValueError(f"sslmode must be one of {', '.join(SSL_MODES)}; got {sslmode!r}")
    return value


def _one_host(userinfo: str, at: bool, tail: str) -> None:
    """ValueError unless the driver, ``check`` and the masking of logs read the same host:
    every '@' but the one that ends the user name and password is refused."""
    path, _, query = tail.partition("?")
    if "@" in userinfo or (not at and "@" in tail):
        # No "@" in the host part but one later: a '/' or '?' in the password cut it short.
        raise ValueError(
            f"has an '@' that does not end the user name and password; {PERCENT_ENCODE}"
        )
    if "@" in path or (":" in userinfo and "@" in query):
        # A password with an '@' and then a '/' or '?': asyncpg ends the host part at the
        # '/' or '?', and takes the host from inside the password, where a reader (and the
        # masking of logs) takes the one after the last '@'.
        raise ValueError(
            "has an '@' after its host part, so the driver would connect to a host written "
            f"inside the password; {PERCENT_ENCODE}"
        )


def split_authority(rest: str) -> tuple[str, str]:
    """A URL's authority (``user:password@host:port``) and what follows it."""
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    return rest[:end], rest[end:]


def _decodes(text: str) -> bool:
    try:
        unquote(text, errors="strict")
    except UnicodeDecodeError:
        return False
    return True


def read_password_file(value: object) -> str:
    """The password in a file (a Kubernetes Secret mounted as one): its text without one trailing
    newline, as ``echo`` and editors leave it."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a file path, got {value!r}")
    try:
        text = reader.read_bounded(value, reader.MAX_SECRET_FILE).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{value}: must be UTF-8 text") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path, or too large
        raise ValueError(f"cannot read: {exc}") from None
    password = text.removesuffix("\n").removesuffix("\r")
    if not password:
        raise ValueError(f"{value} is empty")
    if "\n" in password or "\r" in password:
        raise ValueError(f"{value} must hold the password on one line")
    return password


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


def parse_source(value: object) -> event_ids.Source:
    if not isinstance(value, str):
        raise ValueError(f"must be body:/pointer, header:Name or query:name, got {value!r}")
    return event_ids.parse_source(value)


def parse_sources(value: object) -> event_ids.Source | tuple[event_ids.Source, ...]:
    """One source, or a list of them for a composite key."""
    if isinstance(value, list | tuple):
        if len(value) < 2:
            raise ValueError("a composite event_id needs at least two sources")
        sources = tuple(parse_source(item) for item in value)
        event_ids.check_batch(sources)
        return sources
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
