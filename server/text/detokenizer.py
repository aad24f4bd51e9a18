"""Incremental detokenization: text deltas for a growing token sequence, never broken UTF-8.

With byte-level BPE one character (CJK, emoji) can span several tokens; decoding a token on
its own then yields U+FFFD. The detokenizer decodes only a short window of recent tokens:

* ``prefix_offset`` .. ``read_offset``: tokens already turned into text, kept as left
  context so decoders that look at neighbours (space handling) behave as in a full decode;
* ``read_offset`` .. end: tokens whose text is not final yet.

Each step decodes ``ids[prefix_offset:]``. Text before a trailing U+FFFD is final (more bytes
can only complete the last, unfinished character), so it is emitted at once; the trailing
U+FFFD is held back until the character completes. When the window decodes cleanly, the
window slides: ``prefix_offset`` moves to ``read_offset`` and ``read_offset`` to the end.
Per-token cost is the window's size, not the sequence's.

Worked example, "你" = E4 BD A0 split as tokens [E4 BD] [A0]:
  step([E4 BD]) -> window text "\\ufffd"  -> emit "" (hold)
  step([A0])    -> window text "你"       -> emit "你", slide the window.
"""
from __future__ import annotations

from typing import Iterable, Protocol

_REPLACEMENT = "\ufffd"
# Tokens of left context kept from the prompt (as vLLM does).
_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one ``step`` per engine output."""

    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        prompt = list(prompt_ids or [])[-_PROMPT_CONTEXT:]
        prompt_text = self._decode(prompt) if prompt else ""
        if prompt_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character (token-id prompts can): generated text is
            # decoded on its own, as a full decode of the output would be.
            prompt, prompt_text = [], ""
        self._ids: list[int] = prompt              # only the window's tokens are kept
        self._prefix_offset = 0                     # index into self._ids
        self._read_offset = len(prompt)
        # Characters of decode(ids[prefix:read]) and characters of the window's text emitted so far.
        self._prefix_len = len(prompt_text)
        self._emitted = self._prefix_len
        self.output_text = ""                       # all text emitted so far
        self.num_tokens = 0                         # generated tokens seen

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Add generated ids (one or several, e.g. accepted MTP drafts); return the new text."""
        if isinstance(new_ids, int):
            new_ids = [new_ids]
        new_ids = list(new_ids)
        if not new_ids:
            return ""
        self._ids.extend(new_ids)
        self.num_tokens += len(new_ids)
        text = self._decode(self._ids[self._prefix_offset:])
        if text.endswith(_REPLACEMENT):
            # Possibly an unfinished character: everything before it is final.
            stable = len(text) - 1
            delta = text[self._emitted:stable] if stable > self._emitted else ""
            self._emitted = max(self._emitted, stable)
        else:
            delta = text[self._emitted:]
            # Slide: the text of ids[read:] becomes the new prefix context.
            new_prefix_len = len(text) - self._prefix_len
            drop = self._read_offset
            self._ids = self._ids[drop:]
            self._prefix_offset = 0
            self._read_offset = len(self._ids)
            self._prefix_len = new_prefix_len
            self._emitted = new_prefix_len
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: emit held-back text, even a genuine trailing U+FFFD."""
        text = self._decode(self._ids[self._prefix_offset:])
        delta = text[self._emitted:]
        self._emitted = len(text)
        self.output_text += delta
        return delta
