"""Signing certificates fetched from the URL a request names (PayPal's ``PAYPAL-CERT-URL``, AWS
SNS's ``SigningCertURL``), and the one other GET such a host is sent (SNS's ``SubscribeURL``,
where the proxy confirms a subscription).

A URL is fetched only if it is https on an allowed host (and port; SNS's: a host pattern),
never following a redirect, read up to ``MAX_SIZE`` within ``timeout`` seconds; the
certificate's chain is checked against a CA bundle and its name against the provider's domain
(PayPal's; SNS serves the leaf alone, so there the TLS-checked fetch from an AWS host is the
trust, as in AWS's own validators); the outcome, a certificate or
the reason there is none, is cached by URL (``MAX_CACHED`` URLs), so a sender cannot make the
proxy fetch one URL again and again. aiohttp's client errors and timeouts are translated here,
into CertificateUnavailable (503: the proxy could not reach the provider); what is wrong with
what was fetched, or with the URL, is the reason a request is refused (401). Needs the
``cryptography`` package (extra ``paypal`` or ``sns``): ``signatures`` imports this module only
for a route that verifies with a certificate.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import re
import ssl
import time
import urllib.parse
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import aiohttp
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509 import verification

from proxy import errors

MAX_SIZE = 64 * 1024  # a certificate and its intermediates are a few KiB
MAX_CACHED = 64
MAX_FETCHES = 4  # at once, all URLs together
DEFAULT_TIMEOUT = 5.0
REFUSED_FOR = 60.0  # a URL that served no usable certificate is not fetched again before
KEPT_FOR = 86400.0  # a good certificate is fetched again a day later, or once it expires
_MAX_URL = 2048
_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]{1,5})?")


def check_host(entry: str) -> str:
    """An allow-list entry, ``host`` (port 443) or ``host:port``, lower-cased; ValueError."""
    host = entry.lower()
    if not _HOST.fullmatch(host) or ".." in host:
        raise ValueError(f"must be a host name or host:port, got {entry!r}")
    return host


def load_roots(path: str) -> tuple[x509.Certificate, ...]:
    """The CA certificates of a PEM bundle; ValueError if it holds none."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    roots = []
    for block in _PEM.findall(data):
        # A system bundle may hold a root cryptography only warns about (a negative serial):
        # it is skipped or kept, never a start-up failure.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                roots.append(x509.load_pem_x509_certificate(block))
            except ValueError:
                continue
    if not roots:
        raise ValueError(f"{path} holds no PEM certificate")
    return tuple(roots)


def default_ca_file() -> str:
    """The system's CA bundle, as OpenSSL finds it."""
    paths = ssl.get_default_verify_paths()
    return paths.cafile or paths.openssl_cafile


@dataclass(frozen=True, slots=True)
class Certificate:
    """A fetched certificate that passed the checks: its RSA key and until when it is used."""

    key: rsa.RSAPublicKey
    until: float

    def verifies(self, signature: bytes, message: bytes, *, sha1: bool = False) -> bool:
        """Whether ``signature`` is this key's RSA PKCS#1 v1.5 SHA-256 (or SHA-1: SNS's
        SignatureVersion 1) signature of ``message``."""
        digest: hashes.HashAlgorithm = hashes.SHA1() if sha1 else hashes.SHA256()
        try:
            self.key.verify(signature, message, padding.PKCS1v15(), digest)
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True, slots=True)
class _Refused:
    reason: str
    until: float


class _Unusable(Exception):
    """What was fetched is no certificate this route trusts (the message says why)."""


class Certificates:
    """One route's certificates by URL: which URLs may be fetched, the fetch, the checks and
    the cache. ``fetch`` (async) fills the cache; ``get`` (sync) reads it, so the signature
    check itself stays a pure function of the request."""

    def __init__(
        self,
        *,
        header: str,
        hosts: Iterable[str],
        roots: tuple[x509.Certificate, ...],
        ca_file: str,
        domain: str | None,
        host_pattern: re.Pattern[str] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self.header = header
        self.hosts = frozenset(hosts)
        # None: the leaf is not chained or named (SNS's); the fetch's TLS is the trust.
        self.domain = domain.lower() if domain is not None else None
        self.host_pattern = host_pattern
        self.timeout = timeout
        self._roots = roots
        self._tls = ssl.create_default_context(cafile=ca_file)
        self._cache: collections.OrderedDict[str, Certificate | _Refused] = (
            collections.OrderedDict()
        )
        self._fetching: dict[str, asyncio.Future[None]] = {}
        self._slots: asyncio.Semaphore | None = None

    def refusal(self, url: str, name: str | None = None) -> str | None:
        """Why ``url`` (in ``name``, default the certificate's header) may not be fetched at all
        (None: it may)."""
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port or 443
        except ValueError:
            port = 0
        host = (parts.hostname or "").lower()
        allowed = host in self.hosts if port == 443 else f"{host}:{port}" in self.hosts
        if port == 443 and self.host_pattern is not None:
            allowed = allowed or self.host_pattern.fullmatch(host) is not None
        if (
            len(url) > _MAX_URL
            or not url.isascii()
            or not url.isprintable()
            or " " in url
            or parts.scheme != "https"
            or not url.startswith("https://")
            or "@" in parts.netloc
            or parts.fragment
            or not allowed
        ):
            return (
                f"{name or self.header} is not an https URL on an allowed host (verify.cert_hosts)"
            )
        return None

    def get(self, url: str, now: float) -> Certificate:
        """The certificate ``fetch`` found at ``url``; SignatureInvalid with the reason if none."""
        if (reason := self.refusal(url)) is not None:
            raise errors.SignatureInvalid(reason)
        found = self._cache.get(url)
        if isinstance(found, _Refused):
            raise errors.SignatureInvalid(found.reason)
        if found is None or found.until < now:
            raise errors.SignatureInvalid(f"{self.header}'s certificate is not fetched")
        return found

    async def fetch(self, url: str) -> None:
        """Fetch and check ``url``'s certificate unless the cache has an answer for it, or the
        URL may not be fetched; one fetch per URL at a time, shared by the requests that wait
        for it. CertificateUnavailable if the host could not be reached."""
        now = time.time()
        found = self._cache.get(url)
        if (found is not None and found.until >= now) or self.refusal(url) is not None:
            if found is not None:
                self._cache.move_to_end(url)
            return
        pending = self._fetching.get(url)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(url))
            self._fetching[url] = pending
            pending.add_done_callback(lambda done: self._done(url, done))
        # Shielded: a request given up on does not cancel the fetch others wait for.
        await asyncio.shield(pending)

    def _done(self, url: str, done: asyncio.Future[None]) -> None:
        self._fetching.pop(url, None)
        if not done.cancelled():
            done.exception()  # retrieved: a fetch no request waits for any more is not logged

    async def _fetch(self, url: str) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_FETCHES)
        try:
            async with asyncio.timeout(self.timeout), self._slots:
                data = await self._download(url)
        except TimeoutError as exc:
            raise errors.CertificateUnavailable(f"{self.header}: no answer in time") from exc
        except _Unusable as exc:
            self._keep(url, _Refused(str(exc), time.time() + REFUSED_FOR))
            return
        try:
            found = self._check(data, time.time())
        except _Unusable as exc:
            self._keep(url, _Refused(str(exc), time.time() + REFUSED_FOR))
            return
        self._keep(url, found)

    def _keep(self, url: str, found: Certificate | _Refused) -> None:
        self._cache[url] = found
        self._cache.move_to_end(url)
        while len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)

    async def confirm(self, url: str, name: str) -> None:
        """GET ``url`` (in ``name``; SNS's ``SubscribeURL``) on an allowed host, as for a
        certificate, and expect a 200: CertificateUnavailable (503, so the provider sends it
        again) if the host cannot be reached in time or answers otherwise."""
        assert self.refusal(url, name) is None  # the caller refused it already
        try:
            async with asyncio.timeout(self.timeout):
                await self._download(url, name)
        except TimeoutError as exc:
            raise errors.CertificateUnavailable(f"{name}: no answer in time") from exc
        except _Unusable as exc:
            raise errors.CertificateUnavailable(str(exc)) from None

    async def _download(self, url: str, name: str | None = None) -> bytes:
        label = name or self.header
        connector = aiohttp.TCPConnector(ssl=self._tls, force_close=True)
        try:
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.get(url, allow_redirects=False) as response,
            ):
                if response.status != 200:
                    raise _Unusable(f"{label} answered {response.status}, not 200")
                if (response.content_length or 0) > MAX_SIZE:
                    raise _Unusable(f"{label}'s answer is over {MAX_SIZE} bytes")
                data = bytearray()
                async for chunk in response.content.iter_chunked(16384):
                    data += chunk
                    if len(data) > MAX_SIZE:
                        raise _Unusable(f"{label}'s answer is over {MAX_SIZE} bytes")
                return bytes(data)
        except aiohttp.ClientError as exc:
            raise errors.CertificateUnavailable(f"{label}: {type(exc).__name__}: {exc}") from exc

    def _check(self, data: bytes, now: float) -> Certificate:
        """The leaf certificate of ``data`` (PEM, the leaf first, then intermediates), if it
        chains to a root of the bundle, names the provider's domain and holds an RSA key."""
        try:
            chain = [x509.load_pem_x509_certificate(block) for block in _PEM.findall(data)]
        except ValueError:
            chain = []
        if not chain:
            raise _Unusable(f"{self.header} served no PEM certificate")
        leaf = chain[0]
        if self.domain is None:
            return _unchained(leaf, self.header, now)
        policy = (
            verification.PolicyBuilder()
            .store(verification.Store(list(self._roots)))
            .time(datetime.datetime.fromtimestamp(now, datetime.UTC))
            # Any key usage: the certificate signs messages, it is not a TLS client's.
            .extension_policies(
                ca_policy=verification.ExtensionPolicy.webpki_defaults_ca(),
                ee_policy=verification.ExtensionPolicy.permit_all(),
            )
        )
        try:
            policy.build_client_verifier().verify(leaf, chain[1:])
        except verification.VerificationError:
            raise _Unusable(f"{self.header}'s certificate does not chain to a trusted CA") from None
        if not any(self._ours(name) for name in _names(leaf)):
            raise _Unusable(f"{self.header}'s certificate does not name {self.domain}")
        key = leaf.public_key()
        if not isinstance(key, rsa.RSAPublicKey):
            raise _Unusable(f"{self.header}'s certificate holds no RSA key")
        return Certificate(key, min(leaf.not_valid_after_utc.timestamp(), now + KEPT_FOR))

    def _ours(self, name: str) -> bool:
        name = name.lower()
        return name == self.domain or name.endswith(f".{self.domain}")


def _unchained(leaf: x509.Certificate, header: str, now: float) -> Certificate:
    """The leaf of a provider that serves no chain (SNS), trusted for where it came from: it
    must be within its validity and hold an RSA key."""
    if not leaf.not_valid_before_utc.timestamp() <= now <= leaf.not_valid_after_utc.timestamp():
        raise _Unusable(f"{header}'s certificate is not valid now")
    key = leaf.public_key()
    if not isinstance(key, rsa.RSAPublicKey):
        raise _Unusable(f"{header}'s certificate holds no RSA key")
    return Certificate(key, min(leaf.not_valid_after_utc.timestamp(), now + KEPT_FOR))


def _names(leaf: x509.Certificate) -> list[str]:
    """The DNS names of the subject alternative names, and the common name."""
    names: list[str] = []
    try:
        extension = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        names.extend(extension.value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        pass
    for attribute in leaf.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME):
        if isinstance(attribute.value, str):
            names.append(attribute.value)
    return names
