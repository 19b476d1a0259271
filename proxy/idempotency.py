"""``semantics: idempotency-key``: an API route keyed by the client's ``Idempotency-Key``.

What differs from a webhook route is how the request maps onto a claim; the claim itself is the
same. The key is an RFC 8941 string or the same characters bare; its scope is the route's plus
a hash of the client's ``scope_from`` headers, so clients have key spaces of their own; and the
claim's digest is the request's fingerprint (method, target and body), so a key sent again with
another request is told apart (422) from a retry (the stored answer).
"""

from __future__ import annotations

import hashlib
import re

from proxy import errors, keys

# RFC 8941 sf-string characters (printable ASCII; '"' and '\' only escaped).
_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
_BARE_KEY = re.compile(r"[\x20\x21\x23-\x5b\x5d-\x7e]+")
_ESCAPE = re.compile(r"\\(.)")


def key(value: str, route: str) -> str:
    """An ``Idempotency-Key`` as the key it names: an RFC 8941 string (``"abc"``) or the same
    characters bare (``abc``), one key either way; KeyInvalid for anything else."""
    quoted = _SF_STRING.fullmatch(value)
    if quoted is not None:
        parsed = _ESCAPE.sub(r"\1", quoted.group(1))
    elif _BARE_KEY.fullmatch(value):
        parsed = value
    else:
        raise errors.KeyInvalid(
            f"route {route!r}: Idempotency-Key must be an RFC 8941 string of printable ASCII"
        )
    if not parsed or len(parsed) > keys.MAX_ID_BYTES:
        raise errors.KeyInvalid(
            f"route {route!r}: Idempotency-Key must be 1 to {keys.MAX_ID_BYTES} characters"
        )
    return parsed


def client_scope(
    scope: str, sources: tuple[keys.Source, ...], headers: keys.MultiMapping, route: str
) -> str:
    """The scope of one client's keys: its ``scope_from`` headers as sent (any length: a JWT
    runs to kilobytes), hashed, so no client can replay or block another's keys. The claim's
    scope holds the hash; logs show the route's scope only. ClientUnidentified if one is
    absent, repeated, or named by Connection (the app would not receive it)."""
    try:
        keys.refuse_connection_naming(headers, (source.name for source in sources), route)
    except errors.EventIdInvalid as exc:
        raise errors.ClientUnidentified(exc.message) from None
    values = []
    for source in sources:
        sent = headers.getall(source.name, [])
        if len(sent) != 1:
            problem = "absent" if not sent else "repeated"
            raise errors.ClientUnidentified(f"route {route!r}: {source} {problem}")
        values.append(sent[0])
    identity = "\n".join(values).encode("utf-8", "surrogateescape")
    return f"{scope}/~{hashlib.sha256(identity).hexdigest()[:32]}"


def fingerprint(method: str, target: str, body_sha256: bytes) -> bytes:
    """What a key stands for: the method, the path and query, and the body."""
    return hashlib.sha256(b"%s %s\n%s" % (method.encode(), target.encode(), body_sha256)).digest()
