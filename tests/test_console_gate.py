"""Who may see the operator console and act from it (``proxy.console_gate``,
``proxy.config.console``): beyond a loopback admin listener only with credentials or an explicit
opt-out; an action's token expires. The rest of the console is in tests/test_console.py.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from typing import Any

import pytest
from aiohttp import web

from proxy import config, console_gate, errors
from tests.helpers import FakeUpstream, MakeProxy, admin_client, fetch

PASSWORD = "correct-horse-battery-staple"
ALICE = config.console.Credential(name="alice", password=PASSWORD)
KEPT = {
    "name": "hooks",
    "path": "/hooks",
    "event_id": "body:/id",
    "redeliver": {"schedule": ["1h"], "for": "1d"},
}
BASE: dict[str, Any] = {
    "upstream": {"url": "http://127.0.0.1:9"},
    "database": {"dsn": "embedded"},
    "routes": [KEPT],
}


def problems_of(admin: dict[str, Any]) -> tuple[str, ...]:
    with pytest.raises(errors.ConfigError) as info:
        config.parse({**BASE, "admin": admin})
    return info.value.problems


@pytest.mark.parametrize("listen", ["0.0.0.0:9901", "[::]:9901", "10.0.0.7:9901", "pod:9901"])
def test_the_console_beyond_loopback_needs_credentials_or_an_explicit_opt_out(
    listen: str,
) -> None:
    (problem,) = problems_of({"listen": listen})
    assert problem.startswith(
        f"admin.console: the console shows customers' kept deliveries to whoever reaches "
        f"admin.listen {listen}, which is not loopback: set credentials"
    )
    # Each way out: off, a credential, or said in so many words (and warned about at start-up).
    off = config.parse({**BASE, "admin": {"listen": listen, "console": {"enabled": False}}})
    assert not off.admin.open_console
    guarded = {"listen": listen, "console": {"credentials": f"alice:{PASSWORD}"}}
    assert not config.parse({**BASE, "admin": guarded}).admin.open_console
    said = {"listen": listen, "console": {"unauthenticated": True}}
    assert config.parse({**BASE, "admin": said}).admin.open_console
    both = {"listen": listen, "console": {"unauthenticated": True, "credentials": "a:b"}}
    assert "admin.console.unauthenticated: not with credentials" in " ".join(problems_of(both))


@pytest.mark.parametrize("listen", ["127.0.0.1:9901", "[::1]:9901", "localhost:9901"])
def test_on_loopback_the_console_shows_without_any_setting(listen: str) -> None:
    cfg = config.parse({**BASE, "admin": {"listen": listen}})
    assert cfg.admin.console.enabled
    assert not cfg.admin.open_console


def test_allowed_hosts_are_names_not_urls() -> None:
    cfg = config.parse({**BASE, "admin": {"allowed_hosts": ["Proxy.Shop.SVC.", ".internal", "*"]}})
    assert cfg.admin.allowed_hosts == ("proxy.shop.svc", ".internal", "*")
    for wrong in ("http://proxy", "proxy:9901", "", "a b", "::1"):
        (problem,) = problems_of({"allowed_hosts": [wrong]})
        assert problem.startswith("admin.allowed_hosts: must be host names such as"), problem


def _basic() -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()}


async def test_an_actions_token_expires_and_yesterdays_form_acts_no_more(
    make_proxy: MakeProxy, aiohttp_client: Any, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    upstream.respond = lambda n: web.Response(status=422)
    settings = {"console": {"actions": True, "credentials": [f"alice:{PASSWORD}"]}}
    proxy = await make_proxy(routes=[KEPT], admin=settings)
    admin = await admin_client(aiohttp_client, proxy)
    async with proxy.post("/hooks", data=json.dumps({"id": "evt_1"})) as answer:
        assert answer.status in (200, 202)
    async with admin.get("/console/event?scope=hooks&id=evt_1", headers=_basic()) as page:
        html = await page.text()
    form = re.search(r'<form method="post" action="discard">(.*?)</form>', html, re.S)
    assert form is not None, html
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', form[1]))
    now = int(time.time())
    # The token a form carried before tokens expired: the same for ever.
    everlasting = hmac.new(
        PASSWORD.encode(), b"dedup-proxy console action\x00alice", hashlib.sha256
    ).hexdigest()
    stale = console_gate.csrf_token(ALICE, issued=now - console_gate.CSRF_MAX_AGE - 60)
    forged = f"{now}.{stale.partition('.')[2]}"  # a fresh time on an old token's HMAC
    headers = {**_basic(), "Origin": f"http://{admin.host}:{admin.port}"}
    for token, why in (
        (everlasting, "the form's token is missing or wrong"),
        (stale, "the page is older than 12h: reload it and act again"),
        (forged, "the form's token is missing or wrong"),
    ):
        async with admin.post(
            "/console/discard", data={**fields, "csrf": token}, headers=headers
        ) as response:
            assert response.status == 403
            assert await response.text() == f"refused: {why}\n"
    rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1', "evt_1")
    assert rows[0]["inbox_state"] == "dead"

    async with admin.post(
        "/console/discard", data=fields, headers=headers, allow_redirects=False
    ) as response:
        assert response.status == 303, await response.text()
    rows = await fetch(pg_dsn, f'SELECT inbox_state FROM "{table}" WHERE event_id = $1', "evt_1")
    assert rows[0]["inbox_state"] == "discarded"
