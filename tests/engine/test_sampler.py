"""Sampler and verification: hand-made distributions, processors, and a statistical test.

The statistical test runs the real draft-sample -> verify path many times (one row per
trial, seeds 0..N-1) and checks with a chi-square test that the emitted token follows the
target distribution exactly, as plain sampling does.
"""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from server.engine.sample import sampler
from server.engine.spec.verifier import greedy_accept, verify
from server.engine.protocol import SamplingParams

V = 6


def onehot(ids: list[int], v: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), v).float()


# ---- greedy verification --------------------------------------------------------------
def test_greedy_accept_all_gives_bonus():
    argmax = torch.tensor([[3, 4, 5]])
    tokens, acc = verify(None, argmax, torch.tensor([[3, 4]]), None, torch.tensor([2]), None, None)
    assert acc.tolist() == [2] and tokens.tolist() == [[3, 4, 5]]


def test_greedy_reject_emits_target_argmax():
    argmax = torch.tensor([[3, 2, 5], [1, 1, 1]])
    drafts = torch.tensor([[3, 4], [0, 1]])
    tokens, acc = verify(None, argmax, drafts, None, torch.tensor([2, 2]), None, None)
    assert acc.tolist() == [1, 0]
    assert tokens.tolist() == [[3, 2, -1], [1, -1, -1]]


def test_varlen_drafts_and_prefill_rows():
    argmax = torch.tensor([[3, 4, 0], [7, 0, 0]])
    drafts = torch.tensor([[3, 9], [0, 0]])
    tokens, acc = verify(None, argmax, drafts, None, torch.tensor([1, 0]), None, None)
    assert acc.tolist() == [1, 0]
    assert tokens.tolist() == [[3, 4, -1], [7, -1, -1]]


@pytest.mark.parametrize("K", [0, 1, 2, 3])
def test_host_greedy_accept_equals_tensor_verify(K):
    """The host form the CPU step uses (runner._greedy_on_host) emits what ``verify``
    emits, on every acceptance length: drafts drawn near the argmax so all occur."""
    g = torch.Generator().manual_seed(K)
    for _ in range(200):
        S_ = int(torch.randint(1, 9, (1,), generator=g))
        argmax = torch.randint(0, 3, (S_, K + 1), generator=g)
        drafts = torch.where(torch.rand(S_, K, generator=g) < 0.6, argmax[:, :K],
                             torch.randint(0, 3, (S_, K), generator=g))
        tokens, acc = verify(None, argmax, drafts, None, torch.full((S_,), K), None, None)
        want = [row[:a + 1] for row, a in zip(tokens.tolist(), acc.tolist())]
        assert greedy_accept(argmax.tolist(), drafts.tolist()) == want


# ---- probabilistic verification with hand-made distributions ----------------------------
def _u(vals: list[list[float]]) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float64)


def test_ratio_accept_and_bonus():
    p = torch.stack([torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]])])
    q = torch.tensor([[[0.0, 1.0, 0, 0, 0, 0]]])
    # p(d)/q(d) = 0.5: u 0.4 accepts; bonus from row 1 (one-hot on 3)
    tokens, acc = verify(p, p.argmax(-1), torch.tensor([[1]]), q, torch.tensor([1]),
                           _u([[0.4]]), _u([[0.9, 0.5]]))
    assert acc.tolist() == [1] and tokens.tolist() == [[1, 3]]


def test_ratio_reject_resamples_from_residual():
    p = torch.tensor([[[0.0, 0.5, 0.5, 0, 0, 0], [0, 0, 0, 1.0, 0, 0]]])
    q = torch.tensor([[[0.0, 1.0, 0, 0, 0, 0]]])
    # u 0.6 > 0.5 rejects; residual max(0, p - q) = mass on token 2 only
    for us in (0.0, 0.5, 0.999):
        tokens, acc = verify(p, p.argmax(-1), torch.tensor([[1]]), q, torch.tensor([1]),
                               _u([[0.6]]), _u([[us, 0.5]]))
        assert acc.tolist() == [0] and tokens.tolist() == [[2, -1]]


def test_one_hot_draft_probs_default():
    """Greedy drafting: q is the one-hot of the draft, so accept iff u < p(draft)."""
    p = torch.tensor([[[0.2, 0.8, 0, 0, 0, 0], [0, 0, 1.0, 0, 0, 0]]])
    for u, expect in ((0.79, [[1, 2]]), (0.81, [[0, -1]])):
        tokens, _ = verify(p, p.argmax(-1), torch.tensor([[1]]), None, torch.tensor([1]),
                             _u([[u]]), _u([[0.5, 0.5]]))
        assert tokens.tolist() == expect


# ---- counter-based randomness ----------------------------------------------------------
def test_counter_uniform_is_pure_and_uniform():
    seeds = torch.arange(50000, dtype=torch.int64)
    a = sampler.counter_uniform(seeds, seeds * 0 + 7, sampler.STREAM_SAMPLE)
    b = sampler.counter_uniform(seeds, seeds * 0 + 7, sampler.STREAM_SAMPLE)
    c = sampler.counter_uniform(seeds, seeds * 0 + 7, sampler.STREAM_ACCEPT)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0 <= a.min() and a.max() < 1
    hist = torch.histc(a.float(), bins=10, min=0, max=1)
    assert chisquare(hist.numpy()).pvalue > 1e-4
    assert abs(torch.corrcoef(torch.stack([a, c]))[0, 1]) < 0.03


# ---- processors ------------------------------------------------------------------------
def meta_for(params: SamplingParams, *, rows: int = 1, prompt=(), output=(), n_out: int | None = None,
             stop_ids=frozenset(), seeds=(0,), v: int = V) -> sampler.SamplingMetadata:
    seqs = [sampler.SeqSamplingInput(params, s, rows, 10, len(output) if n_out is None else n_out,
                               list(prompt), list(output), frozenset(stop_ids)) for s in seeds]
    return sampler.SamplingMetadata.build(seqs, v, "cpu")


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, 1.5]])


def test_penalties_bias_and_min_tokens_match_hand_computation():
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5,
                       presence_penalty=0.25, logit_bias={4: 3.0}, min_tokens=3)
    m = meta_for(p, rows=2, prompt=[3], output=[0, 0, 5], n_out=2, stop_ids={5})
    context = torch.tensor([[-1], [2]])          # row 1 follows draft token 2
    out = sampler.process_logits(LOGITS.repeat(2, 1), m, context)
    exp0 = torch.tensor([2.0 / 2 - 1.0 - 0.25, 1.0, 0.5, -1.0 * 2, 3.0, -math.inf])
    exp1 = exp0.clone()
    exp1[2] = 0.5 / 2 - 0.5 - 0.25
    exp1[5] = 1.5 / 2 - 0.5 - 0.25              # row 1 is the 3rd output token: EOS allowed
    assert torch.allclose(out[0], exp0) and torch.allclose(out[1], exp1)


def test_top_k_top_p_min_p_supports():
    def support(**kw) -> list[int]:
        m = meta_for(SamplingParams(**kw))
        return torch.nonzero(sampler.to_probs(sampler.process_logits(LOGITS, m), m)[0]).flatten().tolist()

    assert support(top_k=2) == [0, 5]
    probs = torch.softmax(LOGITS[0], -1)           # [0.38, 0.14, 0.08, 0.02, 0.05, 0.23]
    assert support(top_p=0.5) == [0, 5]            # 0.38 < 0.5, then 0.38+0.23 covers it
    assert support(top_p=0.3) == [0]
    assert support(min_p=0.3) == [0, 1, 5]         # >= 0.3 * 0.38
    assert support(temperature=0.0) == [0]
    assert probs.argmax() == 0


# ---- statistical: verification preserves the target distribution -------------------------
N = 20000
DRAFT_LOGITS = torch.tensor([[0.0, 2.0, 1.0, 0.5, 1.2, -0.5]])

CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.0, top_p=0.7),
    "penalty": SamplingParams(temperature=1.0, repetition_penalty=1.8, frequency_penalty=0.4),
}


@pytest.mark.slow                       # statistical
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("sampled_draft", [True, False])
def test_mtp_verification_follows_target_distribution(name, sampled_draft):
    params = CASES[name]
    seeds = list(range(N))
    # Target and draft see the same context (prompt [3], output [0, 5, 5]).
    m = meta_for(params, rows=2, prompt=[3], output=[0, 5, 5], seeds=seeds)
    target = sampler.to_probs(sampler.process_logits(LOGITS.repeat(2 * N, 1), m), m).view(N, 2, V)
    exact = target[0, 0].double()
    md = meta_for(params, rows=1, prompt=[3], output=[0, 5, 5], seeds=seeds)
    if sampled_draft:                               # draft ~ q, ratio test p/q
        drafts, q = sampler.sample_rows(DRAFT_LOGITS.repeat(N, 1), md, sampler.STREAM_DRAFT)
        q = q.view(N, 1, V)
    else:                                           # greedy drafting: q one-hot
        drafts, q = sampler.process_logits(DRAFT_LOGITS.repeat(N, 1), md).argmax(-1), None
    seeds_t = torch.tensor(seeds)
    idx = torch.tensor([10, 11])
    u_acc = sampler.counter_uniform(seeds_t[:, None], idx[None, :1], sampler.STREAM_ACCEPT)
    u_smp = sampler.counter_uniform(seeds_t[:, None], idx[None, :], sampler.STREAM_SAMPLE)
    tokens, acc = verify(target, target.argmax(-1), drafts.view(N, 1), q,
                           torch.ones(N, dtype=torch.long), u_acc, u_smp)
    with_mtp = torch.bincount(tokens[:, 0], minlength=V).double()
    plain = torch.bincount(sampler.sample_inverse_cdf(target[:, 0], u_smp[:, 0]), minlength=V).double()
    assert 0.05 < acc.double().mean() < 0.95        # both accept and reject paths ran
    for counts in (with_mtp, plain):
        keep = exact > 0
        assert counts[~keep].sum() == 0             # never outside the target's support
        f_exp = exact[keep] / exact[keep].sum() * counts.sum()
        assert chisquare(counts[keep].numpy(), f_exp.numpy()).pvalue > 1e-3, (name, counts, f_exp)
    # The bonus token (all drafts accepted) follows row 1's distribution too.
    bonus = tokens[acc == 1, 1]
    counts = torch.bincount(bonus, minlength=V).double()
    exact1 = target[0, 1].double()
    keep = exact1 > 0
    assert chisquare(counts[keep].numpy(), (exact1[keep] / exact1[keep].sum() * counts.sum()).numpy()).pvalue > 1e-3
