"""Predicted Outputs: a request's expected text as one more source of drafts.

OpenAI's ``prediction`` field carries text the user expects in the answer (code or a
document sent back for a small edit).  Its tokens are verified exactly as MTP drafts are
(spec/verifier.py, runner.py): a predicted draft is a deterministic proposal (q one-hot),
so greedy outputs are unchanged, sampled ones keep their distribution and seeded ones
their tokens (coupled verification draws each row's target sample from the seed alone).

Where the output so far stands in the prediction (``PredictionTrack``): a pointer that
advances while emitted tokens equal the predicted ones; after a mismatch (the user's edit,
or text the prediction lacks) the pointer is lost until the output's last ``SYNC_TOKENS``
tokens occur in the prediction again, the occurrence nearest after where it was lost.
While found, the next step verifies a window of predicted tokens instead of the MTP drafts
(``PredictionTrack.size_window``: all ``max_tokens`` first, 16 after a rejection, 16 more
after each window accepted whole); elsewhere MTP drafts as usual (and the MTP layer's KV stays exact either way:
its first pass always covers the verified positions, proposer.py).

``PredictedDrafts`` wraps the worker's proposer (MTPProposer, or NoProposer with MTP off)
behind the same interface.  Predicted drafts of a step are staged when its tokens are
committed (``stage``) and held once the wrapped proposer commits that step (``commit``:
after the tokens, or later when the draft passes run after emit), so every consumer of a
step's drafts sees one consistent set.  Predicted windows are kept out of the speculation
policy's acceptance figures (their rows are passed as carrying no MTP draft).

A window never costs KV the request would not hold anyway: ``stage`` stops it before the
request's ``max_tokens``, and ``fit`` cuts it, before each step, to the slots the
scheduler gave the step (which gives a window its slots only when they are free,
scheduler.py); cut to nothing, the step verifies MTP's drafts.  So a prediction never
makes a request need more blocks than it would without one.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from server.engine.batch.request_state import RequestState
from server.engine.batch.window import StepWindow
from server.engine.spec.proposer import DraftMask, DraftPasses

# A predicted window of n + 1 rows must yield this many times the tokens per second of a
# one-row step (all its drafts accepted) for n to be used (``window_drafts``).
WINDOW_GAIN = 1.5


def window_drafts(head: torch.Tensor, configured: int, repeats: int = 3,
                  product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
                  ) -> tuple[int, float]:
    """The most predicted drafts a step should verify on this device, and the measured
    gain of that window: ``configured``, or the largest power of two below it whose window
    of n + 1 rows, through the vocabulary head ``head`` [V, H] (a step's widest product),
    gives at least WINDOW_GAIN times one row's tokens per second; 0 when none does.
    ``product``: how the model multiplies by its head (its products' ``linear``).

    Why measured: on a CPU without native bf16 (AVX2) a bf16 product of n rows costs n
    times one row (the 0.5b head: 9 ms for 1 row, 83 ms for 17), so a predicted window
    costs what its tokens would cost one by one and a wrong one costs more; in float32,
    or with AVX512_BF16 / AMX, or on a GPU, a window of 17 rows costs a few rows."""
    if configured <= 0:
        return 0, 1.0
    if head.device.type != "cpu" or not head.is_floating_point():
        return configured, float(configured + 1)

    def seconds(rows: int) -> float:
        x = torch.randn(rows, head.shape[1], dtype=head.dtype)
        product(x, head)                                   # warm
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            product(x, head)
            runs.append(time.perf_counter() - t0)
        return sorted(runs)[len(runs) // 2]
    with torch.inference_mode():
        one = seconds(1)
        n = configured
        while n >= 1:
            gain = (n + 1) * one / seconds(n + 1)
            if gain >= WINDOW_GAIN:
                return n, gain
            n = 1 << (n.bit_length() - 1) if n & (n - 1) else n // 2
    return 0, 1.0


# Tokens at the end of the output that must occur in the prediction to find the place
# again after a mismatch: one token matches too often (a wrong window costs a step).
SYNC_TOKENS = 2
# Occurrences of those tokens looked at when finding the place (the nearest after the loss).
MAX_CANDIDATES = 64
# A request's window after a rejection (PredictionTrack.size_window).
BASE_WINDOW = 16


class PredictionTrack:
    """Where one request's output stands in its prediction (module docstring)."""

    __slots__ = ("tokens", "pos", "lost_at", "window", "_index")

    def __init__(self, tokens: tuple[int, ...] | list[int]) -> None:
        self.tokens = list(tokens)
        self.pos: int | None = 0           # index of the next expected token; None: lost
        self.lost_at = 0                   # where it was lost (the search prefers after it)
        self.window = 0                    # drafts the next window may hold (0: the most)
        self._index: dict[tuple[int, ...], list[int]] | None = None

    def size_window(self, offered: int, accepted: int, most: int) -> None:
        """Size the next window by how the last one went: the first holds ``most`` (a
        prediction is usually a near copy), a rejection drops it to BASE_WINDOW, and each
        window accepted whole doubles the next (up to ``most``).  An unedited prediction
        then takes few long windows, an edited one windows about as long as its runs.  Measured on the float32 0.5b model (benchmarks.prediction), fixed
        windows of 16 / 32 / 64 gave the own answer 2.50x / 3.05x / 3.6x MTP k=1 alone and an
        answer with every 10th word edited 1.61x / 1.46x / 1.2x; shrinking below 16 after a
        rejection lost more (1.27x at 16): a step's fixed cost outweighs a few more rows."""
        if accepted >= offered:
            self.window = min(most, 2 * max(self.window, offered))
        else:
            self.window = min(most, BASE_WINDOW)

    def advance(self, emitted: list[int], tail: list[int]) -> None:
        """Follow the tokens just emitted; ``tail``: the output's last (up to) SYNC_TOKENS
        tokens, them included."""
        toks = self.tokens
        for t in emitted:
            if self.pos is not None and self.pos < len(toks) and toks[self.pos] == t:
                self.pos += 1
            elif self.pos is not None:
                self.lost_at, self.pos = self.pos, None
        if self.pos is None:
            self.pos = self._find(tail)

    def drafts(self, n: int) -> list[int]:
        """The next up to ``n`` predicted tokens ([] when lost or at the end)."""
        if self.pos is None or n <= 0:
            return []
        return self.tokens[self.pos:self.pos + n]

    def _find(self, tail: list[int]) -> int | None:
        """The position after an occurrence of the output's tail, or None."""
        if len(tail) < SYNC_TOKENS:
            return None
        if self._index is None:
            index: dict[tuple[int, ...], list[int]] = {}
            toks = self.tokens
            for i in range(len(toks) - SYNC_TOKENS + 1):
                index.setdefault(tuple(toks[i:i + SYNC_TOKENS]), []).append(i + SYNC_TOKENS)
            self._index = index
        hits = self._index.get(tuple(tail[-SYNC_TOKENS:]))
        if not hits:
            return None
        after = [h for h in hits[:MAX_CANDIDATES] if h >= self.lost_at]
        return min(after) if after else hits[0]


class PredictedDrafts:
    """The worker's proposer with predicted drafts in front of it (module docstring)."""

    def __init__(self, inner: Any, max_tokens: int) -> None:
        self.inner = inner
        self.max_tokens = max_tokens
        self._tracks: dict[str, PredictionTrack] = {}
        self._held: dict[str, list[int]] = {}      # verified by the next step
        self._staged: dict[str, list[int]] = {}    # held at the next ``commit``

    # ---- the proposer interface, delegated ---------------------------------------------
    @property
    def policy(self):
        return self.inner.policy

    @property
    def max_draft_tokens(self) -> int:
        return self.inner.max_draft_tokens

    @property
    def num_held_requests(self) -> int:
        return self.inner.num_held_requests

    def choose_k(self, states: list[RequestState]) -> int:
        return self.inner.choose_k(states)

    def propose(self, window: StepWindow, sampled: list[list[int]], hidden: torch.Tensor,
                k: int, draft_mask: DraftMask | None = None) -> DraftPasses:
        return self.inner.propose(window, sampled, hidden, k, draft_mask)

    def observe_step(self, num_seqs: int, k: int, seconds: float) -> None:
        self.inner.observe_step(num_seqs, k, seconds)

    def num_held(self, request_id: str) -> int:
        held = self._held.get(request_id)
        return len(held) if held is not None else self.inner.num_held(request_id)

    def num_predicted(self, request_id: str) -> int:
        """Drafts the next step verifies for ``request_id`` that came from its prediction."""
        return len(self._held.get(request_id, ()))

    def held_drafts(self, states: list[RequestState], num_drafts: list[int], K: int,
                    device: torch.device) -> torch.Tensor:
        if not self._held:
            return self.inner.held_drafts(states, num_drafts, K, device)
        predicted = [self._held.get(st.request_id) for st in states]
        drafts = self.inner.held_drafts(states, self._mtp_only(predicted, num_drafts), K, device)
        if drafts.shape[1] < K:                   # NoProposer: no columns
            drafts = F.pad(drafts, (0, K - drafts.shape[1]))
        rows = [(i, p) for i, p in enumerate(predicted) if p]
        if rows:
            drafts = drafts.clone()               # it may be the drafting step's own tensor
            for i, p in rows:
                drafts[i, :len(p)] = torch.tensor(p, dtype=drafts.dtype)
        return drafts

    def draft_probs(self, states: list[RequestState], num_drafts: list[int], K: int,
                    draft_ids: torch.Tensor) -> torch.Tensor | None:
        """Predicted rows are one-hot proposals: the wrapped proposer sees them as holding
        nothing, and its one-hot rows for held-nothing sequences are exactly that."""
        predicted = [self._held.get(st.request_id) for st in states]
        return self.inner.draft_probs(states, self._mtp_only(predicted, num_drafts), K, draft_ids)

    def commit(self, states: list[RequestState], drafts: Any, k: int, num_drafts: list[int],
               sampled: list[list[int]]) -> None:
        predicted = [self._held.get(st.request_id) for st in states]
        self.inner.commit(states, drafts, k, self._mtp_only(predicted, num_drafts), sampled)
        for st in states:
            rid = st.request_id
            self._held.pop(rid, None)
            staged = self._staged.pop(rid, None)
            if staged:
                self._held[rid] = staged

    def fit(self, states: list[RequestState], block_size: int, chained: int) -> None:
        """Cut each held window to the KV slots its request's step has: the fed tokens, the
        window and the ``chained`` positions MTP's chained passes write past them must lie
        in its block table.  A window cut to nothing leaves MTP's drafts, which the
        scheduler always gives room."""
        for st in states:
            window = self._held.get(st.request_id)
            if not window:
                continue
            room = len(st.block_table) * block_size - st.num_computed_tokens \
                - st.num_new_tokens - chained
            if room <= 0:
                del self._held[st.request_id]
            elif len(window) > room:
                self._held[st.request_id] = window[:room]

    def drop(self, request_id: str) -> None:
        self.inner.drop(request_id)
        self._tracks.pop(request_id, None)
        self._held.pop(request_id, None)
        self._staged.pop(request_id, None)

    def flush_kv(self) -> None:
        self.inner.flush_kv()

    # ---- predictions ---------------------------------------------------------------------
    def stage(self, st: RequestState, emitted: list[int]) -> int:
        """Follow ``st``'s just-committed tokens in its prediction and stage the drafts its
        next step verifies; returns their number (0: MTP drafts as usual).  At most the
        tokens the request may still emit minus one, so a window never reaches past
        ``max_output_tokens`` (the KV the scheduler reserved covers it)."""
        prediction = st.sampling.prediction
        if not prediction or not self.max_tokens:
            return 0
        track = self._tracks.get(st.request_id)
        if track is None:
            track = self._tracks[st.request_id] = PredictionTrack(prediction)
        tail = st.token_ids[len(st.token_ids) - min(st.num_output_tokens, SYNC_TOKENS):]
        offered = len(self._held.get(st.request_id, ()))    # the window just verified
        if offered:
            track.size_window(offered, len(emitted) - 1, self.max_tokens)
        track.advance(emitted, tail)
        if st.stopped:
            return 0
        room = st.max_output_tokens - st.num_output_tokens - 1
        drafts = track.drafts(min(track.window or self.max_tokens, room))
        if drafts:
            self._staged[st.request_id] = drafts
        return len(drafts)

    @staticmethod
    def _mtp_only(predicted: list[list[int] | None], num_drafts: list[int]) -> list[int]:
        return [0 if p else d for p, d in zip(predicted, num_drafts)]
