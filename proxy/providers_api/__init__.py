"""The providers' own delivery logs, read by the reconciler (``proxy.reconciler``): one interface,
``DeliveryLog``, and an implementation per provider whose API allows it (``github``,
``stripe``, ``paddle``, ``paypal``).

A closed family: it imports nothing from the package but the error tree and the route's
``reconcile`` settings. Every answer of a provider's API is translated here, once, into
``errors.ProviderAPIError`` (``answered``), and aiohttp's client errors with it (``reaching``);
a log's pages are walked, each implementation asking for one page at a time, by ``pages``.

The API is trusted with the events' IDs and states, not with where the token goes nor with the
proxy's memory: an answer is read up to ``MAX_ANSWER`` bytes (``read_json``), a next page is
followed only on the configured API's origin (``next_page``), and what goes into a URL is
checked against the form the provider documents first (``of_form``).
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp
import yarl

from proxy import errors

# A page of a provider's log, or a redelivery asked for: a slow API is an unavailable one.
REQUEST_TIMEOUT = 30.0
# When a provider says to slow down without saying for how long.
DEFAULT_RETRY_AFTER = 60.0
# An answer of the API read at most (a page of 100 Stripe events is about 1 MiB, of GitHub's
# deliveries 50 KiB): a larger one is refused unread rather than held and parsed.
MAX_ANSWER = 8 * 1024 * 1024

Cursor = TypeVar("Cursor")


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """One event in the provider's log, its attempts taken together.

    ``event_id`` is the claim's ID as the route forms it from the delivery's headers (GitHub:
    hook ID and GUID), before any binding to the body; ``ref`` is what ``recover`` needs
    (GitHub: the delivery ID of an attempt); ``delivered`` whether any attempt succeeded.
    """

    event_id: str
    ref: str
    event: str
    at: float  # time.time() of the newest attempt
    delivered: bool
    status: str  # the newest attempt's, as the provider words it
    attempts: int = 1


class DeliveryLog(Protocol):
    """A provider's log of its deliveries to one endpoint (one hook)."""

    def deliveries(self, since: float) -> AsyncIterator[Delivery]:
        """The events the provider tried to deliver at or after ``since`` (time.time()), each
        once, its attempts taken together, walking the log's pages with its cursor."""
        ...  # pragma: no cover

    async def recover(self, delivery: Delivery) -> None:
        """Have ``delivery`` delivered again (GitHub: a redelivery, signed as any other;
        Stripe: the event sent to the route, signed with its secret)."""
        ...  # pragma: no cover

    async def close(self) -> None: ...

    @property
    def truncated(self) -> bool:
        """Whether the last walk of ``deliveries`` stopped at its page bound with pages left
        (the log's older events then unread)."""
        ...  # pragma: no cover


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """How long the answer asks to wait: ``Retry-After`` (seconds or an HTTP date), else
    GitHub's ``x-ratelimit-reset`` (epoch seconds) when ``x-ratelimit-remaining`` is 0; None:
    it does not say."""
    now = time.time() if now is None else now
    value = headers.get("Retry-After")
    if value is not None:
        if value.strip().isdigit():
            return float(value.strip())
        with contextlib.suppress(TypeError, ValueError):
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - now)
    reset = headers.get("x-ratelimit-reset")
    if headers.get("x-ratelimit-remaining") == "0" and reset is not None and reset.isdigit():
        return max(0.0, float(reset) - now)
    return None


def answered(status: int, headers: Mapping[str, str], what: str) -> None:
    """Nothing for a 2xx; else the error that answer means."""
    if 200 <= status < 300:
        return
    wait = retry_after(headers)
    if status == 429 or (status == 403 and wait is not None):
        after = DEFAULT_RETRY_AFTER if wait is None else wait
        raise errors.ProviderRateLimited(
            f"{what}: rate limited ({status}), retry after {after:g}s", retry_after=after
        )
    if status in (401, 403):
        raise errors.ProviderUnauthorized(
            f"{what}: {status}: the token expired, was revoked or lacks the permission "
            '(docs/security.md, "The reconcile token")'
        )
    if status >= 500:
        raise errors.ProviderUnavailable(f"{what}: the provider answered {status}")
    raise errors.ProviderRefused(f"{what}: the provider answered {status}")


@contextlib.contextmanager
def reaching(what: str) -> Iterator[None]:
    """aiohttp's client errors and timeouts as ``ProviderUnavailable``; a body that is not the
    JSON described as ``ProviderRefused``."""
    try:
        yield
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise errors.ProviderUnavailable(f"{what}: {exc!r}") from exc
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.ProviderRefused(f"{what}: an answer not as described: {exc!r}") from exc


async def read_json(response: aiohttp.ClientResponse, what: str) -> Any:
    """The answer's JSON, read up to ``MAX_ANSWER`` bytes; ``ProviderRefused`` beyond them."""
    too_large = errors.ProviderRefused(
        f"{what}: an answer over {MAX_ANSWER // (1024 * 1024)} MiB, refused unread "
        "(providers_api.MAX_ANSWER)"
    )
    if (response.content_length or 0) > MAX_ANSWER:
        raise too_large
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > MAX_ANSWER:
            raise too_large
    return json.loads(body)


def same_origin(url: str, base: str) -> bool:
    """Whether ``url`` is on ``base``'s scheme, host and port (a default port as written or
    not): where the API's token may be sent."""
    try:
        given, configured = yarl.URL(url), yarl.URL(base)
        return (given.scheme, given.host, given.port) == (
            configured.scheme, configured.host, configured.port
        )  # fmt: skip
    except (TypeError, ValueError):
        return False


def next_page(
    url: str, link: str, api_url: str, what: str, *, credential: str = "the token"
) -> str:
    """``link``, the next page's as the answer to ``url`` names it, resolved against ``url``;
    ``ProviderRefused`` if it leaves ``api_url``'s origin, where ``credential`` may go.
    ValueError for a link that is no URL."""
    after = yarl.URL(url).join(yarl.URL(link))
    if not same_origin(str(after), api_url):
        raise errors.ProviderRefused(
            f"{what}: the next page's link leads to another host than api_url's "
            f"({after.host!r:.100}): not followed, {credential} goes to api_url only"
        )
    return str(after)


def of_form(value: object, form: re.Pattern[str], message: str) -> str:
    """``value``, a string of the provider's ``form`` (an ID that goes into a URL);
    ValueError(``message``) otherwise."""
    if not isinstance(value, str) or not form.fullmatch(value):
        raise ValueError(message)
    return value


def session(headers: Mapping[str, str] | None = None) -> aiohttp.ClientSession:
    """A client session whose every request carries ``headers``, within ``REQUEST_TIMEOUT``."""
    return aiohttp.ClientSession(
        headers=headers, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    )


async def fetch_json(
    request: AbstractAsyncContextManager[aiohttp.ClientResponse], what: str
) -> tuple[Any, Mapping[str, str]]:
    """The answer to ``request``, once ``answered``: its JSON (``read_json``) and headers."""
    async with request as response:
        answered(response.status, response.headers, what)
        return await read_json(response, what), response.headers


async def send(request: AbstractAsyncContextManager[aiohttp.ClientResponse], what: str) -> None:
    """``request`` sent and its answer ``answered``; its body is not read."""
    async with request as response:
        answered(response.status, response.headers, what)


class Walked(Protocol):
    truncated: bool


async def pages(
    log: Walked,
    first: Cursor,
    fetch: Callable[[Cursor], Awaitable[tuple[list[Any], Cursor | None]]],
    *,
    max_pages: int,
) -> AsyncIterator[list[Any]]:
    """The log's pages, the first ``fetch``ed at ``first``, each next at the cursor the one before
    names (None: the last), ``max_pages`` at most: ``log.truncated`` says whether pages were left
    at that bound. A walk stopped early by its reader is not truncated."""
    log.truncated = False
    cursor: Cursor | None = first
    for _ in range(max_pages):
        if cursor is None:
            return
        page, cursor = await fetch(cursor)
        yield page
    log.truncated = cursor is not None
