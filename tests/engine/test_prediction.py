"""Predicted Outputs (spec/prediction.py): a request's prediction changes no output token.

Every prediction kind (none, empty, unrelated tokens, the exact answer, the answer with
edits at its start, middle and end, the answer with a stretch left out) against MTP off
without one: greedy and seeded sampling, MTP off / k=1 / k=2, in staggered batches and
under asynchronous scheduling; the exact answer is mostly accepted and takes fewer steps.
"""
from __future__ import annotations

import functools

import pytest
import torch

from server.engine.protocol import EngineRequest, SamplingParams
from server.engine.spec.prediction import PredictionTrack
from tests.engine.helpers import high_acceptance_model, make_engine, prompts, run_staggered

NEW_TOKENS = 32
NUM_PROMPTS = 4
KINDS = ("none", "empty", "random", "exact", "edit_start", "edit_middle", "edit_end", "gap")


def _sampling(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=40, seed=900 + i)
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


def _requests(seeded: bool, predictions: dict[str, tuple[int, ...] | None] | None = None
              ) -> list[EngineRequest]:
    out = []
    for i, p in enumerate(prompts(NUM_PROMPTS, seed=7)):
        for kind in (KINDS if predictions is not None else ("none",)):
            sp = _sampling(i, seeded)
            pred = predictions.get(f"p{i}-{kind}") if predictions is not None else None
            out.append(EngineRequest(f"p{i}-{kind}", p, SamplingParams(
                **{**{f: getattr(sp, f) for f in sp.__dataclass_fields__}, "prediction": pred})))
    return out


@functools.lru_cache(maxsize=None)
def reference(seeded: bool) -> dict[str, list[int]]:
    """MTP off, no predictions: prompt i's answer."""
    eng = make_engine(high_acceptance_model(), 0)
    out = run_staggered(eng, _requests(seeded), every=1)
    return {rid.split("-")[0]: toks for rid, toks in out.items()}


def predictions_for(ref: dict[str, list[int]]) -> dict[str, tuple[int, ...] | None]:
    g = torch.Generator().manual_seed(3)

    def rand(n: int) -> list[int]:
        return torch.randint(2, 512, (n,), generator=g).tolist()
    preds: dict[str, tuple[int, ...] | None] = {}
    for p, ans in ref.items():
        mid = len(ans) // 2
        preds.update({
            f"{p}-none": None, f"{p}-empty": (), f"{p}-random": tuple(rand(len(ans))),
            f"{p}-exact": tuple(ans),
            f"{p}-edit_start": tuple(rand(3) + ans[3:]),
            f"{p}-edit_middle": tuple(ans[:mid] + rand(3) + ans[mid + 3:]),
            f"{p}-edit_end": tuple(ans[:-3] + rand(3)),
            f"{p}-gap": tuple(ans[:mid - 4] + ans[mid + 4:]),
        })
    return preds


def run_with_predictions(k: int, seeded: bool, **kw):
    ref = reference(seeded)
    eng = make_engine(high_acceptance_model(), k, **kw)
    reqs = _requests(seeded, predictions_for(ref))
    counters = {}
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    pending = list(reqs)
    while pending or eng.has_unfinished():
        if pending:
            eng.add_request(pending.pop(0))
        for o in eng.step():
            outs[o.request_id].extend(o.token_ids)
            counters[o.request_id] = o.counters
    st = eng.stats()
    assert st.kv_blocks_used == 0 and st.num_worker_requests == 0
    eng.shutdown()
    return ref, outs, counters, st


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_any_prediction_leaves_every_token_unchanged(k, seeded):
    ref, outs, counters, st = run_with_predictions(k, seeded)
    wrong = [rid for rid, toks in outs.items() if toks != ref[rid.split("-")[0]]]
    assert not wrong, wrong
    exact = [counters[f"p{i}-exact"] for i in range(NUM_PROMPTS)]
    # The exact answer: (almost) every token after the first is a verified, accepted draft.
    for c in exact:
        assert c.num_accepted_prediction_tokens >= NEW_TOKENS - 3, c
        assert c.num_prediction_tokens - c.num_accepted_prediction_tokens <= 2, c
    # No prediction, or an empty one: no predicted draft at all; MTP counters stay MTP's.
    for i in range(NUM_PROMPTS):
        for kind in ("none", "empty"):
            assert counters[f"p{i}-{kind}"].num_prediction_tokens == 0
        if k == 0:
            assert counters[f"p{i}-exact"].num_draft_tokens == 0
    # Edited answers: the place is found again after the edit.
    for i in range(NUM_PROMPTS):
        c = counters[f"p{i}-edit_middle"]
        assert c.num_accepted_prediction_tokens >= NEW_TOKENS // 2, c
    assert st.num_accepted_prediction_tokens >= NUM_PROMPTS * (NEW_TOKENS - 3)


def test_predictions_under_asynchronous_scheduling():
    ref, outs, counters, _ = run_with_predictions(1, False, async_scheduling=True)
    assert {rid: toks for rid, toks in outs.items() if toks != ref[rid.split("-")[0]]} == {}
    assert sum(c.num_accepted_prediction_tokens for c in counters.values()) > NUM_PROMPTS * NEW_TOKENS


def test_the_exact_answer_takes_a_few_steps():
    ref = reference(False)
    steps = {}
    for with_prediction in (False, True):
        eng = make_engine(high_acceptance_model(), 1, prediction_draft_tokens=16)
        pred = tuple(ref["p0"]) if with_prediction else None
        req = EngineRequest("p0", prompts(NUM_PROMPTS, seed=7)[0],
                            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, prediction=pred))
        eng.add_request(req)
        n, toks = 0, []
        while eng.has_unfinished():
            toks += [t for o in eng.step() for t in o.token_ids]
            n += 1
        assert toks == ref["p0"]
        steps[with_prediction] = n
    # prefill + ceil(31 / 17) windows of 16 predicted tokens
    assert steps[True] <= 4 < steps[False], steps


def test_track_follows_the_answer_and_finds_its_place_after_an_edit():
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    t = PredictionTrack(pred)
    assert t.drafts(3) == [10, 11, 12]
    t.advance([10, 11], [10, 11])
    assert t.drafts(3) == [12, 13, 14]
    t.advance([99], [11, 99])                  # an edit: lost until two tokens match again
    assert t.drafts(3) == []
    t.advance([14], [99, 14])
    assert t.drafts(3) == []
    t.advance([15], [14, 15])
    assert t.drafts(3) == [16, 17, 18]
    t.advance([16, 17, 18, 19], [18, 19])
    assert t.drafts(3) == []                   # at the end


def test_track_prefers_the_place_after_where_it_was_lost():
    t = PredictionTrack([1, 2, 3, 9, 1, 2, 4, 5])
    t.advance([1, 2, 3, 9, 1], [9, 1])
    t.advance([7], [1, 7])                     # lost at position 5
    t.advance([1, 2], [1, 2])
    assert t.drafts(2) == [4, 5]               # not [3, 9]: that place is behind


def test_window_drafts_follow_what_a_window_costs(monkeypatch):
    """A window of predicted drafts is used where its rows cost less than their tokens
    would one by one, and dropped where they cost as much (a product whose time grows with
    its rows, as bf16 does on a CPU without native bf16).  Products timed by sleeping."""
    import time
    from server.engine.spec import prediction
    head = torch.zeros(64, 8)
    for per_row, want in ((False, 16), (True, 0)):
        def product(x, w, per_row=per_row):              # the model's products, timed by sleeping
            time.sleep(0.004 * (x.shape[0] if per_row else 1))
        n, gain = prediction.window_drafts(head, 16, product=product)
        assert n == want, (per_row, n, gain)
    assert prediction.window_drafts(head, 0) == (0, 1.0)


def test_windows_grow_while_accepted_whole_and_restart_after_a_rejection():
    t = PredictionTrack(list(range(100)))
    t.size_window(16, 16, 64)
    assert t.window == 32                      # accepted whole: twice as long
    t.size_window(32, 32, 64)
    t.size_window(64, 64, 64)
    assert t.window == 64                      # at most the configured count
    t.size_window(64, 5, 64)
    assert t.window == 16                      # a rejection: BASE_WINDOW again
    t.size_window(8, 8, 12)
    assert t.window == 12


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_a_prediction_near_the_pools_cap_is_served_and_changes_nothing(async_on):
    """Issue 58: a pool of 34 blocks of 16 (maxBatchSize 1, maxSeqLen 512), 450 prompt
    tokens + 62 output tokens.  Before, a prediction made the request need 36 blocks (40
    with async scheduling: the configured window of 64, twice) and the engine refused it;
    now a window never needs KV the request does not hold anyway: the answer is the one
    without a prediction, and the window is verified where it fits."""
    model = high_acceptance_model()
    prompt = prompts(1, seed=11, lo=450, hi=451)[0]
    kw = dict(num_blocks=34, block_size=16, max_batch_size=1, async_scheduling=async_on,
              async_executor="thread")

    def run(prediction):
        eng = make_engine(model, 1, **kw)
        outs = eng.generate([EngineRequest("r", prompt, SamplingParams(
            max_tokens=62, temperature=0.0, ignore_eos=True, prediction=prediction))])["r"]
        eng.shutdown()
        assert outs[-1].error is None, outs[-1].error
        return [t for o in outs for t in o.token_ids], outs[-1].counters

    plain, _ = run(None)
    assert len(plain) == 62
    for prediction in (tuple(plain), tuple(plain[:20]) + (5, 6, 7) + tuple(plain[23:])):
        got, counters = run(prediction)
        assert got == plain
        assert counters.num_accepted_prediction_tokens >= 40, counters


def test_a_request_that_can_never_fit_is_refused_naming_its_parameter():
    """A refusal the client can act on says which parameter to change (the API answers 400
    with it, not 500): fewer output tokens would fit; a prompt that cannot fit with one
    output token is the prompt's fault."""
    eng = make_engine(high_acceptance_model(), 1, num_blocks=8, block_size=8)   # 64 slots
    reqs = [EngineRequest("long", list(range(2, 42)), SamplingParams(max_tokens=100)),
            EngineRequest("huge", list(range(2, 72)), SamplingParams(max_tokens=1)),
            EngineRequest("fits", list(range(2, 42)), SamplingParams(max_tokens=8))]
    outs = eng.generate(reqs)
    assert [(outs[r][-1].error_param, outs[r][-1].finish_reason.value) for r in ("long", "huge")] \
        == [("max_tokens", "error"), ("prompt", "error")]
    assert "KV blocks" in outs["long"][-1].error
    assert outs["fits"][-1].error is None and outs["fits"][-1].error_param is None


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_a_window_without_room_is_cut_to_the_blocks_the_step_has(async_on):
    """Preemptible admission (maxPreemptCount 4) and a pool of 28 blocks of 16 that two
    requests (400 and 200 tokens) share: the second's predicted windows find no free
    blocks most steps.  The scheduler does not preempt or wait for a window: the worker
    cuts it to the step's blocks (MTP's drafts where none is left), and the answers are
    the ones without a prediction."""
    model = high_acceptance_model()
    a, b = prompts(1, seed=21, lo=300, hi=301)[0], prompts(1, seed=22, lo=100, hi=101)[0]

    def run(prediction, **kw):
        eng = make_engine(model, 1, block_size=16, max_batch_size=2, async_scheduling=async_on,
                          async_executor="thread", max_preempt_count=4, **kw)
        outs = eng.generate([EngineRequest("a", a, SamplingParams(max_tokens=100, temperature=0.0,
                                                                  ignore_eos=True)),
                             EngineRequest("b", b, SamplingParams(max_tokens=100, temperature=0.0,
                                                                  ignore_eos=True,
                                                                  prediction=prediction))])
        eng.shutdown()
        return {r: [t for o in v for t in o.token_ids] for r, v in outs.items()}, outs["b"][-1]

    ref, _ = run(None)
    got, last = run(tuple(ref["b"]), num_blocks=28)
    assert got == ref and last.error is None
    assert last.counters.num_accepted_prediction_tokens > 50, last.counters
