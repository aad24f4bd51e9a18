"""DeepSeek tool-call text, read while it streams and once it is complete.

Formats (one call; several calls are separated by "\\n" in V3):
  deepseek_v3:  <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
  deepseek_v31: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
all inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>.  The markers are single tokens,
so a streamed delta never ends inside one; only the V3 closing fence "\\n```" can arrive
in pieces, which is why partial arguments drop trailing newlines and backticks.
"""
from __future__ import annotations

import json

from server.text.special_tokens import (TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN,
                                        TOOL_CALLS_END, TOOL_SEP)

FORMATS = ("deepseek_v3", "deepseek_v31")
_FENCE_OPEN = "```json\n"
_FENCE_CLOSE = "\n```"


def normalize_format(name: str | None) -> str:
    """MindIE parser names (deepseekv3, deepseek_v2, ...) -> one of FORMATS."""
    key = (name or "deepseek_v3").lower().replace("_", "").replace("-", "")
    return "deepseek_v31" if key in ("deepseekv31", "deepseekv32") else "deepseek_v3"


def forced_opening(fmt: str, name: str | None) -> str:
    """Generated-text prefix that forces a call (``name`` None: any function)."""
    if fmt == "deepseek_v31":
        head = TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN
        return head if name is None else head + name + TOOL_SEP
    head = TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP
    return head if name is None else head + name + "\n" + _FENCE_OPEN


class ToolCallText:
    def __init__(self, fmt: str) -> None:
        self.fmt = normalize_format(fmt)

    def _calls(self, tool_text: str) -> list[str]:
        body = tool_text[len(TOOL_CALLS_BEGIN):] if tool_text.startswith(TOOL_CALLS_BEGIN) else tool_text
        body = body.split(TOOL_CALLS_END, 1)[0]
        return body.split(TOOL_CALL_BEGIN)[1:]

    def _name_and_rest(self, part: str) -> tuple[str, str] | None:
        """(name, text after the name and its separator), or None while the name is incomplete."""
        if self.fmt == "deepseek_v31":
            name, sep, rest = part.partition(TOOL_SEP)
            return (name.strip(), rest) if sep else None
        _type, sep, rest = part.partition(TOOL_SEP)
        if not sep:
            return None
        name, nl, rest = rest.partition("\n")
        return (name.strip(), rest) if nl else None

    def parse_partial(self, tool_text: str) -> list[tuple[str, str | None]]:
        """Calls whose name is known, with the argument text visible so far (None: not yet)."""
        calls: list[tuple[str, str | None]] = []
        for part in self._calls(tool_text):
            got = self._name_and_rest(part)
            if got is None or not got[0]:
                break
            name, rest = got
            args, closed, _ = rest.partition(TOOL_CALL_END)
            if self.fmt == "deepseek_v3":
                if not args.startswith(_FENCE_OPEN):
                    calls.append((name, None))
                    if not closed:
                        break
                    continue
                args = args[len(_FENCE_OPEN):]
                args = args.removesuffix(_FENCE_CLOSE) if closed else args.rstrip("\n`")
            calls.append((name, args.strip() if closed else args.lstrip()))
            if not closed:
                break
        return calls

    def parse_full(self, tool_text: str) -> list[tuple[str, str]] | None:
        """All calls with JSON-checked arguments, or None when the text is malformed."""
        parts = self._calls(tool_text)
        if not parts:
            return None
        calls = []
        for part in parts:
            got = self._name_and_rest(part)
            if got is None or not got[0] or TOOL_CALL_END not in got[1]:
                return None
            name, rest = got
            args = rest.split(TOOL_CALL_END, 1)[0]
            if self.fmt == "deepseek_v3":
                if not args.startswith(_FENCE_OPEN) or not args.rstrip().endswith("```"):
                    return None
                args = args[len(_FENCE_OPEN):].rstrip().removesuffix("```")
            args = args.strip()
            try:
                if not isinstance(json.loads(args), dict):
                    return None
            except ValueError:
                return None
            calls.append((name, args))
        return calls
