"""The MTP proposer: drafting with the checkpoint's MTP layer, and the drafts it holds.

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

A long first pass (a prompt, or a chunk of one) runs in two parts: every position's MTP
KV is written without running the layer (``mtp_write_kv``: the KV depends only on the
layer's input at that position), then the whole layer runs on each sequence's last
position alone, whose output is the only one read.  The attention and MoE of the other
positions' outputs, which nothing reads, are never computed.

The proposer owns everything MTP keeps between steps: the held drafts of every request and
the distributions q they were sampled from (for ratio verification), the inputs of the
draft passes, and the per-step choice of k (its SpecPolicy, plus seeded pinning).  With MTP
off the worker uses ``NoProposer``: the same interface, nothing held, nothing drafted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from server.engine.batch.metadata import build_metadata
from server.engine.batch.request_state import RequestState
from server.engine.batch.window import StepWindow, WindowForm
from server.engine.sample import sampler
from server.engine.sample.greedy import greedy_ids
from server.engine.spec.deferred_kv import DeferredMTPWrites
from server.engine.spec.policy import SpecPolicy
from server.model.batch import BatchMetadata, DecodeMetadata


@dataclass(frozen=True, slots=True)
class DraftPasses:
    """A step's MTP passes, their inputs already built from the request states as they
    were before the step is committed; ``run()`` runs them, now or later (after the step's
    tokens went out: worker/worker.py, "drafting after the tokens go out"), and gives the
    drafts, or None (k 0, which only writes the MTP layer's KV, or MTP off)."""
    passes: Callable[[], DraftResult | None]

    def run(self) -> DraftResult | None:
        return self.passes()


NO_DRAFTS = DraftPasses(lambda: None)


@dataclass(frozen=True, slots=True)
class DraftMask:
    """Grammar masks for the first draft of constrained requests (grammar.next_masks):
    ``bitmask``'s rows applied to logits rows ``rows`` (sample/grammar_masks.py)."""
    applier: Any                        # grammar_masks.MaskApplier
    rows: torch.Tensor                  # [M] int64
    bitmask: Any

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.applier.apply(logits, self.rows, self.bitmask)


class NoProposer:
    """MTP off: every window is one row, nothing is drafted."""
    max_draft_tokens = 0
    policy = None

    def num_held(self, request_id: str) -> int:
        return 0

    @property
    def num_held_requests(self) -> int:
        return 0

    def held_drafts(self, states, num_drafts, K: int, device) -> torch.Tensor:
        return torch.zeros(len(states), 0, dtype=torch.int64, device=device)

    def draft_probs(self, states, num_drafts, K, draft_ids):
        return None

    def choose_k(self, states) -> int:
        return 0

    def propose(self, window: StepWindow, sampled: list[list[int]], hidden: torch.Tensor,
                k: int, draft_mask: DraftMask | None = None) -> DraftPasses:
        return NO_DRAFTS

    def commit(self, states, drafts, k, num_drafts, sampled) -> None:
        pass

    def observe_step(self, num_seqs: int, k: int, seconds: float) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass

    def flush_kv(self) -> None:
        pass


class MTPProposer:
    """Drafts with the MTP layer; holds each request's drafts on the device between steps."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int,
                 policy: SpecPolicy, device: torch.device, static_decode: bool = False,
                 draft_head: torch.nn.Module | None = None, defer_kv_writes: bool = False) -> None:
        self.model = model
        # k = 0 steps' MTP KV, written many steps at a time (spec/deferred_kv.py); None:
        # written in each step (a rank group).
        self.deferred = DeferredMTPWrites(model, kv_caches) if defer_kv_writes else None
        # What the drafts' logits multiply by instead of the MTP layer's head (an int8 copy:
        # engine/spec/draft_head.py); verification always takes the model's own head.
        self.draft_head = draft_head
        self.static_decode = static_decode     # chained passes (one token each) take the static path
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.policy = policy
        self.device = device
        self.vocab_size = model.config.vocab_size
        # request id -> (the drafting step's ids [S, k], the request's row in it, q [k, V]
        # or None for greedy drafts).  Rows of the step's tensor, not a copy per request:
        # when the next step runs the same requests in the same order (steady decoding),
        # ``held_drafts`` hands that tensor back whole instead of a copy per request.
        self._held: dict[str, tuple[torch.Tensor, int, torch.Tensor | None]] = {}

    @property
    def max_draft_tokens(self) -> int:
        return self.policy.max_draft_tokens

    def num_held(self, request_id: str) -> int:
        held = self._held.get(request_id)
        return 0 if held is None else int(held[0].shape[1])

    @property
    def num_held_requests(self) -> int:
        return len(self._held)

    def drop(self, request_id: str) -> None:
        """Forget a request's drafts (finished or aborted; a preempted request keeps them:
        the recompute step verifies them exactly as the next decode step would have)."""
        self._held.pop(request_id, None)

    def flush_kv(self) -> None:
        """Write the held k = 0 MTP KV (spec/deferred_kv.py: when the worker must)."""
        if self.deferred is not None:
            self.deferred.flush()

    def held_drafts(self, states: list[RequestState], num_drafts: list[int], K: int,
                    device: torch.device) -> torch.Tensor:
        """[S, K] draft ids (0-padded) fed after each sequence's known tokens.  Callers
        only read it: it may be the drafting step's own tensor."""
        held = [self._held[st.request_id] if d else None for st, d in zip(states, num_drafts)]
        step_ids = held[0][0] if held and held[0] is not None else None
        if (step_ids is not None and step_ids.shape[1] == K
                and all(h is not None and h[0] is step_ids for h in held)):
            rows = [h[1] for h in held]
            if rows == list(range(step_ids.shape[0])):
                return step_ids
            return step_ids[torch.tensor(rows, dtype=torch.int64).to(step_ids.device)]
        drafts = torch.zeros(len(states), K, dtype=torch.int64, device=device)
        for i, (h, d) in enumerate(zip(held, num_drafts)):
            if d:
                drafts[i, :d] = h[0][h[1], :d]
        return drafts

    def draft_probs(self, states: list[RequestState], num_drafts: list[int], K: int,
                    draft_ids: torch.Tensor) -> torch.Tensor | None:
        """q [S, K, V] for verification: the stored q of sampled drafts, one-hot for greedy ones."""
        stored = [self._held[s.request_id][2] if d else None for s, d in zip(states, num_drafts)]
        if all(q is None for q in stored):
            return None
        q = torch.zeros(len(states), K, self.vocab_size, device=self.device)
        q.scatter_(2, draft_ids.unsqueeze(2), 1.0)
        for i, sq in enumerate(stored):
            if sq is not None:
                q[i, :sq.shape[0]] = sq[:K]
        return q

    def choose_k(self, states: list[RequestState]) -> int:
        """Drafts per sequence for the next step.

        The policy may pick any k in 0..max per step; a sequence holding more or fewer
        drafts than the new k was verified on what it held, and now gets k.  A seeded
        sampled request pins k to the maximum while it runs: its tokens are reproducible
        (alone, batched, preempted) only under a fixed draft schedule.
        """
        if any(s.sampling.seed is not None and not s.sampling.greedy for s in states):
            return self.policy.max_draft_tokens
        return self.policy.num_draft_tokens(len(states))

    def propose(self, window: StepWindow, sampled: list[list[int]], hidden: torch.Tensor,
                k: int, draft_mask: DraftMask | None = None) -> DraftPasses:
        """The passes that draft k tokens per sequence from the positions the main forward
        over ``window`` verified (module docstring); ``sampled``: each request's accepted
        drafts and final token; ``hidden``: the forward's hidden states [T, H].  Every
        input is built now (from the request states as they are before the step is
        committed); the model runs when the caller runs the passes.

        k == 0 still runs the MTP layer's first pass: it writes the MTP KV of the verified
        positions, which later drafts attend to once k rises again (a plain decode step's
        later, with others': spec/deferred_kv.py).  Nothing is held until
        ``commit``: a step that fails later leaves the proposer as it was.

        The first pass takes the main forward's form.  A static window (every request one
        token plus Q - 1 drafts, ``hidden`` Q rows each): the same window, all Q rows of
        every request, the rows past the emitted tokens fed token 0; they write MTP KV at
        positions after the last verified one, which no query reads before a later pass
        (this step's chained passes, or the next step's first pass) rewrites it.  One
        request's prompt (chunk) on the static path (runner._static_prefill): that path
        too, on the same positions.  Otherwise the verified positions as varlen rows.

        ``draft_mask``: grammar masks for the first draft of constrained requests; chained
        drafts are not masked (their masks would need the previous draft on the host).
        Masking a draft changes only how often it is accepted: q is the masked
        distribution it was drawn from.
        """
        states, starts, n_new = window.states, window.starts, window.num_new
        m = [n + len(toks) - 1 for n, toks in zip(n_new, sampled)]       # verified positions
        first, input_ids, prev_hidden, last_rows = self._first_pass(window, sampled, hidden, m)
        base = [s0 + mm for s0, mm in zip(starts, m)]     # position of the emitted final token
        tables = [s.block_table for s in states]

        def chain_meta(c: int) -> BatchMetadata | DecodeMetadata:
            starts_c = [b - 1 + c for b in base]
            if self.static_decode:
                return DecodeMetadata.build(starts_c, 1, tables, self.block_size, self.device)
            return build_metadata(starts_c, [1] * len(states), tables, self.block_size,
                                  self.device)

        samp = self._draft_sampling(states, base, sampled, k)
        deferred = self.deferred
        # A plain decode step drafting nothing: one verified position a sequence, whose MTP
        # KV can wait (spec/deferred_kv.py).
        hold = deferred is not None and k == 0 and input_ids.shape[0] == len(states) \
            and all(mm == 1 for mm in m)

        def passes() -> DraftResult | None:
            if hold:
                deferred.add(input_ids, prev_hidden, first.positions, first.slot_mapping)
                return None
            if deferred is not None:
                deferred.flush()                # the drafts attend to those positions
            return run_draft_passes(self.model, self.kv_caches, k, first, input_ids, prev_hidden,
                                    last_rows, samp, self.vocab_size, chain_meta, draft_mask,
                                    self.draft_head)
        return DraftPasses(passes)

    def _first_pass(self, window: StepWindow, sampled: list[list[int]], hidden: torch.Tensor,
                    m: list[int]):
        """The first MTP pass's (metadata, input ids, main hidden states, each sequence's
        last row): over the verified positions ``start .. start + m - 1``."""
        dev = self.device
        states, starts = window.states, window.starts
        tables = [s.block_table for s in states]
        if window.form is WindowForm.STATIC:
            q = window.meta.query_len
            ids = [t for toks in sampled for t in toks + [0] * (q - len(toks))]
            last_rows = torch.tensor([i * q + len(toks) - 1 for i, toks in enumerate(sampled)],
                                     dtype=torch.int64).to(dev)
            return window.meta, torch.tensor(ids, dtype=torch.int64).to(dev), hidden, last_rows
        ids: list[int] = []
        rows: list[int] = []
        for st, s0, n, toks, c0, mm in zip(states, starts, window.num_new, sampled, window.cu, m):
            ids.extend(st.token_ids[s0 + 1:s0 + n])
            ids.extend(toks)
            rows.extend(range(c0, c0 + mm))
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev)
        prev_hidden = hidden[torch.tensor(rows, dtype=torch.int64).to(dev)]
        if window.form is WindowForm.STATIC_PREFILL:
            first = DecodeMetadata.build(starts, m[0], tables, self.block_size, dev)
            return first, input_ids, prev_hidden, torch.tensor([m[0] - 1], dtype=torch.int64,
                                                               device=dev)
        first = build_metadata(starts, m, tables, self.block_size, dev)
        return first, input_ids, prev_hidden, (first.query_start_loc[1:] - 1).to(torch.int64)

    @staticmethod
    def _draft_sampling(states, base, sampled, k: int) -> list[sampler.SeqSamplingInput] | None:
        """How each sequence's first draft is sampled; None: every draft is the raw argmax
        (the min_tokens test is against the count before this step, so it also holds for
        every draft position)."""
        if not k or all(st.plain_greedy for st in states):
            return None
        samp = []
        for st, b, toks in zip(states, base, sampled):
            prompt, output = st.penalty_context()
            if st.sampling.has_penalties:
                output = output + toks
            samp.append(sampler.SeqSamplingInput(st.sampling, st.seed, 1, b + 1,
                                                 st.num_output_tokens + len(toks), prompt,
                                                 output, st.stop_ids))
        return samp

    def commit(self, states: list[RequestState], drafts: DraftResult | None, k: int,
               num_drafts: list[int], sampled: list[list[int]]) -> None:
        """Hold the new drafts and feed the policy the verified windows."""
        for d, toks in zip(num_drafts, sampled):
            if d:
                self.policy.observe(d, len(toks) - 1)
        if drafts is None or not k:
            for st in states:
                self._held.pop(st.request_id, None)
            return
        for i, st in enumerate(states):
            q = drafts.probs[i] if drafts.probs is not None and not st.sampling.greedy else None
            self._held[st.request_id] = (drafts.ids, i, q)

    def observe_step(self, num_seqs: int, k: int, seconds: float) -> None:
        self.policy.observe_step(num_seqs, k, seconds)

# A first pass of at least this many rows per sequence runs in two parts (module
# docstring).  A decode window's (1 + k rows) stays one pass: there the second call would
# cost more than the rows it saves.
SPLIT_FIRST_PASS_ROWS = 8


@dataclass(slots=True)
class DraftResult:
    ids: torch.Tensor                   # [S, k] int64 draft tokens
    probs: torch.Tensor | None          # [S, k, V] q each draft was sampled from; None if all greedy


def run_draft_passes(model, kv_caches: list[torch.Tensor], k: int, first: BatchMetadata,
                     input_ids: torch.Tensor, prev_hidden: torch.Tensor,
                     last_rows: torch.Tensor, sampling: list[sampler.SeqSamplingInput] | None,
                     vocab_size: int, chain_meta,
                     draft_mask: DraftMask | None = None,
                     head: torch.nn.Module | None = None) -> DraftResult | None:
    """Run the first MTP pass plus k-1 chained passes; sample one draft per sequence per pass.

    first / input_ids / prev_hidden: the first pass (see module docstring).
    last_rows [S]: index of each sequence's last position in the first pass.
    sampling[s]: row 0 predicts the first draft (first_token_index = its absolute index);
    None: every draft is the argmax of the raw MTP logits.
    chain_meta(c) -> BatchMetadata for chained pass c (1..k-1): one token per sequence;
    chain_meta(0): the first pass's last position of each sequence.
    k == 0 only writes the first pass's MTP KV (later drafts attend to it) and returns None.
    head: the drafts' vocabulary head, if not the MTP layer's own (engine/spec/draft_head.py).
    """
    device = input_ids.device
    if k == 0:
        model.mtp_write_kv(input_ids, prev_hidden, first.positions, first.slot_mapping,
                           kv_caches, layer=0)
        return None
    if input_ids.shape[0] >= SPLIT_FIRST_PASS_ROWS * last_rows.shape[0]:
        # A long first pass (module docstring): KV everywhere, the layer on the last rows.
        model.mtp_write_kv(input_ids, prev_hidden, first.positions, first.slot_mapping,
                           kv_caches, layer=0)
        h = model.mtp_forward(input_ids[last_rows], prev_hidden[last_rows], chain_meta(0),
                              kv_caches, layer=0)
    else:
        h = model.mtp_forward(input_ids, prev_hidden, first, kv_caches, layer=0)[last_rows]
    meta = sampler.SamplingMetadata.build(sampling, vocab_size, device) if sampling is not None else None
    ids: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    context = None
    for c in range(k):
        if c:
            if meta is not None:
                meta.token_index = meta.token_index + 1
                _advance_min_tokens(meta, sampling, c)
            h = model.mtp_forward(ids[-1], h, chain_meta(c), kv_caches, layer=0)
        logits = model.mtp_compute_logits(h, layer=0, head=head)
        if c == 0 and draft_mask is not None:
            logits = draft_mask.apply(logits)
        if meta is None:
            tok, q = greedy_ids(logits), None
        else:
            tok, q = sampler.sample_rows(logits, meta, sampler.STREAM_DRAFT, context)
        ids.append(tok)
        if q is not None:
            probs.append(q)
        if meta is not None and c + 1 < k:       # penalties' context for the next draft
            context = torch.stack(ids, dim=1)
    return DraftResult(torch.stack(ids, dim=1), torch.stack(probs, dim=1) if probs else None)


def _advance_min_tokens(meta: sampler.SamplingMetadata, sampling: list[sampler.SeqSamplingInput],
                        c: int) -> None:
    """Chained pass c predicts c tokens further on: rebuild the min_tokens mask for that."""
    if meta.mask_index is not None:
        meta.mask_index = sampler.min_tokens_mask(sampling, meta.token_index.device, ahead=c)
