"""Engine-wide counters for /metrics (read through AsyncEngine.stats()).  No torch.

Cumulative counters only grow; gauges describe the moment ``stats()`` was called.
Spec-decode words follow the glossary in protocol.py.  Derived figures:
  acceptance rate          = num_accepted_tokens / num_draft_tokens
  mean acceptance length   = 1 + num_accepted_tokens / num_drafts  (includes the bonus token)
  per-position rate i      = accepted_per_position[i] / num_drafts
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineStats:
    # gauges
    num_waiting: int = 0                 # requests queued (incl. preempted, awaiting recompute)
    num_running: int = 0                 # requests holding KV blocks
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0              # held by requests (cached free blocks count as free)
    kv_blocks_cached: int = 0            # blocks findable in the prefix cache (used or free)
    kv_usage: float = 0.0                # kv_blocks_used / kv_blocks_total
    block_size: int = 0
    num_speculative_tokens: int = 0      # configured k (0: MTP off); the most any step drafts
    spec_current_k: int = 0              # drafts per sequence chosen by the last step (adaptive)
    # cumulative counters
    num_steps: int = 0                   # engine steps that ran the model
    num_requests_finished: int = 0
    num_requests_failed: int = 0         # finished with FinishReason.ERROR
    num_requests_aborted: int = 0
    num_prompt_tokens: int = 0           # prompt tokens computed (recompute after preemption too)
    num_generation_tokens: int = 0       # tokens emitted
    num_preemptions: int = 0
    prefix_cache_queries: int = 0        # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0           # of which found
    num_drafts: int = 0                  # verification windows that carried drafts
    num_draft_tokens: int = 0            # draft tokens proposed and verified
    num_accepted_tokens: int = 0         # draft tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: accepted at draft i
    num_prediction_tokens: int = 0       # requests' predicted tokens verified as drafts
    num_accepted_prediction_tokens: int = 0   # of which accepted
    steps_per_k: list[int] = field(default_factory=list)  # [k+1]: steps that drafted j tokens
    step_time_total_s: float = 0.0       # wall time inside step() (schedule..emit)
    last_step_time_s: float = 0.0
    last_step_num_tokens: int = 0        # tokens fed to the main model by the last step
    last_step_batch_size: int = 0
    num_worker_requests: int = 0         # requests with state on the worker (leak check)
    # host KV tier (kv/host_tier.py); all 0 without one
    host_blocks_total: int = 0
    host_blocks_used: int = 0            # cached prefix blocks + swap slots
    host_blocks_cached: int = 0          # prefix blocks findable there
    host_usage: float = 0.0              # host_blocks_used / host_blocks_total
    host_cache_hits: int = 0             # prompt tokens found there (prefix_cache_hits: device)
    kv_blocks_saved: int = 0             # device -> host block copies
    host_saves_skipped: int = 0          # evicted blocks not kept: every slot busy that step
    kv_blocks_loaded: int = 0            # host -> device block copies
    kv_bytes_saved: int = 0
    kv_bytes_loaded: int = 0
    num_requests_swapped: int = 0        # gauge: waiting requests whose blocks are in the tier
    num_swapped_out: int = 0             # preemptions that swapped instead of recomputing
    num_swapped_in: int = 0              # resumes that loaded their blocks back
    num_preemptions_recomputed: int = 0  # preemptions that dropped the KV (recompute)
    # disk KV tier (kv/disk_tier.py); all 0 without one
    disk_blocks_total: int = 0
    disk_blocks_used: int = 0
    disk_cache_hits: int = 0             # prompt tokens found there (verified files)
    remote_cache_hits: int = 0           # PD decode: prompt tokens whose KV came from P
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_corrupt_files: int = 0          # damaged files found and removed (never served)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class StatsRecorder:
    """Folds each applied step into ``EngineStats`` and logs a throughput / SpecDecoding line
    every ``log_interval_s`` seconds."""

    def __init__(self, stats: EngineStats, num_spec_tokens: int, log: Any,
                 log_interval_s: float = 10.0) -> None:
        self.stats = stats
        self.k = num_spec_tokens
        self.log = log
        self.log_interval_s = log_interval_s
        self._last = (time.monotonic(), 0, 0, 0, 0)   # time, steps, drafts, draft tokens, accepted
        self._last_steps_per_k = [0] * (num_spec_tokens + 1)

    def observe(self, out: Any, results: list, num_prefill_tokens: int, seconds: float) -> None:
        """``out``: the step's ModelRunnerOutput; ``results``: Scheduler.update's StepResults."""
        st = self.stats
        if self.k and out.request_ids:
            st.spec_current_k = out.spec_k
            st.steps_per_k[min(out.spec_k, self.k)] += 1
        st.num_steps += 1
        st.step_time_total_s += seconds
        st.last_step_time_s = seconds
        st.last_step_num_tokens = out.num_tokens
        st.last_step_batch_size = len(out.request_ids)
        st.num_prompt_tokens += num_prefill_tokens
        for r in results:
            st.num_generation_tokens += len(r.new_token_ids)
            if r.predicted:
                st.num_prediction_tokens += r.num_drafts
                st.num_accepted_prediction_tokens += r.num_accepted
            elif r.num_drafts:
                st.num_drafts += 1
                st.num_draft_tokens += r.num_drafts
                st.num_accepted_tokens += r.num_accepted
                for i in range(r.num_accepted):
                    st.accepted_per_position[i] += 1

    def maybe_log(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        now = time.monotonic()
        if now - self._last[0] < self.log_interval_s:
            return
        st = self.stats
        t0, steps0, drafts0, dtok0, acc0 = self._last
        self._last = (now, st.num_steps, st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
        drafts, dtok, acc = st.num_drafts - drafts0, st.num_draft_tokens - dtok0, st.num_accepted_tokens - acc0
        msg = (f"engine: {st.num_steps - steps0} steps in {now - t0:.1f} s, running "
               f"{num_running}, waiting {num_waiting}, KV usage {kv_usage:.1%}")
        if dtok:
            msg += (f"; SpecDecoding: mean acceptance length {1 + acc / drafts:.2f}, "
                    f"acceptance rate {acc / dtok:.1%} ({acc}/{dtok} draft tokens)")
        if self.k:
            per_k, prev = st.steps_per_k, self._last_steps_per_k
            self._last_steps_per_k = list(per_k)
            msg += (f"; k now {st.spec_current_k} (steps per k since last: "
                    + ", ".join(f"{j}:{per_k[j] - prev[j]}" for j in range(len(per_k))) + ")")
        self.log.info(msg)
