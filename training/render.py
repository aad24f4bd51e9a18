"""Chats -> text with the project's DeepSeek-V3 chat template, and the BPE tokenizer.

The template (server/text/templates/deepseek_v3.jinja) drops reasoning from assistant turns
it renders, so the last assistant turn is rendered as the model would write it after the
generation prompt: ``REASONING</think>\\n\\nANSWER<｜end▁of▁sentence｜>`` when thinking is on
(the prompt already ends with ``<think>\\n``), ``ANSWER<｜end▁of▁sentence｜>`` otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from server.text import special_tokens as st
from server.text.chat_template import DEEPSEEK_V3_CHAT_TEMPLATE, render_chat_template

from .corpus import Chat

SPECIAL_VARS = {"bos_token": st.BOS, "eos_token": st.EOS, "pad_token": st.PAD}


def render_prompt(messages: list[dict[str, Any]], tools: list[dict] | None, thinking: bool) -> str:
    """The text the daemon would feed the model for this conversation (generation prompt on)."""
    return render_chat_template(DEEPSEEK_V3_CHAT_TEMPLATE, messages, tools=tools, add_generation_prompt=True,
                                special_tokens=SPECIAL_VARS, thinking=thinking)


def render_completion(msg: dict[str, Any], thinking: bool) -> str:
    """What the model writes for the final assistant turn ``msg``."""
    out = ""
    if thinking:
        out += f"{msg.get('reasoning_content', '')}{st.THINK_END}\n\n"
    out += msg.get("content") or ""
    if msg.get("tool_calls"):
        blocks = [f"{st.TOOL_CALL_BEGIN}function{st.TOOL_SEP}{c['function']['name']}\n```json\n"
                  f"{c['function']['arguments']}\n```{st.TOOL_CALL_END}" for c in msg["tool_calls"]]
        out += st.TOOL_CALLS_BEGIN + "\n".join(blocks) + st.TOOL_CALLS_END
    return out + st.EOS


def render_chat(chat: Chat) -> str:
    """Full training text: template-rendered context + the final assistant completion."""
    return render_prompt(chat.messages[:-1], chat.tools, chat.thinking) + render_completion(chat.messages[-1], chat.thinking)


def render_eval_prompt(chat: Chat) -> str:
    """Context up to (not including) the first assistant turn the model must write."""
    if chat.kind == "tool":
        first = next(i for i, m in enumerate(chat.messages) if m.get("tool_calls"))
    else:
        first = len(chat.messages) - 1
    return render_prompt(chat.messages[:first], chat.tools, chat.thinking)


def prose_text(doc: str) -> str:
    return st.BOS + doc + st.EOS


# --------------------------------------------------------------------------------------
# Tokenizer

NAME_SPLIT = r" (?=\p{Lu})"      # a space before a capital letter is a piece of its own
# Each letter of a capitalised word is a piece of its own: a capital, then (\G: right where the
# last match ended) each lowercase letter glued to it. Lowercase words are untouched.
SPELL_NAMES = r"\p{Lu}|(?<=\p{L})\G\p{Ll}"


def _pre_tokenizer(name_split: bool, spell_names: bool = False):
    from tokenizers import Regex, pre_tokenizers

    rules = [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")]
    if name_split:
        rules.append(pre_tokenizers.Split(Regex(NAME_SPLIT), behavior="isolated"))
    if spell_names:
        rules.append(pre_tokenizers.Split(Regex(SPELL_NAMES), behavior="isolated"))
    rules.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    return pre_tokenizers.Sequence(rules)


def train_tokenizer(texts: Iterable[str], vocab_size: int, name_split: bool = False, spell_names: bool = False):
    """Byte-level BPE with DeepSeek's special tokens as single, unsplittable entries.

    Digits are split one per token (as small models learn arithmetic better that way). With
    ``name_split`` the space before a capital letter is a piece of its own (see with_name_split)
    from the start, so the vocabulary is learnt on those pieces. With ``spell_names`` a
    capitalised word is spelt one letter a piece (see has_spelt_names).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer(name_split, spell_names)
    tok.decoder = decoders.ByteLevel()
    specials = list(st.DEEPSEEK_SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # Mark which added tokens are "special" (skipped on decode): only BOS/EOS/PAD, like the real
    # DeepSeek tokenizer; markers stay visible so reasoning / tool parsers can see them.
    data = json.loads(tok.to_str())
    for t in data["added_tokens"]:
        t["special"] = t["content"] in st.CONTROL_SPECIAL_TOKENS
        t["normalized"] = False
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def with_name_split(tok):
    """``tok`` with a pre-tokenizer rule that splits a space off a capitalised word (same vocabulary).

    Byte-level BPE glues the space to the next word, so "in Paris" holds ``ĠParis`` while the
    JSON argument ``"Paris"`` holds ``Paris``: different ids, and for an unseen name different
    pieces (``ĠF lo r ence`` vs ``F lo r ence``). With the space split off, a name is the same
    token sequence in the prompt, the tool call and the tool result, so a call can copy it.
    Decoding is unchanged (the space is still a ``Ġ`` token). Stage 3 trains with this rule.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok.to_str())
    tok.pre_tokenizer = _pre_tokenizer(True)
    return tok


def _has_rule(tok, pattern: str) -> bool:
    pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
    return any(p.get("pattern", {}).get("Regex") == pattern for p in pre.get("pretokenizers", []))


def has_name_split(tok) -> bool:
    return _has_rule(tok, NAME_SPLIT)


def has_spelt_names(tok) -> bool:
    """True when ``tok`` spells capitalised words one letter a piece.

    A name the model has never seen is then a run of letters it has seen millions of times, so
    copying it from the prompt needs only to find the right letter, never to read back a rare
    piece ("gen", "burg") through a narrow latent: the readout every earlier copy stage failed
    at (spec.py). The space before the name is a piece of its own too, so the name is the same
    ids in the prompt, the call's JSON and the tool result."""
    return _has_rule(tok, SPELL_NAMES)


def write_tokenizer_files(tok, out: Path, model_max_length: int) -> None:
    """tokenizer.json + tokenizer_config.json (chat template, bos/eos/pad) in HF layout."""
    tok.save(str(out / "tokenizer.json"))
    vocab = tok.get_vocab()
    added = {}
    for content in st.DEEPSEEK_SPECIAL_TOKENS:
        added[str(vocab[content])] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": content in st.CONTROL_SPECIAL_TOKENS,
        }
    cfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": st.BOS,
        "eos_token": st.EOS,
        "pad_token": st.PAD,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": DEEPSEEK_V3_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
