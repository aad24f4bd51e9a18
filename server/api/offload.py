"""Request work that must not run on the event loop: decoding, validating, tokenizing.

One 39 MB body used to stall every plane for 45 s, because JSON decoding, pydantic
validation, the chat template and tokenization all ran on the loop that also answers
/health, management, metrics and every running stream.  They run here instead, on a
small fixed pool (a bounded number of threads, whatever the load), and the loop stays
free.  Small bodies skip the pool for JSON decoding: the hand-off would cost more.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="request-plan")
INLINE_BYTES = 64 * 1024        # JSON bodies up to this size are decoded on the loop


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the planning pool and await its result."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(fn, *args))
