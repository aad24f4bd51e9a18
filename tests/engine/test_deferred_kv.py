"""The MTP layer's KV of k = 0 steps, held and written many steps at a time
(server/engine/spec/deferred_kv.py): the rows it leaves are the ones each step would have
written, the writes are really batched, and a slot that changes owners gets the new
owner's rows, never a held write of the old one."""
from __future__ import annotations

import itertools

import torch

from server.engine.protocol import EngineRequest, SamplingParams
from server.engine.spec.policy import FixedK
from server.model.deepseek_v3 import DeepseekV3ForCausalLM
from tests.engine.helpers import high_acceptance_model, make_engine, prompts

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


class Scripted(FixedK):
    """Drafts ``ks`` in turn, one per step (max_k = the largest)."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(max(ks))
        self._ks = itertools.cycle(ks)

    def num_draft_tokens(self, num_seqs: int) -> int:
        return next(self._ks)


def _verified_rows(eng, req: EngineRequest, steps: int, n: int) -> torch.Tensor:
    """After ``steps`` steps of ``req`` alone: its MTP KV rows at positions 0..n-1 (each
    verified by then)."""
    eng.add_request(req)
    for _ in range(steps):
        eng.step()
    st = eng.worker.requests[req.request_id]
    assert len(req.prompt_token_ids) + len(st.output_token_ids) - 1 >= n
    return eng.worker.kv_rows(req.request_id, range(n), layer=-1)


def _count_writes(monkeypatch) -> list[int]:
    rows: list[int] = []
    write = DeepseekV3ForCausalLM.mtp_write_kv

    def spied(self, input_ids, *a, **kw):
        rows.append(input_ids.shape[0])
        return write(self, input_ids, *a, **kw)
    monkeypatch.setattr(DeepseekV3ForCausalLM, "mtp_write_kv", spied)
    return rows


def test_k0_steps_leave_the_mtp_kv_of_drafting_steps_written_in_few_passes(monkeypatch):
    model = high_acceptance_model()
    prompt = prompts(1, seed=4, lo=20, hi=21)[0]
    ref = _verified_rows(make_engine(model, 1, adaptive_speculation=False),
                         EngineRequest("r", prompt, GREEDY), 14, 33)
    writes = _count_writes(monkeypatch)
    eng = make_engine(model, 1, policy=Scripted([0]))
    eng.worker.proposer.inner.deferred.max_steps = 5
    rows = _verified_rows(eng, EngineRequest("r", prompt, GREEDY), 14, 33)
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)
    # The prompt's rows in its step (20); 13 decode steps' rows held, 5 a pass, the rest
    # when read.
    assert writes == [20, 5, 5, 3]


def test_drafting_again_first_writes_what_k0_steps_held(monkeypatch):
    model = high_acceptance_model()
    prompt = prompts(1, seed=5, lo=12, hi=13)[0]
    ref = _verified_rows(make_engine(model, 1, adaptive_speculation=False),
                         EngineRequest("r", prompt, GREEDY), 16, 27)
    eng = make_engine(model, 1, policy=Scripted([0, 0, 0, 1]))
    rows = _verified_rows(eng, EngineRequest("r", prompt, GREEDY), 16, 27)
    torch.testing.assert_close(rows, ref, rtol=1e-5, atol=1e-5)
    assert eng.worker.proposer.inner.deferred.num_flushes >= 3


def test_slots_of_a_finished_request_take_the_next_owners_rows():
    """B's prompt lands on blocks A decoded into at k = 0 (5 blocks in all): A's held rows
    are written before B's step, so B's prompt rows are B's own."""
    model = high_acceptance_model()
    a, b = prompts(2, seed=6, lo=18, hi=19)
    fresh = make_engine(model, 1, policy=Scripted([0]), num_blocks=8)
    fresh.add_request(EngineRequest("b", b, SHORT))
    fresh.step()
    want = fresh.worker.kv_rows("b", range(len(b)), layer=-1)
    eng = make_engine(model, 1, policy=Scripted([0]), num_blocks=5)
    eng.add_request(EngineRequest("a", a, SHORT))
    eng.step()
    done = False
    while not done:
        a_blocks = list(eng.worker.requests["a"].block_table)
        done = any(o.finished for o in eng.step())
    held = len(eng.worker.proposer.inner.deferred)
    assert held >= 10                                    # A's decode steps, not yet written
    # What the cache holds when B's step starts: the worker flushed before the forward
    # (B's own first pass would flush too, but a copy to the host tier or a hit on cached
    # blocks reads the slots before any pass).
    at_forward: list[int] = []
    execute = eng.worker.runner.execute

    def spied(states, *a, **kw):
        at_forward.append(len(eng.worker.proposer.inner.deferred))
        return execute(states, *a, **kw)
    eng.worker.runner.execute = spied
    eng.add_request(EngineRequest("b", b, SHORT))
    while "b" not in eng.worker.requests:               # once A's blocks are free
        eng.step()
    assert at_forward == [0]
    decoded_into = set(a_blocks[len(a) // 8:])           # A's blocks past its prompt
    assert decoded_into & set(eng.worker.requests["b"].block_table[:len(b) // 8 + 1])
    torch.testing.assert_close(eng.worker.kv_rows("b", range(len(b)), layer=-1), want,
                               rtol=1e-5, atol=1e-5)
