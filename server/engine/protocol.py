"""Messages between the HTTP layer and the engine.  No torch here: the API layer imports it.

Glossary (used in code, logs and metrics):
  draft token     a token proposed by the MTP layer for a future position.
  accepted        a draft token the verifier kept (greedy: equal to the target's argmax;
                  sampling: kept by probability-ratio acceptance).
  recovered       the token the verifier emits at the first rejected position, sampled
                  from the residual distribution norm(max(0, p - q)) (greedy: the argmax).
  bonus token     the token sampled from the target at the position after the last
                  draft when every draft was accepted.
  A step that accepts ``a`` of ``k`` drafts emits ``a + 1`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"            # EOS, stop string or stop token
    LENGTH = "length"        # max_tokens, maxIterTimes or maxSeqLen
    ABORT = "abort"          # client gone, timeout, shutdown
    ERROR = "error"          # failed while processing; see EngineOutput.error


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Validated per-request sampling settings; temperature 0 means greedy."""
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # Logprobs of the prompt tokens (vLLM's prompt_logprobs): None = off, n = the chosen
    # token plus the top n alternatives.  The prefill then computes every prompt position
    # (no prefix-cache hit for this request: cached positions have no logits).
    prompt_logprobs: int | None = None
    # A grammar the output must follow (llguidance's serialised grammar; sample/grammar.py in the
    # API layer builds it, server/engine/sample/grammar_masks.py applies it as a token mask).
    grammar: str | None = None
    # OpenAI Predicted Outputs: the token ids of text the user expects in the answer.  Where
    # the output so far matches a place in it, the tokens after that place are verified as
    # drafts (spec/prediction.py); the output is the same as without it.
    prediction: tuple[int, ...] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty) \
            or bool(self.presence_penalty)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = 0.0            # time.monotonic() at arrival; 0 = set on submit
    # PD disaggregation (server/pd): a prefill instance exports the prompt's full blocks'
    # KV (every layer, the MTP layer's too) once computed; a decode instance is handed the
    # rows a prefill instance exported, one bytes row per full prompt block, block 0 first.
    export_kv: bool = False
    remote_kv: tuple[bytes, ...] = ()
    # The PD role version the rows were checked under: after a role change the engine
    # purges blocks loaded from peers and loads no rows of an earlier version
    # (BlockManager.purge_peer_blocks).
    remote_kv_epoch: int = 0


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)   # (token_id, logprob), best first


@dataclass(slots=True)
class RequestCounters:
    prompt_tokens: int = 0
    cached_tokens: int = 0               # prompt tokens served from the prefix cache
    completion_tokens: int = 0
    num_drafts: int = 0                  # verification steps that carried MTP drafts
    num_draft_tokens: int = 0            # MTP draft tokens proposed
    num_accepted_tokens: int = 0         # MTP draft tokens accepted
    num_preemptions: int = 0
    num_prediction_tokens: int = 0       # tokens of the request's prediction verified as drafts
    num_accepted_prediction_tokens: int = 0   # of which accepted (the rest were rejected)


@dataclass(slots=True)
class EngineOutput:
    """One update for one request: the tokens emitted by one engine step (1..k+1 of them).

    ``text`` is the detokenized delta for ``token_ids`` with stop strings already applied
    (text after a stop string is cut, and the stop string itself unless
    include_stop_str_in_output).
    """
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    counters: RequestCounters = field(default_factory=RequestCounters)
    error: str | None = None
    # With ``error``: the request parameter of a request the engine refuses because it can
    # never be served as asked (the client's to change: a 400); None: an engine fault (500).
    error_param: str | None = None
    first_token_time: float | None = None   # monotonic time the request's first token was emitted
    # With SamplingParams.prompt_logprobs, on the request's first output: one entry per
    # prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
