import asyncio

import pytest

from prime_rl.utils.aio import gather_or_cancel


def test_the_first_failure_cancels_the_others_and_waits_for_them_before_it_is_raised():
    ended: list[str] = []

    async def slow():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # cleanup that takes a moment (a process being stopped)
            ended.append("slow cleaned up")
            raise

    async def fails():
        await asyncio.sleep(0.01)
        raise RuntimeError("broke")

    async def main():
        with pytest.raises(RuntimeError, match="broke"):
            await gather_or_cancel(slow(), fails())
        return list(ended)  # before the caller goes on

    assert asyncio.run(main()) == ["slow cleaned up"]
    assert asyncio.run(gather_or_cancel_values()) == [1, 2]


async def gather_or_cancel_values():
    async def value(v):
        return v

    return await gather_or_cancel(value(1), value(2))
