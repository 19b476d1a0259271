"""A route's ``reconcile:`` section: recovering the deliveries the provider reports failed.

Opt-in, per route, on the routes whose provider has an API for its own delivery log (GitHub's
hook deliveries today; see docs/providers.md for the others). The section says how often to
look (``every``), how far back (``since``), which hook's log to read (``repository`` or
``organization``, and ``hook_id``), where the API is (``api_url``: GitHub Enterprise, or a
test's stand-in) and the API credential: ``token`` (usually ``${GITHUB_TOKEN}``) or
``token_file`` (a Kubernetes Secret mounted as a file), read as the routes' signing secrets are
and never shown in ``repr``. A reader that leaves secrets unread (the operator commands) leaves
the token empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.config import reader, values

RECONCILE_KEYS = ("every", "since", "token", "token_file", "repository", "organization",
                  "hook_id", "app", "api_url", "max_per_run")  # fmt: skip
DEFAULT_EVERY = 300.0
DEFAULT_SINCE = 6 * 3600.0
DEFAULT_MAX_PER_RUN = 1000
MIN_EVERY = 10.0
# GitHub keeps a hook's deliveries for three days: a longer look-back finds nothing more.
GITHUB_HISTORY = 3 * 86400.0
GITHUB_API_URL = "https://api.github.com"
# The presets whose provider has an API this proxy reconciles against.
PROVIDERS = ("github",)


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
    hook_id: int = 0
    max_per_run: int = DEFAULT_MAX_PER_RUN
    token: str = field(default="", repr=False)

    @property
    def hook(self) -> str:
        """The hook's path under the API (``/repos/o/r/hooks/1``), as the docs name it."""
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
            f"only on a route with preset {' or '.join(PROVIDERS)} (the providers whose API "
            f"this proxy can read the delivery log of; docs/providers.md), got "
            f"{preset or 'no preset'}",
        )
        return None
    if "app" in section:
        r.problem(
            f"{path}.app",
            "a GitHub App's hook (/app/hook/deliveries) needs a JWT signed with the app's "
            "private key: not supported yet; give the repository or organization hook",
        )
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
    if (repository is None) == (organization is None) and "app" not in section:
        r.problem(path, "give either repository (owner/name) or organization, and hook_id")
    hook_id = r.required(section, "hook_id", path, _hook_id) or 0
    return Reconcile(
        provider=str(preset),
        every=every,
        since=since,
        api_url=r.value(section, "api_url", path, values.parse_http_url, GITHUB_API_URL),
        repository=repository,
        organization=organization,
        hook_id=hook_id,
        max_per_run=r.value(
            section, "max_per_run", path, values.parse_positive_int, DEFAULT_MAX_PER_RUN
        ),
        token=_token(r, section, path),
    )


def _token(r: reader.Reader, section: dict[str, Any], path: str) -> str:
    """``token`` or ``token_file``; "" where secrets are left unread."""
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
