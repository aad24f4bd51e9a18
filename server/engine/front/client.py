"""What the serving layer may call on an engine: the one interface both fronts implement.

``AsyncEngine`` (engine.py: the engine thread in the serving process) and
``EngineProcess`` (engine_process.py: the engine in a process of its own, the daemon's
default) answer the same calls; the API layer holds one as ``ServerState.engine`` and
touches the engine through nothing else.  No torch.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Protocol

from server.engine.protocol import EngineOutput, EngineRequest
from server.engine.runtime import RuntimeInfo
from server.engine.stats import EngineStats


class EngineClient(Protocol):
    on_fatal: Callable[[str], None] | None   # called once, from the engine, if it dies

    async def start(self) -> None: ...

    def submit(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The request's outputs as they come; the last one has ``finished`` set."""

    async def prepare_grammar(self, grammar: str) -> None:
        """Compile a grammar before the request that needs it is submitted."""

    def abort(self, request_id: str) -> None: ...

    def purge_peer_blocks(self, epoch: int) -> None:
        """PD: the role changed to version ``epoch``; forget every prefix block loaded from
        a peer (and those computed on top of one) before the next step, and load no rows
        checked under an earlier version (kv/block_manager.py)."""

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step."""

    @property
    def fatal_error(self) -> str | None:
        """Why the engine is gone for good, else None."""

    @property
    def runtime(self) -> RuntimeInfo:
        """What the engine really runs with (effective k, KV blocks, compile state...)."""

    @property
    def kv_export_sink(self) -> Any:
        """PD prefill: called with (request id, full prompt blocks, their rows)."""

    async def shutdown(self, drain: bool = True) -> None: ...
