"""Output processing after each step: detokenize, apply stop strings, build EngineOutputs.

It runs on the engine thread after ``Scheduler.update``; under asynchronous scheduling
that is while the worker executes the next step, so it is off the critical path.  A stop
string found here finishes the request, and whatever the step already in flight produces
for it is discarded (Scheduler.update skips finished requests).

Engine-side, after the scheduler's token-level stops (EOS, stop_token_ids, lengths).  Stop
strings are searched across token boundaries in the accumulated text: the part of the new
text that could still complete a stop string is held back until it cannot, so a streamed
delta never shows a stop string's first characters and then retracts them.  A hit cuts the
text (keeping the stop string only with include_stop_str_in_output), drops the tokens after
the one that completed it, and finishes the request with FinishReason.STOP.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from server.engine.messages import ModelRunnerOutput
from server.engine.protocol import EngineOutput, FinishReason, TokenLogprob
from server.engine.scheduler import SequenceUpdate
from server.engine.sequence import Sequence


@dataclass(slots=True)
class StopHit:
    stop: str


class RequestOutput:
    """Per-request text state: detokenizer, accumulated text, how much was sent."""

    def __init__(self, seq: Sequence, tokenizer: Any) -> None:
        self.seq = seq
        p = seq.sampling
        self.detok = None
        if tokenizer is not None:
            from server.text.detokenizer import IncrementalDetokenizer
            self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                                skip_special_tokens=p.skip_special_tokens)
        self.stops = tuple(s for s in p.stop if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.num_tokens_sent = 0

    def process(self, tokens: list[int], logprobs: list[TokenLogprob] | None,
                finished: bool) -> tuple[EngineOutput, StopHit | None]:
        seq, p = self.seq, self.seq.sampling
        hit: StopHit | None = None
        kept = 0
        for tok in tokens:
            kept += 1
            is_stop_token = finished and kept == len(tokens) and tok in seq.stop_ids \
                and seq.finish_reason is FinishReason.STOP
            if self.detok is None or (is_stop_token and not p.include_stop_str_in_output):
                continue
            before = len(self.text)
            self.text += self.detok.step(tok)
            if self.stops and len(self.text) > before:
                hit = self._find_stop(before)
                if hit is not None:
                    break
        tokens = tokens[:kept]
        done = finished or hit is not None
        if done and hit is None and self.detok is not None:
            self.text += self.detok.flush()
        limit = len(self.text) if done else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:limit]
        self.sent = limit
        self.num_tokens_sent += len(tokens)
        counters = replace(seq.counters, completion_tokens=self.num_tokens_sent)
        out = EngineOutput(
            request_id=seq.request_id, token_ids=tokens, text=delta, finished=done,
            finish_reason=FinishReason.STOP if hit else (seq.finish_reason if done else None),
            stop_reason=hit.stop if hit else (seq.stop_reason if done else None),
            logprobs=logprobs[:kept] if logprobs is not None else None,
            counters=counters, first_token_time=seq.first_token_time)
        return out, hit

    def _find_stop(self, before: int) -> StopHit | None:
        """Earliest stop string that ends inside the text added since ``before``."""
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.seq.sampling.include_stop_str_in_output \
            else self.text[:i]
        self.sent = min(self.sent, len(self.text))
        return StopHit(s)


def final_output(seq: Sequence, reason: FinishReason, error: str | None = None,
                 text: str = "", error_param: str | None = None) -> EngineOutput:
    """The last output of a request that ends without new tokens (abort, error; a refusal
    names the request parameter at fault in ``error_param``)."""
    return EngineOutput(request_id=seq.request_id, token_ids=[], text=text, finished=True,
                        finish_reason=reason, error=error, error_param=error_param,
                        counters=replace(seq.counters), first_token_time=seq.first_token_time)


class OutputProcessor:
    """The per-request text states and the step's output loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestOutput] = {}

    def add(self, seq: Sequence) -> None:
        self._requests[seq.request_id] = RequestOutput(seq, self.tokenizer)

    def remove(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, results: list[SequenceUpdate], out: ModelRunnerOutput, now: float
                ) -> tuple[list[tuple[Sequence, EngineOutput]], list[tuple[Sequence, str]],
                           list[tuple[Sequence, str]]]:
        """(seq, EngineOutput) for one applied step, plus (seq, stop string) for requests a
        stop string ended and (seq, error) for requests whose processing failed."""
        logprobs = dict(zip(out.request_ids, out.logprobs))
        outputs, stops, failures = [], [], []
        for res in results:
            seq = res.seq
            try:
                if seq.first_token_time is None and res.new_token_ids:
                    seq.first_token_time = now
                o, hit = self._requests[seq.request_id].process(
                    res.new_token_ids, logprobs.get(seq.request_id), res.finished)
                o.prompt_logprobs = out.prompt_logprobs.get(seq.request_id)
            except Exception as exc:          # this request only
                failures.append((seq, f"output processing failed: {exc!r}"))
                continue
            if hit is not None and not seq.finished:
                stops.append((seq, hit.stop))
            outputs.append((seq, o))
        return outputs, stops, failures
