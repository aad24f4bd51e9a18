"""Turns a ScheduledBatch into tensors, runs the model, verifies, drafts.

One step (DESIGN.md "One MTP decode step"), for every scheduled sequence at once:
  1. one main forward over each sequence's new tokens + held drafts (varlen: prefills and
     k+1-token verification windows side by side);
  2. sample / verify the window rows (sampler.verify);
  3. THE host sync of the step: emitted tokens, acceptance counts and logprobs go to the
     host in one transfer (everything before it is queued device work);
  4. MTP drafting for the next step from the true hidden states of the verified positions
     (mtp.py); the drafts stay on the device until the next step feeds them.
With MTP off (k = 0 or a checkpoint without MTP weights) step 4 is skipped and every
window is one row: plain decoding through the same code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine import mtp as M
from server.engine import sampler as S
from server.engine.protocol import TokenLogprob
from server.engine.scheduler import ScheduledBatch
from server.model.batch import BatchMetadata


@dataclass(slots=True)
class _Window:
    """One step's main-forward inputs (built by ModelRunner._window)."""
    input_ids: torch.Tensor      # [T] int64
    meta: BatchMetadata
    cu: list[int]                # cumulative query lengths (host)
    row_seq: torch.Tensor        # [R] sequence of each logits row
    row_off: torch.Tensor        # [R] row index inside its sequence's window
    drafts: torch.Tensor         # [S, K] held drafts (0-padded)
    K: int                       # most drafts any sequence holds


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[list[int]]                       # per scheduled seq: accepted drafts + final token
    num_drafts_next: list[int]                     # drafts now held for the next step
    logprobs: list[list[TokenLogprob] | None]


def build_metadata(starts: list[int], query_lens: list[int], tables: list[list[int]],
                   block_size: int, device: torch.device,
                   logits_indices: torch.Tensor | None = None) -> BatchMetadata:
    """Metadata for sequences feeding ``query_lens[s]`` tokens from position ``starts[s]``.

    Slot of a token at position p: table[p // block_size] * block_size + p % block_size
    (worked example in server/model/batch.py).
    """
    n = len(starts)
    q = torch.tensor(query_lens, dtype=torch.int64)
    st = torch.tensor(starts, dtype=torch.int64)
    cu = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(q, 0, out=cu[1:])
    num_tokens = int(cu[-1])
    seq_of = torch.repeat_interleave(torch.arange(n), q, output_size=num_tokens)
    positions = torch.arange(num_tokens) - cu[seq_of] + st[seq_of]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    slots = bt[seq_of, positions // block_size] * block_size + positions % block_size
    seq_lens = [s + ql for s, ql in zip(starts, query_lens)]
    return BatchMetadata(
        positions=positions.to(device),
        query_start_loc=cu.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=bt.to(torch.int32).to(device),
        slot_mapping=slots.to(device),
        block_size=block_size,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        logits_indices=logits_indices.to(device) if logits_indices is not None else None,
    )


def _has_penalties(p) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def _penalty_context(seq) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) for penalties; empty lists when the request has none
    (copying every sequence's tokens each step would cost O(length) per step)."""
    p = seq.sampling
    if not _has_penalties(p):
        return [], []
    return (seq.prompt_token_ids if p.repetition_penalty != 1.0 else []), seq.output_token_ids


class ModelRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int,
                 policy: M.SpecPolicy, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.policy = policy
        self.device = torch.device(device)
        self.vocab_size = model.config.vocab_size
        self.mtp_enabled = bool(model.has_mtp) and policy.max_draft_tokens > 0
        # request id -> (draft ids [k], q [k, V] or None), held between steps on the device.
        self._drafts: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def drop(self, request_id: str) -> None:
        """Forget a request's drafts (finished, aborted or preempted)."""
        self._drafts.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        scheds = batch.seqs
        seqs = [s.seq for s in scheds]
        starts = [s.start_pos for s in scheds]
        n_new = [s.num_new_tokens for s in scheds]
        nd = [s.num_drafts for s in scheds]
        w = self._window(seqs, starts, n_new, nd)

        hidden = self.model.forward(w.input_ids, w.meta, self.kv_caches)   # [T, H]
        logits = self.model.compute_logits(hidden[w.meta.logits_indices])  # [R, V]
        tokens, num_acc = self._verify(seqs, starts, n_new, nd, w, logits)
        want_lp = [seq.sampling.logprobs for seq in seqs]
        lp = None
        if any(want_lp):
            row_tokens = tokens[w.row_seq, w.row_off]
            lp = S.token_logprobs(logits, row_tokens, max(s.sampling.top_logprobs for s in seqs))

        # ---- the step's host sync: emitted tokens and acceptance counts, one transfer ----
        both = torch.cat([tokens, num_acc.to(tokens.dtype).unsqueeze(1)], dim=1).tolist()
        sampled = [row[:row[-1] + 1] for row in both]
        for d, row in zip(nd, both):
            if d:
                self.policy.observe(d, row[-1])
        logprobs = self._logprobs(sampled, [d + 1 for d in nd], want_lp, lp,
                                  [s.sampling.top_logprobs for s in seqs])

        # ---- drafts for the next step (stay on the device) -----------------------------
        # The policy may pick any k in 0..max per step; a sequence holding more or fewer
        # drafts than the new k was verified on what it held above, and now gets k.
        # A seeded sampled request pins k to the maximum while it runs: its tokens are
        # reproducible (alone, batched, preempted) only under a fixed draft schedule.
        if not self.mtp_enabled:
            k = 0
        elif any(seq.sampling.seed is not None and not seq.sampling.greedy for seq in seqs):
            k = self.policy.max_draft_tokens
        else:
            k = self.policy.num_draft_tokens(len(seqs))
        if self.mtp_enabled:
            # k == 0 still runs the MTP layer's first pass: it writes the MTP KV of the
            # verified positions, which later drafts attend to once k rises again.
            self._draft(seqs, starts, n_new, sampled, w.cu, hidden, k)
        if not k:
            for seq in seqs:
                self._drafts.pop(seq.request_id, None)
        return RunnerOutput(sampled, [k] * len(seqs), logprobs)

    def _window(self, seqs, starts, n_new, nd) -> "_Window":
        """Main-forward inputs: each sequence's new tokens, then its drafts.

        Rows: sequence s with d drafts owns d+1 logits rows, its last d+1 tokens (the last
        known token and each draft); row j predicts the token after draft j.
        """
        dev = self.device
        K = max(nd)
        qlens = [a + b for a, b in zip(n_new, nd)]
        flat: list[int] = []
        for seq, st, n, d in zip(seqs, starts, n_new, nd):
            flat.extend(seq.token_ids[st:st + n])
            flat.extend([0] * d)                      # placeholders, filled from the device
        input_ids = torch.tensor(flat, dtype=torch.int64).to(dev)
        cu = [0]
        for ql in qlens:
            cu.append(cu[-1] + ql)
        nrows = torch.tensor(nd, dtype=torch.int64) + 1
        row_seq = torch.repeat_interleave(torch.arange(len(seqs)), nrows)
        row_off = torch.arange(int(nrows.sum())) - (torch.cumsum(nrows, 0) - nrows)[row_seq]
        logits_indices = torch.tensor(cu[1:])[row_seq] - nrows[row_seq] + row_off
        drafts = torch.zeros(len(seqs), K, dtype=torch.int64, device=dev)   # [S, K]
        if K:
            for i, (seq, d) in enumerate(zip(seqs, nd)):
                if d:
                    drafts[i, :d] = self._drafts[seq.request_id][0][:d]
            before = row_off < nrows[row_seq] - 1     # rows followed by a draft token
            input_ids[(logits_indices[before] + 1).to(dev)] = \
                drafts[row_seq[before].to(dev), row_off[before].to(dev)]
        meta = build_metadata(starts, qlens, [s.block_table for s in seqs], self.block_size, dev,
                              logits_indices)
        return _Window(input_ids, meta, cu, row_seq.to(dev), row_off.to(dev), drafts, K)

    def _verify(self, seqs, starts, n_new, nd, w: "_Window", logits: torch.Tensor):
        """Process the window rows, then verify: tokens [S, K+1], num_accepted [S]."""
        dev, K, S_ = self.device, w.K, len(seqs)
        samp = [S.SeqSamplingInput(seq.sampling, seq.seed, d + 1, st + n, seq.num_output_tokens,
                                   *_penalty_context(seq), seq.stop_ids)
                for seq, d, st, n in zip(seqs, nd, starts, n_new)]
        smeta = S.SamplingMetadata.build(samp, self.vocab_size, dev)
        context = None
        if K and smeta.has_penalties:                 # accepted-draft prefix as context
            ctx = w.drafts[w.row_seq]                 # [R, K]
            context = torch.where(torch.arange(K, device=dev)[None] < w.row_off[:, None], ctx, -1)
        processed = S.process_logits(logits, smeta, context)
        pad_index = w.row_seq * (K + 1) + w.row_off
        argmax_pad = torch.zeros(S_ * (K + 1), dtype=torch.int64, device=dev)
        argmax_pad[pad_index] = processed.argmax(-1)
        argmax_pad = argmax_pad.view(S_, K + 1)
        nd_t = torch.tensor(nd, dtype=torch.int64, device=dev)
        if smeta.all_greedy:
            return S.verify(None, argmax_pad, w.drafts, None, nd_t, None, None)
        probs = S.to_probs(processed, smeta)
        probs_pad = probs.new_zeros(S_ * (K + 1), probs.shape[-1])
        probs_pad[pad_index] = probs
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=dev)
        first = torch.tensor([st + n for st, n in zip(starts, n_new)], dtype=torch.int64, device=dev)
        idx = first[:, None] + torch.arange(K + 1, device=dev)[None]    # token index of each row
        u_acc = S.counter_uniform(seeds[:, None], idx[:, :K], S.STREAM_ACCEPT)
        u_smp = S.counter_uniform(seeds[:, None], idx, S.STREAM_SAMPLE)
        q = self._draft_probs(seqs, nd, K, w.drafts) if K else None
        return S.verify(probs_pad.view(S_, K + 1, -1), argmax_pad, w.drafts, q, nd_t, u_acc, u_smp)

    def _draft_probs(self, seqs, nd, K, draft_ids) -> torch.Tensor | None:
        """q [S, K, V] for verification: the stored q of sampled drafts, one-hot for greedy ones."""
        stored = [self._drafts[s.request_id][1] if d else None for s, d in zip(seqs, nd)]
        if all(q is None for q in stored):
            return None
        V = self.vocab_size
        q = torch.zeros(len(seqs), K, V, device=self.device)
        q.scatter_(2, draft_ids.unsqueeze(2), 1.0)
        for i, sq in enumerate(stored):
            if sq is not None:
                q[i, :sq.shape[0]] = sq[:K]
        return q

    def _draft(self, seqs, starts, n_new, sampled, cu, hidden, k: int) -> None:
        dev = self.device
        m = [n + len(toks) - 1 for n, toks in zip(n_new, sampled)]       # verified positions
        ids: list[int] = []
        rows: list[int] = []
        for seq, st, n, toks, c0, mm in zip(seqs, starts, n_new, sampled, cu, m):
            ids.extend(seq.token_ids[st + 1:st + n])
            ids.extend(toks)
            rows.extend(range(c0, c0 + mm))
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev)
        prev_hidden = hidden[torch.tensor(rows, dtype=torch.int64).to(dev)]
        tables = [s.block_table for s in seqs]
        first = build_metadata(starts, m, tables, self.block_size, dev)
        last_rows = (first.query_start_loc[1:] - 1).to(torch.int64)
        base = [st + mm for st, mm in zip(starts, m)]     # position of the emitted final token

        def chain_meta(c: int) -> BatchMetadata:
            return build_metadata([b - 1 + c for b in base], [1] * len(seqs), tables,
                                  self.block_size, dev)

        samp = []
        for seq, b, toks in zip(seqs, base, sampled if k else ()):
            prompt, output = _penalty_context(seq)
            if _has_penalties(seq.sampling):
                output = output + toks
            samp.append(S.SeqSamplingInput(seq.sampling, seq.seed, 1, b + 1,
                                           seq.num_output_tokens + len(toks), prompt, output,
                                           seq.stop_ids))
        res = M.propose(self.model, self.kv_caches, k, first, input_ids, prev_hidden, last_rows,
                        samp, self.vocab_size, chain_meta)
        if res is None:
            return
        for i, seq in enumerate(seqs):
            self._drafts[seq.request_id] = (res.ids[i], res.probs[i] if res.probs is not None
                                            and not seq.sampling.greedy else None)

    @staticmethod
    def _logprobs(sampled, rows, want, lp, n_tops) -> list[list[TokenLogprob] | None]:
        out: list[list[TokenLogprob] | None] = []
        lp_host = None
        if lp is not None:
            chosen, top_ids, top_lp = lp
            lp_host = (chosen.tolist(), top_ids.tolist() if top_ids is not None else None,
                       top_lp.tolist() if top_lp is not None else None)
        r0 = 0
        for toks, r, w, nt in zip(sampled, rows, want, n_tops):
            if not w or lp_host is None:
                out.append(None)
            else:
                chosen, top_ids, top_lp = lp_host
                out.append([TokenLogprob(t, chosen[r0 + j],
                                         list(zip(top_ids[r0 + j][:nt], top_lp[r0 + j][:nt]))
                                         if top_ids is not None and nt else [])
                            for j, t in enumerate(toks)])
            r0 += r
        return out
