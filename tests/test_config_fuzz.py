"""Property tests for the configuration loader: whatever the YAML, a Config or one ConfigError.

The CLI turns a ``ConfigError`` into its problem list and exit code 2; any other exception reaches
the user as a traceback. Documents are biased toward the real key names (read from ``config`` so
new keys are fuzzed too) and toward values that sit on the edges of each grammar.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy import config, errors
from proxy.config import routes
from proxy.config import verify as verify_section

FUZZ = settings(max_examples=200, deadline=None, database=None)

SECTION_KEYS = {
    "upstream": ("url", "timeout", "preserve_host"),
    "database": config.DATABASE_KEYS,
    "log": ("level", "format"),
}
VERIFY_KEYS: tuple[str, ...] = verify_section.VERIFY_KEYS
KEY_NAMES = tuple(
    dict.fromkeys(
        config.TOP_KEYS
        + config.DATABASE_KEYS
        + routes.ROUTE_KEYS
        + VERIFY_KEYS
        + SECTION_KEYS["upstream"]
        + SECTION_KEYS["log"]
    )
)

# Values that are valid somewhere, or just outside a grammar, or hard on a parser.
EDGE_VALUES: tuple[object, ...] = (
    "http://127.0.0.1:3000",
    "https://app.internal/base/",
    "http://[::1",
    "app:8000",
    "embedded",
    "postgresql://dedup:hunter%212@127.0.0.1:5432/app",
    "postgresql://[x",
    "processed_events",
    "Bad.Table",
    "corvel",
    "/webhooks/{tenant}",
    "body:/id",
    "body:id",
    "header:X-GitHub-Delivery",
    "header:",
    "query:id",
    ["body:/a", "header:B"],
    ["body:/a"],
    "stripe",
    "github",
    "svix",
    "hmac",
    "reject",
    "forward",
    "sha256",
    "base64",
    "whsec_c2VjcmV0",
    "0.0.0.0:8080",
    "[::1]:8080",
    "::1:8080",
    "host:0",
    "host:65536",
    "250ms",
    "1.5s",
    "30d",
    "0s",
    "-5s",
    "1e3s",
    "9" * 400 + "s",
    "10MiB",
    "1 GiB",
    "0B",
    "9" * 5000,
    "\u0663",  # ARABIC-INDIC DIGIT THREE: str.isdigit() is true
    "true",
    "False",
    "debug",
    "json",
    "${DEDUP_PROXY_FUZZ_UNSET}",
    "${DEDUP_PROXY_FUZZ_UNSET:-250ms}",
    "${HOME}",
    "$$",
    "${",
    "\x00",
    "",
    0,
    -1,
    1,
    65536,
    2**63,
    10**400,
    -(10**400),
    0.0,
    -0.0,
    1e-300,
    1e300,
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    None,
    b"bytes",
)

scalars = st.one_of(
    st.sampled_from(EDGE_VALUES),
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
keys = st.one_of(st.sampled_from(KEY_NAMES), st.text(max_size=12), st.integers(), st.none())
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=20,
)
leaf = st.one_of(scalars, scalars, anything)


def section(names: tuple[str, ...], value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A mapping of some of ``names`` (now and then a stray key), or anything at all."""
    return st.one_of(
        st.dictionaries(st.one_of(st.sampled_from(names), keys), value, max_size=len(names) + 1),
        anything,
    )


verify = section(VERIFY_KEYS or ("scheme",), leaf)
route = section(routes.ROUTE_KEYS, st.one_of(leaf, verify))
top_level_values: dict[str, st.SearchStrategy[Any]] = {
    **{key: leaf for key in config.TOP_KEYS},
    **{name: section(names, leaf) for name, names in SECTION_KEYS.items()},
    "routes": st.one_of(st.lists(route, max_size=3), anything),
}
shaped_documents = st.fixed_dictionaries({}, optional=top_level_values)
documents = st.one_of(shaped_documents, shaped_documents, anything)


def config_or_config_error(call: Callable[[], object]) -> None:
    """``call`` returns a Config or raises a ConfigError listing problems; nothing else."""
    try:
        result = call()
    except errors.ConfigError as exc:
        problems = exc.problems
    else:
        assert isinstance(result, config.Config)
        return
    assert isinstance(problems, tuple)
    assert problems
    assert all(isinstance(problem, str) and problem for problem in problems)


def valid_skeleton() -> dict[str, Any]:
    return {
        "upstream": {"url": "http://127.0.0.1:3000"},
        "database": {"dsn": "postgresql://dedup@127.0.0.1/app"},
        "routes": [{"name": "corvel", "path": "/webhooks/corvel", "event_id": "body:/id"}],
    }


def with_value(path: tuple[str, ...], value: object) -> dict[str, Any]:
    document = valid_skeleton()
    node = document
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return document


@FUZZ
@given(documents)
@example(with_value(("claim_wait",), 10**400))
@example(with_value(("claim_wait",), -(10**400)))
@example(with_value(("upstream", "timeout"), -(10**400)))
def test_any_document_gives_a_config_or_a_config_error(document: object) -> None:
    config_or_config_error(lambda: config.parse(document))


YAML_SCALARS = (
    "2001-13-01",  # a YAML 1.1 timestamp datetime() refuses
    "2001-02-30",
    "2001-01-01 25:00:00",
    "!!timestamp x",
    "!!float abc",
    "!!int abc",
    "9" * 5000,  # over Python's int-from-text digit limit
    "0x" + "f" * 5000,
    "1:20:30",  # sexagesimal integer
    "8080:80",
    "!!binary AAAA",
    "!!set {a}",
    "!!python/object:os.system x",
    "&a [*a]",
    "*missing",
    "'unterminated",
    "{",
    "~",
    ".nan",
    "-.inf",
    "yes",
    "${HOME}",
    "[" * 1000,  # nesting deeper than the recursion limit
)
yaml_scalar_text = st.one_of(
    st.sampled_from(YAML_SCALARS),
    st.sampled_from([str(value) for value in EDGE_VALUES]),
    st.text(max_size=20),
)
yaml_line = st.builds(
    "{}{}{}".format,
    st.sampled_from(["", "  ", "    ", "  - ", "- "]),
    st.one_of(st.sampled_from([f"{key}: " for key in KEY_NAMES]), st.text(max_size=8)),
    yaml_scalar_text,
)
yaml_texts = st.one_of(
    st.lists(yaml_line, max_size=12).map("\n".join),
    st.text(),
    documents.map(lambda doc: yaml.safe_dump(doc) if _dumpable(doc) else ""),
)


def _dumpable(document: object) -> bool:
    try:
        yaml.safe_dump(document)
    except (yaml.YAMLError, ValueError):
        return False
    return True


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "config.yaml"


@FUZZ
@given(text=yaml_texts)
@example(text="claim_wait: 2001-13-01\n")
@example(text="max_body: " + "9" * 5000 + "\n")
@example(text="listen: !!timestamp x\n")
@example(text="routes: " + "[" * 1000 + "\n")
def test_any_file_gives_a_config_or_a_config_error(config_file: Path, text: str) -> None:
    config_file.write_text(text, encoding="utf-8", errors="surrogatepass")
    config_or_config_error(lambda: config.load(config_file))


# Valid values and what they mean: (as written in YAML, expected parsed value).
DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "KiB": 2**10,
    "MB": 10**6,
    "MiB": 2**20,
    "GB": 10**9,
    "GiB": 2**30,
}
UNSET = "DEDUP_PROXY_FUZZ_UNSET"

durations = st.one_of(
    st.builds(
        lambda n, unit: (f"{n}{unit}", n * DURATION_UNITS[unit]),
        st.integers(1, 10**4),
        st.sampled_from(sorted(DURATION_UNITS)),
    ),
    st.builds(
        lambda whole, frac: (f"{whole}.{frac}s", whole + int(frac) / 10 ** len(frac)),
        st.integers(0, 10**4),
        st.from_regex(r"[0-9]{0,2}[1-9]", fullmatch=True),
    ),
    st.integers(1, 10**6).map(lambda n: (n, float(n))),
    st.floats(1e-3, 1e6).map(lambda x: (x, x)),
    # ${VAR:-default} falls back to the default when VAR is unset.
    st.integers(1, 10**4).map(lambda n: (f"${{{UNSET}:-{n}ms}}", n / 1000)),
)
sizes = st.one_of(
    st.builds(
        lambda n, unit: (f"{n}{unit}", n * SIZE_UNITS[unit]),
        st.integers(1, 10**6),
        st.sampled_from(sorted(SIZE_UNITS)),
    ),
    st.integers(1, 2**40).map(lambda n: (n, n)),
)
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,30}", fullmatch=True)
sources = st.one_of(
    st.from_regex(r"body:(/[a-z0-9_~-]{1,10}){0,3}", fullmatch=True),
    st.from_regex(r"(header|query):[A-Za-z0-9-]{1,20}", fullmatch=True),
)
# claim_wait and the upstream/database timeouts are capped at an hour.
short_durations = durations.filter(lambda text_and_seconds: text_and_seconds[1] <= 3600)
listens = st.builds(
    lambda host, port: (f"{host}:{port}", (host.strip("[]"), port)),
    st.sampled_from(["0.0.0.0", "127.0.0.1", "localhost", "[::1]", "[::]"]),
    # Not the admin listener's default port, which the public one must not share.
    st.integers(1, 65535).filter(lambda port: port != 9901),
)
tables = st.from_regex(r"([a-z_][a-z0-9_]{0,20}\.)?[a-z_][a-z0-9_]{0,20}", fullmatch=True)


@st.composite
def valid_configs(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """A valid document and the values it should parse to."""
    timings = {
        key: draw(durations if key.endswith("_timeout") else short_durations)
        for key in ("claim_wait", "shutdown_timeout", "client_timeout", "upstream", "pool", "db")
    }
    listen_text, listen = draw(listens)
    max_body_text, max_body = draw(sizes)
    table = draw(tables)
    pool_size = draw(st.integers(1, 1000))
    route_names = draw(st.lists(names, min_size=1, max_size=4, unique=True))
    routes = []
    expected_routes = []
    for number, name in enumerate(route_names):
        source = draw(sources)
        own_max_body = draw(st.none() | sizes)
        raw_route: dict[str, Any] = {"name": name, "path": f"/hooks/{number}/{{tenant}}"}
        raw_route["event_id"] = source
        if own_max_body is not None:
            raw_route["max_body"] = own_max_body[0]
        routes.append(raw_route)
        expected_routes.append(
            (
                name,
                raw_route["path"],
                name,
                source,
                max_body if own_max_body is None else own_max_body[1],
            )
        )
    document = {
        "listen": listen_text,
        "upstream": {"url": "http://app.internal:3000/", "timeout": timings["upstream"][0]},
        "database": {
            "dsn": "postgresql://dedup:hunter%212@127.0.0.1:5432/app",
            "table": table,
            "pool_size": pool_size,
            "pool_timeout": timings["pool"][0],
            "connect_timeout": timings["db"][0],
            "data_dir": "/var/lib/$$dedup",
        },
        "claim_wait": timings["claim_wait"][0],
        "shutdown_timeout": timings["shutdown_timeout"][0],
        "client_timeout": timings["client_timeout"][0],
        "max_body": max_body_text,
        "routes": routes,
    }
    expected = {
        "listen": listen,
        "timings": {key: value for key, (_, value) in timings.items()},
        "table": table,
        "pool_size": pool_size,
        "routes": expected_routes,
    }
    return document, expected


@FUZZ
@given(valid_configs())
def test_valid_config_parses_to_what_it_says(case: tuple[dict[str, Any], dict[str, Any]]) -> None:
    assert UNSET not in os.environ
    document, expected = case

    parsed = config.parse(document)

    timings = {
        "claim_wait": parsed.claim_wait,
        "shutdown_timeout": parsed.shutdown_timeout,
        "client_timeout": parsed.client_timeout,
        "upstream": parsed.upstream.timeout,
        "pool": parsed.database.pool_timeout,
        "db": parsed.database.connect_timeout,
    }
    assert timings.keys() == expected["timings"].keys()
    for key, seconds in expected["timings"].items():
        assert math.isclose(timings[key], seconds, rel_tol=1e-9), key
    assert (parsed.listen.host, parsed.listen.port) == expected["listen"]
    assert parsed.upstream.url == "http://app.internal:3000"
    assert parsed.database.dsn == config.Secret("postgresql://dedup:hunter%212@127.0.0.1:5432/app")
    assert "hunter" not in repr(parsed)
    assert parsed.database.table == expected["table"]
    assert parsed.database.pool_size == expected["pool_size"]
    assert parsed.database.data_dir == Path("/var/lib/$dedup")
    assert [
        (r.name, r.path, r.scope, str(r.event_id), r.max_body) for r in parsed.routes
    ] == expected["routes"]
    assert all(r.upstream == "http://app.internal:3000" for r in parsed.routes)


def test_duration_examples_from_the_readme() -> None:
    document = valid_skeleton()
    document.update(claim_wait="250ms", shutdown_timeout="5m", client_timeout="2h")
    document["upstream"]["timeout"] = "1h"

    parsed = config.parse(document)

    assert (parsed.claim_wait, parsed.shutdown_timeout, parsed.client_timeout) == (
        0.25,
        300.0,
        7200.0,
    )
    assert parsed.upstream.timeout == 3600
