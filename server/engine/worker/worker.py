"""The worker: the one owner of device state.

A worker holds the model, the KV pool tensors, the runner, the MTP proposer (held drafts
and their probabilities) and a ``RequestState`` per request.  It is driven only by
``SchedulerOutput`` messages and answers with ``ModelRunnerOutput``s (messages.py), so the
same interface can sit in this process (executor/in_process.py) or in another one.

Its optional parts are objects it is given or builds once, each behind one narrow call:
the KV transfer (kv/transfer/kv_transfer.py: host and disk tiers, PD rows; ``apply`` before a step,
``export`` after a PD prefill), the step's graphs (worker/step_graphs.py: ``adopt``
between steps), the grammar book (sample/grammar.py), the rank group
(worker/rank_group.py: agreement between ranks) and the drafts left for after a step
(``finish_step``).

A step that raises is retried request by request: the ones that still fail are reported
in ``ModelRunnerOutput.failed`` and the rest complete (their KV is simply rewritten).
Nothing is committed (tokens, drafts) until a step has succeeded.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from server.engine.batch.request_state import RequestState
from server.engine.config import EngineConfig
from server.engine.kv.cache import (
    KVCacheSpec,
    allocate_kv_caches,
    num_blocks_for,
    rank_blocks,
    stripe_kv_caches,
)
from server.engine.kv.transfer import KVTransfer, StripePlace
from server.engine.messages import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from server.engine.runtime import lookahead_slots
from server.engine.sample import grammar
from server.engine.spec.draft_head import draft_head
from server.engine.spec.draft_layer import int8_draft_layers
from server.engine.sample.screened_head import screened_head
from server.engine.spec.policy import AdaptiveK, FixedK, SpecPolicy
from server.engine.spec.prediction import WINDOW_GAIN, PredictedDrafts, window_drafts
from server.engine.spec.proposer import MTPProposer, NoProposer
from server.engine.worker.rank_group import RankGroup, collective_error
from server.engine.worker.runner import ModelRunner, VerifiedStep
from server.engine.worker.step_graphs import StepGraphs
from server.model.kernels.report import kernel_report
from server.model.loading.arena import pack_weights
from server.model.static_decode import kv_form, supports_static_decode

log = logging.getLogger("server.engine")


@dataclass(slots=True)
class _PendingDrafts:
    """A step's draft passes, left to run after its tokens went out (``finish_step``)."""
    states: list[RequestState]
    step: VerifiedStep
    clean: bool                       # a clean cost sample for the speculation policy
    seconds: float                    # the step's time so far


class Worker:
    def __init__(self, model: Any, cfg: EngineConfig, num_spec_tokens: int,
                 policy: SpecPolicy | None = None, group: RankGroup | None = None,
                 draft_after_emit: bool = False) -> None:
        """``group``: the ranks of a tensor/expert-parallel model (worker/rank_group.py); every
        decision that could differ between ranks (pool size, a step's measured time) is
        agreed over it, so all ranks run the same steps.

        ``draft_after_emit``: a step returns once its tokens are verified; its MTP passes
        run in ``finish_step``, which the engine loop calls after handing the tokens out
        (and ``execute_model`` calls first, if nobody did).  The drafts are needed only
        by the next step, so the tokens reach the client one draft pass earlier: the
        time to first token loses the MTP layer's pass over the prompt.  Only for a
        worker the engine calls inline, not in a rank group."""
        self.model = model
        self.group = group
        self.draft_after_emit = draft_after_emit and group is None
        self._pending: _PendingDrafts | None = None
        self._draft_failures: dict[str, str] = {}     # request id -> why, failed next step
        self.device = torch.device(cfg.device)
        k = num_spec_tokens
        if k:
            # Before anything stacks or packs the layer's weights (engine/spec/draft_layer.py).
            int8_draft_layers(model, grouped=group is not None)
        self.chained = max(0, k - 1)          # positions MTP's chained passes write past a window
        spec = self._allocate_kv(model, cfg, k)
        self.kv_transfer = KVTransfer(
            self.kv_caches, self.device, KVTransfer.host_slots_for(
                spec.bytes_per_block, cfg.host_cache_blocks, cfg.host_cache_gb),
            cfg.kv_pool_async_write, self.stripes)
        self.static_decode = cfg.static_decode and supports_static_decode(model, self.kv_caches)
        # Serving only: the layers then no longer call q_a and kv_a (gate and up) one by one,
        # which tools that hook those modules (calibration) would miss.
        model.stack_projections()
        if self.static_decode:
            model.static_decoder.prepare()
            model.static_decoder.kv_form = kv_form(self.kv_caches)
        if self.device.type == "cpu":
            pack_weights(model)                 # the step's weights in one stream (loading/arena.py)
        self.graphs = StepGraphs(model, cfg, self.device, self.static_decode, 1 + k)
        mtp: MTPProposer | NoProposer = NoProposer()
        drafts_head = draft_head(model) if k else None
        if k:
            if policy is None:
                policy = AdaptiveK(k) if cfg.adaptive_speculation else FixedK(k)
            mtp = MTPProposer(model, self.kv_caches, cfg.block_size, policy, self.device,
                              self.static_decode, drafts_head,
                              defer_kv_writes=self.group is None)
        # Requests' predictions (OpenAI Predicted Outputs) draft in front of MTP.
        self.proposer = PredictedDrafts(mtp, self._prediction_drafts(model, cfg))
        self.runner = ModelRunner(model, self.kv_caches, cfg.block_size, self.proposer, self.device,
                                  self.static_decode,
                                  screened_head(model, drafts_head, grouped=group is not None))
        # Compiled grammars (sample/grammar.py); the API layer compiles into it before submitting
        # when this worker runs in its process, so the engine thread only copies.
        self.grammars = grammar.GrammarBook(cfg.tokenizer_dir, model.config.vocab_size)
        self.requests: dict[str, RequestState] = {}

    def _prediction_drafts(self, model: Any, cfg: EngineConfig) -> int:
        """Predicted drafts per step: as configured where a window of them pays on this
        device, fewer or none where it does not (prediction.window_drafts), agreed over a
        rank group (every rank must feed the same windows)."""
        n, gain = window_drafts(model.lm_head.weight, cfg.prediction_draft_tokens,
                                product=model.products.linear)
        if self.group is not None:
            n = self.group.agree_min(n)
        if n == 0 and cfg.prediction_draft_tokens:
            log.info("predicted outputs: predictions are not verified on this device: no window "
                     "of 2 to %d rows gains %.1fx one row's tokens/s (the vocabulary head's "
                     "product, measured at start)", cfg.prediction_draft_tokens + 1, WINDOW_GAIN)
        elif n < cfg.prediction_draft_tokens:
            log.info("predicted outputs: up to %d predicted drafts a step, not %d: a window of "
                     "%d rows gains %.2fx one row's tokens/s here (less than %.1fx for more)",
                     n, cfg.prediction_draft_tokens, n + 1, gain, WINDOW_GAIN)
        return n

    def _allocate_kv(self, model: Any, cfg: EngineConfig, k: int) -> KVCacheSpec:
        """The KV pool: as many blocks as the budget holds, no more than the batch can use
        (agreed over a rank group, so every rank has the same pool).  With sp > 1 (or
        dp > 1) the budget buys this rank's stripe and the pool is sp (dp) stripes
        (kv/cache.py)."""
        # kv_cache_dtype "int8" quantizes every layer's latent; otherwise the layers the
        # checkpoint's FA3 scales name (none for a float checkpoint).
        int8_layers = frozenset(range(model.num_kv_layers)) if cfg.kv_cache_dtype == "int8" \
            else model.kv_cache_int8_layers
        spec = KVCacheSpec(model.num_kv_layers, cfg.block_size, model.kv_cache_dim,
                           next(model.parameters()).dtype,
                           rope_dim=model.config.qk_rope_head_dim, int8_layers=int8_layers)
        self.num_int8_kv_layers = len(int8_layers)
        par = cfg.parallel
        stripes = par.kv_stripes if self.group is not None else 1
        per_seq = -(-(cfg.max_seq_len + lookahead_slots(k, cfg.async_scheduling)) // cfg.block_size)
        blocks = num_blocks_for(
            spec, mem_size_gb=cfg.mem_size_gb, device=self.device,
            max_useful_blocks=rank_blocks(cfg.max_batch_size * per_seq + 1, stripes),
            num_blocks=None if cfg.num_blocks is None else rank_blocks(cfg.num_blocks, stripes))
        if self.group is not None:
            blocks = self.group.agree_min(blocks)
        stripe = par.kv_stripe(self.group.rank) if stripes > 1 else 0
        self.kv_caches = stripe_kv_caches(allocate_kv_caches(spec, blocks, self.device),
                                          stripe, stripes, cfg.block_size)
        self.num_kv_blocks = self.kv_caches[0].num_blocks
        self.sp = par.sp if stripes > 1 else 1
        self.dp = par.dp if stripes > 1 else 1
        # PD rows by global block id over the stripes (kv/transfer/striped.py).
        self.stripes = StripePlace.of(par, self.group.rank) if stripes > 1 else None
        if stripes > 1:
            log.info("KV pool striped over %s: %d blocks, %d on each rank",
                     f"sp {self.sp} ranks" if self.sp > 1 else f"dp {self.dp} groups",
                     self.num_kv_blocks, self.num_kv_blocks // stripes)
        return spec

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.num_kv_blocks, self.num_int8_kv_layers, self.kv_transfer.host_slots,
                          self.kv_transfer.bytes_per_block, self.graphs.current(),
                          sp=self.sp, dp=self.dp,
                          kv_blocks_per_rank=self.num_kv_blocks // (self.sp * self.dp),
                          prediction_draft_tokens=self.proposer.max_tokens,
                          kernels=tuple(kernel_report(self.model).items()))

    @property
    def policy(self) -> SpecPolicy | None:
        return self.proposer.policy

    @property
    def num_held_requests(self) -> int:
        """Requests with state on the worker (live ones, plus finished ones until the next
        step tells it); a leak shows here."""
        return len(self.requests)

    def kv_rows(self, request_id: str, positions, layer: int) -> torch.Tensor:
        """A copy of the KV cache rows of ``request_id`` at ``positions`` in cache layer
        ``layer`` (-1: the MTP layer), for checks and debugging; call between steps."""
        self.finish_step()
        self.proposer.flush_kv()
        st = self.requests[request_id]
        bs = self.runner.block_size
        return self.kv_caches[layer].read_slots([st.block_table[p // bs] * bs + p % bs
                                                 for p in positions])

    def finish_step(self) -> None:
        """Run the draft passes the last step left (``draft_after_emit``) and hold their
        drafts.  A pass that fails fails its requests in the next step: their tokens are
        out, and without drafts they cannot take part in the step the scheduler plans."""
        if self._pending is None:
            return
        p, self._pending = self._pending, None
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                drafts = p.step.drafting.run()
        except Exception as exc:                # noqa: BLE001 - handed to the next step
            log.exception("the draft pass of %d requests failed", len(p.states))
            for st in p.states:
                self.proposer.drop(st.request_id)
                self._draft_failures[st.request_id] = f"engine draft pass failed: {exc!r}"
            return
        self.proposer.commit(p.states, drafts, p.step.k, p.step.num_drafts, p.step.sampled)
        if p.clean:
            self.proposer.observe_step(len(p.states), p.step.k,
                                       p.seconds + time.perf_counter() - t0)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput(so.step_id)
        self.finish_step()
        if so.new_requests or so.finished_request_ids or so.preempted_request_ids \
                or so.has_kv_transfers:
            # Slots change owners or get copied: the held k = 0 MTP KV first (spec/deferred_kv.py).
            self.proposer.flush_kv()
        out.failed.update(self._draft_failures)
        self._draft_failures.clear()
        out.compile_update = self.graphs.adopt()
        self.kv_transfer.apply(so)            # before the forward, which reads or reuses them
        states = self._step_states(so, out)
        out.num_held_requests = len(self.requests)
        if not states:
            return out
        self.proposer.fit(states, self.runner.block_size, self.chained)
        exports = any(new.export_kv for new in so.new_requests)
        # PD prefill exports read the MTP layer's KV of the prompt: drafted in the step.
        defer = self.draft_after_emit and not exports
        t0 = time.perf_counter()
        done = self._run(states, defer, out)
        for group, res in done:
            self._commit(group, res, out)
        if exports:                           # a prompt is prefilled in one step
            self.proposer.flush_kv()
            self._export_prompts(states, out)
        out.execute_time_s = time.perf_counter() - t0
        self._observe(so, states, done, out)
        return out

    def _step_states(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestState]:
        """Apply the message's request changes; the states this step computes, in batch
        order (cached requests, then new ones)."""
        for rid in so.finished_request_ids:
            self.requests.pop(rid, None)
            self.proposer.drop(rid)
        for new in so.new_requests:
            st = self.requests[new.request_id] = RequestState.from_new(new)
            if new.sampling.grammar is not None:
                try:
                    st.matcher = self.grammars.matcher(new.sampling.grammar, st.output_token_ids)
                except grammar.GrammarError as exc:
                    out.failed[new.request_id] = str(exc)
        states: list[RequestState] = []
        for cached in so.cached_requests:
            st = self.requests.get(cached.request_id)
            if st is None:
                out.failed[cached.request_id] = "the worker holds no state for this request"
                continue
            if cached.request_id in out.failed:   # its draft pass failed
                continue
            st.block_table.extend(cached.new_block_ids)
            if st.stopped:                    # an earlier step ended it: nothing to compute
                out.skipped.append(cached.request_id)
                continue
            states.append(st)
        return states + [self.requests[new.request_id] for new in so.new_requests
                         if new.request_id not in out.failed]

    def _run(self, states: list[RequestState], defer: bool, out: ModelRunnerOutput
             ) -> list[tuple[list[RequestState], VerifiedStep]]:
        """The step; if it raises, each request alone (the ones that fail again fail)."""
        try:
            return [(states, self.runner.execute(states, defer_drafts=defer))]
        except Exception as exc:
            if self.group is not None and collective_error(exc):
                raise                         # the group is broken: no retry can succeed
            log.exception("engine step failed; retrying its %d requests one by one", len(states))
        done = []
        for st in states:
            try:
                done.append(([st], self.runner.execute([st])))
            except Exception as exc:
                if self.group is not None and collective_error(exc):
                    raise
                out.failed[st.request_id] = f"engine step failed: {exc!r}"
        return done

    def _observe(self, so: SchedulerOutput, states: list[RequestState],
                 done: list[tuple[list[RequestState], VerifiedStep]], out: ModelRunnerOutput) -> None:
        """Hold the step's draft passes for ``finish_step``, and give the speculation
        policy the step's cost when it is a clean sample: decode only, every request
        verified the same k it now drafted (the first step after a switch mixes two k's)."""
        res = done[0][1] if len(done) == 1 and len(done[0][0]) == len(states) else None
        decode_only = not so.new_requests and all(st.num_new_tokens == 1 for st in states)
        clean = res is not None and decode_only and all(d == res.k for d in res.num_drafts) \
            and not any(out.num_predicted)
        if res is not None and res.drafting is not None:     # sampled once drafted
            self._pending = _PendingDrafts(states, res, clean, out.execute_time_s)
        elif clean:
            seconds = out.execute_time_s
            if self.group is not None and self.proposer.policy is not None:
                seconds = self.group.agree_max(seconds)
            self.proposer.observe_step(len(states), res.k, seconds)

    def _export_prompts(self, states: list[RequestState], out: ModelRunnerOutput) -> None:
        """PD prefill: the full prompt blocks' rows of each request whose prompt this step
        finished (what a decode instance's prefix match can take: block b while
        (b + 1) * block_size <= prompt - 1, so the MTP layer's KV at its last slot, which
        reads the next token, is final).  With a striped pool each export is a collective
        (kv/transfer/striped.py): every rank runs this loop over the same states."""
        bs = self.runner.block_size
        for st in states:
            if st.export_kv and st.num_computed_tokens >= st.num_prompt_tokens \
                    and st.request_id not in out.failed:
                n = (st.num_prompt_tokens - 1) // bs
                out.kv_exports[st.request_id] = (n, self.kv_transfer.export(st.block_table[:n]))
                st.export_kv = False

    def _commit(self, states: list[RequestState], res: VerifiedStep, out: ModelRunnerOutput) -> None:
        """Advance the states by the step's tokens; stage predicted drafts for the next step
        (they are held once the proposer commits this step: now, or in finish_step)."""
        predicted = [self.proposer.num_predicted(st.request_id) for st in states]
        for st, toks, d, lp, p in zip(states, res.sampled, res.num_drafts, res.logprobs, predicted):
            st.advance(toks)
            if st.matcher is not None:
                try:
                    grammar.commit(st.matcher, toks, st.stopped)
                except grammar.GrammarError as exc:
                    out.failed[st.request_id] = str(exc)
                    continue
            out.request_ids.append(st.request_id)
            out.sampled_token_ids.append(toks)
            out.num_drafts.append(d)
            out.num_predicted.append(p)
            out.num_drafts_next.append(self.proposer.stage(st, toks) or res.k)
            out.logprobs.append(lp)
        if res.drafting is None:                  # else the drafts come in finish_step
            self.proposer.commit(states, res.drafts, res.k, res.num_drafts, res.sampled)
        out.num_tokens += res.num_tokens
        out.spec_k = res.k
        out.prompt_logprobs.update(res.prompt_logprobs)
