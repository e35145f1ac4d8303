"""The pace of requests to an object store (storage/pace.py), against a simulated store: each request
waits a first-byte latency, then receives at the lesser of a per-connection cap and its share of a
link. The count must settle where the link is full, and the request size follow latency x rate."""

from __future__ import annotations

import asyncio

import pytest

from streamload.storage.pace import LARGEST, SMALLEST, Pace, Timer

MB = 1e6


async def _load(pace: Pace, link: float, cap: float, latency: float, seconds: float) -> None:
    """Requests as a load makes them (always more waiting than the count) for `seconds`."""
    active = 0

    async def one() -> None:
        nonlocal active
        ticket = await pace.acquire()
        try:
            timer = Timer()
            await asyncio.sleep(latency)
            timer.headers()
            size = pace.request_bytes()
            active += 1
            left = float(size)
            loop, last = asyncio.get_running_loop(), asyncio.get_running_loop().time()
            while left > 0:  # receive in steps, at the share the link gives now
                await asyncio.sleep(0.005)
                # by the time that passed, not the time asked for: a busy machine's loop wakes late, and a
                # step counted as 5 ms would make the simulated link slower than its rate (the count then
                # settled elsewhere: the test depended on this machine's speed)
                now = loop.time()
                left -= min(cap, link / active) * (now - last)
                last = now
            active -= 1
            pace.record(timer.sample(size, ticket))
        finally:
            pace.release()

    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    running: set[asyncio.Task[None]] = set()
    while loop.time() < end:
        while len(running) < 2 * pace.limit + 8:
            task = asyncio.ensure_future(one())
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.sleep(0.005)
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


@pytest.mark.parametrize(
    ("cap", "want"),
    [
        (10 * MB, (16,)),  # 16 connections fill a 25 MB/s link already: doubling does not pay
        (1 * MB, (32,)),  # 25 connections are needed: 16 -> 32 pays, 64 does not
    ],
)
def test_the_count_settles_where_the_link_is_full(cap: float, want: tuple[int, ...]) -> None:
    pace = Pace()
    asyncio.run(_load(pace, link=25 * MB, cap=cap, latency=0.01, seconds=3.0))
    assert pace.limit in want
    assert pace._settled
    assert pace.latency is not None and 0.009 < pace.latency < 0.05


def test_request_size_follows_latency_and_rate() -> None:
    pace = Pace()
    assert pace.request_bytes() == SMALLEST  # nothing measured yet
    asyncio.run(_load(pace, link=400 * MB, cap=100 * MB, latency=0.02, seconds=1.5))
    assert pace.rate is not None and pace.latency is not None
    # the smallest power of two that receives for 4x the wait at the rate a request got, within bounds
    size, want = pace.request_bytes(), 4 * pace.latency * pace.rate
    assert size > SMALLEST
    assert size <= LARGEST and (size >= want or size == LARGEST) and size // 2 < want


def test_a_cancelled_wait_gives_its_connection_on() -> None:
    async def run() -> None:
        pace = Pace(connections=1)
        await pace.acquire()
        waiting = asyncio.ensure_future(pace.acquire())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        pace.release()
        third = await asyncio.wait_for(pace.acquire(), 1)  # not blocked by the cancelled one
        assert third[1] >= 1
        pace.release()
        assert pace._active == 0

    asyncio.run(run())
