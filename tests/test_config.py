"""Configuration loading and validation, and the ``check`` command that reports on it."""

from __future__ import annotations

import copy
import hashlib
import hmac
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy import cli, config, errors, event_ids, signatures
from proxy.config import routes, values, verify

UPSTREAM = "http://127.0.0.1:3000"
PASSWORD = "hunter2-not-for-logs"
DSN = f"postgresql://app:{PASSWORD}@db.internal:5432/events"
BASE: dict[str, Any] = {
    "upstream": {"url": UPSTREAM},
    "database": {"dsn": "embedded"},
    "routes": [{"name": "stripe", "path": "/webhooks/stripe", "event_id": "body:/id"}],
}
VALID_YAML = f"""\
listen: 127.0.0.1:8080
upstream:
  url: {UPSTREAM}
database:
  dsn: {DSN}
routes:
  - name: stripe
    path: /webhooks/stripe
    event_id: body:/id
    event_type: body:/type
  - name: github
    path: /webhooks/github
    event_id: header:X-GitHub-Delivery
    upstream: http://127.0.0.1:4000
"""


def raw_config(**overrides: Any) -> dict[str, Any]:
    """A minimal valid document with top-level keys replaced (``None`` removes a key)."""
    raw = copy.deepcopy(BASE)
    for key, value in overrides.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    return raw


def with_route(**fields: Any) -> dict[str, Any]:
    """A minimal valid document whose only route has ``fields`` added or replaced."""
    route = {**BASE["routes"][0], **fields}
    return raw_config(routes=[{k: v for k, v in route.items() if v is not None}])


def problems_of(raw: object) -> tuple[str, ...]:
    with pytest.raises(errors.ConfigError) as info:
        config.parse(raw, source="test.yaml")
    return info.value.problems


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- a valid configuration and its defaults ---------------------------------------------------


def test_minimal_config_gets_the_documented_defaults() -> None:
    cfg = config.parse(raw_config())

    assert cfg.listen == config.Listen(host="0.0.0.0", port=8080)
    assert str(cfg.listen) == "0.0.0.0:8080"
    assert cfg.claim_wait == 10.0
    assert cfg.shutdown_timeout == 30.0
    assert cfg.upstream == config.UpstreamConfig(url=UPSTREAM, timeout=30.0, preserve_host=True)
    assert cfg.database.dsn is None
    assert cfg.database.embedded is True
    assert cfg.database.data_dir == Path(".dedup-proxy/pgdata")
    assert cfg.database.table == "processed_events"
    assert cfg.database.create_schema is True
    assert cfg.database.pool_size == 10
    assert cfg.database.pool_timeout == 5.0
    assert cfg.database.connect_timeout == 5.0
    assert cfg.log == config.LogConfig(level="info", format="auto")
    assert cfg.workers == 1
    assert cfg.routes == (
        routes.RouteConfig(
            name="stripe",
            path="/webhooks/stripe",
            scope="stripe",
            event_id=event_ids.Source("body", "/id", ("id",)),
            event_type=None,
            upstream=UPSTREAM,
            max_body=1024 * 1024,
        ),
    )


def test_route_overrides_upstream_scope_and_max_body() -> None:
    cfg = config.parse(
        raw_config(
            upstream={"url": "http://app:8000/"},
            max_body="1MiB",
            routes=[
                {"name": "a", "path": "/a", "event_id": "header:X-Id"},
                {
                    "name": "b",
                    "path": "/b",
                    "event_id": "query:id",
                    "event_type": "header:X-Type",
                    "scope": "shared",
                    "upstream": "https://other:9443",
                    "max_body": "64KiB",
                },
            ],
        )
    )

    a, b = cfg.routes
    assert cfg.upstream.url == "http://app:8000"  # trailing slash stripped
    assert (a.upstream, a.scope, a.max_body) == ("http://app:8000", "a", 2**20)
    assert (b.upstream, b.scope, b.max_body) == ("https://other:9443", "shared", 64 * 1024)
    assert b.event_id == event_ids.Source("query", "id")
    assert b.event_type == event_ids.Source("header", "X-Type")


def test_every_setting_can_be_given() -> None:
    cfg = config.parse(
        {
            "listen": "127.0.0.1:9000",
            "upstream": {"url": "https://app", "timeout": "45s", "preserve_host": False},
            "database": {
                "dsn": DSN,
                "data_dir": "/var/lib/proxy",
                "table": "dedup.events",
                "create_schema": False,
                "pool_size": 20,
                "pool_timeout": "2s",
                "connect_timeout": "500ms",
            },
            "claim_wait": "1m",
            "shutdown_timeout": 5,
            "max_body": 1024,
            "log": {"level": "debug", "format": "json"},
            "routes": BASE["routes"],
        }
    )

    assert cfg.listen == config.Listen(host="127.0.0.1", port=9000)
    assert cfg.upstream == config.UpstreamConfig(
        url="https://app", timeout=45.0, preserve_host=False
    )
    assert cfg.database == config.DatabaseConfig(
        dsn=config.Secret(DSN),
        data_dir=Path("/var/lib/proxy"),
        table="dedup.events",
        create_schema=False,
        pool_size=20,
        pool_timeout=2.0,
        connect_timeout=0.5,
    )
    assert cfg.database.embedded is False
    assert (cfg.claim_wait, cfg.shutdown_timeout) == (60.0, 5.0)
    assert cfg.routes[0].max_body == 1024
    assert cfg.log == config.LogConfig(level="debug", format="json")


@pytest.mark.parametrize(("value", "workers"), [(2, 2), ("4", 4), (64, 64)])
def test_workers(value: object, workers: int) -> None:
    assert config.parse(raw_config(workers=value)).workers == workers


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (0, "workers: must be a positive integer, got 0"),
        ("two", "workers: must be a positive integer, got 'two'"),
        (65, "workers: must be at most 64, got 65"),
    ],
)
def test_bad_workers_is_rejected(value: object, problem: str) -> None:
    assert problem in problems_of(raw_config(workers=value))


def test_load_reads_a_yaml_file(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, VALID_YAML))

    assert [route.name for route in cfg.routes] == ["stripe", "github"]
    assert cfg.routes[1].upstream == "http://127.0.0.1:4000"
    assert cfg.routes[1].event_id == event_ids.Source("header", "X-GitHub-Delivery")
    assert cfg.database.dsn is not None
    assert cfg.database.dsn.reveal() == DSN


# --- durations and sizes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("30d", 30 * 86400.0),
        ("1.5h", 5400.0),
        (" 20s ", 20.0),
        ("45", 45.0),
        (15, 15.0),
        (2.5, 2.5),
    ],
)
def test_durations(value: object, seconds: float) -> None:
    assert config.parse(raw_config(shutdown_timeout=value)).shutdown_timeout == seconds


@pytest.mark.parametrize("key", ["claim_wait", "upstream.timeout", "database.pool_timeout"])
def test_timeouts_sent_to_postgresql_are_capped_at_an_hour(key: str) -> None:
    def with_value(value: str) -> dict[str, Any]:
        raw = raw_config()
        *sections, name = key.split(".")
        target = raw
        for section in sections:
            target = target[section]
        target[name] = value
        return raw

    assert problems_of(with_value("61m")) == (f"{key}: must be at most 3600s, got '61m'",)
    assert config.parse(with_value("1h"))


@pytest.mark.parametrize("value", ["soon", "30 seconds", "5w", "-5s", "1,5s", "s", True, [30]])
def test_malformed_duration_is_rejected(value: object) -> None:
    assert problems_of(raw_config(claim_wait=value)) == (
        f"claim_wait: must be a duration like 500ms, 30s, 5m or 30d, got {value!r}",
    )


@pytest.mark.parametrize("value", [0, 0.0, -1, -0.5, "0s", "0ms", "0"])
def test_zero_or_negative_duration_is_rejected(value: object) -> None:
    assert problems_of(raw_config(shutdown_timeout=value)) == (
        f"shutdown_timeout: must be positive, got {value!r}",
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_duration_is_rejected(value: float) -> None:
    # YAML's `.nan` and `.inf` are floats; neither is a usable number of seconds.
    assert problems_of(raw_config(claim_wait=value)) == (
        f"claim_wait: must be a finite duration, got {value!r}",
    )


@pytest.mark.parametrize(
    ("value", "size"),
    [
        ("512KiB", 512 * 1024),
        ("10MiB", 10 * 1024 * 1024),
        ("1MB", 1_000_000),
        ("1KB", 1000),
        ("2GiB", 2 * 1024**3),
        ("64 KiB", 64 * 1024),
        ("100B", 100),
        ("4096", 4096),
        (4096, 4096),
    ],
)
def test_sizes(value: object, size: int) -> None:
    assert config.parse(with_route(max_body=value)).routes[0].max_body == size


@pytest.mark.parametrize(
    ("size", "text"),
    [(2**20, "1MiB"), (512 * 1024, "512KiB"), (10**6, "1MB"), (1500, "1500B"), (3 * 2**30, "3GiB")],
)
def test_sizes_are_printed_as_configured(size: int, text: str) -> None:
    assert values.format_size(size) == text
    assert values.parse_size(text) == size


@pytest.mark.parametrize("value", ["1.5MiB", "10 megabytes", "MiB", "-1KiB", 1.5, True])
def test_malformed_size_is_rejected(value: object) -> None:
    assert problems_of(raw_config(max_body=value)) == (
        f"max_body: must be a size like 512KiB or 10MiB, got {value!r}",
    )


@pytest.mark.parametrize("value", [0, -1, "0KiB"])
def test_zero_or_negative_size_is_rejected(value: object) -> None:
    assert problems_of(with_route(max_body=value)) == (
        f"routes[0].max_body: must be positive, got {value!r}",
    )


# --- ${VAR} interpolation ----------------------------------------------------------------------


def test_variable_is_substituted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_URL", "http://app:9000")
    monkeypatch.setenv("POOL", "25")

    cfg = config.parse(
        raw_config(
            upstream={"url": "${UPSTREAM_URL}"},
            database={"dsn": "embedded", "pool_size": "${POOL}"},
        )
    )

    assert cfg.upstream.url == "http://app:9000"
    assert cfg.database.pool_size == 25


def test_variables_inside_a_longer_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APP_HOST", "app.internal")
    monkeypatch.setenv("APP_PORT", "8001")

    cfg = config.parse(raw_config(upstream={"url": "http://${APP_HOST}:${APP_PORT}/hooks"}))

    assert cfg.upstream.url == "http://app.internal:8001/hooks"


def test_default_is_used_when_the_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("WAIT", raising=False)

    cfg = config.parse(
        raw_config(database={"dsn": "${DATABASE_URL:-embedded}"}, claim_wait="${WAIT:-3s}")
    )

    assert cfg.database.dsn is None
    assert cfg.claim_wait == 3.0


def test_set_variable_wins_over_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", DSN)

    cfg = config.parse(raw_config(database={"dsn": "${DATABASE_URL:-embedded}"}))

    assert cfg.database.dsn == config.Secret(DSN)


def test_default_is_used_when_the_variable_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    # `${VAR:-default}` is POSIX-shell / Compose syntax, where ':-' means "unset or empty".
    monkeypatch.setenv("DATABASE_URL", "")

    cfg = config.parse(raw_config(database={"dsn": "${DATABASE_URL:-embedded}"}))

    assert cfg.database.dsn is None


def test_double_dollar_is_a_literal_dollar(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/root")

    cfg = config.parse(raw_config(database={"dsn": "embedded", "data_dir": "/x/$$HOME/$${HOME}"}))

    assert cfg.database.data_dir == Path("/x/$HOME/${HOME}")


def test_missing_variable_names_variable_and_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("STRIPE_PATH", raising=False)

    raw = raw_config(database={"dsn": "${DATABASE_URL}"})
    raw["routes"][0]["path"] = "/hooks/${STRIPE_PATH}"

    assert problems_of(raw) == (
        "database.dsn: environment variable DATABASE_URL is not set",
        "routes[0].path: environment variable STRIPE_PATH is not set",
    )


def test_variable_value_is_not_parsed_as_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    injected = "a: b\n- c"
    monkeypatch.setenv("X", injected)
    text = "upstream: {url: http://app}\ndatabase:\n  dsn: embedded\n  data_dir: ${X}\n"
    text += "routes:\n  - {name: '${X}', path: /p, event_id: body:/id}\n"

    with pytest.raises(errors.ConfigError) as info:
        config.load(write(tmp_path, text))

    # The value arrived as one string: a bad route name, not a new mapping or list.
    assert info.value.problems == (
        f"routes[0].name: must be letters, digits, '_', '.' or '-' (at most 63), got {injected!r}",
    )

    write(tmp_path, text.replace("'${X}'", "stripe"))
    cfg = config.load(tmp_path / "config.yaml")
    assert cfg.database.data_dir == tmp_path / injected  # beside the configuration file


# --- unknown keys and collected problems -------------------------------------------------------


def test_unknown_keys_are_errors_with_a_hint() -> None:
    raw = raw_config(rouets=[], database={"dsn": "embedded", "pool": 3})
    raw["routes"][0]["event-id"] = "body:/id"
    raw["zzz"] = 1

    problems = problems_of(raw)

    assert set(problems) == {
        "rouets: unknown key (did you mean 'routes'?)",
        "zzz: unknown key (expected "
        + ", ".join(config.TOP_KEYS)  # every top-level key, listed for the reader
        + ")",
        "database.pool: unknown key (did you mean 'pool_size'?)",
        "routes[0].event-id: unknown key (did you mean 'event_id'?)",
    }
    assert len(problems) == 4


def test_all_problems_are_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    raw = {
        "listen": "8080",
        "upstream": {"url": "app:8000"},
        "database": {"dsn": "${DATABASE_URL}", "table": "Events"},
        "log": {"level": "loud"},
        "routes": [
            {"name": "a", "path": "/a", "event_id": "body:/id"},
            {"name": "b", "path": "/b", "event_id": "body:/id", "upstream": "app:9000"},
        ],
    }

    with pytest.raises(errors.ConfigError) as info:
        config.parse(raw, source="config.yaml")

    expected = {
        "listen: must be host:port, port 1-65535, IPv6 as [::1]:port; got '8080'",
        "upstream.url: must be an http(s) URL, got 'app:8000'",
        "database.dsn: environment variable DATABASE_URL is not set",
        "database.table: must be a lower-case SQL identifier, optionally schema.table; "
        "got 'Events'",
        "log.level: must be one of debug, info, warning, error; got 'loud'",
        "routes[1].upstream: must be an http(s) URL, got 'app:9000'",
    }
    assert set(info.value.problems) == expected
    assert len(info.value.problems) == len(expected)
    assert info.value.source == "config.yaml"
    message = str(info.value)
    assert message.startswith("invalid configuration in config.yaml:\n")
    assert all(f"\n  {problem}" in message for problem in expected)


@pytest.mark.parametrize("raw", [[1, 2], "listen: 1", 42])
def test_document_must_be_a_mapping(raw: object) -> None:
    problems = problems_of(raw)

    assert problems[0] == f"must be a mapping, got {type(raw).__name__}"
    assert "database: is required (dsn: embedded, or a postgresql:// URL)" in problems


# --- each field's message ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("app:8000", "must be an http(s) URL, got 'app:8000'"),
        ("ftp://app", "must be an http(s) URL, got 'ftp://app'"),
        ("http://", "must be an http(s) URL, got 'http://'"),
        (8000, "must be an http(s) URL, got 8000"),
        ("http://app/?x=1", "must not carry a query or fragment, got 'http://app/?x=1'"),
        ("http://app/#top", "must not carry a query or fragment, got 'http://app/#top'"),
    ],
)
def test_upstream_url_must_be_http(url: object, message: str) -> None:
    assert problems_of(raw_config(upstream={"url": url})) == (f"upstream.url: {message}",)


def test_upstream_url_is_required() -> None:
    assert problems_of(raw_config(upstream={"timeout": "5s"})) == ("upstream.url: is required",)


def test_database_is_required() -> None:
    assert problems_of(raw_config(database=None)) == (
        "database: is required (dsn: embedded, or a postgresql:// URL)",
    )


def test_database_dsn_is_required() -> None:
    assert problems_of(raw_config(database={"table": "events"})) == ("database.dsn: is required",)


@pytest.mark.parametrize("dsn", ["mysql://u:p@h/db", "localhost:5432", "embeded", 5432])
def test_dsn_must_be_embedded_or_postgresql(dsn: object) -> None:
    assert problems_of(raw_config(database={"dsn": dsn})) == (
        "database.dsn: must be 'embedded' or a postgresql:// URL",
    )


@pytest.mark.parametrize("dsn", ["postgresql://u:p@h/db", "postgres://h:5433/db"])
def test_postgresql_dsn_is_kept_secret(dsn: str) -> None:
    cfg = config.parse(raw_config(database={"dsn": dsn}))

    assert isinstance(cfg.database.dsn, config.Secret)
    assert cfg.database.dsn.reveal() == dsn
    assert cfg.database.embedded is False


@pytest.mark.parametrize("table", ["events", "_t1", "dedup.events", "a" * 63])
def test_table_identifier_accepted(table: str) -> None:
    cfg = config.parse(raw_config(database={"dsn": "embedded", "table": table}))

    assert cfg.database.table == table


@pytest.mark.parametrize(
    "table", ["Events", "1events", "a.b.c", "events;drop", "my-events", "", "a" * 64, 7]
)
def test_table_identifier_rejected(table: object) -> None:
    assert problems_of(raw_config(database={"dsn": "embedded", "table": table})) == (
        "database.table: must be a lower-case SQL identifier, optionally schema.table; "
        f"got {table!r}",
    )


@pytest.mark.parametrize("routes", [None, [], "stripe", {"name": "stripe"}])
def test_routes_must_be_a_non_empty_list(routes: object) -> None:
    raw = raw_config()
    raw["routes"] = routes
    assert problems_of(raw) == ("routes: must be a non-empty list of routes",)


def test_route_must_be_a_mapping() -> None:
    assert problems_of(raw_config(routes=["stripe"])) == (
        "routes[0]: must be a mapping, got str",
        "routes[0]: must be a mapping with name, path and event_id (or preset)",
    )


@pytest.mark.parametrize("missing", ["name", "path", "event_id"])
def test_route_field_is_required(missing: str) -> None:
    assert problems_of(with_route(**{missing: None})) == (f"routes[0].{missing}: is required",)


def test_duplicate_route_names_and_paths() -> None:
    raw = raw_config(
        routes=[
            {"name": "a", "path": "/a", "event_id": "body:/id"},
            {"name": "b", "path": "/a", "event_id": "body:/id"},
            {"name": "a", "path": "/c", "event_id": "body:/id"},
        ]
    )

    assert problems_of(raw) == (
        "routes[1].path: '/a' matches the same requests as routes[0] (paths match "
        "case-insensitively, ignoring a trailing slash)",
        "routes[2].name: 'a' is already used by routes[0]",
    )


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("cookie:id", "must be body:/pointer, header:Name or query:name, got 'cookie:id'"),
        ("id", "must be body:/pointer, header:Name or query:name, got 'id'"),
        (5, "must be body:/pointer, header:Name or query:name, got 5"),
        ("body:id", "a JSON pointer must be empty or start with '/', got 'id'"),
        ("header:", "header name must be a non-empty token, got ''"),
        ("query:event id", "query name must be a non-empty token, got 'event id'"),
    ],
)
def test_bad_event_id_source(source: object, message: str) -> None:
    assert problems_of(with_route(event_id=source)) == (f"routes[0].event_id: {message}",)


def test_bad_event_type_source() -> None:
    assert problems_of(with_route(event_type="cookie:type")) == (
        "routes[0].event_type: must be body:/pointer, header:Name or query:name, got 'cookie:type'",
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "name",
            "my route",
            "must be letters, digits, '_', '.' or '-' (at most 63), got 'my route'",
        ),
        ("name", "-x", "must be letters, digits, '_', '.' or '-' (at most 63), got '-x'"),
        ("scope", "a/b", "must be letters, digits, '_', '.' or '-' (at most 63), got 'a/b'"),
        ("path", "webhooks", "must be a URL path starting with '/', got 'webhooks'"),
        (
            "path",
            "/a b",
            "must be a normalized path of letters, digits, '-', '.', '_', '~' and "
            "{name} segments, got '/a b' (segment 'a b')",
        ),
        (
            "path",
            "/a/../b",
            "must be a normalized path of letters, digits, '-', '.', '_', '~' and "
            "{name} segments, got '/a/../b' (segment '..')",
        ),
        (
            "path",
            "/a;x",
            "must be a normalized path of letters, digits, '-', '.', '_', '~' and "
            "{name} segments, got '/a;x' (segment 'a;x')",
        ),
        ("path", "/h/{t}/{t}", "repeats a parameter name: '/h/{t}/{t}'"),
        ("methods", ["post"], "must be HTTP methods in upper case (POST, PUT), got 'post'"),
        ("methods", [], "must be a non-empty list of HTTP methods, got []"),
        ("upstream", "app", "must be an http(s) URL, got 'app'"),
    ],
)
def test_bad_route_field(key: str, value: str, message: str) -> None:
    assert problems_of(with_route(**{key: value})) == (f"routes[0].{key}: {message}",)


# --- templated routes: each tenant's own secrets, or one secret said to be shared ----------------

TENANTS = {"path": "/hooks/{tenant}", "preset": "stripe"}
ONE_VALUE = "(letters, digits, '-', '.', '_', '~'), got"
NOT_MAPPINGS: tuple[object, ...] = ({}, ["acme"], "acme", None)


def github_signature(secret: str, body: bytes) -> CIMultiDict[str]:
    mac = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return CIMultiDict({"X-Hub-Signature-256": f"sha256={mac}"})


def test_tenant_secrets_give_each_tenant_its_own_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACME_EU_SECRET", "acme-eu-secret")
    tenants = {"Acme/EU": "${ACME_EU_SECRET}", "globex/us": ["globex-new", "globex-old"]}
    verify = {"scheme": "github", "tenant_secrets": tenants}
    route = config.parse(with_route(path="/hooks/{tenant}/{region}", verify=verify)).routes[0]
    body = b'{"id": "1"}'

    def verifier(values: tuple[str, ...]) -> signatures.Verifier:
        found = route.verifier_for(values)
        assert found is not None
        return found

    verifier(("ACME", "eu")).verify(github_signature("acme-eu-secret", body), body, 0)
    verifier(("globex", "US")).verify(github_signature("globex-old", body), body, 0)
    for params, secret in [(("globex", "eu"), "acme-eu-secret"), (("acme", "us"), "globex-new")]:
        with pytest.raises(errors.SignatureInvalid):
            verifier(params).verify(github_signature(secret, body), body, 0)
    assert route.scope_for(("ACME", "eu")) == "stripe/acme/eu"
    assert not [s for s in ("acme-eu-secret", "globex-new") if s in repr(route)]


@pytest.mark.parametrize(("key", "value"), [("secret", "s3cret"), ("secrets", ["new", "old"])])
def test_a_secret_shared_by_every_tenant_must_be_said_to_be_shared(key: str, value: object) -> None:
    assert problems_of(with_route(**TENANTS, verify={key: value})) == (
        f"routes[0].verify.{key}: {verify.SHARED_SECRET}",
    )
    shared = config.parse(with_route(**TENANTS, verify={key: value, "shared_secret": True}))
    route = shared.routes[0]
    assert route.verify is not None
    assert route.verifier_for(("acme",)) is route.verifier_for(("globex",)) is route.verify


@pytest.mark.parametrize(
    ("route", "expected"),
    [
        (
            {"preset": "stripe", "verify": {"tenant_secrets": {"acme": "s"}}},
            ["routes[0].verify.tenant_secrets: only on a path with {parameters}"],
        ),
        (
            {"preset": "stripe", "verify": {"secret": "s", "shared_secret": True}},
            ["routes[0].verify.shared_secret: only on a path with {parameters}"],
        ),
        (
            {**TENANTS, "verify": {"secret": "s", "shared_secret": "yes"}},
            [
                "routes[0].verify.shared_secret: must be true or false, got 'yes'",
                f"routes[0].verify.secret: {verify.SHARED_SECRET}",
            ],
        ),
        (
            {**TENANTS, "verify": {"tenant_secrets": {"acme": "s"}, "secrets": ["t"]}},
            ["routes[0].verify: give either tenant_secrets or secrets, not both"],
        ),
        (
            {**TENANTS, "verify": {"tenant_secrets": {"acme": "s"}, "shared_secret": True}},
            ["routes[0].verify: give either tenant_secrets or shared_secret, not both"],
        ),
        (
            {**TENANTS, "scope": "all", "verify": {"tenant_secrets": {"acme": "s"}}},
            [
                "routes[0].verify.tenant_secrets: not with an explicit scope (shared by every "
                "tenant, one tenant could claim another's event IDs first)"
            ],
        ),
        *[
            (
                {**TENANTS, "verify": {"tenant_secrets": tenants}},
                [
                    "routes[0].verify.tenant_secrets: must be a mapping of each tenant's value in "
                    "the path to its secret(s)"
                ],
            )
            for tenants in NOT_MAPPINGS
        ],
        *[
            (
                {**TENANTS, "verify": {"tenant_secrets": {name: "s"}}},
                [
                    f"routes[0].verify.tenant_secrets.{name}: must be a value of {{tenant}} in "
                    f"/hooks/{{tenant}} {ONE_VALUE} {name!r}"
                ],
            )
            for name in ("acme/eu", "ac me", "ac%6De", "..", "", 7)
        ],
        (
            {
                **TENANTS,
                "path": "/h/{tenant}/{region}",
                "verify": {"tenant_secrets": {"acme/eu": "s", "acme": "t"}},
            },
            [
                "routes[0].verify.tenant_secrets.acme: must be a value of {tenant}/{region} in "
                "/h/{tenant}/{region} (letters, digits, '-', '.', '_', '~', the values joined "
                "by /), got 'acme'"
            ],
        ),
        (
            {**TENANTS, "verify": {"tenant_secrets": {"Acme": "s", "ACME": "t"}}},
            [
                "routes[0].verify.tenant_secrets.ACME: is 'Acme' again (tenants match "
                "case-insensitively)"
            ],
        ),
        (
            {**TENANTS, "verify": {"tenant_secrets": {"acme": [], "globex": 3}}},
            [
                "routes[0].verify.tenant_secrets.acme: must be a string or a non-empty list of "
                "strings",
                "routes[0].verify.tenant_secrets.globex: must be a string or a non-empty list of "
                "strings",
            ],
        ),
        (
            {**TENANTS, "verify": {"tenant_secrets": {"acme": ["s", "t\n"]}}},
            ["routes[0].verify.tenant_secrets.acme[1]: has leading or trailing whitespace"],
        ),
        (
            {**TENANTS, "verify": {"tenant_secrets": {"acme": "${DEDUP_TEST_UNSET_SECRET}"}}},
            [
                "routes[0].verify.tenant_secrets.acme: environment variable "
                "DEDUP_TEST_UNSET_SECRET is not set"
            ],
        ),
        (
            {**TENANTS, "preset": "svix", "verify": {"tenant_secrets": {"acme": "whsec_no!"}}},
            ["routes[0].verify.tenant_secrets.acme: must be base64, optionally after whsec_"],
        ),
        (
            {**TENANTS, "verify": {"tenant_secret": {"acme": "s"}}},
            [
                "routes[0].verify.tenant_secret: unknown key (did you mean 'tenant_secrets'?)",
            ],
        ),
    ],
)
def test_tenant_secrets_problems(route: dict[str, Any], expected: list[str]) -> None:
    assert problems_of(with_route(**route)) == tuple(expected)


@pytest.mark.parametrize(
    ("listen", "host", "port", "text"),
    [
        ("127.0.0.1:9000", "127.0.0.1", 9000, "127.0.0.1:9000"),
        ("localhost:80", "localhost", 80, "localhost:80"),
        ("[::1]:8080", "::1", 8080, "[::1]:8080"),
        ("[::]:443", "::", 443, "[::]:443"),
    ],
)
def test_listen(listen: str, host: str, port: int, text: str) -> None:
    cfg = config.parse(raw_config(listen=listen))

    assert cfg.listen == config.Listen(host=host, port=port)
    assert str(cfg.listen) == text


@pytest.mark.parametrize(
    "listen",
    [
        "8080",
        ":8080",
        "host:",
        "host:http",
        "host:65536",
        "host:-1",
        "[]:80",
        8080,
        "host:0",
        "[::1:8080",
        "host:\u00b2",
    ],
)
def test_bad_listen(listen: object) -> None:
    assert problems_of(raw_config(listen=listen)) == (
        f"listen: must be host:port, port 1-65535, IPv6 as [::1]:port; got {listen!r}",
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("level", "verbose", "must be one of debug, info, warning, error; got 'verbose'"),
        ("level", "INFO", "must be one of debug, info, warning, error; got 'INFO'"),
        ("format", "xml", "must be one of auto, json, text; got 'xml'"),
    ],
)
def test_bad_log_choice(key: str, value: str, message: str) -> None:
    assert problems_of(raw_config(log={key: value})) == (f"log.{key}: {message}",)


@pytest.mark.parametrize(("value", "parsed"), [(False, False), ("false", False), ("TRUE", True)])
def test_booleans(value: object, parsed: bool) -> None:
    cfg = config.parse(
        raw_config(
            upstream={"url": UPSTREAM, "preserve_host": value},
            database={"dsn": "embedded", "create_schema": value},
        )
    )

    assert cfg.upstream.preserve_host is parsed
    assert cfg.database.create_schema is parsed


@pytest.mark.parametrize("value", ["yes", "0", 1, 0])
def test_bad_boolean(value: object) -> None:
    assert problems_of(raw_config(upstream={"url": UPSTREAM, "preserve_host": value})) == (
        f"upstream.preserve_host: must be true or false, got {value!r}",
    )


@pytest.mark.parametrize("value", [0, -3, True, "ten", 2.5])
def test_bad_pool_size(value: object) -> None:
    assert problems_of(raw_config(database={"dsn": "embedded", "pool_size": value})) == (
        f"database.pool_size: must be a positive integer, got {value!r}",
    )


# --- secrets -----------------------------------------------------------------------------------


def test_dsn_password_is_hidden_from_repr_and_str() -> None:
    cfg = config.parse(raw_config(database={"dsn": DSN}))

    assert PASSWORD not in repr(cfg)
    assert PASSWORD not in str(cfg)
    assert PASSWORD not in repr(cfg.database)
    assert "Secret('**********')" in repr(cfg.database)
    assert str(config.Secret(DSN)) == "Secret('**********')"


@pytest.mark.parametrize(
    ("dsn", "redacted"),
    [
        (DSN, "postgresql://app:***@db.internal:5432/events"),
        ("postgresql://u:p%40ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u:p@ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://:pw@h/db", "postgresql://:***@h/db"),
        ("postgresql://u@h:5432/db?sslmode=require", "postgresql://u@h:5432/db?sslmode=require"),
        ("postgresql://h/db", "postgresql://h/db"),
    ],
)
def test_redact_dsn(dsn: str, redacted: str) -> None:
    assert config.redact_dsn(dsn) == redacted


def test_redact_dsn_hides_a_password_query_parameter() -> None:
    # libpq and asyncpg both accept the password as a query parameter.
    redacted = config.redact_dsn(f"postgresql://app@db/events?password={PASSWORD}")

    assert PASSWORD not in redacted
    # And the client key's passphrase; it is not a password for password_file's purposes.
    passphrase = config.redact_dsn(f"postgresql://app@db/events?sslpassword={PASSWORD}&x=1")
    assert passphrase == "postgresql://app@db/events?sslpassword=***&x=1"


# --- the check command -------------------------------------------------------------------------


def test_check_prints_routes_without_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, VALID_YAML)

    assert cli.main(["check", "--config", str(path)]) == 0

    out, err = capsys.readouterr()
    assert out.startswith(f"configuration OK: {path}\n")
    assert "listen:      127.0.0.1:8080\n" in out
    assert (
        "database:    postgresql://app:***@db.internal:5432/events, table processed_events" in out
    )
    assert (
        "  POST /webhooks/stripe -> http://127.0.0.1:3000  [stripe]\n"
        "       id body:/id, type body:/type, scope stripe, NOT VERIFIED, retention 30d,"
        " max_body 1MiB\n"
    ) in out
    assert (
        "  POST /webhooks/github -> http://127.0.0.1:4000  [github]\n"
        "       id header:X-GitHub-Delivery, scope github, NOT VERIFIED, retention 30d,"
        " max_body 1MiB\n"
    ) in out
    assert PASSWORD not in out + err
    assert err == ""


def test_check_says_where_the_console_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user learns of the console from ``check`` (issue 51: nothing pointed at it)."""
    path = write(tmp_path, VALID_YAML.replace(DSN, "embedded"))
    assert cli.main(["check", "-c", str(path)]) == 0
    assert (
        "admin:       127.0.0.1:9901: /metrics, /healthz, /readyz; console at "
        "http://127.0.0.1:9901/console/ (read-only, no credentials)"
    ) in capsys.readouterr().out
    off = write(
        tmp_path, VALID_YAML.replace(DSN, "embedded") + "admin: {console: {enabled: false}}\n"
    )
    assert cli.main(["check", "-c", str(off)]) == 0
    assert "admin:       127.0.0.1:9901: /metrics, /healthz, /readyz; console off" in (
        capsys.readouterr().out
    )


def test_check_describes_the_embedded_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, VALID_YAML.replace(DSN, "embedded"))

    assert cli.main(["check", "-c", str(path)]) == 0

    # Absolute, beside the configuration file, whichever directory check runs in.
    out = capsys.readouterr().out
    assert f"database:    embedded (data in {tmp_path}/.dedup-proxy/pgdata)" in out


def test_check_reports_problems_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    text = VALID_YAML.replace(DSN, "${DATABASE_URL}").replace(UPSTREAM, "app:8000", 1)
    path = write(tmp_path, text)

    assert cli.main(["check", "--config", str(path)]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        f"invalid configuration in {path}:\n"
        "  upstream.url: must be an http(s) URL, got 'app:8000'\n"
        "  database.dsn: environment variable DATABASE_URL is not set\n"
    )


def test_no_config_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cli.CONFIG_ENV, raising=False)

    assert cli.main(["check"]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert "no configuration; pass --config FILE or set DEDUP_PROXY_CONFIG" in err
    assert "Traceback" not in err


def test_config_env_var_is_the_fallback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, VALID_YAML)
    monkeypatch.setenv(cli.CONFIG_ENV, str(path))

    assert cli.main(["check"]) == 0

    assert capsys.readouterr().out.startswith(f"configuration OK: {path}\n")


def test_config_option_beats_the_env_var(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, VALID_YAML)
    monkeypatch.setenv(cli.CONFIG_ENV, str(tmp_path / "absent.yaml"))

    assert cli.main(["check", "--config", str(path)]) == 0

    assert capsys.readouterr().out.startswith(f"configuration OK: {path}\n")


@pytest.mark.parametrize("kind", ["missing", "directory", "not-utf8"])
def test_unreadable_file_is_a_clean_error(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-utf8":
        path.write_bytes(b"listen: \xff\xfe\n")

    assert cli.main(["check", "--config", str(path)]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"invalid configuration in {path}:\n  cannot read file: ")
    assert "Traceback" not in err


def test_a_file_far_larger_than_a_configuration_is_refused_having_read_a_bounded_prefix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = tmp_path / "config.yaml"
    with huge.open("wb") as file:
        file.truncate(100 * 1024 * 1024)  # sparse: 100 MiB of NULs that take no disk
    password = tmp_path / "password"
    with password.open("wb") as file:
        file.truncate(10 * 1024 * 1024)
    documents = {
        "the file": huge,
        # The path swapped for /dev/zero never ends: read whole, it takes all the memory there is.
        "/dev/zero": Path("/dev/zero"),
    }
    for what, path in documents.items():
        tracemalloc.start()
        try:
            with pytest.raises(errors.ConfigError) as info:
                config.load(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert info.value.problems == (
            f"not a configuration file: larger than {config.reader.MAX_FILE >> 20} MiB, "
            "the most read",
        ), what
        assert peak < 4 * config.reader.MAX_FILE, (what, peak)
    assert cli.main(["check", "--config", "/dev/zero"]) == 2
    assert "Traceback" not in capsys.readouterr().err
    # So are the files that hold passwords.
    for secret in (password, Path("/dev/zero")):
        problems = problems_of(
            raw_config(
                database={"dsn": "postgresql://app@db:5432/app", "password_file": str(secret)},
                admin={"console": {"credentials_file": str(secret)}},
            )
        )
        assert [p.partition(":")[0] for p in problems] == [
            "database.password_file",
            "admin.console.credentials_file",
        ]
        assert all("larger than 64 KiB" in p for p in problems), problems


def test_invalid_yaml_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "routes: [unclosed\nupstream: {url: http://app}\n")

    assert cli.main(["check", "--config", str(path)]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"invalid configuration in {path}:\n  not valid YAML: ")
    assert "line 2" in err
    assert "Traceback" not in err
    assert '"<unicode string>"' not in err
    assert f'in "{path}", line 1' in err


# --- problems named where the user wrote them ----------------------------------------------------


@pytest.mark.parametrize(
    ("verify", "problem"),
    [
        ({"secret": ""}, "routes[0].verify.secret: must not be empty"),
        ({"secrets": ["whsec_a", ""]}, "routes[0].verify.secrets[1]: must not be empty"),
        ({"secret": " whsec_a"}, "routes[0].verify.secret: has leading or trailing whitespace"),
        (
            {"secrets": ["whsec_a", "whsec_b\n"]},
            "routes[0].verify.secrets[1]: has leading or trailing whitespace",
        ),
    ],
)
def test_a_bad_secret_is_reported_under_the_key_it_was_given(
    verify: dict[str, Any], problem: str
) -> None:
    assert problems_of(with_route(preset="stripe", verify=verify)) == (problem,)


def test_an_empty_secret_from_the_environment_names_its_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DEDUP_TEST_EMPTY_SECRET", "")
    raw = with_route(preset="stripe", verify={"secret": "${DEDUP_TEST_EMPTY_SECRET}"})

    assert problems_of(raw) == ("routes[0].verify.secret: must not be empty",)


def test_a_misspelt_secret_is_one_unknown_key_with_a_hint() -> None:
    raw = with_route(preset="stripe", verify={"secert": "whsec_x"})

    assert problems_of(raw) == ("routes[0].verify.secert: unknown key (did you mean 'secret'?)",)


def test_a_verify_without_a_secret_says_it_is_required() -> None:
    assert problems_of(with_route(preset="stripe", verify={"tolerance": "1m"})) == (
        "routes[0].verify.secret: is required (or secrets: a list, or tenant_secrets)",
    )


def test_an_unknown_preset_is_one_problem() -> None:
    raw = with_route(event_id=None, preset="strpe", verify={"secret": "whsec_x"})

    (problem,) = problems_of(raw)
    assert problem.startswith("routes[0].preset: must be one of stripe, github, ")
    assert problem.endswith("got 'strpe': did you mean 'stripe'?")


@pytest.mark.parametrize(("written", "hint"), [("githib", "github"), ("Shopfy", "shopify")])
def test_a_misspelt_preset_is_refused_with_the_nearest_one(written: str, hint: str) -> None:
    (problem,) = problems_of(with_route(event_id=None, preset=written))
    assert problem.endswith(f"got {written!r}: did you mean {hint!r}?")


@pytest.mark.parametrize("written", ["GitHub", "Github", "GITHUB"])
def test_a_preset_is_named_in_any_case(written: str) -> None:
    (route,) = config.parse(with_route(event_id=None, preset=written)).routes
    assert route.preset == "github"
    assert (
        route.event_id
        == config.parse(with_route(event_id=None, preset="github")).routes[0].event_id
    )


# --- hand_off ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("preset", "hand_off"),
    [("github", 7.0), ("shopify", 3.5), ("slack", 2.1), ("stripe", None), ("paypal", None)],
)
def test_a_redeliver_routes_hand_off_is_its_providers_deadline_share(
    preset: str, hand_off: float | None
) -> None:
    """At 0.7 of the deadline the preset states; none where the provider publishes none."""
    cfg = config.parse(with_route(name="p", preset=preset, event_id=None, redeliver=True))
    assert cfg.routes[0].hand_off == hand_off


@pytest.mark.parametrize(("value", "hand_off"), [("2s", 2.0), ("off", None), (False, None)])
def test_hand_off_is_a_duration_or_off(value: object, hand_off: float | None) -> None:
    cfg = config.parse(
        with_route(name="p", preset="github", event_id=None, redeliver=True, hand_off=value)
    )
    assert cfg.routes[0].hand_off == hand_off


def test_hand_off_needs_redeliver_and_a_preset_without_it_sets_none() -> None:
    assert (
        config.parse(with_route(name="p", preset="github", event_id=None)).routes[0].hand_off
        is None
    )
    assert problems_of(with_route(hand_off="2s")) == (
        "routes[0].hand_off: only with redeliver: handing off keeps the delivery for "
        "the redeliverer",
    )
    assert problems_of(with_route(redeliver=True, hand_off="2h")) == (
        "routes[0].hand_off: must be at most 3600s, got '2h'",
    )


def test_check_names_where_a_routes_receipts_are_written_never_their_dsn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = VALID_YAML.replace(
        "    event_type: body:/type\n",
        "    event_type: body:/type\n    receipt: true\n",
        1,
    ).replace(
        "    upstream: http://127.0.0.1:4000\n",
        f"    upstream: http://127.0.0.1:4000\n    receipt:\n      dsn: {DSN}\n",
        1,
    )
    path = write(tmp_path, text)

    assert cli.main(["check", "-c", str(path)]) == 0

    out = capsys.readouterr().out
    assert "receipt: the app writes Dedup-Receipt in the claim database" in out
    assert "receipt: the app writes Dedup-Receipt in receipt.dsn (masked)" in out
    assert PASSWORD not in out
