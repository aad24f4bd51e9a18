"""Shared factories for engine tests: tiny models (random and high-acceptance), engines, prompts."""
from __future__ import annotations

import functools
import tempfile

import torch

from server.engine.config import EngineConfig
from server.engine.core import LLMEngine
from server.engine.protocol import EngineOutput, EngineRequest, SamplingParams
from server.model.loading import load_checkpoint
from server.testing.daemon import free_port  # noqa: F401  (tests import it from here)
from server.testing.high_acceptance import make_high_acceptance
from server.testing.tiny_checkpoint import make_tiny_checkpoint

_TMP = tempfile.mkdtemp(prefix="engine-tests-")


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, with_mtp: bool = True):
    path = make_tiny_checkpoint(f"{_TMP}/tiny-{seed}-{int(with_mtp)}", seed=seed, with_mtp=with_mtp)
    model, _info = load_checkpoint(path)
    return model.eval()


@functools.lru_cache(maxsize=None)
def high_acceptance_model(alpha: float = 0.1, seed: int = 0):
    """A tiny model whose MTP layer nearly predicts what the main model will say next
    (see server.testing.high_acceptance.make_high_acceptance for the construction)."""
    path = make_tiny_checkpoint(f"{_TMP}/hi-{seed}", seed=seed)
    model, _info = load_checkpoint(path)
    return make_high_acceptance(model, alpha).eval()


def make_engine(model, k: int = 0, *, num_blocks: int = 512, block_size: int = 8,
                max_batch_size: int = 8, eos: set[int] | None = None, policy=None, blocks=None,
                **kw) -> LLMEngine:
    cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, num_speculative_tokens=k,
                       max_queue_delay_us=0, max_batch_size=max_batch_size, max_seq_len=512, **kw)
    return LLMEngine(model, cfg, eos_token_ids=set() if eos is None else eos, policy=policy,
                     blocks=blocks)


def prompts(n: int, *, seed: int = 0, lo: int = 3, hi: int = 40, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (L,), generator=g).tolist() for L in lens]


def requests(ps: list[list[int]], params: SamplingParams | list[SamplingParams],
             prefix: str = "r") -> list[EngineRequest]:
    if isinstance(params, SamplingParams):
        params = [params] * len(ps)
    return [EngineRequest(f"{prefix}{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def run_tokens(engine: LLMEngine, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    return {rid: tokens_of(v) for rid, v in engine.generate(reqs).items()}


def run_staggered(engine: LLMEngine, reqs: list[EngineRequest], every: int = 3) -> dict[str, list[int]]:
    """Add a request every ``every`` steps so prefills land between running decodes."""
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    pending = list(reqs)
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            outs[o.request_id].extend(o.token_ids)
        step += 1
    return outs


def run_rank_processes(target, args_of_rank, world: int, timeout: float = 60.0) -> list[int | None]:
    """``world`` processes (the fork server's start) running ``target(*args_of_rank(r))``:
    their exit codes once all ended or ``timeout`` passed (stragglers are killed)."""
    from server.engine.child import child_context
    ctx = child_context()
    procs = [ctx.Process(target=target, args=args_of_rank(r)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


def force_kernel_setting(monkeypatch, variable: str, value: str) -> None:
    """This process's kernel settings (server/config/kernel_env.py) as if ``variable`` held
    ``value``, for the test (monkeypatch undoes it)."""
    from server.config import kernel_env
    from server.model.kernels import settings
    chosen = kernel_env.parse({variable: value})
    monkeypatch.setattr(settings, "kernel_settings", lambda: chosen)
