"""Logits processing, sampling and speculative verification (see protocol.py's glossary).

Rows.  Every logits row belongs to one sequence and predicts the token at one absolute
index of that sequence (``token_index``).  A verification window for a sequence holding
``d`` drafts has d+1 rows: row i predicts the token after draft i (row 0: after the last
emitted token), so drafts d1..di count as context for row i (penalties, min_tokens).

Randomness.  Every random number a request uses is a counter-based hash of
(request seed, token index, stream), not a draw from a stateful generator: a seeded
request samples the same tokens alone, inside any batch, and after being preempted and
recomputed, and the hot path needs no per-request Python.  Streams: acceptance test,
final-token sample (recovered or bonus), draft sample.

Seeded requests (a ``seed`` given, temperature > 0) are sampled by the Gumbel-max trick
with per-token noise that depends only on (seed, token index, token), and verified by
coupling instead of by probability ratio: every window row draws its target token t_j
with that noise, and a draft is accepted iff it equals t_j.  The emitted tokens are then
exactly those of MTP off (same seed, any k), not only the same distribution.  Their
drafts are drawn from q with the same noise, so draft and target agree as often as a
shared noise makes argmax(log q + G) and argmax(log p + G) agree; this accepts somewhat
less often than the ratio test (P(d = t) <= sum min(p, q)).  Unseeded requests keep
inverse-CDF sampling and ratio verification.

Processing order: repetition / frequency / presence penalties, logit_bias, min_tokens
(stop ids masked), then temperature, top_k, top_p, min_p.  Greedy rows take the argmax of
the penalised logits; as a distribution that is a one-hot, which makes greedy
verification the same ratio test (accept iff draft == argmax).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from server.engine.protocol import SamplingParams
from server.model.batch import expand_rows

STREAM_ACCEPT = 1
STREAM_SAMPLE = 2
STREAM_DRAFT = 3
STREAM_GUMBEL = 4                        # per-token noise of coupled (seeded) sampling
_GOLDEN = -7046029254386353131          # 0x9E3779B97F4A7C15 as int64
_MIX1 = -4658895280553007687            # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685            # 0x94D049BB133111EB


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping multiply; logical shifts emulated by masks)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def counter_uniform(seeds: torch.Tensor, index: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform [0, 1) float64 per element, a pure function of (seed, index, stream)."""
    offset = (stream * _MIX2) & ((1 << 64) - 1)
    offset -= (offset >> 63) << 64                 # as a signed int64
    x = _mix64(seeds) + index * _GOLDEN + offset
    x = _mix64(_mix64(x))
    return ((x >> 11) & ((1 << 53) - 1)).to(torch.float64) * (2.0 ** -53)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of unnormalised ``probs`` [R, V] from uniforms ``u`` [R] (float64)."""
    cdf = probs.to(torch.float64).cumsum(-1)
    x = (u * cdf[:, -1]).unsqueeze(-1)
    # right=True: the first index whose cdf exceeds x, so zero-probability tokens never win.
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def gumbel_sample(probs: torch.Tensor, seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] by the Gumbel-max trick: argmax(log p_t + G_t)
    with G_t = -log(-log U_t), U_t a counter uniform of (seed, index, token t).  Exact for
    any p, and two distributions sampled with the same (seed, index) pick the same token
    as often as a shared noise allows, which is what coupled verification needs."""
    v = probs.shape[-1]
    tok = torch.arange(v, device=probs.device)
    u = counter_uniform(seeds[:, None], index[:, None] * v + tok[None], STREAM_GUMBEL)   # [R, V]
    g = -torch.log(-torch.log(u.clamp_(min=2.0 ** -60)))
    return (probs.double().log() + g).argmax(-1)


@dataclass(slots=True)
class SeqSamplingInput:
    """Host description of one sequence's rows (built by the runner)."""
    params: SamplingParams
    seed: int
    num_rows: int
    first_token_index: int            # absolute index of the token row 0 predicts
    num_output_tokens: int            # output tokens before row 0's token
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int]


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row device tensors for one sampling pass.  R = rows, S = sequences."""
    num_rows: int
    row_seq: torch.Tensor             # [R] int64 sequence of each row
    row_offset: torch.Tensor          # [R] int64 row index inside its sequence
    token_index: torch.Tensor         # [R] int64 absolute index of the predicted token
    seeds: torch.Tensor               # [R] int64
    temperature: torch.Tensor         # [R] float32, 1.0 on greedy rows
    greedy: torch.Tensor              # [R] bool
    all_greedy: bool
    any_greedy: bool                  # host copies of greedy.all() / greedy.any(): no sync
    top_k: torch.Tensor | None        # [R] int64, vocab size where off
    top_p: torch.Tensor | None        # [R] float32
    min_p: torch.Tensor | None        # [R] float32
    rep_penalty: torch.Tensor | None  # [R] float32
    freq_penalty: torch.Tensor | None
    pres_penalty: torch.Tensor | None
    output_counts: torch.Tensor | None  # [S, V] float32 counts of output tokens
    prompt_mask: torch.Tensor | None    # [S, V] bool prompt tokens (repetition penalty)
    bias_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, tokens)
    bias_value: torch.Tensor | None
    mask_index: tuple[torch.Tensor, torch.Tensor] | None  # min_tokens: (rows, stop ids)
    coupled: torch.Tensor | None = None  # [Rc] int64: rows of seeded sampled requests (module doc)

    @classmethod
    def build(cls, seqs: list[SeqSamplingInput], vocab_size: int,
              device: torch.device | str) -> "SamplingMetadata":
        rows = [s.num_rows for s in seqs]
        num_rows = int(sum(rows))
        row_seq, row_offset = expand_rows(torch.tensor(rows, dtype=torch.int64))

        def per_row(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype)[row_seq].to(device)

        ps = [s.params for s in seqs]
        greedy_l = [p.greedy for p in ps]
        token_index = torch.tensor([s.first_token_index for s in seqs])[row_seq] + row_offset
        seeds = per_row([s.seed for s in seqs], torch.int64)
        temperature = per_row([1.0 if p.greedy else p.temperature for p in ps], torch.float32)
        greedy = per_row(greedy_l, torch.bool)
        all_greedy = all(greedy_l)
        sampled = [not g for g in greedy_l]

        def opt(values: list, off, dtype, active: list[bool]) -> torch.Tensor | None:
            if not any(a and v != off for v, a in zip(values, active)):
                return None
            return per_row([v if a else off for v, a in zip(values, active)], dtype)

        top_k = opt([p.top_k if p.top_k > 0 else vocab_size for p in ps], vocab_size,
                    torch.int64, sampled)
        top_p = opt([p.top_p for p in ps], 1.0, torch.float32, sampled)
        min_p = opt([p.min_p for p in ps], 0.0, torch.float32, sampled)
        every = [True] * len(ps)
        rep = opt([p.repetition_penalty for p in ps], 1.0, torch.float32, every)
        freq = opt([p.frequency_penalty for p in ps], 0.0, torch.float32, every)
        pres = opt([p.presence_penalty for p in ps], 0.0, torch.float32, every)
        output_counts = prompt_mask = None
        if rep is not None or freq is not None or pres is not None:
            output_counts = _counts([s.output_ids for s in seqs], vocab_size)
            if rep is not None:
                prompt_mask = _counts([s.prompt_ids for s in seqs], vocab_size) > 0
                prompt_mask = prompt_mask.to(device)
            output_counts = output_counts.to(device)

        bias_index, bias_value = _logit_bias(seqs, device)
        mask_index = min_tokens_mask(seqs, device)
        coupled_l = [p.seed is not None and not p.greedy for p in ps]
        coupled = None
        if any(coupled_l):                # row indices built on the host: no sync to find them
            coupled = torch.nonzero(torch.tensor(coupled_l)[row_seq]).squeeze(1).to(device)
        return cls(num_rows, row_seq.to(device), row_offset.to(device), token_index.to(device),
                   seeds, temperature, greedy, all_greedy, any(greedy_l), top_k, top_p, min_p, rep, freq, pres,
                   output_counts, prompt_mask, bias_index, bias_value, mask_index, coupled)

    @property
    def has_penalties(self) -> bool:
        return self.output_counts is not None


def _logit_bias(seqs: list[SeqSamplingInput], device: torch.device | str
                ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """logit_bias as sparse (rows, tokens) -> value edits over every row of a sequence."""
    rows, toks, vals = [], [], []
    start = 0
    for s in seqs:
        for tok, val in (s.params.logit_bias or {}).items():
            for r in range(start, start + s.num_rows):
                rows.append(r), toks.append(int(tok)), vals.append(float(val))
        start += s.num_rows
    if not rows:
        return None, None
    return ((torch.tensor(rows, device=device), torch.tensor(toks, device=device)),
            torch.tensor(vals, dtype=torch.float32, device=device))


def min_tokens_mask(seqs: list[SeqSamplingInput], device: torch.device | str,
                    ahead: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, stop ids) to mask while a sequence has fewer than ``min_tokens`` outputs.

    Row r of a sequence predicts its output token ``num_output_tokens + ahead + r``; the
    stop ids are masked on the rows before ``min_tokens``.  ``ahead``: a chained draft
    pass predicts that many tokens past the rows' own (spec/proposer.py)."""
    rows, toks = [], []
    start = 0
    for s in seqs:
        short = s.params.min_tokens - s.num_output_tokens - ahead
        if short > 0 and s.stop_ids:
            for r in range(start, start + min(s.num_rows, short)):
                for tok in s.stop_ids:
                    rows.append(r), toks.append(tok)
        start += s.num_rows
    if not rows:
        return None
    return torch.tensor(rows, device=device), torch.tensor(toks, device=device)


def _counts(lists: list[list[int]], vocab_size: int) -> torch.Tensor:
    lens = torch.tensor([len(x) for x in lists], dtype=torch.int64)
    flat = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lists)), lens)
    out = torch.zeros(len(lists), vocab_size, dtype=torch.float32)
    out.index_put_((seq, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return out


def process_logits(logits: torch.Tensor, meta: SamplingMetadata,
                   context: torch.Tensor | None = None) -> torch.Tensor:
    """Penalties, logit_bias and min_tokens on ``logits`` [R, V] (float32, new tensor).

    ``context`` [R, C] int64 (-1 = none): tokens that precede each row's token beyond the
    sequence's output_ids (the accepted-draft prefix), counted as output tokens.
    """
    logits = logits.float().clone()
    if meta.has_penalties:
        counts = meta.output_counts[meta.row_seq]
        if context is not None and context.numel():
            valid = context >= 0
            counts.scatter_add_(1, context.clamp(min=0), valid.float())
        if meta.rep_penalty is not None:
            seen = counts > 0
            if meta.prompt_mask is not None:
                seen |= meta.prompt_mask[meta.row_seq]
            pen = meta.rep_penalty.unsqueeze(1)
            logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)
        if meta.freq_penalty is not None:
            logits -= meta.freq_penalty.unsqueeze(1) * counts
        if meta.pres_penalty is not None:
            logits -= meta.pres_penalty.unsqueeze(1) * (counts > 0).float()
    if meta.bias_index is not None:
        logits.index_put_(meta.bias_index, meta.bias_value, accumulate=True)
    if meta.mask_index is not None:
        logits.index_put_(meta.mask_index, torch.tensor(float("-inf"), device=logits.device))
    return logits


def to_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Processed logits [R, V] -> the distribution each row samples from (greedy: one-hot)."""
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.top_k is not None or meta.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if meta.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
            remove |= ranks >= meta.top_k.unsqueeze(1)
        if meta.top_p is not None:
            p = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            before = p.cumsum(-1) - p               # mass strictly above this token
            remove |= before > meta.top_p.unsqueeze(1)
        remove[:, 0] = False                        # the best token always survives
        logits = logits.scatter(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    if meta.min_p is not None:
        top = probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < meta.min_p.unsqueeze(1) * top, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if meta.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(meta.greedy.unsqueeze(1), onehot, probs)
    return probs


def sample_rows(logits: torch.Tensor, meta: SamplingMetadata, stream: int = STREAM_SAMPLE,
                context: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row; returns (tokens [R], probs [R, V] or None when all greedy)."""
    processed = process_logits(logits, meta, context)
    if meta.all_greedy:
        return processed.argmax(-1), None
    probs = to_probs(processed, meta)
    u = counter_uniform(meta.seeds, meta.token_index, stream)
    tokens = sample_inverse_cdf(probs, u)
    if meta.coupled is not None:
        # Seeded rows: Gumbel-max with the noise of their (seed, index), as their target
        # sample will use (coupled verification, module doc).
        c = meta.coupled
        tokens[c] = gumbel_sample(probs[c], meta.seeds[c], meta.token_index[c])
    return tokens, probs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   num_top: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Raw target logprobs of ``tokens`` [R] under ``logits`` [R, V], plus the top ``num_top``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.clamp(min=0).unsqueeze(1)).squeeze(1)
    if num_top <= 0:
        return chosen, None, None
    top_lp, top_ids = lp.topk(num_top, dim=-1)
    return chosen, top_ids, top_lp
