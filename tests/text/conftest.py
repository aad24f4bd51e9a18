"""Shared fixtures: one tiny DeepSeek-style tokenizer folder, loaded by us and by transformers."""
import json

import pytest

from server.testing.tiny_tokenizer import write_tiny_tokenizer
from server.text.tokenizer import Tokenizer

VOCAB_SIZE = 1024


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_tok")
    write_tiny_tokenizer(d, VOCAB_SIZE)
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [1, 5], "temperature": 0.6, "top_p": 0.95, "do_sample": True}
    ))
    return d


@pytest.fixture(scope="session")
def tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def hf_tok(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))
