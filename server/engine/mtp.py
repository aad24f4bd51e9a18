"""Drafting with the checkpoint's MTP layer, and the policy that picks k per step.

After verification the runner knows, for every sequence, the positions whose KV just
became final (``start .. start+m-1``: prompt tokens for a prefill, ``t`` and the accepted
drafts for a decode) and the token after each of them.  The first MTP pass feeds the pairs
(true main hidden h_j, embedding of token j+1) for exactly those positions, which writes
the MTP layer's KV from the main model's hidden states (overwriting whatever a rejected
draft left there) and yields d1 from the last position.  For k > 1 the single MTP layer is
applied again on its own output: input d_c at position start+m-1+c with the previous pass's
hidden state, giving d_{c+1}.  Those chained positions get their MTP KV rewritten from true
hidden states next step, when they are verified.

Index rule: the MTP layer at position j reads token j+1 and predicts token j+2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from server.engine import sampler as S
from server.model.batch import BatchMetadata


class SpecPolicy(Protocol):
    """Chooses how many tokens to draft for the next step (adaptive speculation hooks here)."""

    def num_draft_tokens(self, num_seqs: int) -> int: ...

    def observe(self, num_drafts: int, num_accepted: int) -> None: ...


@dataclass
class FixedK:
    """Always draft ``k`` tokens (num_speculative_tokens)."""
    k: int

    def num_draft_tokens(self, num_seqs: int) -> int:
        return self.k

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        pass


@dataclass(slots=True)
class DraftResult:
    ids: torch.Tensor                   # [S, k] int64 draft tokens
    probs: torch.Tensor | None          # [S, k, V] q each draft was sampled from; None if all greedy


def propose(model, kv_caches: list[torch.Tensor], k: int, first: BatchMetadata,
            input_ids: torch.Tensor, prev_hidden: torch.Tensor, last_rows: torch.Tensor,
            sampling: list[S.SeqSamplingInput], vocab_size: int,
            chain_meta) -> DraftResult:
    """Run the first MTP pass plus k-1 chained passes; sample one draft per sequence per pass.

    first / input_ids / prev_hidden: the first pass (see module docstring).
    last_rows [S]: index of each sequence's last position in the first pass.
    sampling[s]: row 0 predicts the first draft (first_token_index = its absolute index).
    chain_meta(c) -> BatchMetadata for chained pass c (1..k-1): one token per sequence.
    """
    device = input_ids.device
    meta = S.SamplingMetadata.build(sampling, vocab_size, device)
    h = model.mtp_forward(input_ids, prev_hidden, first, kv_caches, layer=0)[last_rows]
    ids: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    context = None
    for c in range(k):
        if c:
            meta.token_index = meta.token_index + 1
            _advance_min_tokens(meta, sampling, c)
            h = model.mtp_forward(ids[-1], h, chain_meta(c), kv_caches, layer=0)
        logits = model.mtp_compute_logits(h, layer=0)
        tok, q = S.sample_rows(logits, meta, S.STREAM_DRAFT, context)
        ids.append(tok)
        if q is not None:
            probs.append(q)
        context = torch.stack(ids, dim=1)
    return DraftResult(torch.stack(ids, dim=1), torch.stack(probs, dim=1) if probs else None)


def _advance_min_tokens(meta: S.SamplingMetadata, sampling: list[S.SeqSamplingInput], c: int) -> None:
    """Chained pass c predicts c tokens further on: rebuild the min_tokens mask for that."""
    if meta.mask_index is None:
        return
    rows, toks = [], []
    for r, s in enumerate(sampling):
        if s.params.min_tokens - s.num_output_tokens - c > 0:
            for t in s.stop_ids:
                rows.append(r), toks.append(t)
    dev = meta.token_index.device
    meta.mask_index = (torch.tensor(rows, dtype=torch.long, device=dev),
                       torch.tensor(toks, dtype=torch.long, device=dev)) if rows else None
