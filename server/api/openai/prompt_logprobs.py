"""Prompt-token logprobs in the two shapes clients read.

* OpenAI's legacy completions (``echo`` + ``logprobs``): the prompt tokens lead the
  ``logprobs`` block (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``);
  the first prompt token has ``null`` logprob and ``null`` top alternatives, because
  nothing precedes it.  lm-evaluation-harness's loglikelihood tasks read exactly this.
* vLLM's ``prompt_logprobs`` extra: a list with one entry per prompt token, ``null``
  first, then ``{token_id: {"logprob", "decoded_token"}}`` holding the prompt token and
  its top alternatives.

The engine computes them from the main model's prefill (server/engine/worker/runner.py), which
MTP does not change.
"""
from __future__ import annotations

from server.api.openai.responses import TokenText, _lp
from server.engine.protocol import TokenLogprob


def echo_block(prompt_ids: list[int], items: list[TokenLogprob | None],
               text_of: TokenText) -> dict:
    """The prompt's part of a completions ``logprobs`` block (offsets from 0)."""
    tokens, lps, tops, offsets = [], [], [], []
    pos = 0
    for tid, item in zip(prompt_ids, items):
        token = text_of(tid)
        tokens.append(token)
        offsets.append(pos)
        pos += len(token)
        if item is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(_lp(item.logprob))
            top = {text_of(t): _lp(l) for t, l in item.top}
            top.setdefault(token, _lp(item.logprob))    # OpenAI lists the chosen token too
            tops.append(top)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens,
            "top_logprobs": tops}


def join_blocks(prompt: dict, generated: dict | None) -> dict:
    """Prompt block, then the generated tokens' block with its offsets moved after it."""
    if not generated:
        return prompt
    end = (prompt["text_offset"][-1] + len(prompt["tokens"][-1])) if prompt["tokens"] else 0
    start = generated["text_offset"][0] if generated["text_offset"] else 0
    out = {k: list(v) for k, v in prompt.items()}
    for key in ("token_logprobs", "tokens", "top_logprobs"):
        out[key] += generated[key]
    out["text_offset"] += [end + o - start for o in generated["text_offset"]]
    return out


def vllm_prompt_logprobs(items: list[TokenLogprob | None] | None,
                         text_of: TokenText) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` list (keys are token ids as strings, as JSON needs)."""
    if items is None:
        return None
    out: list[dict | None] = []
    for item in items:
        if item is None:
            out.append(None)
            continue
        entry = {str(item.token_id): {"logprob": _lp(item.logprob),
                                      "decoded_token": text_of(item.token_id)}}
        for t, l in item.top:
            entry.setdefault(str(t), {"logprob": _lp(l), "decoded_token": text_of(t)})
        out.append(entry)
    return out
