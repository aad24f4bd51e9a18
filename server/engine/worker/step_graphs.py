"""Which graphs the worker's static decode/verify step runs, and getting them compiled.

The worker asks for compiled graphs once (worker/compile_step.py does the compiling): at
once where the engine waits for them (``compile_wait``, or an accelerator), otherwise in
the background while it serves the step uncompiled; between steps ``adopt`` switches to
each round of graphs once it is ready.  What the engine learns of it is a
``CompileState`` (messages.py): at start in the WorkerInfo, later in a step's
``compile_update`` when it changed.  A failure to compile is logged and the step keeps
running as it was: compiling is an optimisation, never a reason to fail.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from server.engine.config import EngineConfig
from server.engine.messages import CompileState
from server.engine.worker.compile_step import (BackgroundGraphs, compile_static_decoder,
                                               should_compile)

log = logging.getLogger("server.engine")


class StepGraphs:
    def __init__(self, model: Any, cfg: EngineConfig, device: torch.device, static_decode: bool,
                 max_query_len: int) -> None:
        self.model = model
        self.static_decode = static_decode
        self.seconds: float | None = None
        self.state = "compiled" if model.static_decoder.compiled else "off"
        self._background: BackgroundGraphs | None = None
        # A model compiled for an engine with fewer drafts gains the graphs this one lacks.
        if not (should_compile(cfg.compile, device, static_decode)
                and model.static_decoder.static_query_len < max_query_len):
            return
        if cfg.compile_wait or device.type != "cpu":
            try:
                self.seconds = compile_static_decoder(model, cfg.block_size, device, max_query_len)
                self.state = "compiled"
            except Exception as exc:            # noqa: BLE001 - e.g. no C++ compiler on the host
                self._failed(exc)
        else:                                   # serve uncompiled until the graphs are ready
            self._background = BackgroundGraphs(model, cfg.block_size, device, max_query_len)
            self.state = "compiling"

    @property
    def decode_path(self) -> str:
        """compiled, static (plain PyTorch) or eager (the varlen path, e.g. for striped
        (sequence-parallel) caches)."""
        if not self.static_decode:
            return "eager"
        return "compiled" if self.model.static_decoder.compiled else "static"

    def current(self) -> CompileState:
        return CompileState(self.decode_path, self.seconds, self.state)

    def adopt(self) -> CompileState | None:
        """Between steps: switch to each round of background graphs once it is ready; the
        new state when it changed."""
        if self._background is None:
            return None
        try:
            ready = self._background.poll()
        except Exception as exc:                # noqa: BLE001 - the step path stays as it is
            ready = None
            self._background = None
            self._failed(exc)
        if ready is not None:
            graphs, last = ready
            self.model.static_decoder.use_graphs(graphs)
            self.seconds = self._background.seconds
            log.info("static decode step: switched to %d compiled graphs, %.1f s after start%s",
                     len(graphs), self._background.elapsed(), "" if last else " (more to come)")
            if last:
                self.state = "compiled"
                self._background = None
        if ready is not None or self._background is None:
            return self.current()
        return None

    def _failed(self, exc: BaseException) -> None:
        self.state = "failed"
        log.warning("compiling the static decode step failed (%s: %s); serving it "
                    "uncompiled ($MTP_SERVE_COMPILE=0 skips the attempt)",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
