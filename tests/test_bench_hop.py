"""benchmarks.hop's arithmetic (the run itself needs the 0.5b checkpoint and a daemon)."""
from __future__ import annotations

import pytest

from benchmarks import hop


def test_chunk_gaps_leave_out_the_first_two_chunks():
    # TTFT (1.0 s) and the second chunk's wait are not a decode token's time
    assert hop.chunk_gaps([0.0, 1.0, 1.5, 1.52, 1.54, 1.57]) == pytest.approx([0.02, 0.02, 0.03])
    assert hop.chunk_gaps([0.0, 1.0]) == []


def test_rounds_are_paired_daemon_over_engine():
    r = hop.paired([0.010, 0.020, 0.012], [0.011, 0.021, 0.015])
    assert r["median"] == pytest.approx(1.1) and r["min"] == pytest.approx(1.05)
    assert r["max"] == pytest.approx(1.25)
    assert hop.paired([], []) == {}


def test_every_stream_gets_its_own_prompt():
    """8 streams of one prompt decode 8 identical greedy sequences (the same experts every
    token): not the batch the engine side runs."""
    ps = hop.bench_prompts(8)
    assert len(ps) == 8 and len(set(ps)) == 8 and all(p.strip() for p in ps)
    assert len(hop.bench_prompts(100)) == 100
