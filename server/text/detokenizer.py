"""Incremental detokenization: text deltas for a growing token sequence, never broken UTF-8.

Two things make "decode the new token on its own" wrong:

* byte-level BPE and byte-fallback tokens split one character (CJK, emoji) across several
  tokens; a partial character decodes to U+FFFD (byte fallback: one per byte);
* decoders look at a token's position: Metaspace (SentencePiece) and ``Strip`` drop the
  leading space of the *first* token decoded, ByteLevel merges bytes across tokens.

So each step decodes a short window of recent tokens, and the text of the window's left
part is always *decoded*, never derived from an earlier, longer decode: with Metaspace,
decode(["▁Hi", "▁set"]) is "Hi set" but decode(["▁set"]) is "set", not " set", so "the
text of the last token is the longer decode minus the shorter one" drops and duplicates
characters once the window slides.

This is the scheme of ``tokenizers.decoders.DecodeStream`` (``step_decode_stream`` in the
tokenizers crate). The window is ``ids``:

* ``ids[:read]``: tokens whose text is already emitted (left context), their decode is
  ``prefix``;
* ``ids[read:]``: tokens whose text is not emitted yet.

A step appends the new ids and decodes the window. If the text is no longer than
``prefix`` (a skipped special token) or ends with U+FFFD (possibly an unfinished
character), everything is held. Otherwise the delta is the text after ``prefix``, and the
window slides: the tokens just emitted become the left context and ``prefix`` is their
own decode. Per-token cost is two decodes of a few tokens, not of the whole sequence.

When the tokenizer exposes a ``tokenizers.Tokenizer`` (``backend_tokenizer``, as ours and
transformers' fast tokenizers do) and the installed tokenizers has DecodeStream with
prefill and chunked steps, DecodeStream does the steps in Rust (several times faster per
token than two decode calls from Python). The window is mirrored here either way, because
DecodeStream offers no ``flush`` (a genuinely unfinished character at the end must still
come out) and raises "Invalid prefix" where a decoder rewrites text already out; from
then on the request continues on the Python path from the mirrored window.

Worked example (Metaspace, prompt context ["▁Hi"]):
  step("▁set")  window ["▁Hi", "▁set"]  -> "Hi set", prefix "Hi"  -> emit " set";
                slide: window ["▁set"], prefix = decode(["▁set"]) = "set"
  step("ting")  window ["▁set", "ting"] -> "setting"               -> emit "ting".
Byte-level "你" = E4 BD A0 split as tokens [E4 BD] [A0]:
  step([E4 BD]) -> window text ends with "\\ufffd" -> emit "" (hold)
  step([A0])    -> window text ends with "你"      -> emit "你", slide.
"""
from __future__ import annotations

from typing import Any, Iterable, Protocol

from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT = "\ufffd"
# Tokens of left context kept from the prompt (as vLLM does), so the first generated token
# is decoded in the middle of a window, as in a full decode of prompt + output.
_PROMPT_CONTEXT = 5
# Longest prompt suffix tried when the short one cuts a character (see _prompt_context).
_MAX_PROMPT_CONTEXT = 24


def _decode_stream_class() -> Any:
    """tokenizers' DecodeStream if it takes prefill ids and lists of ids, else None.

    Both came in tokenizers releases later than DecodeStream itself; with an older one
    every request takes the Python path, which gives the same text.
    """
    try:
        from tokenizers import models
        from tokenizers.decoders import DecodeStream
        probe = _HFTokenizer(models.WordLevel({"a": 0}, unk_token="a"))
        DecodeStream(ids=[0], skip_special_tokens=True).step(probe, [0, 0])
    except Exception:  # ImportError, TypeError: an older tokenizers
        return None
    return DecodeStream


_DecodeStream = _decode_stream_class()


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` that decodes for ``tokenizer``, or None."""
    if isinstance(tokenizer, _HFTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, _HFTokenizer) else None


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one ``step`` per engine output."""

    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context, prefix = self._prompt_context(list(prompt_ids or []))
        self._ids: list[int] = context      # the window; older tokens are not kept
        self._read = len(context)           # ids[:read] are emitted; their decode is prefix
        self._prefix: str | None = prefix   # None while DecodeStream holds it
        self._backend = _backend(tokenizer) if _DecodeStream is not None else None
        self._stream = (_DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
                        if self._backend is not None else None)
        self._pieces: list[str] = []        # the deltas (joined on demand: no quadratic +=)
        self.num_tokens = 0                 # generated tokens seen

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def _prompt_context(self, prompt: list[int]) -> tuple[list[int], str]:
        """The prompt's last tokens as left context, and their decode.

        The shortest suffix of at least ``_PROMPT_CONTEXT`` tokens that decodes without
        U+FFFD: a suffix that starts inside a character reads as U+FFFD there, and byte
        fallback turns a whole run of byte tokens into U+FFFD when any of it is cut, which
        would hide whether the prompt itself ends cleanly.
        """
        if not prompt:
            return [], ""
        shortest = min(_PROMPT_CONTEXT, len(prompt))
        for n in range(shortest, min(len(prompt), _MAX_PROMPT_CONTEXT) + 1):
            text = self._decode(prompt[-n:])
            if _REPLACEMENT not in text:
                return prompt[-n:], text
        context = prompt[-shortest:]
        text = self._decode(context)
        if text.endswith(_REPLACEMENT):
            # The prompt ends inside a character (token-id prompts can): generated text is
            # decoded on its own, as a full decode of the output would be.
            return [], ""
        return context, text

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _slide(self) -> None:
        """The tokens just emitted become the window's left context."""
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix = None if self._stream is not None else self._decode(self._ids)

    def _window_delta(self, final: bool) -> str:
        """Python path: the window's new text, or "" while it is held.

        ``text`` normally extends ``prefix``. Byte fallback can rewrite text that is already
        out: one invalid byte turns its whole run of byte tokens into U+FFFD, valid
        characters before it included (DecodeStream raises "Invalid prefix" there). That
        cannot be retracted; what lies past the prefix's length is emitted and the stream
        goes on.
        """
        if self._prefix is None:
            self._prefix = self._decode(self._ids[:self._read])
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix) or (text.endswith(_REPLACEMENT) and not final):
            return ""   # nothing visible yet, or possibly an unfinished character: hold
        return text[len(self._prefix):]

    def step(self, new_ids: int | Iterable[int]) -> str:
        """Add generated ids (one or several, e.g. accepted MTP drafts); return the new text."""
        if isinstance(new_ids, int):
            self._ids.append(new_ids)
            self.num_tokens += 1
        else:
            new_ids = list(new_ids)
            if not new_ids:
                return ""
            self._ids.extend(new_ids)
            self.num_tokens += len(new_ids)
            if len(new_ids) == 1:
                new_ids = new_ids[0]   # DecodeStream converts an int faster than a list
        if self._stream is not None:
            try:
                delta = self._stream.step(self._backend, new_ids) or ""
            except Exception:   # "Invalid prefix": continue on the Python path
                self._stream = None
                delta = self._window_delta(final=False)
        else:
            delta = self._window_delta(final=False)
        if delta:
            self._slide()
            self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of generation: emit held-back text, even a genuine trailing U+FFFD."""
        if len(self._ids) == self._read:
            return ""
        delta = self._window_delta(final=True)
        self._stream = None     # the stream's window no longer matches; steps go on in Python
        self._slide()
        self._pieces.append(delta)
        return delta
