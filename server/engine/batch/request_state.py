"""The worker's per-request state: what it needs to feed, sample and draft a request.  No torch.

The worker builds one from a ``NewRequestData`` and then advances it itself after every
step it executes, so a step scheduled before the previous one's tokens reached the host
(asynchronous scheduling) still starts from the true state.  The engine's ``Sequence`` is
the scheduler's view of the same request and never crosses to the worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.engine.messages import NewRequestData
from server.engine.protocol import SamplingParams
from server.engine.stop_rules import first_stop
from server.engine.token_view import TokenView


@dataclass(slots=True, eq=False)
class RequestState(TokenView):
    request_id: str
    token_ids: list[int]              # prompt + every token this worker emitted for it
    num_prompt_tokens: int
    num_computed_tokens: int          # positions whose main and MTP KV are final
    block_table: list[int]
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    max_output_tokens: int
    stopped: bool = False             # a token-level stop rule ended it (stop_rules.py)
    matcher: Any = None               # its grammar's llguidance matcher (sample/grammar.py), if any
    export_kv: bool = False           # PD prefill: export the prompt blocks once computed

    @classmethod
    def from_new(cls, new: NewRequestData) -> "RequestState":
        return cls(new.request_id, list(new.token_ids), new.num_prompt_tokens,
                   new.num_computed_tokens, list(new.block_ids), new.sampling, new.seed,
                   new.stop_ids, new.max_output_tokens, export_kv=new.export_kv)

    @property
    def num_new_tokens(self) -> int:
        """Known tokens the next step feeds (the prompt, or the last emitted token)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that edits the logits (penalties, logit_bias, an unmet
        min_tokens): the next token is the argmax of the raw logits."""
        sp = self.sampling
        return (sp.greedy and not sp.has_penalties and not sp.logit_bias
                and (sp.min_tokens <= self.num_output_tokens or not self.stop_ids))

    def penalty_context(self) -> tuple[list[int], list[int]]:
        """(prompt ids, output ids) for penalties; empty lists when the request has none
        (copying every sequence's tokens each step would cost O(length) per step)."""
        p = self.sampling
        if not p.has_penalties:
            return [], []
        return (self.prompt_token_ids if p.repetition_penalty != 1.0 else []), self.output_token_ids

    def advance(self, sampled: list[int]) -> None:
        """Apply one executed step: every fed token and the accepted drafts are now computed."""
        self.stopped = first_stop(sampled, self.num_output_tokens, self.stop_ids, self.sampling,
                                  self.max_output_tokens) is not None
        self.num_computed_tokens = len(self.token_ids) + len(sampled) - 1
        self.token_ids.extend(sampled)
