"""Reading a webhook's body: whole, within its limits of size and time, against the memory budget.

The body is read before anything is claimed (its event ID, signature and digest are in it). A
client that sends it too slowly, stops half-way or sends too much is refused here; the errors
of aiohttp's request stream are translated into ``errors`` here and nowhere else.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from proxy import errors, memory


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
    except (aiohttp.ClientPayloadError, OSError) as exc:
        raise errors.RequestIncomplete(f"request body ended early: {exc!r}") from exc
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
