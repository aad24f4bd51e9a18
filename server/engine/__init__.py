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
    await engine.shutdown(drain=True)

Module map (one concept each):
    protocol.py       messages + glossary (no torch)
    config.py         EngineConfig: the engine's slice of AppConfig
    sequence.py       per-request state, token counting (no torch)
    block_manager.py  block allocation, ref counts, prefix cache (no torch)
    kv_cache.py       pool tensors and their sizing
    scheduler.py      continuous batching, budgets, preemption, stops (no torch)
    sampler.py        logits processors, sampling, verification (pure functions)
    mtp.py            drafting with the MTP layer; SpecPolicy (k per step)
    runner.py         batch -> tensors -> model -> verify -> drafts; the step's host sync
    output.py         detokenization, stop strings, EngineOutput
    core.py           LLMEngine: step() = schedule, execute, update, emit
    engine.py         AsyncEngine: the engine thread and the async front
    stats.py          EngineStats counters for /metrics
"""
