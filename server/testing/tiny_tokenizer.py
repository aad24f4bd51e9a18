"""A tiny byte-level BPE tokenizer with DeepSeek's special tokens, for tests and demo checkpoints.

``write_tiny_tokenizer(dir, vocab_size)`` trains on a small built-in corpus (well under a
second) and writes ``tokenizer.json`` and ``tokenizer_config.json`` only. Id layout, fixed for
a given ``vocab_size``:

* 0 ``<｜begin▁of▁sentence｜>`` (BOS), 1 ``<｜end▁of▁sentence｜>`` (EOS), 2 ``<｜▁pad▁｜>`` (PAD),
  as in the real DeepSeek-V3 vocabulary; these are "special" (skipped when decoding).
* then the 256 byte symbols and the learned merges;
* then the turn / reasoning / tool markers (``<｜User｜>``, ``<think>``, ``<｜tool▁sep｜>``, ...),
  added tokens that are not special, so they stay visible in decoded text;
* then ``<｜place▁holder▁no▁N｜>`` fillers (special) up to exactly ``vocab_size`` ids.

Loads with ``transformers.AutoTokenizer.from_pretrained(dir)`` offline and with
``server.text.tokenizer.Tokenizer.from_dir(dir)``.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from server.text.chat_template import DEEPSEEK_V3_CHAT_TEMPLATE
from server.text.special_tokens import BOS, CONTROL_SPECIAL_TOKENS, EOS, MARKER_TOKENS, PAD, placeholder_token

_BYTE_ALPHABET = 256
MIN_VOCAB_SIZE = len(CONTROL_SPECIAL_TOKENS) + _BYTE_ALPHABET + len(MARKER_TOKENS)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still learn simple patterns.
Hello! How are you today? I am fine, thank you. What is the weather like in Paris?
It is sunny and warm in Paris, about 21 degrees. In London it is raining again.
Please call the function get_weather with the city name. The result will come back as JSON.
You are a helpful assistant. Answer the question briefly and clearly.
Let me think about this step by step. First, add the two numbers. Then check the result.
One plus one is two. Two times three is six. Ten minus four is six. 12345 67890 3.14 2.718
The answer is 42. Count from one to ten: one two three four five six seven eight nine ten.
{"city": "Paris", "unit": "celsius"} {"name": "get_time", "arguments": {"tz": "CET"}}
```json
{"query": "weather", "days": 3, "ok": true, "value": null}
```
def add(a, b):
    return a + b
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April
The user asked a question and the assistant answered it. The tool returned a result.
Reasoning: the user wants the temperature, so I should call the weather tool first.
Streaming sends the text in small pieces, token by token, until the model stops.
Bonjour, ça va? Très bien, merci. Grüße aus München. ¿Dónde está la estación?
你好，世界。今天天气很好。我们去公园散步吧。谢谢你的帮助。
こんにちは世界。ありがとうございます。 안녕하세요. Привет, мир! Γειά σου κόσμε.
Emoji: 😀 🎉 👍 🚀 ❤️ 🌍 ✨ 🤖
"""


def _corpus_lines() -> list[str]:
    lines = [line for line in _CORPUS.splitlines() if line.strip()]
    # Repeat so common pairs clear min_frequency and merges are learned deterministically.
    return lines * 4


def write_tiny_tokenizer(dir: str | Path, vocab_size: int) -> None:
    """Train and write a DeepSeek-style tokenizer with exactly ``vocab_size`` ids into ``dir``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: need at least {MIN_VOCAB_SIZE} "
            f"({len(CONTROL_SPECIAL_TOKENS)} control tokens + {_BYTE_ALPHABET} bytes + "
            f"{len(MARKER_TOKENS)} DeepSeek markers)"
        )
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKER_TOKENS),
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in CONTROL_SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    assert [tok.token_to_id(t) for t in CONTROL_SPECIAL_TOKENS] == [0, 1, 2]

    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"tokenizer came out with {size} ids, more than vocab_size={vocab_size}")
    fillers = [AddedToken(placeholder_token(i), special=True, normalized=False) for i in range(vocab_size - size)]
    if fillers:
        tok.add_special_tokens(fillers)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(f"tokenizer has {size} ids, expected exactly {vocab_size}")
    # BOS comes from the post-processor, as in the real DeepSeek-V3 tokenizer.json, so every
    # transformers version (and our Tokenizer) adds it for encode(add_special_tokens=True).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 0)]
    )
    tok.save(str(out / "tokenizer.json"))

    added = {
        str(i): {
            "content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
            "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 16384,
        "added_tokens_decoder": added,
        "chat_template": DEEPSEEK_V3_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
