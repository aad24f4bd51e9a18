"""``n`` choices as ``n`` engine requests: per-choice seeds, interleaving and clean-up.

Each choice is an independent engine request (the prefix cache shares the prompt's KV
blocks between them).  With a request ``seed``, choice ``i`` samples with ``seed + i``
(wrapped to a signed 64-bit value), as vLLM's parallel sampling does: choice 0 is exactly
the ``n=1`` answer for that seed, the choices differ from each other, and the same request
gives the same choices again.  Without a seed each engine request draws its own.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from server.engine.protocol import SamplingParams

_END = object()


def choice_seed(seed: int | None, i: int) -> int | None:
    """Seed of choice ``i``: ``seed + i`` wrapped into [-2**63, 2**63), None stays None."""
    if seed is None:
        return None
    return ((seed + i + 2 ** 63) % 2 ** 64) - 2 ** 63


def choice_sampling(sampling: SamplingParams, i: int) -> SamplingParams:
    if i == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=choice_seed(sampling.seed, i))


class Interleave:
    """Merge the outputs of several EngineCalls as ``(index, output)`` in arrival order.

    A pump task per call copies its outputs into one queue; an exception from any call
    (timeout, engine failure, disconnect) is re-raised to the reader.  ``close`` cancels
    the pumps and aborts every unfinished call; callers call it in ``finally`` because an
    abandoned async generator's own clean-up runs only when it is garbage-collected.
    A ``None`` call (nothing to generate, e.g. ``max_tokens`` 0) yields ``(index, None)``.
    """

    def __init__(self, calls: list) -> None:
        self.calls = calls
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def _pump(self, i: int, call: Any) -> None:
        try:
            if call is None:
                self._queue.put_nowait((i, None))
                return
            async for out in call:
                self._queue.put_nowait((i, out))
        except BaseException as exc:     # cancellation included: the reader stops anyway
            self._queue.put_nowait((i, exc))
        finally:
            self._queue.put_nowait((i, _END))

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        self._tasks = [asyncio.create_task(self._pump(i, c)) for i, c in enumerate(self.calls)]
        live = len(self.calls)
        while live:
            i, item = await self._queue.get()
            if item is _END:
                live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            yield i, item

    def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for c in self.calls:
            if c is not None:
                c.close()


def prompt_cached_tokens(cached: list[int], n: int) -> int:
    """Prompt tokens served from the prefix cache, counted once per prompt: the smallest
    figure among a prompt's ``n`` choices, so siblings hitting each other's freshly cached
    prompt blocks do not inflate it (equal to the plain sum when ``n`` is 1)."""
    return sum(min(cached[p:p + n]) for p in range(0, len(cached), n))
