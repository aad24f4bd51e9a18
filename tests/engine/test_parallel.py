"""Tensor/expert-parallel engines (worker ranks over gloo) against the one-process engine.

Every layout serves the same tokens as one process, greedy and seeded, with MTP off, k=1
and k=2: the demo model, a random tiny checkpoint with 8 routed experts, and a checkpoint
transformers itself wrote (no MTP layer: k = 0).  All-reduce order may in principle flip
an argmax; on these models it does not, so the comparison is exact.
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch

from server.engine.config import EngineConfig, ParallelConfig
from server.engine.core import LLMEngine
from server.engine.protocol import SamplingParams
from server.model.loading import CheckpointError, inspect_checkpoint, load_checkpoint
from server.model.parallel.plan import ParallelPlan
from server.testing.tiny_checkpoint import make_tiny_checkpoint
from tests.engine.helpers import free_port, prompts, requests, run_tokens

pytestmark = pytest.mark.slow
DEMO = Path(__file__).resolve().parents[2] / "models" / "deepseek-v3-tiny-mtp"
# name: (world, moe_tp, moe_ep[, sp])
LAYOUTS = {"tp2": (2, 2, 1), "ep2": (2, 1, 2), "tp4-moe2x2": (4, 2, 2), "tp4-ep4": (4, 1, 4),
           "tp2-sp2": (2, 2, 1, 2)}
BASE = EngineConfig(block_size=8, num_blocks=256, max_queue_delay_us=0, max_batch_size=8,
                    max_seq_len=512, adaptive_speculation=False)


def _requests(vocab: int):
    ps = prompts(4, seed=3, vocab=vocab - 8)
    return (requests(ps, SamplingParams(max_tokens=20, temperature=0.0), "g")
            + requests(ps, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=11), "s"))


@functools.lru_cache(maxsize=None)
def _single(path: str, k: int) -> dict[str, list[int]]:
    model, _ = load_checkpoint(path)
    cfg = dataclasses.replace(BASE, num_speculative_tokens=k)
    return run_tokens(LLMEngine(model.eval(), cfg, eos_token_ids=set()), _requests(model.config.vocab_size))


def parallel_config(layout: str, **kw) -> ParallelConfig:
    world, moe_tp, moe_ep, *sp = LAYOUTS[layout]
    return ParallelConfig(world_size=world, moe_tp=moe_tp, moe_ep=moe_ep, sp=sp[0] if sp else 1,
                          master_port=free_port(), **kw)


def _parallel(path: str, k: int, layout: str, **kw) -> dict[str, list[int]]:
    cfg = dataclasses.replace(BASE, num_speculative_tokens=k, **kw,
                              parallel=parallel_config(layout))
    summary = inspect_checkpoint(path)
    engine = LLMEngine(summary, cfg, eos_token_ids=set())
    try:
        assert engine.executor.info.num_kv_blocks > 0
        return run_tokens(engine, _requests(summary.config.vocab_size))
    finally:
        engine.shutdown()
        assert not any(p.is_alive() for p in engine.executor._procs), "a rank outlived shutdown"


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "tiny", seed=5))


@pytest.fixture(scope="module")
def hf_path(tmp_path_factory) -> str:
    """A checkpoint written by transformers' own DeepseekV3ForCausalLM.save_pretrained."""
    transformers = pytest.importorskip("transformers")
    from server.testing.tiny_checkpoint import tiny_config
    raw = tiny_config(with_mtp=False)
    raw.pop("architectures", None)
    raw.pop("torch_dtype", None)
    torch.manual_seed(0)
    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():                    # spread the logits so greedy picks are not ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    out = tmp_path_factory.mktemp("tp") / "hf"
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


# Every k on tensor parallelism; the other layouts at k=2 (MTP off and k=1 run the same
# sharded forward, which k=2's main and draft passes already cover there).
@pytest.mark.demo
@pytest.mark.parametrize("layout, k", [("tp2", 0), ("tp2", 1), ("tp2", 2), ("ep2", 2), ("tp4-moe2x2", 2)])
def test_demo_model_identical(layout, k):
    assert _parallel(str(DEMO), k, layout) == _single(str(DEMO), k)


@pytest.mark.demo
def test_int8_ranks_keep_the_uncompiled_static_step(quantized):
    """Int8 shards do not compile (their sliced tensors' layouts are not a compile child's):
    compile on, the static step serves uncompiled, tokens as one process."""
    cfg = dataclasses.replace(BASE, num_speculative_tokens=1, compile="on",
                              parallel=parallel_config("ep2"))
    engine = LLMEngine(inspect_checkpoint(quantized["ct"]), cfg, eos_token_ids=set())
    try:
        assert engine.runtime.decode_path == "static"
        out = run_tokens(engine, _requests(engine.runtime.vocab_size))
    finally:
        engine.shutdown()
    assert out == _single(quantized["ct"], 1)


@pytest.mark.demo
def test_async_scheduling_over_ranks_identical():
    """Two steps in flight: rank 0 queues the second message while the group runs the first."""
    assert _parallel(str(DEMO), 2, "tp2", async_scheduling=True) == _single(str(DEMO), 2)


def test_random_checkpoint_identical_k2(tiny_path):
    """8 routed experts split 2 ways, each cut in 2: routed dispatch over local experts."""
    assert _parallel(tiny_path, 2, "tp4-moe2x2") == _single(tiny_path, 2)


def test_a_group_without_a_port_meets_on_a_store_the_executor_holds(tiny_path):
    """No port configured (the daemon's one-node default): the executor opens the store on a
    port the kernel picks while binding it, every rank joins it as a client, and it goes
    with the group."""
    par = dataclasses.replace(parallel_config("tp2"), master_port=0)
    engine = LLMEngine(inspect_checkpoint(tiny_path), dataclasses.replace(BASE, parallel=par),
                       eos_token_ids=set())
    try:
        store = engine.executor._store
        assert store is not None and store.port > 0 and store.check(["joined/0", "joined/1"])
        out = run_tokens(engine, _requests(engine.runtime.vocab_size))
    finally:
        engine.shutdown()
    assert engine.executor._store is None
    assert out == _single(tiny_path, 0)


def test_fp8_checkpoint_identical(tmp_path):
    """Block-FP8 weights (read whole per rank, dequantized, then cut) served in float32."""
    path = str(make_tiny_checkpoint(tmp_path / "fp8", seed=2, fp8=True))
    model, _ = load_checkpoint(path, dtype=torch.float32)
    cfg = dataclasses.replace(BASE, num_speculative_tokens=1, dtype="float32")
    ref = run_tokens(LLMEngine(model.eval(), cfg, eos_token_ids=set()), _requests(512))
    par = dataclasses.replace(cfg, parallel=ParallelConfig(world_size=2, moe_tp=2, moe_ep=1,
                                                           master_port=free_port()))
    engine = LLMEngine(inspect_checkpoint(path), par, eos_token_ids=set())
    try:
        assert run_tokens(engine, _requests(512)) == ref
    finally:
        engine.shutdown()


def test_transformers_checkpoint_identical(hf_path):
    assert _parallel(hf_path, 0, "ep2") == _single(hf_path, 0)


# Int8 checkpoints over tp=2 moe_ep=2 (MindIE's layout for W8A8 DeepSeek: experts whole per
# rank).  "ct" is W8A8_DYNAMIC everywhere, "w8a8" W8A8 static attention + dynamic MLPs,
# "w4a8" adds W4A8 routed experts.  Row-parallel int8 layers sum integers over the group,
# so these are exact by construction, not by luck of the argmax.
@pytest.mark.demo
@pytest.mark.parametrize("name, k, kw", [("ct", 0, {}), ("ct", 1, {}), ("w8a8", 2, {}),
                                         ("w4a8", 2, {"async_scheduling": True})])
def test_int8_demo_tp2_ep2_identical(quantized, name, k, kw):
    assert _parallel(str(quantized[name]), k, "ep2", **kw) == _single(str(quantized[name]), k)


@pytest.fixture(scope="module")
def tiny_w4a8(tiny_path, tmp_path_factory) -> str:
    from training import quantize
    out = tmp_path_factory.mktemp("tp") / "tiny-w4a8"
    assert quantize.main([tiny_path, str(out), "--calib-samples", "8", "--w4a8-experts"]) == 0
    return str(out)


def test_int8_random_checkpoint_tp4_ep4_identical(tiny_w4a8):
    """8 int8 routed experts, two per rank; attention over 4 ranks (one head each)."""
    assert _parallel(tiny_w4a8, 2, "tp4-ep4") == _single(tiny_w4a8, 2)


def test_int8_experts_cut_within_themselves_are_refused(tiny_w4a8):
    with pytest.raises(CheckpointError, match=r"moe_tp 2\) cannot be computed exactly; serve int8 "
                                              r"experts whole: moe_tp 1, moe_ep 2"):
        load_checkpoint(tiny_w4a8, plan=ParallelPlan(2, 2, 1, rank=0))


@pytest.mark.demo
def test_int8_shard_weights_are_at_most_055_of_the_whole(quantized, capsys):
    full = _weight_bytes(load_checkpoint(quantized["w8a8"])[0])
    for rank in (0, 1):
        part = _weight_bytes(load_checkpoint(quantized["w8a8"], plan=ParallelPlan(2, 1, 2, rank=rank))[0])
        with capsys.disabled():
            print(f"\nW8A8 tp=2 moe_ep=2 rank {rank}: {part} of {full} weight bytes ({part / full:.3f}x)")
        assert part / full <= 0.55, (rank, part / full)


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.demo
def test_shard_weights_are_at_most_060_of_the_whole(capsys):
    """Resident weight bytes per rank with tp=2 (the issue's bound: <= 0.6x); the shard is
    loaded for real (slices read from the file), no group is needed to load."""
    full = _weight_bytes(load_checkpoint(DEMO)[0])
    for rank in (0, 1):
        part = _weight_bytes(load_checkpoint(DEMO, plan=ParallelPlan(2, 2, 1, rank=rank))[0])
        with capsys.disabled():
            print(f"\ntp=2 rank {rank}: {part} of {full} weight bytes ({part / full:.3f}x)")
        assert part / full <= 0.6, (rank, part / full)


def test_shapes_that_do_not_divide_are_refused(tiny_path):
    with pytest.raises(CheckpointError, match="cannot be split over 3 ranks .moe_tp 3, moe_ep 1.: vocab_size .512. does not divide by 3"):
        load_checkpoint(tiny_path, plan=ParallelPlan(3, 3, 1, rank=0))


def test_a_rank_that_cannot_start_is_named(tiny_path):
    """Three ranks cannot split 4 heads / 512 vocabulary rows: the start fails with
    the rank and the reason, and no rank process is left behind."""
    cfg = dataclasses.replace(BASE, parallel=ParallelConfig(world_size=3, moe_tp=3, moe_ep=1,
                                                            master_port=free_port()))
    with pytest.raises(RuntimeError, match=r"rank \d: .*cannot be split over 3 ranks"):
        LLMEngine(inspect_checkpoint(tiny_path), cfg, eos_token_ids=set())


@pytest.mark.demo
def test_a_hung_rank_fails_the_group_within_the_collective_timeout():
    """SIGSTOP one rank: rank 0's next collective times out (here after 3 s), the step
    fails with the group's error, every later step fails at once, and shutdown leaves no
    process (the stopped one is killed)."""
    import os
    import signal
    import time
    cfg = dataclasses.replace(BASE, num_speculative_tokens=1, parallel=ParallelConfig(
        world_size=2, moe_tp=2, moe_ep=1, master_port=free_port(), timeout_s=3.0))
    engine = LLMEngine(inspect_checkpoint(str(DEMO)), cfg, eos_token_ids=set())
    try:
        engine.add_request(_requests(2048)[0])
        engine.step()
        os.kill(engine.executor.worker_pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - t0 < 15
        assert engine.fatal_error is not None
    finally:
        os.kill(engine.executor.worker_pids[1], signal.SIGKILL)
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.executor._procs)
