"""Incremental detokenization equals a full decode and never shows half a character."""
import random

import pytest

from server.text.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"


def _byte_token_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte: multi-byte characters are split across tokens on purpose."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # GPT-2 byte->char table, rebuilt to find each byte's single-byte token.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = {b: chr(c) for b, c in zip(bs, cs)}
    assert sorted(table.values()) == alphabet
    return [tok.token_to_id(table[b]) for b in text.encode("utf-8")]


def _run(tok, ids, prompt=(), skip=True, rng=None):
    d = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 4) if rng else 1  # several ids per step, as with accepted MTP drafts
        deltas.append(d.step(ids[i:i + k]))
        i += k
    deltas.append(d.flush())
    return deltas, d


def test_split_multibyte_characters(tok):
    text = "a你好😀b👍🏽é"
    ids = _byte_token_ids(tok, text)
    assert len(ids) == len(text.encode())
    deltas, d = _run(tok, ids)
    assert "".join(deltas) == text == d.output_text
    assert all(FFFD not in x for x in deltas)
    # Each character appears only once its last byte has arrived.
    assert [x for x in deltas if x] == ["a", "你", "好", "😀", "b", "👍", "🏽", "é"]


def test_prompt_context_is_not_reemitted(tok):
    prompt = tok.encode("<｜begin▁of▁sentence｜><｜User｜>Hi 你好<｜Assistant｜>")
    out = tok.encode("Hello 😀 world") + [1]
    deltas, _ = _run(tok, out, prompt=prompt)
    assert "".join(deltas) == "Hello 😀 world"
    deltas, _ = _run(tok, out, prompt=prompt, skip=False)
    assert "".join(deltas) == "Hello 😀 world<｜end▁of▁sentence｜>"


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_equal_full_decode(tok, skip, seed):
    rng = random.Random(seed)
    for _ in range(40):
        # Mix whole-vocab ids with byte-split CJK/emoji text so characters span tokens.
        ids = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.5:
                ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 5))]
            else:
                ids += _byte_token_ids(tok, rng.choice(["你好", "😀🎉", "ça", "日本語", " ok", "👨‍👩‍👧"]))
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        deltas, _ = _run(tok, ids, prompt=prompt, skip=skip, rng=rng)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == full
        if FFFD not in full:
            assert all(FFFD not in x for x in deltas)


def test_decode_window_stays_small(tok):
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "The quick brown fox 你好 😀 jumps. " * 40
    ids = tok.encode(text)
    d = IncrementalDetokenizer(Counting(), tok.encode("prompt " * 50))
    out = "".join(d.step(i) for i in ids) + d.flush()
    assert out == text
    assert len(ids) > 300 and max(calls) <= 12  # the window, never the whole sequence
