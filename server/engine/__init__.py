"""The serving engine: scheduler, paged KV pool, MTP drafting and verification, sampler.

Public API (docs/interfaces.md), re-exported here and loaded on first use:

    from server.engine import (AsyncEngine, LLMEngine, EngineError, EngineConfig,
                               engine_config_from_app, EngineStats, RuntimeInfo, EngineClient,
                               EngineRequest, EngineOutput, SamplingParams, FinishReason)

    engine = AsyncEngine.from_config(app_config, model=None | model | (model, info),
                                     tokenizer=None, engine_config=None, device=None)
    await engine.start()
    async for out in engine.submit(req): ...      # last output has finished=True
    engine.abort(request_id)                      # KV freed at the next step boundary
    engine.stats() -> EngineStats                 # snapshot taken after the latest step
    engine.runtime -> RuntimeInfo                 # effective k, async scheduling, KV blocks, EOS
    await engine.shutdown(drain=True)

Module map (the folders name the parts; engine side first, then what crosses to the
worker, then the worker side):

    protocol.py        API messages + the spec-decode glossary (no torch)
    config.py          EngineConfig (the engine's slice of AppConfig), EngineError
    runtime.py         RuntimeInfo: what the engine really runs with (no torch)
    stats.py           EngineStats counters for /metrics, StatsRecorder
    sequence.py        the scheduler's per-request state, token counting (no torch)
    token_view.py      token-list views shared by Sequence and RequestState (no torch)
    stop_rules.py      token-level stops, applied by the scheduler and the worker (no torch)
    scheduler.py       continuous batching, budgets, preemption, placeholders (no torch)
    output.py          OutputProcessor: detokenization, stop strings, EngineOutput
    core.py            LLMEngine: step() = schedule, execute, update, emit
    child.py           what every child process of the engine does first
    messages.py        SchedulerOutput / ModelRunnerOutput / WorkerInfo (plain, picklable; no torch)

    front/             the engine's fronts: what the API layer holds
      client.py          EngineClient: the interface both fronts give the API layer (no torch)
      async_engine.py    AsyncEngine: the engine thread and the async front; EngineLoop
      engine_process.py  EngineProcess: the engine in a process of its own (the daemon's default)
      streams.py         OutputStreams: one asyncio queue per open request (no torch)
    kv/                the KV pool and where blocks go besides it (a block's key, size and
                       file: server/kvblock)
      block_manager.py   block allocation, ref counts, MTP-aware prefix cache (no torch)
      dp_blocks.py       one block pool per attention data parallel group (no torch)
      host_tier.py       host tier bookkeeping: hash -> slot, swap slots (no torch)
      peer_blocks.py     blocks derived from a PD peer's rows, purged on a role change (no torch)
      disk_tier.py       disk tier: verified reads, write plans (no torch)
      tiers.py           the tiers built for one engine (disk fingerprint) and their figures
      cache.py           pool tensors and their sizing
      transfer/          the worker's block copies
        kv_transfer.py     KVTransfer: the worker's one door for tier copies and PD rows
        host_pool.py       the host tier's memory and its copies
        block_rows.py      whole blocks as byte rows (device side of every copy)
        striped.py         rows by global block id over a striped pool
    batch/             a step's batch on the worker side (what worker/ builds and spec/ reads)
      request_state.py   RequestState: the worker's per-request state (no torch)
      metadata.py        BatchMetadata from per-sequence host lists
      window.py          StepWindow: one step's main-forward inputs and their form
    spec/              MTP speculative decoding
      proposer.py        MTPProposer: held drafts, draft passes; NoProposer
      policy.py          SpecPolicy: FixedK, AdaptiveK (no torch)
      verifier.py        verification (pure functions over tensors; greedy on host lists)
      prediction.py      Predicted Outputs: a request's prediction as drafts in front of MTP
    sample/            sampling and structured-output masks
      sampler.py         logits processors, sampling, counter-based randomness
      grammar.py         llguidance matchers, GrammarBook (no torch)
      grammar_masks.py   grammar masks for verified rows and first drafts
    executor/          how the engine reaches its worker(s)
      base.py            Executor protocol, make_executor, check_layout
      in_process.py      InProcessExecutor: the worker inline or on a worker thread
      process.py         ProcessExecutor: the worker in its own process; serve_steps
      parallel.py        ParallelExecutor: a tensor/expert-parallel rank group
    worker/            device state and one step on it
      worker.py          Worker: owns model, KV tensors, request states, the proposer
      runner.py          request states -> tensors -> model -> verify; the step's host sync
      step_graphs.py     which graphs the static step runs; compiling them in the background
      compile_step.py    compiling the static decode step (torch.compile, on-disk cache);
                         a compile child runs it (run_child)
      compile_child.py   a compile child described and started; the model it rebuilds empty
      rank_group.py      a rank group: rendezvous, step broadcast, agreement, faults
"""
from __future__ import annotations

import importlib
from typing import Any

# The public names, loaded on first use: ``import server.engine.protocol`` (the serving
# process does) must not import torch through this package.
_PUBLIC = {
    "AsyncEngine": "server.engine.front.async_engine", "LLMEngine": "server.engine.core",
    "EngineClient": "server.engine.front.client", "EngineConfig": "server.engine.config",
    "EngineError": "server.engine.config", "engine_config_from_app": "server.engine.config",
    "EngineStats": "server.engine.stats", "RuntimeInfo": "server.engine.runtime",
    "EngineRequest": "server.engine.protocol", "EngineOutput": "server.engine.protocol",
    "SamplingParams": "server.engine.protocol", "FinishReason": "server.engine.protocol",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'server.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
