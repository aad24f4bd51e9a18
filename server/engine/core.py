"""The synchronous engine core: LLMEngine.step() = schedule -> execute -> update -> emit.

One thread calls it (the AsyncEngine thread in engine.py, or a test); it owns the model,
the KV pool, the scheduler and the runner.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for
from server.engine.mtp import AdaptiveK, FixedK, SpecPolicy
from server.engine.output import RequestOutput, final_output
from server.engine.protocol import EngineOutput, EngineRequest, FinishReason
from server.engine.runner import ModelRunner, RunnerOutput
from server.engine.scheduler import ScheduledBatch, Scheduler
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.stats import EngineStats

log = logging.getLogger("server.engine")
LOG_INTERVAL_S = 10.0          # period of the "SpecDecoding metrics" / throughput log line


class EngineError(ValueError):
    """The engine cannot be built from this configuration (message says what and why)."""


class LLMEngine:
    """Synchronous engine core.  Not thread-safe: one thread calls everything."""

    def __init__(self, model: Any, cfg: EngineConfig, tokenizer: Any = None, *,
                 eos_token_ids: set[int] | None = None, policy: SpecPolicy | None = None,
                 clock=time.monotonic) -> None:
        if cfg.kv_cache_dtype != "auto":
            raise EngineError(f"kv_cache_dtype {cfg.kv_cache_dtype!r} is not supported yet; "
                              "allowed: 'auto' (the model's dtype)")
        self.cfg = cfg
        self.model = model
        self.tokenizer = tokenizer
        self.clock = clock
        k = cfg.num_speculative_tokens
        if k and not model.has_mtp:
            log.warning("num_speculative_tokens=%d but the checkpoint has no MTP weights: "
                        "decoding without MTP", k)
            k = 0
        self.num_spec_tokens = k
        if eos_token_ids is None:
            eos_token_ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
            if not eos_token_ids:
                eos = getattr(model.config, "eos_token_id", None)
                eos_token_ids = set(eos if isinstance(eos, (list, tuple)) else
                                    ([eos] if eos is not None else []))
        self.eos_token_ids = frozenset(eos_token_ids)
        device = torch.device(cfg.device)
        dtype = next(model.parameters()).dtype
        spec = KVCacheSpec(model.num_kv_layers, cfg.block_size, model.kv_cache_dim, dtype)
        per_seq = -(-(cfg.max_seq_len + 2 * k) // cfg.block_size)
        num_blocks = num_blocks_for(spec, mem_size_gb=cfg.mem_size_gb, device=device,
                                    max_useful_blocks=cfg.max_batch_size * per_seq + 1,
                                    num_blocks=cfg.num_blocks)
        self.kv_caches = allocate_kv_caches(spec, num_blocks, device)
        self.blocks = BlockManager(num_blocks, cfg.block_size,
                                   enable_prefix_cache=cfg.enable_prefix_cache,
                                   hash_next_token=k > 0)
        self.scheduler = Scheduler(cfg, self.blocks, num_spec_tokens=k, clock=clock)
        if policy is None:
            policy = AdaptiveK(k) if k and cfg.adaptive_speculation else FixedK(k)
        self.policy = policy
        self.runner = ModelRunner(model, self.kv_caches, cfg.block_size, self.policy, device)
        self._seqs: dict[str, Sequence] = {}
        self._outputs: dict[str, RequestOutput] = {}
        self._pending: list[EngineOutput] = []          # outputs produced outside step()
        self._stats = EngineStats(kv_blocks_total=num_blocks, block_size=cfg.block_size,
                                  num_speculative_tokens=k, accepted_per_position=[0] * k,
                                  steps_per_k=[0] * (k + 1), spec_current_k=k)
        self._rng = random.Random()
        self._last_log = (time.monotonic(), 0, 0, 0, 0)   # time, steps, drafts, draft tokens, accepted
        self._last_steps_per_k = [0] * (k + 1)

    # ---- requests -------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """Queue ``req``; a request the engine cannot serve finishes at once with an error."""
        if req.request_id in self._seqs:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        p = req.sampling
        n = len(req.prompt_token_ids)
        seed = p.seed if p.seed is not None else self._rng.getrandbits(63)
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        seq = Sequence(req.request_id, list(req.prompt_token_ids), n, p,
                       max_output_tokens=min(p.max_tokens, self.cfg.max_iter_times,
                                             self.cfg.max_seq_len - n),
                       seed=int(seed) & ((1 << 63) - 1),
                       arrival_time=req.arrival_time or self.clock(), stop_ids=stop_ids)
        seq.counters.prompt_tokens = n
        self._seqs[req.request_id] = seq
        error = self._check(seq)
        if error:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = FinishReason.ERROR
            self._finish_bookkeeping(seq)
            self._pending.append(final_output(seq, FinishReason.ERROR, error))
            return
        self._outputs[req.request_id] = RequestOutput(seq, self.tokenizer)
        self.scheduler.add(seq)

    def _check(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        vocab = self.model.config.vocab_size
        if n == 0:
            return "the prompt is empty"
        if n >= self.cfg.max_seq_len:
            return f"prompt has {n} tokens; maxSeqLen {self.cfg.max_seq_len} leaves no room for output"
        if seq.max_output_tokens < 1:
            return "max_tokens must be at least 1"
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
            return f"prompt token ids must lie in [0, {vocab})"
        p = seq.sampling
        for what, ids in (("logit_bias", list(p.logit_bias or ())), ("stop_token_ids", p.stop_token_ids)):
            bad = [int(t) for t in ids if not 0 <= int(t) < vocab]
            if bad:
                return f"{what} token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
        need = self.scheduler.worst_case_blocks(seq)
        if need > self.blocks.num_blocks:
            return (f"request needs up to {need} KV blocks ({n} prompt + {seq.max_output_tokens} "
                    f"output tokens), the pool has {self.blocks.num_blocks}")
        return None

    def abort(self, request_id: str) -> None:
        """End a request now; its KV blocks are free when this returns."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._finish_bookkeeping(seq)
        self._pending.append(final_output(seq, FinishReason.ABORT))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def _finish_bookkeeping(self, seq: Sequence) -> None:
        self.runner.drop(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        self._outputs.pop(seq.request_id, None)
        st = self._stats
        st.num_requests_finished += 1
        st.num_requests_failed += seq.finish_reason is FinishReason.ERROR
        st.num_requests_aborted += seq.finish_reason is FinishReason.ABORT

    def _fail(self, seq: Sequence, error: str) -> EngineOutput:
        log.error("request %s failed: %s", seq.request_id, error)
        self.scheduler.finish(seq, FinishReason.ERROR)
        self._finish_bookkeeping(seq)
        return final_output(seq, FinishReason.ERROR, error)

    # ---- the step -------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        try:
            result = self.runner.execute(batch)
        except Exception:                     # find the request(s) that break the step
            log.exception("engine step failed; retrying its %d requests one by one", len(batch))
            batch, result, failed = self._isolate(batch)
            outputs += failed
            if not batch.seqs:
                return outputs
        results = self.scheduler.update(batch, result.sampled, result.num_drafts_next)
        now = self.clock()
        by_seq = {id(s.seq): i for i, s in enumerate(batch.seqs)}
        for res in results:
            seq = res.seq
            i = by_seq[id(seq)]
            try:
                if seq.first_token_time is None and res.new_token_ids:
                    seq.first_token_time = now
                out, hit = self._outputs[seq.request_id].process(
                    res.new_token_ids, result.logprobs[i], res.finished)
                if hit is not None and not seq.finished:
                    self.scheduler.finish(seq, FinishReason.STOP, hit.stop)
                if out.finished:
                    self._finish_bookkeeping(seq)
                outputs.append(out)
            except Exception as exc:          # this request only
                log.exception("output processing failed for %s", seq.request_id)
                if seq.finished:
                    seq.status = SequenceStatus.RUNNING   # let _fail do the bookkeeping
                    seq.finish_reason = None
                    self.scheduler.running.append(seq)
                outputs.append(self._fail(seq, f"output processing failed: {exc!r}"))
        self._observe(batch, results, result.num_drafts_next, time.perf_counter() - t0)
        return outputs

    def _isolate(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, RunnerOutput, list[EngineOutput]]:
        """Run each sequence of a failed step alone: the ones that still fail finish with
        an error, the rest continue (their KV for this step is simply rewritten)."""
        ok = ScheduledBatch(preempted=batch.preempted)
        merged = RunnerOutput([], [], [])
        failed = []
        for sched in batch.seqs:
            try:
                one = self.runner.execute(ScheduledBatch([sched]))
            except Exception as exc:
                failed.append(self._fail(sched.seq, f"engine step failed: {exc!r}"))
                continue
            ok.seqs.append(sched)
            merged.sampled += one.sampled
            merged.num_drafts_next += one.num_drafts_next
            merged.logprobs += one.logprobs
        return ok, merged, failed

    def _observe(self, batch, results, num_drafts_next: list[int], dt: float) -> None:
        st = self._stats
        k = num_drafts_next[0] if num_drafts_next else 0
        if self.num_spec_tokens:
            st.spec_current_k = k
            st.steps_per_k[min(k, self.num_spec_tokens)] += 1
            # A clean cost sample for the policy: decode only, every sequence verified the
            # same k it now drafted (the first step after a switch mixes two k's).
            if all(not s.is_prefill and s.num_new_tokens == 1 and s.num_drafts == k for s in batch.seqs):
                self.policy.observe_step(len(batch), k, dt)
        st.num_steps += 1
        st.step_time_total_s += dt
        st.last_step_time_s = dt
        st.last_step_num_tokens = batch.num_tokens
        st.last_step_batch_size = len(batch)
        st.num_prompt_tokens += sum(s.num_new_tokens for s in batch.seqs if s.is_prefill)
        st.num_generation_tokens += sum(len(r.new_token_ids) for r in results)
        drafts_of = {id(s.seq): s.num_drafts for s in batch.seqs}
        for r in results:
            n = drafts_of[id(r.seq)]
            if n:
                st.num_drafts += 1
                st.num_draft_tokens += n
                st.num_accepted_tokens += r.num_accepted
                for i in range(r.num_accepted):
                    st.accepted_per_position[i] += 1
        now = time.monotonic()
        if now - self._last_log[0] >= LOG_INTERVAL_S:
            self._log_metrics(now)

    def _log_metrics(self, now: float) -> None:
        st = self._stats
        t0, steps0, drafts0, dtok0, acc0 = self._last_log
        self._last_log = (now, st.num_steps, st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
        drafts, dtok, acc = st.num_drafts - drafts0, st.num_draft_tokens - dtok0, st.num_accepted_tokens - acc0
        msg = (f"engine: {st.num_steps - steps0} steps in {now - t0:.1f} s, running "
               f"{len(self.scheduler.running)}, waiting {len(self.scheduler.waiting)}, "
               f"KV usage {self.blocks.usage():.1%}")
        if dtok:
            msg += (f"; SpecDecoding: mean acceptance length {1 + acc / drafts:.2f}, "
                    f"acceptance rate {acc / dtok:.1%} ({acc}/{dtok} draft tokens)")
        if self.num_spec_tokens:
            per_k = st.steps_per_k
            prev = self._last_steps_per_k
            self._last_steps_per_k = list(per_k)
            msg += (f"; k now {st.spec_current_k} (steps per k since last: "
                    + ", ".join(f"{j}:{per_k[j] - prev[j]}" for j in range(len(per_k))) + ")")
        log.info(msg)

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
        return EngineStats(**{f: (list(v) if isinstance(v, list) else v)
                              for f, v in ((f, getattr(st, f)) for f in EngineStats.__slots__)})

    def idle_wait_s(self) -> float | None:
        """Seconds until queued prefills must run (maxQueueDelayMicroseconds), if idle."""
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
        return outs
