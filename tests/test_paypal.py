"""PayPal: the ``paypal`` scheme against a stand-in of PayPal's certificate host, and through the
proxy (with the ``square`` preset beside it).

The stand-in serves, over TLS on 127.0.0.1, a signing certificate issued for
``messageverificationcerts.paypal.com`` by a test CA (through an intermediate, as PayPal's is);
requests are signed with its key over the string PayPal's SDKs build. No PayPal library is a
test dependency: ``paypalrestsdk`` is deprecated and pins ``cryptography<51`` through pyOpenSSL
(docs/providers.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import sys
import zlib
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from multidict import CIMultiDict

import proxy
from proxy import certificates, errors, signatures
from tests.helpers import FakeUpstream, MakeProxy, claimed

WEBHOOK_ID = "1JE4291016473214C"
OTHER_WEBHOOK = "8PT597110X687430LKGECATA"
BODY = b'{"id":"WH-58D329510W468432D-8HN650336L201105X","event_type":"PAYMENT.CAPTURE.COMPLETED"}'
TIME = "2024-05-01T12:00:00Z"
SENT = datetime(2024, 5, 1, 12, 0, 0, tzinfo=UTC).timestamp()  # TIME
NOW = SENT + 30
CERT_PATH = "/v1/notifications/certs/CERT-360caa42-fca2a594-a5cafa77"


class Host:
    """The stand-in certificate host: what it serves, and how often each path was asked."""

    def __init__(self) -> None:
        rsa_key = trustme.KeyType.RSA
        self.ca = trustme.CA(key_type=rsa_key)  # trusted by ca_file, beside the TLS server's
        intermediate = self.ca.create_child_ca(key_type=rsa_key)
        self.signer = intermediate.issue_cert(
            "messageverificationcerts.paypal.com", key_type=rsa_key
        )
        chain = b"".join(blob.bytes() for blob in self.signer.cert_chain_pems)
        stranger = trustme.CA(key_type=rsa_key).issue_cert(
            "messageverificationcerts.paypal.com", key_type=rsa_key
        )
        elsewhere = self.ca.issue_cert("messageverificationcerts.example.com", key_type=rsa_key)
        self.served: dict[str, tuple[int, bytes, dict[str, str]]] = {
            CERT_PATH: (200, chain, {}),
            "/redirect": (302, b"", {"Location": CERT_PATH}),
            "/huge": (200, chain + b"\n" * (certificates.MAX_SIZE + 1), {}),
            "/other-ca": (200, stranger.cert_chain_pems[0].bytes(), {}),
            "/not-paypal": (200, elsewhere.cert_chain_pems[0].bytes(), {}),
            "/missing": (404, b"", {}),
            "/text": (200, b"hello", {}),
        }
        self.hits: Counter[str] = Counter()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.hits[request.path] += 1
        status, body, headers = self.served.get(request.path, (404, b"", {}))
        return web.Response(status=status, body=body, headers=headers)

    def key(self) -> rsa.RSAPrivateKey:
        key = serialization.load_pem_private_key(self.signer.private_key_pem.bytes(), None)
        assert isinstance(key, rsa.RSAPrivateKey)
        return key


@pytest.fixture
def ca_file(ca: trustme.CA, host: Host, tmp_path: Path) -> str:
    """The CA bundle: the TLS server's CA and the signing certificate's root."""
    path = tmp_path / "ca.pem"
    path.write_bytes(ca.cert_pem.bytes() + host.ca.cert_pem.bytes())
    return str(path)


@pytest.fixture
async def host(server_tls: Any, aiohttp_server: Any) -> Host:
    stand_in = Host()
    application = web.Application()
    application.router.add_route("GET", "/{tail:.*}", stand_in.handle)
    server = await aiohttp_server(application, ssl=server_tls)
    stand_in.url = f"https://127.0.0.1:{server.port}"
    return stand_in


def netloc(host: Host) -> str:
    return host.url.removeprefix("https://")


def paypal(host: Host, ca_file: str, *webhook_ids: str, **options: Any) -> signatures.Verifier:
    options.setdefault("cert_hosts", [netloc(host)])
    return signatures.build(
        "paypal", list(webhook_ids or (WEBHOOK_ID,)), ca_file=ca_file, **options
    )


def signed(
    host: Host,
    body: bytes = BODY,
    *,
    transmission: str = "b2384410-07c8-11ef-8fd2-9d5ee6b4a9b4",
    at: str = TIME,
    webhook_id: str = WEBHOOK_ID,
    url: str | None = None,
    algorithm: str = "SHA256withRSA",
) -> CIMultiDict[str]:
    """The headers PayPal sends: its SDKs' string, signed with the certificate's key."""
    message = f"{transmission}|{at}|{webhook_id}|{zlib.crc32(body)}".encode()
    signature = host.key().sign(message, padding.PKCS1v15(), hashes.SHA256())
    return CIMultiDict(
        {
            "PAYPAL-TRANSMISSION-ID": transmission,
            "PAYPAL-TRANSMISSION-TIME": at,
            "PAYPAL-TRANSMISSION-SIG": base64.b64encode(signature).decode(),
            "PAYPAL-CERT-URL": url or host.url + CERT_PATH,
            "PAYPAL-AUTH-ALGO": algorithm,
        }
    )


async def check(
    verifier: signatures.Verifier, headers: CIMultiDict[str], body: bytes = BODY, now: float = NOW
) -> None:
    await signatures.prepare(verifier, headers, body)
    verifier.verify(headers, body, now)


async def refused(
    verifier: signatures.Verifier, headers: CIMultiDict[str], body: bytes = BODY, now: float = NOW
) -> str:
    with pytest.raises(errors.SignatureInvalid) as info:
        await check(verifier, headers, body, now)
    assert (info.value.status, info.value.code) == (401, "signature_invalid")
    return info.value.message


async def test_a_signed_request_is_accepted_and_its_certificate_fetched_once(
    host: Host, ca_file: str
) -> None:
    verifier = paypal(host, ca_file)

    await check(verifier, signed(host))
    await check(verifier, signed(host, transmission="another-transmission"))

    assert host.hits == Counter({CERT_PATH: 1})


async def test_any_configured_webhook_id_verifies(host: Host, ca_file: str) -> None:
    verifier = paypal(host, ca_file, OTHER_WEBHOOK, WEBHOOK_ID)

    await check(verifier, signed(host))
    assert await refused(verifier, signed(host, webhook_id="5GP028458E2496506")) == (
        "no signature matches"
    )


@pytest.mark.parametrize(
    "tamper",
    ["body", "PAYPAL-TRANSMISSION-ID", "PAYPAL-TRANSMISSION-TIME", "signature"],
)
async def test_a_tampered_request_is_refused(host: Host, ca_file: str, tamper: str) -> None:
    headers, body = signed(host), BODY
    if tamper == "body":
        body = BODY.replace(b"COMPLETED", b"COMPLETEd")
    elif tamper == "signature":
        headers["PAYPAL-TRANSMISSION-SIG"] = signed(host, BODY + b" ")["PAYPAL-TRANSMISSION-SIG"]
    elif tamper == "PAYPAL-TRANSMISSION-TIME":
        headers[tamper] = "2024-05-01T12:00:01Z"
    else:
        headers[tamper] = "b2384410-07c8-11ef-8fd2-000000000000"

    assert await refused(paypal(host, ca_file), headers, body) == "no signature matches"


async def test_a_stale_transmission_is_refused_after_the_signature_matched(
    host: Host, ca_file: str
) -> None:
    verifier = paypal(host, ca_file)

    await check(verifier, signed(host), now=SENT + 300)
    await check(verifier, signed(host), now=SENT - 300)
    reason = await refused(verifier, signed(host), now=SENT + 301)
    assert reason == "PAYPAL-TRANSMISSION-TIME outside tolerance of 300s"
    assert await refused(verifier, signed(host, BODY + b" "), now=SENT + 301) == (
        "no signature matches"
    )


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("PAYPAL-AUTH-ALGO", "SHA1withRSA", "PAYPAL-AUTH-ALGO is not SHA256withRSA"),
        ("PAYPAL-TRANSMISSION-SIG", "not base64!", "PAYPAL-TRANSMISSION-SIG malformed"),
        (
            "PAYPAL-TRANSMISSION-TIME",
            "2024-05-01T12:00:00",
            "PAYPAL-TRANSMISSION-TIME is not an ISO 8601 time with an offset",
        ),
        (
            "PAYPAL-TRANSMISSION-TIME",
            "yesterday",
            "PAYPAL-TRANSMISSION-TIME is not an ISO 8601 time with an offset",
        ),
    ],
)
async def test_a_malformed_header_is_refused(
    host: Host, ca_file: str, name: str, value: str, reason: str
) -> None:
    headers = signed(host)
    headers[name] = value
    assert await refused(paypal(host, ca_file), headers) == reason


HEADERS = ["PAYPAL-TRANSMISSION-ID", "PAYPAL-TRANSMISSION-TIME", "PAYPAL-TRANSMISSION-SIG",
           "PAYPAL-CERT-URL", "PAYPAL-AUTH-ALGO"]  # fmt: skip


@pytest.mark.parametrize("name", HEADERS)
async def test_a_missing_header_is_refused(host: Host, ca_file: str, name: str) -> None:
    headers = signed(host)
    del headers[name]
    assert await refused(paypal(host, ca_file), headers) == f"{name} missing"
    assert host.hits.total() <= 1


async def test_a_certificate_url_off_the_allow_list_is_never_fetched(
    host: Host, ca_file: str, aiohttp_server: Any, server_tls: Any
) -> None:
    other = Host()
    application = web.Application()
    application.router.add_route("GET", "/{tail:.*}", other.handle)
    server = await aiohttp_server(application, ssl=server_tls)
    where = netloc(host)
    urls = [
        f"https://127.0.0.1:{server.port}{CERT_PATH}",  # another port of the same host
        f"http://{where}{CERT_PATH}",  # not https
        f"https://user@{where}{CERT_PATH}",
        f"https://{where}{CERT_PATH}#fragment",
        f"https://localhost:{host.url.rsplit(':', 1)[1]}{CERT_PATH}",  # another name
    ]
    verifier = paypal(host, ca_file)
    reasons = {await refused(verifier, signed(host, url=url)) for url in urls}

    assert reasons == {"PAYPAL-CERT-URL is not an https URL on an allowed host (verify.cert_hosts)"}
    assert other.hits.total() == 0
    assert host.hits.total() == 0


async def test_paypal_hosts_are_the_default_allow_list(host: Host, ca_file: str) -> None:
    verifier = signatures.build("paypal", [WEBHOOK_ID], ca_file=ca_file)
    assert isinstance(verifier, signatures.PayPalSignature)

    assert verifier.certificates.hosts == frozenset(signatures.PAYPAL_CERT_HOSTS)
    for url in (
        "https://api.paypal.com/v1/notifications/certs/CERT-1",
        "https://api-m.sandbox.paypal.com/v1/notifications/certs/CERT-1",
    ):
        assert verifier.certificates.refusal(url) is None
    for url in (
        host.url + CERT_PATH,
        "https://api.paypal.com.evil.example/v1/notifications/certs/CERT-1",
        "https://evil.example/api.paypal.com/v1/notifications/certs/CERT-1",
        "https://api.paypal.com:8443/v1/notifications/certs/CERT-1",
        "https://169.254.169.254/latest/meta-data/",
    ):
        assert verifier.certificates.refusal(url) is not None
    assert await refused(verifier, signed(host)) == (
        "PAYPAL-CERT-URL is not an https URL on an allowed host (verify.cert_hosts)"
    )
    assert host.hits.total() == 0


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/redirect", "PAYPAL-CERT-URL answered 302, not 200"),
        ("/missing", "PAYPAL-CERT-URL answered 404, not 200"),
        ("/huge", f"PAYPAL-CERT-URL's answer is over {certificates.MAX_SIZE} bytes"),
        ("/text", "PAYPAL-CERT-URL served no PEM certificate"),
        ("/other-ca", "PAYPAL-CERT-URL's certificate does not chain to a trusted CA"),
        ("/not-paypal", "PAYPAL-CERT-URL's certificate does not name paypal.com"),
    ],
)
async def test_a_certificate_url_that_serves_no_trusted_paypal_certificate_is_refused(
    host: Host, ca_file: str, path: str, reason: str
) -> None:
    verifier = paypal(host, ca_file)
    headers = signed(host, url=host.url + path)

    assert await refused(verifier, headers) == reason
    assert await refused(verifier, headers) == reason  # from the cache
    assert host.hits == Counter({path: 1})  # the redirect is not followed


async def test_an_unreachable_certificate_host_is_the_proxys_503_not_the_senders_401(
    host: Host, ca_file: str, unused_tcp_port: int
) -> None:
    verifier = paypal(host, ca_file, cert_hosts=[f"127.0.0.1:{unused_tcp_port}"])
    headers = signed(host, url=f"https://127.0.0.1:{unused_tcp_port}{CERT_PATH}")

    with pytest.raises(errors.CertificateUnavailable) as info:
        await check(verifier, headers)
    assert (info.value.status, info.value.outcome) == (503, "unavailable")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cert_hosts": ["api.paypal.com/x"]}, "cert_hosts[0] must be a host name or host:port"),
        ({"cert_hosts": []}, "cert_hosts must be a non-empty list of host or host:port"),
        ({"ca_file": "/nonexistent/ca.pem"}, "ca_file: cannot read /nonexistent/ca.pem"),
    ],
)
def test_bad_paypal_settings_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        signatures.build("paypal", [WEBHOOK_ID], **options)


def test_without_cryptography_a_paypal_route_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As where cryptography is not installed: proxy.certificates cannot be imported.
    monkeypatch.setitem(sys.modules, "proxy.certificates", None)
    monkeypatch.delattr(proxy, "certificates")
    with pytest.raises(ValueError, match=r"install webhook-dedup-proxy\[paypal\]"):
        signatures.build("paypal", [WEBHOOK_ID])


# --- through the proxy --------------------------------------------------------------------------


async def test_paypal_preset_forwards_a_signed_event_once_and_refuses_forgeries_unclaimed(
    make_proxy: MakeProxy,
    upstream: FakeUpstream,
    host: Host,
    ca_file: str,
    pg_dsn: str,
    table: str,
) -> None:
    verify = {"secret": WEBHOOK_ID, "cert_hosts": [netloc(host)], "ca_file": ca_file}
    route = {"name": "paypal", "path": "/paypal", "preset": "paypal", "verify": verify}
    client = await make_proxy(routes=[route])
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    forged = BODY.replace(b"WH-58D", b"WH-99D")

    first = await client.post("/paypal", data=BODY, headers=signed(host, at=now))
    again = await client.post("/paypal", data=BODY, headers=signed(host, at=now))
    swapped = await client.post("/paypal", data=forged, headers=signed(host, at=now))
    stale = await client.post("/paypal", data=forged, headers=signed(host, forged, at=TIME))
    elsewhere = await client.post(
        "/paypal", data=forged, headers=signed(host, forged, at=now, url="https://10.0.0.1/c")
    )

    assert (first.status, again.status) == (200, 200)
    assert again.headers["Dedup-Status"] == "duplicate"
    assert [swapped.status, stale.status, elsewhere.status] == [401, 401, 401]
    assert upstream.bodies() == [BODY]
    event = ("paypal", "WH-58D329510W468432D-8HN650336L201105X", "PAYMENT.CAPTURE.COMPLETED")
    assert await claimed(pg_dsn, table) == [event]
    assert host.hits == Counter({CERT_PATH: 1})


async def test_square_preset_verifies_the_notification_url_and_body(
    make_proxy: MakeProxy, upstream: FakeUpstream, pg_dsn: str, table: str
) -> None:
    key, public = "Ibxx_5AKakO-3qeNVR61Dw", "https://hooks.example.com/square"
    route = {
        "name": "square",
        "path": "/square",
        "preset": "square",
        "verify": {"secret": key, "public_url": public},
    }
    client = await make_proxy(routes=[route])
    body = b'{"event_id":"ac3ac95b","type":"payment.updated"}'
    forged = body.replace(b"ac3ac95b", b"ac3ac95c")

    def headers(url: str, signed_body: bytes) -> dict[str, str]:
        mac = hmac.new(key.encode(), url.encode() + signed_body, hashlib.sha256).digest()
        return {"x-square-hmacsha256-signature": base64.b64encode(mac).decode()}

    first = await client.post("/square", data=body, headers=headers(public, body))
    again = await client.post("/square", data=body, headers=headers(public, body))
    swapped = await client.post("/square", data=forged, headers=headers(public, body))
    other_url = await client.post(
        "/square", data=forged, headers=headers("https://evil.example/square", forged)
    )

    assert (first.status, again.status) == (200, 200)
    assert again.headers["Dedup-Status"] == "duplicate"
    assert (swapped.status, other_url.status) == (401, 401)
    assert upstream.bodies() == [body]
    assert await claimed(pg_dsn, table) == [("square", "ac3ac95b", "payment.updated")]
