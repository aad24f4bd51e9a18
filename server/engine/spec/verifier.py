"""Speculative verification, a pure function over tensors (glossary in protocol.py).

Greedy rows accept a draft iff it equals the target's argmax; sampled rows use
probability-ratio acceptance (accept d with probability min(1, p(d)/q(d))), then emit one
recovered token from norm(max(0, p - q)) or, when every draft passed, a bonus token from p.
The uniforms come from the counter-based generator in sample/sampler.py, so a seeded request's
result does not depend on its batch.  Seeded sampled requests are verified by coupling
instead (worker/runner.py, sample/sampler.py's module doc): the greedy form of this function with each
row's Gumbel-max target sample in place of the argmax.
"""
from __future__ import annotations

import torch

from server.engine.sample.sampler import sample_inverse_cdf


def greedy_accept(target_argmax: list[list[int]], draft_ids: list[list[int]]) -> list[list[int]]:
    """``verify`` for greedy rows whose every draft is held, on host lists: each sequence
    keeps its drafts while they equal the target's argmax, then the argmax after them.

    Why a second form: on a CPU the tensor form is ~12 dispatches (44 us for one sequence,
    65 us with one draft, measured hot) around a result the step reads on the host anyway;
    one argmax read back and this loop over at most K drafts take 6-8 us.  On an
    accelerator the tensor form stays: its one transfer is the step's only sync.
    """
    out = []
    for am, drafts in zip(target_argmax, draft_ids):
        n = 0
        while n < len(drafts) and drafts[n] == am[n]:
            n += 1
        out.append(drafts[:n] + [am[n]])
    return out


def verify(target_probs: torch.Tensor | None, target_argmax: torch.Tensor,
           draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
           num_drafts: torch.Tensor, u_accept: torch.Tensor | None,
           u_sample: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification, a pure function.  S sequences, K = max drafts.

    target_probs [S, K+1, V]  the target distribution at each window row (greedy rows
                              one-hot); None when every row is greedy.
    target_argmax [S, K+1]    argmax of the processed target logits.
    draft_ids [S, K]          drafts (padding anywhere past num_drafts).
    draft_probs [S, K, V]     q each draft was sampled from; None = one-hot (greedy drafting).
    num_drafts [S]            drafts actually held per sequence.
    u_accept [S, K], u_sample [S, K+1]  uniforms (float64), needed only with target_probs.
    Returns tokens [S, K+1] (-1 after the last emitted) and num_accepted [S]; sequence s
    emits tokens[s, :num_accepted[s] + 1]: the accepted drafts then the recovered or bonus token.
    """
    S, K1 = target_argmax.shape
    K = K1 - 1
    cols = torch.arange(K, device=target_argmax.device).unsqueeze(0)
    valid = cols < num_drafts.unsqueeze(1)
    if target_probs is None:
        accept = draft_ids == target_argmax[:, :K]
    else:
        p_d = target_probs[:, :K].gather(2, draft_ids.unsqueeze(2)).squeeze(2).double()
        q_d = (draft_probs[:, :K].gather(2, draft_ids.unsqueeze(2)).squeeze(2).double()
               if draft_probs is not None else torch.ones_like(p_d))
        accept = u_accept * q_d < p_d                      # u < p/q, q_d > 0 for a drawn draft
    num_accepted = (accept & valid).int().cumprod(dim=1).sum(dim=1)        # [S]
    a = num_accepted.long()
    if target_probs is None:
        final = target_argmax.gather(1, a.unsqueeze(1)).squeeze(1)
    else:
        rows = torch.arange(S, device=a.device)
        p_a = target_probs[rows, a]                                         # [S, V]
        rejected = a < num_drafts
        if draft_probs is not None:
            q_a = draft_probs[rows, a.clamp(max=max(K - 1, 0))] if K else torch.zeros_like(p_a)
        else:
            q_a = torch.zeros_like(p_a)
            if K:
                q_a.scatter_(1, draft_ids.gather(1, a.clamp(max=K - 1).unsqueeze(1)), 1.0)
        q_a = q_a * rejected.unsqueeze(1)                  # bonus row: sample p itself
        residual = (p_a - q_a).clamp_(min=0)
        empty = residual.sum(-1, keepdim=True) <= 0        # p == q up to rounding: use p
        residual = torch.where(empty, p_a, residual)
        final = sample_inverse_cdf(residual, u_sample.gather(1, a.unsqueeze(1)).squeeze(1))
    tokens = torch.full((S, K1), -1, dtype=torch.long, device=target_argmax.device)
    if K:
        tokens[:, :K] = torch.where(cols < a.unsqueeze(1), draft_ids, -1)
    tokens.scatter_(1, a.unsqueeze(1), final.unsqueeze(1))
    return tokens, num_accepted
