"""The engine's fronts: what the serving layer holds to reach the engine core (core.py).

    client.py          EngineClient: the one interface both fronts give the API layer (no torch)
    async_engine.py    AsyncEngine: the core on a thread of this process; EngineLoop, the
                       inbox -> step -> deliver loop both fronts run
    engine_process.py  EngineProcess: the core in a process of its own (the daemon's default)
    streams.py         OutputStreams: one asyncio queue per open request (no torch)

The public names are re-exported by server.engine, loaded on first use (the API layer
imports client.py and streams.py without torch).
"""
