"""The room at the app (``app_limit.Room``) under asyncio: requests before the redeliverer's
lanes, the lanes' share bounded while requests arrive, no wake-up lost, no place leaked when a
wait ends by cancellation or timeout."""

from __future__ import annotations

import asyncio

from proxy import app_limit


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_the_lanes_share_leaves_a_quarter_to_requests_and_a_room_of_one_to_either() -> None:
    assert [app_limit.lane_share(n) for n in (1, 2, 3, 4, 8, 16)] == [1, 1, 2, 3, 6, 12]


async def test_a_lane_waiting_does_not_make_the_room_full_to_a_request() -> None:
    room = app_limit.Room(2)
    assert room.try_enter()
    assert await room.enter_lane(1.0)
    assert room.full()  # both places taken
    waiting = asyncio.ensure_future(room.enter_lane(5.0))
    await _settle()
    room.leave()  # the request's place: the waiting lane may not take it (its share is 1 of 2)
    await _settle()
    assert not waiting.done()
    assert not room.full()
    assert room.try_enter()  # a newcomer is sent, not kept
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    room.leave()
    room.leave_lane()
    assert (room.in_flight, room.lanes_in) == (0, 0)


async def test_while_requests_arrive_the_lanes_hold_at_most_their_share() -> None:
    room = app_limit.Room(8)
    assert room.try_enter()  # a request arrived just now
    lanes = [asyncio.ensure_future(room.enter_lane(0.2)) for _ in range(8)]
    entered = await asyncio.gather(*lanes)
    assert sum(entered) == 6  # lane_share(8): two places left to requests
    assert room.lanes_in == 6
    assert room.try_enter()  # the requests' two places: the first one's, and this one
    assert not room.try_enter()
    for _ in range(2):
        room.leave()
    for _ in range(6):
        room.leave_lane()
    assert (room.in_flight, room.lanes_in) == (0, 0)


async def test_once_requests_stop_the_lanes_may_hold_every_place_without_a_place_given_back() -> (
    None
):
    room = app_limit.Room(4, quiet=0.2)
    assert room.try_enter()
    room.leave()  # a request came and went: the lanes hold 3 of 4 for 0.2 s
    held = [await room.enter_lane(1.0) for _ in range(3)]
    assert held == [True, True, True]
    fourth = asyncio.ensure_future(room.enter_lane(5.0))
    await _settle()
    assert not fourth.done()
    # No place is given back; the share lifts once no request came for ``quiet``: the lane
    # waiting looks again then, not after its whole patience.
    assert await asyncio.wait_for(fourth, 2.0)
    assert room.lanes_in == room.in_flight == 4
    for _ in range(4):
        room.leave_lane()
    assert room.in_flight == 0


async def test_a_place_given_back_goes_to_a_waiting_request_before_a_waiting_lane() -> None:
    room = app_limit.Room(1)
    assert room.try_enter()
    lane = asyncio.ensure_future(room.enter_lane(5.0))
    await _settle()
    request = asyncio.ensure_future(room.enter(5.0))  # another route's request, waiting
    await _settle()
    room.leave()
    await _settle()
    assert request.done()
    assert request.result()
    assert not lane.done()
    room.leave()  # the request's: now the lane's (a room of one: its share is the place)
    assert await asyncio.wait_for(lane, 1.0)
    assert (room.in_flight, room.lanes_in) == (1, 1)
    room.leave_lane()
    assert (room.in_flight, room.lanes_in) == (0, 0)


async def test_a_lane_cancelled_after_it_was_handed_a_place_passes_it_on() -> None:
    room = app_limit.Room(1)
    assert room.try_enter()
    first = asyncio.ensure_future(room.enter_lane(5.0))
    second = asyncio.ensure_future(room.enter_lane(5.0))
    await _settle()
    room.leave()  # handed to the first lane, which has not run yet
    first.cancel()  # ... and is cancelled before it does
    await asyncio.gather(first, return_exceptions=True)
    assert first.cancelled()
    assert await asyncio.wait_for(second, 1.0)  # the place passed on, not leaked
    assert (room.in_flight, room.lanes_in) == (1, 1)
    room.leave_lane()
    assert (room.in_flight, room.lanes_in) == (0, 0)


async def test_a_lane_cancelled_while_waiting_leaves_nothing_behind() -> None:
    room = app_limit.Room(1)
    assert room.try_enter()
    lane = asyncio.ensure_future(room.enter_lane(5.0))
    await _settle()
    lane.cancel()
    await asyncio.gather(lane, return_exceptions=True)
    room.leave()
    assert (room.in_flight, room.lanes_in) == (0, 0)
    assert room.try_enter()  # the place is free: no dead waiter took it
    room.leave()


async def test_a_lane_whose_patience_ends_gets_no_place_and_holds_none() -> None:
    room = app_limit.Room(1)
    assert room.try_enter()
    assert not await room.enter_lane(0.05)
    room.leave()
    assert (room.in_flight, room.lanes_in) == (0, 0)


async def test_many_lanes_and_requests_at_once_never_exceed_the_room_nor_leak_a_place() -> None:
    """Requests (kept when the room is full, or waiting their turn) and lanes entering,
    working a moment, leaving, some cancelled midway: at the end every place is back."""
    room = app_limit.Room(4, quiet=0.05)
    peak = {"all": 0, "lanes": 0}

    def note() -> None:
        peak["all"] = max(peak["all"], room.in_flight)
        peak["lanes"] = max(peak["lanes"], room.lanes_in)
        assert room.in_flight <= room.size

    async def request(n: int) -> None:
        entered = room.try_enter() if n % 2 else await room.enter(0.05)
        if entered:
            note()
            try:
                await asyncio.sleep(0.001 * (n % 3))
            finally:
                room.leave()

    async def lane(n: int) -> None:
        for _ in range(20):
            if await room.enter_lane(0.02):
                note()
                try:
                    await asyncio.sleep(0.001 * (n % 2))
                finally:
                    room.leave_lane()

    lanes = [asyncio.ensure_future(lane(n)) for n in range(6)]
    requests = [asyncio.ensure_future(request(n)) for n in range(200)]
    await asyncio.sleep(0.01)
    for task in requests[::7] + lanes[:2]:
        task.cancel()
    await asyncio.gather(*lanes, *requests, return_exceptions=True)
    assert (room.in_flight, room.lanes_in) == (0, 0)
    assert peak["all"] <= 4
    assert peak["lanes"] >= 1


async def test_a_freed_place_goes_to_a_signed_request_then_a_lane_then_an_unsigned_request() -> (
    None
):
    """A route without verify (``behind``) waits behind signed requests and the lanes: a flood
    on it cannot queue ahead of a provider's signed deliveries or the kept ones' redeliveries."""
    room = app_limit.Room(4, quiet=0.0)  # no share held back: the lanes may hold every place
    for _ in range(4):
        assert room.try_enter(behind=True)
    assert room.full(behind=True)
    order: list[str] = []

    async def request(name: str, *, behind: bool) -> None:
        if await room.enter(5.0, behind=behind):
            order.append(name)

    async def lane() -> None:
        if await room.enter_lane(5.0):
            order.append("lane")

    waiting = [
        asyncio.ensure_future(request("unsigned", behind=True)),
        asyncio.ensure_future(lane()),
        asyncio.ensure_future(request("signed", behind=False)),
    ]
    await _settle()
    assert not room.try_enter(behind=True)  # one behind waits already: no passing it
    for _ in range(3):
        room.leave()
        await _settle()
    await asyncio.gather(*waiting)
    assert order == ["signed", "lane", "unsigned"]
    assert (room.in_flight, room.lanes_in) == (4, 1)
