"""Pipelined steps run in the order they were planned, whatever order they arrive in;
each scheduler registration (epoch) has an order of its own."""

from __future__ import annotations

import asyncio

import pytest

from services.worker.step_order import StepOrder


async def test_a_step_waits_for_the_one_it_names() -> None:
    order = StepOrder()
    ran: list[int] = []

    async def step(step_id: int, after: int, delay: float = 0.0) -> None:
        async with order.turn(step_id, after):
            await asyncio.sleep(delay)
            ran.append(step_id)

    second = asyncio.create_task(step(7, after=5))       # arrives first
    await asyncio.sleep(0.01)
    assert ran == []
    await asyncio.gather(step(5, after=0, delay=0.01), second)
    assert ran == [5, 7]
    await step(9, after=7)                               # its predecessor is done: no wait
    assert ran == [5, 7, 9]


async def test_a_failed_step_still_lets_its_successor_run() -> None:
    order = StepOrder()
    successor = asyncio.create_task(_run(order, 2, after=1))
    with pytest.raises(ValueError):
        async with order.turn(1, 0):
            raise ValueError("malformed batch")
    assert await asyncio.wait_for(successor, 1.0) == 2


async def test_a_step_whose_predecessor_never_comes_waits_for_its_deadline() -> None:
    order = StepOrder()
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(_run(order, 4, after=3), 0.05)
    assert await asyncio.wait_for(_run(order, 3, after=0), 1.0) == 3


async def test_a_new_epoch_starts_the_order_again_and_lets_the_old_waiters_go() -> None:
    order = StepOrder()
    await _run(order, 5, after=0, epoch=1)
    orphan = asyncio.create_task(_run(order, 7, after=6, epoch=1))   # step 6 died with its scheduler
    await asyncio.sleep(0.01)
    assert not orphan.done()
    assert await asyncio.wait_for(_run(order, 1, after=0, epoch=2), 1.0) == 1   # the new scheduler's first
    assert await asyncio.wait_for(orphan, 1.0) == 7    # let go (the engine refuses it)
    assert await asyncio.wait_for(_run(order, 2, after=1, epoch=2), 1.0) == 2
    # A late step of the old epoch waits for nothing and marks nothing finished.
    assert await asyncio.wait_for(_run(order, 3, after=99, epoch=1), 1.0) == 3
    successor = asyncio.create_task(_run(order, 4, after=3, epoch=2))
    await asyncio.sleep(0.01)
    assert not successor.done()
    await _run(order, 3, after=2, epoch=2)
    assert await asyncio.wait_for(successor, 1.0) == 4


async def _run(order: StepOrder, step_id: int, after: int, epoch: int = 0) -> int:
    async with order.turn(step_id, after, epoch):
        return step_id
