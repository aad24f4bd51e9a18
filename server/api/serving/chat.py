"""POST /v1/chat/completions: messages -> prompt ids -> engine -> JSON or SSE chunks."""
from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response

from server.api.openai.chat_output import ChatOutputParser, normalize_format, parse_full_text
from server.api.openai.grammars import (GrammarRequest, auto_tool_grammar, response_format_grammar,
                                        tool_call_grammar)
from server.api.openai.prompt_logprobs import vllm_prompt_logprobs
from server.api.openai.protocol import ChatCompletionRequest
from server.api.openai.responses import (chat_logprobs, finish_reason, merge_logprobs, stop_reason,
                                         usage)
from server.api.serving.common import (build_sampling, check_text_size, fit_prompt, max_new_tokens,
                                       new_id, plan_request, prediction_ids)
from server.api.serving.engine_call import engine_failure
from server.api.serving.fanout import Interleave, choice_sampling, prompt_cached_tokens
from server.api.serving.run import run_choices
from server.api.sse import event
from server.api.state import ServerState
from server.engine.protocol import EngineRequest
from server.web.errors import APIError, bad_request
from server.text.reasoning import count_reasoning_tokens
from server.text.special_tokens import THINK_END, THINK_START

class ChatPlan:
    """Everything decided before generation: prompt, sampling and how to read the output."""

    def __init__(self, state: ServerState, req: ChatCompletionRequest) -> None:
        self.req = req
        self.state = state
        s = state.settings
        self.request_id = new_id("chatcmpl")
        self.created = int(time.time())
        self.tool_choice, self.named = _tool_choice(req)
        use_tools = req.tools and self.tool_choice != "none"
        self.tool_format = normalize_format(s.tool_call_parser) if use_tools else None
        kwargs = _template_kwargs(req)
        try:
            prompt = state.tokenizer.apply_chat_template(
                _template_messages(req), tools=_template_tools(req) if use_tools else None,
                add_generation_prompt=req.add_generation_prompt,
                chat_template=state.chat_template, **kwargs)
        except APIError:
            raise
        except Exception as exc:     # template errors are the request's fault
            raise bad_request(f"chat template failed: {exc}", "messages") from None
        tail = prompt.rstrip()
        self.reasoning = s.enable_reasoning and (
            tail.endswith(THINK_START) or bool(kwargs.get("thinking") or kwargs.get("enable_thinking")))
        self.grammar, answer_grammar = self._structured_output(req, state)
        if self.grammar is not None and (req.ignore_eos or req.min_tokens):
            param = "ignore_eos" if req.ignore_eos else "min_tokens"
            raise bad_request(f"a forced tool call cannot be combined with {param} (a "
                              "finished grammar allows only the end-of-sequence token)", param)
        self.forced = THINK_END if self.grammar is not None and answer_grammar and self.reasoning else ""
        check_text_size(prompt, s, state.max_token_chars, "messages")
        ids = state.tokenizer.encode(prompt + self.forced, add_special_tokens=False)
        self.prompt_ids = fit_prompt(ids, s, "messages")
        requested = req.max_completion_tokens or req.max_tokens
        top = req.top_logprobs or 0
        if top and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        self.sampling = build_sampling(
            req, max_tokens=max_new_tokens(requested, len(self.prompt_ids), s),
            defaults=state.generation_defaults, vocab_size=s.vocab_size,
            logprobs=req.logprobs, top_logprobs=top, prompt_logprobs=req.prompt_logprobs,
            grammar=self.grammar.grammar if self.grammar is not None else None,
            prediction=prediction_ids(req, state.tokenizer, s, state.max_token_chars))
        # A parsed call whose name was not offered never reaches the client as a call.
        offered = {t.function.name for t in req.tools or ()}
        self.allowed_names = frozenset({self.named} if self.named else offered)

    def _structured_output(self, req: ChatCompletionRequest, state: ServerState
                           ) -> tuple[GrammarRequest | None, bool]:
        """(the grammar, whether it describes the answer) for a forced tool call or for
        response_format (openai/grammars.py).  With thinking on, the server closes the
        thought first (the grammar describes the answer), so the reasoning is empty.  In
        auto mode the grammar leaves text free (thinking included) and constrains a
        tool-call section once the model opens one."""
        if self.tool_format and self.tool_choice in ("required", "named"):
            return tool_call_grammar(self.tool_format, req.tools, self.named,
                                     req.parallel_tool_calls, state.tokenizer.token_to_id), True
        grammar = response_format_grammar(req.response_format)
        if grammar is None and self.tool_format and self.tool_choice == "auto" \
                and not req.ignore_eos and not req.min_tokens:
            return auto_tool_grammar(self.tool_format, req.tools, req.parallel_tool_calls,
                                     state.tokenizer.token_to_id, [THINK_START, THINK_END]), False
        return grammar, True

    @property
    def num_choices(self) -> int:
        return self.req.n

    def parser(self) -> ChatOutputParser:
        return ChatOutputParser(reasoning=self.reasoning, tool_format=self.tool_format,
                                forced_prefix=self.forced,
                                parallel_tool_calls=self.req.parallel_tool_calls,
                                allowed_names=self.allowed_names)

    def engine_request(self, i: int = 0) -> EngineRequest:
        """Choice ``i``'s engine request; with n > 1 ids get ``-i`` and seeds ``seed + i``."""
        rid = self.request_id if self.req.n == 1 else f"{self.request_id}-{i}"
        return EngineRequest(rid, list(self.prompt_ids), choice_sampling(self.sampling, i),
                             arrival_time=time.monotonic())

    def finish(self, engine_reason: str | None, has_calls: bool) -> str | None:
        if has_calls:
            return "stop" if self.tool_choice == "named" else "tool_calls"
        return engine_reason

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        if not self.reasoning:
            return 0
        end = self.state.think_end_id
        return count_reasoning_tokens(token_ids, end) if end is not None else len(token_ids)

    def usage(self, choices: list["ChoiceState"]) -> dict:
        """Prompt counted once, completion and reasoning tokens (and draft figures) summed
        over the choices (OpenAI's rule for n > 1); cached tokens as
        ``prompt_cached_tokens`` says."""
        first = choices[0].last.counters if choices[0].last is not None else None
        prompt = first.prompt_tokens if first and first.prompt_tokens else len(self.prompt_ids)
        completion = sum(ch.completion_tokens() for ch in choices)
        cached = prompt_cached_tokens([ch.cached_tokens() for ch in choices], len(choices))
        return usage(prompt, completion, cached,
                     sum(self.reasoning_tokens(ch.token_ids) for ch in choices),
                     [ch.last.counters if ch.last is not None else None for ch in choices])

    def chunk(self, choices: list, **extra: Any) -> dict:
        return {"id": self.request_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.state.settings.model_name,
                "choices": choices, **extra}


class ChoiceState:
    """What one choice has produced so far."""

    def __init__(self, index: int, parser: ChatOutputParser | None = None) -> None:
        self.index = index
        self.parser = parser
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: dict | None = None
        self.last: Any = None
        self.shown = {"content": "", "reasoning_content": ""}

    def completion_tokens(self) -> int:
        c = self.last.counters if self.last is not None else None
        return c.completion_tokens if c and c.completion_tokens else len(self.token_ids)

    def cached_tokens(self) -> int:
        return self.last.counters.cached_tokens if self.last is not None else 0


def _tool_choice(req: ChatCompletionRequest) -> tuple[str, str | None]:
    choice = req.tool_choice
    tools = req.tools or []
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice != "none" and req.tools is None:
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        if choice == "required" and not tools:
            return "none", None       # OpenAI downgrades required with no tools
        return choice, None
    name = choice.function.name
    if req.tools is None:
        raise bad_request("a named tool_choice needs tools", "tool_choice")
    if name not in {t.function.name for t in tools}:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools",
                          "tool_choice")
    return "named", name


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"content part type {part.type!r} is not supported; this model "
                              "reads text parts only", "messages")
        texts.append(part.text)
    return "\n".join(texts)


def _template_messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in req.messages:
        msg: dict = {"role": m.role, "content": _text(m.content) or ""}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content or m.reasoning
        if reasoning:
            msg["reasoning_content"] = reasoning
        if m.tool_calls:
            msg["tool_calls"] = [{
                "id": tc.id or "", "type": "function",
                "function": {"name": tc.function.name,
                             "arguments": tc.function.arguments if isinstance(
                                 tc.function.arguments, str) else json.dumps(
                                 tc.function.arguments, ensure_ascii=False)}}
                for tc in m.tool_calls]
        out.append(msg)
    return out


def _template_tools(req: ChatCompletionRequest) -> list[dict] | None:
    if not req.tools:
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _template_kwargs(req: ChatCompletionRequest) -> dict:
    kwargs: dict = {}
    if req.thinking and isinstance(req.thinking, dict) and "type" in req.thinking:
        on = req.thinking.get("type") == "enabled"
        kwargs.update(thinking=on, enable_thinking=on)
    if req.reasoning_effort:
        kwargs["reasoning_effort"] = req.reasoning_effort
    kwargs.update(req.chat_template_kwargs or {})
    for key in ("messages", "tools", "add_generation_prompt"):
        kwargs.pop(key, None)
    return kwargs


async def create_chat_completion(state: ServerState, raw: Any,
                                 is_disconnected: Callable[[], Awaitable[bool]],
                                 release: Callable[[], None],
                                 plan_inline: bool = False) -> Response:
    """Validate, plan and run one chat request (``n`` engine requests, one per choice);
    ``release`` frees its admission slots."""
    plan = await plan_request("chat", ChatCompletionRequest, ChatPlan, state, raw, release,
                              plan_inline)
    return await run_choices(state, plan, release, is_disconnected,
                             stream=_stream, complete=_complete)


async def _complete(plan: ChatPlan, merged: Interleave) -> dict:
    states = [ChoiceState(i) for i in range(len(merged.calls))]
    prompt_lp = None
    async for i, out in merged:
        st = states[i]
        if out.prompt_logprobs is not None and prompt_lp is None:
            prompt_lp = out.prompt_logprobs
        st.token_ids.extend(out.token_ids)
        st.text.append(out.text)
        st.logprobs = merge_logprobs(st.logprobs, chat_logprobs(out.logprobs, plan.state.text_of))
        st.last = out
        failure = engine_failure(out, "messages") if out.finished else None
        if failure:
            raise failure
    body = {"id": plan.request_id, "object": "chat.completion", "created": plan.created,
            "model": plan.state.settings.model_name,
            "choices": [_choice_body(plan, st) for st in states],
            "system_fingerprint": None, "usage": plan.usage(states)}
    if plan.req.prompt_logprobs is not None:     # vLLM's extra, once per response
        body["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lp, plan.state.text_of)
    return body


def _choice_body(plan: ChatPlan, st: ChoiceState) -> dict:
    msg = parse_full_text("".join(st.text), reasoning=plan.reasoning, tool_format=plan.tool_format,
                          forced_prefix=plan.forced,
                          parallel_tool_calls=plan.req.parallel_tool_calls,
                          allowed_names=plan.allowed_names)
    message: dict = {"role": "assistant", "content": msg.content, "refusal": None,
                     "tool_calls": msg.tool_calls}
    if plan.reasoning:
        message["reasoning_content"] = msg.reasoning
        message["reasoning"] = msg.reasoning
    return {"index": st.index, "message": message, "logprobs": st.logprobs,
            "finish_reason": plan.finish(finish_reason(st.last), bool(msg.tool_calls)),
            "stop_reason": stop_reason(st.last)}


def _mirror(delta: dict) -> dict:
    if "reasoning_content" in delta:
        delta["reasoning"] = delta["reasoning_content"]
    return delta


async def _stream(plan: ChatPlan, merged: Interleave) -> AsyncIterator[bytes]:
    """Chunks of all choices, interleaved as they come; each carries its choice index, each
    choice opens with its own role delta and ends with its own finish_reason."""
    req = plan.req
    full_text = plan.state.settings.full_text
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    states = [ChoiceState(i, plan.parser()) for i in range(len(merged.calls))]
    async for i, out in merged:
        st = states[i]
        if st.last is None:
            extra_first = {}
            if out.prompt_logprobs is not None and req.prompt_logprobs is not None:
                extra_first["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs,
                                                                      plan.state.text_of)
            yield event(plan.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}], **extra_first))
        st.last = out
        st.token_ids.extend(out.token_ids)
        failure = engine_failure(out, "messages")
        if failure:
            raise failure
        delta = st.parser.feed(out.text)
        final_delta, message = st.parser.finish() if out.finished else ({}, None)
        for key, value in final_delta.items():
            if key == "tool_calls":
                delta.setdefault("tool_calls", []).extend(value)
            else:
                delta[key] = delta.get(key, "") + value
        if full_text:
            for key in st.shown:
                if key in delta:
                    st.shown[key] += delta[key]
                    delta[key] = st.shown[key]
        lp = chat_logprobs(out.logprobs, plan.state.text_of)
        extra = {"usage": plan.usage(states)} if continuous else {}
        if out.finished:
            reason = plan.finish(finish_reason(out), bool(message and message.tool_calls))
            yield event(plan.chunk([{"index": i, "delta": _mirror(delta), "logprobs": lp,
                                     "finish_reason": reason,
                                     "stop_reason": stop_reason(out)}], **extra))
        elif delta or lp:
            yield event(plan.chunk([{"index": i, "delta": _mirror(delta), "logprobs": lp,
                                     "finish_reason": None}], **extra))
    if include_usage:
        yield event(plan.chunk([], usage=plan.usage(states)))
