"""Adaptive speculation (mtp.AdaptiveK): decisions from synthetic step costs and acceptance,
and k switching mid-generation never changes greedy outputs."""
from __future__ import annotations

import itertools

import pytest

from server.engine.spec.policy import AdaptiveK, FixedK
from server.engine.protocol import SamplingParams
from tests.engine.helpers import high_acceptance_model, make_engine, prompts, requests, run_staggered, \
    run_tokens, tiny_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def trained(max_k: int, acceptance: list[float], cost, num_seqs: int, **kw) -> AdaptiveK:
    """A policy that has seen ``acceptance`` per position and ``cost(k)`` seconds per step."""
    p = AdaptiveK(max_k, probe_every=10 ** 9, alpha_acc=1.0, cost_window=1, **kw)
    p.acceptance = list(acceptance)
    for k in range(max_k + 1):
        p.observe_step(num_seqs, k, cost(k))
    return p


def test_high_acceptance_and_flat_cost_drafts_the_most():
    p = trained(2, [0.9, 0.85], lambda k: 0.010 + 0.001 * k, num_seqs=1)
    assert p.num_draft_tokens(1) == 2


def test_low_acceptance_falls_to_plain_decoding():
    p = trained(2, [0.1, 0.1], lambda k: 0.010 + 0.003 * k, num_seqs=1)
    assert p.num_draft_tokens(1) == 0


def test_big_batch_where_verification_costs_scale_with_tokens_falls_to_zero():
    # 64 sequences: the step is compute bound, cost ~ (k+1) tokens per sequence; with 70%
    # acceptance k=1 yields 1.7 tokens for 2x the cost.
    p = trained(2, [0.7, 0.7], lambda k: 0.050 * (k + 1), num_seqs=64)
    assert p.num_draft_tokens(64) == 0
    # ...while at batch 1 (cost nearly flat in k) the same acceptance pays.
    for k in range(3):
        p.observe_step(1, k, 0.010 + 0.001 * k)
    assert p.num_draft_tokens(1) == 2


def test_expected_tokens_follow_the_chain_of_conditional_acceptances():
    p = AdaptiveK(3)
    p.acceptance = [0.8, 0.5, 0.5]
    assert p.expected_tokens(0) == 1.0
    assert p.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.4)
    assert p.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)


def test_observe_updates_only_the_positions_reached():
    p = AdaptiveK(2, alpha_acc=1.0, prior_acceptance=0.5)
    p.observe(2, 0)                       # draft 1 rejected: draft 2 never judged
    assert p.acceptance == [0.0, 0.5]
    p.observe(2, 1)                       # draft 1 accepted, draft 2 rejected
    assert p.acceptance == [1.0, 0.0]
    p.observe(2, 2)
    assert p.acceptance == [1.0, 1.0]


def test_unmeasured_k_are_probed_first_then_the_best_is_kept():
    p = AdaptiveK(2, probe_len=2, probe_every=10 ** 9)
    seen = [p.num_draft_tokens(4) for _ in range(2)]
    assert seen == [0, 0]                               # probe of k=0 lasts probe_len steps
    p.observe_step(4, 0, 0.010)
    assert [p.num_draft_tokens(4) for _ in range(2)] == [1, 1]
    p.observe_step(4, 1, 0.011)
    assert [p.num_draft_tokens(4) for _ in range(2)] == [2, 2]
    p.observe_step(4, 2, 0.012)
    assert p.num_draft_tokens(4) == 2                   # prior acceptance 0.7 pays here


def test_raises_k_again_when_acceptance_recovers_and_probes_periodically():
    p = trained(1, [0.05], lambda k: 0.010 + 0.004 * k, num_seqs=1, probe_len=1)
    p.probe_every = 5
    p.alpha_acc = 0.5
    ks = [p.num_draft_tokens(1) for _ in range(4)]
    assert ks == [0, 0, 0, 0]
    assert p.num_draft_tokens(1) == 1                   # 5th decision: a probe of k=1
    for _ in range(10):                                 # the drafts now get accepted
        p.observe(1, 1)
    assert p.num_draft_tokens(1) == 1
    assert p.current == 1 and p.num_switches == 2        # down to 0, then back up to 1


def test_one_stalled_step_does_not_flip_k_but_a_lasting_change_does():
    # k=1 pays at batch 1: 1.8 tokens for 1.25x the time of a plain step.
    p = AdaptiveK(1, probe_every=16, probe_len=1)
    p.acceptance = [0.8]
    for _ in range(4):
        p.observe_step(1, 0, 0.010)
        p.observe_step(1, 1, 0.0125)
    assert p.num_draft_tokens(1) == 1
    # One k=1 step stalls 5x (another process took the core): a moving average would
    # price k=1 at 0.022 s and fall to k=0; the windowed median keeps the step's own cost.
    p.observe_step(1, 1, 0.060)
    assert p.cost[(1, 1)] == 0.0125
    assert p.num_draft_tokens(1) == 1 and p.num_switches == 0
    # k=1 steps now really cost 3x.  Until k=0 is measured again that reads as a slower
    # host (k=0 priced 3x too); probes of k=0 (every 16 decisions) show it is not, and
    # once they fill half of k=0's window k falls to 0.
    p.probe_len = 3
    ks = []
    for _ in range(60):
        k = p.num_draft_tokens(1)
        ks.append(k)
        p.observe_step(1, k, 0.030 if k else 0.010)
    assert ks[:13] == [1] * 13 and ks[13] == 0          # decision 16: the first probe of k=0
    assert p.current == 0 and ks[-12:] == [0] * 12 and p.num_switches == 1


def test_a_slower_host_does_not_make_the_k_measured_longer_ago_look_better():
    # Concurrency 8: k=1 verifies 2 tokens a sequence for 1.82x a plain step's time, 1.8
    # tokens: not worth drafting.  Then the whole host slows by 30%; only k=0, the current
    # k, is measured.  Priced against k=0's own steps of the same minutes, k=1 slowed too.
    p = AdaptiveK(1, probe_every=10 ** 9)
    p.acceptance = [0.8]
    for _ in range(8):
        p.observe_step(8, 0, 0.034)
        p.observe_step(8, 1, 0.062)
    assert [p.num_draft_tokens(8) for _ in range(2)] == [0, 0]
    for _ in range(8):
        p.observe_step(8, 0, 0.044)
        assert p.num_draft_tokens(8) == 0
    assert p.priced_cost(1, 8) == pytest.approx(0.062 * 0.044 / 0.034)
    assert p.num_switches == 1                          # only max_k -> 0 at the start


def test_drafting_must_beat_plain_decoding_by_its_unpriced_overhead():
    # At batch 8 k=1 prices 5% better than k=0 on clean steps: below what drafting costs
    # outside them there (8.75%)...
    cost = lambda k: 0.030 * (1 + 0.72 * k)         # noqa: E731
    assert trained(1, [0.8], cost, num_seqs=8).num_draft_tokens(8) == 0
    assert trained(1, [0.8], cost, num_seqs=8, draft_overhead=0.0).num_draft_tokens(8) == 1
    # ...where a lone request pays none of it.
    assert trained(1, [0.8], cost, num_seqs=1).num_draft_tokens(1) == 1


class Scripted(FixedK):
    """Cycles through ``ks``, one per step: forces every kind of k switch."""

    def __init__(self, max_k: int, ks: list[int]) -> None:
        super().__init__(max_k)
        self._ks = itertools.cycle(ks)

    def num_draft_tokens(self, num_seqs: int) -> int:
        return next(self._ks)


@pytest.mark.parametrize("model_name", ["tiny", "high"])
def test_k_switching_mid_generation_keeps_greedy_outputs(model_name):
    model = tiny_model() if model_name == "tiny" else high_acceptance_model()
    ps = prompts(6, seed=3)
    ref = run_tokens(make_engine(model, 0), requests(ps, GREEDY))
    for ks in ([2, 0, 1, 2, 1, 0, 0, 2], [1, 2, 2, 0]):
        eng = make_engine(model, 2, policy=Scripted(2, ks))
        assert run_staggered(eng, requests(ps, GREEDY)) == ref
        st = eng.stats()
        assert sum(st.steps_per_k) == st.num_steps and all(st.steps_per_k)


def test_engine_adaptive_by_default_and_off_by_config():
    model = high_acceptance_model()
    ps = prompts(4, seed=5)
    ref = run_tokens(make_engine(model, 0), requests(ps, GREEDY))
    eng = make_engine(model, 2)
    assert isinstance(eng.policy, AdaptiveK)
    assert run_tokens(eng, requests(ps, GREEDY)) == ref
    st = eng.stats()
    assert sum(st.steps_per_k) == st.num_steps and 0 <= st.spec_current_k <= 2
    fixed = make_engine(model, 2, adaptive_speculation=False)
    assert type(fixed.policy) is FixedK
    assert run_tokens(fixed, requests(ps, GREEDY)) == ref
    assert fixed.stats().steps_per_k[2] == fixed.stats().num_steps


def test_a_k_that_keeps_losing_its_probes_is_probed_less_often_until_it_wins_again():
    # Concurrency 8: k=1 verifies 2 tokens a sequence for 2.2x a plain step's time, 1.8
    # tokens: its probes (every 8 decisions here) each cost drafting's overheads too.  A
    # probe that prices k=1 clearly behind k=0 doubles the wait for the next (to 8x).
    p = AdaptiveK(1, probe_every=8, probe_len=2)
    p.acceptance = [0.8]
    for _ in range(8):
        p.observe_step(8, 0, 0.030)
        p.observe_step(8, 1, 0.066)
    probes = []
    for _ in range(400):
        k = p.num_draft_tokens(8)
        if k:
            probes.append(p._decisions)
        p.observe_step(8, k, 0.066 if k else 0.030)
    starts = [d for i, d in enumerate(probes) if i == 0 or probes[i - 1] != d - 1]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[:4] == [24, 40, 72, 72] and set(gaps[4:]) == {72}
    assert p.current == 0
    # k=1 gets cheap (say its experts now fit the cache): within its backed-off wait a probe
    # says so, k rises to 1, and now k=0 is the one that loses its probes.
    for _ in range(200):
        k = p.num_draft_tokens(8)
        p.observe_step(8, k, 0.031 if k else 0.030)
    assert p.current == 1 and (1, 8) not in p._backoff and p._backoff[(0, 8)] > 1
