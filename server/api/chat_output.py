"""Turn generated text into chat deltas: reasoning, content and tool calls.

One object per choice.  The generated text first goes through the reasoning splitter
(when thinking is on), and what comes out as content goes through the tool-call stream
(when tools are on); both come from ``server.text`` and hold back partial markers, so
the deltas always add up to the full-text parse.  Tool-call text that does not parse
comes back as content, never as an error.

``forced_prefix`` is text the server appended to the prompt to force a tool call
(``tool_choice`` required or named): the model continues it, so the parser reads
prefix + output, and whatever the prefix produces (a call's id and name) goes out with
the first real delta.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from server.text.reasoning import ReasoningParser
from server.text.special_tokens import (TOOL_CALL_BEGIN, TOOL_CALLS_BEGIN, TOOL_SEP)
from server.text.tool_calls import DeepSeekV3ToolParser, DeepSeekV31ToolParser

_PARSERS = {"deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser}


def normalize_format(name: str | None) -> str:
    """MindIE parser names (deepseekv3, deepseek_v2, deepseekv31, ...) -> a parser key."""
    key = (name or "deepseek_v3").lower().replace("_", "").replace("-", "")
    return "deepseek_v31" if key in ("deepseekv31", "deepseekv32") else "deepseek_v3"


def forced_opening(fmt: str, name: str | None) -> str:
    """Generated-text prefix that forces a call in the model's own format (None: any name)."""
    if fmt == "deepseek_v31":
        head = TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN
        return head if name is None else head + name + TOOL_SEP
    head = TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP
    return head if name is None else head + name + "\n```json\n"


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class ChatOutputParser:
    def __init__(self, *, reasoning: bool, tool_format: str | None,
                 forced_prefix: str = "", parallel_tool_calls: bool = True) -> None:
        self.reasoning = ReasoningParser().stream() if reasoning else None
        self.tools = _PARSERS[normalize_format(tool_format)]().stream() if tool_format else None
        self.parallel = parallel_tool_calls
        self._reasoning_text: list[str] = []
        self._content_text: list[str] = []
        self._pending = self._step(forced_prefix, final=False) if forced_prefix else {}

    def _step(self, delta: str, final: bool) -> dict:
        out: dict = {}
        if self.reasoning is not None:
            r, c = self.reasoning.finish() if final else self.reasoning.feed(delta)
            if r:
                out["reasoning_content"] = r
                self._reasoning_text.append(r)
        else:
            c = "" if final else delta
        if self.tools is not None:
            td = self.tools.feed(c) if c else None
            parts = [td] if td else []
            if final:
                parts.append(self.tools.finish())
            content = "".join(p.content for p in parts)
            calls = [tc for p in parts for tc in p.tool_calls
                     if self.parallel or tc.get("index", 0) == 0]
            if calls:
                out["tool_calls"] = calls
        else:
            content = c
        if content:
            out["content"] = content
            self._content_text.append(content)
        return out

    def feed(self, delta: str) -> dict:
        """Add generated text; returns a (possibly empty) delta message."""
        out = self._step(delta, final=False)
        if self._pending:
            out = _join(self._pending, out)
            self._pending = {}
        return out

    def finish(self) -> tuple[dict, ParsedMessage]:
        """Flush held-back text; returns (last delta, the whole message)."""
        out = _join(self._pending, self._step("", final=True))
        self._pending = {}
        reasoning = "".join(self._reasoning_text) if self.reasoning is not None else None
        content = "".join(self._content_text)
        calls: list[dict] = []
        if self.tools is not None:
            result = self.tools.result()
            if result.tool_calls:
                calls = [c.to_openai() for c in result.tool_calls]
                if not self.parallel:
                    calls = calls[:1]
                content = result.content or ""
            else:
                content = result.content or content
        message = ParsedMessage(reasoning=reasoning if reasoning is not None else None,
                                content=content or (None if calls else ""), tool_calls=calls)
        return out, message


def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        if key == "tool_calls":
            out["tool_calls"] = out.get("tool_calls", []) + value
        else:
            out[key] = out.get(key, "") + value
    return out


def parse_full_text(text: str, *, reasoning: bool, tool_format: str | None,
                    forced_prefix: str = "", parallel_tool_calls: bool = True) -> ParsedMessage:
    """Non-streaming parse of a whole output (strict: malformed tool text is content)."""
    text = forced_prefix + text
    thought = None
    if reasoning:
        thought, text = ReasoningParser().extract(text)
        thought, text = thought or "", text or ""
    calls: list[dict] = []
    if tool_format:
        result = _PARSERS[normalize_format(tool_format)]().extract(text)
        if result.tool_calls:
            calls = [c.to_openai() for c in result.tool_calls]
            if not parallel_tool_calls:
                calls = calls[:1]
            text = result.content or ""
    return ParsedMessage(reasoning=thought, content=text or (None if calls else ""),
                         tool_calls=calls)
