"""A route's ``verify:`` mapping: the signature scheme and its options (the preset's where the
section sets none), and the ``secret``, ``secrets`` or ``tenant_secrets`` each verifier is built
from. Apart from routes because it is the one part of a route that handles secrets, with rules of
its own (on a templated path a secret is per tenant unless ``shared_secret`` says otherwise) and
its own problem paths; routes hands it the few route facts it needs (the preset, the path's
pattern, whether the scope is explicit) and gets back a ``signatures.Verifier``. It imports
nothing from routes, which imports it. A reader that leaves secrets unread (the commands that
verify nothing) gets verifiers that describe the scheme and refuse every request.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

from proxy import paths, signatures
from proxy.config import presets, reader, values

VERIFY_KEYS = ("scheme", "secret", "secrets", "tolerance", "header", "algorithm", "encoding",
               "prefix", "public_url", "cert_hosts", "ca_file", "verify_token", "tenant_secrets",
               "shared_secret", "confirm_subscription")  # fmt: skip
# How signatures names a bad secret ("secrets[1] has leading or trailing whitespace").
_NUMBERED = re.compile(r"secrets\[(\d+)\] ")
SHARED_SECRET = (
    "on a path with {parameters} this would verify every tenant's path, so one tenant could sign "
    "another's events: give each tenant its own under tenant_secrets, or set shared_secret: true "
    "if one sender signs for every tenant"
)


def tenant_of(values: tuple[str, ...]) -> str:
    """The tenant a path names: its parameter values, case-folded, joined by "/"."""
    return "/".join(value.lower() for value in values)


def parse(
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
    """The verifier of the ``verify`` mapping ``raw`` at ``path``; None if there is none or it
    does not build (each problem reported)."""
    section = r.mapping(raw, path, VERIFY_KEYS)
    if raw is None:
        return None
    checked = _settings(r, section, path, preset_name, preset, bad_preset=bad_preset)
    if "tenant_secrets" in section:
        return _parse_tenant_secrets(
            r, section, path, checked, pattern, explicit_scope=explicit_scope
        )
    return _parse_secrets(r, section, path, checked, pattern)


def _settings(
    r: reader.Reader,
    section: dict[str, Any],
    path: str,
    preset_name: str | None,
    preset: presets.Preset | None,
    *,
    bad_preset: bool,
) -> signatures.Settings | None:
    """The scheme and its options, the preset's where the section sets none; None, reported,
    if there is no scheme or the options do not fit it."""
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
    options: dict[str, Any] = {
        key: r.value(section, key, path, str, None)
        for key in ("header", "algorithm", "encoding", "prefix", "public_url")
    }
    if "cert_hosts" in section:
        options["cert_hosts"] = r.strings(section, "cert_hosts", path)
    options["ca_file"] = r.value(section, "ca_file", path, _absolute, None)
    if "verify_token" in section:
        # Meta's subscription check; a secret: whoever knows it can subscribe the route.
        options["verify_tokens"] = r.strings(section, "verify_token", path, secret=True)
    options["confirm_subscription"] = r.value(
        section, "confirm_subscription", path, values.parse_bool, None
    )
    default_tolerance = (preset and preset.tolerance) or signatures.DEFAULT_TOLERANCE
    tolerance = r.value(section, "tolerance", path, values.parse_duration, default_tolerance)
    if scheme is None or any(
        key in section and options[option] is None
        for key, option in (("cert_hosts", "cert_hosts"), ("verify_token", "verify_tokens"))
    ):
        return None
    try:
        return signatures.settings(scheme, tolerance=tolerance, **options)
    except ValueError as exc:
        r.problem(path, str(exc))
        return None


def _absolute(raw: object) -> str:
    """A file's absolute path (``ca_file``): read at start, wherever the proxy was started."""
    if not isinstance(raw, str) or not raw.startswith("/"):
        raise ValueError(f"must be an absolute path, got {raw!r}")
    return raw


def _parse_tenant_secrets(
    r: reader.Reader,
    section: dict[str, Any],
    path: str,
    checked: signatures.Settings | None,
    pattern: paths.Pattern | None,
    *,
    explicit_scope: bool,
) -> signatures.Verifier | None:
    """``tenant_secrets``, on a templated path only, and instead of every other secret key."""
    for key in ("secret", "secrets", "shared_secret"):
        if key in section:
            r.problem(path, f"give either tenant_secrets or {key}, not both")
    where = f"{path}.tenant_secrets"
    templated = pattern is not None and bool(pattern.params)
    if pattern is not None and not templated:
        r.problem(where, "only on a path with {parameters}")
    if explicit_scope:
        r.problem(where, "not with an explicit scope (shared by every tenant, one tenant "
                  "could claim another's event IDs first)")  # fmt: skip
    tenants = pattern if templated else None
    return _parse_tenants(r, section["tenant_secrets"], where, checked, tenants)


def _parse_secrets(
    r: reader.Reader,
    section: dict[str, Any],
    path: str,
    checked: signatures.Settings | None,
    pattern: paths.Pattern | None,
) -> signatures.Verifier | None:
    """``secret`` or ``secrets``: on a templated path, shared by every tenant only if it says so."""
    if "secret" in section and "secrets" in section:
        r.problem(path, "give either secret or secrets, not both")
    key = "secrets" if "secrets" in section else "secret"
    if key not in section:
        # A misspelt secret (secert) is reported as an unknown key already, with its did-you-mean.
        secret_keys = ("secret", "secrets", "tenant_secrets")
        if not any(difflib.get_close_matches(str(name), secret_keys, n=1) for name in section):
            r.problem(f"{path}.secret", "is required (or secrets: a list, or tenant_secrets)")
        return None
    secrets = r.strings(section, key, path, secret=True)
    shared = r.value(section, "shared_secret", path, values.parse_bool, False)
    templated = pattern is not None and bool(pattern.params)
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
        secrets = r.strings(raw, name, path, secret=True)
        try:
            tenant = tenant_of(pattern.parse_values(name)) if pattern else None
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
    if not r.secrets:
        return checked.unread()
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
