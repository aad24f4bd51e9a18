"""The synchronous engine core: LLMEngine.step() = schedule -> execute -> update -> emit.

One thread calls it (the AsyncEngine thread in engine.py, or a test).  It owns the
scheduler (requests, KV block bookkeeping) and the output processing; device state lives
with the worker behind the executor, reached only through step messages (messages.py).

Asynchronous scheduling (``EngineConfig.async_scheduling``, MindIE's
MINDIE_ASYNC_SCHEDULING_ENABLE=1) keeps two steps in flight: step() schedules and launches
step n+1, then applies and emits step n while n+1 executes.  Off, the same step() waits for
the step it just launched.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import random
import time
from collections import deque
from typing import Any

from server.engine.config import EngineConfig, EngineError
from server.engine.executor.base import make_executor
from server.engine.kv.block_manager import BlockManager, RemoteRow
from server.engine.kv.tiers import fill_tier_stats, make_block_manager
from server.engine.messages import CompileState, ModelRunnerOutput, SchedulerOutput
from server.engine.output import OutputProcessor, final_output
from server.engine.protocol import EngineOutput, EngineRequest, FinishReason
from server.engine.runtime import RuntimeInfo
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.spec.policy import SpecPolicy
from server.engine.stats import EngineStats, StatsRecorder
from server.engine.worker.worker import Worker

log = logging.getLogger("server.engine")


def _eos_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    ids = set(tokenizer.eos_token_ids if tokenizer is not None else ())
    if not ids:
        eos = model.config.eos_token_id
        ids = set(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    return frozenset(ids)


class LLMEngine:
    """Synchronous engine core.  Not thread-safe: one thread calls everything."""

    def __init__(self, model: Any, cfg: EngineConfig, tokenizer: Any = None, *,
                 eos_token_ids: set[int] | None = None, policy: SpecPolicy | None = None,
                 blocks: BlockManager | None = None, clock=time.monotonic) -> None:
        if cfg.kv_cache_dtype not in ("auto", "int8"):
            raise EngineError(f"kv_cache_dtype {cfg.kv_cache_dtype!r}; allowed: 'auto' (the "
                              "model's dtype), 'int8' (int8 latent, RoPE part in the model dtype)")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.clock = clock
        k = cfg.num_speculative_tokens
        if k and not model.has_mtp:
            log.warning("num_speculative_tokens=%d but the checkpoint has no MTP weights: "
                        "decoding without MTP", k)
            k = 0
        eos = frozenset(eos_token_ids) if eos_token_ids is not None else _eos_ids(tokenizer, model)
        self.executor = make_executor(model, cfg, k, policy)
        self.worker: Worker | None = self.executor.worker   # None when it lives in another process
        info = self.executor.info
        host_blocks = info.host_kv_blocks
        self.runtime = RuntimeInfo(
            num_speculative_tokens=k, configured_speculative_tokens=cfg.num_speculative_tokens,
            adaptive_speculation=bool(k) and cfg.adaptive_speculation,
            async_scheduling=cfg.async_scheduling, num_kv_blocks=info.num_kv_blocks,
            block_size=cfg.block_size, eos_token_ids=eos, max_seq_len=cfg.max_seq_len,
            vocab_size=model.config.vocab_size, num_kv_layers=model.num_kv_layers,
            num_int8_kv_layers=info.num_int8_kv_layers, decode_path=info.compile.decode_path,
            compile_seconds=info.compile.seconds, compile_state=info.compile.state,
            host_kv_blocks=host_blocks, kv_block_bytes=info.kv_block_bytes,
            host_cache_prefix=bool(host_blocks) and cfg.host_cache_prefix and cfg.enable_prefix_cache,
            swap_preemption=bool(host_blocks) and cfg.swap_preemption,
            world_size=cfg.parallel.world_size, moe_tp=cfg.parallel.moe_tp,
            moe_ep=cfg.parallel.moe_ep, sp=info.sp, dp=info.dp, cp=cfg.parallel.cp,
            kv_blocks_per_rank=info.kv_blocks_per_rank,
            prediction_draft_tokens=info.prediction_draft_tokens, kernels=info.kernels,
            engine_pid=os.getpid(),
            worker_pids=self.executor.worker_pids if cfg.parallel.world_size > 1 else ())
        self.blocks = blocks or make_block_manager(model.config, cfg, self.runtime)
        self.scheduler = Scheduler(cfg, self.blocks, num_spec_tokens=k,
                                   async_scheduling=cfg.async_scheduling,
                                   prediction_drafts=self.runtime.prediction_draft_tokens,
                                   clock=clock)
        self.output_processor = OutputProcessor(tokenizer)
        self._stats = EngineStats(kv_blocks_total=self.runtime.num_kv_blocks,
                                  block_size=cfg.block_size, num_speculative_tokens=k,
                                  accepted_per_position=[0] * k, steps_per_k=[0] * (k + 1),
                                  spec_current_k=k)
        self._recorder = StatsRecorder(self._stats, k, log)
        self._pending: list[EngineOutput] = []          # outputs produced outside step()
        self._in_flight: deque[tuple[SchedulerOutput, cf.Future[ModelRunnerOutput]]] = deque()
        self._max_in_flight = 2 if cfg.async_scheduling else 1
        self._rng = random.Random()
        # PD prefill (server/pd): takes (request id, full prompt blocks, their rows) as the
        # worker exports them, before the request's last output is emitted.
        self.kv_export_sink: Any = None
        log.info(self.runtime.describe())

    @property
    def policy(self) -> SpecPolicy | None:
        """The speculation policy the MTP proposer asks for k (None with MTP off, or when
        the worker runs in another process)."""
        return self.worker.policy if self.worker is not None else None

    @property
    def grammars(self):
        """The worker's compiled grammars (grammar.GrammarBook), or None when the worker
        runs in another process (it compiles a grammar there on first sight)."""
        return self.worker.grammars if self.worker is not None else None

    # ---- requests -------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue ``req``; a request the engine cannot serve finishes at once with an error."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        p = req.sampling
        n = len(req.prompt_token_ids)
        seed = p.seed if p.seed is not None else self._rng.getrandbits(63)
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.runtime.eos_token_ids)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), n, p,
                       max_output_tokens=min(p.max_tokens, self.cfg.max_iter_times,
                                             self.cfg.max_seq_len - n),
                       seed=int(seed) & ((1 << 63) - 1),
                       arrival_time=req.arrival_time or self.clock(), stop_ids=stop_ids,
                       export_kv=req.export_kv,
                       remote_kv=tuple(RemoteRow(r) for r in req.remote_kv),
                       peer_epoch=req.remote_kv_epoch if req.remote_kv else None)
        seq.counters.prompt_tokens = n
        refusal = self._check(seq)
        if refusal:
            param, error = refusal
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ERROR
            self._finish_bookkeeping(seq)
            self._pending.append(final_output(seq, FinishReason.ERROR, error, error_param=param))
            return
        self.output_processor.add(seq)
        self.scheduler.add(seq)

    def _check(self, seq: Sequence) -> tuple[str, str] | None:
        """(the request parameter at fault, why) for a request that can never be served as
        asked; None for one the engine takes.  The API answers a refusal with a 400 naming
        the parameter ("prompt": the prompt, whatever the route calls it)."""
        n, vocab = seq.num_prompt_tokens, self.runtime.vocab_size
        if n == 0:
            return "prompt", "the prompt is empty"
        if n >= self.cfg.max_seq_len:
            return "prompt", f"prompt has {n} tokens; maxSeqLen {self.cfg.max_seq_len} leaves no room for output"
        if seq.max_output_tokens < 1:
            return "max_tokens", "max_tokens must be at least 1"
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
            return "prompt", f"prompt token ids must lie in [0, {vocab})"
        p = seq.sampling
        for what, ids in (("logit_bias", list(p.logit_bias or ())), ("stop_token_ids", p.stop_token_ids),
                          ("prediction", p.prediction or ())):
            bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
            if bad:
                return what, f"{what} token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
        need = self.scheduler.worst_case_blocks(seq)
        most = self.blocks.num_blocks_per_group
        if need > most:
            pool = ("the pool has" if self.blocks.num_groups == 1
                    else f"a dp group's pool (of {self.blocks.num_groups}) has")
            # Fewer output tokens help unless the prompt with one output token cannot fit.
            one = self.scheduler.request_blocks(n, 1)
            return ("prompt" if one > most else "max_tokens",
                    f"request needs up to {need} KV blocks ({n} prompt + {seq.max_output_tokens} "
                    f"output tokens), {pool} {most}")
        return None

    def abort(self, request_id: str) -> None:
        """End a request now; its KV blocks are free when this returns."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._finish_bookkeeping(seq)
        self._pending.append(final_output(seq, FinishReason.ABORT))

    @property
    def fatal_error(self) -> str | None:
        """Why the worker group is gone for good (a rank died or hung), else None: every
        later step fails with it, so the daemon reports unhealthy and stops."""
        return self.executor.fatal_error

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or self.scheduler.has_finished_to_report
                or bool(self._pending) or bool(self._in_flight))

    def fail_all(self, error: str) -> list[EngineOutput]:
        """End every request with ``error`` (the engine loop's last resort after a bug)."""
        for _so, fut in self._in_flight:
            fut.exception()                   # wait; whatever it produced is discarded
        self._in_flight.clear()
        outputs, self._pending = self._pending, []
        for seq in list(self.scheduler.requests.values()):
            outputs.append(self._fail(seq, error))
        return outputs

    def _finish_bookkeeping(self, seq: Sequence) -> None:
        self.output_processor.remove(seq.request_id)
        st = self._stats
        st.num_requests_finished += 1
        st.num_requests_failed += seq.finish_reason is FinishReason.ERROR
        st.num_requests_aborted += seq.finish_reason is FinishReason.ABORT

    def _fail(self, seq: Sequence, error: str) -> EngineOutput:
        log.error("request %s failed: %s", seq.request_id, error)
        if seq.finished:                      # e.g. its last output could not be processed
            seq.finish_reason = FinishReason.ERROR
        self.scheduler.finish(seq, FinishReason.ERROR)
        self._finish_bookkeeping(seq)
        return final_output(seq, FinishReason.ERROR, error)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Schedule and launch the next step; apply and emit the oldest one in flight."""
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        if so.num_scheduled or so.finished_request_ids or so.has_kv_transfers:
            self._in_flight.append((so, self.executor.execute_model(so)))
        if self._in_flight and (len(self._in_flight) >= self._max_in_flight or not so.num_scheduled):
            done, fut = self._in_flight.popleft()
            outputs += self._apply(done, fut.result(), t0)
        return outputs

    def finish_step(self) -> None:
        """After the outputs of ``step`` went out: the draft passes the step left
        (``EngineConfig.draft_after_emit``).  Optional: the next step runs them first."""
        self.executor.finish_step()

    def poll_idle(self) -> bool:
        """While idle: let the worker switch to graphs compiled in the background.  It
        switches between steps, and an idle engine takes none, so without this the runtime
        (and /v1/status) says "compiling" until the first request.  An empty step does it;
        True when the runtime changed."""
        if self.runtime.compile_state != "compiling" or self.has_unfinished():
            return False
        before = self.runtime
        out = self.executor.execute_model(SchedulerOutput(step_id=0)).result()
        if out.compile_update is not None:
            self._update_runtime(out.compile_update)
        return self.runtime is not before

    def _update_runtime(self, update: CompileState) -> None:
        self.runtime = dataclasses.replace(self.runtime, decode_path=update.decode_path,
                                           compile_seconds=update.seconds,
                                           compile_state=update.state)

    def _apply(self, so: SchedulerOutput, out: ModelRunnerOutput, t0: float) -> list[EngineOutput]:
        """Update the scheduler with one executed step and turn it into EngineOutputs."""
        if out.compile_update is not None:
            self._update_runtime(out.compile_update)
        failed = {**out.failed, **{rid: "the worker and the scheduler disagree on its stop"
                                   for rid in out.skipped}}
        emitted = [self._fail(self.scheduler.requests[rid], err) for rid, err in failed.items()
                   if rid in self.scheduler.requests]
        for rid, (num_blocks, rows) in out.kv_exports.items():   # before its last output
            if self.kv_export_sink is not None:
                self.kv_export_sink(rid, num_blocks, rows)
        results = self.scheduler.update(out)
        outputs, stops, failures = self.output_processor.process(results, out, self.clock())
        for seq, stop in stops:
            self.scheduler.finish(seq, FinishReason.STOP, stop)
        for seq, o in outputs:
            if o.finished:
                self._finish_bookkeeping(seq)
        emitted += [o for _seq, o in outputs] + [self._fail(seq, err) for seq, err in failures]
        if out.request_ids:
            self._recorder.observe(out, results, so.num_prefill_tokens, time.perf_counter() - t0)
            self._recorder.maybe_log(len(self.scheduler.running), len(self.scheduler.waiting),
                                     self.blocks.usage())
        return emitted

    def stats(self) -> EngineStats:
        st = self._stats
        st.num_waiting = len(self.scheduler.waiting)
        st.num_running = len(self.scheduler.running)
        st.kv_blocks_used = self.blocks.num_used_blocks
        st.kv_blocks_cached = self.blocks.num_cached_blocks
        st.kv_usage = self.blocks.usage()
        st.num_preemptions = self.scheduler.num_preemptions
        st.prefix_cache_queries = self.blocks.num_prefix_queries
        st.prefix_cache_hits = self.blocks.num_prefix_hits
        self._tier_stats(st)
        st.num_worker_requests = self.executor.num_held_requests
        return EngineStats(**{f: (list(v) if isinstance(v, list) else v)
                              for f, v in ((f, getattr(st, f)) for f in EngineStats.__slots__)})

    def _tier_stats(self, st: EngineStats) -> None:
        """The KV tiers' figures and the scheduler's swap counts (all 0 without a tier)."""
        fill_tier_stats(st, self.blocks, self.runtime.kv_block_bytes)
        sched = self.scheduler
        st.num_requests_swapped = sched.num_swapped
        st.num_swapped_out = sched.num_swapped_out
        st.num_swapped_in = sched.num_swapped_in
        st.num_preemptions_recomputed = sched.num_recomputed

    def idle_wait_s(self) -> float | None:
        """Seconds until queued prefills must run (maxQueueDelayMicroseconds), if idle."""
        if self._in_flight:
            return None
        deadline = self.scheduler.next_deadline()
        return None if deadline is None else max(0.0, deadline - self.clock())

    def generate(self, requests: list[EngineRequest]) -> dict[str, list[EngineOutput]]:
        """Run ``requests`` to completion on the calling thread (tests, scripts)."""
        outs: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        while self.has_unfinished():
            wait = self.idle_wait_s()
            if wait:
                time.sleep(wait)
            for o in self.step():
                outs[o.request_id].append(o)
            self.finish_step()
        return outs

    def shutdown(self) -> None:
        self.executor.shutdown()
