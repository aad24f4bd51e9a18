"""Continuous batching by token counting.  No torch here.

Each step every running sequence feeds ``token_ids[num_computed_tokens:]`` plus the drafts
it holds, and waiting sequences are admitted (FCFS) as prefills into the same batch
within maxPrefillTokens / maxPrefillBatchSize / maxBatchSize.  With supportSelectBatch a
step is either prefill-only or decode-only, chosen by MindIE's trade-off: a prefill stalls
every running decode for about prefillTimeMsPerReq each, an under-full decode batch wastes
decodeTimeMsPerReq per empty seat; prefill runs once the accumulated waste exceeds the
stall it would cause.

KV blocks.  A scheduled sequence needs slots for its new tokens, its drafts and the k - 1
positions the chained MTP passes write; with a step in flight (asynchronous scheduling)
also for that step's 1 + d placeholder tokens and up to k fresh drafts (runtime.py has
the worst case).  A request with a prediction may verify a window of predicted drafts
instead (spec/prediction.py): the worker never stages one past the request's
``max_tokens`` and cuts one to the blocks the step was given, so a window needs no KV
beyond MTP's worst case, and never makes a request unservable.  The scheduler gives a
window its slots when they are free (no preemption, no waiting for them); otherwise the
step runs with the window cut, or with MTP's drafts.  Two admission modes keep the
engine from ever deadlocking:
  * preemptible (maxPreemptCount > 0): blocks are taken as needed; when they run out the
    newest preemptible running sequence is preempted (blocks freed, recomputed later from
    its tokens).  A sequence preempted maxPreemptCount times is re-admitted reserved.
  * reserved (maxPreemptCount == 0, or after the last allowed preemption): admission
    holds back the sequence's worst-case block count, so it always completes.
A preempted sequence is swapped out instead of recomputed when the host tier
(kv/host_tier.py, ``EngineConfig.swap_preemption``) has room for its blocks: they are saved
there and loaded back when it resumes, with its computed positions as they were (its
drafts stay with the worker's proposer either way); recompute is the fallback.
Freed blocks may be handed out while a step that still writes them is in flight: the
worker runs steps in order, so the new owner's step writes them after it.

Attention data parallel (dp > 1): the pool is one per dp group (kv/dp_blocks.py), and a
sequence is placed in a group when it is admitted (``_place``: its prefix hit first,
then the least loaded group); its blocks, reservation and room are that group's.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from server.engine.kv.block_manager import BlockManager, PrefixMatch
from server.engine.config import EngineConfig
from server.engine.messages import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                    SchedulerOutput)
from server.engine.protocol import FinishReason
from server.engine.runtime import lookahead_slots
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.stop_rules import first_stop


@dataclass(slots=True)
class SequenceUpdate:                # what update() did to one sequence
    seq: Sequence
    new_token_ids: list[int]     # emitted this step, cut after a stop
    num_drafts: int              # drafts verified
    num_accepted: int
    finished: bool
    predicted: bool = False      # the drafts came from the request's prediction


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, *, num_spec_tokens: int = 0,
                 async_scheduling: bool = False, prediction_drafts: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.num_spec_tokens = num_spec_tokens
        self.chained = max(0, num_spec_tokens - 1)    # positions the chained MTP passes write
        self.async_scheduling = async_scheduling
        # A request with a prediction may verify this many predicted drafts a step: what
        # the worker measured worth verifying (RuntimeInfo.prediction_draft_tokens).
        self.prediction_drafts = prediction_drafts
        self._lookahead = lookahead_slots(num_spec_tokens, async_scheduling)
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}       # every unfinished sequence, by id
        self._finished_ids: list[str] = []            # the worker drops their state next step
        self._step_id = 0
        # Blocks promised to reserved sequences, per dp group (one without attention data
        # parallel: kv/dp_blocks.py).
        self._reserved = [0] * blocks.num_groups
        self._decode_waste_ms = 0.0
        self.num_preemptions = 0
        self.swap = cfg.swap_preemption and blocks.host is not None
        self.num_swapped_out = 0                # preemptions that swapped to the host tier
        self.num_swapped_in = 0                 # resumes that loaded the blocks back
        self.num_recomputed = 0                 # preemptions that dropped the KV (recompute)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks promised to reserved sequences and not yet taken by them."""
        return sum(self._reserved)

    def _max_drafts(self, seq: Sequence, window: bool = True) -> int:
        """The most drafts ``seq`` may feed in a step: k, or its predicted drafts."""
        if window and seq.sampling.prediction and self.prediction_drafts:
            return max(self.num_spec_tokens, self.prediction_drafts)
        return self.num_spec_tokens

    def request_blocks(self, num_prompt_tokens: int, max_output_tokens: int) -> int:
        """The most blocks a request of this size ever holds (a prediction adds none)."""
        return self.blocks.blocks_for(num_prompt_tokens + max_output_tokens + self._lookahead)

    def worst_case_blocks(self, seq: Sequence) -> int:
        return self.request_blocks(seq.num_prompt_tokens, seq.max_output_tokens)

    def _slots_needed(self, seq: Sequence, window: bool = True) -> int:
        """Positions ``seq``'s next step may touch; ``window`` False: with a predicted
        window held or to come, only what MTP's drafts would touch (the worker cuts the
        window to the blocks the step has).  Never past the request's worst case, which
        covers every window the worker stages (module docstring)."""
        if seq.num_inflight_steps:      # placeholders: 1 + d tokens in flight, then fresh drafts
            need = seq.num_tokens + 1 + seq.num_draft_tokens + self._max_drafts(seq, window) \
                + self.chained
        else:
            drafts = seq.num_draft_tokens if window else min(seq.num_draft_tokens,
                                                             self.num_spec_tokens)
            need = seq.num_tokens + drafts + self.chained
        return min(need, seq.num_prompt_tokens + seq.max_output_tokens + self._lookahead)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    @property
    def num_swapped(self) -> int:
        """Waiting sequences whose blocks are in the host tier."""
        return sum(1 for s in self.waiting if s.swap_slots)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_finished_to_report(self) -> bool:     # the worker learns of them next step
        return bool(self._finished_ids)

    def next_deadline(self) -> float | None:
        """When an idle engine must schedule the queued prefills (maxQueueDelayMicroseconds)."""
        if self.running or not self.waiting:
            return None
        if self._prefill_batch_full():         # waiting longer cannot add to the batch
            return self.waiting[0].arrival_time
        return self.waiting[0].arrival_time + self.cfg.max_queue_delay_us / 1e6

    def _prefill_batch_full(self) -> bool:
        """The queue already holds a whole first prefill batch (maxPrefillBatchSize or
        maxBatchSize requests, or maxPrefillTokens prompt tokens)."""
        cfg = self.cfg
        if len(self.waiting) >= min(cfg.max_prefill_batch_size, cfg.max_batch_size):
            return True
        tokens = 0
        for seq in self.waiting:
            tokens += seq.num_tokens
            if tokens >= cfg.max_prefill_tokens:
                return True
        return False

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Finish ``seq`` (any state) and free its blocks at once."""
        if seq.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        if self.requests.pop(seq.request_id, None) is not None:
            self._finished_ids.append(seq.request_id)
        seq.num_draft_tokens = 0
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _release(self, seq: Sequence) -> None:
        if seq.reserved_blocks:
            self._reserved[seq.dp_group] -= max(0, seq.reserved_blocks - len(seq.block_table))
            seq.reserved_blocks = 0
        self.blocks.free(seq)

    def _room(self, seq: Sequence) -> int:
        """Blocks ``seq`` may take now: free ones minus what reserved sequences were promised."""
        own = max(0, seq.reserved_blocks - len(seq.block_table)) if seq.reserved_blocks else 0
        return self.blocks.num_free(seq.dp_group) - (self._reserved[seq.dp_group] - own)

    def _grow(self, seq: Sequence, num_slots: int) -> bool:
        need = self.blocks.blocks_for(num_slots) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self._room(seq):
            return False
        before = len(seq.block_table)
        self.blocks.append_slots(seq, num_slots)
        if seq.reserved_blocks:
            self._reserved[seq.dp_group] -= min(len(seq.block_table), seq.reserved_blocks) - \
                min(before, seq.reserved_blocks)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # The drafts it holds survive (the worker's proposer keeps them): the recompute step
        # verifies them exactly as the next decode step would have, so a seeded request's
        # random draws, and so its output, do not depend on whether it was preempted.  A
        # step of it still in flight completes; update() appends its tokens.
        self.running.remove(seq)
        if self.swap and self.blocks.can_swap_out(seq):
            seq.swap_num_computed = seq.num_computed_tokens   # update() corrects it if in flight
            self.blocks.swap_out(seq)
            self.num_swapped_out += 1
        else:
            self._release(seq)
            self.num_recomputed += 1
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
            return now >= self.next_deadline()
        if not cfg.support_select_batch or len(self.running) >= cfg.max_batch_size:
            return len(self.running) < cfg.max_batch_size
        stall = cfg.prefill_time_ms_per_req * len(self.running)
        if self._decode_waste_ms >= stall:
            self._decode_waste_ms = 0.0
            return True
        self._decode_waste_ms += cfg.decode_time_ms_per_req * (cfg.max_batch_size - len(self.running))
        return False

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        new: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        preempted: list[Sequence] = []
        prefill = self._want_prefill(self.clock())
        prefill_only = self.cfg.support_select_batch and prefill and bool(self.running)
        if not prefill_only:
            self._schedule_running(cached, preempted)
        if prefill:
            self._schedule_waiting(new, preempted)
        finished, self._finished_ids = tuple(self._finished_ids), []
        moves = self.blocks.take_transfers()
        return SchedulerOutput(self._step_id, tuple(new), tuple(cached), finished,
                               tuple(s.request_id for s in preempted),
                               tuple(moves.saves), tuple(moves.loads),
                               tuple(moves.disk_writes), tuple(moves.row_loads))

    def _schedule_running(self, cached: list[CachedRequestData], preempted: list[Sequence]) -> None:
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if seq.num_inflight_steps and seq.num_output_tokens + 1 >= seq.max_output_tokens:
                i += 1                         # the step in flight is certainly its last
                continue
            slots, plain = self._slots_needed(seq), self._slots_needed(seq, window=False)
            before = len(seq.block_table)
            if slots > plain and not self._grow(seq, slots):
                slots = plain                  # no room for its predicted window this step
            while not self._grow(seq, slots):
                victim = self._pick_victim(i, seq.dp_group)
                if victim is None:
                    break
                preempted.append(victim)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue                       # seq preempted itself; running shifted
            if self.blocks.blocks_for(slots) > len(seq.block_table):
                i += 1                         # reserved everywhere: wait for blocks to free
                continue
            placeholders = 1 + seq.num_draft_tokens if seq.num_inflight_steps else 0
            cached.append(CachedRequestData(seq.request_id, tuple(seq.block_table[before:]),
                                            seq.num_computed_tokens, placeholders))
            seq.num_inflight_steps += 1
            i += 1
        # Preempted sequences go back to the front of the queue, oldest first.
        for victim in sorted(preempted, key=lambda s: s.arrival_time, reverse=True):
            self.waiting.appendleft(victim)

    def _pick_victim(self, first: int, group: int) -> Sequence | None:
        """Newest preemptible sequence not yet scheduled this step (index >= ``first``) of
        dp group ``group``: only its blocks make room there (one pool: every sequence)."""
        for seq in reversed(self.running[first:]):
            if not seq.reserved_blocks and seq.dp_group == group:
                return seq
        return None

    def _schedule_waiting(self, new: list[NewRequestData], preempted: list[Sequence]) -> None:
        cfg = self.cfg
        num_tokens = 0
        skip = {id(s) for s in preempted}
        while self.waiting and len(self.running) < cfg.max_batch_size \
                and len(new) < cfg.max_prefill_batch_size:
            seq = self.waiting[0]
            if id(seq) in skip or seq.num_inflight_steps:
                break                          # freed this step, or its last step is in flight
            # Admitted (again) with MTP's slots: a predicted window it holds is cut to them.
            slots = self._slots_needed(seq, window=False)
            reserve = cfg.max_preempt_count == 0 or seq.num_preemptions >= cfg.max_preempt_count
            worst = self.worst_case_blocks(seq) if reserve else 0
            place = self._place(seq, slots, worst)
            if place is None:
                break                          # FCFS: the head waits for room
            group, match = place
            swapped = bool(seq.swap_slots)     # its blocks come back from the host tier instead
            n_new = seq.num_tokens - (seq.swap_num_computed if swapped
                                      else match.num_blocks * self.blocks.block_size)
            if new and num_tokens + n_new > cfg.max_prefill_tokens:
                break
            self.waiting.popleft()
            seq.dp_group = group
            if swapped:
                self.blocks.swap_in(seq, slots)
                self.num_swapped_in += 1
            else:
                self.blocks.allocate(seq, match, slots)
            if reserve:
                seq.reserved_blocks = worst
                self._reserved[group] += max(0, worst - len(seq.block_table))
            if seq.num_preemptions == 0:            # first admission
                seq.counters.cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            new.append(NewRequestData(seq.request_id, tuple(seq.token_ids), seq.num_prompt_tokens,
                                      seq.num_computed_tokens, tuple(seq.block_table),
                                      seq.sampling, seq.seed, seq.stop_ids,
                                      seq.max_output_tokens, seq.export_kv))
            seq.num_inflight_steps += 1
            num_tokens += n_new

    def _place(self, seq: Sequence, slots: int, worst: int) -> tuple[int, PrefixMatch] | None:
        """The dp group to admit ``seq`` into and its prefix match there, or None while no
        group has room for its ``slots`` now (and its ``worst``-case blocks when admitted
        in reserve).  One pool: group 0.  With attention data parallel (kv/dp_blocks.py):
        the group with the longest prefix hit among those with room, then the one left
        with the most room (the least loaded)."""
        blocks = self.blocks
        extra = max(0, worst - blocks.blocks_for(slots))
        best, best_key = None, None
        for g in range(blocks.num_groups):
            if seq.swap_slots:                 # back from the host tier (one pool only)
                match = PrefixMatch([], [], 0)
                need = max(blocks.blocks_for(slots), len(seq.swap_slots))
            else:
                # Prompt logprobs need logits at every prompt position: no prefix-cache hit.
                match = blocks.match_prefix(seq, g) if seq.sampling.prompt_logprobs is None \
                    else PrefixMatch([], [], 0)
                need = blocks.blocks_for(slots) - match.num_device_blocks + match.num_free_hits
            room = blocks.num_free(g) - self._reserved[g] - need - extra
            if room >= 0 and (best_key is None or (match.num_blocks, room) > best_key):
                best, best_key = (g, match), (match.num_blocks, room)
        return best

    # ---- update ---------------------------------------------------------------------
    def update(self, out: ModelRunnerOutput) -> list[SequenceUpdate]:
        """Apply one executed step: roll back rejected drafts, append tokens, stop.

        A sequence's state is exact up to its previous step when this runs (steps are
        applied in order), so the step fed every known token: its computed positions become
        ``num_tokens + accepted``.  Outputs of sequences finished meanwhile (aborted, or a
        stop found in the previous step's output) are discarded.
        """
        results = []
        for rid in (*out.failed, *out.skipped):
            seq = self.requests.get(rid)
            if seq is not None:
                seq.num_inflight_steps = max(0, seq.num_inflight_steps - 1)
        predicted = out.num_predicted or [0] * len(out.request_ids)
        for rid, tokens, n_drafts, n_next, n_pred in zip(out.request_ids, out.sampled_token_ids,
                                                         out.num_drafts, out.num_drafts_next, predicted):
            seq = self.requests.get(rid)
            if seq is None:
                continue
            seq.num_inflight_steps -= 1
            accepted = len(tokens) - 1
            running = seq.status is SequenceStatus.RUNNING
            if running:                        # else preempted while in flight: recomputed
                seq.num_computed_tokens = seq.num_tokens + accepted
            elif seq.swap_slots:               # ... or swapped out after this step wrote its KV
                seq.swap_num_computed = seq.num_tokens + accepted
            c = seq.counters
            if n_pred:                         # the drafts came from the request's prediction
                c.num_prediction_tokens += n_pred
                c.num_accepted_prediction_tokens += accepted
            else:
                c.num_drafts += bool(n_drafts)
                c.num_draft_tokens += n_drafts
                c.num_accepted_tokens += accepted if n_drafts else 0
            emitted, reason, stop_reason = self._append(seq, tokens)
            c.completion_tokens = seq.num_output_tokens
            if running:
                self.blocks.register_computed(seq)
            if reason is not None:
                self.finish(seq, reason, stop_reason)
            else:
                seq.num_draft_tokens = n_next
            results.append(SequenceUpdate(seq, emitted, n_drafts, accepted, reason is not None,
                                          bool(n_pred)))
        return results

    @staticmethod
    def _append(seq: Sequence, tokens: list[int]) -> tuple[list[int], FinishReason | None,
                                                           str | int | None]:
        stop = first_stop(tokens, seq.num_output_tokens, seq.stop_ids, seq.sampling,
                          seq.max_output_tokens)
        if stop is not None:
            tokens = tokens[:stop[0] + 1]
        seq.token_ids.extend(tokens)
        return (tokens, None, None) if stop is None else (tokens, stop[1], stop[2])
