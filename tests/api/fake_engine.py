"""A scripted stand-in for AsyncEngine, for unit tests of the serving path only.

It answers every request with a fixed text, tokenized with the real tokenizer and
emitted ``tokens_per_step`` tokens per output (MTP-like steps), with counters that move
as a verifier's would.  A request's ``prediction`` is "verified" against the script: the
prediction tokens at a step's positions count as prediction drafts, those matching the
script up to the first miss as accepted (the real engine decides differently; this only
gives the serving path figures to carry).  The end-to-end tests use the real engine.
"""
from __future__ import annotations

import asyncio

from server.engine.protocol import (EngineOutput, EngineRequest, FinishReason, RequestCounters,
                                    TokenLogprob)
from server.engine.runtime import RuntimeInfo
from server.engine.stats import EngineStats
from server.text.detokenizer import IncrementalDetokenizer


class FakeEngine:
    def __init__(self, tokenizer, script: str = "Hello there.", tokens_per_step: int = 2,
                 step_delay_s: float = 0.0, num_speculative_tokens: int = 0) -> None:
        self.tok = tokenizer
        self.script = script
        self.tokens_per_step = tokens_per_step
        self.step_delay_s = step_delay_s
        self.aborted: set[str] = set()
        self.requests: list[EngineRequest] = []
        self.grammars: list[str] = []
        self.running = 0
        self.fail_after: int | None = None     # emit an ERROR output after this many steps
        self.refusal: tuple[str, str] | None = None   # (param, why): refuse every request at once
        self.fatal_error: str | None = None    # the worker group's failure (AsyncEngine)
        self.runtime = RuntimeInfo(num_speculative_tokens, num_speculative_tokens, False, False,
                                   64, 16, frozenset(), 2048)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self.running, kv_blocks_total=64, block_size=16,
                           kv_blocks_used=4 * self.running, kv_usage=4 * self.running / 64)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def prepare_grammar(self, grammar: str) -> None:
        """The real engine compiles it; the script ignores grammars (it is fixed text)."""
        self.grammars.append(grammar)

    async def submit(self, req: EngineRequest):
        self.requests.append(req)
        ids = self.tok.encode(self.script)[: req.sampling.max_tokens]
        detok = IncrementalDetokenizer(self.tok, req.prompt_token_ids)
        counters = RequestCounters(prompt_tokens=len(req.prompt_token_ids))
        if self.refusal is not None:          # as LLMEngine.add_request refuses
            yield EngineOutput(req.request_id, [], "", True, FinishReason.ERROR, counters=counters,
                               error=self.refusal[1], error_param=self.refusal[0])
            return
        self.running += 1
        try:
            pos = 0
            while pos < len(ids):
                await asyncio.sleep(self.step_delay_s)
                if req.request_id in self.aborted:
                    yield EngineOutput(req.request_id, [], "", True, FinishReason.ABORT,
                                       counters=counters)
                    return
                if self.fail_after is not None and pos >= self.fail_after:
                    yield EngineOutput(req.request_id, [], "", True, FinishReason.ERROR,
                                       counters=counters, error="device lost")
                    return
                n = 1 if pos == 0 else self.tokens_per_step
                step = ids[pos:pos + n]
                if pos > 0:
                    counters.num_drafts += 1
                    counters.num_draft_tokens += self.tokens_per_step - 1
                    counters.num_accepted_tokens += len(step) - 1
                pred = req.sampling.prediction or ()
                if pos > 0 and pos < len(pred):
                    verified = pred[pos:pos + len(step)]
                    counters.num_prediction_tokens += len(verified)
                    for want, got in zip(verified, step):
                        if want != got:
                            break
                        counters.num_accepted_prediction_tokens += 1
                pos += len(step)
                counters.completion_tokens = pos
                done = pos >= len(ids)
                lps = [TokenLogprob(t, -0.5, [(t, -0.5)]) for t in step] \
                    if req.sampling.logprobs else None
                reason = None
                if done:
                    reason = FinishReason.LENGTH if len(ids) == req.sampling.max_tokens \
                        else FinishReason.STOP
                yield EngineOutput(req.request_id, step, detok.step(step), done, reason,
                                   logprobs=lps, counters=RequestCounters(**{
                                       k: getattr(counters, k) for k in counters.__slots__}))
        finally:
            self.running -= 1

    async def shutdown(self, drain: bool = True) -> None:
        pass
