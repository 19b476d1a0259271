"""Upgrades across the claim-binding change: on GitHub, Shopify and Twilio routes with
``verify`` release 0.1.0 stored a claim under the event ID alone, this one under the ID bound
to the body (``webhooks.bound``). For one retention after a route's first bound claim, a claim
in either form is a duplicate of the other (``Store.notice_id_forms``): release 0.1.0 itself,
run side by side with this tree on one table, and pre-upgrade claims written as it writes them.
And the previous release, 0.2.0, side by side with this tree on a table this tree migrated, as
its upgrade notes have the rollout go (docs/deployment.md, "From 0.2.0 to 0.3.0").
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import io
import json
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy import config, operations, webhooks
from tests.helpers import (
    CORVEL,
    FakeUpstream,
    MakeProxy,
    execute,
    fetch,
    github_headers,
    github_route,
    run_cli,
    run_python,
    serve_settings,
    start_serve,
    wait_for_lock_waiters,
)

# Release 0.1.0, before claims were bound (docs/deployment.md, "Upgrades").
OLD_RELEASE = "88bf7da"
# Release 0.2.0: the commit that finished its CHANGELOG section, before 0.3.0's first change.
RELEASE_0_2_0 = "0d66c8e"
ROOT = Path(__file__).resolve().parents[1]
SHOPIFY_SECRET = "shpss_upgrade"
TWILIO_TOKEN = "12345678901234567890123456789012"
TWILIO_URL = "https://hooks.example.com/twilio/sms"
TWIML = b"<Response><Message>ok</Message></Response>"


def release_tree(factory: pytest.TempPathFactory, commit: str, version: str) -> Path:
    """A release's ``proxy`` package, from this repository's history (CI clones it whole): run
    with this environment's dependencies, as its own ``proxy`` package."""
    found = subprocess.run(
        ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
        check=False,
    )
    if found.returncode != 0:
        pytest.fail(
            f"commit {commit} (release {version}) is not in this clone: the upgrade test needs "
            "the history (git fetch --unshallow)"
        )
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "proxy"], capture_output=True, check=True
    ).stdout
    tree = factory.mktemp(f"release-{version}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


@pytest.fixture(scope="session")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Release 0.1.0's tree, once per session."""
    return release_tree(tmp_path_factory, OLD_RELEASE, "0.1.0")


@pytest.fixture(scope="session")
def release_0_2_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Release 0.2.0's tree, once per session."""
    return release_tree(tmp_path_factory, RELEASE_0_2_0, "0.2.0")


async def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, str | None]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=body, headers=headers) as response,
    ):
        await response.read()
        return response.status, response.headers.get("Dedup-Status")


async def test_release_0_1_0_and_this_one_on_one_table_process_a_delivery_and_its_copy_once(
    tmp_path: Path, old_release: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> None:
    """0.1.0 claims a delivery before the upgrade; this release, started beside it, takes
    that delivery's copy as a duplicate, and 0.1.0 takes the copy of this one's claim as one."""
    served = []

    async def start(name: str, **kwargs: Any) -> str:
        settings = serve_settings(upstream.url, pg_dsn, table, routes=[github_route()])
        settings.pop("log")  # 0.1.0 has no log.format
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(settings))
        served.append(await start_serve(config_file, tmp_path / f"{name}.log", **kwargs))
        return f"{served[-1].url}/webhooks/github"

    first = json.dumps({"ref": "refs/heads/main", "n": 1}).encode()
    second = json.dumps({"ref": "refs/heads/main", "n": 2}).encode()
    try:
        # cwd: ``python -m proxy`` imports the package from there, before this tree's.
        old = await start("old", env={"PYTHONPATH": str(old_release)}, cwd=old_release)
        before = await post(old, first, github_headers(first, "d-1"))
        stored = await fetch(pg_dsn, f'SELECT event_id FROM "{table}"')
        assert [row["event_id"] for row in stored] == ["1:d-1"]  # 0.1.0's form: not bound

        new = await start("new")
        after = await post(new, first, github_headers(first, "d-1"))
        claimed_new = await post(new, second, github_headers(second, "d-2"))
        copy_at_old = await post(old, second, github_headers(second, "d-2"))
    finally:
        for process in served:
            await process.kill()

    assert before == (200, None)
    assert after == (200, "duplicate")  # the pre-upgrade claim
    assert claimed_new == (200, None)
    assert copy_at_old == (200, "duplicate")  # 0.1.0 sees this release's claim
    assert upstream.bodies() == [first, second]


async def test_release_0_2_0_beside_this_one_on_a_migrated_table_processes_each_event_once(
    tmp_path: Path, release_0_2_0: Path, pg_dsn: str, table: str, upstream: FakeUpstream
) -> None:
    """The rollout 0.3.0's notes ask for: this release's ``migrate`` first (its column and
    indexes), then 0.2.0 replicas still serving beside this release's. A delivery claimed by
    either, on a route that binds its claims and on one that does not, is a duplicate at the
    other, and 0.2.0 says its own version."""
    routes = [CORVEL, github_route()]
    served = []

    def configured(name: str) -> Path:
        settings = serve_settings(upstream.url, pg_dsn, table, routes=routes)
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(yaml.safe_dump(settings))
        return config_file

    async def start(name: str, **kwargs: Any) -> str:
        served.append(await start_serve(configured(name), tmp_path / f"{name}.log", **kwargs))
        return served[-1].url

    status, _, stderr = await run_cli("migrate", "--config", str(configured("migrate")))
    assert status == 0, stderr
    _, old_version, _ = await run_python("-m", "proxy", "--version", cwd=release_0_2_0)
    bodies = [json.dumps({"id": f"evt_{n}", "ref": "refs/heads/main"}).encode() for n in (1, 2)]
    corvel = {"Content-Type": "application/json"}
    try:
        # cwd: ``python -m proxy`` imports the package from there, before this tree's.
        old = await start("old", env={"PYTHONPATH": str(release_0_2_0)}, cwd=release_0_2_0)
        new = await start("new")
        answers = [
            await post(f"{old}/webhooks/corvel", bodies[0], corvel),
            await post(f"{new}/webhooks/corvel", bodies[0], corvel),
            await post(f"{new}/webhooks/corvel", bodies[1], corvel),
            await post(f"{old}/webhooks/corvel", bodies[1], corvel),
            await post(f"{old}/webhooks/github", bodies[0], github_headers(bodies[0], "d-1")),
            await post(f"{new}/webhooks/github", bodies[0], github_headers(bodies[0], "d-1")),
            await post(f"{new}/webhooks/github", bodies[1], github_headers(bodies[1], "d-2")),
            await post(f"{old}/webhooks/github", bodies[1], github_headers(bodies[1], "d-2")),
        ]
    finally:
        for process in served:
            await process.kill()

    assert old_version == "dedup-proxy 0.2.0\n"
    assert answers == [(200, None), (200, "duplicate"), (200, None), (200, "duplicate")] * 2
    assert upstream.bodies() == bodies * 2  # each event once per route


# --- the window, against claims written as 0.1.0 writes them ------------------------------


def shopify_route() -> dict[str, Any]:
    return {
        "name": "shopify",
        "path": "/webhooks/shopify",
        "preset": "shopify",
        "verify": {"secret": SHOPIFY_SECRET},
    }


def shopify_headers(body: bytes, event_id: str) -> dict[str, str]:
    mac = hmac.new(SHOPIFY_SECRET.encode(), body, hashlib.sha256).digest()
    return {
        "X-Shopify-Hmac-Sha256": base64.b64encode(mac).decode(),
        "X-Shopify-Event-Id": event_id,
        "X-Shopify-Topic": "orders/paid",
    }


def twilio_route() -> dict[str, Any]:
    return {
        "name": "twilio",
        "path": "/twilio/sms",
        "preset": "twilio",
        "verify": {"secret": TWILIO_TOKEN, "public_url": TWILIO_URL},
    }


def twilio_headers(body: bytes, token: str) -> dict[str, str]:
    params = dict(pair.split("=", 1) for pair in body.decode().split("&"))
    signed = TWILIO_URL + "".join(k + v for k, v in sorted(params.items()))
    mac = hmac.new(TWILIO_TOKEN.encode(), signed.encode(), hashlib.sha1).digest()
    return {
        "X-Twilio-Signature": base64.b64encode(mac).decode(),
        "I-Twilio-Idempotency-Token": token,
        "Content-Type": "application/x-www-form-urlencoded",
    }


# (route, path, body, headers for (body, the provider's ID), the ID as the proxy keys it)
Provider = tuple[dict[str, Any], str, bytes, Callable[[bytes, str], dict[str, str]], str]
PROVIDERS: dict[str, Provider] = {
    "github": (
        github_route(),
        "/webhooks/github",
        json.dumps({"n": 1}).encode(),
        github_headers,
        "1:{}",
    ),
    "shopify": (
        shopify_route(),
        "/webhooks/shopify",
        json.dumps({"id": 7}).encode(),
        shopify_headers,
        "{}",
    ),
    "twilio": (
        twilio_route(),
        "/twilio/sms",
        urlencode({"MessageSid": "SM1", "Body": "hi"}).encode(),
        twilio_headers,
        "{}",
    ),
}


def old_claim(table: str, scope: str, event_id: str, body: bytes, answer: bytes | None) -> str:
    """A claim as 0.1.0 commits it: under the event ID alone, with the body's digest and, on a
    route that replays, the app's answer."""
    digest = hashlib.sha256(body).hexdigest()
    columns = "scope, event_id, body_sha256"
    values = f"'{scope}', '{event_id}', decode('{digest}', 'hex')"
    if answer is not None:
        columns += ", answer_status, answer_headers, answer_body"
        values += f", 200, '[[\"Content-Type\",\"text/xml\"]]', decode('{answer.hex()}', 'hex')"
    return f'INSERT INTO "{table}" ({columns}) VALUES ({values}) ON CONFLICT DO NOTHING'


@pytest.mark.parametrize("provider", list(PROVIDERS))
async def test_inside_the_window_either_form_is_a_duplicate_of_the_other(
    provider: str, make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    route, path, body, headers, keyed = PROVIDERS[provider]
    upstream.respond = lambda n: web.Response(body=TWIML, content_type="text/xml")
    replays = provider == "twilio"
    await make_proxy(routes=[route])  # creates the table; the scope has no claims yet
    await execute(pg_dsn, f"""DELETE FROM "{table}" WHERE scope = '~id-forms'""")
    # Before the upgrade: 0.1.0 claimed "e-1" (and stored its answer, on a route that replays).
    await execute(pg_dsn, old_claim(table, route["name"], keyed.format("e-1"), body, TWIML))

    proxy = await make_proxy(routes=[route])  # the upgrade: its first bound claim opens it
    copy = await proxy.post(path, data=body, headers=headers(body, "e-1"))
    fresh = await proxy.post(path, data=body, headers=headers(body, "e-2"))
    # 0.1.0, still running beside it, claims the copy of "e-2" in its form.
    old_copy = await fetch(
        pg_dsn, old_claim(table, route["name"], keyed.format("e-2"), body, None) + " RETURNING 1"
    )

    assert copy.headers["Dedup-Status"] == "duplicate"
    if replays:  # the answer 0.1.0 stored, replayed
        assert (await copy.read(), copy.headers.get("Idempotent-Replayed")) == (TWIML, "true")
    assert (fresh.status, fresh.headers.get("Dedup-Status")) == (200, None)
    assert old_copy == []  # a conflict: 0.1.0 answers it as a duplicate
    assert len(upstream.requests) == 1
    rows = await fetch(
        pg_dsn,
        f"""SELECT event_id, answer_body FROM "{table}" WHERE scope = $1 ORDER BY 1""",
        route["name"],
    )
    bound = webhooks.bound(keyed.format("e-2"), "", hashlib.sha256(body).digest())
    assert [row["event_id"] for row in rows] == [keyed.format("e-1"), keyed.format("e-2"), bound]
    if replays:  # in both rows: 0.1.0 replays it from the legacy one
        assert [row["answer_body"] for row in rows[1:]] == [TWIML, TWIML]


async def test_forget_inside_the_window_forgets_both_forms(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    proxy_config: Callable[..., config.Config],
    pg_dsn: str,
    table: str,
) -> None:
    """``events forget`` of the ID as sent deletes the claim's legacy form with it, so that
    the manual redelivery it is for goes through inside the window too."""
    route, path, body, headers, _ = PROVIDERS["github"]
    await make_proxy(routes=[route])
    await execute(
        pg_dsn,
        f"""DELETE FROM "{table}" WHERE scope = '~id-forms';"""
        + old_claim(table, "github", "1:before", body, None),
    )
    proxy = await make_proxy(routes=[route])
    await proxy.post(path, data=body, headers=headers(body, "e-1"))
    out = io.StringIO()

    code = await operations.forget(proxy_config(routes=[route]), "github", ["1:e-1"], out)
    again = await proxy.post(path, data=body, headers=headers(body, "e-1"))

    bound = webhooks.bound("1:e-1", "", hashlib.sha256(body).digest())
    assert (code, out.getvalue()) == (0, f"forgotten: github 1:e-1 (claim {bound})\n")
    assert (again.status, again.headers.get("Dedup-Status")) == (200, None)
    assert len(upstream.requests) == 2


async def test_a_new_route_has_no_window_and_the_window_ends_one_retention_on(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """Where no claim predates the bound form, none is made in the legacy form (the window
    weakens what binding guards); after an upgrade, none once a retention has passed."""
    route, path, body, headers, _ = PROVIDERS["github"]
    new = await make_proxy(routes=[route])
    await new.post(path, data=body, headers=headers(body, "e-1"))
    forms = await fetch(
        pg_dsn, f"""SELECT received_at::text FROM "{table}" WHERE scope = '~id-forms'"""
    )
    await execute(pg_dsn, f"""DELETE FROM "{table}" WHERE scope = '~id-forms'""")
    upgraded = await make_proxy(routes=[route])  # claims predate it: the window opens
    await upgraded.post(path, data=body, headers=headers(body, "e-2"))
    # As if that upgrade had begun just over a retention (4 days for GitHub) ago.
    await execute(
        pg_dsn,
        f"""UPDATE "{table}" SET received_at = now() - interval '4 days 1 minute'
            WHERE scope = '~id-forms'""",
    )
    later = await make_proxy(routes=[route])
    await later.post(path, data=body, headers=headers(body, "e-3"))

    assert [row["received_at"] for row in forms] == ["-infinity"]
    rows = await fetch(pg_dsn, f"""SELECT event_id FROM "{table}" WHERE scope = 'github'""")
    digest = hashlib.sha256(body).digest()
    assert sorted(row["event_id"] for row in rows) == sorted(
        [
            webhooks.bound("1:e-1", "", digest),
            "1:e-2",
            webhooks.bound("1:e-2", "", digest),
            webhooks.bound("1:e-3", "", digest),
        ]
    )


async def test_two_copies_in_flight_inside_the_window_reach_the_app_once(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """Both rows are claimed in one order by every replica: a copy on another replica waits
    on the first's legacy row, then is its duplicate (no deadlock, no second delivery)."""
    route, path, body, headers, _ = PROVIDERS["github"]
    await make_proxy(routes=[route])
    await execute(
        pg_dsn,
        f"""DELETE FROM "{table}" WHERE scope = '~id-forms';"""
        + old_claim(table, "github", "1:before", body, None),
    )
    proxy = await make_proxy(routes=[route])
    other = await make_proxy(routes=[route])  # another replica
    upstream.gate = asyncio.Event()
    first = asyncio.create_task(proxy.post(path, data=body, headers=headers(body, "e-1")))
    await upstream.arrived.wait()
    copy = asyncio.create_task(other.post(path, data=body, headers=headers(body, "e-1")))
    await wait_for_lock_waiters(pg_dsn, table, 1)
    upstream.gate.set()
    answers = [await first, await copy]

    assert [a.headers.get("Dedup-Status") for a in answers] == [None, "duplicate"]
    assert len(upstream.requests) == 1


async def test_verify_removed_then_given_back_opens_the_window_again(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """The claims made while the route had no ``verify`` are in the other form: the start
    that gives it back opens a window, so that a retry of such an event is a duplicate."""
    route, path, body, headers, _ = PROVIDERS["github"]
    unsigned = {key: value for key, value in route.items() if key != "verify"}
    bound = await make_proxy(routes=[route])  # a new route: no window
    await bound.post(path, data=body, headers=headers(body, "e-1"))
    removed = await make_proxy(routes=[unsigned])  # verify removed: claims by the ID alone
    await removed.post(path, data=body, headers=headers(body, "e-2"))
    back = await make_proxy(routes=[route])  # verify given back

    retry = await back.post(path, data=body, headers=headers(body, "e-2"))
    fresh = await back.post(path, data=body, headers=headers(body, "e-3"))

    assert retry.headers.get("Dedup-Status") == "duplicate"
    assert (fresh.status, fresh.headers.get("Dedup-Status")) == (200, None)
    assert len(upstream.requests) == 3  # e-1, e-2 and e-3, once each
    forms = await fetch(
        pg_dsn,
        f"""SELECT event_type, received_at > '-infinity' AS window FROM "{table}"
            WHERE scope = '~id-forms'""",
    )
    assert [(row["event_type"], row["window"]) for row in forms] == [("bound", True)]


async def test_verify_given_back_with_no_claim_made_meanwhile_opens_no_window(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    """Only claims made in the other form need one: the window weakens what binding guards."""
    route, path, body, headers, _ = PROVIDERS["github"]
    unsigned = {key: value for key, value in route.items() if key != "verify"}
    bound = await make_proxy(routes=[route])
    await bound.post(path, data=body, headers=headers(body, "e-1"))
    await make_proxy(routes=[unsigned])
    back = await make_proxy(routes=[route])
    await back.post(path, data=body, headers=headers(body, "e-2"))

    rows = await fetch(pg_dsn, f"""SELECT event_id FROM "{table}" WHERE scope = 'github'""")
    digest = hashlib.sha256(body).digest()
    assert sorted(row["event_id"] for row in rows) == sorted(
        [webhooks.bound("1:e-1", "", digest), webhooks.bound("1:e-2", "", digest)]
    )
