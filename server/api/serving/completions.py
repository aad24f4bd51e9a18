"""POST /v1/completions: prompt(s) as text or token ids -> ``n`` choices per prompt.

Choice ``k`` is prompt ``k // n``'s choice ``k % n`` (OpenAI's ``index = prompt * n + i``)
and is its own engine request."""
from __future__ import annotations

import time
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from server.api.openai.grammars import response_format_grammar
from server.api.openai.prompt_logprobs import echo_block, join_blocks, vllm_prompt_logprobs
from server.api.openai.protocol import CompletionRequest
from server.api.openai.responses import completion_logprobs, finish_reason, stop_reason, usage
from server.api.serving.common import (build_sampling, check_text_size, fit_prompt, max_new_tokens,
                                       new_id, plan_request, prediction_ids)
from server.api.serving.engine_call import engine_failure
from server.api.serving.fanout import Interleave, choice_sampling, prompt_cached_tokens
from server.api.serving.run import run_choices
from server.api.sse import event
from server.api.state import ServerState
from server.engine.protocol import EngineRequest
from server.web.errors import bad_request

MAX_PROMPTS = 64


def _prompts(req: CompletionRequest, tok: Any, vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt; given ids must lie in the model's ``[0, vocab_size)``."""
    p = req.prompt
    if isinstance(p, str):
        items: list = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise bad_request("prompt is empty", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = tok.encode(item, add_special_tokens=True) if item else []
        else:
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab_size})", "prompt")
        out.append(ids)
    return out


class CompletionPlan:
    def __init__(self, state: ServerState, req: CompletionRequest) -> None:
        s = state.settings
        if req.suffix is not None:
            raise bad_request("suffix is not currently supported", "suffix")
        self.state, self.req = state, req
        self.n = req.n
        self.request_id = new_id("cmpl")
        self.created = int(time.time())
        for text in [req.prompt] if isinstance(req.prompt, str) else req.prompt:
            if isinstance(text, str):         # before tokenizing (common.py)
                check_text_size(text, s, state.max_token_chars, "prompt")
        self.prompts = [fit_prompt(ids, s, "prompt")
                        for ids in _prompts(req, state.tokenizer, s.vocab_size)]
        if len(self.prompts) * self.n > MAX_PROMPTS:
            raise bad_request(f"{len(self.prompts)} prompts x n={self.n} is "
                              f"{len(self.prompts) * self.n} choices; at most {MAX_PROMPTS} "
                              "per request", "n")
        top = req.logprobs
        # Prompt logprobs: OpenAI's echo + logprobs (top alternatives: logprobs), or vLLM's
        # prompt_logprobs (top alternatives: its value); the larger count serves both.
        self.echo_logprobs = req.echo and top is not None
        wanted = [n for n in (top if self.echo_logprobs else None, req.prompt_logprobs)
                  if n is not None]
        prompt_lp = max(wanted) if wanted else None
        limits = [max_new_tokens(req.max_tokens, len(ids), s) for ids in self.prompts]
        # max_tokens 0 with prompt logprobs: the engine runs the prefill and one token,
        # which this layer drops (the engine always emits at least one token).
        self.prompt_only = prompt_lp is not None and req.max_tokens == 0
        self.grammar = response_format_grammar(req.response_format)
        prediction = prediction_ids(req, state.tokenizer, s, state.max_token_chars)
        self.samplings = [build_sampling(
            req, max_tokens=1 if self.prompt_only else limit,
            defaults=state.generation_defaults, vocab_size=s.vocab_size,
            logprobs=top is not None, top_logprobs=top or 0, prompt_logprobs=prompt_lp,
            grammar=self.grammar.grammar if self.grammar is not None else None,
            prediction=prediction)
            for limit in limits]
        self.echo = [state.tokenizer.decode(ids, skip_special_tokens=True) if req.echo else ""
                     for ids in self.prompts]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def echo_only(self, k: int) -> bool:
        """Choice ``k`` asks for no tokens (max_tokens 0): the echo alone, no engine call."""
        return self.samplings[self.prompt_of(k)].max_tokens == 0

    def prompt_of(self, k: int) -> int:
        return k // self.n

    def engine_request(self, k: int) -> EngineRequest:
        p = self.prompt_of(k)
        return EngineRequest(f"{self.request_id}-{k}", list(self.prompts[p]),
                             choice_sampling(self.samplings[p], k % self.n),
                             arrival_time=time.monotonic())

    def body(self, choices: list, **extra: Any) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.state.settings.model_name, "choices": choices, **extra}

    def usage(self, counts: list[int], cached: list[int], counters: list) -> dict:
        """Each prompt counted once, completion tokens (and draft figures, from each
        choice's last ``RequestCounters``) summed over every choice."""
        return usage(sum(len(p) for p in self.prompts), sum(counts),
                     prompt_cached_tokens(cached, self.n), counters=counters)


async def create_completion(state: ServerState, raw: Any,
                            is_disconnected: Callable[[], Awaitable[bool]],
                            release: Callable[[], None],
                            plan_inline: bool = False) -> Response:
    plan = await plan_request("completion", CompletionRequest, CompletionPlan, state, raw, release,
                              plan_inline)
    return await run_choices(state, plan, release, is_disconnected,
                             stream=_stream, complete=_complete, idle=plan.echo_only)


async def _complete(plan: CompletionPlan, merged: Interleave) -> dict:
    states = await _collect(plan, merged)
    choices = [_choice_body(plan, k, st) for k, st in enumerate(states)]
    return plan.body(choices, usage=plan.usage(
        [st["n"] for st in states], [st["cached"] for st in states],
        [st["last"].counters if st["last"] is not None else None for st in states]))


async def _collect(plan: CompletionPlan, merged: Interleave) -> list[dict]:
    states = [{"text": [plan.echo[plan.prompt_of(k)]], "logprobs": None, "last": None, "n": 0,
               "cached": 0, "prompt": None, "prompt_lp": None} for k in range(plan.num_choices)]
    async for k, out in merged:
        if out is None:          # max_tokens 0: the echo alone
            continue
        st = states[k]
        if out.prompt_logprobs is not None:
            st["prompt_lp"] = out.prompt_logprobs
            if plan.echo_logprobs:
                st["prompt"] = echo_block(plan.prompts[plan.prompt_of(k)], out.prompt_logprobs,
                                          plan.state.text_of)
        if plan.prompt_only:     # the one token the engine had to make is not the answer
            st["last"] = out
            failure = engine_failure(out) if out.finished else None
            if failure:
                raise failure
            continue
        st["text"].append(out.text)
        st["n"] += len(out.token_ids)
        lp = completion_logprobs(out.logprobs, plan.state.text_of)
        if lp is not None:
            st["logprobs"] = lp if st["logprobs"] is None else {
                key: st["logprobs"][key] + v for key, v in lp.items()}
        st["last"] = out
        st["cached"] = out.counters.cached_tokens
        failure = engine_failure(out) if out.finished else None
        if failure:
            raise failure
    return states


def _choice_body(plan: CompletionPlan, k: int, st: dict) -> dict:
    parts, last = st["logprobs"], st["last"]
    if st["prompt"] is not None:      # echo + logprobs: the prompt tokens lead
        parts = join_blocks(st["prompt"], parts)
    elif parts is not None:   # offsets run over the returned text
        offsets, pos = [], len(plan.echo[plan.prompt_of(k)])
        for token in parts["tokens"]:
            offsets.append(pos)
            pos += len(token)
        parts["text_offset"] = offsets
    body = {"index": k, "text": "".join(st["text"]), "logprobs": parts,
            "finish_reason": "length" if plan.prompt_only else (finish_reason(last) or "length"),
            "stop_reason": None if plan.prompt_only else stop_reason(last)}
    if plan.req.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(st["prompt_lp"], plan.state.text_of)
    return body


async def _stream(plan: CompletionPlan, merged: Interleave) -> AsyncIterator[bytes]:
    """Interleave the choices' streams; each chunk carries its choice index."""
    req = plan.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    counts = [0] * plan.num_choices
    cached = [0] * plan.num_choices
    counters: list = [None] * plan.num_choices
    full = [plan.echo[plan.prompt_of(k)] for k in range(plan.num_choices)]
    sent_echo = [False] * plan.num_choices
    async for k, item in merged:
        text = plan.echo[plan.prompt_of(k)] if not sent_echo[k] else ""
        sent_echo[k] = True
        if item is None:     # max_tokens 0
            yield event(plan.body([{"index": k, "text": text, "logprobs": None,
                                    "finish_reason": "length", "stop_reason": None}]))
            continue
        failure = engine_failure(item)
        if failure:
            raise failure
        cached[k] = item.counters.cached_tokens
        counters[k] = item.counters
        lp = None if plan.prompt_only else completion_logprobs(item.logprobs, plan.state.text_of)
        if item.prompt_logprobs is not None and plan.echo_logprobs:
            lp = join_blocks(echo_block(plan.prompts[plan.prompt_of(k)], item.prompt_logprobs,
                                        plan.state.text_of), lp)
        if not plan.prompt_only:
            counts[k] += len(item.token_ids)
            full[k] += item.text
            text += item.text
        out_text = full[k] if plan.state.settings.full_text else text
        choice = {
            "index": k, "text": out_text, "logprobs": lp,
            "finish_reason": (("length" if plan.prompt_only else finish_reason(item))
                              if item.finished else None),
            "stop_reason": stop_reason(item) if item.finished and not plan.prompt_only else None}
        if item.prompt_logprobs is not None and plan.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(item.prompt_logprobs,
                                                             plan.state.text_of)
        yield event(plan.body([choice]))
    if include_usage:
        yield event(plan.body([], usage=plan.usage(counts, cached, counters)))
