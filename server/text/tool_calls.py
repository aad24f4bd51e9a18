"""DeepSeek tool-call extraction from generated text, full and streaming.

Two formats (the DeepSeek-V3 and V3.1 chat templates):

* DeepSeek-V3 / R1 (``DeepSeekV3ToolParser``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    \\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

* DeepSeek-V3.1 (``DeepSeekV31ToolParser``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the section is content; so is text after ``<｜tool▁calls▁end｜>``. A section may
also open directly with ``<｜tool▁call▁begin｜>``. Whitespace between calls is ignored; a
missing ``<｜tool▁calls▁end｜>`` at the end of the output is tolerated.

One state machine serves both uses: ``extract`` feeds the whole text to a stream at once, so
streaming in any chunking gives the same calls and content as full parsing. ``extract`` is
strict: if the section is malformed, a call is unfinished, or any ARGS is not valid JSON, the
whole text comes back as content with no calls (never an exception). A stream cannot take back
deltas already sent: if the structure breaks before any call was announced, the held text is
sent as content; if it breaks later, the rest is sent as content and ``result()`` reports the
strict verdict.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from server.text.special_tokens import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

_SECTION_OPENERS = (TOOL_CALLS_BEGIN, TOOL_CALL_BEGIN)
_MAX_HEADER_CHARS = 512  # a header longer than this is not a tool call
_NEED_MORE = "need_more"
_BAD = "bad"


def make_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One parsed call; ``arguments`` is the JSON text exactly as the model wrote it."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass
class ToolStreamDelta:
    """What one ``feed`` produced: plain content, and OpenAI-style tool-call deltas keyed by index."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Longest proper suffix of ``text`` that is a prefix of one of ``markers``."""
    longest = max(len(m) for m in markers) - 1
    for n in range(min(len(text), longest), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


def _plain(s: str) -> bool:
    """A name/type field: no newline, no marker."""
    return "\n" not in s and "<｜" not in s


class ToolCallStream:
    """Streaming extractor for one generation; create with ``parser.stream()``."""

    _CONTENT, _SECTION, _HEADER, _ARGS, _AFTER, _RAW = range(6)

    def __init__(self, parser: "_DeepSeekToolParserBase") -> None:
        self._p = parser
        self._state = self._CONTENT
        self._buf = ""
        self._section_raw = ""       # text since the section opened (sent as content if it breaks early)
        self._calls: list[ToolCall] = []
        self._call_done: list[bool] = []
        self._content: list[str] = []
        self.malformed = False

    # ----------------------------------------------------------------- public
    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._calls

    def feed(self, delta: str) -> ToolStreamDelta:
        out = ToolStreamDelta()
        if delta:
            self._buf += delta
            if self._state not in (self._CONTENT, self._AFTER, self._RAW):
                self._section_raw += delta
            self._run(out, final=False)
        return self._merge(out)

    def finish(self) -> ToolStreamDelta:
        """End of output: release held-back text."""
        out = ToolStreamDelta()
        self._run(out, final=True)
        if self._state in (self._CONTENT, self._AFTER, self._RAW):
            self._emit_content(out, self._buf)
        elif self._state == self._ARGS:
            self._emit_args(out, self._buf)  # truncated call: pass on what was generated
            self.malformed = True
        elif not self._calls:
            self._emit_content(out, self._section_raw)  # opened a section, never made a call
            self.malformed = True
        elif self._state == self._HEADER:
            self._emit_content(out, self._buf)
            self.malformed = True
        elif self._buf.strip():
            self._emit_content(out, self._buf)
            self.malformed = True
        self._buf = ""
        return self._merge(out)

    def result(self) -> ExtractedToolCalls:
        """Strict verdict over everything fed (call after ``finish``)."""
        ok = bool(self._calls) and not self.malformed and all(self._call_done)
        if ok:
            for call in self._calls:
                try:
                    json.loads(call.arguments)
                except ValueError:
                    ok = False
                    break
        if not ok:
            return ExtractedToolCalls(content=self._p.last_text if self._p.last_text is not None
                                      else "".join(self._content) or None, tool_calls=[])
        content = "".join(self._content)
        return ExtractedToolCalls(content=content if content.strip() else None, tool_calls=list(self._calls))

    # ----------------------------------------------------------------- machine
    def _run(self, out: ToolStreamDelta, final: bool) -> None:
        while True:
            before = (self._state, len(self._buf))
            if self._state in (self._AFTER, self._RAW):
                self._emit_content(out, self._buf)
                self._buf = ""
                return
            if self._state == self._CONTENT:
                self._step_content(out, final)
            elif self._state == self._SECTION:
                self._step_section(out, final)
            elif self._state == self._HEADER:
                self._step_header(out, final)
            elif self._state == self._ARGS:
                self._step_args(out, final)
            if (self._state, len(self._buf)) == before:
                return

    def _step_content(self, out: ToolStreamDelta, final: bool) -> None:
        hits = [(i, m) for m in _SECTION_OPENERS if (i := self._buf.find(m)) >= 0]
        if hits:
            idx, marker = min(hits)
            self._emit_content(out, self._buf[:idx])
            self._section_raw = self._buf[idx:]
            # <｜tool▁calls▁begin｜> is consumed; a bare <｜tool▁call▁begin｜> stays for _step_section.
            self._buf = self._buf[idx + len(TOOL_CALLS_BEGIN):] if marker == TOOL_CALLS_BEGIN else self._buf[idx:]
            self._state = self._SECTION
            return
        keep = 0 if final else _held_suffix(self._buf, _SECTION_OPENERS)
        self._emit_content(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _step_section(self, out: ToolStreamDelta, final: bool) -> None:
        body = self._buf.lstrip()
        if body.startswith(TOOL_CALL_BEGIN):
            self._buf = body[len(TOOL_CALL_BEGIN):]
            self._state = self._HEADER
        elif body.startswith(TOOL_CALLS_END):
            self._buf = body[len(TOOL_CALLS_END):]
            self._state = self._AFTER
        elif not body or TOOL_CALL_BEGIN.startswith(body) or TOOL_CALLS_END.startswith(body):
            self._buf = body
        else:
            self._break(out)

    def _step_header(self, out: ToolStreamDelta, final: bool) -> None:
        status = self._p.parse_header(self._buf)
        if status == _NEED_MORE:
            if len(self._buf) > _MAX_HEADER_CHARS:
                self._break(out)
            return
        if status == _BAD:
            self._break(out)
            return
        name, consumed = status
        index = len(self._calls)
        self._calls.append(ToolCall(id=make_tool_call_id(), name=name, arguments=""))
        self._call_done.append(False)
        out.tool_calls.append({"index": index, "id": self._calls[-1].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
        self._buf = self._buf[consumed:]
        self._state = self._ARGS

    def _step_args(self, out: ToolStreamDelta, final: bool) -> None:
        hits = [(i, -len(e)) for e in self._p.args_ends if (i := self._buf.find(e)) >= 0]
        if hits:
            idx, neg_len = min(hits)  # earliest end; at a tie the longer spelling
            self._emit_args(out, self._buf[:idx])
            self._call_done[-1] = True
            self._buf = self._buf[idx - neg_len:]
            self._state = self._SECTION
            return
        if final:
            return  # finish() decides what to do with an unterminated call
        keep = _held_suffix(self._buf, self._p.args_ends)
        self._emit_args(out, self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _break(self, out: ToolStreamDelta) -> None:
        """Malformed section: from here on everything is content."""
        self.malformed = True
        self._emit_content(out, self._section_raw if not self._calls else self._buf)
        self._buf = ""
        self._state = self._RAW

    # ----------------------------------------------------------------- output
    def _emit_content(self, out: ToolStreamDelta, text: str) -> None:
        if text:
            out.content += text
            self._content.append(text)

    def _emit_args(self, out: ToolStreamDelta, text: str) -> None:
        if not text:
            return
        self._calls[-1].arguments += text
        out.tool_calls.append({"index": len(self._calls) - 1, "function": {"arguments": text}})

    @staticmethod
    def _merge(out: ToolStreamDelta) -> ToolStreamDelta:
        """One delta per call index per feed (first one keeps id/type/name)."""
        merged: dict[int, dict[str, Any]] = {}
        for d in out.tool_calls:
            cur = merged.get(d["index"])
            if cur is None:
                merged[d["index"]] = {**d, "function": dict(d["function"])}
            else:
                cur["function"]["arguments"] = cur["function"].get("arguments", "") + d["function"]["arguments"]
        out.tool_calls = [merged[i] for i in sorted(merged)]
        return out


class _DeepSeekToolParserBase:
    """Shared full-text / streaming entry points; subclasses define the call header and end."""

    args_ends: tuple[str, ...] = (TOOL_CALL_END,)

    def __init__(self) -> None:
        self.last_text: str | None = None  # set only during extract(), for the strict fallback

    def parse_header(self, buf: str) -> tuple[str, int] | str:
        """``(name, chars consumed)`` once the header after ``<｜tool▁call▁begin｜>`` is complete."""
        raise NotImplementedError

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def extract(self, text: str) -> ExtractedToolCalls:
        """Full output -> content and calls; malformed tool text comes back as content."""
        if TOOL_CALLS_BEGIN not in text and TOOL_CALL_BEGIN not in text:
            return ExtractedToolCalls(content=text or None, tool_calls=[])
        parser = type(self)()
        parser.last_text = text
        stream = parser.stream()
        stream.feed(text)
        stream.finish()
        return stream.result()


def _name_then_sep(buf: str) -> tuple[str, int] | str:
    """``NAME<｜tool▁sep｜>`` -> (name, end of sep)."""
    sep = buf.find(TOOL_SEP)
    if sep < 0:
        head = buf[: len(buf) - _held_suffix(buf, (TOOL_SEP,))]
        return _NEED_MORE if _plain(head) else _BAD
    name = buf[:sep].strip()
    if not name or not _plain(name):
        return _BAD
    return name, sep + len(TOOL_SEP)


class DeepSeekV3ToolParser(_DeepSeekToolParserBase):
    """``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`` (DeepSeek-V3 / R1)."""

    # The fence's newline is optional in practice; the arguments never include the fence.
    args_ends = ("\n```" + TOOL_CALL_END, "```" + TOOL_CALL_END)
    _FENCE = "```json\n"

    def parse_header(self, buf: str) -> tuple[str, int] | str:
        first = _name_then_sep(buf)  # the "name" here is the call type, e.g. "function"
        if not isinstance(first, tuple):
            return first
        _, pos = first
        nl = buf.find("\n", pos)
        if nl < 0:
            return _NEED_MORE if _plain(buf[pos:]) else _BAD
        name = buf[pos:nl].strip()
        if not name or not _plain(name):
            return _BAD
        after = buf[nl + 1:]
        if after.startswith(self._FENCE):
            return name, nl + 1 + len(self._FENCE)
        return _NEED_MORE if self._FENCE.startswith(after) else _BAD


class DeepSeekV31ToolParser(_DeepSeekToolParserBase):
    """``NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`` (DeepSeek-V3.1)."""

    args_ends = (TOOL_CALL_END,)

    def parse_header(self, buf: str) -> tuple[str, int] | str:
        return _name_then_sep(buf)


TOOL_PARSERS: dict[str, type[_DeepSeekToolParserBase]] = {
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseekv3": DeepSeekV3ToolParser,
    "deepseek_v2": DeepSeekV3ToolParser,
    "deepseekv2": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "deepseekv31": DeepSeekV31ToolParser,
}
