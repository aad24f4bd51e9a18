"""Request work that must not run on the event loop: decoding, validating, tokenizing.

One 39 MB body used to stall every plane for 45 s, because JSON decoding, pydantic
validation, the chat template and tokenization all ran on the loop that also answers
/health, management, metrics and every running stream.  They run here instead, on a
small fixed pool (a bounded number of threads, whatever the load), and the loop stays
free.  Small bodies skip the pool, where the hand-offs cost more than the work: the pool's
two hand-offs (validation, then planning) added ~0.35 ms to a chat request whose
validation and planning take ~0.1 ms (the bench's ~200-byte prompts).  Planning grows
with the text: ~0.5 ms at 1 KB, ~1 ms at 2 KB (the longest pause a request may give the
loop), ~11 ms at 16 KB.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="request-plan")
INLINE_BYTES = 64 * 1024        # JSON bodies up to this size are decoded on the loop
PLAN_INLINE_BYTES = 2 * 1024    # requests up to this size are validated and planned on it


TRIM_BYTES = 4 * 1024 * 1024   # after a body this large, give freed heap back to the OS
_TRIM_DELAY_S = 1.0            # by then the request's objects (and its error) are gone


def _libc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):     # not glibc: nothing to trim
        return None


_MALLOC_TRIM = _libc_trim()


def _release() -> None:
    gc.collect()              # a refusal's traceback cycle still holds the prompt's frames
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def trim_soon() -> None:
    """Give a large body's memory back to the OS, a moment after it was handled.

    The copies of a 39 MB body (bytes, str, the rendered prompt) are freed only when the
    cyclic collector breaks the cycle between a refusal's exception and the frames that
    hold them, which may be long after; and freed heap pages stay with malloc.  So: a
    collection, then ``malloc_trim(0)`` (glibc), on the planning pool, never the loop."""
    loop = asyncio.get_running_loop()
    loop.call_later(_TRIM_DELAY_S, lambda: loop.run_in_executor(_POOL, _release))


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on the planning pool and await its result."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_POOL, functools.partial(fn, *args))
