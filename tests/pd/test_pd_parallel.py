"""PD disaggregation with parallel instances: 1 P with tp 2, sp 2, cp 2 (4 ranks) + 1 D with
dp 2, tp 1, moe_ep 2 (2 ranks), on the demo model (engine/kv/transfer/striped.py).

Engines (the same code path as the daemon's below the HTTP and trust layer: the worker
exports rows through the rank group, D's scheduler queues the pulled rows and each rank
writes its stripe's): greedy and seeded tokens, MTP off and k=1, identical to one
process, the KV really moved (D's remote prefix hits cover every full prompt block) and
the rows P's four ranks export are one process's rows (float rounding only).
Ranks without an engine: ``StripedRows`` reads and writes each block on the ranks of its
stripe, and a wrong block-to-rank mapping gives other rows (the check bites).
Daemons (MTP off and k=1): the same layouts through the coordinator, with the trust
checks; the answers are the one-process daemon's, the bytes P sent are the bytes D took,
and D's remote prefix hits show the rows were used.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from server.engine.config import ParallelConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.loading import inspect_checkpoint, load_checkpoint
from tests.engine.helpers import free_port, prompts, run_tokens
from tests.engine.test_parallel import BASE, DEMO

BS = 8


def on_demo(test):
    """Engines and daemons on the demo model (the stripe checks below need neither)."""
    for mark in (pytest.mark.slow, pytest.mark.demo,
                 pytest.mark.skipif(not (DEMO / "model.safetensors").exists(),
                                    reason="demo model not present")):
        test = mark(test)
    return test


def p_parallel() -> ParallelConfig:
    """tp 2 x cp 2 on 4 ranks, sp = tp; experts over moe_ep 4 (moe_tp x moe_ep == worldSize)."""
    return ParallelConfig(world_size=4, moe_tp=1, moe_ep=4, sp=2, cp=2, master_port=free_port())


def d_parallel() -> ParallelConfig:
    """dp 2 x tp 1 on 2 ranks, experts over moe_ep 2."""
    return ParallelConfig(world_size=2, dp=2, moe_tp=1, moe_ep=2, master_port=free_port())


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10, temperature=0.0),
            SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=5)]


def _requests(vocab: int, **kw) -> list[EngineRequest]:
    """Two prompts of 20-45 tokens (2-5 full blocks), each greedy and seeded."""
    ps = prompts(2, seed=21, lo=20, hi=45, vocab=vocab - 8)
    return [EngineRequest(f"{'gs'[j]}{i}", p, sp, **kw)
            for i, p in enumerate(ps) for j, sp in enumerate(_params())]


def _export(engine: LLMEngine, vocab: int) -> dict[str, bytes]:
    """P's part: each prompt prefilled, its full blocks' rows exported (one token out)."""
    rows: dict[str, bytes] = {}
    engine.kv_export_sink = lambda rid, n, data: rows.__setitem__(rid, data)
    reqs = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_tokens=1))
            for r in _requests(vocab, export_kv=True)]
    run_tokens(engine, reqs)
    return rows


def _split(data: bytes, bytes_per_block: int) -> tuple[bytes, ...]:
    return tuple(data[i:i + bytes_per_block] for i in range(0, len(data), bytes_per_block))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("pd-par") / "tiny", seed=5))


@pytest.mark.parametrize("checkpoint, k", [("demo", 0), ("demo", 1), ("tiny", 1)])
@on_demo
def test_p_cp2_sp2_and_d_dp2_serve_one_processs_tokens(checkpoint, k, request):
    path = str(DEMO) if checkpoint == "demo" else request.getfixturevalue("tiny_ckpt")
    cfg = dataclasses.replace(BASE, block_size=BS, num_speculative_tokens=k)
    one, _ = load_checkpoint(path)
    one = one.eval()
    vocab = one.config.vocab_size
    ref_engine = LLMEngine(one, cfg, eos_token_ids=set())
    want = run_tokens(ref_engine, _requests(vocab))
    want_rows = _export(LLMEngine(one, cfg, eos_token_ids=set()), vocab)
    p = LLMEngine(inspect_checkpoint(path), dataclasses.replace(cfg, parallel=p_parallel()),
                  eos_token_ids=set())
    try:
        rows = _export(p, vocab)
        bpb = p.runtime.kv_block_bytes
    finally:
        p.shutdown()
    # P's four ranks export one process's rows (two sp stripes gathered; float rounding).
    assert rows.keys() == want_rows.keys() and bpb == ref_engine.runtime.kv_block_bytes
    for rid, data in rows.items():
        got = torch.frombuffer(bytearray(data), dtype=torch.float32)
        ref = torch.frombuffer(bytearray(want_rows[rid]), dtype=torch.float32)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    d = LLMEngine(inspect_checkpoint(path), dataclasses.replace(cfg, parallel=d_parallel()),
                  eos_token_ids=set())
    try:
        reqs = [dataclasses.replace(r, remote_kv=_split(rows[r.request_id], bpb))
                for r in _requests(vocab)]
        got = run_tokens(d, reqs)
        stats = d.stats()
    finally:
        d.shutdown()
    assert got == want
    full_blocks = sum((len(r.prompt_token_ids) - 1) // BS for r in reqs)
    assert stats.remote_cache_hits == full_blocks * BS > 0


# -- ranks, no engine: StripedRows and the block-to-rank mapping ----------------------------
P_PAR = ParallelConfig(world_size=4, moe_tp=1, moe_ep=4, sp=2, cp=2)   # stripes 0 1 0 1
D_PAR = ParallelConfig(world_size=4, dp=2, moe_tp=1, moe_ep=4)         # stripes 0 0 1 1


def test_each_rank_knows_its_stripe_and_one_rank_reads_each():
    from server.engine.kv.transfer.striped import StripePlace
    assert [StripePlace.of(P_PAR, r) for r in range(4)] == [
        StripePlace(0, 2, True), StripePlace(1, 2, True),
        StripePlace(0, 2, False), StripePlace(1, 2, False)]
    assert [StripePlace.of(D_PAR, r) for r in range(4)] == [
        StripePlace(0, 2, True), StripePlace(0, 2, False),
        StripePlace(1, 2, True), StripePlace(1, 2, False)]


def _row(block: int, dim: int) -> torch.Tensor:
    """Block ``block``'s content in every test cache: [BS, dim] float32, unique per block."""
    return torch.arange(BS * dim, dtype=torch.float32).view(BS, dim) + 1000.0 * (block + 1)


def _rank_rows(rank: int, port: int, out: str, broken: bool) -> None:
    """One of 4 ranks: P's pool (sp 2 over cp 2 copies) filled with each global block's
    content, rows gathered; D's pool (dp 2 of tp 2) written from rows, read back.
    ``broken``: each rank uses the other layout's block-to-rank mapping."""
    import torch.distributed as dist

    from server.engine.kv.transfer.striped import StripedRows, StripePlace
    from server.model.layers.latent_cache import LatentCache
    from server.model.parallel.sequence import StripedLatentCache, StripeIndex
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    dim, local = 3, 5                                 # 5 local blocks + the sink: 10 global
    result = {}
    for name, par, other in (("p", P_PAR, D_PAR), ("d", D_PAR, P_PAR)):
        place = StripePlace.of(other if broken else par, rank)
        true = StripePlace.of(par, rank)
        data = torch.zeros(local + 1, BS, dim)
        if name == "p":
            for j in range(local):
                data[j] = _row(j * 2 + true.stripe, dim)
        caches = [StripedLatentCache(LatentCache(data), StripeIndex(true.stripe, 2, BS))]
        rows = StripedRows(caches, torch.device("cpu"), place)
        blocks = [4, 7, 2, 9]
        if name == "p":
            got = torch.frombuffer(bytearray(rows.gather(blocks)), dtype=torch.float32)
            result[name] = torch.equal(got, torch.cat([_row(b, dim).flatten() for b in blocks]))
        else:
            rows.scatter([(_row(b, dim).numpy().tobytes(), b) for b in blocks])
            mine = [b for b in blocks if b % 2 == true.stripe]
            result[name] = all(torch.equal(data[b // 2], _row(b, dim)) for b in mine) and \
                int((data.abs().sum((1, 2)) > 0).sum()) == len(mine)
    torch.save(result, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("broken", [False, True])
def test_rows_move_by_global_block_over_the_stripes_and_a_wrong_mapping_bites(tmp_path, broken):
    from tests.engine.helpers import run_rank_processes
    port, out = free_port(), str(tmp_path / "rows")
    codes = run_rank_processes(_rank_rows, lambda r: (r, port, out, broken), 4)
    assert codes == [0] * 4
    results = [torch.load(f"{out}.{r}") for r in range(4)]
    if not broken:
        assert results == [{"p": True, "d": True}] * 4
    else:            # P's export and D's writes are wrong (on rank 0: all ranks get P's rows)
        assert not results[0]["p"] and not all(r["d"] for r in results)


# -- daemons: the same layouts through the coordinator -------------------------------------
P_KEYS = {"worldSize": 4, "tp": 2, "sp": 2, "cp": 2, "moe_ep": 4}
D_KEYS = {"worldSize": 2, "dp": 2, "tp": 1, "moe_ep": 2}


def _daemon_answers(base: str) -> list[str]:
    """Few short requests: the long prompt greedy and seeded (its 3 full blocks move),
    a chat greedy."""
    import openai

    from server.testing.daemon import MODEL_NAME
    from tests.daemon.answers import LONG
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)
    out = [client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=12,
                                     temperature=t, seed=7).choices[0].text for t in (0, 0.9)]
    r = client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France?"}])
    return out + [r.choices[0].message.content]


# MTP k=1 only through daemons (the seed's rule with cp/sp); MTP off is checked at engine
# level above, through the same transfer code.
@pytest.mark.parametrize("k", [1])
@on_demo
def test_daemons_p_cp2_sp2_and_d_dp2_answer_like_one_process(tmp_path, k):
    from server.testing.daemon import Daemon, make_config, start_all
    from tests.daemon.answers import metric
    from tests.pd.test_pd import ENV, Coordinator, _pd_config, _plugins
    for sub in ("ref", "p", "d"):
        (tmp_path / sub).mkdir()
    p_cfg, d_cfg = (_pd_config(tmp_path / "p", "prefill", k=k),
                    _pd_config(tmp_path / "d", "decode", k=k))
    for cfg, keys in ((p_cfg, P_KEYS), (d_cfg, D_KEYS)):
        doc = json.loads(cfg.read_text())
        doc["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0].update(keys)
        doc["BackendConfig"]["npuDeviceIds"] = [list(range(keys["worldSize"]))]
        cfg.write_text(json.dumps(doc))
    ref_d, p, d = start_all(
        Daemon(make_config(tmp_path / "ref", DEMO, model={"plugin_params": _plugins(k)},
                           schedule={"cacheBlockSize": 16}), env=ENV),
        Daemon(p_cfg, env=ENV, new_session=True), Daemon(d_cfg, env=ENV, new_session=True))
    try:
        want = _daemon_answers(ref_d.base)
    finally:
        assert ref_d.terminate() == 0
    c = None
    try:
        assert (p.status()["runtime"]["parallel"]["cp"], d.status()["runtime"]["parallel"]["dp"]) == (2, 2)
        c = Coordinator(tmp_path, p, d)
        assert _daemon_answers(c.base) == want
        received = metric(d.metrics, "kv_transfer_bytes_total", 'direction="received"')
        assert received == metric(p.metrics, "kv_transfer_bytes_total", 'direction="sent"') > 0
        assert metric(d.metrics, "prefix_cache_hit_tokens_total", 'tier="remote"') > 0
        assert metric(d.metrics, "kv_transfer_failures_total") == 0
    finally:
        if c is not None:
            c.stop()
        p.kill()
        d.kill()
