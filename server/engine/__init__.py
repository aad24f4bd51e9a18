"""The serving engine: scheduler, paged KV pool, MTP drafting and verification, sampler.

Public API (docs/interfaces.md, server.engine):

    from server.engine.engine import AsyncEngine, LLMEngine, EngineError
    from server.engine.config import EngineConfig, engine_config_from_app
    from server.engine.stats import EngineStats
    from server.engine.protocol import EngineRequest, EngineOutput, SamplingParams, FinishReason

    engine = AsyncEngine.from_config(app_config, model=None | model | (model, info),
                                     tokenizer=None, engine_config=None, device=None)
    await engine.start()
    async for out in engine.submit(req): ...      # last output has finished=True
    engine.abort(request_id)                      # KV freed at the next step boundary
    engine.stats() -> EngineStats                 # snapshot taken after the latest step
    engine.runtime -> RuntimeInfo                 # effective k, async scheduling, KV blocks, EOS
    await engine.shutdown(drain=True)

Module map (one concept each; engine side, then the step messages, then the worker side):
    protocol.py       API messages + glossary (no torch)
    config.py         EngineConfig: the engine's slice of AppConfig
    runtime.py        RuntimeInfo: what the engine really runs with (no torch)
    sequence.py       the scheduler's per-request state, token counting (no torch)
    kv/block_manager.py  block allocation, ref counts, prefix cache (no torch)
    scheduler.py      continuous batching, budgets, preemption, placeholders (no torch)
    output.py         OutputProcessor: detokenization, stop strings, EngineOutput
    stats.py          EngineStats counters for /metrics, StatsRecorder
    core.py           LLMEngine: step() = schedule, execute, update, emit
    engine.py         AsyncEngine: the engine thread and the async front; EngineLoop
    engine_process.py EngineProcess: the engine in a process of its own (the daemon's default)
    streams.py        OutputStreams: one asyncio queue per open request (no torch)
    messages.py       SchedulerOutput / ModelRunnerOutput (plain, picklable; no torch)
    executor/in_process.py       InProcessExecutor: the worker inline or on a worker thread (async)
    worker/worker.py         Worker: owns model, KV tensors, request states, the MTP proposer
    worker/request_state.py  the worker's per-request state (no torch)
    worker/runner.py         request states -> tensors -> model -> verify; the step's host sync
    spec/proposer.py            MTPProposer: held drafts, draft passes, k per step; NoProposer
    spec/policy.py    SpecPolicy: FixedK, AdaptiveK (no torch)
    sample/sampler.py        logits processors, sampling, verification (pure functions)
    worker/metadata.py       BatchMetadata from per-sequence host lists
    kv/cache.py       pool tensors and their sizing
"""
