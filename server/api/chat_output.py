"""Turn generated text into chat deltas: reasoning, content and tool calls.

One object per choice, fed the text delta of every engine output.  It keeps the whole
text so far and re-derives what is visible, so every delta it returns is a suffix of
what a full-text parse would give; ``finish`` flushes the rest and decides whether the
tool-call text was well formed.

Stages of the generated text (``R`` = reasoning on, ``T`` = tool calls parsed):
    [R: reasoning ... </think>] content [T: <｜tool▁calls▁begin｜> calls ... <｜tool▁calls▁end｜>]
Tool-call text that does not parse comes back as content (never an error); a missing
``</think>`` means everything is reasoning, as DeepSeek-R1's parser does.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.api.tool_text import ToolCallText
from server.text.special_tokens import THINK_END, THINK_START, TOOL_CALLS_BEGIN


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[dict] = field(default_factory=list)


class ChatOutputParser:
    def __init__(self, *, reasoning: bool, tool_format: str | None,
                 forced_prefix: str = "", parallel_tool_calls: bool = True) -> None:
        """``tool_format``: None (tools off), "deepseek_v3" or "deepseek_v31".

        ``forced_prefix`` is generated-text the server placed at the end of the prompt
        (a forced tool-call opening for ``tool_choice`` required/named); the model's
        output continues it, so the parser sees prefix + output.
        """
        self.reasoning_on = reasoning
        self.tools = ToolCallText(tool_format) if tool_format else None
        self.parallel = parallel_tool_calls
        self.text = forced_prefix
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_calls: list[tuple[str, int]] = []   # (id, argument chars sent) per call

    # -- splitting -------------------------------------------------------------------
    def _split(self, final: bool) -> tuple[str, str, str]:
        """(reasoning, content, tool text) of the text so far."""
        text = self.text
        reasoning = ""
        if self.reasoning_on:
            if text.startswith(THINK_START):
                text = text[len(THINK_START):]
            head, sep, rest = text.partition(THINK_END)
            if not sep:
                # Hold back a partial "</think>" only while streaming.
                return head if final else _hold_back(head, THINK_END), "", ""
            reasoning, text = head, rest
        if self.tools is not None:
            content, sep, tool_text = text.partition(TOOL_CALLS_BEGIN)
            if sep:
                return reasoning, content, sep + tool_text
            return reasoning, content if final else _hold_back(content, TOOL_CALLS_BEGIN), ""
        return reasoning, text, ""

    # -- streaming -------------------------------------------------------------------
    def feed(self, delta: str) -> dict:
        """Add generated text; returns a (possibly empty) delta message."""
        self.text += delta
        return self._delta(final=False)

    def _delta(self, final: bool) -> dict:
        reasoning, content, tool_text = self._split(final)
        out: dict = {}
        if len(reasoning) > self._sent_reasoning:
            out["reasoning_content"] = reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(reasoning)
        if len(content) > self._sent_content:
            out["content"] = content[self._sent_content:]
            self._sent_content = len(content)
        if tool_text:
            calls = self.tools.parse_partial(tool_text)
            deltas = self._tool_deltas(calls)
            if deltas:
                out["tool_calls"] = deltas
        return out

    def _tool_deltas(self, calls: list[tuple[str, str | None]]) -> list[dict]:
        deltas = []
        for index, (name, args) in enumerate(calls):
            if not self.parallel and index > 0:
                break
            if index >= len(self._sent_calls):
                call_id = tool_call_id()
                self._sent_calls.append((call_id, 0))
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            call_id, sent = self._sent_calls[index]
            if args is not None and len(args) > sent:
                deltas.append({"index": index, "function": {"arguments": args[sent:]}})
                self._sent_calls[index] = (call_id, len(args))
        return deltas

    def finish(self) -> tuple[dict, ParsedMessage]:
        """Flush what is left; returns (last delta, full parse of the whole text)."""
        last = self._delta(final=True)
        message = self.parse_full()
        if self.tools is not None and not message.tool_calls and self._sent_calls:
            # Streamed tool deltas turned out malformed: give the raw text back as content.
            last.pop("tool_calls", None)
        elif message.tool_calls and self._sent_calls:
            # Make sure the streamed arguments add up to the final ones.
            extra = []
            for index, call in enumerate(message.tool_calls):
                if index < len(self._sent_calls):
                    call["id"] = self._sent_calls[index][0]
                    sent = self._sent_calls[index][1]
                    args = call["function"]["arguments"]
                    if len(args) > sent:
                        extra.append({"index": index, "function": {"arguments": args[sent:]}})
            if extra:
                last.setdefault("tool_calls", []).extend(extra)
        if self.tools is not None and not message.tool_calls:
            _, content, tool_text = self._split(final=True)
            if tool_text:   # malformed calls: unsent raw text becomes content
                last["content"] = last.get("content", "") + tool_text
        return last, message

    # -- whole text --------------------------------------------------------------------
    def parse_full(self) -> ParsedMessage:
        reasoning, content, tool_text = self._split(final=True)
        calls: list[dict] = []
        if tool_text:
            parsed = self.tools.parse_full(tool_text)
            if parsed is None:
                content += tool_text            # malformed: return the text as content
            else:
                if not self.parallel:
                    parsed = parsed[:1]
                calls = [{"id": tool_call_id(), "type": "function",
                          "function": {"name": n, "arguments": a}} for n, a in parsed]
        return ParsedMessage(reasoning=reasoning if self.reasoning_on else None,
                             content=content if (content or not calls) else None,
                             tool_calls=calls)


def _hold_back(text: str, marker: str) -> str:
    """Drop a trailing partial ``marker`` so it is not streamed as text by mistake."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text
