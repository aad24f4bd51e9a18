"""Acceptance on the bundled demo model, measured through the engine (MTP k=1, greedy),
agrees with the figure the model's own evaluation reports in its README
(scripts/demo_model/evaluate.py: mtp_acceptance_k1 over the same held-out prompts).

The engine only verifies drafts at step starts (a bonus token is never drafted), the
evaluation scores every generated position, so the two are estimates of the same rate
over slightly different position samples: they must agree within a few points.
Skipped until models/deepseek-v3-tiny-mtp holds weights.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.engine.config import EngineConfig
from server.engine.engine import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "models" / "deepseek-v3-tiny-mtp"
pytestmark = pytest.mark.skipif(not any(DEMO.glob("*.safetensors")),
                                reason="demo model weights not present")


def card_figure() -> float | None:
    readme = DEMO / "README.md"
    if not readme.is_file():
        return None
    m = re.search(r"\|\s*mtp_acceptance_k1\s*\|\s*([0-9.]+)\s*\|", readme.read_text())
    return float(m.group(1)) if m else None


def test_engine_acceptance_matches_the_demo_models_evaluation():
    from scripts.demo_model import corpus, render
    from scripts.demo_model.spec import TrainSettings
    from server.model.loader import load_checkpoint
    from server.text.tokenizer import Tokenizer

    model, _ = load_checkpoint(DEMO)
    tok = Tokenizer.from_dir(DEMO)
    sets = corpus.eval_prompts(TrainSettings().eval_seed, n_chat=40, n_tool=40, n_think=40)
    prompts = [tok.encode(render.render_eval_prompt(c)) for chats in sets.values() for c in chats]
    results = {}
    for k in (0, 1):
        cfg = EngineConfig(block_size=16, num_blocks=2048, num_speculative_tokens=k,
                           max_queue_delay_us=0, max_batch_size=16, max_seq_len=4096)
        eng = LLMEngine(model.eval(), cfg, tok)
        reqs = [EngineRequest(f"d{i}", p, SamplingParams(max_tokens=96, temperature=0.0))
                for i, p in enumerate(prompts)]
        outs = eng.generate(reqs)
        results[k] = ({r: [t for o in v for t in o.token_ids] for r, v in outs.items()}, eng.stats())
    assert results[1][0] == results[0][0]                       # lossless on the demo model too
    st = results[1][1]
    rate = st.acceptance_rate
    print(f"demo model through the engine: acceptance {rate:.3f} "
          f"({st.num_accepted_tokens}/{st.num_draft_tokens}), mean acceptance length "
          f"{st.mean_acceptance_length:.2f}, steps {st.num_steps} vs {results[0][1].num_steps} without MTP")
    expected = card_figure()
    if expected is None:
        pytest.skip(f"no mtp_acceptance_k1 in {DEMO / 'README.md'}; engine measured {rate:.3f}")
    assert abs(rate - expected) < 0.05, (rate, expected)
