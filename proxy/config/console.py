"""``admin.console``: the operator console on the admin listener (``proxy.console``).

The console shows without any setting on a loopback ``admin.listen``. Beyond loopback it would
show customers' deliveries to whoever reaches that address, so it then needs a credential (or
``enabled: false``, or ``unauthenticated: true``: said, and warned about at start-up). Its
actions (redeliver, discard) need ``actions: true`` and a credential, which every page then asks
for: ``credentials`` (``name:password``, one or a list, each usually ``${VAR}``) or
``credentials_file`` (a Kubernetes Secret mounted as a file, one ``name:password`` a line). The
name is who the action log names. The passwords are read as the routes' secrets are, and never
shown in ``repr``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from proxy.config import reader, values

CONSOLE_KEYS = ("enabled", "actions", "credentials", "credentials_file", "unauthenticated")
# Long enough that guessing one over the admin listener is out of reach.
MIN_PASSWORD = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Credential:
    """An operator's name and password (never in ``repr``)."""

    name: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsoleConfig:
    enabled: bool = True
    actions: bool = False
    credentials: tuple[Credential, ...] = field(default=(), repr=False)
    # Served without credentials on an admin.listen beyond loopback, as the operator said.
    unauthenticated: bool = False


def _credential(text: str) -> Credential:
    name, colon, password = text.partition(":")
    if not colon or not name or not password:
        raise ValueError("must be name:password")
    values.parse_name(name)
    if len(password) < MIN_PASSWORD:
        raise ValueError(f"{name}'s password must be at least {MIN_PASSWORD} characters")
    return Credential(name=name, password=password)


def _read_file(value: object) -> list[str]:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a file path, got {value!r}")
    try:
        text = reader.read_bounded(value, reader.MAX_SECRET_FILE).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{value}: must be UTF-8 text") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read: {exc}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{value} is empty")
    return lines


def _parse(r: reader.Reader, texts: list[str], where: str) -> list[Credential]:
    found = []
    for n, text in enumerate(texts):
        try:
            found.append(_credential(text))
        except ValueError as exc:
            # The line itself is never echoed: it holds a password.
            r.problem(f"{where}[{n}]" if len(texts) > 1 else where, str(exc))
    return found


def parse_console(r: reader.Reader, raw: object, *, listen: str, loopback: bool) -> ConsoleConfig:
    """``admin.console``, on an admin listener at ``listen`` (``loopback``: reachable from this
    machine only)."""
    path = "admin.console"
    section: dict[str, Any] = r.mapping(raw, path, CONSOLE_KEYS)
    credentials: list[Credential] = []
    if section.get("credentials") is not None:
        texts = r.strings(section, "credentials", path, secret=True)
        if texts is not None and r.secrets:
            credentials += _parse(r, texts, f"{path}.credentials")
    if section.get("credentials_file") is not None and r.secrets:
        lines: list[str] = r.value(section, "credentials_file", path, _read_file, [])
        credentials += _parse(r, lines, f"{path}.credentials_file")
    names = [c.name for c in credentials]
    for name in sorted({n for n in names if names.count(n) > 1}):
        r.problem(path, f"operator {name!r} has more than one credential")
    console = ConsoleConfig(
        enabled=r.value(section, "enabled", path, values.parse_bool, True),
        actions=r.value(section, "actions", path, values.parse_bool, False),
        credentials=tuple(credentials),
        unauthenticated=r.value(section, "unauthenticated", path, values.parse_bool, False),
    )
    given = "credentials" in section or "credentials_file" in section
    if console.unauthenticated and given:
        r.problem(f"{path}.unauthenticated", "not with credentials: say one or the other")
    elif console.enabled and not given and not loopback and not console.unauthenticated:
        r.problem(
            path,
            f"the console shows customers' kept deliveries to whoever reaches admin.listen "
            f"{listen}, which is not loopback: set credentials or credentials_file, or "
            "enabled: false (or unauthenticated: true where only trusted clients reach it)",
        )
    if console.actions and not given:
        r.problem(
            f"{path}.actions",
            "needs credentials or credentials_file: the console's actions are never open",
        )
    return console
