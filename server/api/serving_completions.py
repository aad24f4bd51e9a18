"""POST /v1/completions: prompt(s) as text or token ids -> one choice per prompt."""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from server.api.engine_call import (ClientDisconnected, EngineCall, close_stream,
                                     engine_failure)
from server.api.errors import APIError, bad_request, openai_body
from server.api.protocol import CompletionRequest
from server.api.responses import completion_logprobs, finish_reason, stop_reason, usage
from server.api.serving_common import (build_sampling, fit_prompt, max_new_tokens, new_id,
                                       plan_request)
from server.api.sse import DONE, SSE_HEADERS, event, json_response
from server.api.state import ServerState
from server.engine.protocol import EngineRequest

MAX_PROMPTS = 64


def _prompts(req: CompletionRequest, tok: Any) -> list[list[int]]:
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
            bad = [t for t in ids if not 0 <= t < tok.vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary "
                                  f"[0, {tok.vocab_size})", "prompt")
        out.append(ids)
    return out


class CompletionPlan:
    def __init__(self, state: ServerState, req: CompletionRequest) -> None:
        s = state.settings
        if req.suffix is not None:
            raise bad_request("suffix is not currently supported", "suffix")
        self.state, self.req = state, req
        self.request_id = new_id("cmpl")
        self.created = int(time.time())
        self.prompts = [fit_prompt(ids, s, "prompt") for ids in _prompts(req, state.tokenizer)]
        top = req.logprobs
        self.samplings = [build_sampling(
            req, max_tokens=max_new_tokens(req.max_tokens, len(ids), s),
            defaults=state.generation_defaults, vocab_size=state.tokenizer.vocab_size,
            logprobs=top is not None, top_logprobs=top or 0) for ids in self.prompts]
        self.echo = [state.tokenizer.decode(ids, skip_special_tokens=True) if req.echo else ""
                     for ids in self.prompts]

    def engine_request(self, i: int) -> EngineRequest:
        return EngineRequest(f"{self.request_id}-{i}", list(self.prompts[i]), self.samplings[i],
                             arrival_time=time.monotonic())

    def body(self, choices: list, **extra: Any) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.state.settings.model_name, "choices": choices, **extra}


async def create_completion(state: ServerState, raw: Any,
                            is_disconnected: Callable[[], Awaitable[bool]],
                            release: Callable[[], None]) -> Response:
    plan = plan_request("completion", CompletionRequest, CompletionPlan, state, raw, release)
    req = plan.req
    s = state.settings
    calls = []
    for i in range(len(plan.prompts)):
        state.metrics.on_received()
        calls.append(None if plan.samplings[i].max_tokens == 0 else EngineCall(
            state.engine, plan.engine_request(i), state.metrics,
            token_timeout_s=s.token_timeout_s, e2e_timeout_s=s.e2e_timeout_s,
            is_disconnected=None if req.stream else is_disconnected))
    if req.stream:
        body = _stream(plan, calls, release)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(close_stream, body, calls, release))
    tasks = [asyncio.ensure_future(_one(plan, i, c)) for i, c in enumerate(calls)]
    try:
        results = await asyncio.gather(*tasks)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        for t in tasks:           # one prompt failed: stop the others (aborts their requests)
            t.cancel()
        for c in calls:
            if c is not None:
                c.close()
        release()
    choices = [r[0] for r in results]
    prompt_tokens = sum(len(p) for p in plan.prompts)
    completion_tokens = sum(r[1] for r in results)
    cached = sum(r[2] for r in results)
    return json_response(plan.body(choices, usage=usage(prompt_tokens, completion_tokens, cached)))


async def _one(plan: CompletionPlan, i: int, call: EngineCall | None) -> tuple[dict, int, int]:
    text, logprob_parts, last, n = [plan.echo[i]], None, None, 0
    if call is not None:
        async for out in call:
            text.append(out.text)
            n += len(out.token_ids)
            lp = completion_logprobs(out.logprobs, plan.state.text_of)
            if lp is not None:
                logprob_parts = lp if logprob_parts is None else {
                    k: logprob_parts[k] + v for k, v in lp.items()}
            last = out
        failure = engine_failure(last)
        if failure:
            raise failure
    if logprob_parts is not None:   # offsets run over the returned text
        offsets, pos = [], len(plan.echo[i])
        for token in logprob_parts["tokens"]:
            offsets.append(pos)
            pos += len(token)
        logprob_parts["text_offset"] = offsets
    choice = {"index": i, "text": "".join(text), "logprobs": logprob_parts,
              "finish_reason": finish_reason(last) or "length", "stop_reason": stop_reason(last)}
    cached = last.counters.cached_tokens if last is not None else 0
    return choice, n, cached


async def _stream(plan: CompletionPlan, calls: list, release: Callable[[], None]
                  ) -> AsyncIterator[bytes]:
    """Interleave the prompts' streams; each chunk carries its choice index."""
    req = plan.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    queue: asyncio.Queue = asyncio.Queue()
    counts = [0] * len(calls)
    cached = [0] * len(calls)
    full = [plan.echo[i] for i in range(len(calls))]

    async def pump(i: int, call: EngineCall | None) -> None:
        try:
            if call is None:
                queue.put_nowait((i, None))
                return
            async for out in call:
                queue.put_nowait((i, out))
        except BaseException as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, StopAsyncIteration))

    tasks = [asyncio.create_task(pump(i, c)) for i, c in enumerate(calls)]
    live = len(calls)
    sent_echo = [False] * len(calls)
    try:
        while live:
            i, item = await queue.get()
            if item is StopAsyncIteration:
                live -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            text = plan.echo[i] if not sent_echo[i] else ""
            sent_echo[i] = True
            if item is None:     # max_tokens 0
                yield event(plan.body([{"index": i, "text": text, "logprobs": None,
                                        "finish_reason": "length", "stop_reason": None}]))
                continue
            failure = engine_failure(item)
            if failure:
                raise failure
            counts[i] += len(item.token_ids)
            cached[i] = item.counters.cached_tokens
            full[i] += item.text
            out_text = full[i] if plan.state.settings.full_text else text + item.text
            yield event(plan.body([{
                "index": i, "text": out_text,
                "logprobs": completion_logprobs(item.logprobs, plan.state.text_of),
                "finish_reason": finish_reason(item) if item.finished else None,
                "stop_reason": stop_reason(item) if item.finished else None}]))
        if include_usage:
            yield event(plan.body([], usage=usage(sum(len(p) for p in plan.prompts),
                                                  sum(counts), sum(cached))))
    except APIError as exc:
        yield event(openai_body(exc.status, exc.message, exc.param))
    except ClientDisconnected:
        return
    except Exception as exc:
        yield event(openai_body(500, f"internal error: {type(exc).__name__}: {exc}"))
    finally:
        for t in tasks:
            t.cancel()
        for c in calls:
            if c is not None:
                c.close()
        release()
    yield DONE
