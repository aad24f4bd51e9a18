"""Streamed text equals a full decode on the three decoder families models ship with.

ByteLevel (the DeepSeek tokenizer, ``tok``), Metaspace (SentencePiece-style: the decoder
drops the first token's leading space) and byte fallback (Llama-style: characters outside
the vocabulary as ``<0xXX>`` tokens, ``Strip`` of one leading space). Tokens arrive in
chunks of 1..k+1, as MTP emits them; for every split the streamed text must be the full
decode of prompt + output minus the prompt's decode, with no U+FFFD the full decode lacks.

Each case runs twice: through ``tokenizers.decoders.DecodeStream`` (the tokenizer exposes
its backend) and through the Python path (a tokenizer that only has ``decode``).
"""
from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers.decoders import DecodeStream

from server.text import detokenizer
from server.text.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
_SPECIALS = ["<unk>", "<s>", "</s>"]
_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?()'\"#-_\n")
_PIECES = ["Set", "set", "ting", "up", "the", "operation", "op", "era", "tion", "called", "de",
           "flock", "lock", "pre", "run", "Hello", "there", "play", "con", "ing", "a", "S5", "dL"]
# Outside the byte-fallback vocabulary: spelled as <0xXX> byte tokens there.
_WIDE = ["你", "好", "世", "界", "😀", "🎉", "é", "ç"]
TEXTS = ["Setting up the operation", " set dL S5ting operation8conplay called", "deflock",
         " pre run)", " 你好，世界", "😀🎉 ça", "\n\nHello there", " a", "lock ding"]
PROMPTS = ["Hello there", "Hello 你好", "operation 😀", "x"]


def _unigram_vocab(byte_fallback: bool) -> list[tuple[str, float]]:
    """Fixed pieces and scores (trainers are not deterministic): whole words beat letters."""
    vocab = [(s, 0.0) for s in _SPECIALS]
    if byte_fallback:
        vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [("▁", -5.0)] + [(c, -10.0) for c in _CHARS]
    if not byte_fallback:
        vocab += [(c, -10.0) for c in _WIDE]
    vocab += [(p, -3.0) for p in _PIECES] + [("▁" + p, -2.5) for p in _PIECES]
    return vocab


def metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style: Metaspace pre-tokenizer and decoder (leading-space rule)."""
    tok = Tokenizer(models.Unigram(_unigram_vocab(byte_fallback=False), unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(s, special=True) for s in _SPECIALS])
    tok.add_tokens([AddedToken("<think>", special=False)])
    return tok


def byte_fallback_tokenizer() -> Tokenizer:
    """Llama-2-style: byte-fallback model, Replace + ByteFallback + Fuse + Strip decoder."""
    tok = Tokenizer(models.Unigram(_unigram_vocab(byte_fallback=True), unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(s, special=True) for s in _SPECIALS])
    return tok


class DecodeOnly:
    """A tokenizer with nothing but ``decode``: forces the detokenizer's Python path."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _ids(tok, text: str) -> list[int]:
    enc = tok.encode(text)
    return enc if isinstance(enc, list) else enc.ids


def _vocab_size(tok) -> int:
    return tok.vocab_size if hasattr(tok, "vocab_size") else tok.get_vocab_size()


@pytest.fixture(scope="module", params=["bytelevel", "metaspace", "byte_fallback"])
def family(request, tok):
    if request.param == "bytelevel":
        return request.param, tok
    built = metaspace_tokenizer() if request.param == "metaspace" else byte_fallback_tokenizer()
    return request.param, built


@pytest.fixture(params=["stream", "python"])
def path(request):
    return request.param


def _detok(tok, path, prompt, skip):
    d = IncrementalDetokenizer(tok if path == "stream" else DecodeOnly(tok), prompt,
                               skip_special_tokens=skip)
    assert (d._stream is not None) == (path == "stream" and detokenizer._DecodeStream is not None)
    return d


def _stream(d, ids, rng, k):
    """Feed ``ids`` in chunks of 1..k+1 (MTP: one verified token plus up to k drafts)."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, k + 1)
        deltas.append(d.step(ids[i:i + n]))
        i += n
    deltas.append(d.flush())
    return deltas


def _output(tok, rng) -> list[int]:
    """Realistic output: encoded text (wide characters split over byte tokens where the
    tokenizer does that), special tokens, random ids of whole characters."""
    out: list[int] = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.6:
            out += _ids(tok, rng.choice(TEXTS))
        elif r < 0.8:
            out += [rng.randrange(1, 3)]       # <s> / </s> (special in every family here)
        else:
            vocab = _vocab_size(tok)
            out += [i for i in (rng.randrange(vocab) for _ in range(3))
                    if FFFD not in tok.decode([i], skip_special_tokens=False)]
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_streamed_text_equals_full_decode(family, path, k):
    name, tok = family
    rng = random.Random(f"{name}-{k}")
    for trial in range(60):
        skip = trial % 2 == 0
        prompt = [1] + _ids(tok, rng.choice(PROMPTS)) if name != "bytelevel" else \
            _ids(tok, "<｜begin▁of▁sentence｜><｜User｜>" + rng.choice(PROMPTS) + "<｜Assistant｜>")
        out = _output(tok, rng)
        prompt_text = tok.decode(prompt, skip_special_tokens=skip)
        full = tok.decode(prompt + out, skip_special_tokens=skip)
        assert full.startswith(prompt_text) and FFFD not in full
        deltas = _stream(_detok(tok, path, prompt, skip), out, rng, k)
        assert "".join(deltas) == full[len(prompt_text):], (name, prompt, out)
        assert not any(FFFD in x for x in deltas)


def test_metaspace_word_split_across_steps(path):
    """The issue's failure: " set" then "ting" lost or doubled spaces and letters."""
    tok = metaspace_tokenizer()
    prompt = _ids(tok, "Hello there")
    out = _ids(tok, " set dL S5ting operation8conplay called deflock")
    assert len(out) > 8
    d = _detok(tok, path, prompt, True)
    deltas = [d.step(i) for i in out] + [d.flush()]
    assert "".join(deltas) == " set dL S5ting operation8conplay called deflock"
    assert "".join(deltas[:2]) == tok.decode(prompt + out[:2])[len("Hello there"):]


def test_byte_fallback_characters_appear_whole(path):
    tok = byte_fallback_tokenizer()
    out = _ids(tok, "a 你好😀")
    assert sum(tok.id_to_token(i).startswith("<0x") for i in out) == 3 + 3 + 4
    d = _detok(tok, path, _ids(tok, "Hello"), True)
    deltas = [d.step(i) for i in out] + [d.flush()]
    assert [x for x in deltas if x] == [" a", " ", "你", "好", "😀"]


def test_prompt_ending_in_byte_tokens(path):
    """The last 5 prompt tokens cut "你" (3 byte tokens + 3 for "好"): byte fallback turns
    the cut run into U+FFFD, so a longer suffix is taken as context, not none."""
    tok = byte_fallback_tokenizer()
    prompt = _ids(tok, "Hello 你好")
    assert FFFD in tok.decode(prompt[-5:]) and FFFD not in tok.decode(prompt)
    out = _ids(tok, "there")
    d = _detok(tok, path, prompt, True)
    assert "".join([d.step(i) for i in out] + [d.flush()]) == " there"
    assert tok.decode(prompt + out) == "Hello 你好 there"


@pytest.mark.parametrize("k", [0, 2])
def test_steps_match_decode_stream(family, path, k):
    """Same deltas step by step as tokenizers' DecodeStream, the reference scheme."""
    name, tok = family
    if name == "bytelevel":
        tok = tok.backend_tokenizer
    rng = random.Random(f"ds-{name}-{k}")
    for trial in range(30):
        out = _output(tok, rng)
        prompt = _ids(tok, rng.choice(PROMPTS))
        ref = DecodeStream(ids=prompt, skip_special_tokens=True)
        d = _detok(tok, path, prompt, True)
        i = 0
        while i < len(out):
            n = rng.randint(1, k + 1)
            assert d.step(out[i:i + n]) == (ref.step(tok, out[i:i + n]) or "")
            i += n


def test_byte_fallback_garbage_recovers(path):
    """Random byte tokens: an invalid byte turns its whole run, earlier valid characters
    included, into U+FFFD, which DecodeStream reports as "Invalid prefix". Both paths
    recover the same way, never raise, and add no U+FFFD the full decode does not have."""
    tok = byte_fallback_tokenizer()
    rng = random.Random(7)
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    recovered = 0
    for _ in range(150):
        out = []
        for _ in range(rng.randint(1, 8)):
            out += _ids(tok, rng.choice(TEXTS)) if rng.random() < 0.5 else \
                [rng.choice(byte_ids) for _ in range(rng.randint(1, 4))]
        prompt = _ids(tok, rng.choice(PROMPTS))
        d = _detok(tok, path, prompt, True)
        k = rng.randint(0, 3)
        state = rng.getstate()
        deltas = _stream(d, out, rng, k)
        rng.setstate(state)
        assert deltas == _stream(_detok(tok, "python", prompt, True), out, rng, k)
        full = tok.decode(prompt + out)
        if FFFD not in full:
            assert not any(FFFD in x for x in deltas)
            assert "".join(deltas) == full[len(tok.decode(prompt)):]
        recovered += path == "stream" and d._stream is None and len(deltas) > 1
    if path == "stream":
        assert recovered > 0, "no case reached DecodeStream's invalid-prefix error"
