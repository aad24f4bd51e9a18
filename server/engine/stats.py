"""Engine-wide counters for /metrics (read through AsyncEngine.stats()).  No torch.

Cumulative counters only grow; gauges describe the moment ``stats()`` was called.
Spec-decode words follow the glossary in protocol.py.  Derived figures:
  acceptance rate          = num_accepted_tokens / num_draft_tokens
  mean acceptance length   = 1 + num_accepted_tokens / num_drafts  (includes the bonus token)
  per-position rate i      = accepted_per_position[i] / num_drafts
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    steps_per_k: list[int] = field(default_factory=list)  # [k+1]: steps that drafted j tokens
    step_time_total_s: float = 0.0       # wall time inside step() (schedule..emit)
    last_step_time_s: float = 0.0
    last_step_num_tokens: int = 0        # tokens fed to the main model by the last step
    last_step_batch_size: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
