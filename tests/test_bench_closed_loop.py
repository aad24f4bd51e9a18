"""benchmarks.closed_loop's request lengths and its loop, on a tiny engine (the run itself
needs the 0.5b checkpoint)."""
from __future__ import annotations

import statistics

from benchmarks import closed_loop
from tests.engine.helpers import make_engine, prompts, tiny_model


def test_lengths_spread_over_the_range_the_same_every_time():
    fixed = closed_loop.request_lengths("64")
    assert {fixed(i) for i in range(50)} == {64}
    spread = closed_loop.request_lengths("32-96")
    ls = [spread(i) for i in range(65)]
    assert sorted(ls) == list(range(32, 97))            # every length once in 65 requests
    assert statistics.mean(ls) == 64
    assert ls == [closed_loop.request_lengths("32-96")(i) for i in range(65)]


def test_the_loop_replaces_each_request_as_it_ends_until_all_are_served():
    eng = make_engine(tiny_model(), 1)
    emitted: dict[str, int] = {}
    step = eng.step

    def counting_step():
        outs = step()
        for o in outs:
            emitted[o.request_id] = emitted.get(o.request_id, 0) + len(o.token_ids)
        return outs
    eng.step = counting_step
    lengths = closed_loop.request_lengths("3-9")
    rate = closed_loop.serve_round(eng, prompts(4, seed=2), 3, 7, lengths, "t")
    assert rate > 0 and not eng.has_unfinished()
    assert emitted == {f"t-{i}": lengths(i) for i in range(7)}


def test_a_modes_name_says_its_k_policy_and_select_batch():
    assert closed_loop.mode_settings("off") == (0, True, False)
    assert closed_loop.mode_settings("f2") == (2, False, False)
    assert closed_loop.mode_settings("k1+sb") == (1, True, True)
    assert closed_loop.mode_settings("k3") is None and closed_loop.mode_settings("+sb") is None
