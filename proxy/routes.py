"""Routes: each webhook path, where its event ID is, how it is verified, how long it is kept."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy import keys, paths, presets, reader, signatures, values

DEFAULT_RETENTION = 30 * 86400.0
# The largest app answer stored for replay: TwiML and chat answers are a few KiB.
DEFAULT_REPLAY_MAX_BODY = 64 * 1024
# Stored through the COMMIT's statement, hex-encoded: a megabyte is already a large statement.
MAX_REPLAY_MAX_BODY = 1024 * 1024
# semantics: idempotency-key — the IETF httpapi draft's header, its methods, a day of keys.
IDEMPOTENCY_KEY = "header:Idempotency-Key"
IDEMPOTENCY_METHODS = ("POST", "PATCH")
IDEMPOTENCY_RETENTION = 86400.0
ROUTE_KEYS = ("name", "path", "preset", "scope", "event_id", "event_type", "upstream",
              "max_body", "verify", "retention", "missing_id", "methods", "on_duplicate",
              "replay_max_body", "replay_set_cookie", "claim_wait", "semantics",
              "scope_from")  # fmt: skip
VERIFY_KEYS = ("scheme", "secret", "secrets", "tolerance", "header", "algorithm", "encoding",
               "prefix", "public_url", "tenant_secrets", "shared_secret")  # fmt: skip
# How signatures names a bad secret ("secrets[1] has leading or trailing whitespace").
_NUMBERED = re.compile(r"secrets\[(\d+)\] ")
SHARED_SECRET = (
    "on a path with {parameters} this would verify every tenant's path, so one tenant could sign "
    "another's events: give each tenant its own under tenant_secrets, or set shared_secret: true "
    "if one sender signs for every tenant"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteConfig:
    name: str
    path: str
    scope: str
    # Scope each claim by the path's {parameters} too (a templated path without an explicit
    # scope): /hooks/acme and /hooks/globex are separate ID spaces.
    scoped_by_path: bool = False
    methods: tuple[str, ...] = ("POST",)
    event_id: keys.Source | tuple[keys.Source, ...]  # a tuple: a composite key
    event_type: keys.Source | None
    upstream: str
    max_body: int
    preset: str | None = None
    # With tenant_secrets a signatures.TenantSignatures, which refuses every request itself: the
    # pipeline verifies with verifier_for.
    verify: signatures.Verifier | None = None
    retention: float = DEFAULT_RETENTION
    forward_missing_id: bool = False  # ``missing_id: forward``
    # ``on_duplicate: replay``: a duplicate gets the app's first 2xx answer, stored with the claim.
    replay: bool = False
    replay_max_body: int = DEFAULT_REPLAY_MAX_BODY
    replay_set_cookie: bool = False
    # How long a copy waits on this event in flight; None: the global claim_wait. Never longer
    # than the global one (the pipeline takes the smaller).
    claim_wait: float | None = None
    # ``semantics: idempotency-key``: an API route keyed by the client's Idempotency-Key.
    idempotency: bool = False
    scope_from: tuple[keys.Source, ...] = ()  # hashed into the scope: one key space per client

    @property
    def id_signed(self) -> bool:
        """Whether the signature covers every part of the event ID (False when unverified)."""
        if self.verify is None:
            return False
        sources = self.event_id if isinstance(self.event_id, tuple) else (self.event_id,)
        signed = self.verify.signed_headers
        return all(
            source.kind == "body" or (source.kind == "header" and source.name.lower() in signed)
            for source in sources
        )

    @property
    def pattern(self) -> paths.Pattern:
        return paths.Pattern.parse(self.path)

    def scope_for(self, values: tuple[str, ...]) -> str:
        """The claim's scope for a request whose path parameters are ``values``; parameter
        values are scoped case-insensitively, as the path's literals."""
        if not self.scoped_by_path:
            return self.scope
        return f"{self.scope}/{_tenant(values)}"

    def verifier_for(self, values: tuple[str, ...]) -> signatures.Verifier | None:
        """The verifier of a request whose path parameters are ``values`` (None: unverified): on
        a route with ``tenant_secrets``, that tenant's, found as the scope is (case-folded), or
        one that refuses every request for a tenant without secrets."""
        if isinstance(self.verify, signatures.TenantSignatures):
            return self.verify.for_tenant(_tenant(values))
        return self.verify


def _tenant(values: tuple[str, ...]) -> str:
    """The tenant a path names: its parameter values, case-folded, joined by "/"."""
    return "/".join(value.lower() for value in values)


def parse_routes(
    r: reader.Reader,
    raw: object,
    default_upstream: str,
    default_max_body: int,
    claim_wait: float = float("inf"),
) -> tuple[RouteConfig, ...]:
    """The routes; ``claim_wait`` is the global one, which a route's may only shorten."""
    if not isinstance(raw, list) or not raw:
        r.problem("routes", "must be a non-empty list of routes")
        return ()
    parsed: list[RouteConfig] = []
    seen_names: dict[str, str] = {}
    seen_paths: dict[tuple[str, ...], str] = {}
    for index, item in enumerate(raw):
        path = f"routes[{index}]"
        route = r.mapping(item, path, ROUTE_KEYS)
        if not route:
            r.problem(path, "must be a mapping with name, path and event_id (or preset)")
            continue
        preset_name = r.value(route, "preset", path, values.parse_choice(*presets.PRESETS), None)
        preset = presets.PRESETS.get(preset_name or "")
        bad_preset = preset is None and route.get("preset") is not None
        name = r.required(route, "name", path, values.parse_name)
        pattern = r.required(route, "path", path, paths.Pattern.parse)
        url_path = pattern.path if pattern else None
        semantics = r.value(
            route, "semantics", path, values.parse_choice("webhook", "idempotency-key"), "webhook"
        )
        idempotency = semantics == "idempotency-key"
        event_id = _event_id(r, route, path, preset, idempotency=idempotency)
        if name is not None and name in seen_names:
            r.problem(f"{path}.name", f"{name!r} is already used by {seen_names[name]}")
        elif name is not None:
            seen_names[name] = path
        if pattern is not None and pattern.key in seen_paths:
            r.problem(
                f"{path}.path",
                f"{pattern.path!r} matches the same requests as {seen_paths[pattern.key]} "
                "(paths match case-insensitively, ignoring a trailing slash)",
            )
        elif pattern is not None:
            seen_paths[pattern.key] = path
        default_type = (
            values.parse_source(preset.event_type) if preset and preset.event_type else None
        )
        missing_id = "forward" if preset and preset.forward_missing_id else "reject"
        route_config = RouteConfig(
            name=name or "",
            path=url_path or "",
            scope=r.value(route, "scope", path, values.parse_name, name or ""),
            scoped_by_path="scope" not in route and bool(pattern and pattern.params),
            methods=r.value(route, "methods", path, values.parse_methods, ("POST",)),
            idempotency=idempotency,
            scope_from=r.value(route, "scope_from", path, _parse_scope_from, ()),
            event_id=event_id or (),
            event_type=r.value(route, "event_type", path, values.parse_source, default_type),
            upstream=r.value(route, "upstream", path, values.parse_http_url, default_upstream),
            max_body=r.value(
                route,
                "max_body",
                path,
                values.parse_size,
                preset.max_body if preset and preset.max_body else default_max_body,
            ),
            preset=preset_name,
            verify=_parse_verify(
                r,
                route.get("verify"),
                f"{path}.verify",
                preset_name,
                preset,
                pattern=pattern,
                explicit_scope="scope" in route,
                bad_preset=bad_preset,
            ),
            retention=r.value(
                route,
                "retention",
                path,
                values.parse_duration,
                preset.retention
                if preset
                else IDEMPOTENCY_RETENTION
                if idempotency
                else DEFAULT_RETENTION,
            ),
            forward_missing_id=r.value(
                route, "missing_id", path, values.parse_choice("reject", "forward"), missing_id
            )
            == "forward",
            replay=r.value(
                route,
                "on_duplicate",
                path,
                values.parse_choice("ack", "replay"),
                (preset and preset.on_duplicate) or ("replay" if idempotency else "ack"),
            )
            == "replay",
            claim_wait=r.value(
                route,
                "claim_wait",
                path,
                values.parse_duration_upto(claim_wait),
                min(preset.claim_wait, claim_wait) if preset and preset.claim_wait else None,
            ),
            replay_max_body=r.value(
                route, "replay_max_body", path, values.parse_size, DEFAULT_REPLAY_MAX_BODY
            ),
            replay_set_cookie=r.value(route, "replay_set_cookie", path, values.parse_bool, False),
        )
        if idempotency:
            _check_idempotency(r, path, route_config)
        elif "scope_from" in route:
            r.problem(f"{path}.scope_from", "only for semantics: idempotency-key")
        for option in ("replay_max_body", "replay_set_cookie"):
            if option in route and not route_config.replay:
                r.problem(f"{path}.{option}", "only with on_duplicate: replay")
        if route_config.replay_max_body > MAX_REPLAY_MAX_BODY:
            r.problem(f"{path}.replay_max_body", f"must be at most {MAX_REPLAY_MAX_BODY} (1MiB)")
        if name is not None and url_path is not None and event_id is not None:
            parsed.append(route_config)
    return tuple(parsed)


def _event_id(
    r: reader.Reader,
    route: dict[str, Any],
    path: str,
    preset: presets.Preset | None,
    *,
    idempotency: bool,
) -> keys.Source | tuple[keys.Source, ...] | None:
    """The route's event_id, or its preset's or semantics' default; None, reported, if none."""
    if idempotency and preset is None:
        default_id = values.parse_sources(IDEMPOTENCY_KEY)
        return r.value(route, "event_id", path, values.parse_sources, default_id)
    if preset is None and route.get("preset") is not None:
        # A misspelt preset is reported once, not again as the event_id it would have set.
        return r.value(route, "event_id", path, values.parse_sources, None)
    if preset is None:
        return r.required(route, "event_id", path, values.parse_sources)
    ids = preset.event_id
    return r.value(
        route, "event_id", path, values.parse_sources,
        values.parse_sources(ids if len(ids) > 1 else ids[0]),
    )  # fmt: skip


def _parse_scope_from(value: object) -> tuple[keys.Source, ...]:
    """One header source or a list of them (``header:Authorization``)."""
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("must be a header source or a non-empty list of them")
    sources = tuple(values.parse_source(item) for item in items)
    if any(source.kind != "header" for source in sources):
        raise ValueError(f"must be header sources (header:Authorization), got {value!r}")
    return sources


def _check_idempotency(r: reader.Reader, path: str, route: RouteConfig) -> None:
    """What ``semantics: idempotency-key`` allows: POST and PATCH (the draft's methods; the
    others are idempotent already), and the first answer replayed."""
    others = [method for method in route.methods if method not in IDEMPOTENCY_METHODS]
    if others:
        r.problem(f"{path}.methods", f"idempotency-key routes claim POST or PATCH, not {others}")
    if not route.replay:
        r.problem(f"{path}.on_duplicate", "idempotency-key routes always replay the first answer")
    if route.claim_wait is not None:
        r.problem(f"{path}.claim_wait", "idempotency-key routes never wait: a key in flight is 409")


def _parse_verify(
    r: reader.Reader,
    raw: object,
    path: str,
    preset_name: str | None,
    preset: presets.Preset | None,
    *,
    pattern: paths.Pattern | None,
    explicit_scope: bool,
    bad_preset: bool = False,
) -> signatures.Verifier | None:
    section = r.mapping(raw, path, VERIFY_KEYS)
    if raw is None:
        return None
    scheme = r.value(section, "scheme", path, values.parse_choice(*signatures.SCHEMES), None)
    if scheme is None and "scheme" not in section:
        scheme = preset.scheme if preset else None
        if scheme is None and not bad_preset:
            reason = (
                f"preset {preset_name} has no signature scheme the proxy can check"
                if preset_name
                else "is required"
            )
            r.problem(f"{path}.scheme", reason)
    options = {
        key: r.value(section, key, path, str, None)
        for key in ("header", "algorithm", "encoding", "prefix", "public_url")
    }
    default_tolerance = (preset and preset.tolerance) or signatures.DEFAULT_TOLERANCE
    tolerance = r.value(section, "tolerance", path, values.parse_duration, default_tolerance)
    checked = None
    try:
        if scheme is not None:
            checked = signatures.settings(scheme, tolerance=tolerance, **options)
    except ValueError as exc:
        r.problem(path, str(exc))
    templated = pattern is not None and bool(pattern.params)
    if "tenant_secrets" in section:
        for key in ("secret", "secrets", "shared_secret"):
            if key in section:
                r.problem(path, f"give either tenant_secrets or {key}, not both")
        where = f"{path}.tenant_secrets"
        if pattern is not None and not templated:
            r.problem(where, "only on a path with {parameters}")
        if explicit_scope:
            r.problem(where, "not with an explicit scope (shared by every tenant, one tenant "
                      "could claim another's event IDs first)")  # fmt: skip
        tenants = pattern if templated else None
        return _parse_tenants(r, section["tenant_secrets"], where, checked, tenants)
    if "secret" in section and "secrets" in section:
        r.problem(path, "give either secret or secrets, not both")
    key = "secrets" if "secrets" in section else "secret"
    if key not in section:
        # A misspelt secret (secert) is reported as an unknown key already, with its did-you-mean.
        secret_keys = ("secret", "secrets", "tenant_secrets")
        if not any(difflib.get_close_matches(str(name), secret_keys, n=1) for name in section):
            r.problem(f"{path}.secret", "is required (or secrets: a list, or tenant_secrets)")
        return None
    secrets = r.strings(section, key, path)
    shared = r.value(section, "shared_secret", path, values.parse_bool, False)
    if "shared_secret" in section and pattern is not None and not templated:
        r.problem(f"{path}.shared_secret", "only on a path with {parameters}")
    elif templated and secrets is not None and not shared:
        r.problem(f"{path}.{key}", SHARED_SECRET)
    listed = isinstance(section[key], list)
    return _verifier(r, f"{path}.{key}", checked, secrets, listed=listed)


def _parse_tenants(
    r: reader.Reader,
    raw: object,
    path: str,
    checked: signatures.Settings | None,
    pattern: paths.Pattern | None,
) -> signatures.Verifier | None:
    """``tenant_secrets``: each tenant (its value in the path) and its secret or secrets."""
    if not isinstance(raw, Mapping) or not raw:
        r.problem(path, "must be a mapping of each tenant's value in the path to its secret(s)")
        return None
    verifiers: dict[str, signatures.Verifier] = {}
    spelled: dict[str, str] = {}
    for name in raw:
        where = reader.join(path, str(name))
        secrets = r.strings(raw, name, path)
        try:
            tenant = _tenant(pattern.parse_values(name)) if pattern else None
        except ValueError as exc:
            r.problem(where, str(exc))
            continue
        if tenant in spelled:
            r.problem(where, f"is {spelled[tenant]!r} again (tenants match case-insensitively)")
        elif tenant is not None:
            spelled[tenant] = str(name)
            listed = isinstance(raw[name], list)
            if verifier := _verifier(r, where, checked, secrets, listed=listed):
                verifiers[tenant] = verifier
    return signatures.TenantSignatures.of(verifiers) if verifiers else None


def _verifier(
    r: reader.Reader,
    path: str,
    checked: signatures.Settings | None,
    secrets: list[str] | None,
    *,
    listed: bool,
) -> signatures.Verifier | None:
    """The verifier of ``secrets``; a bad one reported at the key it was written under (``secret``,
    ``secrets[1]``; ``path`` itself under tenant_secrets), not as signatures numbers it."""
    if checked is None or secrets is None:
        return None
    try:
        return checked.verifier(secrets)
    except ValueError as exc:
        message = str(exc)
        if match := _NUMBERED.match(message):
            where = f"[{match[1]}]" if listed else ""
            message = message[match.end() :]
            r.problem(path + where, message)
        else:
            r.problem(path, message)
        return None
