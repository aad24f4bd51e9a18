"""Turn generated text into chat deltas: reasoning, content and tool calls.

One object per choice.  The generated text first goes through the reasoning splitter
(when thinking is on), and what comes out as content goes through the tool-call stream
(when tools are on); both come from ``server.text`` and hold back partial markers, so
the deltas always add up to the full-text parse.  Tool-call text that does not parse
comes back as content, never as an error.

``forced_prefix`` is text the server appended to the prompt (``</think>`` when a
grammar constrains the answer of a thinking model): the model continues it, so the
parser reads prefix + output, and whatever the prefix produces goes out with the first
real delta.  ``allowed_names``: a parsed call to a function that was not offered is
dropped, in the full parse and in the stream (later calls are renumbered).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from server.text.reasoning import ReasoningParser
from server.text.tool_calls import DeepSeekV3ToolParser, DeepSeekV31ToolParser

_PARSERS = {"deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser}


def normalize_format(name: str | None) -> str:
    """MindIE parser names (deepseekv3, deepseek_v2, deepseekv31, ...) -> a parser key."""
    key = (name or "deepseek_v3").lower().replace("_", "").replace("-", "")
    return "deepseek_v31" if key in ("deepseekv31", "deepseekv32") else "deepseek_v3"


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class ChatOutputParser:
    def __init__(self, *, reasoning: bool, tool_format: str | None,
                 forced_prefix: str = "", parallel_tool_calls: bool = True,
                 allowed_names: frozenset[str] | None = None) -> None:
        self.reasoning = ReasoningParser().stream() if reasoning else None
        self.tools = _PARSERS[normalize_format(tool_format)]().stream() if tool_format else None
        self.parallel = parallel_tool_calls
        self.allowed = allowed_names
        self._index: dict[int, int | None] = {}     # parser's call index -> ours (None: dropped)
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
            calls = [tc for tc in (self._renumber(tc) for p in parts for tc in p.tool_calls)
                     if tc is not None and (self.parallel or tc.get("index", 0) == 0)]
            if calls:
                out["tool_calls"] = calls
        else:
            content = c
        if content:
            out["content"] = content
            self._content_text.append(content)
        return out

    def _renumber(self, tc: dict) -> dict | None:
        """A streamed call delta with its index among the offered-name calls; None for a
        call whose name was not offered (its deltas are dropped)."""
        i = tc.get("index", 0)
        if i not in self._index:
            name = (tc.get("function") or {}).get("name")
            ok = self.allowed is None or name in self.allowed
            kept = sum(v is not None for v in self._index.values())
            self._index[i] = kept if ok else None
        j = self._index[i]
        return None if j is None else {**tc, "index": j}

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
                calls = _offered([c.to_openai() for c in result.tool_calls], self.allowed)
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


def _offered(calls: list[dict], allowed: frozenset[str] | None) -> list[dict]:
    """Calls whose name was offered (a call to an unknown function is dropped: its markup
    is not shown as content either)."""
    if allowed is None:
        return calls
    return [c for c in calls if c["function"]["name"] in allowed]


def parse_full_text(text: str, *, reasoning: bool, tool_format: str | None,
                    forced_prefix: str = "", parallel_tool_calls: bool = True,
                    allowed_names: frozenset[str] | None = None) -> ParsedMessage:
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
            calls = _offered([c.to_openai() for c in result.tool_calls], allowed_names)
            if not parallel_tool_calls:
                calls = calls[:1]
            text = result.content or ""
    return ParsedMessage(reasoning=thought, content=text or (None if calls else ""),
                         tool_calls=calls)
