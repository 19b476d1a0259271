"""The operator console's gate: who may see it, who may act, and the headers that keep what it
shows inert.

Every console answer carries a strict Content-Security-Policy (no script at all, styles from the
console's own stylesheet only, no frame may hold it) and the headers that go with it. With
``admin.console.credentials`` set, every page asks for HTTP Basic credentials: the name is who
the action log names. An action (a POST; no GET changes anything) must come from a page of the
console itself: ``Sec-Fetch-Site`` (where the browser sends it) says ``same-origin``, its
``Origin`` is the console's (``same_origin``), and the form carries a token bound to the
operator's credential and to when its page was made (an HMAC keyed by the password, so the
same in every worker and after a restart, and unknown to a page of another origin), refused once
older than ``CSRF_MAX_AGE``: a form copied off a page, a log or a screen stops working.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.config import console as console_config

CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self' data:; script-src 'none'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
REALM = 'Basic realm="dedup-proxy console", charset="UTF-8"'
# The operator's credential on the request, once checked (absent: none is configured).
OPERATOR = web.RequestKey("operator", console_config.Credential)
CSRF_FIELD = "csrf"
# A working day: a page left open over lunch still acts; yesterday's does not.
CSRF_MAX_AGE = 12 * 3600
_CSRF_CONTEXT = b"dedup-proxy console action\x00"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def csrf_token(credential: console_config.Credential, issued: int | None = None) -> str:
    """The token an action's form carries for this operator: when it was ``issued`` (now, in
    whole seconds since the epoch), and the HMAC of that and the operator's name."""
    issued = int(time.time()) if issued is None else issued
    return f"{issued}.{_csrf_mac(credential, issued)}"


def _csrf_mac(credential: console_config.Credential, issued: int) -> str:
    key = credential.password.encode("utf-8")
    message = _CSRF_CONTEXT + credential.name.encode() + b"\x00" + str(issued).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def csrf_problem(credential: console_config.Credential, token: object) -> str | None:
    """Why ``token`` is refused for this operator (None: it is theirs, and recent)."""
    issued, dot, mac = token.partition(".") if isinstance(token, str) else ("", "", "")
    if not (dot and issued.isascii() and issued.isdigit() and len(issued) <= 12):
        return "the form's token is missing or wrong"
    if not hmac.compare_digest(mac.encode(), _csrf_mac(credential, int(issued)).encode()):
        return "the form's token is missing or wrong"
    age = time.time() - int(issued)
    if not -60 <= age <= CSRF_MAX_AGE:
        return f"the page is older than {CSRF_MAX_AGE // 3600}h: reload it and act again"
    return None


def _presented(request: web.Request) -> tuple[str, str] | None:
    scheme, _, encoded = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    name, colon, password = decoded.partition(":")
    return (name, password) if colon else None


def authenticate(
    request: web.Request, credentials: tuple[console_config.Credential, ...]
) -> console_config.Credential | None:
    """The operator whose credential the request presents (None: none, or a wrong one). Each
    password is compared in constant time, and all of them are, whichever matches."""
    presented = _presented(request)
    if presented is None:
        return None
    name, password = presented
    found = None
    for credential in credentials:
        same_name = hmac.compare_digest(credential.name.encode(), name.encode())
        same = hmac.compare_digest(credential.password.encode(), password.encode())
        if same_name and same:
            found = credential
    return found


def same_origin(request: web.Request) -> bool:
    """Whether a POST comes from a page of the console's own origin. ``Sec-Fetch-Site``, which
    no page can set, says so where the browser sends it; the console's ``no-referrer`` policy
    then makes Chromium send ``Origin: null``, so that ``Origin`` may be this host or null.
    Without it, ``Origin`` (every browser sends it on a POST) must name this host."""
    origin = request.headers.get("Origin")
    own = f"{request.scheme}://{request.host}"
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None:
        return fetch_site == "same-origin" and origin in (own, "null")
    return origin == own


def guard(settings: console_config.ConsoleConfig) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The console application's middleware: the headers on every answer (errors too), the
    credential when one is configured, and for a POST its origin and token (403 otherwise)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            response = await _checked(request, handler, settings)
        except web.HTTPException as exc:
            exc.headers.update(HEADERS)
            raise
        response.headers.update(HEADERS)
        return response

    return middleware


async def _checked(
    request: web.Request, handler: Handler, settings: console_config.ConsoleConfig
) -> web.StreamResponse:
    credential = None
    if settings.credentials:
        credential = authenticate(request, settings.credentials)
        if credential is None:
            raise web.HTTPUnauthorized(
                text="the console asks for an operator's credentials\n",
                headers={"WWW-Authenticate": REALM},
            )
    if credential is not None:
        request[OPERATOR] = credential
    # A method or path the console has no route for is answered so (405, 404) by the router.
    if request.method not in ("GET", "HEAD") and request.match_info.http_exception is None:
        if not settings.actions or credential is None:
            raise web.HTTPForbidden(text="the console's actions are off: it only shows\n")
        if not same_origin(request):
            raise web.HTTPForbidden(text="refused: not from a page of the console\n")
        form = await request.post()
        if problem := csrf_problem(credential, form.get(CSRF_FIELD)):
            raise web.HTTPForbidden(text=f"refused: {problem}\n")
    return await handler(request)
