"""Scheduler unit tests with factories: no model, no torch."""
from __future__ import annotations

import itertools

from server.engine.kv.block_manager import BlockManager
from server.engine.config import EngineConfig
from server.engine.messages import ModelRunnerOutput, SchedulerOutput
from server.engine.protocol import FinishReason, SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, SequenceStatus

_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks: int = 64, block_size: int = 4, k: int = 0, clock: Clock | None = None,
         **cfg) -> Scheduler:
    cfg.setdefault("max_queue_delay_us", 0)
    c = EngineConfig(block_size=block_size, num_blocks=num_blocks, num_speculative_tokens=k, **cfg)
    return Scheduler(c, BlockManager(num_blocks, block_size), num_spec_tokens=k,
                     clock=clock or Clock())


def req(n_prompt: int = 5, max_tokens: int = 16, arrival: float = 0.0, **sp) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens, **sp)
    stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else {1})
    return Sequence(f"q{next(_ids)}", list(range(2, 2 + n_prompt)), n_prompt, p,
                    max_output_tokens=max_tokens, seed=0, arrival_time=arrival, stop_ids=stop)


def seqs_of(s: Scheduler, so: SchedulerOutput) -> list[Sequence]:
    return [s.requests[rid] for rid in so.request_ids]


def num_new(so: SchedulerOutput) -> list[int]:
    """Known tokens each scheduled request feeds (synchronous scheduling: exact)."""
    return [1 for _ in so.cached_requests] + \
           [len(r.token_ids) - r.num_computed_tokens for r in so.new_requests]


def output(s: Scheduler, so: SchedulerOutput, sampled: list[list[int]],
           drafts_next: list[int]) -> ModelRunnerOutput:
    """What a worker would answer: ``sampled`` per request, drafts verified as held."""
    ids = so.request_ids
    return ModelRunnerOutput(so.step_id, ids, sampled, [s.requests[r].num_draft_tokens for r in ids],
                             drafts_next, [None] * len(ids))


def step(s: Scheduler, tokens=lambda seq: [7], drafts: int = 0):
    so = s.schedule()
    seqs = seqs_of(s, so)
    res = s.update(output(s, so, [tokens(q) for q in seqs], [drafts] * len(seqs)))
    return so, res


def test_prefill_budgets_fcfs():
    s = make(max_prefill_tokens=12, max_prefill_batch_size=2, max_batch_size=3)
    seqs = [req(5) for _ in range(4)]
    for q in seqs:
        s.add(q)
    b = s.schedule()
    assert seqs_of(s, b) == seqs[:2]                      # batch size 2 (and 10 <= 12 tokens)
    assert num_new(b) == [5, 5]
    s.update(output(s, b, [[7], [7]], [0, 0]))
    b = s.schedule()
    # two decodes + one prefill (max_batch_size 3); the 4th waits
    assert seqs_of(s, b) == seqs[:3]
    assert num_new(b) == [1, 1, 5]


def test_prefill_token_budget_but_never_starves_a_long_prompt():
    s = make(max_prefill_tokens=8)
    a, b = req(6), req(6)
    big = req(20)
    for q in (a, b):
        s.add(q)
    assert seqs_of(s, s.schedule()) == [a]                 # 12 > 8
    s2 = make(max_prefill_tokens=8)
    s2.add(big)
    assert seqs_of(s2, s2.schedule()) == [big]             # alone it may exceed the budget


def test_queue_delay_holds_prefill_while_idle():
    clock = Clock()
    s = make(clock=clock, max_queue_delay_us=5000, max_prefill_batch_size=4)
    s.add(req(arrival=clock.t))
    assert s.schedule().num_scheduled == 0
    assert abs(s.next_deadline() - (clock.t + 0.005)) < 1e-9
    clock.t += 0.006
    assert s.schedule().num_scheduled == 1


def test_queue_delay_ends_once_the_first_batch_is_full():
    """An idle engine waits for more prompts only while more could join the first prefill:
    the wait ends at maxPrefillBatchSize or maxBatchSize requests, or maxPrefillTokens."""
    for limits, prompts in (({"max_prefill_batch_size": 2}, [5, 5]),
                            ({"max_batch_size": 2}, [5, 5]),
                            ({"max_prefill_tokens": 12}, [5, 7])):
        clock = Clock()
        s = make(clock=clock, max_queue_delay_us=5000, **limits)
        s.add(req(prompts[0], arrival=clock.t))
        assert s.next_deadline() > clock.t and s.schedule().num_scheduled == 0
        clock.t += 0.001
        s.add(req(prompts[1], arrival=clock.t))
        assert s.next_deadline() <= clock.t, limits      # due now: the engine loop does not sleep
        assert s.schedule().num_scheduled == 2, limits


def test_select_batch_trades_prefill_stall_against_decode_waste():
    s = make(support_select_batch=True, max_batch_size=4, prefill_time_ms_per_req=100,
             decode_time_ms_per_req=10)
    s.add(req())
    step(s)                                               # idle: prefill at once
    s.add(req())
    kinds = []
    for _ in range(12):
        b, _ = step(s)
        kinds.append("P" if b.new_requests else "D")
        if b.new_requests:
            break
    # stall = 100 ms * 1 running; waste = 10 ms * 3 empty seats per decode step -> 4 decodes first
    assert kinds == ["D", "D", "D", "D", "P"]


def test_num_computed_rolls_back_rejected_drafts():
    s = make(k=2)
    q = req(5)
    s.add(q)
    b, _ = step(s, drafts=2)
    assert q.num_computed_tokens == 5 and q.num_tokens == 6 and q.num_draft_tokens == 2
    b = s.schedule()
    x = b.cached_requests[0]
    assert (x.num_computed_tokens, x.num_output_placeholders, q.num_draft_tokens) == (5, 0, 2)
    # one of two drafts accepted: the step emits 2 tokens and computed 5 + 1 + 1
    s.update(output(s, b, [[11, 12]], [2]))
    assert q.num_computed_tokens == 7 and q.num_tokens == 8
    assert (q.counters.num_drafts, q.counters.num_draft_tokens, q.counters.num_accepted_tokens) == (1, 2, 1)
    # blocks cover the window plus the chained-draft lookahead (k - 1)
    b = s.schedule()
    assert len(q.block_table) * 4 >= q.num_tokens + 2 + 1


def test_stop_inside_an_mtp_step_drops_later_tokens():
    s = make(k=2)
    q = req(5, stop_token_ids=(9,))
    s.add(q)
    step(s, drafts=2)
    _, res = step(s, tokens=lambda seq: [8, 9, 10])
    assert res[0].new_token_ids == [8, 9] and res[0].finished
    assert q.output_token_ids == [7, 8, 9]
    assert q.finish_reason is FinishReason.STOP and q.stop_reason == 9
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_eos_min_tokens_ignore_eos_and_length():
    s = make()
    a = req(max_tokens=3)                          # EOS id is 1
    b = req(max_tokens=5, min_tokens=2)
    c = req(max_tokens=3, ignore_eos=True)
    for q in (a, b, c):
        s.add(q)
    _, res = step(s, tokens=lambda seq: [1])
    assert a.finish_reason is FinishReason.STOP and a.stop_reason is None
    assert not b.finished and not c.finished        # min_tokens 2 / ignore_eos
    step(s, tokens=lambda seq: [1])
    assert not b.finished                           # EOS may come only after 2 other tokens
    step(s, tokens=lambda seq: [1])
    assert b.finish_reason is FinishReason.STOP and b.num_output_tokens == 3
    assert c.finish_reason is FinishReason.LENGTH and c.output_token_ids == [1, 1, 1]


def test_preempts_newest_and_recomputes_from_tokens():
    s = make(num_blocks=6, block_size=4, max_preempt_count=3)
    old, new = req(7, max_tokens=12), req(7, max_tokens=12)
    s.add(old)
    s.add(new)
    step(s)                                        # 2 blocks each: 8 slots, 8 tokens now
    b, _ = step(s)                                 # both need a third block: 6 total is enough
    b, _ = step(s)
    seen_preempt = []
    for _ in range(40):
        b, _ = step(s)
        seen_preempt += [p for p in b.preempted_request_ids]
        if not s.has_work():
            break
    assert not s.has_work()
    assert seen_preempt and seen_preempt[0] == new.request_id and new.num_preemptions >= 1
    assert old.num_preemptions == 0
    assert old.num_output_tokens == 12 and new.num_output_tokens == 12
    assert s.blocks.num_free_blocks == 6 and s.num_reserved_blocks == 0


def test_reserve_mode_never_preempts_and_never_deadlocks():
    s = make(num_blocks=8, block_size=4, max_preempt_count=0)
    seqs = [req(6, max_tokens=10) for _ in range(4)]   # worst case 4 blocks each
    for q in seqs:
        s.add(q)
    running_sizes = []
    for _ in range(100):
        b, _ = step(s)
        assert not b.preempted_request_ids
        running_sizes.append(len(s.running))
        if not s.has_work():
            break
    assert all(q.finish_reason is FinishReason.LENGTH for q in seqs)
    assert max(running_sizes) == 2
    assert s.blocks.num_free_blocks == 8


def test_preemption_limit_readmits_reserved():
    s = make(num_blocks=5, block_size=4, max_preempt_count=1)
    seqs = [req(3, max_tokens=14, arrival=i) for i in range(3)]
    for q in seqs:
        s.add(q)
    for _ in range(200):
        step(s)
        if not s.has_work():
            break
    assert all(q.finished and q.num_output_tokens == 14 for q in seqs)
    assert all(q.num_preemptions <= 1 for q in seqs)
    assert s.num_preemptions >= 1


def test_abort_frees_blocks_in_any_state():
    s = make(num_blocks=16)
    a, b = req(6), req(6)
    s.add(a)
    step(s)
    s.add(b)
    s.finish(a, FinishReason.ABORT)
    s.finish(b, FinishReason.ABORT)
    assert a.status is SequenceStatus.FINISHED and not s.has_work()
    assert s.blocks.num_free_blocks == 16


def test_preempted_sequence_keeps_its_drafts_for_the_recompute_step():
    s = make(num_blocks=4, block_size=4, k=2, max_preempt_count=2)
    old, new = req(5, max_tokens=12), req(5, max_tokens=12)
    s.add(old)
    s.add(new)
    step(s, drafts=2)                              # 2 blocks each (6 tokens + 2 drafts + 1)
    b = s.schedule()                               # old needs a 3rd block: new is preempted
    assert b.preempted_request_ids == (new.request_id,)
    assert new.num_draft_tokens == 2 and new.num_computed_tokens == 0
    s.update(output(s, b, [[7, 7, 7]], [2]))
    s.finish(old, FinishReason.ABORT)
    b = s.schedule()
    x = b.new_requests[0]
    assert x.request_id == new.request_id and not b.cached_requests
    assert (len(x.token_ids) - x.num_computed_tokens, new.num_draft_tokens) == (6, 2)
