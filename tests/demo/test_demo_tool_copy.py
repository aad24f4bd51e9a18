"""The demo model copies the city named in a weather / time request into its tool call.

Why: a tool call is only useful when its arguments come from the request. The model used to
answer "What is the weather in Paris?" with get_weather for Lima, Barcelona or Boston
(whichever city it had memorised for the phrasing). The model trained since spells capitalised
words one letter a token (render.SPELL_NAMES), so copying a name means copying letters it has
seen millions of times. These prompts name evaluation-only cities (facts.EVAL_CITIES)
in evaluation-only phrasings (corpus.HELDOUT_*_PHRASINGS), neither of which is ever trained,
so only copying gets them right. Greedy, batched through the serving engine with MTP k=1
(lossless against the cache-free forward the model card's evaluation uses: tests/engine).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine.protocol import EngineRequest, SamplingParams
from server.model.loading import load_checkpoint
from server.text.tokenizer import Tokenizer
from server.text.tool_calls import DeepSeekV3ToolParser
from tests.engine.helpers import make_engine, run_tokens
from training import corpus, evaluate, facts, render

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models" / "deepseek-v3-tiny-mtp"

pytestmark = [pytest.mark.demo, pytest.mark.slow]

TOOLS = [corpus.TOOLS["get_weather"], corpus.TOOLS["get_time"]]


@pytest.fixture(scope="module")
def model_tok():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_checkpoint(MODEL_DIR, dtype=torch.float32)[0], Tokenizer.from_dir(MODEL_DIR)
    torch.set_num_threads(old)


def _calls(model_tok, chats: list[tuple[list[dict], list[dict]]]) -> list:
    """The first tool call of each (messages, tools) chat's greedy answer (at most 48 tokens)."""
    model, tok = model_tok
    eos = tok.token_to_id("<｜end▁of▁sentence｜>")
    eng = make_engine(model, 1, max_batch_size=len(chats), eos={eos})
    greedy = SamplingParams(max_tokens=48, temperature=0.0)
    reqs = [EngineRequest(f"c{i}", tok.encode(render.render_prompt(m, t, thinking=False)), greedy)
            for i, (m, t) in enumerate(chats)]
    outs = run_tokens(eng, reqs)
    return [evaluate.first_call(DeepSeekV3ToolParser(), tok.decode(outs[r.request_id])) for r in reqs]


def test_prompt_city_reaches_the_arguments(model_tok):
    cases = [("What is the weather in Paris?", "get_weather"),
             ("What's the weather like in Paris?", "get_weather"),
             ("What time is it now in Tokyo?", "get_time")]
    got = _calls(model_tok, [([{"role": "user", "content": p}], TOOLS) for p, _ in cases])
    for (prompt, name), call in zip(cases, got):
        assert call == (name, {"city": prompt.split(" in ")[1].rstrip("?")}), prompt


def test_heldout_cities_and_phrasings_are_copied(model_tok):
    """One prompt per held-out city (20), each in a held-out phrasing: at least 16 exact."""
    chats = corpus.copy_eval_prompts(seed=4242, n=len(facts.EVAL_CITIES))
    assert sorted(c.expect_args["city"] for c in chats) == sorted(facts.EVAL_CITIES)
    for chat in chats:
        prompt = chat.messages[-2]["content"]
        assert corpus.is_heldout(prompt)
        assert not any(prompt == p.format(c=chat.expect_args["city"])
                       for p in corpus.COPY_WEATHER_PHRASINGS + corpus.COPY_TIME_PHRASINGS)
    got = _calls(model_tok, [(c.messages[:-1], c.tools) for c in chats])
    bad = [(c.messages[-2]["content"], g) for c, g in zip(chats, got)
           if g != (c.expect_tool, c.expect_args)]
    assert len(chats) - len(bad) >= 16, f"{len(chats) - len(bad)}/20 copied; misses: {bad}"
