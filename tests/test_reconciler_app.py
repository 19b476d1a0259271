"""The reconciler on a GitHub App's hook (``/app/hook/deliveries``), against the stand-in of
GitHub's API (tests/provider_standins.py, the operations vendored in
tests/provider_api/github-app-hook-deliveries.yaml), through a real proxy on the session's
PostgreSQL: the API opens only to a JWT signed with the App's key (a pair made here), failed
deliveries are redelivered and reach the app once, claimed ones are never asked for again, and a
wrong, expired or unusable key ends the run as documented, counted.
"""

from __future__ import annotations

import asyncio
import json
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema  # type: ignore[import-untyped]
import jwt
import pytest
import yaml
from aiohttp.test_utils import TestServer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from proxy import cli, config, errors, reconciler
from proxy.config import reconcile as reconciling
from proxy.providers_api import github_app
from tests.helpers import (
    GITHUB_SECRET,
    FakeUpstream,
    MakeProxy,
    github_route,
    metrics_text,
    reconcile_once,
)
from tests.provider_standins import GitHubHook, json_schema

CLIENT_ID = "Iv23liStandInClient"
VENDORED = Path(__file__).parent / "provider_api" / "github-app-hook-deliveries.yaml"


def _key_pair() -> tuple[str, Any]:
    """A private key in PEM as GitHub hands it out (PKCS#1), and its public key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    ).decode()
    return pem, key.public_key()


@pytest.fixture(scope="module")
def app_key() -> tuple[str, Any]:
    return _key_pair()


@pytest.fixture
async def hook(aiohttp_server: Any, app_key: tuple[str, Any]) -> GitHubHook:
    stand_in = GitHubHook.app_hook(secret=GITHUB_SECRET, client_id=CLIENT_ID, public_key=app_key[1])
    server = await aiohttp_server(stand_in.app())
    stand_in.api_url = str(server.make_url(""))
    return stand_in


# The tests drive each run themselves.
pytestmark = pytest.mark.usefixtures("no_background_runs")


def _route(api_url: str, private_key: str, **reconcile: Any) -> dict[str, Any]:
    settings = {"every": "1h", "since": "1h", "client_id": CLIENT_ID, "hook_id": 1,
                "private_key": private_key, "api_url": api_url, **reconcile}  # fmt: skip
    return github_route(reconcile=settings)


def _body(n: int) -> bytes:
    return json.dumps({"action": "opened", "n": n}).encode()


def _delivered(upstream: FakeUpstream) -> Counter[str]:
    return Counter(r.headers["x-github-delivery"][0] for r in upstream.requests)


async def test_failed_deliveries_to_an_app_hook_are_redelivered_and_reach_the_app_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook, app_key: tuple[str, Any]
) -> None:
    proxy = await make_proxy(routes=[_route(hook.api_url, app_key[0])])
    hook.target = str(proxy.make_url("/webhooks/github"))
    assert await hook.deliver("before", _body(0)) == 200
    hook.target = "http://127.0.0.1:9/unreachable"  # the proxy could not be reached
    for n in range(5):
        await hook.deliver(f"missed-{n}", _body(n))
    hook.target = str(proxy.make_url("/webhooks/github"))

    report = await reconcile_once(proxy)

    assert report.stopped is None
    assert len(report.deliveries) == 6
    assert sorted(d.event_id for d in report.recovered) == [f"1:missed-{n}" for n in range(5)]
    delivered = _delivered(upstream)
    assert set(delivered.values()) == {1}
    assert set(delivered) == {"before"} | {f"missed-{n}" for n in range(5)}
    # The next run: each has its claim now, and a successful attempt; nothing is asked again.
    asked = list(hook.redelivery_requests)
    again = await reconcile_once(proxy)
    assert (again.gaps, again.recovered, hook.redelivery_requests) == ([], [], asked)
    assert set(_delivered(upstream).values()) == {1}
    assert 'dedup_reconcile_recovered_total{route="github"} 5.0' in metrics_text(proxy)


async def test_a_failed_app_delivery_with_a_claim_is_never_asked_for_again(
    make_proxy: MakeProxy, upstream: FakeUpstream, hook: GitHubHook, app_key: tuple[str, Any]
) -> None:
    """The app was slow: GitHub logged a timeout, but the proxy claimed and processed it."""
    proxy = await make_proxy(routes=[_route(hook.api_url, app_key[0])])
    hook.target = str(proxy.make_url("/webhooks/github"))
    assert await hook.deliver("slow", _body(1)) == 200
    hook.attempts[-1].status_code = 504

    report = await reconcile_once(proxy)

    assert [d.event_id for d in report.claimed] == ["1:slow"]
    assert (report.gaps, hook.redelivery_requests, report.stopped) == ([], [], None)
    assert len(upstream.requests) == 1


def _an_hour_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = types.SimpleNamespace(time=lambda: time.time() - 3600)
    monkeypatch.setattr(github_app, "time", slow)


@pytest.mark.parametrize("key", ["another App's key", "an hour-slow clock", "not a key"])
async def test_a_wrong_expired_or_unusable_key_ends_the_run_unauthorized_and_is_counted(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    hook: GitHubHook,
    app_key: tuple[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    key: str,
) -> None:
    pem = app_key[0]
    if key == "another App's key":
        pem = _key_pair()[0]
    elif key == "an hour-slow clock":
        _an_hour_slow(monkeypatch)  # the JWT expired 50 minutes ago
    else:
        pem = "-----BEGIN RSA PRIVATE KEY-----\nbm90IGEga2V5\n-----END RSA PRIVATE KEY-----\n"
    proxy = await make_proxy(routes=[_route(hook.api_url, pem)])
    hook.target = "http://127.0.0.1:9/unreachable"
    for n in range(3):
        await hook.deliver(f"gap-{n}", _body(n))
    hook.target = str(proxy.make_url("/webhooks/github"))

    report = await reconcile_once(proxy)

    assert report.stopped is not None
    assert report.stopped.kind == "unauthorized"
    assert pem not in report.stopped.message
    assert (report.recovered, hook.redelivery_requests, upstream.requests) == ([], [], [])
    assert hook.list_requests == (0 if key == "not a key" else 1)
    metrics = metrics_text(proxy)
    assert 'dedup_reconcile_errors_total{kind="unauthorized",route="github"} 1.0' in metrics
    assert "dedup_reconcile_last_success_timestamp_seconds{" not in metrics
    if key == "an hour-slow clock":
        monkeypatch.undo()
        monkeypatch.setattr(reconciler, "FIRST_RUN_DELAY", 3600.0)
        recovered = await reconcile_once(
            proxy
        )  # the clock set right: the next run recovers each once
        assert len(recovered.recovered) == 3
        assert set(_delivered(upstream).values()) == {1}


def test_the_app_jwt_is_rs256_issued_by_the_app_backdated_and_renewed_before_its_end(
    app_key: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    start = int(time.time())
    now = [float(start)]
    monkeypatch.setattr(github_app, "time", types.SimpleNamespace(time=lambda: now[0]))
    token = github_app.AppJWT(CLIENT_ID, app_key[0])

    first = token.bearer()

    assert jwt.get_unverified_header(first)["alg"] == "RS256"
    claims = jwt.decode(first, app_key[1], algorithms=["RS256"], issuer=CLIENT_ID)
    assert claims == {"iat": start - 60, "exp": start + 540, "iss": CLIENT_ID}
    now[0] += 470  # 70 s left: kept
    assert token.bearer() == first
    now[0] += 20  # 50 s left: signed afresh
    assert token.bearer() != first
    assert app_key[0] not in repr(token)
    assert first not in repr(token)


def test_the_stand_in_answers_as_the_vendored_app_operations_say(
    app_key: tuple[str, Any],
) -> None:
    described = yaml.safe_load(VENDORED.read_text())
    paths = described["paths"]
    operations = {
        paths["/app/hook/deliveries"]["get"]["operationId"],
        paths["/app/hook/deliveries/{delivery_id}"]["get"]["operationId"],
        paths["/app/hook/deliveries/{delivery_id}/attempts"]["post"]["operationId"],
    }
    assert operations == {
        "apps/list-webhook-deliveries",
        "apps/get-webhook-delivery",
        "apps/redeliver-webhook-delivery",
    }
    schemas = described["components"]["schemas"]
    item, one = json_schema(schemas["hook-delivery-item"]), json_schema(schemas["hook-delivery"])
    accepted = json_schema(described["components"]["responses"]["accepted"])

    async def answers() -> tuple[list[Any], Any, Any, int, int]:
        stand_in = GitHubHook.app_hook(
            secret=GITHUB_SECRET, client_id=CLIENT_ID, public_key=app_key[1]
        )
        stand_in.target = "http://127.0.0.1:9/unreachable"
        await stand_in.deliver("guid-1", _body(1))
        bearer = {"Authorization": f"Bearer {github_app.AppJWT(CLIENT_ID, app_key[0]).bearer()}"}
        async with TestServer(stand_in.app()) as server, aiohttp.ClientSession() as session:
            base = str(server.make_url("/app/hook/deliveries"))
            async with session.get(base, headers=bearer) as listed:
                listing = await listed.json()
            delivery_id = listing[0]["id"]
            async with session.get(f"{base}/{delivery_id}", headers=bearer) as got:
                single = await got.json()
            async with session.post(f"{base}/{delivery_id}/attempts", headers=bearer) as posted:
                redelivered, status = await posted.json(), posted.status
            async with session.get(base) as anonymous:
                refused = anonymous.status
        return listing, single, redelivered, status, refused

    listing, single, redelivered, status, refused = asyncio.run(answers())
    jsonschema.validate(listing, {"type": "array", "items": item})
    jsonschema.validate(single, one)
    jsonschema.validate(redelivered, accepted["content"]["application/json"]["schema"])
    assert (status, refused) == (202, 401)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**single, "request": None}, one)


def _parse(reconcile: dict[str, Any], *, secrets: bool = True) -> config.Config:
    return config.parse({
        "upstream": {"url": "http://127.0.0.1:9"}, "database": {"dsn": "embedded"},
        "routes": [github_route(reconcile={"hook_id": 1, **reconcile})],
    }, secrets=secrets)  # fmt: skip


def _problems(reconcile: dict[str, Any]) -> str:
    with pytest.raises(errors.ConfigError) as raised:
        _parse(reconcile)
    return str(raised.value)


def test_an_app_hook_is_configured_with_the_app_and_its_key_never_shown(
    app_key: tuple[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pem = app_key[0]
    key_file = tmp_path / "app.pem"
    key_file.write_text(pem)
    monkeypatch.setenv("STAND_IN_APP_KEY", pem.strip().replace("\n", "\\n"))  # one line
    for credential in ({"private_key_file": str(key_file)},
                       {"private_key": "${STAND_IN_APP_KEY}"}):  # fmt: skip
        cfg = _parse({"client_id": CLIENT_ID, **credential})
        settings = cfg.routes[0].reconcile
        assert settings is not None
        assert (settings.app, settings.hook, settings.private_key) == (CLIENT_ID, "/app/hook", pem)
        assert settings.token == ""
        assert "PRIVATE KEY" not in repr(cfg)
    by_id = _parse({"app_id": 123456, "private_key_file": str(key_file)}).routes[0].reconcile
    assert by_id is not None
    assert by_id.app == "123456"
    unread = _parse({"client_id": CLIENT_ID, "private_key": "${UNSET_KEY_VAR}"}, secrets=False)
    assert unread.routes[0].reconcile is not None


def test_an_app_hook_needs_exactly_one_hook_kind_and_the_app_s_own_credential(
    app_key: tuple[str, Any],
) -> None:
    pem = app_key[0]
    both = _problems({"client_id": CLIENT_ID, "repository": "octo/app", "private_key": pem})
    assert "exactly one hook" in both
    assert "got repository and app_id/client_id" in both
    assert "exactly one hook" in _problems({"token": "t"})
    assert "either app_id or client_id" in _problems(
        {"client_id": CLIENT_ID, "app_id": 1, "private_key": pem}
    )
    assert "not a token" in _problems({"client_id": CLIENT_ID, "token": "t", "private_key": pem})
    assert "give either private_key" in _problems({"client_id": CLIENT_ID})
    assert "only for a GitHub App's hook" in _problems(
        {"repository": "octo/app", "token": "t", "private_key": pem}
    )
    not_pem = _problems({"client_id": CLIENT_ID, "private_key": "s3cr3t-not-a-pem"})
    assert "must be the App's private key in PEM" in not_pem
    assert "s3cr3t-not-a-pem" not in not_pem
    assert "numeric ID" in _problems({"app_id": "Iv23x", "private_key": pem})


def test_an_app_hook_without_the_extra_says_which_extra_to_install(
    app_key: tuple[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciling, "GITHUB_APP_MODULES", ("jwt", "no_such_module_for_jwt"))
    problems = _problems({"client_id": CLIENT_ID, "private_key": app_key[0]})
    assert "routes[0].reconcile.client_id" in problems
    assert "pip install 'webhook-dedup-proxy[github-app]'" in problems


def test_check_names_the_app_hook_and_masks_its_key(
    app_key: tuple[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_file = tmp_path / "app.pem"
    key_file.write_text(app_key[0])
    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": "http://127.0.0.1:9"},
                "database": {"dsn": "postgresql://app@127.0.0.1:9/events"},
                "routes": [
                    github_route(
                        reconcile={
                            "client_id": CLIENT_ID,
                            "hook_id": 1,
                            "private_key_file": str(key_file),
                        }
                    )
                ],
            }
        )
    )

    assert cli.main(["check", "--config", str(path)]) == 0

    out = capsys.readouterr().out
    assert f"reconcile /app/hook every 5m over 6h (App {CLIENT_ID}'s JWT, key (masked))" in out
    assert "PRIVATE KEY" not in out
