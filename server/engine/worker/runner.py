"""One executed step on the device: request states -> tensors -> model -> verify -> drafts.

One step (docs/architecture.md, "One MTP step"), for every scheduled request at once:
  1. one main forward over each request's new tokens + held drafts (varlen: prefills and
     k+1-token verification windows side by side);
  2. sample / verify the window rows (verifier.verify);
  3. THE host sync of the step: emitted tokens and acceptance counts reach the host in one
     transfer (everything before it is queued device work);
  4. the proposer drafts the next step's tokens from the true hidden states of the
     verified positions (spec/proposer.py); the drafts stay on the device.
With MTP off (``NoProposer``) step 4 is skipped and every window is one row: plain
decoding through the same code.  The runner reads only the worker's ``RequestState``s; it
changes nothing: the worker commits a step once all of it succeeded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from server.engine.batch.metadata import build_metadata, expand_rows
from server.engine.batch.request_state import RequestState
from server.engine.batch.window import StepWindow, WindowForm
from server.engine.protocol import TokenLogprob
from server.engine.sample import grammar_masks, sampler
from server.engine.sample.greedy import greedy_ids
from server.engine.sample.screened_head import ScreenedHead
from server.engine.spec.proposer import DraftMask, DraftPasses, DraftResult
from server.engine.spec.verifier import greedy_accept, verify
from server.model.batch import DecodeMetadata


@dataclass(slots=True)
class VerifiedStep:
    """What one execution produced, not yet committed to the worker's state."""
    sampled: list[list[int]]                       # per request: accepted drafts + final token
    num_drafts: list[int]                          # drafts verified per request
    logprobs: list[list[TokenLogprob] | None]
    k: int                                         # drafts per request for the next step
    drafts: DraftResult | None                     # the drafts (None: none, or still to run)
    num_tokens: int                                # tokens fed to the main model
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # execute(defer_drafts=True): the draft passes, still to run (they give ``drafts``)
    drafting: DraftPasses | None = None


class ModelRunner:
    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, proposer,
                 device: torch.device | str = "cpu", static_decode: bool = False,
                 screen: ScreenedHead | None = None) -> None:
        self.model = model
        # Greedy host-verified windows' ids without the whole head (sample/screened_head.py).
        self.screen = screen
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.proposer = proposer
        self.device = torch.device(device)
        self.vocab_size = model.config.vocab_size
        # Steps where every request feeds one token plus the same number of drafts take
        # the static path (DecodeMetadata; server/model/static_decode.py).
        self.static_decode = static_decode
        self._rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.masks = grammar_masks.MaskApplier(self.vocab_size, self.device)
        self.masks_words = (self.vocab_size + 31) // 32

    @torch.inference_mode()
    def execute(self, states: list[RequestState], k: int | None = None,
                defer_drafts: bool = False) -> VerifiedStep:
        """One step for ``states``; ``k``: drafts per request for the next step (default:
        the proposer's choice).  ``defer_drafts``: leave the MTP passes in
        ``VerifiedStep.drafting`` instead of running them (worker/worker.py)."""
        if k is None:
            k = self.proposer.choose_k(states)
        n_new = [s.num_new_tokens for s in states]
        nd = [self.proposer.num_held(s.request_id) for s in states]
        split = self._static_split(n_new, nd)
        if split is not None:
            # Prefills among decodes: the decodes still take the static path, the
            # prefills the varlen one, as two forwards of one step.
            decode, rest = split
            return _merge([self.execute([states[i] for i in decode], k, defer_drafts),
                           self.execute([states[i] for i in rest], k, defer_drafts)],
                          decode + rest)
        starts = [s.num_computed_tokens for s in states]
        uniform = self.static_decode and all(n == 1 for n in n_new) and min(nd) == max(nd)
        lone_prefill = not uniform and self._static_prefill_ok(states, starts, n_new, nd)
        if uniform:
            w = self._static_window(states, starts, n_new, nd[0])
        elif lone_prefill:
            w = self._static_prefill(states[0], starts[0], n_new[0])
        else:
            w = self._window(states, starts, n_new, nd)

        hidden = self.model.forward(w.input_ids, w.meta, self.kv_caches)   # [T, H]
        rows = hidden if w.logits_indices is None else hidden[w.logits_indices]
        ids = self._screened_ids(states, w, rows)
        logits = self.model.compute_logits(rows) if ids is None else None    # [R, V]
        prompt_lp = self._prompt_logprobs(states, starts, w.cu, hidden)
        sampled, logprobs = self._sample(states, starts, n_new, nd, w, logits, ids)

        # ---- drafts for the next step (stay on the device) -----------------------------
        draft_mask = None
        if k and any(s.matcher is not None for s in states):   # the first draft, where cheap
            rows, bitmask = grammar_masks.next_masks([s.matcher for s in states], sampled,
                                                     self.masks_words)
            draft_mask = DraftMask(self.masks, torch.tensor(rows, device=self.device), bitmask)
        passes = self.proposer.propose(w, sampled, hidden, k, draft_mask)
        if defer_drafts:
            return VerifiedStep(sampled, nd, logprobs, k, None, w.cu[-1], prompt_lp, passes)
        return VerifiedStep(sampled, nd, logprobs, k, passes.run(), w.cu[-1], prompt_lp)

    def _static_split(self, n_new: list[int], nd: list[int]) -> tuple[list[int], list[int]] | None:
        """(decode rows, the rest) when a step mixes one-token decodes holding the same
        number of drafts with prefills, on the static path; else None."""
        if not self.static_decode:
            return None
        decode = [i for i, n in enumerate(n_new) if n == 1]
        if 0 < len(decode) < len(n_new) and len({nd[i] for i in decode}) == 1:
            return decode, [i for i in range(len(n_new)) if n_new[i] != 1]
        return None

    def _screened_ids(self, states, w: StepWindow, rows: torch.Tensor) -> torch.Tensor | None:
        """Every row's greedy id through the screened head, where the step verifies on the
        host with raw argmaxes alone (``_greedy_on_host``, no grammar); else None."""
        if (self.screen is None or any(s.matcher is not None for s in states)
                or not self._greedy_on_host(states, w, [s.sampling.logprobs for s in states])):
            return None
        return self.screen.ids(rows)

    def _sample(self, states, starts, n_new, nd, w: StepWindow, logits: torch.Tensor | None,
                ids: torch.Tensor | None = None
                ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """Verify every window: each request's accepted drafts and final token (after THE
        host sync of the step), and their logprobs where asked.  ``ids``: every row's
        greedy id already (``_screened_ids``; ``logits`` then None)."""
        want_lp = [s.sampling.logprobs for s in states]
        if ids is not None:
            sampled = greedy_accept(ids.view(len(states), w.K + 1).tolist(), w.drafts.tolist())
            return sampled, self._logprobs(sampled, [d + 1 for d in nd], want_lp, None,
                                           [s.sampling.top_logprobs for s in states])
        # Grammar masks on every verified row (sample/grammar_masks.py); logprobs stay the
        # raw model's.
        matchers = [s.matcher for s in states]
        vlogits = logits
        if any(m is not None for m in matchers):
            held = w.drafts.tolist()                  # a host copy, constrained steps only
            rows, bitmask = grammar_masks.window_masks(
                matchers, [h[:d] for h, d in zip(held, nd)], self.masks_words)
            vlogits = self.masks.apply(logits, torch.tensor(rows, device=logits.device), bitmask)
        lp = None
        if self._greedy_on_host(states, w, want_lp):
            sampled = greedy_accept(greedy_ids(vlogits).view(len(states), w.K + 1).tolist(),
                                    w.drafts.tolist())
        else:
            tokens, num_acc = self._verify(states, starts, n_new, nd, w, vlogits)
            if any(want_lp):
                row_tokens = tokens[w.row_seq, w.row_off]
                lp = sampler.token_logprobs(logits, row_tokens,
                                            max(s.sampling.top_logprobs for s in states))
            # ---- the step's host sync: emitted tokens and acceptance counts, one transfer ----
            both = torch.cat([tokens, num_acc.to(tokens.dtype).unsqueeze(1)], dim=1).tolist()
            sampled = [row[:row[-1] + 1] for row in both]
        return sampled, self._logprobs(sampled, [d + 1 for d in nd], want_lp, lp,
                                       [s.sampling.top_logprobs for s in states])

    def _prompt_logprobs(self, states, starts, cu, hidden) -> dict[str, list[TokenLogprob | None]]:
        """Logprobs of each prompt token for requests that asked (``prompt_logprobs``), from
        this step's main forward over their whole prompt: hidden row j predicts token j+1.

        Only a request's first prefill computes them (no output yet, nothing cached: the
        scheduler skips the prefix cache for such requests); a recompute after preemption
        does not repeat them.  Raw model logprobs, as vLLM reports them.
        """
        out: dict[str, list[TokenLogprob | None]] = {}
        for i, st in enumerate(states):
            n_top = st.sampling.prompt_logprobs
            if n_top is None or starts[i] != 0 or st.num_output_tokens:
                continue
            n = st.num_prompt_tokens
            if n < 2:
                out[st.request_id] = [None]
                continue
            logits = self.model.compute_logits(hidden[cu[i]:cu[i] + n - 1])      # [n-1, V]
            target = torch.tensor(st.token_ids[1:n], dtype=torch.int64, device=logits.device)
            host = _to_host(sampler.token_logprobs(logits, target, n_top))
            out[st.request_id] = [None] + _token_logprobs(st.token_ids[1:n], host, 0, n_top)
        return out

    def _window(self, states, starts, n_new, nd) -> StepWindow:
        """Main-forward inputs: each request's new tokens, then its drafts.

        Rows: a request with d drafts owns d+1 logits rows, its last d+1 tokens (the last
        known token and each draft); row j predicts the token after draft j.
        """
        dev = self.device
        K = max(nd)
        qlens = [a + b for a, b in zip(n_new, nd)]
        flat: list[int] = []
        for st, s0, n, d in zip(states, starts, n_new, nd):
            flat.extend(st.token_ids[s0:s0 + n])
            flat.extend([0] * d)                      # placeholders, filled from the device
        input_ids = torch.tensor(flat, dtype=torch.int64).to(dev)
        cu = [0]
        for ql in qlens:
            cu.append(cu[-1] + ql)
        nrows = torch.tensor(nd, dtype=torch.int64) + 1
        row_seq, row_off = expand_rows(nrows)
        logits_indices = torch.tensor(cu[1:])[row_seq] - nrows[row_seq] + row_off
        drafts = self.proposer.held_drafts(states, nd, K, dev)   # [S, K]
        if K:
            before = row_off < nrows[row_seq] - 1     # rows followed by a draft token
            input_ids[(logits_indices[before] + 1).to(dev)] = \
                drafts[row_seq[before].to(dev), row_off[before].to(dev)]
        meta = build_metadata(starts, qlens, [s.block_table for s in states], self.block_size,
                              dev, logits_indices)
        return StepWindow(WindowForm.VARLEN, states, starts, n_new, input_ids, meta, cu,
                          row_seq.to(dev), row_off.to(dev), drafts, K, meta.logits_indices)

    # Largest query x context x heads product a static prefill takes: its attention scores
    # are one [query * heads, context] float32 matrix (64 MiB here).
    STATIC_PREFILL_SCORES = 1 << 24
    # Most multiply-adds a static prefill may spend on unchosen experts (its graphs compute
    # a model's few experts densely, StaticDecoder.dense_moe_waste): the demo model's
    # 800-token prompt spends 0.63 G and still gains (162 against 221 ms).
    STATIC_PREFILL_WASTE = 1e9

    def _static_prefill_ok(self, states, starts, n_new, nd) -> bool:
        """One request feeding several tokens and holding no drafts (a prompt, or a chunk of
        one) takes the compiled static graphs for a lone sequence where they pay: on the
        2-core CPU a 40 / 120 / 250-token prefill of the demo model took 5.6 / 12.6 /
        29.9 ms there, 8.5 / 16.9 / 36.9 ms on the varlen path.  Only with graphs:
        uncompiled, the varlen path's routed MoE and plain attention are the cheaper ones.
        Never where the decoder takes no prompts (``StaticDecoder.takes_prompts``)."""
        decoder = self.model.static_decoder
        if not (self.static_decode and len(states) == 1 and nd[0] == 0 and n_new[0] > 1
                and decoder.compiled and decoder.takes_prompts
                and n_new[0] * decoder.dense_moe_waste <= self.STATIC_PREFILL_WASTE):
            return False
        heads = self.model.config.num_attention_heads
        return n_new[0] * heads * (starts[0] + n_new[0]) <= self.STATIC_PREFILL_SCORES

    def _static_prefill(self, st: RequestState, s0: int, n: int) -> StepWindow:
        """A lone prompt (chunk) as one static window of n tokens; logits for its last row."""
        dev = self.device
        input_ids = torch.tensor(st.token_ids[s0:s0 + n], dtype=torch.int64).to(dev)
        meta = DecodeMetadata.build([s0], n, [st.block_table], self.block_size, dev)
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        return StepWindow(WindowForm.STATIC_PREFILL, [st], [s0], [n], input_ids, meta,
                          [0, n], zero, zero, torch.zeros(1, 0, dtype=torch.int64, device=dev), 0,
                          torch.tensor([n - 1], dtype=torch.int64, device=dev))

    def _static_window(self, states, starts, n_new, K: int) -> StepWindow:
        """Every request feeds its last token and K drafts: K + 1 rows each, all with logits."""
        dev, n, q = self.device, len(states), K + 1
        last = torch.tensor([st.token_ids[s0] for st, s0 in zip(states, starts)], dtype=torch.int64)
        drafts = self.proposer.held_drafts(states, [K] * n, K, dev)          # [S, K]
        input_ids = torch.cat([last.to(dev)[:, None], drafts], dim=1).flatten()
        meta = DecodeMetadata.build(starts, q, [s.block_table for s in states], self.block_size, dev)
        rows = self._rows.get((n, q))
        if rows is None:
            rows = (torch.arange(n, device=dev).repeat_interleave(q), torch.arange(q, device=dev).repeat(n))
            self._rows[(n, q)] = rows
        return StepWindow(WindowForm.STATIC, states, starts, n_new, input_ids, meta,
                          list(range(0, n * q + 1, q)), rows[0], rows[1], drafts, K, None)

    def _greedy_on_host(self, states, w: StepWindow, want_lp: list[bool]) -> bool:
        """Verify on host lists (verifier.greedy_accept): a CPU, a static window (every
        request K + 1 rows, every draft held) and raw-argmax requests without logprobs."""
        return (self.device.type == "cpu" and w.logits_indices is None and not any(want_lp)
                and all(st.plain_greedy for st in states))

    def _verify(self, states, starts, n_new, nd, w: StepWindow, logits: torch.Tensor):
        """Process the window rows, then verify: tokens [S, K+1], num_accepted [S]."""
        dev, K, S_ = self.device, w.K, len(states)
        if w.logits_indices is None and all(st.plain_greedy for st in states):
            # Static window (K + 1 rows per request) and raw-argmax requests: no sampling
            # metadata to build, no padding to scatter.
            nd_t = torch.full((S_,), K, dtype=torch.int64, device=dev)
            return verify(None, greedy_ids(logits).view(S_, K + 1), w.drafts, None, nd_t, None, None)
        samp = [sampler.SeqSamplingInput(st.sampling, st.seed, d + 1, s0 + n, st.num_output_tokens,
                                   *st.penalty_context(), st.stop_ids)
                for st, d, s0, n in zip(states, nd, starts, n_new)]
        smeta = sampler.SamplingMetadata.build(samp, self.vocab_size, dev)
        context = None
        if K and smeta.has_penalties:                 # accepted-draft prefix as context
            ctx = w.drafts[w.row_seq]                 # [R, K]
            context = torch.where(torch.arange(K, device=dev)[None] < w.row_off[:, None], ctx, -1)
        processed = sampler.process_logits(logits, smeta, context)
        pad_index = w.row_seq * (K + 1) + w.row_off
        argmax_pad = torch.zeros(S_ * (K + 1), dtype=torch.int64, device=dev)
        argmax_pad[pad_index] = processed.argmax(-1)
        argmax_pad = argmax_pad.view(S_, K + 1)
        nd_t = torch.tensor(nd, dtype=torch.int64, device=dev)
        if smeta.all_greedy:
            return verify(None, argmax_pad, w.drafts, None, nd_t, None, None)
        probs = sampler.to_probs(processed, smeta)
        coupled = None
        if smeta.coupled is not None:
            # Seeded requests: coupled verification (sample/sampler.py): the target token of every
            # row is the sample MTP-off decoding would draw there; a draft must equal it.
            target = argmax_pad.flatten().clone()
            c = smeta.coupled
            target[pad_index[c]] = sampler.gumbel_sample(probs[c], smeta.seeds[c], smeta.token_index[c])
            coupled = verify(None, target.view(S_, K + 1), w.drafts, None, nd_t, None, None)
            is_coupled = [s.sampling.seed is not None and not s.sampling.greedy for s in states]
            if all(is_coupled):
                return coupled
            seq_coupled = torch.tensor(is_coupled, device=dev)
        probs_pad = probs.new_zeros(S_ * (K + 1), probs.shape[-1])
        probs_pad[pad_index] = probs
        seeds = torch.tensor([s.seed for s in states], dtype=torch.int64, device=dev)
        first = torch.tensor([s0 + n for s0, n in zip(starts, n_new)], dtype=torch.int64, device=dev)
        idx = first[:, None] + torch.arange(K + 1, device=dev)[None]    # token index of each row
        u_smp = sampler.counter_uniform(seeds[:, None], idx, sampler.STREAM_SAMPLE)
        u_acc = sampler.counter_uniform(seeds[:, None], idx[:, :K], sampler.STREAM_ACCEPT)
        q = self.proposer.draft_probs(states, nd, K, w.drafts) if K else None
        tokens, num_acc = verify(probs_pad.view(S_, K + 1, -1), argmax_pad, w.drafts, q, nd_t,
                                 u_acc, u_smp)
        if coupled is None:
            return tokens, num_acc
        return (torch.where(seq_coupled[:, None], coupled[0], tokens),
                torch.where(seq_coupled, coupled[1], num_acc))

    @staticmethod
    def _logprobs(sampled, rows, want, lp, n_tops) -> list[list[TokenLogprob] | None]:
        out: list[list[TokenLogprob] | None] = []
        host = _to_host(lp) if lp is not None else None
        r0 = 0
        for toks, r, w, nt in zip(sampled, rows, want, n_tops):
            out.append(_token_logprobs(toks, host, r0, nt) if w and host is not None else None)
            r0 += r
        return out


def _to_host(lp: tuple) -> tuple[list, list | None, list | None]:
    """sampler.token_logprobs' tensors as host lists (one transfer each)."""
    chosen, top_ids, top_lp = lp
    return (chosen.tolist(), top_ids.tolist() if top_ids is not None else None,
            top_lp.tolist() if top_lp is not None else None)


def _token_logprobs(tokens: list[int], host: tuple, first_row: int,
                    num_top: int) -> list[TokenLogprob]:
    """TokenLogprobs of ``tokens``, token j from logits row ``first_row + j``."""
    chosen, top_ids, top_lp = host
    return [TokenLogprob(t, chosen[first_row + j],
                         list(zip(top_ids[first_row + j][:num_top], top_lp[first_row + j][:num_top]))
                         if top_ids is not None and num_top else [])
            for j, t in enumerate(tokens)]


def _merge(parts: list[VerifiedStep], order: list[int]) -> VerifiedStep:
    """Results of groups of one step, back in the step's request order (``order[j]`` is the
    step index of the j-th request of the concatenated groups)."""
    back = sorted(range(len(order)), key=order.__getitem__)
    def cat(field: str) -> list:
        joined = [x for p in parts for x in getattr(p, field)]
        return [joined[j] for j in back]
    passes = [p.drafting for p in parts]
    drafting = None
    if any(f is not None for f in passes):
        drafting = DraftPasses(lambda: _merge_drafts([f.run() if f is not None else None
                                                      for f in passes], back))
    return VerifiedStep(cat("sampled"), cat("num_drafts"), cat("logprobs"), parts[0].k,
                      _merge_drafts([p.drafts for p in parts], back),
                      sum(p.num_tokens for p in parts),
                      {rid: lp for p in parts for rid, lp in p.prompt_logprobs.items()}, drafting)


def _merge_drafts(drafts: list[DraftResult | None], back: list[int]) -> DraftResult | None:
    """The groups' DraftResults as one, in the step's request order (None unless every
    group drafted)."""
    if not drafts or any(d is None for d in drafts):
        return None
    ids = torch.cat([d.ids for d in drafts])[back]
    probs = None
    if any(d.probs is not None for d in drafts):
        vocab = next(d.probs for d in drafts if d.probs is not None).shape[-1]
        probs = torch.cat([d.probs if d.probs is not None
                           else d.ids.new_zeros(d.ids.shape + (vocab,), dtype=torch.float32)
                           for d in drafts])[back]
    return DraftResult(ids, probs)
