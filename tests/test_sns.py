"""AWS SNS: the ``sns`` scheme against a stand-in of SNS's certificate host, and the ``sns``
preset through the proxy.

The stand-in serves, over TLS on 127.0.0.1, a certificate whose key signs the messages here, as
SNS's ``SigningCertURL`` serves its leaf alone; the canonical string is cross-checked against
the ``aws-sns-message-validator`` package (a third party's: AWS publishes no Python validator),
which also verifies (SignatureVersion 1, the one it knows) what the proxy accepted; and AWS's own
JavaScript validator (``sns-validator``, ``aws/aws-js-sns-message-validator``, run by node)
accepts what the proxy accepts and refuses what it refuses, for SignatureVersion 1 and 2, its
certificate fetched from the same stand-in. The allow-list of AWS's hosts is replaced
(``cert_hosts``) by the stand-in's, as only tests do.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from multidict import CIMultiDict

from proxy import errors, signatures
from tests.helpers import FakeUpstream, MakeProxy, claimed, npm_install

TOPIC = "arn:aws:sns:us-west-2:123456789012:MyTopic"
CERT_PATH = "/SimpleNotificationService-f3ecfb7224c7233fe7bb5f59f96de52f.pem"


class Host:
    """The stand-in certificate host: what it serves, and how often each path was asked."""

    def __init__(self) -> None:
        issued = trustme.CA(key_type=trustme.KeyType.RSA).issue_cert(
            "sns.amazonaws.com", key_type=trustme.KeyType.RSA
        )
        self.key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), None)
        self.pem = issued.cert_chain_pems[0].bytes()  # the leaf alone, as SNS serves it
        self.hits: Counter[str] = Counter()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        if request.path == "/redirect":
            return web.Response(status=302, headers={"Location": CERT_PATH})
        if request.path == "/" and request.query.get("Action") == "ConfirmSubscription":
            return web.Response(text="<ConfirmSubscriptionResponse/>")
        if request.path != CERT_PATH:
            return web.Response(status=404)
        return web.Response(body=self.pem)

    def sign(self, text: bytes, version: str) -> str:
        assert isinstance(self.key, rsa.RSAPrivateKey)
        digest: hashes.HashAlgorithm = hashes.SHA1() if version == "1" else hashes.SHA256()
        return base64.b64encode(self.key.sign(text, padding.PKCS1v15(), digest)).decode()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Any) -> str:
    """The CA bundle the proxy checks the stand-in's TLS against."""
    path = tmp_path / "ca.pem"
    path.write_bytes(ca.cert_pem.bytes())
    return str(path)


@pytest.fixture
async def host(server_tls: Any, aiohttp_server: Any) -> Host:
    stand_in = Host()
    application = web.Application()
    application.router.add_route("GET", "/{tail:.*}", stand_in.handle)
    server = await aiohttp_server(application, ssl=server_tls)
    stand_in.url = f"https://127.0.0.1:{server.port}"
    return stand_in


def canonical(message: dict[str, str]) -> bytes:
    """What AWS signs, written out from its "verifying the signatures" page."""
    if message["Type"] == "Notification":
        names = ["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"]
    else:
        names = ["Message", "MessageId", "SubscribeURL", "Timestamp", "Token", "TopicArn", "Type"]
    return "".join(f"{n}\n{message[n]}\n" for n in names if n in message).encode()


def message(
    host: Host,
    kind: str = "Notification",
    *,
    version: str = "1",
    at: datetime | None = None,
    url: str | None = None,
    **fields: str,
) -> dict[str, str]:
    """An SNS message as AWS posts it, signed by the stand-in's key."""
    sent = {
        "Type": kind,
        "MessageId": "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324",
        "TopicArn": TOPIC,
        "Message": '{"order": 42, "state": "paid"}',
        "Timestamp": (at or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
        "SignatureVersion": version,
        "SigningCertURL": url or host.url + CERT_PATH,
    }
    if kind == "Notification":
        sent |= {"Subject": "Order paid", "UnsubscribeURL": host.url + "/?Action=Unsubscribe"}
    else:
        sent |= {
            "Token": "2336412f37fb687f5d51e6e2425dacbba7c6f0ba1e9e1d6f",
            "SubscribeURL": host.url + f"/?Action=ConfirmSubscription&TopicArn={TOPIC}",
        }
    sent |= fields
    sent["Signature"] = host.sign(canonical(sent), version)
    return sent


def sns(host: Host, ca_file: str, *topics: str, **options: Any) -> signatures.Verifier:
    options.setdefault("cert_hosts", [host.url.removeprefix("https://")])
    return signatures.build("sns", list(topics or (TOPIC,)), ca_file=ca_file, **options)


async def check(
    verifier: signatures.Verifier, sent: dict[str, str], headers: dict[str, str] | None = None
) -> None:
    body = json.dumps(sent).encode()
    multi = CIMultiDict(headers or {})
    await signatures.prepare(verifier, multi, body)
    verifier.verify(multi, body, datetime.now(UTC).timestamp())


async def refused(
    verifier: signatures.Verifier, sent: dict[str, str], headers: dict[str, str] | None = None
) -> str:
    with pytest.raises(errors.SignatureInvalid) as info:
        await check(verifier, sent, headers)
    return info.value.message


def validator() -> Any:
    """The third party's validator, its certificate fetch answered with the stand-in's PEM."""
    module = importlib.import_module("sns_message_validator")
    return module.SNSMessageValidator(cert_url_regex=r"^https://127\.0\.0\.1:")


@pytest.mark.parametrize("kind", ["Notification", "SubscriptionConfirmation",
                                  "UnsubscribeConfirmation"])  # fmt: skip
@pytest.mark.parametrize("version", ["1", "2"])
async def test_a_signed_message_is_accepted_and_its_certificate_fetched_once(
    host: Host, ca_file: str, kind: str, version: str
) -> None:
    verifier = sns(host, ca_file)
    sent = message(host, kind, version=version)

    await check(verifier, sent)
    await check(verifier, sent, {"x-amz-sns-message-type": kind})

    assert host.hits == Counter({CERT_PATH: 1})
    # The string signed is the one the third party's validator builds.
    assert validator()._get_plaintext_to_sign(sent).encode() == canonical(sent)


async def test_what_the_validator_accepts_we_accept_and_the_other_way(
    host: Host, ca_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = validator()
    monkeypatch.setattr(
        checker._cert_session, "get", lambda url: type("R", (), {"content": host.pem})
    )
    errors_module = importlib.import_module("sns_message_validator")
    verifier = sns(host, ca_file)
    without_subject = message(host)
    del without_subject["Subject"]
    without_subject["Signature"] = host.sign(canonical(without_subject), "1")

    for sent in (message(host), without_subject, message(host, "SubscriptionConfirmation")):
        checker.validate_message(sent)
        await check(verifier, sent)
    swapped = {**message(host), "Message": "{}"}
    with pytest.raises(errors_module.SignatureVerificationFailureException):
        checker.validate_message(swapped)
    assert await refused(verifier, swapped) == "no signature matches"


@pytest.mark.parametrize(
    "field", ["Message", "MessageId", "Subject", "Timestamp", "TopicArn", "Type"]
)
async def test_a_changed_signed_field_is_refused(host: Host, ca_file: str, field: str) -> None:
    sent = message(host)
    changed = {"Timestamp": sent["Timestamp"].replace(".", ".9"),
               "Type": "UnsubscribeConfirmation"}.get(field, sent[field] + "x")  # fmt: skip
    reason = await refused(sns(host, ca_file, TOPIC, TOPIC + "x"), {**sent, field: changed})
    assert reason in ("no signature matches", "SubscribeURL missing or not a string")


async def test_a_version_1_signature_does_not_pass_as_version_2(host: Host, ca_file: str) -> None:
    sent = message(host, version="1")
    assert await refused(sns(host, ca_file), {**sent, "SignatureVersion": "2"}) == (
        "no signature matches"
    )
    assert await refused(sns(host, ca_file), {**sent, "SignatureVersion": "3"}) == (
        "SignatureVersion is neither 1 nor 2"
    )


async def test_another_topics_message_is_refused_though_aws_signed_it(
    host: Host, ca_file: str
) -> None:
    sent = message(host, TopicArn="arn:aws:sns:us-west-2:999999999999:Theirs")
    assert await refused(sns(host, ca_file), sent) == (
        "TopicArn is none of the route's topics (verify.secrets)"
    )


async def test_a_stale_message_is_refused_after_the_signature_matched(
    host: Host, ca_file: str
) -> None:
    sent = message(host, at=datetime.now(UTC) - timedelta(days=2))
    assert await refused(sns(host, ca_file, tolerance=86400), sent) == (
        "Timestamp outside tolerance of 86400s"
    )


async def test_unsigned_headers_must_say_what_is_signed(host: Host, ca_file: str) -> None:
    verifier, sent = sns(host, ca_file), message(host)
    reasons = [
        await refused(verifier, sent, {"x-amz-sns-message-type": "SubscriptionConfirmation"}),
        await refused(verifier, sent, {"x-amz-sns-message-id": "another"}),
    ]
    assert reasons == [
        "x-amz-sns-message-type does not match the signed Type",
        "x-amz-sns-message-id does not match the signed MessageId",
    ]


async def test_a_body_with_a_key_twice_is_refused(host: Host, ca_file: str) -> None:
    sent = message(host)
    body = json.dumps(sent).replace('"Message":', '"Message": "{}", "Message":', 1).encode()
    verifier = sns(host, ca_file)
    await signatures.prepare(verifier, CIMultiDict(), body)
    with pytest.raises(errors.SignatureInvalid, match="not an SNS message"):
        verifier.verify(CIMultiDict(), body, datetime.now(UTC).timestamp())


async def test_a_certificate_url_off_the_allow_list_is_never_fetched(
    host: Host, ca_file: str
) -> None:
    where = host.url.removeprefix("https://")
    urls = [
        f"http://{where}{CERT_PATH}",
        f"https://user@{where}{CERT_PATH}",
        f"https://localhost:{host.url.rsplit(':', 1)[1]}{CERT_PATH}",
        "https://169.254.169.254/latest/meta-data/",
    ]
    verifier = sns(host, ca_file)
    reasons = {await refused(verifier, message(host, url=url)) for url in urls}

    assert reasons == {"SigningCertURL is not an https URL on an allowed host (verify.cert_hosts)"}
    assert host.hits.total() == 0
    assert await refused(verifier, message(host, url=host.url + "/redirect")) == (
        "SigningCertURL answered 302, not 200"
    )


def test_sns_hosts_are_the_default_allow_list(ca_file: str) -> None:
    verifier = signatures.build("sns", [TOPIC], ca_file=ca_file)
    assert isinstance(verifier, signatures.SnsSignature)
    refusal = verifier.certificates.refusal

    for url in (
        "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-1.pem",
        "https://sns.cn-north-1.amazonaws.com.cn/SimpleNotificationService-1.pem",
    ):
        assert refusal(url) is None
    for url in (
        "https://sns.us-east-1.amazonaws.com.evil.example/SimpleNotificationService-1.pem",
        "https://evil.example/sns.us-east-1.amazonaws.com/x.pem",
        "https://sns.us-east-1.amazonaws.com:8443/SimpleNotificationService-1.pem",
        "https://s3.amazonaws.com/sns.us-east-1.amazonaws.com.pem",
        "https://x.sns.us-east-1.amazonaws.com/SimpleNotificationService-1.pem",
        "http://sns.us-east-1.amazonaws.com/SimpleNotificationService-1.pem",
    ):
        assert refusal(url) is not None


async def test_an_unreachable_certificate_host_is_the_proxys_503_not_the_senders_401(
    ca_file: str,
) -> None:
    verifier = signatures.build("sns", [TOPIC], ca_file=ca_file, cert_hosts=["127.0.0.1:9"])
    body = json.dumps({"SigningCertURL": "https://127.0.0.1:9" + CERT_PATH}).encode()
    with pytest.raises(errors.CertificateUnavailable):
        await signatures.prepare(verifier, CIMultiDict(), body)


# --- through the proxy --------------------------------------------------------------------------


async def test_sns_preset_forwards_a_signed_message_once_and_refuses_forgeries_unclaimed(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    host: Host,
    ca_file: str,
    pg_dsn: str,
    table: str,
) -> None:
    where = host.url.removeprefix("https://")
    verify = {"secret": TOPIC, "cert_hosts": [where], "ca_file": ca_file}
    route = {"name": "sns", "path": "/sns", "preset": "sns", "verify": verify}
    client = await make_proxy(routes=[route])
    sent = message(host, version="2")
    body = json.dumps(sent).encode()
    headers = {
        "Content-Type": "text/plain; charset=UTF-8",
        "x-amz-sns-message-type": "Notification",
    }

    for forged in (
        {**sent, "Message": '{"order": 42, "state": "refunded"}'},  # body-swapped
        message(host, version="2", at=datetime.now(UTC) - timedelta(days=2)),  # stale
        {**sent, "Signature": message(host, MessageId="other")["Signature"]},  # forged
        message(host, version="2", TopicArn="arn:aws:sns:us-west-2:999999999999:Theirs"),
    ):
        answer = await client.post("/sns", data=json.dumps(forged).encode(), headers=headers)
        assert answer.status == 401
    assert await claimed(pg_dsn, table) == []

    first = await client.post("/sns", data=body, headers=headers)
    again = await client.post("/sns", data=body, headers=headers)
    assert (first.status, again.status) == (200, 200)
    assert again.headers["Dedup-Status"] == "duplicate"
    # A subscription confirmation is claimed and forwarded: the app confirms it.
    confirmation = json.dumps(message(host, "SubscriptionConfirmation", MessageId="c-1")).encode()
    assert (await client.post("/sns", data=confirmation)).status == 200

    assert upstream.bodies() == [body, confirmation]
    assert sorted(await claimed(pg_dsn, table)) == [
        ("sns", "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324", "Notification"),
        ("sns", "c-1", "SubscriptionConfirmation"),
    ]
    assert host.hits == Counter({CERT_PATH: 1})


async def test_with_confirm_subscription_the_proxy_confirms_a_verified_subscription_itself(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    host: Host,
    ca_file: str,
    pg_dsn: str,
    table: str,
) -> None:
    where = host.url.removeprefix("https://")
    verify = {"secret": TOPIC, "cert_hosts": [where], "ca_file": ca_file,
              "confirm_subscription": True}  # fmt: skip
    client = await make_proxy(routes=[{"name": "sns", "path": "/sns", "preset": "sns",
                                       "verify": verify}])  # fmt: skip
    confirmation = message(host, "SubscriptionConfirmation")

    refused_ones = [
        {**confirmation, "Token": "another"},  # forged
        message(host, "SubscriptionConfirmation", TopicArn=TOPIC + "-theirs"),
        message(host, "SubscriptionConfirmation", SubscribeURL="https://169.254.169.254/x"),
    ]
    statuses = [
        (await client.post("/sns", data=json.dumps(sent).encode())).status for sent in refused_ones
    ]
    answer = await client.post("/sns", data=json.dumps(confirmation).encode())
    failing = message(
        host, "SubscriptionConfirmation", MessageId="c-2", SubscribeURL=host.url + "/gone"
    )
    unreachable = await client.post("/sns", data=json.dumps(failing).encode())
    notified = await client.post("/sns", data=json.dumps(message(host)).encode())

    assert statuses == [401, 401, 401]
    assert (answer.status, await answer.text()) == (200, "subscription confirmed")
    assert answer.headers["Dedup-Status"] == "handshake"
    # AWS answered 404: the proxy's 503, so that SNS sends the confirmation again.
    assert unreachable.status == 503
    assert notified.status == 200
    assert host.hits == Counter({CERT_PATH: 1, "/": 1, "/gone": 1})
    assert [json.loads(body)["Type"] for body in upstream.bodies()] == ["Notification"]
    assert await claimed(pg_dsn, table) == [
        ("sns", "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324", "Notification")
    ]


def test_confirm_subscription_is_for_sns_only() -> None:
    with pytest.raises(ValueError, match="confirm_subscription: only for scheme sns, not stripe"):
        signatures.build("stripe", ["whsec_x"], confirm_subscription=True)


# AWS's own validator (npm ``sns-validator``): the message in a file, its answer printed; the
# certificate host held to the stand-in's (its ``hostPattern``), trusted through the test CA.
AWS_VALIDATOR = """
import { readFileSync } from "node:fs";
import MessageValidator from "sns-validator";
const validator = new MessageValidator(/^127\\.0\\.0\\.1:\\d+$/);
validator.validate(JSON.parse(readFileSync(process.argv[2], "utf8")), (error) =>
  console.log(error ? `false ${error.message}` : "true"));
"""


@pytest.fixture(scope="module")
def aws_validator(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("sns-validator")
    npm_install(where, "sns-validator@0.3")
    script = where / "validate.mjs"
    script.write_text(AWS_VALIDATOR)
    return script


async def aws_says(script: Path, ca_file: str, sent: dict[str, str]) -> str:
    """What AWS's validator says of ``sent``: a process of its own, awaited (not run blocking:
    it fetches the certificate from the stand-in, which answers in this test's loop)."""
    body = script.parent / f"message-{len(os.listdir(script.parent))}.json"
    body.write_text(json.dumps(sent))
    process = await asyncio.create_subprocess_exec(
        "node", str(script), str(body), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "NODE_EXTRA_CA_CERTS": ca_file},
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    return out.decode().strip()


@pytest.mark.parametrize("version", ["1", "2"])
async def test_awss_own_validator_accepts_what_we_accept_and_refuses_what_we_refuse(
    host: Host, ca_file: str, aws_validator: Path, version: str
) -> None:
    verifier = sns(host, ca_file)
    sent = message(host, version=version)
    swapped = {**sent, "Message": '{"order": 42, "state": "refunded"}'}
    downgraded = {**sent, "SignatureVersion": "1" if version == "2" else "2"}

    await check(verifier, sent)
    assert await aws_says(aws_validator, ca_file, sent) == "true"
    for forged in (swapped, downgraded):
        assert await refused(verifier, forged)
        assert (await aws_says(aws_validator, ca_file, forged)).startswith("false")
