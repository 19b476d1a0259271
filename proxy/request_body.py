"""Reading a webhook's body: whole, within its limits of size and time, against the memory budget.

The body is read before anything is claimed (its event ID, signature and digest are in it). A
client that sends it too slowly, stops half-way or sends too much is refused here; the errors
of aiohttp's request stream are translated into ``errors`` here and nowhere else.

A client that sends ``Expect: 100-continue`` waits for ``100 Continue`` before it sends any body
(RFC 9110 10.1.1). It is written when a body is about to be read (``go_ahead``, here and
before a pass-through request goes to the app), as Go's net/http does on a body's first read,
and not on the head's arrival as aiohttp's default Expect handler would: every refusal the
head alone earns (a path refused, no route, a method, a declared length over max_body, a
header that is not UTF-8) comes instead, and the connection is closed after it
(``close_unread``): the client may send the body or not.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11

from proxy import errors, memory

_CONTINUED = web.RequestKey("continued", bool)  # 100 Continue written


async def read(
    request: web.Request,
    limit: int,
    within: float,
    reservation: memory.Reservation,
    *,
    pause: float = float("inf"),
) -> bytes:
    """The whole body within ``within`` seconds, its bytes never pausing longer than ``pause``
    (nginx's client_body_timeout, counted between two reads), refusing more than ``limit`` bytes
    (before reading, when the length is declared).

    Each part is reserved against the memory budget as it arrives, never a declared length
    ahead of its bytes: a request head alone (``Content-Length: 26214400`` and no body) must
    not hold any of the budget, or a few such heads would shed every genuine webhook.
    """
    declared = request.content_length
    if declared is not None and declared > limit:
        raise errors.BodyTooLarge(f"body of {declared} bytes is over max_body {limit}")
    await go_ahead(request)
    content = request.content
    try:
        if content.is_eof():
            # All of it arrived with the headers (a typical webhook): no wait, no timer.
            body = content.read_nowait()
            reservation.body(len(body))
        else:
            body = await _read_parts(content, limit, within, pause, reservation)
    except TimeoutError as exc:
        raise errors.RequestTimeout(f"body not received within {within:g}s") from exc
    except (aiohttp.ClientPayloadError, OSError) as broken:
        raise errors.RequestIncomplete(f"request body ended early: {broken!r}") from broken
    if len(body) > limit:
        raise errors.BodyTooLarge(f"body is over max_body {limit} bytes")
    return body


async def _read_parts(
    content: aiohttp.StreamReader,
    limit: int,
    within: float,
    pause: float,
    reservation: memory.Reservation,
) -> bytes:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    chunks = bytearray()
    while len(chunks) <= limit:
        left = end - loop.time()
        try:
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(min(left, pause)):
                chunk = await content.readany()
        except TimeoutError:
            if pause < left:
                raise errors.RequestTimeout(
                    f"body paused for over client_body_timeout {pause:g}s"
                ) from None
            raise
        if not chunk:
            break
        reservation.body(len(chunk))
        chunks += chunk
    return bytes(chunks)


def waits_to_send(request: web.BaseRequest) -> bool:
    """The client sends its body only after ``100 Continue`` (aiohttp's default handler's test:
    HTTP/1.1 and ``Expect: 100-continue``)."""
    expect = request.headers.get(hdrs.EXPECT, "")
    return request.version == HttpVersion11 and expect.lower() == "100-continue"


async def expectation(request: web.Request) -> None:
    """The route's Expect handler, which aiohttp runs before the handler: 417 for an expectation
    other than 100-continue, as aiohttp's default does, but without the client's value in its
    text (aiohttp's echoed it, and failed with a 500 on a byte that is not UTF-8); for
    100-continue, nothing yet (``go_ahead`` answers it)."""
    if request.version == HttpVersion11 and not waits_to_send(request):
        raise web.HTTPExpectationFailed(text="Unknown Expect: only 100-continue is supported")


async def go_ahead(request: web.BaseRequest) -> None:
    """Write ``100 Continue`` to a client that waits for it, once: where its body is about to
    be read, after every refusal its head alone earns."""
    if request.get(_CONTINUED) or not waits_to_send(request):
        return
    request[_CONTINUED] = True
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the answer's own count starts after it, as in aiohttp's


async def close_unread(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Close the connection after an answer to a client still waiting to send its body (no
    ``100 Continue`` was written): it may send the body after the answer or never (RFC 9110
    10.1.1), so no next request can be told apart on the connection. aiohttp's lingering read
    drops a body sent after all, then closes. A response hook, so that it runs for every
    answer."""
    if waits_to_send(request) and not request.get(_CONTINUED):
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"
