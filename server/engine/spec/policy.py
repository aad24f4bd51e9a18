"""How many tokens to draft per step: the speculation policy (SpecPolicy), FixedK, AdaptiveK.

Owned by the MTP proposer (spec/proposer.py), which asks it once per step after verification and
feeds it what it measures: each verified window (acceptance) and each clean decode step's
execution time (cost).  No torch here.
"""
from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Protocol


class SpecPolicy(Protocol):
    """Chooses how many tokens to draft for the next step.

    ``max_draft_tokens`` bounds every choice (KV lookahead is sized for it).  The proposer
    reports each verified window (``observe``) and each clean decode step's execution time
    (``observe_step``), and asks ``num_draft_tokens`` once per step, after verification.
    """

    max_draft_tokens: int

    def num_draft_tokens(self, num_seqs: int) -> int: ...

    def observe(self, num_drafts: int, num_accepted: int) -> None: ...

    def observe_step(self, num_seqs: int, k: int, seconds: float) -> None: ...


@dataclass
class FixedK:
    """Always draft ``k`` tokens (num_speculative_tokens)."""
    k: int

    @property
    def max_draft_tokens(self) -> int:
        return self.k

    def num_draft_tokens(self, num_seqs: int) -> int:
        return self.k

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        pass

    def observe_step(self, num_seqs: int, k: int, seconds: float) -> None:
        pass


# The current k's steps each of another k's samples is priced against (class docstring).
PAIRED = 3
# A probed k this far behind the current one in goodput waits twice as long for its next
# probe, up to MAX_BACKOFF x probe_every (AdaptiveK's docstring).
LOSING = 0.15
MAX_BACKOFF = 8


def _bucket(num_seqs: int) -> int:
    """Batch sizes share cost estimates by power of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(0, num_seqs - 1).bit_length()


class AdaptiveK:
    """Adaptive speculation: the k (0..max_k) with the best measured tokens per second.

    For a batch of B sequences drafting k tokens each, a step emits on average
    B * (1 + a1 + a1*a2 + ... + a1*...*ak) tokens, where ai is the acceptance rate of
    draft i given drafts 1..i-1 were accepted (EWMA per position, from ``observe``), and
    costs c(k, B) seconds (the lower median of the last ``cost_window`` decode-only step
    times per k and power-of-two batch bucket, from ``observe_step``).  The policy picks
    argmax_k expected_tokens(k) / c(k, B).

    So k falls when acceptance is low (few extra tokens) or when the batch is large enough
    that verifying k+1 tokens per sequence costs more than the extra tokens are worth, and
    rises again when the figures say it pays.

    Why a windowed median, not a moving average: on a shared host a step now and then
    takes several times its usual time (another process on the core, a page fault).  With
    an average, one such sample of k=1 made k=0 look better, and k=1, run again only for
    a few probe steps every ``probe_every`` decisions, took hundreds of steps to earn its
    place back: a k=1 daemon at concurrency 1 spent 74% of its steps at k=0 and served
    0.88x of MTP off, where fixed k=1 served 1.14x (benchmarks.serve, stop at EOS).
    Interference only ever adds time, so the lower median also leans to the step's own
    cost.

    Why each other k is priced against the current k's steps *around its own samples*:
    the current k is measured every step, another k only in probes, up to ``probe_every``
    decisions ago, and a shared host's speed drifts by 20-40% over minutes.  Comparing a
    fresh figure with a stale one chose whichever k was measured in the faster minutes: at
    concurrency 8 (0.5b, bf16) k=0 steps read 43.3 ms against stale k=1 ones of 67.0, so
    k=1 looked 1.16x better; the same run's medians were 38.3 and 67.7 (1.02x), and the
    daemon served 0.82-0.84x of MTP off.  So another k is priced by the current k's cost
    now times the median of its samples' ratios to the current k's steps nearest in time
    to each (the current k is the clock of the host's speed).  A real change in one k's
    own cost then shows once probes have refilled half its window, not within a few steps.

    ``draft_overhead``: drafting costs what no clean step shows: each admitted prompt's
    first draft pass, the first step after a switch, and above all requests whose ends
    drift apart (a window accepts more or fewer tokens), so that the prompts replacing them
    are prefilled one by one, each step reading every weight for one prompt, where they
    came in together before.  At concurrency 8 (0.5b, bf16, 40 requests of 64 tokens) the
    admitting steps took 3.1 s at k=1 against 1.85 s at k=0, of 14.5 s: ~9%.  A lone
    request has no one to drift apart from.  So a k > 0 is chosen over k = 0 only when its
    priced goodput beats k = 0's by ``draft_overhead * (1 - 1/B)`` as well.

    Exploration: a k with no cost figure yet for this bucket, and every ``probe_every``
    decisions the k measured longest ago, is run for ``probe_len`` steps (the first step
    after a switch still verifies the old k, so it is not a clean cost sample).  A switch
    needs a ``margin`` gain, so noise does not flap k.  k never changes outputs: whatever
    drafts a sequence holds are verified, then the new k is drafted.

    Backoff: a probe that leaves its k's goodput ``LOSING`` or more below the current k's
    doubles the wait before that k is probed again (up to ``MAX_BACKOFF`` x probe_every);
    a probe within it resets the wait.  Why: at concurrency 8 (0.5b bf16, AVX2) k=1 and
    k=2 stayed 20-30% behind k=0, and their probes, each followed by drafting's own costs,
    held a k=2 daemon at 0.91-0.95x of MTP off.
    """

    def __init__(self, max_k: int, *, probe_every: int = 64, probe_len: int = 3,
                 cost_window: int = 8, alpha_acc: float = 0.05, margin: float = 0.03,
                 prior_acceptance: float = 0.7, draft_overhead: float = 0.10,
                 history: int = 64) -> None:
        self.max_draft_tokens = max_k
        self.probe_every, self.probe_len = probe_every, probe_len
        self.cost_window, self.alpha_acc, self.margin = cost_window, alpha_acc, margin
        self.draft_overhead = draft_overhead
        self.acceptance = [prior_acceptance] * max_k      # [k] conditional rate per position
        self.cost: dict[tuple[int, int], float] = {}        # (k, bucket) -> seconds per step
        # (k, bucket) -> the last ``history`` clean steps, as (decision count, seconds)
        self._samples: dict[tuple[int, int], deque[tuple[int, float]]] = {}
        self._history = max(history, cost_window)
        self.current = max_k
        self._probe: tuple[int, int] | None = None          # (k, steps left)
        self._judged: tuple[int, int, int] | None = None     # (k, bucket, first decision) of a probe
        self._backoff: dict[tuple[int, int], int] = {}       # (k, bucket) -> probe wait multiple
        self._decisions = 0
        self.num_switches = 0

    # ---- measurements ----------------------------------------------------------------
    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One verified window: position i was reached iff drafts 0..i-1 were accepted."""
        a = self.alpha_acc
        for i in range(min(num_drafts, num_accepted + 1, self.max_draft_tokens)):
            hit = 1.0 if i < num_accepted else 0.0
            self.acceptance[i] += a * (hit - self.acceptance[i])

    def observe_step(self, num_seqs: int, k: int, seconds: float) -> None:
        """A decode-only step where every sequence verified ``k`` drafts and drafted ``k``."""
        key = (k, _bucket(num_seqs))
        samples = self._samples.setdefault(key, deque(maxlen=self._history))
        samples.append((self._decisions, seconds))
        self.cost[key] = statistics.median_low([s for _, s in self._recent(key)])

    def _last_measured(self, key: tuple[int, int]) -> int:
        """The decision count at ``key``'s last sample; -1: never measured."""
        samples = self._samples.get(key)
        return samples[-1][0] if samples else -1

    def _recent(self, key: tuple[int, int]) -> list[tuple[int, float]]:
        samples = self._samples[key]
        return list(samples)[-self.cost_window:]

    def priced_cost(self, k: int, num_seqs: int) -> float | None:
        """c(k, B) as of now: the current k's cost times k's cost relative to it, each of
        k's samples against the current k's steps nearest in time (class docstring)."""
        b = _bucket(num_seqs)
        c = self.cost.get((k, b))
        if c is None or k == self.current or not self._samples.get((self.current, b)):
            return c
        return self._priced(self._recent((k, b)), b)

    def _priced(self, samples: list[tuple[int, float]], b: int) -> float:
        """The current k's cost now times the median ratio of ``samples`` (another k's, as
        (decision count, seconds)) to the current k's steps nearest in time to each."""
        ref = self._samples[(self.current, b)]
        times = [t for t, _ in ref]
        ratios = []
        for t, s in samples:
            i = bisect.bisect_left(times, t)
            near = sorted(range(max(0, i - PAIRED), min(len(ref), i + PAIRED)),
                          key=lambda j: abs(times[j] - t))[:PAIRED]
            ratios.append(s / statistics.median(ref[j][1] for j in near))
        # Both sides of a ratio see the host's interference: its plain median, not the
        # lower one (which would lean to whichever k is not current, and flap).
        return self.cost[(self.current, b)] * statistics.median(ratios)

    # ---- decision --------------------------------------------------------------------
    def expected_tokens(self, k: int) -> float:
        """Tokens one sequence emits per step with k drafts: 1 + sum_j prod_{i<=j} ai."""
        total, run = 1.0, 1.0
        for i in range(k):
            run *= self.acceptance[i]
            total += run
        return total

    def goodput(self, k: int, num_seqs: int) -> float | None:
        """Expected tokens per second for the batch, or None without a cost figure; a
        k > 0 net of ``draft_overhead`` at this batch (class docstring)."""
        c = self.priced_cost(k, num_seqs)
        if c is None or c <= 0:
            return None
        return self._goodput_at(k, num_seqs, c)

    def _goodput_at(self, k: int, num_seqs: int, c: float) -> float:
        overhead = self.draft_overhead * (1.0 - 1.0 / num_seqs) if k else 0.0
        return num_seqs * self.expected_tokens(k) / c / (1.0 + overhead)

    def num_draft_tokens(self, num_seqs: int) -> int:
        self._decisions += 1
        if self._probe is not None:
            k, left = self._probe
            self._probe = (k, left - 1) if left > 1 else None
            return k
        b = _bucket(num_seqs)
        ks = range(self.max_draft_tokens + 1)
        unmeasured = [k for k in ks if (k, b) not in self.cost]
        if unmeasured or self._decisions % self.probe_every == 0:
            due = [k for k in ks if k != self.current and self._decisions - self._last_measured((k, b))
                   >= self.probe_every * self._backoff.get((k, b), 1)]
            probe = unmeasured[0] if unmeasured else min(
                due or [self.current], key=lambda k: self._last_measured((k, b)))
            if probe != self.current or unmeasured:
                self._probe = (probe, self.probe_len - 1) if self.probe_len > 1 else None
                self._judged = (probe, b, self._decisions)
                return probe
        self._judge_probe(num_seqs)
        rates = {k: self.goodput(k, num_seqs) for k in ks}
        best = max(ks, key=lambda k: rates[k] or 0.0)
        cur = rates.get(self.current)
        if best != self.current and (cur is None or rates[best] > cur * (1 + self.margin)):
            self.current = best
            self.num_switches += 1
        return self.current

    def _judge_probe(self, num_seqs: int) -> None:
        """After a probe: its k waits longer for the next one if its own steps (not the
        older ones in its window) priced it clearly behind the current k, else the usual
        ``probe_every`` (class docstring)."""
        if self._judged is None:
            return
        k, b, since = self._judged
        self._judged = None
        fresh = [(t, s) for t, s in self._samples.get((k, b), ()) if t >= since]
        cur = self.cost.get((self.current, b))
        if k == self.current or not fresh or not cur or b != _bucket(num_seqs):
            return
        mine = self._goodput_at(k, num_seqs, self._priced(fresh, b))
        if mine < self._goodput_at(self.current, num_seqs, cur) * (1 - LOSING):
            self._backoff[(k, b)] = min(MAX_BACKOFF, 2 * self._backoff.get((k, b), 1))
        else:
            self._backoff.pop((k, b), None)
