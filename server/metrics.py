"""Prometheus metrics: MindIE's 22 series plus the speculative-decoding ones MindIE lacks.

Names, types and buckets follow MindIE's ``prometheus_metrics.cpp`` (no prefix, one
``model_name`` label).  The registry is our own ``CollectorRegistry`` so several daemons
(or tests) in one process never collide.  TPOT is observed per token: a step that emits
``n`` tokens in ``dt`` seconds observes ``dt / n`` ``n`` times, as MindIE does under MTP.

Speculative counters (vLLM's names without the ``vllm:`` prefix), MTP drafts only:
  spec_decode_num_drafts_total               verification steps that carried MTP drafts
  spec_decode_num_draft_tokens_total         MTP draft tokens proposed
  spec_decode_num_accepted_tokens_total      MTP draft tokens accepted
  spec_decode_num_accepted_tokens_per_pos_total{position}  accepted at draft position p
Predicted Outputs (a request's ``prediction`` verified as drafts beside MTP's):
  spec_decode_num_prediction_draft_tokens_total     prediction tokens verified as drafts
  spec_decode_num_prediction_accepted_tokens_total  of which accepted
Acceptance is a prefix (draft p can only be kept if 0..p-1 were), so a step that accepted
``a`` drafts counts positions 0..a-1.
Adaptive speculation (engine/spec/proposer.py AdaptiveK), refreshed at scrape:
  spec_decode_current_k                      drafts per sequence chosen by the latest step
  spec_decode_steps_total{k}                 engine steps that drafted k tokens
KV tiers (engine/kv/host_tier.py), refreshed at scrape; ``cpu_cache_usage_perc`` is the host
tier's usage and ``num_requests_swapped`` the requests whose blocks wait there:
  prefix_cache_hit_tokens_total{tier}        prompt tokens found on the device / host tier / disk
  kv_tier_bytes_total{direction}             bytes moved device -> host (save) / host -> device (load)
  kv_preemptions_total{mode}                 preemptions that swapped / recomputed
  kv_tier_saves_skipped_total                evicted prefix blocks not kept: every host slot
                                             was already written that step (the tier is small)
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
TOKEN_BUCKETS = (10, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 16000, 20000, 32000,
                 50000, 64000, 128000)

# Scraped sample names (prometheus_client adds ``_total`` to counters).
MINDIE_METRIC_NAMES = (
    "request_received_total", "request_success_total", "request_failed_total",
    "num_requests_running", "num_requests_waiting", "num_requests_swapped",
    "avg_prompt_throughput_toks_per_s", "avg_generation_throughput_toks_per_s",
    "time_to_first_token_seconds", "time_per_output_token_seconds",
    "e2e_request_latency_seconds", "failed_request_perc", "request_prompt_tokens",
    "request_generation_tokens", "prompt_tokens_total", "generation_tokens_total",
    "npu_cache_usage_perc", "cpu_cache_usage_perc", "npu_prefix_cache_hit_rate",
    "num_preemptions_total", "all_radix_match_num", "npu_radix_match_hit_num",
)
SPEC_METRIC_NAMES = (
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
    "spec_decode_acceptance_rate", "spec_decode_mean_accepted_length",
    "spec_decode_current_k", "spec_decode_steps_total",
    "spec_decode_num_prediction_draft_tokens_total",
    "spec_decode_num_prediction_accepted_tokens_total",
)
KV_TIER_METRIC_NAMES = ("prefix_cache_hit_tokens_total", "kv_tier_bytes_total",
                        "kv_preemptions_total")
_THROUGHPUT_WINDOW_S = 10.0


class ServingMetrics:
    """Owns the registry; the serving layer reports events, scrapes refresh the gauges."""

    enabled = True

    def __init__(self, model_name: str, num_speculative_tokens: int = 0) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, lbl = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(name, doc, lbl + (extra or []), registry=r)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, lbl, registry=r).labels(model_name)

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, lbl, buckets=buckets, registry=r).labels(model_name)

        self.received = counter("request_received", "Count of received requests.").labels(model_name)
        self.success = counter("request_success", "Count of successfully processed requests.").labels(model_name)
        self.failed = counter("request_failed", "Count of failed requests.").labels(model_name)
        self.running = gauge("num_requests_running", "Number of requests currently running on NPU.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.swapped = gauge("num_requests_swapped", "Number of requests swapped to CPU.")
        self.prompt_tput = gauge("avg_prompt_throughput_toks_per_s", "Average prefill throughput in tokens/s.")
        self.gen_tput = gauge("avg_generation_throughput_toks_per_s", "Average generation throughput in tokens/s.")
        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Histogram of time per output token in seconds.", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", E2E_BUCKETS)
        self.failed_perc = gauge("failed_request_perc", "Requests failure rate. 1 means 100 percent usage.")
        self.prompt_hist = hist("request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.gen_hist = hist("request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS)
        self.prompt_total = counter("prompt_tokens", "Number of prefill tokens processed.").labels(model_name)
        self.gen_total = counter("generation_tokens", "Number of generation tokens processed.").labels(model_name)
        self.npu_cache = gauge("npu_cache_usage_perc", "NPU KV-cache usage. 1 means 100 percent usage.")
        self.cpu_cache = gauge("cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.")
        self.prefix_hit_rate = gauge("npu_prefix_cache_hit_rate", "NPU prefix cache block hit rate.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.").labels(model_name)
        self.radix_all = gauge("all_radix_match_num", "Prompt tokens taking part in the prefix-cache match.")
        self.radix_hit = gauge("npu_radix_match_hit_num", "Prompt tokens that hit the prefix cache.")

        self.num_drafts = counter("spec_decode_num_drafts", "Verification steps that carried draft tokens.").labels(model_name)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed by the MTP layer.").labels(model_name)
        self.num_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted by the verifier.").labels(model_name)
        per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                          "Draft tokens accepted, by draft position.", ["position"])
        self.accepted_per_pos = [per_pos.labels(model_name, str(p))
                                 for p in range(max(1, num_speculative_tokens))]
        self.prediction_draft_tokens = counter(
            "spec_decode_num_prediction_draft_tokens",
            "Prediction tokens (Predicted Outputs) verified as drafts.").labels(model_name)
        self.prediction_accepted = counter(
            "spec_decode_num_prediction_accepted_tokens",
            "Prediction tokens verified as drafts and accepted.").labels(model_name)
        self.acceptance_rate = gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens.")
        self.mean_accepted_len = gauge("spec_decode_mean_accepted_length",
                                       "Tokens emitted per verification step: 1 + accepted / drafts.")
        self.current_k = gauge("spec_decode_current_k", "Draft tokens per sequence chosen by the latest step.")
        steps_k = counter("spec_decode_steps", "Engine steps by the number of draft tokens they chose.", ["k"])
        self.steps_per_k = [steps_k.labels(model_name, str(k)) for k in range(num_speculative_tokens + 1)]
        self._steps_per_k_seen = [0] * (num_speculative_tokens + 1)
        hits = counter("prefix_cache_hit_tokens", "Prompt tokens found in a KV cache tier.", ["tier"])
        moved = counter("kv_tier_bytes", "KV bytes moved between the device pool and the host tier.",
                        ["direction"])
        preempt = counter("kv_preemptions", "Preemptions by what happened to the KV.", ["mode"])
        skipped = counter("kv_tier_saves_skipped",
                          "Evicted prefix blocks not kept: every host slot was written that step.")
        # stats key -> its labelled counter; each scrape adds what grew since the last one
        self._tier_counters = {
            "prefix_cache_hits": hits.labels(model_name, "device"),
            "host_cache_hits": hits.labels(model_name, "host"),
            "disk_cache_hits": hits.labels(model_name, "disk"),
            "remote_cache_hits": hits.labels(model_name, "remote"),     # PD: pulled from P
            "kv_bytes_saved": moved.labels(model_name, "save"),
            "kv_bytes_loaded": moved.labels(model_name, "load"),
            "num_swapped_out": preempt.labels(model_name, "swap"),
            "num_preemptions_recomputed": preempt.labels(model_name, "recompute"),
            "host_saves_skipped": skipped.labels(model_name)}
        self._tier_seen = dict.fromkeys(self._tier_counters, 0)
        self._n_received = self._n_failed = 0
        self._spec = [0, 0, 0]                        # drafts, draft tokens, accepted
        self._recent: deque[tuple[float, int, int]] = deque()   # (time, prompt toks, gen toks)

    # -- events from the serving layer -------------------------------------------------
    def on_received(self) -> None:
        self._n_received += 1
        self.received.inc()
        self._update_failed_perc()

    def on_first_token(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        # cached_tokens (every tier) is not the NPU hit rate: refresh_kv_tiers sets that.
        self.ttft.observe(ttft_s)
        self.prompt_total.inc(prompt_tokens)
        self._note(prompt_tokens, 0)

    def on_step(self, dt_s: float, num_tokens: int) -> None:
        """A decode step emitted ``num_tokens`` tokens ``dt_s`` after the previous one."""
        if num_tokens <= 0:
            return
        per_token = dt_s / num_tokens
        for _ in range(num_tokens):
            self.tpot.observe(per_token)

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.gen_total.inc(num_tokens)
            self._note(0, num_tokens)

    def _note(self, prompt_tokens: int, gen_tokens: int) -> None:
        """Record tokens for the throughput window, dropping what fell out of it: trimmed
        only at a scrape, the window grew by an entry per token chunk for as long as
        nobody scraped /metrics (3 MB a minute in a 64-client benchmarks.soak run)."""
        now = time.monotonic()
        self._drop_before(now)
        self._recent.append((now, prompt_tokens, gen_tokens))

    def _drop_before(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > _THROUGHPUT_WINDOW_S:
            self._recent.popleft()

    def on_spec(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        """Deltas of one request's MTP counters over one engine step."""
        if drafts <= 0 and draft_tokens <= 0:
            return
        self.num_drafts.inc(max(0, drafts))
        self.num_draft_tokens.inc(max(0, draft_tokens))
        self.num_accepted.inc(max(0, accepted))
        for pos in range(min(max(0, accepted), len(self.accepted_per_pos))):
            self.accepted_per_pos[pos].inc()
        s = self._spec
        s[0] += max(0, drafts); s[1] += max(0, draft_tokens); s[2] += max(0, accepted)
        if s[1]:
            self.acceptance_rate.set(s[2] / s[1])
        if s[0]:
            self.mean_accepted_len.set(1.0 + s[2] / s[0])

    def on_prediction(self, draft_tokens: int, accepted: int) -> None:
        """Deltas of one request's prediction counters over one engine step (the MTP
        series above never count prediction drafts)."""
        if draft_tokens > 0:
            self.prediction_draft_tokens.inc(draft_tokens)
        if accepted > 0:
            self.prediction_accepted.inc(accepted)

    def on_finished(self, ok: bool, prompt_tokens: int, generation_tokens: int,
                    e2e_s: float, preemptions: int = 0) -> None:
        if ok:
            self.success.inc()
            self.e2e.observe(e2e_s)
            self.prompt_hist.observe(prompt_tokens)
            self.gen_hist.observe(generation_tokens)
        else:
            self._n_failed += 1
            self.failed.inc()
        if preemptions:
            self.preemptions.inc(preemptions)
        self._update_failed_perc()

    # -- scrape --------------------------------------------------------------------------
    def refresh(self, running: int, waiting: int, swapped: int, kv_usage: float,
                cpu_usage: float = 0.0) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.swapped.set(swapped)
        self.npu_cache.set(kv_usage)
        self.cpu_cache.set(cpu_usage)
        self._drop_before(time.monotonic())
        self.prompt_tput.set(sum(p for _, p, _ in self._recent) / _THROUGHPUT_WINDOW_S)
        self.gen_tput.set(sum(g for _, _, g in self._recent) / _THROUGHPUT_WINDOW_S)

    def refresh_spec(self, current_k: int, steps_per_k: list[int]) -> None:
        """The engine's adaptive-speculation figures (cumulative steps per k)."""
        self.current_k.set(current_k)
        for k, n in enumerate(steps_per_k[:len(self.steps_per_k)]):
            if n > self._steps_per_k_seen[k]:
                self.steps_per_k[k].inc(n - self._steps_per_k_seen[k])
                self._steps_per_k_seen[k] = n

    def refresh_kv_tiers(self, stats: dict) -> None:
        """The engine's cumulative tier figures (EngineStats fields) into the counters.

        MindIE's radix gauges and ``npu_prefix_cache_hit_rate`` are the device's own
        (``cached_tokens`` in a response also counts host and disk hits)."""
        queried, hits = int(stats["prefix_cache_queries"]), int(stats["prefix_cache_hits"])
        self.radix_all.set(queried)
        self.radix_hit.set(hits)
        self.prefix_hit_rate.set(hits / queried if queried else 0.0)
        for key, ctr in self._tier_counters.items():
            now = int(stats[key])
            if now > self._tier_seen[key]:
                ctr.inc(now - self._tier_seen[key])
                self._tier_seen[key] = now

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _update_failed_perc(self) -> None:
        self.failed_perc.set(self._n_failed / self._n_received if self._n_received else 0.0)


class NullMetrics:
    """Monitoring off (MIES_SERVICE_MONITOR_MODE=0): every event is a no-op."""

    enabled = False

    def __getattr__(self, name: str):  # on_* / refresh: accept anything, do nothing
        if name.startswith(("on_", "refresh")):
            return lambda *a, **k: None
        raise AttributeError(name)

    def render(self) -> bytes:
        return b""


def make_metrics(model_name: str, num_speculative_tokens: int, enabled: bool):
    # MindIE exposes no ``*_created`` series; prometheus_client's switch for them is
    # process-wide, so the daemon (the only caller) flips it here.
    disable_created_metrics()
    return ServingMetrics(model_name, num_speculative_tokens) if enabled else NullMetrics()
