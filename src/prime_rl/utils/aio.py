"""asyncio helpers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def gather_or_cancel(*aws: Awaitable) -> list[Any]:
    """`asyncio.gather`, except that the first failure cancels the others and waits for them before it is raised:
    nothing keeps running (a harness program, a request) after its caller gave up, into the loop's shutdown."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
