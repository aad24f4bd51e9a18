"""PD at the engine level: a prefill engine exports the prompt blocks' rows, a decode
engine starts from them and must produce exactly a co-located engine's tokens (greedy and
seeded, MTP off / k=1 / k=2, with and without the prefix cache on D, synchronous and with
asynchronous scheduling in a worker process); both pools end where they started."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineRequest, SamplingParams
from server.model.loading import load_checkpoint
from tests.engine.helpers import prompts, run_tokens

pytestmark = pytest.mark.demo
DEMO = Path(__file__).resolve().parents[2] / "models" / "deepseek-v3-tiny-mtp"


@pytest.fixture(scope="module")
def demo():
    model, _ = load_checkpoint(DEMO)
    return model.eval()


def _requests() -> list[EngineRequest]:
    ps = prompts(4, seed=3, lo=10, hi=70, vocab=2000)
    sp = [SamplingParams(max_tokens=20, temperature=0.0),
          SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=5)]
    return [EngineRequest(f"r{i}-{j}", p, s) for i, p in enumerate(ps) for j, s in enumerate(sp)]


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("d_side", ["plain", "prefix-cache", "async"])
def test_decode_from_exported_rows_equals_colocated(demo, k, d_side):
    base = EngineConfig(block_size=8, num_blocks=256, num_speculative_tokens=k, max_queue_delay_us=0,
                        max_batch_size=8, max_seq_len=512, adaptive_speculation=False)
    reqs = _requests()
    ref = run_tokens(LLMEngine(demo, base, eos_token_ids=set()), reqs)
    prefill = LLMEngine(demo, dataclasses.replace(base, enable_prefix_cache=True), eos_token_ids=set())
    rows = {}
    prefill.kv_export_sink = lambda rid, n, payload: rows.__setitem__(rid, (n, payload))
    run_tokens(prefill, [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_tokens=1),
                                             export_kv=True) for r in reqs])
    assert set(rows) == {r.request_id for r in reqs}
    d_cfg = dataclasses.replace(base, enable_prefix_cache=d_side == "prefix-cache",
                                async_scheduling=d_side == "async")
    decode = LLMEngine(demo, d_cfg, eos_token_ids=set())
    size = decode.runtime.kv_block_bytes
    try:
        dreqs = []
        for r in reqs:
            n, payload = rows[r.request_id]
            assert len(payload) == n * size and n == (len(r.prompt_token_ids) - 1) // 8
            dreqs.append(dataclasses.replace(r, remote_kv=tuple(
                payload[i * size:(i + 1) * size] for i in range(n))))
        assert run_tokens(decode, dreqs) == ref
        # Every full prompt block came from P, or (prefix cache on D) from D's own pool:
        # the second request of each prompt finds the first one's blocks there.
        b = decode.blocks
        assert b.num_remote_hits + b.num_prefix_hits == sum(n for n, _ in rows.values()) * 8
        assert b.num_remote_hits > 0 and (b.num_prefix_hits > 0) == (d_side == "prefix-cache")
        assert decode.blocks.num_free_blocks == 256
    finally:
        decode.shutdown()
    assert prefill.blocks.num_used_blocks == 0
