"""Grammar-constrained decoding in the engine (server/engine/sample/grammar.py).

* Masks per verified row: a draft the grammar forbids gets a zero row bit (so the
  verifier rejects it), later rows allow everything, and the matcher ends as it began.
* On the demo model: constrained outputs with MTP k=1 and k=2 are token for token what MTP
  off gives (greedy), in batches mixed with unconstrained requests and staggered
  arrivals; every output follows its grammar; seeded sampling reproduces alone and in a
  batch; each grammar is compiled once.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema
import pytest
import torch

from server.api.openai.grammars import (auto_tool_grammar, response_format_grammar,
                                        tool_call_grammar)
from server.api.openai.protocol import Tool
from server.engine.sample import grammar
from server.engine.sample import grammar_masks
from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.text.special_tokens import THINK_END, THINK_START
from server.text.tokenizer import Tokenizer
from tests.engine.helpers import run_staggered, tokens_of

DEMO = str(Path(__file__).resolve().parents[2] / "models" / "deepseek-v3-tiny-mtp")
pytestmark = pytest.mark.demo          # the demo model's tokenizer and weights
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
    "sunny": {"type": "boolean"}}, "required": ["city", "temperature_c", "sunny"],
    "additionalProperties": False}
FACT = {"type": "object", "properties": {
    "answer": {"type": "string", "maxLength": 30}, "confidence": {"enum": ["low", "high"]}},
    "required": ["answer", "confidence"], "additionalProperties": False}
TOOLS = [Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}),
    Tool.model_validate({"type": "function", "function": {
        "name": "GetLocalTime", "parameters": {"type": "object", "properties": {
            "tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"],
            "additionalProperties": False}}})]
QUESTIONS = ["What is the weather in Paris?", "Tell me about Tokyo.", "What is 12 plus 30?",
             "Is it sunny in Rome today?", "What time is it in Berlin?", "Name a big city."]


@functools.lru_cache(maxsize=None)
def demo():
    from server.model.loading import load_checkpoint
    model, _ = load_checkpoint(DEMO)
    return model.eval(), Tokenizer.from_dir(DEMO)


def schema_grammar(schema: dict) -> str:
    return response_format_grammar({"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}).grammar


def chat_prompt(tok: Tokenizer, question: str, tools=None) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None)
    return tok.encode(text, add_special_tokens=False)


def engine(k: int, **kw) -> LLMEngine:
    model, tok = demo()
    cfg = EngineConfig(num_speculative_tokens=k, tokenizer_dir=DEMO, max_seq_len=1024,
                       num_blocks=512, block_size=16, max_queue_delay_us=0, max_batch_size=8, **kw)
    return LLMEngine(model, cfg, tok)


def workload(sp_of) -> list[EngineRequest]:
    """Constrained requests (two schemas, forced tool calls) among unconstrained ones."""
    _, tok = demo()
    tool_g = tool_call_grammar("deepseek_v3", TOOLS, None, True, tok.token_to_id).grammar
    named_g = tool_call_grammar("deepseek_v3", TOOLS, "GetLocalTime", True, tok.token_to_id).grammar
    auto_g = auto_tool_grammar("deepseek_v3", TOOLS, True, tok.token_to_id, [THINK_START, THINK_END]).grammar
    reqs = []
    for i, q in enumerate(QUESTIONS):
        reqs.append(EngineRequest(f"w{i}", chat_prompt(tok, q + " Answer in JSON."), sp_of(i, schema_grammar(WEATHER))))
        reqs.append(EngineRequest(f"f{i}", chat_prompt(tok, q), sp_of(i, schema_grammar(FACT))))
        reqs.append(EngineRequest(f"t{i}", chat_prompt(tok, q, TOOLS), sp_of(i, tool_g if i % 2 else named_g)))
        reqs.append(EngineRequest(f"u{i}", chat_prompt(tok, q), sp_of(i, None)))
        reqs.append(EngineRequest(f"a{i}", chat_prompt(tok, q, TOOLS), sp_of(i, auto_g)))
    return reqs


def check_follows(tok: Tokenizer, rid: str, ids: list[int]) -> None:
    text = tok.decode(ids, skip_special_tokens=False).replace(tok.decode([1], skip_special_tokens=False), "")
    if rid[0] in "wf":
        jsonschema.validate(json.loads(text), WEATHER if rid[0] == "w" else FACT)
    elif rid[0] in "ta":
        from server.text.tool_calls import DeepSeekV3ToolParser
        calls = DeepSeekV3ToolParser().extract(text).tool_calls
        assert calls or rid[0] == "a", text          # auto: a call is optional
        for c in calls:
            tool = {t.function.name: t for t in TOOLS}[c.name]
            jsonschema.validate(json.loads(c.arguments), tool.function.parameters)
        if rid[0] == "t" and rid[1] in "024":
            assert [c.name for c in calls] == ["GetLocalTime"]


# ---- masks (no model) -------------------------------------------------------------------
def test_window_masks_reject_a_forbidden_draft_and_leave_the_matcher_as_it_was():
    _, tok = demo()
    book = grammar.GrammarBook(DEMO, 2048)
    g = schema_grammar({"enum": ["yes", "no"]})
    m = book.matcher(g, [])
    yes = tok.encode('"yes"')
    bad = tok.encode('"x')[-1]
    applier = grammar_masks.MaskApplier(2048, torch.device("cpu"))
    rows, bm = grammar_masks.window_masks([None, m], [[5, 6], [yes[0], bad, yes[-1]]], book.words)
    assert rows == [3, 4, 5, 6]                          # request 1 owns window rows 3..6
    allowed = applier.allowed(bm)
    assert allowed[0, yes[0]] and allowed[1].sum() < 2048
    assert not allowed[1, bad]                           # the forbidden draft: bit 0 -> rejected
    assert allowed[2:].all()                             # rows after it are never used
    again = grammar_masks.window_masks([m], [[]], book.words)[1]
    assert torch.equal(again[0], bm[1 - 1])              # the matcher rolled back
    logits = torch.zeros(7, 2048)
    out = applier.apply(logits, torch.tensor(rows), bm)
    assert torch.isinf(out[4, bad]) and torch.equal(out[:3], logits[:3])
    assert book.num_compiled == 1 and book.matcher(g, yes[:1]) is not None and book.num_compiled == 1


# ---- the engine on the demo model ---------------------------------------------------------
@functools.lru_cache(maxsize=None)
def greedy_run(k: int) -> tuple[dict[str, list[int]], object]:
    eng = engine(k)
    sp = lambda i, g: SamplingParams(max_tokens=72, temperature=0.0, grammar=g)   # noqa: E731
    return run_staggered(eng, workload(sp), every=2), eng.stats()


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_constrained_greedy_identical_with_mtp(k):
    ref, _ = greedy_run(0)
    out, st = greedy_run(k)
    assert out == ref
    assert st.num_accepted_tokens > 0 and st.num_draft_tokens > st.num_accepted_tokens
    _, tok = demo()
    for rid, ids in out.items():
        if rid[0] != "u":
            check_follows(tok, rid, ids)
    auto = [tok.decode(ids, skip_special_tokens=False) for rid, ids in out.items() if rid[0] == "a"]
    assert 0 < sum("tool▁calls▁begin" in t for t in auto) < len(auto)   # auto: calls and answers


@pytest.mark.slow
def test_seeded_constrained_sampling_identical_with_mtp_and_alone():
    """Seeded requests are verified by coupling (sample/sampler.py): with MTP k=1 and k=2 they
    emit exactly what MTP off emits for the same seed, batched or alone."""
    sp = lambda i, g: SamplingParams(max_tokens=72, temperature=0.9, top_p=0.95,   # noqa: E731
                                     seed=100 + i, grammar=g)
    reqs = workload(sp)
    ref = run_staggered(engine(0), reqs, every=2)
    for k in (2, 1):
        eng = engine(k)
        batched = run_staggered(eng, reqs, every=1)
        assert batched == ref, k
        assert eng.stats().num_accepted_tokens > 0
    _, tok = demo()
    for r in reqs[:5]:
        alone = tokens_of(engine(1).generate([r])[r.request_id])
        assert alone == batched[r.request_id]
        if r.request_id[0] != "u":
            check_follows(tok, r.request_id, alone)
    assert eng.worker.grammars.num_compiled == 5         # two schemas, three tool grammars


@pytest.mark.slow
def test_constrained_outputs_identical_under_async_scheduling():
    """The worker process (async scheduling on a CPU) compiles grammars itself on first
    sight and computes step n+1's masks from its own state, so the step waits for them
    and the outputs are those of synchronous scheduling."""
    sp = lambda i, g: (SamplingParams(max_tokens=72, temperature=0.0, grammar=g) if i % 2   # noqa: E731
                       else SamplingParams(max_tokens=72, temperature=0.9, seed=7 + i, grammar=g))
    reqs = workload(sp)[:16]
    ref = run_staggered(engine(1), reqs, every=2)
    eng = engine(1, async_scheduling=True)
    assert eng.worker is None and eng.grammars is None      # the worker is in another process
    try:
        out = run_staggered(eng, reqs, every=2)
    finally:
        eng.shutdown()
    assert out == ref


# ---- statistics: constrained sampling under MTP follows the constrained distribution -----
@pytest.mark.slow
def test_constrained_sampling_distribution_is_unchanged_by_mtp(tmp_path):
    """600 seeded requests per engine on a high-acceptance tiny model under the grammar
    ``[a-e]{4}``: the joint distribution of the first two letters with MTP k=1 and k=2
    (masked drafts accepted by probability ratio, masked residuals) matches MTP off by a
    chi-square test of homogeneity; every output follows the grammar."""
    import llguidance
    from scipy.stats import chi2_contingency

    from server.model.loading import load_checkpoint
    from server.testing.high_acceptance import make_high_acceptance
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "ckpt", seed=2)
    model, _ = load_checkpoint(path)
    model = make_high_acceptance(model, 0.1).eval()
    tok = Tokenizer.from_dir(path)
    g = llguidance.LLMatcher.grammar_from_regex("[a-e]{4}")
    prompt = tok.encode("The letters are:")
    counts = []
    for k in (0, 1, 2):
        cfg = EngineConfig(num_speculative_tokens=k, tokenizer_dir=str(path), max_seq_len=256,
                           num_blocks=1024, block_size=16, max_queue_delay_us=0, max_batch_size=64)
        eng = LLMEngine(model, cfg, tok)
        reqs = [EngineRequest(f"s{i}", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=i,
                                                              grammar=g)) for i in range(600)]
        table = torch.zeros(25)
        for rid, outs in eng.generate(reqs).items():
            text = tok.decode(tokens_of(outs))
            assert len(text) == 4 and set(text) <= set("abcde"), text
            table["abcde".index(text[0]) * 5 + "abcde".index(text[1])] += 1
        counts.append(table)
        if k:
            assert eng.stats().num_accepted_tokens > 0
    for k in (1, 2):
        pair = torch.stack([counts[0], counts[k]])
        pair = pair[:, pair.sum(0) > 0]
        assert chi2_contingency(pair.numpy()).pvalue > 1e-3, (k, counts[0], counts[k])


@pytest.mark.slow
def test_predicted_drafts_under_grammars_change_no_token():
    """Predictions (spec/prediction.py) on constrained requests: the grammar masks every
    verified row, predicted drafts included, so a prediction that breaks the grammar is
    rejected where it does; outputs stay MTP off's.  Half the requests predict their exact
    answer, the rest the answer with a token changed every 8."""
    ref, _ = greedy_run(0)
    g = torch.Generator().manual_seed(5)

    def sp(i, gr, rid):
        ans = list(ref[rid])
        if i % 2:
            for j in range(3, len(ans), 8):
                ans[j] = int(torch.randint(2, 2048, (1,), generator=g))
        return SamplingParams(max_tokens=72, temperature=0.0, grammar=gr, prediction=tuple(ans))
    reqs = workload(lambda i, gr: SamplingParams(max_tokens=72, temperature=0.0, grammar=gr))
    reqs = [EngineRequest(r.request_id, r.prompt_token_ids,
                          sp(int(r.request_id[1:]), r.sampling.grammar, r.request_id)) for r in reqs]
    eng = engine(1)
    out = run_staggered(eng, reqs, every=2)
    assert out == ref
    st = eng.stats()
    assert st.num_accepted_prediction_tokens > 0.5 * sum(len(v) for v in ref.values())
    assert st.num_prediction_tokens > st.num_accepted_prediction_tokens     # edits were rejected
