"""Per-request engine state.  No torch: the scheduler and block manager live on it.

Token counting (the whole scheduler is built on it):
  token_ids            prompt + output tokens emitted so far (n = len(token_ids)).
  num_computed_tokens  positions whose KV (main and MTP layers) is final; after every
                       step it is n - 1: the last emitted token is fed next step.
  num_draft_tokens     drafts held on the device by the worker's MTP proposer for the next
                       step; they are fed after the last token and verified (also by the
                       recompute step after a preemption).  A step that accepts ``a`` of
                       them advances num_computed_tokens by (new tokens) + a, i.e.
                       rejected drafts roll back.
  num_inflight_steps   steps scheduled whose output has not been applied yet (0 or 1; 1
                       only under asynchronous scheduling, where the next step is
                       scheduled with placeholders for that step's tokens).
Prefill, decode and recompute after preemption are the same: feed
token_ids[num_computed_tokens:] (+ drafts).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from server.kvblock.key import BlockKey
from server.engine.protocol import FinishReason, RequestCounters, SamplingParams
from server.engine.token_view import TokenView


class SequenceStatus(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence(TokenView):
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    max_output_tokens: int            # min(max_tokens, maxIterTimes, maxSeqLen - prompt)
    seed: int                         # every random draw of this request derives from it
    arrival_time: float = 0.0
    stop_ids: frozenset[int] = frozenset()   # EOS (unless ignore_eos) + stop_token_ids
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_draft_tokens: int = 0
    num_inflight_steps: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0        # leading blocks registered in the prefix cache
    block_hashes: list[BlockKey] = field(default_factory=list)   # keys of its registered blocks
    prefix_keys: list[BlockKey] = field(default_factory=list)    # keys of its full blocks so far
    reserved_blocks: int = 0          # worst-case block budget when admitted in reserve mode
    dp_group: int = 0                 # attention data parallel group its blocks come from
    swap_slots: list[int] = field(default_factory=list)   # host tier slots while swapped out
    swap_num_computed: int = 0        # computed positions its swapped-out blocks hold
    export_kv: bool = False           # PD prefill: the worker exports the prompt blocks' KV
    remote_kv: tuple = ()             # PD decode: prompt blocks' rows from P (RemoteRow each)
    # PD: the oldest role version of peer rows its KV derives from (pulled rows, or cached
    # blocks computed from them); None: none.  kv/block_manager.py, purge_peer_blocks.
    peer_epoch: int | None = None
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    counters: RequestCounters = field(default_factory=RequestCounters)
    first_token_time: float | None = None
    error: str | None = None

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
