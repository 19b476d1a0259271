"""A route's ``reconcile:`` section: recovering the deliveries the provider reports failed.

Opt-in, per route, on the routes whose provider has an API for its own delivery log (GitHub's
hook deliveries, Stripe's events; docs/providers.md for the others). The section says how often to
look (``every``), how far back (``since``), which hook's log to read (``repository``,
``organization`` or a GitHub App's, ``app_id``/``client_id``; and ``hook_id``), where the API is
(``api_url``: GitHub Enterprise, or a test's stand-in) and the API credential: ``token``
(usually ``${GITHUB_TOKEN}``) or ``token_file`` (a Kubernetes Secret mounted as a file); for an
App's hook, the App's ``private_key`` or ``private_key_file`` (PEM), which signs a short-lived
JWT (``proxy.providers_api.github_app``, the ``github-app`` extra). Secrets are read as the
routes' signing secrets are and never shown in ``repr``. A reader that leaves secrets unread
(the operator commands) leaves them empty.

A Stripe route (``_parse_stripe``) names no hook: Stripe's log is the account's events, and a gap
is delivered by the proxy itself, signed with the route's endpoint secret (``signing_secret``,
filled in from the route's ``verify``) and POSTed to ``deliver_to`` (by default the proxy's own
listener on the route's path, filled in by ``config.parse``); ``types`` narrows the events read.

A Paddle route (``_parse_paddle``) names its notification destination
(``notification_setting_id``) and reads it with an API key (``token``); a PayPal route
(``_parse_paypal``) names its webhook (``webhook_id``) and reads the REST app's events with the
app's OAuth client credentials (``client_id``, and ``client_secret`` or ``client_secret_file``),
``types`` narrowing them as Stripe's. Both recover a gap by asking the provider to send it again.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from proxy.config import reader, values

RECONCILE_KEYS = ("every", "since", "token", "token_file", "repository", "organization",
                  "hook_id", "app_id", "client_id", "private_key", "private_key_file",
                  "api_url", "max_per_run", "deliver_to", "types", "notification_setting_id",
                  "webhook_id", "client_secret", "client_secret_file")  # fmt: skip
DEFAULT_EVERY = 300.0
DEFAULT_SINCE = 6 * 3600.0
DEFAULT_MAX_PER_RUN = 1000
MIN_EVERY = 10.0
# GitHub keeps a hook's deliveries for three days: a longer look-back finds nothing more.
GITHUB_HISTORY = 3 * 86400.0
GITHUB_API_URL = "https://api.github.com"
# Stripe lists an account's events for 30 days.
STRIPE_HISTORY = 30 * 86400.0
STRIPE_API_URL = "https://api.stripe.com"
# Stripe's List Events takes at most 20 ``types``.
STRIPE_MAX_TYPES = 20
# Paddle keeps notifications 90 days (its API description, List notifications).
PADDLE_HISTORY = 90 * 86400.0
PADDLE_API_URL = "https://api.paddle.com"
# A notification destination's ID as Paddle's API description gives its pattern.
PADDLE_SETTING_ID = re.compile(r"ntfset_[a-z0-9]{26}")
PAYPAL_API_URL = "https://api-m.paypal.com"
# PayPal's webhook IDs (1JE4291016473214C), and its REST apps' client IDs (letters, digits, - _).
PAYPAL_WEBHOOK_ID = re.compile(r"[A-Za-z0-9]{1,50}")
PAYPAL_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")
# The presets whose provider has an API this proxy reconciles against.
PROVIDERS = ("github", "stripe", "paddle", "paypal")
# The keys of the section that apply to one provider only (a GitHub App's key is refused by
# ``_token`` on any route read with a token).
GITHUB_ONLY = ("repository", "organization", "hook_id", "app_id")
STRIPE_ONLY = ("deliver_to",)
PADDLE_ONLY = ("notification_setting_id",)
PAYPAL_ONLY = ("webhook_id", "client_secret", "client_secret_file")
# The extra that signs a GitHub App's JWT (PyJWT with cryptography), and the module it brings.
GITHUB_APP_EXTRA = "github-app"
GITHUB_APP_MODULES = ("jwt", "cryptography")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reconcile:
    """Where a route's provider keeps its delivery log, how to read it, and how often."""

    provider: str
    every: float = DEFAULT_EVERY
    since: float = DEFAULT_SINCE
    api_url: str = GITHUB_API_URL
    # GitHub: "owner/name" for a repository hook, or an organization for an organization hook.
    repository: str | None = None
    organization: str | None = None
    # A GitHub App's hook: the App's client ID (or app ID), the JWT's issuer.
    app: str | None = None
    hook_id: int = 0
    max_per_run: int = DEFAULT_MAX_PER_RUN
    token: str = field(default="", repr=False)
    # A GitHub App's private key (PEM), which signs its JWT.
    private_key: str = field(default="", repr=False)
    # Stripe: where a gap is POSTed ("": not yet filled in), the event types read (none: all),
    # and the route's endpoint secret that signs it (from ``verify``; never shown).
    deliver_to: str = ""
    types: tuple[str, ...] = ()
    signing_secret: bytes = field(default=b"", repr=False)
    # Paddle: the notification destination whose failed notifications are read.
    notification_setting_id: str = ""
    # PayPal: the webhook a gap is resent to, and the REST app's OAuth client credentials.
    webhook_id: str = ""
    client_id: str = ""
    client_secret: str = field(default="", repr=False)

    @property
    def hook(self) -> str:
        """The hook's path under the API (``/repos/o/r/hooks/1``), as the docs name it; an
        App's hook is the App's own (``/app/hook``: the App is the JWT's issuer)."""
        if self.app is not None:
            return "/app/hook"
        if self.repository is not None:
            return f"/repos/{self.repository}/hooks/{self.hook_id}"
        return f"/orgs/{self.organization}/hooks/{self.hook_id}"


def _repository(value: object) -> str:
    owner, slash, name = value.partition("/") if isinstance(value, str) else ("", "", "")
    if not slash or not owner or not name or "/" in name or not value_safe(str(value)):
        raise ValueError(f"must be owner/name, got {value!r}")
    return str(value)


def _organization(value: object) -> str:
    if not isinstance(value, str) or not value or "/" in value or not value_safe(value):
        raise ValueError(f"must be an organization's login, got {value!r}")
    return value


def value_safe(text: str) -> bool:
    """Letters, digits, '-', '_' and '.' (and the one '/' of owner/name): a path segment as is."""
    return all(ch.isalnum() or ch in "-_./" for ch in text) and ".." not in text


def _hook_id(value: object) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return values.parse_positive_int(value)


def _token_file(value: object) -> str:
    try:
        return values.read_password_file(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("password", "token")) from None


def parse_reconcile(
    r: reader.Reader, raw: object, path: str, *, preset: str | None
) -> Reconcile | None:
    """The route's ``reconcile`` mapping (None: absent); every problem reported at ``path``."""
    if raw is None:
        return None
    section: dict[str, Any] = r.mapping(raw, path, RECONCILE_KEYS)
    if not isinstance(raw, dict):
        return None
    if preset not in PROVIDERS:
        r.problem(
            path,
            f"only on a route with preset {', '.join(PROVIDERS[:-1])} or {PROVIDERS[-1]} "
            "(the providers whose API "
            f"this proxy can read the delivery log of; docs/providers.md), got "
            f"{preset or 'no preset'}",
        )
        return None
    if preset in _PARSERS:
        return _PARSERS[preset](r, section, path)
    _refuse(r, section, path, STRIPE_ONLY, "only on a route with preset stripe")
    _refuse(r, section, path, ("types",), "only on a route with preset stripe or paypal")
    _refuse(r, section, path, PADDLE_ONLY, "only on a route with preset paddle")
    _refuse(r, section, path, PAYPAL_ONLY, "only on a route with preset paypal")
    every = r.value(section, "every", path, values.parse_duration, DEFAULT_EVERY)
    if every < MIN_EVERY:
        r.problem(f"{path}.every", f"must be at least {MIN_EVERY:g}s, got {every:g}s")
    since = r.value(section, "since", path, values.parse_duration, DEFAULT_SINCE)
    if since > GITHUB_HISTORY:
        r.problem(f"{path}.since", "must be at most 3d: GitHub keeps a hook's deliveries 3 days")
    if since < every:
        r.problem(
            f"{path}.since",
            f"must be at least 'every' ({every:g}s): a run must look back over the time since "
            "the last one",
        )
    repository = r.value(section, "repository", path, _repository, None)
    organization = r.value(section, "organization", path, _organization, None)
    app = _app(r, section, path)
    given = {"repository": ("repository",), "organization": ("organization",),
             "app_id/client_id": ("app_id", "client_id")}  # fmt: skip
    kinds = [kind for kind, keys in given.items() if any(key in section for key in keys)]
    if len(kinds) != 1:
        r.problem(
            path,
            "give exactly one hook: repository (owner/name), organization, or a GitHub App's "
            f"app_id or client_id; and hook_id{', got ' + ' and '.join(kinds) if kinds else ''}",
        )
    hook_id = r.required(section, "hook_id", path, _hook_id) or 0
    return Reconcile(
        provider=str(preset),
        every=every,
        since=since,
        **_api(r, section, path, GITHUB_API_URL),
        repository=repository,
        organization=organization,
        app=app,
        hook_id=hook_id,
        token="" if app is not None else _token(r, section, path),
        private_key=_private_key(r, section, path) if app is not None else "",
    )


def _token(r: reader.Reader, section: dict[str, Any], path: str) -> str:
    """``token`` or ``token_file``; "" where secrets are left unread."""
    for key in ("private_key", "private_key_file"):
        if key in section:
            r.problem(f"{path}.{key}", "only for a GitHub App's hook (app_id or client_id)")
    if ("token" in section) == ("token_file" in section):
        r.problem(path, "give either token (e.g. ${GITHUB_TOKEN}) or token_file")
        return ""
    if "token" in section:
        tokens = r.strings(section, "token", path, secret=True)
        if tokens is not None and len(tokens) != 1:
            r.problem(f"{path}.token", "must be one string")
        return tokens[0] if tokens and r.secrets else ""
    if not r.secrets:
        return ""
    return r.value(section, "token_file", path, _token_file, "")


def _app(r: reader.Reader, section: dict[str, Any], path: str) -> str | None:
    """The App's ``client_id`` or ``app_id`` (the JWT's issuer); None: not an App's hook."""
    if "app_id" in section and "client_id" in section:
        r.problem(path, "give either app_id or client_id (GitHub recommends the client ID)")
    app = r.value(section, "app_id", path, _app_id, None)
    app = r.value(section, "client_id", path, _client_id, app)
    if "app_id" not in section and "client_id" not in section:
        return None
    if (missing := github_app_missing()) is not None:
        r.problem(f"{path}.{'client_id' if 'client_id' in section else 'app_id'}", missing)
    return app or ""


def github_app_missing() -> str | None:
    """Why a GitHub App's JWT cannot be signed here (the extra not installed), or None."""
    absent = [name for name in GITHUB_APP_MODULES if importlib.util.find_spec(name) is None]
    if not absent:
        return None
    return (
        f"a GitHub App's hook needs {' and '.join(absent)} to sign the App's JWT: install the "
        f"{GITHUB_APP_EXTRA} extra (pip install 'webhook-dedup-proxy[{GITHUB_APP_EXTRA}]')"
    )


def _app_id(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return str(value)
    if isinstance(value, str) and value.isdigit() and int(value) > 0:
        return value
    raise ValueError(f"must be the App's numeric ID, got {value!r}")


def _client_id(value: object) -> str:
    if (
        not isinstance(value, str)
        or not value
        or not all(ch.isalnum() or ch in "._-" for ch in value)
    ):
        raise ValueError(f"must be the App's client ID (e.g. Iv23li...), got {value!r}")
    return value


def _private_key(r: reader.Reader, section: dict[str, Any], path: str) -> str:
    """``private_key`` or ``private_key_file`` (PEM); "" where secrets are left unread."""
    for key in ("token", "token_file"):
        if key in section:
            r.problem(f"{path}.{key}", "a GitHub App's hook is read with the App's private_key "
                      "or private_key_file, not a token")  # fmt: skip
    if ("private_key" in section) == ("private_key_file" in section):
        r.problem(path, "give either private_key (e.g. ${GITHUB_APP_PRIVATE_KEY}) or "
                  "private_key_file, the App's PEM key")  # fmt: skip
        return ""
    if "private_key" in section:
        keys = r.strings(section, "private_key", path, secret=True)
        if keys is not None and len(keys) != 1:
            r.problem(f"{path}.private_key", "must be one string")
        if not keys or not r.secrets:
            return ""
        try:
            return _pem(keys[0].replace("\\n", "\n"))
        except ValueError as exc:
            r.problem(f"{path}.private_key", str(exc))
            return ""
    if not r.secrets:
        return ""
    return r.value(section, "private_key_file", path, _private_key_file, "")


def _private_key_file(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a file path, got {value!r}")
    try:
        text = Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{value}: must be a PEM file (UTF-8 text)") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ValueError(f"cannot read: {exc}") from None
    try:
        return _pem(text)
    except ValueError as exc:
        raise ValueError(f"{value}: {exc}") from None


def _pem(text: str) -> str:
    """A PEM private key as GitHub gives it (``-----BEGIN RSA PRIVATE KEY-----``); the key's
    text is never in the message."""
    key = text.strip()
    if not (key.startswith("-----BEGIN ") and "PRIVATE KEY-----" in key.splitlines()[0]):
        raise ValueError("must be the App's private key in PEM (-----BEGIN RSA PRIVATE KEY-----)")
    return key + "\n"


class _API(TypedDict):
    api_url: str
    max_per_run: int


def _api(r: reader.Reader, section: dict[str, Any], path: str, default_url: str) -> _API:
    """``api_url`` (``default_url``, the provider's, unless given) and ``max_per_run``: every
    provider's log is read over an API, a bounded number of events a run."""
    return _API(
        api_url=r.value(section, "api_url", path, values.parse_http_url, default_url),
        max_per_run=r.value(
            section, "max_per_run", path, values.parse_positive_int, DEFAULT_MAX_PER_RUN
        ),
    )


def _period(
    r: reader.Reader, section: dict[str, Any], path: str, history: float | None, why: str
) -> tuple[float, float]:
    """``every`` and ``since``: a run looks back at least a period, and no further than the
    provider keeps its log (``history``; None: it does not say)."""
    every = r.value(section, "every", path, values.parse_duration, DEFAULT_EVERY)
    if every < MIN_EVERY:
        r.problem(f"{path}.every", f"must be at least {MIN_EVERY:g}s, got {every:g}s")
    since = r.value(section, "since", path, values.parse_duration, DEFAULT_SINCE)
    if history is not None and since > history:
        r.problem(f"{path}.since", f"must be at most {values.format_duration(history)}: {why}")
    if since < every:
        r.problem(
            f"{path}.since",
            f"must be at least 'every' ({every:g}s): a run must look back over the time since "
            "the last one",
        )
    return every, since


def _parse_stripe(r: reader.Reader, section: dict[str, Any], path: str) -> Reconcile:
    """A Stripe route's section: the account's events over the API, no hook to name."""
    _refuse(r, section, path, (*GITHUB_ONLY, "client_id"), "not on a Stripe route: Stripe's "
            "log is the account's events, read with the key (types narrows them)")  # fmt: skip
    _refuse(r, section, path, (*PADDLE_ONLY, *PAYPAL_ONLY), "not on a Stripe route")
    every, since = _period(r, section, path, STRIPE_HISTORY, "Stripe lists events for 30 days")
    return Reconcile(
        provider="stripe",
        every=every,
        since=since,
        **_api(r, section, path, STRIPE_API_URL),
        token=_token(r, section, path),
        deliver_to=r.value(section, "deliver_to", path, values.parse_http_url, ""),
        types=r.value(section, "types", path, _types, ()),
    )


def _parse_paddle(r: reader.Reader, section: dict[str, Any], path: str) -> Reconcile:
    """A Paddle route's section: its notification destination's failed notifications, read
    with an API key (``token``), each replayed by Paddle."""
    _refuse(r, section, path, (*GITHUB_ONLY, "client_id", *STRIPE_ONLY, "types", *PAYPAL_ONLY),
            "not on a Paddle route: its log is the notification destination's "
            "(notification_setting_id), read with an API key (token)")  # fmt: skip
    every, since = _period(r, section, path, PADDLE_HISTORY, "Paddle keeps notifications 90 days")
    return Reconcile(
        provider="paddle",
        every=every,
        since=since,
        **_api(r, section, path, PADDLE_API_URL),
        token=_token(r, section, path),
        notification_setting_id=r.required(
            section, "notification_setting_id", path, _setting_id
        ) or "",
    )  # fmt: skip


def _setting_id(value: object) -> str:
    if not isinstance(value, str) or not PADDLE_SETTING_ID.fullmatch(value):
        raise ValueError(f"must be a notification destination's ID (ntfset_...), got {value!r}")
    return value


def _parse_paypal(r: reader.Reader, section: dict[str, Any], path: str) -> Reconcile:
    """A PayPal route's section: the REST app's webhook events, read with its OAuth client
    credentials, each without a claim resent by PayPal to ``webhook_id``."""
    _refuse(r, section, path, (*GITHUB_ONLY, *STRIPE_ONLY, *PADDLE_ONLY, "token", "token_file"),
            "not on a PayPal route: its log is the REST app's events, read with the app's "
            "client_id and client_secret")  # fmt: skip
    for key in ("private_key", "private_key_file"):
        if key in section:
            r.problem(f"{path}.{key}", "only for a GitHub App's hook (app_id or client_id)")
    every, since = _period(r, section, path, None, "")
    if ("client_secret" in section) == ("client_secret_file" in section):
        r.problem(path, "give either client_secret (e.g. ${PAYPAL_CLIENT_SECRET}) or "
                  "client_secret_file, the REST app's secret")  # fmt: skip
        secret = ""
    elif "client_secret" in section:
        secrets = r.strings(section, "client_secret", path, secret=True)
        if secrets is not None and len(secrets) != 1:
            r.problem(f"{path}.client_secret", "must be one string")
        secret = secrets[0] if secrets and r.secrets else ""
    else:
        secret = r.value(section, "client_secret_file", path, _token_file, "") if r.secrets else ""
    return Reconcile(
        provider="paypal",
        every=every,
        since=since,
        **_api(r, section, path, PAYPAL_API_URL),
        types=r.value(section, "types", path, _types, ()),
        webhook_id=r.required(section, "webhook_id", path, _webhook_id) or "",
        client_id=r.required(section, "client_id", path, _paypal_client_id) or "",
        client_secret=secret,
    )


def _webhook_id(value: object) -> str:
    if not isinstance(value, str) or not PAYPAL_WEBHOOK_ID.fullmatch(value):
        raise ValueError(f"must be a PayPal webhook's ID (letters and digits), got {value!r}")
    return value


def _paypal_client_id(value: object) -> str:
    if not isinstance(value, str) or not PAYPAL_CLIENT_ID.fullmatch(value):
        raise ValueError(f"must be the REST app's client ID, got {value!r}")
    return value


_PARSERS = {"stripe": _parse_stripe, "paddle": _parse_paddle, "paypal": _parse_paypal}


def _types(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or not items
        or not all(isinstance(item, str) and item and item.strip() == item for item in items)
    ):
        raise ValueError("must be an event type or a non-empty list of them")
    if len(items) > STRIPE_MAX_TYPES:
        raise ValueError(f"at most {STRIPE_MAX_TYPES} (Stripe's limit), got {len(items)}")
    return tuple(items)


def _refuse(
    r: reader.Reader, section: dict[str, Any], path: str, keys: tuple[str, ...], why: str
) -> None:
    """A problem for each of ``keys`` in the section: keys of another provider's."""
    for key in keys:
        if key in section:
            r.problem(f"{path}.{key}", why)
