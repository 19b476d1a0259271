"""A GitHub App's credential for its own hook's deliveries (``/app/hook/deliveries``): a JSON
Web Token the App signs with its private key (RS256), as GitHub's "Generating a JSON Web Token
(JWT) for a GitHub App" describes it: ``iat`` 60 s in the past (clock drift), ``exp`` at most 10
minutes ahead, ``iss`` the App's client ID (or app ID).

PyJWT (with ``cryptography``, the ``github-app`` extra) is imported here, when the first JWT is
signed, and nowhere else: a proxy without an App's hook needs neither. A key that cannot sign is
``errors.ProviderUnauthorized``, as GitHub's 401 for a wrong key is; neither the key nor the JWT
is ever in a message, a log line or a ``repr``.
"""

from __future__ import annotations

import time

from proxy import errors

# Before now: GitHub's advice against clock drift.
BACKDATE = 60
# From now: 9 minutes, within GitHub's 10.
LIFETIME = 540
# A JWT with less than this left is signed afresh.
RENEW_BEFORE = 60


class AppJWT:
    """The App's bearer token, signed when first asked for and again when < ``RENEW_BEFORE``
    is left (a reconcile run opens its own: a fresh JWT per run)."""

    def __init__(self, issuer: str, private_key: str) -> None:
        self._issuer = issuer
        self._private_key = private_key
        self._token = ""
        self._expires = 0.0

    def __repr__(self) -> str:
        return f"AppJWT(issuer={self._issuer!r}, private_key=<masked>)"

    def bearer(self) -> str:
        now = time.time()
        if not self._token or self._expires - now < RENEW_BEFORE:
            self._token = self._sign(int(now))
            self._expires = int(now) + LIFETIME
        return self._token

    def _sign(self, now: int) -> str:
        import jwt  # the github-app extra: only a route with an App's hook gets here

        claims = {"iat": now - BACKDATE, "exp": now + LIFETIME, "iss": self._issuer}
        try:
            return jwt.encode(claims, self._private_key, algorithm="RS256")
        except (ValueError, TypeError, jwt.PyJWTError) as exc:
            # The exception's text may quote the key: only its type is said.
            raise errors.ProviderUnauthorized(
                f"the GitHub App's private key cannot sign a JWT ({type(exc).__name__}): is it "
                "the App's PEM key as GitHub gave it?"
            ) from None
