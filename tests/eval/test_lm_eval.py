"""lm-evaluation-harness's local-completions loglikelihood task against the real daemon
(benchmarks/lm_eval.py): runs only where the ``eval`` extra is installed."""
from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.demo,
              pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                 reason="lm-eval not installed (pip install -e '.[eval]')")]


def test_lm_eval_loglikelihoods_match_the_engine(tmp_path):
    from benchmarks.lm_eval import main
    assert main(["--keep", str(tmp_path / "out")]) == 0
    assert list((tmp_path / "out").rglob("results_*.json"))
