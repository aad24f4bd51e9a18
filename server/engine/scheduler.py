"""Continuous batching by token counting.  No torch here.

Each step every running sequence feeds ``token_ids[num_computed_tokens:]`` plus the drafts
it holds, and waiting sequences are admitted (FCFS) as prefills into the same batch
within maxPrefillTokens / maxPrefillBatchSize / maxBatchSize.  With supportSelectBatch a
step is either prefill-only or decode-only, chosen by MindIE's trade-off: a prefill stalls
every running decode for about prefillTimeMsPerReq each, an under-full decode batch wastes
decodeTimeMsPerReq per empty seat; prefill runs once the accumulated waste exceeds the
stall it would cause.

KV blocks.  Every scheduled sequence needs slots for its new tokens, its drafts and
``lookahead`` more (the chained MTP passes write k-1 positions past the verified ones).
Two admission modes keep the engine from ever deadlocking:
  * preemptible (maxPreemptCount > 0): blocks are taken as needed; when they run out the
    newest preemptible running sequence is preempted (blocks freed, recomputed later from
    its tokens).  A sequence preempted maxPreemptCount times is re-admitted reserved.
  * reserved (maxPreemptCount == 0, or after the last allowed preemption): admission
    holds back the sequence's worst-case block count, so it always completes.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from server.engine.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.protocol import FinishReason
from server.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int          # known tokens fed: token_ids[num_computed:num_computed+this]
    num_drafts: int              # drafts fed after them (held by the runner)
    start_pos: int               # num_computed_tokens when scheduled
    is_prefill: bool = False     # admitted from the queue this step (prompt or recompute)


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefills: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_drafts for s in self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass(slots=True)
class StepResult:
    """What update() did to one scheduled sequence."""
    seq: Sequence
    new_token_ids: list[int]     # emitted this step, cut after a stop
    num_accepted: int
    finished: bool


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, *, num_spec_tokens: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.num_spec_tokens = num_spec_tokens
        self.lookahead = max(0, num_spec_tokens - 1)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._reserved_outstanding = 0          # blocks promised to reserved sequences
        self._decode_waste_ms = 0.0
        self.num_preemptions = 0

    # ---- queue management -----------------------------------------------------------
    def worst_case_blocks(self, seq: Sequence) -> int:
        n = seq.num_prompt_tokens + seq.max_output_tokens + self.num_spec_tokens + self.lookahead
        return self.blocks.blocks_for(n)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_deadline(self) -> float | None:
        """When an idle engine must schedule the queued prefills (maxQueueDelayMicroseconds)."""
        if self.running or not self.waiting:
            return None
        return self.waiting[0].arrival_time + self.cfg.max_queue_delay_us / 1e6

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Finish ``seq`` (any state) and free its blocks at once."""
        if seq.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.num_draft_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _release(self, seq: Sequence) -> None:
        if seq.reserved_blocks:
            self._reserved_outstanding -= max(0, seq.reserved_blocks - len(seq.block_table))
            seq.reserved_blocks = 0
        self.blocks.free(seq)

    # ---- block helpers --------------------------------------------------------------
    def _room(self, seq: Sequence) -> int:
        """Blocks ``seq`` may take now: free ones minus what reserved sequences were promised."""
        own = max(0, seq.reserved_blocks - len(seq.block_table)) if seq.reserved_blocks else 0
        return self.blocks.num_free_blocks - (self._reserved_outstanding - own)

    def _grow(self, seq: Sequence, num_slots: int) -> bool:
        need = self.blocks.blocks_for(num_slots) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self._room(seq):
            return False
        before = len(seq.block_table)
        self.blocks.append_slots(seq, num_slots)
        if seq.reserved_blocks:
            self._reserved_outstanding -= min(len(seq.block_table), seq.reserved_blocks) - \
                min(before, seq.reserved_blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # The drafts it holds survive (the runner keeps them): the recompute step verifies
        # them exactly as the next decode step would have, so a seeded request's random
        # draws, and so its output, do not depend on whether it was preempted.
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.counters.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1

    # ---- schedule -------------------------------------------------------------------
    def _want_prefill(self, now: float) -> bool:
        if not self.waiting:
            return False
        cfg = self.cfg
        if not self.running:
            full = len(self.waiting) >= cfg.max_prefill_batch_size
            return full or now >= self.waiting[0].arrival_time + cfg.max_queue_delay_us / 1e6
        if not cfg.support_select_batch or len(self.running) >= cfg.max_batch_size:
            return len(self.running) < cfg.max_batch_size
        stall = cfg.prefill_time_ms_per_req * len(self.running)
        if self._decode_waste_ms >= stall:
            self._decode_waste_ms = 0.0
            return True
        self._decode_waste_ms += cfg.decode_time_ms_per_req * (cfg.max_batch_size - len(self.running))
        return False

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        now = self.clock()
        prefill = self._want_prefill(now)
        prefill_only = self.cfg.support_select_batch and prefill and bool(self.running)
        if not prefill_only:
            self._schedule_running(batch)
        if prefill:
            self._schedule_waiting(batch)
        return batch

    def _schedule_running(self, batch: ScheduledBatch) -> None:
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            n_new = seq.num_tokens - seq.num_computed_tokens
            slots = seq.num_tokens + seq.num_draft_tokens + self.lookahead
            while not self._grow(seq, slots):
                victim = self._pick_victim(i)
                if victim is None:
                    break
                batch.preempted.append(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue                       # seq preempted itself; running shifted
            if self.blocks.blocks_for(slots) > len(seq.block_table):
                i += 1                         # reserved everywhere: wait for blocks to free
                continue
            batch.seqs.append(ScheduledSeq(seq, n_new, seq.num_draft_tokens, seq.num_computed_tokens))
            i += 1
        # Preempted sequences go back to the front of the queue, oldest first.
        for victim in sorted(batch.preempted, key=lambda s: s.arrival_time, reverse=True):
            self.waiting.appendleft(victim)

    def _pick_victim(self, first: int) -> Sequence | None:
        """Newest preemptible sequence not yet scheduled this step (index >= ``first``)."""
        for seq in reversed(self.running[first:]):
            if not seq.reserved_blocks:
                return seq
        return None

    def _schedule_waiting(self, batch: ScheduledBatch) -> None:
        cfg = self.cfg
        num_tokens = 0
        num_prefills = 0
        preempted = {id(s) for s in batch.preempted}
        while self.waiting and len(self.running) < cfg.max_batch_size \
                and num_prefills < cfg.max_prefill_batch_size:
            seq = self.waiting[0]
            if id(seq) in preempted:
                break                          # freed this step for someone else: not now
            match = self.blocks.match_prefix(seq)
            n_new = seq.num_tokens - match.num_blocks * self.blocks.block_size
            if num_prefills and num_tokens + n_new > cfg.max_prefill_tokens:
                break
            slots = seq.num_tokens + seq.num_draft_tokens + self.lookahead
            need = self.blocks.blocks_for(slots) - match.num_blocks + match.num_free_hits
            reserve = cfg.max_preempt_count == 0 or seq.num_preemptions >= cfg.max_preempt_count
            worst = self.worst_case_blocks(seq) if reserve else 0
            extra = max(0, worst - self.blocks.blocks_for(slots))
            if need + extra > self.blocks.num_free_blocks - self._reserved_outstanding:
                break                          # FCFS: the head waits for room
            self.waiting.popleft()
            self.blocks.allocate(seq, match, slots)
            if reserve:
                seq.reserved_blocks = worst
                self._reserved_outstanding += max(0, worst - len(seq.block_table))
            if seq.num_preemptions == 0:            # first admission
                seq.counters.cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(ScheduledSeq(seq, seq.num_tokens - seq.num_computed_tokens,
                                           seq.num_draft_tokens, seq.num_computed_tokens,
                                           is_prefill=True))
            num_tokens += n_new
            num_prefills += 1
        batch.num_prefills = num_prefills

    # ---- update ---------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: list[list[int]],
               num_drafts_next: list[int]) -> list[StepResult]:
        """Apply one step's verified tokens: roll back rejected drafts, append, stop."""
        results = []
        for sched, tokens, n_draft in zip(batch.seqs, sampled, num_drafts_next):
            seq = sched.seq
            if seq.finished or seq.status is not SequenceStatus.RUNNING:
                continue                       # aborted while the step ran
            accepted = len(tokens) - 1
            seq.num_computed_tokens = sched.start_pos + sched.num_new_tokens + accepted
            if sched.num_drafts:
                c = seq.counters
                c.num_drafts += 1
                c.num_draft_tokens += sched.num_drafts
                c.num_accepted_tokens += accepted
            emitted, reason, stop_reason = self._append(seq, tokens)
            c = seq.counters
            c.completion_tokens = seq.num_output_tokens
            self.blocks.register_computed(seq)
            if reason is not None:
                self.finish(seq, reason, stop_reason)
            else:
                seq.num_draft_tokens = n_draft
            results.append(StepResult(seq, emitted, accepted, reason is not None))
        return results

    def _append(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], FinishReason | None,
                                                                  str | int | None]:
        min_tokens = seq.sampling.min_tokens
        for i, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            n_out = seq.num_output_tokens
            if tok in seq.stop_ids and n_out > min_tokens:
                stop = tok if tok in seq.sampling.stop_token_ids else None
                return tokens[:i + 1], FinishReason.STOP, stop
            if n_out >= seq.max_output_tokens:
                return tokens[:i + 1], FinishReason.LENGTH, None
        return tokens, None, None
