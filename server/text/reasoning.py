"""DeepSeek-R1 reasoning extraction: text up to ``</think>`` is reasoning, the rest is content.

Rules (DeepSeek-R1 / vLLM ``deepseek_r1`` / MindIE "thinking analysis"):

* A ``<think>`` at the very start of the output is dropped; it is optional because R1-style
  templates put ``<think>\\n`` in the prompt.
* Everything before the first ``</think>`` is reasoning, everything after it is content.
* No ``</think>`` at all (e.g. cut by ``max_tokens``) means the whole output is reasoning.
* Newlines right after ``</think>`` are dropped: R1 writes ``</think>\n\n`` before its
  answer as a separator, and DeepSeek's API returns the answer without it; a client that
  renders ``content`` would otherwise show two blank lines first.

``ReasoningParser.extract`` works on full text; ``ReasoningParser.stream()`` returns a
``ReasoningStream`` that takes text deltas and gives ``(reasoning_delta, content_delta)``,
holding back a tail that could be the start of a split marker, so the concatenated deltas
always equal the full-text result. ``count_reasoning_tokens`` counts by token id.
"""
from __future__ import annotations

from typing import Iterable

from server.text.special_tokens import THINK_END, THINK_START


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Streaming splitter for one generation (create with ``ReasoningParser.stream()``)."""

    def __init__(self, start: str, end: str) -> None:
        self._start, self._end = start, end
        self._buf = ""          # text not classified yet
        self._at_start = True   # a leading start marker may still come
        self._in_reasoning = True
        self._content_started = False   # newlines before the first content char are dropped

    @property
    def in_reasoning(self) -> bool:
        """True until the end marker has been seen (tool parsing waits for this)."""
        return self._in_reasoning

    def feed(self, delta: str) -> tuple[str, str]:
        """Classify ``delta``; returns ``(reasoning_delta, content_delta)`` (either may be "")."""
        if not self._in_reasoning:
            return "", self._content(delta)
        self._buf += delta
        if self._at_start:
            if self._start.startswith(self._buf):
                return "", ""  # could still become the start marker
            if self._buf.startswith(self._start):
                self._buf = self._buf[len(self._start):]
            self._at_start = False
        idx = self._buf.find(self._end)
        if idx >= 0:
            reasoning, content = self._buf[:idx], self._buf[idx + len(self._end):]
            self._buf = ""
            self._in_reasoning = False
            return reasoning, self._content(content)
        keep = _held_suffix(self._buf, self._end)
        reasoning = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return reasoning, ""

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """End of output: anything held back was reasoning after all."""
        if not self._in_reasoning:
            return "", ""
        rest = self._buf
        if self._at_start and rest == self._start:
            rest = ""
        self._buf = ""
        self._at_start = False
        return rest, ""


class ReasoningParser:
    """DeepSeek-R1 ``<think>...</think>`` splitter (full text and streaming)."""

    def __init__(self, start: str = THINK_START, end: str = THINK_END) -> None:
        self.start, self.end = start, end

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Full output -> ``(reasoning, content)``; an empty part is None."""
        if text.startswith(self.start):
            text = text[len(self.start):]
        reasoning, sep, content = text.partition(self.end)
        if not sep:
            return (text or None), None
        return (reasoning or None), (content.lstrip("\n") or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.start, self.end)


def count_reasoning_tokens(output_ids: Iterable[int], end_token_id: int) -> int:
    """Tokens spent on reasoning: everything up to and including the first ``</think>`` id.

    Without the end token the whole output counts (it was all reasoning).
    """
    n = 0
    for tid in output_ids:
        n += 1
        if tid == end_token_id:
            return n
    return n


class ReasoningTokenCounter:
    """Incremental ``count_reasoning_tokens`` for streams (feed ids as they are generated)."""

    def __init__(self, end_token_id: int) -> None:
        self.end_token_id = end_token_id
        self.count = 0
        self.done = False

    def feed(self, ids: Iterable[int]) -> int:
        for tid in ids:
            if self.done:
                break
            self.count += 1
            if tid == self.end_token_id:
                self.done = True
        return self.count
