"""Builders for response pieces shared by chat and completions: usage, logprobs, finish."""
from __future__ import annotations

from typing import Any, Iterable

from server.engine.protocol import EngineOutput, FinishReason, RequestCounters, TokenLogprob


def speculative_usage(counters: Iterable[RequestCounters | None]) -> dict:
    """The ``usage.speculative`` extension: draft tokens verified and accepted, MTP's and
    the prediction's apart, summed over the choices (each a final ``RequestCounters``;
    None for a choice that never reached the engine)."""
    out = {"mtp_draft_tokens": 0, "mtp_accepted_tokens": 0,
           "prediction_draft_tokens": 0, "prediction_accepted_tokens": 0}
    for c in counters:
        if c is None:
            continue
        out["mtp_draft_tokens"] += c.num_draft_tokens
        out["mtp_accepted_tokens"] += c.num_accepted_tokens
        out["prediction_draft_tokens"] += c.num_prediction_tokens
        out["prediction_accepted_tokens"] += c.num_accepted_prediction_tokens
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None,
          counters: Iterable[RequestCounters | None] = ()) -> dict:
    """OpenAI's usage object.  ``completion_tokens_details`` always carries OpenAI's
    Predicted Outputs figures (zeros without a prediction): ``accepted_prediction_tokens``
    = prediction tokens verified as drafts and accepted, ``rejected_prediction_tokens`` =
    verified and rejected (tokens never verified are in neither).  ``speculative`` is our
    extension (``speculative_usage``)."""
    spec = speculative_usage(counters)
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    body["completion_tokens_details"] = {
        "reasoning_tokens": reasoning_tokens or 0,
        "accepted_prediction_tokens": spec["prediction_accepted_tokens"],
        "rejected_prediction_tokens": max(0, spec["prediction_draft_tokens"]
                                          - spec["prediction_accepted_tokens"])}
    body["speculative"] = spec
    return body


def finish_reason(out: EngineOutput | None) -> str | None:
    if out is None or out.finish_reason is None:
        return None
    return out.finish_reason.value


def stop_reason(out: EngineOutput | None) -> str | int | None:
    if out is None or out.finish_reason != FinishReason.STOP:
        return None
    return out.stop_reason


class TokenText:
    """Token id -> text, for logprobs (special tokens shown as themselves)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _lp(value: float) -> float:
    # JSON has no -inf; OpenAI clamps to a large negative number.
    return max(float(value), -9999.0)


def chat_logprobs(items: list[TokenLogprob] | None, text_of: TokenText) -> dict | None:
    if items is None:
        return None
    content = []
    for item in items:
        token = text_of(item.token_id)
        content.append({
            "token": token, "logprob": _lp(item.logprob), "bytes": list(token.encode()),
            "top_logprobs": [{"token": text_of(t), "logprob": _lp(l),
                              "bytes": list(text_of(t).encode())} for t, l in item.top],
        })
    return {"content": content}


def completion_logprobs(items: list[TokenLogprob] | None, text_of: TokenText,
                        offset: int = 0) -> dict | None:
    if items is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for item in items:
        token = text_of(item.token_id)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        token_lps.append(_lp(item.logprob))
        tops.append({text_of(t): _lp(l) for t, l in item.top} if item.top else None)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens,
            "top_logprobs": tops}


def merge_logprobs(acc: dict | None, part: dict | None) -> dict | None:
    """Concatenate per-step logprob blocks (same shape) for non-streaming answers."""
    if part is None:
        return acc
    if acc is None:
        return {k: list(v) for k, v in part.items()}
    for key, value in part.items():
        acc[key].extend(value)
    return acc
