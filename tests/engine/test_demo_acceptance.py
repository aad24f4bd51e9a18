"""The bundled demo model through the engine: lossless greedy MTP, and acceptance that
agrees with the figure the model's own evaluation reports in its README
(training/evaluate.py: mtp_acceptance_k1 over the same held-out prompts).

The engine only verifies drafts at step starts (a bonus token is never drafted), the
evaluation scores every generated position, so the two are estimates of the same rate
over slightly different position samples: they must agree within a few points.
Skipped until models/deepseek-v3-tiny-mtp holds weights.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "models" / "deepseek-v3-tiny-mtp"
pytestmark = [pytest.mark.slow, pytest.mark.demo,
              pytest.mark.skipif(not any(DEMO.glob("*.safetensors")),
                                 reason="demo model weights not present")]
GREEDY = SamplingParams(max_tokens=96, temperature=0.0)     # the evaluation's max_new


def card_figure() -> float | None:
    readme = DEMO / "README.md"
    if not readme.is_file():
        return None
    m = re.search(r"\|\s*mtp_acceptance_k1\s*\|\s*([0-9.]+)\s*\|", readme.read_text())
    return float(m.group(1)) if m else None


@functools.lru_cache(maxsize=None)
def demo():
    from training import corpus, render
    from training.spec import TrainSettings
    from server.model.loading import load_checkpoint
    from server.text.tokenizer import Tokenizer

    model, _ = load_checkpoint(DEMO)
    tok = Tokenizer.from_dir(DEMO)
    sets = corpus.eval_prompts(TrainSettings().eval_seed, n_chat=40, n_tool=40, n_think=40)
    prompts = [tok.encode(render.render_eval_prompt(c)) for chats in sets.values() for c in chats]
    return model.eval(), tok, prompts


def engine(k: int, batch: int = 64) -> LLMEngine:
    model, tok, _ = demo()
    cfg = EngineConfig(block_size=16, num_blocks=2048, num_speculative_tokens=k,
                       max_queue_delay_us=0, max_batch_size=batch, max_seq_len=1024)
    return LLMEngine(model, cfg, tok)


@functools.lru_cache(maxsize=None)
def run(k: int):
    _, _, prompts = demo()
    eng = engine(k)
    reqs = [EngineRequest(f"d{i}", p, GREEDY) for i, p in enumerate(prompts)]
    outs = eng.generate(reqs)
    return {r: [t for o in v for t in o.token_ids] for r, v in outs.items()}, eng.stats()


def test_engine_acceptance_matches_the_demo_models_evaluation():
    ref, base = run(0)
    out, st = run(1)
    assert out == ref                                          # lossless on the demo model
    rate = st.acceptance_rate
    print(f"demo model through the engine, k=1: acceptance {rate:.3f} "
          f"({st.num_accepted_tokens}/{st.num_draft_tokens}), mean acceptance length "
          f"{st.mean_acceptance_length:.2f}, steps {st.num_steps} vs {base.num_steps} without MTP")
    expected = card_figure()
    if expected is None:
        pytest.skip(f"no mtp_acceptance_k1 in {DEMO / 'README.md'}; engine measured {rate:.3f}")
    assert abs(rate - expected) < 0.05, (rate, expected)


def test_demo_model_k2_lossless_in_batches_and_one_at_a_time():
    ref, _ = run(0)
    _, _, prompts = demo()
    reqs = [EngineRequest(f"d{i}", p, GREEDY) for i, p in enumerate(prompts[:32])]
    eng = engine(2, batch=8)
    outs = eng.generate(reqs)
    assert {r: [t for o in v for t in o.token_ids] for r, v in outs.items()} == \
        {r.request_id: ref[r.request_id] for r in reqs}
    st = eng.stats()
    print(f"demo model, k=2: acceptance {st.acceptance_rate:.3f}, per position "
          f"{[round(a / st.num_drafts, 3) for a in st.accepted_per_position]}, "
          f"mean acceptance length {st.mean_acceptance_length:.2f}")
    for k in (1, 2):
        eng = engine(k, batch=1)
        for r in reqs[::4]:
            got = eng.generate([EngineRequest(r.request_id, r.prompt_token_ids, GREEDY)])
            assert [t for o in got[r.request_id] for t in o.token_ids] == ref[r.request_id]
