"""DeepSeek-V3/R1 special token strings, spelled exactly as the official tokenizers spell them.

The "bars" are U+FF5C FULLWIDTH VERTICAL LINE (``｜``) and the word separators are U+2581
LOWER ONE EIGHTH BLOCK (``▁``), never ASCII ``|`` and ``_``: a template or parser that uses
ASCII silently turns control tokens into ordinary text.

Roles in the tiny tokenizer (server.testing.tiny_tokenizer) mirror the real vocabulary:
BOS, EOS and PAD are "special" (dropped by ``decode(skip_special_tokens=True)``); the turn,
reasoning and tool markers are added tokens that are *not* special, so they survive decoding
and the reasoning / tool-call parsers can see them in the generated text.
"""
from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"

USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

THINK_START = "<think>"
THINK_END = "</think>"

TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"

# Fill-in-the-middle markers exist in the real vocabulary; kept so tokenizers built from this
# list reserve them too.
FIM_HOLE = "<｜fim▁hole｜>"
FIM_BEGIN = "<｜fim▁begin｜>"
FIM_END = "<｜fim▁end｜>"

# Tokens dropped by decode(skip_special_tokens=True).
CONTROL_SPECIAL_TOKENS: list[str] = [BOS, EOS, PAD]

# Markers that stay visible in decoded text (parsers rely on them).
MARKER_TOKENS: list[str] = [
    USER,
    ASSISTANT,
    THINK_START,
    THINK_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    FIM_HOLE,
    FIM_BEGIN,
    FIM_END,
]

# Everything a tokenizer writer must add as single, unsplittable tokens (control tokens first).
DEEPSEEK_SPECIAL_TOKENS: list[str] = CONTROL_SPECIAL_TOKENS + MARKER_TOKENS


def placeholder_token(i: int) -> str:
    """Name of the i-th vocabulary filler token (the real tokenizer has the same family)."""
    return f"<｜place▁holder▁no▁{i}｜>"
