"""Tokenizer files load, and encode/decode agree with transformers on the same files."""
import json

import pytest

from server.testing.tiny_tokenizer import MIN_VOCAB_SIZE, write_tiny_tokenizer
from server.text.special_tokens import DEEPSEEK_SPECIAL_TOKENS, EOS, THINK_END, TOOL_CALLS_BEGIN
from server.text.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello world! How are you?",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "你好，世界。今天天气很好。",
    "Emoji 😀🎉👍🏽 and 👨‍👩‍👧 family",
    "<｜begin▁of▁sentence｜>sys<｜User｜>hi<｜Assistant｜><think>\nhmm</think>ok<｜end▁of▁sentence｜>",
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{"a": 1}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "ASCII look-alikes <|User|> and <|end_of_sentence|> stay text",
    "",
]


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 300, 1000, 2048])
def test_exact_vocab_size_and_layout(tmp_path, vocab_size):
    write_tiny_tokenizer(tmp_path, vocab_size)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    t = Tokenizer.from_dir(tmp_path)
    assert t.vocab_size == vocab_size
    assert (t.bos_token_id, t.eos_token_id, t.pad_token_id) == (0, 1, 2)
    ids = [t.token_to_id(s) for s in DEEPSEEK_SPECIAL_TOKENS]
    assert None not in ids and len(set(ids)) == len(ids)
    assert max(ids) < vocab_size
    assert t.id_to_token(vocab_size - 1) is not None and t.id_to_token(vocab_size) is None


def test_too_small_vocab_fails_clearly(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        write_tiny_tokenizer(tmp_path, MIN_VOCAB_SIZE - 1)


def test_special_tokens_are_single_ids(tok):
    for s in DEEPSEEK_SPECIAL_TOKENS:
        assert tok.encode(s) == [tok.token_to_id(s)]


def test_markers_survive_skip_special_decode(tok):
    ids = tok.encode("a<think>b" + THINK_END + TOOL_CALLS_BEGIN + "c" + EOS)
    assert tok.decode(ids, skip_special_tokens=True) == "a<think>b" + THINK_END + TOOL_CALLS_BEGIN + "c"
    assert tok.decode(ids, skip_special_tokens=False).endswith(EOS)
    assert tok.special_ids >= {0, 1, 2}
    assert tok.token_to_id(THINK_END) not in tok.special_ids


def test_config_values(tok):
    assert tok.eos_token_ids == {1, 5}
    assert tok.generation_defaults == {"temperature": 0.6, "top_p": 0.95, "do_sample": True}
    assert tok.model_max_length == 16384


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special", [False, True])
def test_encode_matches_transformers(tok, hf_tok, text, add_special):
    assert tok.encode(text, add_special_tokens=add_special) == hf_tok.encode(text, add_special_tokens=add_special)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_transformers_and_round_trips(tok, hf_tok, text, skip):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_random_ids_decode_like_transformers(tok, hf_tok):
    import random

    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


def test_generation_config_int_eos_and_missing_files(tmp_path):
    write_tiny_tokenizer(tmp_path, 400)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == {1, 7}
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "nowhere")


def test_added_tokens_decoder_flags_win_like_transformers(tiny_dir, tmp_path):
    """A token marked special only in tokenizer_config.json is skipped by both decoders."""
    import shutil

    transformers = pytest.importorskip("transformers")
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    key = next(k for k, v in cfg["added_tokens_decoder"].items() if v["content"] == "<think>")
    cfg["added_tokens_decoder"][key]["special"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    ours = Tokenizer.from_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = ours.encode("a<think>b")
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "ab"
    assert int(key) in ours.special_ids and ours.vocab_size == len(theirs)
