"""Routes: each webhook path, where its event ID is, how it is verified, how long it is kept."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from proxy import event_ids, paths, signatures
from proxy.config import order as ordering
from proxy.config import presets, reader, redeliver, values, verify
from proxy.config import reconcile as reconciling

DEFAULT_RETENTION = 30 * 86400.0
# The largest app answer stored for replay: TwiML and chat answers are a few KiB.
DEFAULT_REPLAY_MAX_BODY = 64 * 1024
# Stored through the COMMIT's statement, hex-encoded: a megabyte is already a large statement.
MAX_REPLAY_MAX_BODY = 1024 * 1024
# semantics: idempotency-key — the IETF httpapi draft's header, its methods, a day of keys.
IDEMPOTENCY_KEY = "header:Idempotency-Key"
IDEMPOTENCY_METHODS = ("POST", "PATCH")
IDEMPOTENCY_RETENTION = 86400.0
MAX_HAND_OFF = 3600.0
DEFAULT_RECEIPT_WAIT = 2.0
RECEIPT_KEYS = ("dsn", "wait")
ROUTE_KEYS = ("name", "path", "preset", "scope", "event_id", "event_type", "upstream",
              "max_body", "verify", "retention", "missing_id", "methods", "on_duplicate",
              "replay_max_body", "replay_set_cookie", "claim_wait", "semantics",
              "scope_from", "redeliver", "hand_off", "receipt", "reconcile", "order")  # fmt: skip
_SEMANTICS = values.parse_choice("webhook", "idempotency-key")
_MISSING_ID = values.parse_choice("reject", "forward")
_ON_DUPLICATE = values.parse_choice("ack", "replay")


@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt:
    """``receipt``: the app is sent ``Dedup-Receipt`` and writes it in its own transaction;
    kept in the claim database (``dsn`` None) or the app's own. ``wait``: how long a probe
    waits on an app transaction still open."""

    dsn: str | None = field(default=None, repr=False)
    wait: float = DEFAULT_RECEIPT_WAIT


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteConfig:
    name: str
    path: str
    scope: str
    # Scope each claim by the path's {parameters} too (a templated path without an explicit
    # scope): /hooks/acme and /hooks/globex are separate ID spaces.
    scoped_by_path: bool = False
    methods: tuple[str, ...] = ("POST",)
    event_id: event_ids.Source | tuple[event_ids.Source, ...]  # a tuple: a composite key
    event_type: event_ids.Source | None
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
    scope_from: tuple[event_ids.Source, ...] = ()  # hashed into the scope: one key space per client
    # ``redeliver``: a failed delivery is kept and redelivered (``proxy.redeliverer``).
    redeliver: redeliver.Redeliver | None = None
    # With ``redeliver``: if the app has not answered this long after the request arrived, the
    # delivery is kept (committed) and the provider answered 202 before its deadline, while the
    # proxy goes on waiting for the app. None: never.
    hand_off: float | None = None
    # ``receipt``: the app writes a receipt in its own transaction (``database.receipts``).
    receipt: Receipt | None = None
    # ``reconcile``: the provider's delivery log read for the deliveries it reports failed
    # (``proxy.reconciler``).
    reconcile: reconciling.Reconcile | None = None
    # ``order``: one delivery of an object at the app at a time, in order (``proxy.ordering``).
    order: ordering.Order | None = None

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
    def composite_id(self) -> bool:
        """Whether the event ID is several parts joined (GitHub's ``<hook ID>:<GUID>``): an
        operator may give its last part alone, as the provider shows it."""
        return isinstance(self.event_id, tuple) and len(self.event_id) > 1

    @property
    def binds_claims(self) -> bool:
        """Whether a claim's ID is the event ID bound to what is signed (``webhooks.bound``):
        a webhook route whose ``verify`` does not cover the ID (GitHub, Shopify, Twilio)."""
        return not self.idempotency and self.verify is not None and not self.id_signed

    @property
    def pattern(self) -> paths.Pattern:
        return paths.Pattern.parse(self.path)

    def scope_for(self, values: tuple[str, ...]) -> str:
        """The claim's scope for a request whose path parameters are ``values``; parameter
        values are scoped case-insensitively, as the path's literals."""
        if not self.scoped_by_path:
            return self.scope
        return f"{self.scope}/{verify.tenant_of(values)}"

    def cap_scope(self, scope: str) -> str:
        """The scope whose kept deliveries (``redeliver``) count against the cap of a claim in
        ``scope``: on a route with ``tenant_secrets`` the tenant's own (each tenant signs for its
        own path only, and the tenants are the configured few), else the route's, every path
        of it together (a path value anyone can choose, or sign for, gets no cap of its own)."""
        if isinstance(self.verify, signatures.TenantSignatures):
            return scope
        return self.scope

    def verifier_for(self, values: tuple[str, ...]) -> signatures.Verifier | None:
        """The verifier of a request whose path parameters are ``values`` (None: unverified): on
        a route with ``tenant_secrets``, that tenant's, found as the scope is (case-folded), or
        one that refuses every request for a tenant without secrets."""
        if isinstance(self.verify, signatures.TenantSignatures):
            return self.verify.for_tenant(verify.tenant_of(values))
        return self.verify


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
    inherited = _Inherited(
        upstream=default_upstream, max_body=default_max_body, claim_wait=claim_wait
    )
    taken = _Taken()
    parsed: list[RouteConfig] = []
    for index, item in enumerate(raw):
        path = f"routes[{index}]"
        route = r.mapping(item, path, ROUTE_KEYS)
        if not route:
            r.problem(path, "must be a mapping with name, path and event_id (or preset)")
        elif (route_config := _parse_route(r, route, path, inherited, taken)) is not None:
            parsed.append(route_config)
    return tuple(parsed)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Inherited:
    """The global settings a route inherits unless it sets its own."""

    upstream: str
    max_body: int
    claim_wait: float  # also the longest a route's may be


@dataclass(frozen=True, slots=True, kw_only=True)
class _Defaults:
    """What a route's absent keys fall back to: its preset's facts first, then its semantics'
    (an idempotency-key route is keyed by the header, replays, keeps a key a day), then the
    global settings it inherits."""

    event_id: event_ids.Source | tuple[event_ids.Source, ...] | None  # None: event_id is required
    event_type: event_ids.Source | None
    upstream: str
    max_body: int
    retention: float
    missing_id: str
    on_duplicate: str
    claim_wait: float | None  # None: the global claim_wait
    max_claim_wait: float  # the global claim_wait, which a route's may only shorten
    hand_off: float | None = None  # with redeliver: the preset's deadline's share


def _defaults(
    preset: presets.Preset | None, *, idempotency: bool, inherited: _Inherited
) -> _Defaults:
    """Resolved before any other key is read: which preset and semantics a route has is all
    they depend on."""
    on_duplicate = "replay" if idempotency else "ack"
    if preset is None:
        return _Defaults(
            event_id=values.parse_sources(IDEMPOTENCY_KEY) if idempotency else None,
            event_type=None,
            upstream=inherited.upstream,
            max_body=inherited.max_body,
            retention=IDEMPOTENCY_RETENTION if idempotency else DEFAULT_RETENTION,
            missing_id="reject",
            on_duplicate=on_duplicate,
            claim_wait=None,
            max_claim_wait=inherited.claim_wait,
        )
    ids = preset.event_id
    return _Defaults(
        # A preset without one (Meta's: no delivery ID): the route's event_id is required.
        event_id=values.parse_sources(ids if len(ids) > 1 else ids[0]) if ids else None,
        event_type=values.parse_source(preset.event_type) if preset.event_type else None,
        upstream=inherited.upstream,
        max_body=preset.max_body or inherited.max_body,
        retention=preset.retention,
        missing_id="forward" if preset.forward_missing_id else "reject",
        on_duplicate=preset.on_duplicate or on_duplicate,
        claim_wait=min(preset.claim_wait, inherited.claim_wait) if preset.claim_wait else None,
        max_claim_wait=inherited.claim_wait,
        hand_off=round(preset.deadline * presets.HAND_OFF_SHARE, 3) if preset.deadline else None,
    )


class _Taken:
    """The names and paths of the routes read so far: no later route may reuse either."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}
        self.paths: dict[tuple[str, ...], str] = {}

    def check(
        self, r: reader.Reader, path: str, name: str | None, pattern: paths.Pattern | None
    ) -> None:
        if name is not None and name in self.names:
            r.problem(f"{path}.name", f"{name!r} is already used by {self.names[name]}")
        elif name is not None:
            self.names[name] = path
        if pattern is not None and pattern.key in self.paths:
            r.problem(
                f"{path}.path",
                f"{pattern.path!r} matches the same requests as {self.paths[pattern.key]} "
                "(paths match case-insensitively, ignoring a trailing slash)",
            )
        elif pattern is not None:
            self.paths[pattern.key] = path


def _parse_route(
    r: reader.Reader, route: dict[str, Any], path: str, inherited: _Inherited, taken: _Taken
) -> RouteConfig | None:
    """One route, each absent key its default; None if it has no name, path or event ID (each
    reported). The keys are read in a fixed order, which is the order of the problems."""
    preset_name = r.value(route, "preset", path, presets.parse_name, None)
    preset = presets.PRESETS.get(preset_name or "")
    bad_preset = preset is None and route.get("preset") is not None
    name = r.required(route, "name", path, values.parse_name)
    pattern = r.required(route, "path", path, paths.Pattern.parse)
    semantics = r.value(route, "semantics", path, _SEMANTICS, "webhook")
    idempotency = semantics == "idempotency-key"
    defaults = _defaults(preset, idempotency=idempotency, inherited=inherited)
    event_id = _event_id(r, route, path, defaults.event_id, bad_preset=bad_preset)
    taken.check(r, path, name, pattern)
    retention = r.value(route, "retention", path, values.parse_duration, defaults.retention)
    route_config = RouteConfig(
        name=name or "",
        path=pattern.path if pattern else "",
        scope=r.value(route, "scope", path, values.parse_name, name or ""),
        scoped_by_path="scope" not in route and bool(pattern and pattern.params),
        methods=r.value(route, "methods", path, values.parse_methods, ("POST",)),
        idempotency=idempotency,
        scope_from=r.value(route, "scope_from", path, _parse_scope_from, ()),
        event_id=event_id or (),
        event_type=r.value(route, "event_type", path, values.parse_source, defaults.event_type),
        upstream=r.value(route, "upstream", path, values.parse_http_url, defaults.upstream),
        max_body=r.value(route, "max_body", path, values.parse_size, defaults.max_body),
        preset=preset_name,
        verify=verify.parse(
            r,
            route.get("verify"),
            f"{path}.verify",
            preset_name,
            preset,
            pattern=pattern,
            explicit_scope="scope" in route,
            bad_preset=bad_preset,
        ),
        retention=retention,
        forward_missing_id=r.value(route, "missing_id", path, _MISSING_ID, defaults.missing_id)
        == "forward",
        replay=r.value(route, "on_duplicate", path, _ON_DUPLICATE, defaults.on_duplicate)
        == "replay",
        claim_wait=r.value(
            route,
            "claim_wait",
            path,
            values.parse_duration_upto(defaults.max_claim_wait),
            defaults.claim_wait,
        ),
        replay_max_body=r.value(
            route, "replay_max_body", path, values.parse_size, DEFAULT_REPLAY_MAX_BODY
        ),
        replay_set_cookie=r.value(route, "replay_set_cookie", path, values.parse_bool, False),
    )
    route_config = _with_delivery(r, route, path, route_config, hand_off=defaults.hand_off)
    _check_options(r, route, path, route_config)
    if name is None or pattern is None or event_id is None:
        return None
    return route_config


def _with_delivery(
    r: reader.Reader, route: dict[str, Any], path: str, read: RouteConfig, *, hand_off: float | None
) -> RouteConfig:
    """``read`` with how its deliveries are followed up, read after the rest: ``redeliver``,
    ``hand_off`` (by default ``hand_off``, the preset's share), ``receipt``, ``reconcile`` and
    ``order``."""
    route_config = dataclasses.replace(
        read,
        # A claim redelivered late must outlive the provider's copies: never past retention.
        redeliver=redeliver.parse_redeliver(
            r,
            r.interpolate(route.get("redeliver"), f"{path}.redeliver"),
            f"{path}.redeliver",
            default_for=min(redeliver.DEFAULT_FOR, read.retention),
        ),
        hand_off=r.value(route, "hand_off", path, _hand_off, hand_off),
        receipt=_receipt(r, r.interpolate(route.get("receipt"), f"{path}.receipt"), path),
        reconcile=reconciling.parse_reconcile(
            r, route.get("reconcile"), f"{path}.reconcile", preset=read.preset
        ),
        order=ordering.parse_order(
            r,
            r.interpolate(route.get("order"), f"{path}.order"),
            f"{path}.order",
            preset=read.preset,
        ),
    )
    if route_config.redeliver is None and route_config.hand_off is not None:
        if "hand_off" in route:
            r.problem(
                f"{path}.hand_off",
                "only with redeliver: handing off keeps the delivery for the redeliverer",
            )
        route_config = dataclasses.replace(route_config, hand_off=None)
    return route_config


def _event_id(
    r: reader.Reader,
    route: dict[str, Any],
    path: str,
    default: event_ids.Source | tuple[event_ids.Source, ...] | None,
    *,
    bad_preset: bool,
) -> event_ids.Source | tuple[event_ids.Source, ...] | None:
    """The route's event_id, or its default; None, reported, if neither."""
    # A misspelt preset is reported once, not again as the event_id it would have set.
    if default is None and not bad_preset:
        return r.required(route, "event_id", path, values.parse_sources)
    return r.value(route, "event_id", path, values.parse_sources, default)


def _check_options(
    r: reader.Reader, route: dict[str, Any], path: str, route_config: RouteConfig
) -> None:
    """The keys that only some routes may set, and the replay_max_body cap."""
    if route_config.idempotency:
        _check_idempotency(r, path, route_config)
    elif "scope_from" in route:
        r.problem(f"{path}.scope_from", "only for semantics: idempotency-key")
    for option in ("replay_max_body", "replay_set_cookie"):
        if option in route and not route_config.replay:
            r.problem(f"{path}.{option}", "only with on_duplicate: replay")
    if route_config.replay_max_body > MAX_REPLAY_MAX_BODY:
        r.problem(f"{path}.replay_max_body", f"must be at most {MAX_REPLAY_MAX_BODY} (1MiB)")
    _check_redeliver(r, path, route_config, written="on_duplicate" in route)
    if route_config.order is not None and route_config.idempotency:
        r.problem(f"{path}.order", "only on webhook routes, not semantics: idempotency-key")
    if route_config.reconcile is not None and route_config.scoped_by_path:
        r.problem(
            f"{path}.reconcile",
            "not on a path with {parameters} without an explicit scope: the provider's log "
            "does not say which path a delivery went to, so its claim's scope is unknown",
        )
    _check_reconcile(r, path, route_config)


def _check_reconcile(r: reader.Reader, path: str, route_config: RouteConfig) -> None:
    """A ``reconcile`` against the rest of the route: its claims and its webhook."""
    settings = route_config.reconcile
    if settings is None:
        return
    # These logs keep listing an event after it is recovered (Stripe never saw the proxy's own
    # delivery; Paddle's original notification stays failed; PayPal's list says nothing of
    # deliveries): only its claim keeps it from being sent again, so the claim must outlive
    # the look-back.
    if settings.provider in ("stripe", "paddle", "paypal") and (
        settings.since > route_config.retention
    ):
        r.problem(
            f"{path}.reconcile.since",
            f"must be at most the route's retention ({route_config.retention:g}s): an event "
            "recovered before is sent again once its claim is gone",
        )
    if (
        settings.provider == "paypal"
        and isinstance(route_config.verify, signatures.PayPalSignature)
        and settings.webhook_id.encode() not in route_config.verify.secrets
    ):
        r.problem(
            f"{path}.reconcile.webhook_id",
            "must be one of the route's verify secrets (its webhook IDs): PayPal signs a "
            "resent event for that webhook, and the route checks it as any delivery",
        )


def _receipt(r: reader.Reader, raw: object, path: str) -> Receipt | None:
    """``receipt: true`` (in the claim database), ``false``/absent, or ``{dsn, wait}``."""
    if raw is None:
        return None
    if isinstance(raw, str | bool):
        try:
            return Receipt() if values.parse_bool(raw) else None
        except ValueError:
            r.problem(f"{path}.receipt", "must be true, false or a mapping of dsn, wait")
            return None
    section: dict[str, Any] = r.mapping(raw, f"{path}.receipt", RECEIPT_KEYS)
    written = section.get("dsn")
    # A command that touches no receipt runs where the app database's variable is not set.
    unread = not r.receipts and isinstance(written, str) and "$" in written
    return Receipt(
        dsn=written if unread else r.value(section, "dsn", f"{path}.receipt", _receipt_dsn, None),
        wait=r.value(
            section, "wait", f"{path}.receipt", values.parse_duration_upto(60.0),
            DEFAULT_RECEIPT_WAIT,
        ),
    )  # fmt: skip


def _receipt_dsn(value: object) -> str:
    dsn = values.parse_dsn(value)
    if dsn is None:
        raise ValueError("must be a postgresql:// URL (the app's database), not embedded")
    return dsn


def _hand_off(value: object) -> float | None:
    """A duration, or ``off``/``false`` (never)."""
    if value is False or (isinstance(value, str) and value.lower() in ("off", "false")):
        return None
    return values.parse_duration_upto(MAX_HAND_OFF)(value)


def _check_redeliver(
    r: reader.Reader, path: str, route: RouteConfig, *, written: bool = True
) -> None:
    """Only where the sender acts on no answer but the 2xx, and kept as long as it retries.
    ``written``: whether the route says ``on_duplicate`` itself (else its preset does)."""
    if route.receipt is not None and route.idempotency:
        r.problem(f"{path}.receipt", "only on webhook routes, not semantics: idempotency-key")
    if route.redeliver is None:
        return
    if route.idempotency or route.replay:
        why = "semantics: idempotency-key" if route.idempotency else "on_duplicate: replay"
        if not route.idempotency and not written:
            why = (
                f"preset {route.preset}, which answers a duplicate with the app's first answer "
                "(on_duplicate: replay, its default)"
            )
        r.problem(
            f"{path}.redeliver",
            f"not with {why}: the sender needs the app's answer, and a kept delivery is "
            "answered 202 before the app has given one",
        )
    if route.redeliver.for_ > route.retention:
        r.problem(
            f"{path}.redeliver.for",
            f"must be at most the route's retention ({route.retention:g}s): a claim redelivered "
            "late must still be kept long enough to make the provider's copies duplicates",
        )


def _parse_scope_from(value: object) -> tuple[event_ids.Source, ...]:
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
